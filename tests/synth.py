"""Tiny synthetic GGUF models written with the `gguf` package (llama.cpp's own writer), with a
small byte-level BPE vocabulary so the whole Engine (tokenizer included) can load them."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize


def byte_chars() -> list[str]:
    """GPT-2's printable character for each byte value (written here, not imported from the
    engine, so the tests' reference tokenizer stays independent of it)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """<|endoftext|>, <|im_start|>, <|im_end|>, the 256 byte tokens, and a few merged tokens."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = byte_chars()
    sp = chars[ord(" ")]
    merges = [f"{sp} t", "h e", f"{sp}t he", "i n", "a n"]
    merged = [f"{sp}t", "he", f"{sp}the", "in", "an"]
    tokens = specials + chars + merged
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


def add_tiny_tokenizer(
    w: GGUFWriter, extra_tokens: tuple[str, ...] = (), chat_template: str | None = None
) -> None:
    """The `tiny_vocab` tokenizer keys: gpt2 BPE (GPT-2 pre-tokenizer), BOS 0, EOS 2 (<|im_end|>), no BOS added;
    `extra_tokens` appended as control tokens, and a chat template if given."""
    tokens, types, merges = tiny_vocab()
    tokens, types = tokens + list(extra_tokens), types + [3] * len(extra_tokens)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the name llama.cpp knows GPT-2's pre-tokenizer by
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


# Byte offsets of the f16 scale fields in each k-quant family block (ggml's block layouts).
F16_FIELDS = {
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}


# MXFP4 (gpt-oss's experts): a one-byte power-of-two scale first
RANDOM_BLOCK_TYPES = (*F16_FIELDS, Q.MXFP4)

# Tensors of more values than this only benchmarks write (tests' models are tiny): their random
# blocks are drawn without the floats other types draw, and scaled from the decoded deviation
# of their first blocks, since drawing and decoding every value took minutes of a benchmark's
# set-up (a Qwen3-30B-A3B-shape layer's experts: 600M values).
BIG_TENSOR = 1 << 22


def random_blocks(dtype: Q, rows: int, cols: int, scale: float, rng) -> np.ndarray:
    """(rows, row bytes) of valid `dtype` blocks with random integer fields and random-signed
    f16 scales (MXFP4: random exponents), sized so that the decoded weights have standard
    deviation about `scale`. The `gguf` package decodes these formats but cannot encode most of
    them; any valid encoding serves tests that compare against its decoding."""
    from gguf.constants import GGML_QUANT_SIZES

    block_len, block_bytes = GGML_QUANT_SIZES[dtype]
    n_blocks = rows * cols // block_len
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    if dtype == Q.MXFP4:
        # the doubled E2M1 values have standard deviation ~5.3 at exponent 128 (scale 1/2);
        # exponents spread over four powers of two around the one that gives `scale`
        centre = 128 + int(np.round(np.log2(scale / 5.3)))
        raw[:, 0] = rng.integers(centre - 2, centre + 2, n_blocks)
        return raw.reshape(rows, -1)

    def set_scales(unit):
        for off in F16_FIELDS[dtype]:
            v = (rng.uniform(0.5, 1.0, n_blocks) * rng.choice([-1.0, 1.0], n_blocks) * unit).astype(
                np.float16
            )
            raw[:, off : off + 2] = v.view(np.uint8).reshape(n_blocks, 2)

    state = rng.bit_generator.state
    set_scales(1.0)
    n_std = n_blocks if n_blocks * block_len <= BIG_TENSOR else BIG_TENSOR // block_len
    std = float(dequantize(raw[:n_std], dtype).std())
    rng.bit_generator.state = state  # the same signs and magnitudes, rescaled
    set_scales(scale / std)
    return raw.reshape(rows, -1)


