"""Independent float64 numpy implementation of the LLaMA-family forward pass, written from the
GGUF/ggml definitions (RMSNorm, RoPE modes 0 and 2, GQA attention, gated FFNs). It shares no code
with the engine; weights are dequantized with the `gguf` package's own numpy dequantizers."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

# block formats whose matrix products take int8 activations (all but the float types)
FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
# the 256-weight formats: their products take activations rounded per 256 (ggml's q8_K pairing)
# instead of per 32
Q = GGMLQuantizationType
SUPERBLOCK_TYPES = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS}


def read_weights(path: str) -> tuple[dict, dict]:
    """All tensors as float64 arrays (row-major shapes) plus the metadata values; the set of
    quantized tensor names is in meta["_quantized"]."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PWRI":
        # the gguf package only reads the GGUF magic: read a copy that carries it
        import os
        import shutil
        import tempfile

        fd, tmp = tempfile.mkstemp(suffix=".gguf")
        os.close(fd)
        shutil.copyfile(path, tmp)
        with open(tmp, "r+b") as f:
            f.write(b"GGUF")
        try:
            w, meta = read_weights(tmp)
        finally:
            os.unlink(tmp)
        meta["_magic"] = magic
        return w, meta
    r = GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        try:
            meta[k] = f.contents()
        except Exception:
            pass
    w = {}
    with open(path, "rb") as f:
        meta["_magic"] = f.read(4)
    meta["_quantized"] = set()
    meta["_superblock"] = set()
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(t.data, dtype=np.float64).reshape(shape)
        else:
            arr = dequantize(np.asarray(t.data), qtype).astype(np.float64).reshape(shape)
        if qtype not in FLOAT_TYPES:
            meta["_quantized"].add(t.name)
        if qtype in per_256_types():
            meta["_superblock"].add(t.name)
        w[t.name] = arr
    return w, meta


