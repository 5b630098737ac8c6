"""Tiny synthetic GGUF models written with the `gguf` package (llama.cpp's own writer), with a
small byte-level BPE vocabulary so the whole Engine (tokenizer included) can load them."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize


def byte_chars() -> list[str]:
    """GPT-2's printable character for each byte value (written here, not imported from the
    engine, so the tests' reference tokenizer stays independent of it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
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
) -> str:
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    n_vocab = len(tokens)
    hd = n_embd // n_head

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
    if activation is not None:
        w.add_string(f"{arch}.ffn_activation", activation)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def mat(name, rows, cols, scale):
        if name in skip:
            return
        a = (rng.standard_normal((rows, cols)) * scale * weight_scale).astype(np.float32)
        if dtype == Q.F32:
            w.add_tensor(name, a)
        elif dtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quantize(a, dtype), raw_dtype=dtype)

    def vec(name, n, around=1.0, spread=0.1):
        if name in skip:
            return
        w.add_tensor(name, (around + spread * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", n_vocab, n_embd, 1.0)
    for l in range(n_layer):
        p = f"blk.{l}."
        vec(p + "attn_norm.weight", n_embd)
        mat(p + "attn_q.weight", n_head * hd, n_embd, 0.3)
        mat(p + "attn_k.weight", n_head_kv * hd, n_embd, 0.3)
        mat(p + "attn_v.weight", n_head_kv * hd, n_embd, 0.3)
        if bias:
            vec(p + "attn_q.bias", n_head * hd, 0.0, 0.2)
            vec(p + "attn_k.bias", n_head_kv * hd, 0.0, 0.2)
            vec(p + "attn_v.bias", n_head_kv * hd, 0.0, 0.2)
        mat(p + "attn_output.weight", n_embd, n_head * hd, 0.15)
        vec(p + "ffn_norm.weight", n_embd)
        mat(p + "ffn_gate.weight", n_ff, n_embd, 0.2)
        mat(p + "ffn_up.weight", n_ff, n_embd, 0.2)
        mat(p + "ffn_down.weight", n_embd, n_ff, 0.15)
    vec("output_norm.weight", n_embd)
    if not tied:
        mat("output.weight", n_vocab, n_embd, 0.3)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if magic is not None:
        with open(path, "r+b") as f:
            f.write(magic)
    return str(path)