# What each architecture's files carry beyond the LLaMA layer, as llama.cpp's converter writes
# them: q/k norms (qwen3, gemma3), post-block norms (gemma2/3), fused qkv and gate_up (phi3).
ARCH_FEATURES = {
    "qwen3": {"qk_norm"},
    "qwen3moe": {"qk_norm"},
    "olmoe": {"qk_norm_whole"},
    "gemma": set(),
    "gemma2": {"post_norms"},
    "gemma3": {"qk_norm", "post_norms"},
    "phi3": {"fused"},
    # attention biases and sinks, the FFN norm named post_attention_norm, biased experts
    "gpt-oss": {"gpt_oss"},
}


def write_model(
    path,
    arch: str = "llama",
    n_embd: int = 64,
    n_layer: int = 2,
    n_ff: int = 96,
    n_head: int = 4,
    n_head_kv: int = 2,
    dtype: Q = Q.F32,
    activation: str | None = None,
    tied: bool = False,
    bias: bool = False,
    rope_base: float = 10000.0,
    n_ctx: int = 256,
    seed: int = 0,
    skip: tuple[str, ...] = (),
    weight_scale: float = 1.0,
    magic: bytes | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    rope_scaling: float | None = None,
    rope_freqs: bool = False,
    yarn_original_ctx: int | None = None,
    longrope_original_ctx: int | None = None,
    extra_meta: dict | None = None,
    experts: dict | None = None,
    extra_tokens: tuple[str, ...] = (),
    chat_template: str | None = None,
) -> str:
    """A random model of `arch` (features per ARCH_FEATURES). `head_dim` writes
    attention.key_length/value_length (q_dim may then differ from n_embd); `sliding_window`
    the window of gemma2/3's sliding layers; `rope_scaling` a linear rope.scaling.factor, or
    YaRN's with `yarn_original_ctx` (its original_context_length); `rope_freqs` Llama 3's
    per-frequency factors; `longrope_original_ctx` Phi-3's LongRoPE (short and long factors,
    the original context and an attention factor, as the Phi-3 128k converter writes them);
    `extra_meta` more keys (str, int or float values, "{arch}." prefixed), replacing those of the
    same name; `extra_tokens` control tokens after the tiny vocabulary, and `chat_template` the
    file's template.

    `experts` makes every FFN a mixture of experts as llama.cpp's converter writes one:
    dict(n_expert, n_used, n_ff_exp, n_ff_shared=0, ff_key=True): the router
    `ffn_gate_inp` (F32, as llama.cpp's quantizer leaves it), the 3-D `ffn_{gate,up,down}_exps`
    (n_expert, rows, cols) in `dtype`, `expert_count` and `expert_used_count`, the experts'
    width as `expert_feed_forward_length` where `ff_key` (Qwen's files; Mixtral and OLMoE
    files give it as `feed_forward_length`), and with `n_ff_shared` Qwen2-MoE's shared expert
    (`ffn_{gate,up,down}_shexp`, `ffn_gate_inp_shexp`, `expert_shared_feed_forward_length`);
    SmallThinker's files also say their router's `gating` ("softmax" or "sigmoid"; an int is
    written as it is, None leaves the key out). `dtype` (a type) stores the expert tensors in
    it instead (gpt-oss's files: MXFP4 experts, the rest Q8_0 or F32). gpt-oss's layers carry
    attention biases and sinks, the FFN norm as `post_attention_norm`, and biases on the router
    and every expert (`ffn_{gate_inp,gate_exps,up_exps,down_exps}.bias`).
    `skew` (a float) makes the routing favour a few experts per layer (see below), as trained
    routers do and random ones do not."""
    rng = np.random.default_rng(seed)
    n_vocab = len(tiny_vocab()[0]) + len(extra_tokens)
    hd = head_dim or n_embd // n_head
    features = ARCH_FEATURES.get(arch, set())

    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(hd)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    if rope_scaling is not None:
        w.add_rope_scaling_type(
            RopeScalingType.LINEAR if yarn_original_ctx is None else RopeScalingType.YARN
        )
        w.add_rope_scaling_factor(rope_scaling)
    if yarn_original_ctx is not None:
        w.add_rope_scaling_orig_ctx_len(yarn_original_ctx)
    if longrope_original_ctx is not None:
        w.add_rope_scaling_orig_ctx_len(longrope_original_ctx)
        w.add_rope_scaling_attn_factors(1.19)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if activation is not None:
        w.add_string(f"{arch}.ffn_activation", activation)
    if experts is not None:
        w.add_expert_count(experts["n_expert"])
        w.add_expert_used_count(experts["n_used"])
        if experts.get("ff_key", True):
            w.add_expert_feed_forward_length(experts["n_ff_exp"])
        if experts.get("n_ff_shared"):
            w.add_expert_shared_feed_forward_length(experts["n_ff_shared"])
        gating = experts.get("gating", "softmax")
        if arch == "smallthinker" and gating is not None:
            # as its converter writes it: softmax (1) or sigmoid (2); an int as it is
            gating = {"softmax": 1, "sigmoid": 2}.get(gating, gating)
            w.add_uint32(f"{arch}.expert_gating_func", gating)
    add_tiny_tokenizer(w, extra_tokens, chat_template)

    def mat(name, rows, cols, scale, stack=None, t=None, shift=None):
        """A (rows, cols) matrix, or `stack` of them as one 3-D tensor, in `t` or `dtype`;
        `shift` is added to the random values (not for the random-block types)."""
        if name in skip:
            return
        t = dtype if t is None else t
        lead = () if stack is None else (stack,)
        big = (stack or 1) * rows * cols > BIG_TENSOR
        # (drawn for every type, the random-block ones too, so that each file's later tensors
        # stay what they were; not for big random-block tensors, see BIG_TENSOR)
        if not (big and t in RANDOM_BLOCK_TYPES):
            a = (rng.standard_normal((*lead, rows, cols)) * scale * weight_scale).astype(np.float32)
        if t in RANDOM_BLOCK_TYPES:
            assert shift is None, "random blocks take no shift"
            blocks = random_blocks(t, (stack or 1) * rows, cols, scale * weight_scale, rng)
            w.add_tensor(name, blocks.reshape(*lead, rows, -1), raw_dtype=t)
            return
        if shift is not None:
            a += shift
        if t == Q.F32:
            w.add_tensor(name, a)
        elif t == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quantize(a, t), raw_dtype=t)

    def vec(name, n, around=1.0, spread=0.1):
        if name in skip:
            return
        w.add_tensor(name, (around + spread * rng.standard_normal(n)).astype(np.float32))

    # skewed routing: every embedding shares a direction u, and each layer's router favours a
    # few experts along it (alpha falls from skew for its first expert to 0, in a random order
    # per layer), so that some experts are routed to far more often than others
    skew = (experts or {}).get("skew")
    u = np.sign(rng.standard_normal(n_embd)).astype(np.float32) if skew else None
    # Gemma scales the embeddings by sqrt(n_embd): keep the residual stream's size as elsewhere
    mat(
        "token_embd.weight",
        n_vocab,
        n_embd,
        1.0 / np.sqrt(n_embd) if arch.startswith("gemma") else 1.0,
        t=Q.F16 if skew else None,
        shift=u,
    )
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", (1.0 + 7.0 * rng.random(hd // 2)).astype(np.float32))
    if longrope_original_ctx is not None:
        long, short = (
            (1.0 + 30.0 * rng.random(hd // 2)).astype(np.float32),
            (1.0 + 0.5 * rng.random(hd // 2)).astype(np.float32),
        )
        for name, factors in [
            ("rope_factors_long.weight", long),
            ("rope_factors_short.weight", short),
        ]:
            if name not in skip:
                w.add_tensor(name, factors)
    for l in range(n_layer):
        p = f"blk.{l}."
        vec(p + "attn_norm.weight", n_embd)
        if "fused" in features:
            mat(p + "attn_qkv.weight", (n_head + 2 * n_head_kv) * hd, n_embd, 0.3)
        else:
            mat(p + "attn_q.weight", n_head * hd, n_embd, 0.3)
            mat(p + "attn_k.weight", n_head_kv * hd, n_embd, 0.3)
            mat(p + "attn_v.weight", n_head_kv * hd, n_embd, 0.3)
        if "qk_norm" in features:
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
        if "qk_norm_whole" in features:
            # OLMoE: q and k RMSNormed whole, not per head
            vec(p + "attn_q_norm.weight", n_head * hd)
            vec(p + "attn_k_norm.weight", n_head_kv * hd)
        if bias or "gpt_oss" in features:
            vec(p + "attn_q.bias", n_head * hd, 0.0, 0.2)
            vec(p + "attn_k.bias", n_head_kv * hd, 0.0, 0.2)
            vec(p + "attn_v.bias", n_head_kv * hd, 0.0, 0.2)
        mat(p + "attn_output.weight", n_embd, n_head * hd, 0.15)
        if "gpt_oss" in features:
            vec(p + "attn_output.bias", n_embd, 0.0, 0.2)
            # sink logits around the scores' size, some above and some below
            vec(p + "attn_sinks.weight", n_head, 0.0, 1.5)
        if "post_norms" in features:
            vec(p + "post_attention_norm.weight", n_embd)
        vec(
            p + ("post_attention_norm.weight" if "gpt_oss" in features else "ffn_norm.weight"),
            n_embd,
        )
        if experts is not None:
            n_expert, n_exp_ff = experts["n_expert"], experts["n_ff_exp"]
            favour = None
            if skew:
                alpha = skew * np.log(n_expert / np.arange(1, n_expert + 1)) / np.log(n_expert)
                favour = rng.permutation(alpha)[:, None].astype(np.float32) * u[None, :]
            # (SmallThinker's router reads the layer input, which grows layer by layer, and may
            # gate by sigmoids, which the others' logits of ~16 would saturate: a few at first)
            router_scale = 4.0 / np.sqrt(n_embd) if arch == "smallthinker" else 1.0
            mat(p + "ffn_gate_inp.weight", n_expert, n_embd, router_scale, t=Q.F32, shift=favour)
            t_exp = experts.get("dtype")
            mat(p + "ffn_gate_exps.weight", n_exp_ff, n_embd, 0.2, stack=n_expert, t=t_exp)
            mat(p + "ffn_up_exps.weight", n_exp_ff, n_embd, 0.2, stack=n_expert, t=t_exp)
            mat(p + "ffn_down_exps.weight", n_embd, n_exp_ff, 0.15, stack=n_expert, t=t_exp)
            if "gpt_oss" in features:
                vec(p + "ffn_gate_inp.bias", n_expert, 0.0, 0.5)
                for name, width in [("gate", n_exp_ff), ("up", n_exp_ff), ("down", n_embd)]:
                    b = (0.3 * rng.standard_normal((n_expert, width))).astype(np.float32)
                    if p + f"ffn_{name}_exps.bias" not in skip:
                        w.add_tensor(p + f"ffn_{name}_exps.bias", b)
            n_sh = experts.get("n_ff_shared", 0)
            if n_sh:
                vec(p + "ffn_gate_inp_shexp.weight", n_embd, 0.0, 0.3)
                mat(p + "ffn_gate_shexp.weight", n_sh, n_embd, 0.2)
                mat(p + "ffn_up_shexp.weight", n_sh, n_embd, 0.2)
                mat(p + "ffn_down_shexp.weight", n_embd, n_sh, 0.15)
        elif "fused" in features:
            mat(p + "ffn_up.weight", 2 * n_ff, n_embd, 0.2)
        else:
            mat(p + "ffn_gate.weight", n_ff, n_embd, 0.2)
            mat(p + "ffn_up.weight", n_ff, n_embd, 0.2)
        if experts is None:
            mat(p + "ffn_down.weight", n_embd, n_ff, 0.15)
        if "post_norms" in features:
            vec(p + "post_ffw_norm.weight", n_embd)
    vec("output_norm.weight", n_embd)
    if not tied:
        mat("output.weight", n_vocab, n_embd, 0.3)

    for key, value in (extra_meta or {}).items():
        # (later values replace earlier ones of the same key)
        add = {str: w.add_string, int: w.add_uint32}.get(type(value), w.add_float32)
        add(f"{arch}.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if magic is not None:
        with open(path, "r+b") as f:
            f.write(magic)
    return str(path)


def _stored(a: np.ndarray, dtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or array to write, float64 values the file will hold)."""
    if dtype == Q.F32:
        return a, a.astype(np.float64)
    if dtype == Q.F16:
        h = a.astype(np.float16)
        return h, h.astype(np.float64)
    q = quantize(a, dtype)
    return q, dequantize(q, dtype).astype(np.float64).reshape(a.shape)


def write_powerinfer_model(
    path,
    arch: str = "llama",
    n_embd: int = 64,
    n_layer: int = 2,
    n_ff: int = 96,
    n_head: int = 4,
    n_head_kv: int | None = None,
    dtype: Q = Q.F16,
    predictor: str | None = "exact",
    predictor_dtype: Q = Q.F16,
    threshold: float | None = -0.1,
    attn_norm_2: bool = False,
    ffn_bias: bool = False,
    n_ctx: int = 256,
    seed: int = 0,
    skip: tuple[str, ...] = (),
    fc2_rows: int | None = None,
    down_bias: bool = False,
    magic: bytes = b"PWRI",
) -> str:
    """A tiny model in PowerInfer's layout (what its converter writes): `PWRI` magic,
    `blk.N.ffn_down_t.weight` (n_ff rows, one per neuron) instead of `ffn_down`, and predictors
    `blk.N.fc1.weight` (H, n_embd) / `blk.N.fc2.weight` (n_ff, H), F16.

    Architectures: llama (ReGLU), bamboo (dReLU), falcon (fused QKV, parallel block, optional
    attn_norm_2, no gate), opt (LayerNorm and biases, learned positions, tied output, no gate).

    predictor="exact" builds a predictor whose logit for neuron j is exactly the sign-deciding
    part of the neuron's pre-activation, written as a function of the predictor's input x: the
    norm before the FFN only rescales (RMSNorm) or centres and rescales (LayerNorm without bias),
    so sign(row_j . norm(x)) = sign(v_j . x) with v_j = row_j * w (minus its mean for LayerNorm).
    With fc1 = [V; -V] and fc2 = [I, -I], fc2 @ relu(fc1 @ x) = V x. With a slightly negative
    threshold it selects every truly active neuron. "negated" flips the sign (it misses nearly
    every active neuron), "random" draws Gaussian weights (H = 64). `down_bias` gives any
    architecture an `ffn_down_t.bias` (OPT always has one)."""
    rng = np.random.default_rng(seed)
    n_vocab = len(tiny_vocab()[0])
    n_head_kv = n_head_kv or n_head
    hd = n_embd // n_head
    gateless = arch in ("falcon", "opt")
    layer_norm = arch in ("falcon", "opt")

    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if layer_norm:
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_dimension_count(hd)
    if threshold is not None:
        w.add_float32("powerinfer.sparse_threshold", threshold)
    add_tiny_tokenizer(w)

    def mat(name, rows, cols, scale, t=None):
        vals, stored = _stored(
            (rng.standard_normal((rows, cols)) * scale).astype(np.float32), t or dtype
        )
        if name not in skip:
            if (t or dtype) in (Q.F32, Q.F16):
                w.add_tensor(name, vals)
            else:
                w.add_tensor(name, vals, raw_dtype=t or dtype)
        return stored

    def vec(name, n, around=1.0, spread=0.1):
        v = (around + spread * rng.standard_normal(n)).astype(np.float32)
        if name not in skip:
            w.add_tensor(name, v)
        return v.astype(np.float64)

    def predictor_tensors(p, v):
        if predictor is None:
            return
        if predictor == "random":
            h = 64
            fc1 = rng.standard_normal((h, n_embd)) * 0.3
            fc2 = rng.standard_normal((n_ff, h)) * 0.3
        else:
            sign = -1.0 if predictor == "negated" else 1.0
            fc1 = np.concatenate([v, -v]) * sign
            fc2 = np.concatenate([np.eye(n_ff), -np.eye(n_ff)], axis=1)
        if fc2_rows is not None:
            fc2 = fc2[:fc2_rows]
        for name, a in ((p + "fc1.weight", fc1), (p + "fc2.weight", fc2)):
            if name in skip:
                continue
            vals, _ = _stored(a.astype(np.float32), predictor_dtype)
            if predictor_dtype in (Q.F32, Q.F16):
                w.add_tensor(name, vals)
            else:
                w.add_tensor(name, vals, raw_dtype=predictor_dtype)

    mat("token_embd.weight", n_vocab, n_embd, 1.0)
    if arch == "opt":
        mat("position_embd.weight", n_ctx + 2, n_embd, 0.5)
    for l in range(n_layer):
        p = f"blk.{l}."
        norm_w = vec(p + "attn_norm.weight", n_embd)
        if layer_norm:
            # the FFN of falcon reads attn_norm: its bias must be zero for the exact predictor
            vec(
                p + "attn_norm.bias",
                n_embd,
                0.0,
                0.0 if arch == "falcon" and predictor == "exact" else 0.1,
            )
        if attn_norm_2:
            vec(p + "attn_norm_2.weight", n_embd)
            vec(p + "attn_norm_2.bias", n_embd, 0.0, 0.1)
        if arch == "falcon":
            mat(p + "attn_qkv.weight", (n_head + 2 * n_head_kv) * hd, n_embd, 0.3)
        else:
            mat(p + "attn_q.weight", n_head * hd, n_embd, 0.3)
            mat(p + "attn_k.weight", n_head_kv * hd, n_embd, 0.3)
            mat(p + "attn_v.weight", n_head_kv * hd, n_embd, 0.3)
        if arch == "opt":
            vec(p + "attn_q.bias", n_head * hd, 0.0, 0.2)
            vec(p + "attn_k.bias", n_head_kv * hd, 0.0, 0.2)
            vec(p + "attn_v.bias", n_head_kv * hd, 0.0, 0.2)
        mat(p + "attn_output.weight", n_embd, n_head * hd, 0.15)
        if arch == "opt":
            vec(p + "attn_output.bias", n_embd, 0.0, 0.1)
        if arch != "falcon":
            norm_w = vec(p + "ffn_norm.weight", n_embd)
            if arch == "opt":
                vec(p + "ffn_norm.bias", n_embd, 0.0, 0.1 if ffn_bias else 0.0)
        if not gateless:
            rows = mat(p + "ffn_gate.weight", n_ff, n_embd, 0.2)
        up = mat(p + "ffn_up.weight", n_ff, n_embd, 0.2)
        if gateless:
            rows = up
        if arch == "opt":
            vec(p + "ffn_up.bias", n_ff, 0.0, 0.1 if ffn_bias else 0.0)
        mat(p + "ffn_down_t.weight", n_ff, n_embd, 0.15)
        if arch == "opt" or down_bias:
            vec(p + "ffn_down_t.bias", n_embd, 0.0, 0.1)
        v = rows * norm_w[None, :]
        if layer_norm:
            v = v - v.mean(axis=1, keepdims=True)
        predictor_tensors(p, v)
    vec("output_norm.weight", n_embd)
    if layer_norm:
        vec("output_norm.bias", n_embd, 0.0, 0.1)
    if arch != "opt":
        mat("output.weight", n_vocab, n_embd, 0.3)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "r+b") as f:
        f.write(magic)
    return str(path)