def rmsnorm(x, g, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * g


def yarn(rope_dim, base, factor, original_ctx, beta_fast=32.0, beta_slow=1.0):
    """YaRN as Hugging Face's `_compute_yarn_parameters` defines it: per frequency i a mix of
    the interpolated (1 / factor) and the original inverse frequency, original below the
    correction range's low end, interpolated above its high end, a linear ramp between; and the
    magnitude 0.1 ln(factor) + 1 that multiplies cos and sin. Returns (inv_freq, magnitude)."""
    import math

    def correction_dim(rotations):
        return rope_dim * math.log(original_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    original = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    inv = original / factor * (1 - extrapolation) + original * extrapolation
    return inv, (0.1 * math.log(factor) + 1 if factor > 1 else 1.0)


def rope(
    x,
    positions,
    n_heads,
    head_dim,
    rope_dim,
    base,
    neox,
    freq_scale=1.0,
    factors=None,
    yarn_ctx=None,
    magnitude=1.0,
):
    """x: (n, n_heads * head_dim). ggml mode 0 rotates (2i, 2i+1); NeoX rotates (i, i + d/2).
    Angle i of position p: p * freq_scale * base^(-2i / rope_dim) / factors[i]; with `yarn_ctx`
    (the original context) YaRN's frequencies and magnitude for the factor 1 / freq_scale."""
    n = x.shape[0]
    x = x.reshape(n, n_heads, head_dim).copy()
    half = rope_dim // 2
    inv = freq_scale * base ** (-np.arange(half, dtype=np.float64) * 2 / rope_dim)
    if yarn_ctx is not None:
        inv, yarn_magnitude = yarn(rope_dim, base, 1 / freq_scale, yarn_ctx)
        magnitude *= yarn_magnitude
    if factors is not None:
        inv = inv / factors
    ang = positions[:, None].astype(np.float64) * inv[None, :]  # (n, half)
    c, s = magnitude * np.cos(ang)[:, None, :], magnitude * np.sin(ang)[:, None, :]
    if neox:
        a, b = x[..., :half].copy(), x[..., half:rope_dim].copy()
        x[..., :half] = a * c - b * s
        x[..., half:rope_dim] = a * s + b * c
    else:
        a, b = x[..., 0:rope_dim:2].copy(), x[..., 1:rope_dim:2].copy()
        x[..., 0:rope_dim:2] = a * c - b * s
        x[..., 1:rope_dim:2] = a * s + b * c
    return x.reshape(n, n_heads * head_dim)


def q8_round(x: np.ndarray) -> np.ndarray:
    """Rounds each row to int8 per block of 32 (scale = max|x| / 127), as integer dot products
    with quantized weights see their input."""
    b = x.reshape(x.shape[0], -1, 32)
    d = np.abs(b).max(axis=-1, keepdims=True) / 127
    q = np.where(d > 0, np.round(b / np.where(d > 0, d, 1)), 0)
    return (q * d).reshape(x.shape)


def q8k_round(x: np.ndarray) -> np.ndarray:
    """Rounds each row to int8 per block of 256 as ggml's q8_K does: the element of largest
    magnitude (the first such) maps to -127, the others to the nearest (ties to even) multiple
    of its scale, at most 127."""
    b = x.reshape(x.shape[0], -1, 256)
    first = np.abs(b).argmax(axis=-1)[..., None]
    peak = np.take_along_axis(b, first, axis=-1)
    iscale = np.where(peak != 0, -127 / np.where(peak != 0, peak, 1), 0)
    q = np.minimum(np.rint(b * iscale), 127)
    return np.where(iscale != 0, q / np.where(iscale != 0, iscale, 1), 0).reshape(x.shape)


def tie_distance(x: np.ndarray, per_256: bool) -> np.ndarray:
    """Per row of x, how near (in steps of its int8 scale) the value nearest to a rounding tie
    comes to it: where this is within f32 error, f32 and f64 may round it apart."""
    b = x.reshape(x.shape[0], -1, 256 if per_256 else 32)
    peak = np.abs(b).max(axis=-1, keepdims=True)
    r = b * 127 / np.where(peak > 0, peak, 1)
    return np.abs(np.abs(r - np.floor(r)) - 0.5).reshape(x.shape[0], -1).min(axis=1)


def per_256_types() -> set:
    """The types whose activations the engine rounds per 256: the super-block formats, at every
    SIMD level."""
    return SUPERBLOCK_TYPES


def layernorm(x, g, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + (b if b is not None else 0)


def forward(
    w: dict,
    meta: dict,
    tokens,
    activation: str | None = None,
    int8_activations: bool = False,
    n_ctx: int | None = None,
    routing_margin: np.ndarray | None = None,
    rounding_margin: np.ndarray | None = None,
    routes: list | None = None,
) -> np.ndarray:
    """Logits (len(tokens), n_vocab) in float64. With `int8_activations`, inputs of quantized
    weight matrices are rounded to int8 blocks first (what the engine's integer kernels do).

    Families: llama/mistral/qwen2/bamboo (RMSNorm, sequential), falcon (LayerNorm, fused QKV,
    attention and FFN in parallel on the normed layer input, attn_norm_2 for the attention when
    present, NeoX RoPE) and opt (LayerNorm with biases, learned positions offset by 2, no RoPE).
    A PowerInfer `ffn_down_t` (neuron-major) is used as down = down_t^T.

    Also, from the Gemma, Qwen 3, Phi-3 and Llama 3 definitions (Hugging Face's modeling code,
    read through llama.cpp's GGUF conventions): q/k RMSNorm per head (attn_q_norm), post-block
    norms (post_attention_norm, post_ffw_norm), embeddings times sqrt(n_embd) and GELU-gated FFNs
    (gemma*), attention and final soft-capping (gemma2), sliding-window layers (gemma2: even
    layers; gemma3: five of six, with RoPE base 10 000 and no scaling), fused qkv and gate_up
    rows (phi3), linear RoPE scaling and rope_freqs factors (llama).

    Mixture-of-experts layers (`ffn_gate_inp`), as llama.cpp's build_moe_ffn with softmax
    gating: Mixtral (llama), Qwen2-MoE (with its sigmoid-gated shared expert), Qwen3-MoE, OLMoE
    (q and k RMSNormed whole); and SmallThinker's (llama.cpp's graph): the router reads the
    layer input, softmax or sigmoid gating, ReGLU experts, and with a sliding window the first
    of every four layers attends fully, without RoPE; and gpt-oss's (llama.cpp's graph): attention
    biases and sinks (a logit per head in its softmax, with no value), even layers sliding,
    every layer's RoPE alike (YaRN included), the FFN norm named post_attention_norm, a biased
    router whose chosen logits' softmax weighs the experts, biased experts with the clamped
    SwiGLU (gate <= 7, |up| <= 7, slope 1.702, up + 1). `routing_margin` (len(tokens),), if given, receives each token's
    smallest gap over the layers between the router logits of its last chosen expert and the
    next one: where it is within rounding error, the engine may legitimately pick the other.
    `routes`, if given, receives (layer, experts chosen (n, n_used)) per mixture-of-experts
    layer. `rounding_margin` (1,), if given with a single token, receives how near the int8 rounding
    of its activations came to a tie (`tie_distance`), the smallest over every product."""
    arch = meta["general.architecture"]
    m = lambda k, d=None: meta.get(f"{arch}.{k}", d)
    n_embd, n_layer, n_head = m("embedding_length"), m("block_count"), m("attention.head_count")
    n_kv = m("attention.head_count_kv", n_head)
    hd = m("attention.key_length", n_embd // n_head)
    rope_dim = m("rope.dimension_count", hd)
    base = m("rope.freq_base", 10000.0)
    layer_norm = arch in ("falcon", "opt")
    eps = (
        m("attention.layer_norm_epsilon", 1e-5)
        if layer_norm
        else m("attention.layer_norm_rms_epsilon", 1e-5)
    )
    neox = arch in (
        "qwen2",
        "qwen3",
        "falcon",
        "gemma",
        "gemma2",
        "gemma3",
        "phi3",
        "qwen2moe",
        "qwen3moe",
        "olmoe",
        "smallthinker",
        "gpt-oss",
    )
    gemma = arch in ("gemma", "gemma2", "gemma3")
    freq_scale = (
        1.0 / m("rope.scaling.factor", 1.0) if m("rope.scaling.type") in ("linear", "yarn") else 1.0
    )
    yarn_ctx = (
        m("rope.scaling.original_context_length", m("context_length"))
        if m("rope.scaling.type") == "yarn"
        else None
    )
    factors = w.get("rope_freqs.weight")
    if factors is None and "rope_factors_long.weight" in w:
        # LongRoPE: the long factors where the context (`n_ctx`, else the tokens') exceeds the
        # original one, as Hugging Face's Phi-3 picks them by sequence length and llama.cpp by
        # context size
        original = m("rope.scaling.original_context_length", m("context_length"))
        factors = w[
            "rope_factors_long.weight"
            if (n_ctx or len(tokens)) > original
            else "rope_factors_short.weight"
        ]
    magnitude = m("rope.scaling.attn_factor", 1.0)
    window = (
        m("attention.sliding_window", 4096 if arch == "gemma2" else 0)
        if arch in ("gemma2", "gemma3", "gpt-oss")
        else 0
    )
    # gpt-oss (llama.cpp's graph): even layers slide, every layer turns q and k alike
    pattern = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}.get(arch, 0)
    gpt_oss = arch == "gpt-oss"
    smallthinker = arch == "smallthinker"
    if smallthinker and m("attention.sliding_window", 0) > 0:
        # SmallThinker (llama.cpp's graph): a window of 4096 whatever the file's value, over
        # all but the first of every `sliding_window_pattern` layers; those first layers have
        # no RoPE
        window, pattern = 4096, m("attention.sliding_window_pattern", 4)
    attn_cap = m("attn_logit_softcapping", 50.0) if arch == "gemma2" else 0.0
    final_cap = m("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0)

    def slides(l):
        if smallthinker:
            return window > 0 and l % pattern != 0
        return window > 0 and l % pattern < pattern - 1

    def ropes(l):
        return arch != "opt" and not (smallthinker and window > 0 and l % 4 == 0)

    powerinfer = meta.get("_magic") == b"PWRI"
    if activation is None:
        activation = m("ffn_activation")
    if activation is None:
        if arch in ("opt", "falcon"):
            activation = "relu" if (arch == "opt" or powerinfer) else "gelu"
        elif arch == "bamboo":
            activation = "drelu"
        elif arch == "llama" and powerinfer:
            activation = "relu"
        elif gemma:
            activation = "geglu"
        elif smallthinker:
            activation = "relu"
        elif gpt_oss:
            activation = "swiglu_oai"
        else:
            activation = "silu"
    gateless = arch in ("opt", "falcon")

    def mm(x, name, expert=None):
        """x @ W^T for the tensor `name` (its matrix `expert` of a 3-D expert tensor)."""
        if int8_activations and name in meta["_quantized"]:
            per_256 = name in meta["_superblock"]
            if rounding_margin is not None and len(x) == len(rounding_margin):
                np.minimum(rounding_margin, tie_distance(x, per_256), out=rounding_margin)
            x = q8k_round(x) if per_256 else q8_round(x)
        return x @ (w[name] if expert is None else w[name][expert]).T

    def norm(x, name):
        if layer_norm:
            return layernorm(x, w[name + ".weight"], w.get(name + ".bias"), eps)
        return rmsnorm(x, w[name + ".weight"], eps)

    tokens = np.asarray(tokens)
    n = len(tokens)
    pos = np.arange(n)
    x = w["token_embd.weight"][tokens]
    if gemma:
        x = x * np.sqrt(n_embd)
    if arch == "opt":
        x = x + w["position_embd.weight"][pos + 2]
    mask = np.triu(np.full((n, n), -np.inf), k=1)

    def head_norm(a, name, heads):
        # per head, or (OLMoE) over the whole of q or k: the weight's length says which
        width = len(w[name])
        return rmsnorm(a.reshape(n, heads * hd // width, width), w[name], eps).reshape(
            n, heads * hd
        )

    def attention(h, p, l):
        if p + "attn_qkv.weight" in w:
            qkv = mm(h, p + "attn_qkv.weight")
            q, k, v = (
                qkv[:, : n_head * hd],
                qkv[:, n_head * hd : (n_head + n_kv) * hd],
                qkv[:, (n_head + n_kv) * hd :],
            )
        else:
            q = mm(h, p + "attn_q.weight") + w.get(p + "attn_q.bias", 0)
            k = mm(h, p + "attn_k.weight") + w.get(p + "attn_k.bias", 0)
            v = mm(h, p + "attn_v.weight") + w.get(p + "attn_v.bias", 0)
        if p + "attn_q_norm.weight" in w:
            q = head_norm(q, p + "attn_q_norm.weight", n_head)
            k = head_norm(k, p + "attn_k_norm.weight", n_kv)
        if ropes(l):
            # gemma3's sliding layers: their own base, unscaled
            b, fs, yc, mag = (
                (10000.0, 1.0, None, 1.0)
                if arch == "gemma3" and slides(l)
                else (base, freq_scale, yarn_ctx, magnitude)
            )
            q = rope(q, pos, n_head, hd, rope_dim, b, neox, fs, factors, yc, mag)
            k = rope(k, pos, n_kv, hd, rope_dim, b, neox, fs, factors, yc, mag)
        q, k, v = q.reshape(n, n_head, hd), k.reshape(n, n_kv, hd), v.reshape(n, n_kv, hd)
        out = np.zeros((n, n_head, hd))
        layer_mask = mask
        if slides(l):
            # query i sees keys j with i - j < window
            layer_mask = np.where(pos[:, None] - pos[None, :] >= window, -np.inf, mask)
        for hh in range(n_head):
            g = hh // (n_head // n_kv)
            s = q[:, hh, :] @ k[:, g, :].T / np.sqrt(hd)
            if attn_cap:
                s = attn_cap * np.tanh(s / attn_cap)
            s = s + layer_mask
            # gpt-oss's sink: a logit in each row's softmax with no value
            sink = w[p + "attn_sinks.weight"][hh] if p + "attn_sinks.weight" in w else -np.inf
            top = np.maximum(s.max(axis=1, keepdims=True), sink)
            s = np.exp(s - top)
            s /= s.sum(axis=1, keepdims=True) + np.exp(sink - top)
            out[:, hh, :] = s @ v[:, g, :]
        return mm(out.reshape(n, n_head * hd), p + "attn_output.weight") + w.get(
            p + "attn_output.bias", 0
        )

    def gelu(a):
        return 0.5 * a * (1 + np.tanh(0.7978845608 * a * (1 + 0.044715 * a * a)))

    def gated(gate, up):
        if activation == "geglu":
            return gelu(gate) * up
        if activation in ("silu", "swiglu"):
            return gate / (1 + np.exp(-gate)) * up
        if activation in ("relu", "reglu"):
            return np.maximum(gate, 0) * up
        if activation == "swiglu_oai":
            # gpt-oss: the gate clamped above at 7, up into [-7, 7], slope 1.702, up + 1
            g = np.minimum(gate, 7.0)
            return g / (1 + np.exp(-1.702 * g)) * (np.clip(up, -7.0, 7.0) + 1)
        return np.maximum(gate, 0) * np.maximum(up, 0)

    def ffn(h, p, _=None):
        up = mm(h, p + "ffn_up.weight") + w.get(p + "ffn_up.bias", 0)
        if gateless:
            a = np.maximum(up, 0) if activation == "relu" else gelu(up)
        else:
            if p + "ffn_gate.weight" in w:
                gate = mm(h, p + "ffn_gate.weight")
            else:
                # phi3: ffn_up holds [gate; up]
                gate, up = up[:, : up.shape[1] // 2], up[:, up.shape[1] // 2 :]
            a = gated(gate, up)
        if p + "ffn_down_t.weight" in w:
            # the neuron-major product reads the activations in f32, never rounded to int8
            out = a @ w[p + "ffn_down_t.weight"] + w.get(p + "ffn_down_t.bias", 0)
        else:
            out = mm(a, p + "ffn_down.weight") + w.get(p + "ffn_down.bias", 0)
        return out

    n_used = m("expert_used_count")
    # llama.cpp's build_moe_ffn: Mixtral (llama), Qwen3-MoE and SmallThinker divide the chosen
    # experts' probabilities by their sum, Qwen2-MoE and OLMoE take them as they are
    normalize = arch in ("llama", "qwen3moe", "smallthinker")
    weights_scale = m("expert_weights_scale", 0.0) or 1.0
    # the probabilities: a softmax, or (SmallThinker's `expert_gating_func` 2) each sigmoid
    sigmoid_gating = smallthinker and m("expert_gating_func") == 2

    def silu(a):
        return a / (1 + np.exp(-a))

    def moe_ffn(h, p, layer_input):
        # SmallThinker's router reads the layer input, the others the FFN's normed input
        logits = mm(layer_input if smallthinker else h, p + "ffn_gate_inp.weight")
        logits = logits + w.get(p + "ffn_gate_inp.bias", 0)
        if gpt_oss:
            # ranked by the logits; weighted by a softmax over the chosen ones (below)
            probs = logits
        elif sigmoid_gating:
            probs = 1 / (1 + np.exp(-logits))
        else:
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
        out = np.zeros_like(h)
        if routes is not None:
            chosen = np.argsort(-probs, axis=1, kind="stable")[:, :n_used]
            routes.append((int(p.split(".")[1]), chosen))
        if routing_margin is not None and n_used < logits.shape[1]:
            # how near each token came to another choice: the gap between the router logits
            # of the last chosen expert and the next one, the smallest over the layers
            ranked = -np.sort(-logits, axis=1)
            gap = ranked[:, n_used - 1] - ranked[:, n_used]
            if sigmoid_gating:
                # sigmoids that round to the same float32 (near 1) are a tie there, however
                # far apart their logits
                p32 = (1 / (1 + np.exp(-ranked[:, n_used - 1 : n_used + 1]))).astype(np.float32)
                gap = np.where(p32[:, 0] == p32[:, 1], 0.0, gap)
            np.minimum(routing_margin, gap, out=routing_margin)
        for t in range(n):
            chosen = np.argsort(-probs[t], kind="stable")[:n_used]
            weights = probs[t, chosen]
            if gpt_oss:
                weights = np.exp(weights - weights.max())
                weights = weights / weights.sum()
            if normalize:
                weights = weights / weights.sum()
            for e, wt in zip(chosen, weights * weights_scale):
                x = h[t : t + 1]
                b = {
                    k: w[p + f"ffn_{k}_exps.bias"][e] if p + f"ffn_{k}_exps.bias" in w else 0
                    for k in ("gate", "up", "down")
                }
                gate = mm(x, p + "ffn_gate_exps.weight", e) + b["gate"]
                a = gated(gate, mm(x, p + "ffn_up_exps.weight", e) + b["up"])
                out[t] += wt * (mm(a, p + "ffn_down_exps.weight", e)[0] + b["down"])
        if p + "ffn_gate_inp_shexp.weight" in w:
            # Qwen2-MoE's shared expert, scaled by sigmoid(gate_inp . h)
            a = silu(mm(h, p + "ffn_gate_shexp.weight")) * mm(h, p + "ffn_up_shexp.weight")
            gate = 1 / (1 + np.exp(-(h @ w[p + "ffn_gate_inp_shexp.weight"])))
            out += gate[:, None] * mm(a, p + "ffn_down_shexp.weight")
        return out

    for l in range(n_layer):
        p = f"blk.{l}."
        ffn_of_layer = moe_ffn if p + "ffn_gate_inp.weight" in w else ffn
        if arch == "falcon":
            h = norm(x, p + "attn_norm")
            ha = norm(x, p + "attn_norm_2") if p + "attn_norm_2.weight" in w else h
            x = x + attention(ha, p, l) + ffn(h, p)
        else:
            layer_input = x
            a = attention(norm(x, p + "attn_norm"), p, l)
            # (gpt-oss's post_attention_norm is its FFN norm)
            if p + "post_attention_norm.weight" in w and not gpt_oss:
                a = norm(a, p + "post_attention_norm")
            x = x + a
            ffn_norm = p + ("post_attention_norm" if gpt_oss else "ffn_norm")
            f = ffn_of_layer(norm(x, ffn_norm), p, layer_input)
            if p + "post_ffw_norm.weight" in w:
                f = norm(f, p + "post_ffw_norm")
            x = x + f
    x = norm(x, "output_norm")
    logits = mm(x, "output.weight" if "output.weight" in w else "token_embd.weight")
    if final_cap:
        logits = final_cap * np.tanh(logits / final_cap)
    return logits
