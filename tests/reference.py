"""Independent float64 numpy implementation of the LLaMA-family forward pass, written from the
GGUF/ggml definitions (RMSNorm, RoPE modes 0 and 2, GQA attention, gated FFNs). It shares no code
with the engine; weights are dequantized with the `gguf` package's own numpy dequantizers."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize


QUANTIZED = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}


def read_weights(path: str) -> tuple[dict, dict]:
    """All tensors as float64 arrays (row-major shapes) plus the metadata values; the set of
    quantized tensor names is in meta["_quantized"]."""
    r = GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        try:
            meta[k] = f.contents()
        except Exception:
            pass
    w = {}
    meta["_quantized"] = set()
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(t.data, dtype=np.float64).reshape(shape)
        else:
            arr = dequantize(np.asarray(t.data), qtype).astype(np.float64).reshape(shape)
        if qtype in QUANTIZED:
            meta["_quantized"].add(t.name)
        w[t.name] = arr
    return w, meta


def rmsnorm(x, g, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * g


def rope(x, positions, n_heads, head_dim, rope_dim, base, neox):
    """x: (n, n_heads * head_dim). ggml mode 0 rotates (2i, 2i+1); NeoX rotates (i, i + d/2)."""
    n = x.shape[0]
    x = x.reshape(n, n_heads, head_dim).copy()
    half = rope_dim // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2 / rope_dim)
    ang = positions[:, None].astype(np.float64) * inv[None, :]  # (n, half)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
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


def forward(w: dict, meta: dict, tokens, activation: str | None = None, int8_activations: bool = False) -> np.ndarray:
    """Logits (len(tokens), n_vocab) in float64. With `int8_activations`, inputs of quantized
    weight matrices are rounded to int8 blocks first (what the engine's integer kernels do)."""
    arch = meta["general.architecture"]
    m = lambda k, d=None: meta.get(f"{arch}.{k}", d)
    n_embd, n_layer, n_head = m("embedding_length"), m("block_count"), m("attention.head_count")
    n_kv = m("attention.head_count_kv", n_head)
    hd = n_embd // n_head
    rope_dim = m("rope.dimension_count", hd)
    base = m("rope.freq_base", 10000.0)
    eps = m("attention.layer_norm_rms_epsilon", 1e-5)
    neox = arch == "qwen2"
    if activation is None:
        activation = m("ffn_activation") or ("drelu" if arch == "bamboo" else "silu")

    def mm(x, name):
        if int8_activations and name in meta["_quantized"]:
            x = q8_round(x)
        return x @ w[name].T

    tokens = np.asarray(tokens)
    n = len(tokens)
    pos = np.arange(n)
    x = w["token_embd.weight"][tokens]
    mask = np.triu(np.full((n, n), -np.inf), k=1)
    for l in range(n_layer):
        p = f"blk.{l}."
        h = rmsnorm(x, w[p + "attn_norm.weight"], eps)
        q = mm(h, p + "attn_q.weight") + w.get(p + "attn_q.bias", 0)
        k = mm(h, p + "attn_k.weight") + w.get(p + "attn_k.bias", 0)
        v = mm(h, p + "attn_v.weight") + w.get(p + "attn_v.bias", 0)
        q = rope(q, pos, n_head, hd, rope_dim, base, neox).reshape(n, n_head, hd)
        k = rope(k, pos, n_kv, hd, rope_dim, base, neox).reshape(n, n_kv, hd)
        v = v.reshape(n, n_kv, hd)
        out = np.zeros((n, n_head, hd))
        for hh in range(n_head):
            g = hh // (n_head // n_kv)
            s = q[:, hh, :] @ k[:, g, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            out[:, hh, :] = s @ v[:, g, :]
        x = x + mm(out.reshape(n, n_head * hd), p + "attn_output.weight")
        h = rmsnorm(x, w[p + "ffn_norm.weight"], eps)
        gate = mm(h, p + "ffn_gate.weight")
        up = mm(h, p + "ffn_up.weight")
        if activation in ("silu", "swiglu"):
            a = gate / (1 + np.exp(-gate)) * up
        elif activation in ("relu", "reglu"):
            a = np.maximum(gate, 0) * up
        else:
            a = np.maximum(gate, 0) * np.maximum(up, 0)
        x = x + mm(a, p + "ffn_down.weight")
    x = rmsnorm(x, w["output_norm.weight"], eps)
    return mm(x, "output.weight" if "output.weight" in w else "token_embd.weight")
