"""The engine's llama-family layer in PyTorch, for training (relufication): the same function as
`crates/core/src/forward.rs` for the architectures relufy accepts (llama, mistral, qwen2,
qwen3), with weights read from the GGUF through the engine's own `read_tensor` (every type the
engine reads, dequantized to float32) and kept under their GGUF names so that the trained model
is written back tensor for tensor.

What it covers, as configuration: RoPE on adjacent pairs (llama, mistral: GGUF stores q and k
permuted for it) or on halves (qwen2/3), partial RoPE dimensions, linear scaling and Llama 3's
`rope_freqs` factors; q/k/v biases (qwen2); per-head q/k RMSNorm before RoPE (qwen3); grouped
query attention; tied or separate output. The FFN's gate activation is the one training point:
SiLU, ReLU, or a blend of the two (and dReLU's ReLU on the up side too), chosen per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# tensors a supported file may carry that are read but never trained
FIXED_TENSORS = ("rope_freqs.weight",)


@dataclass(frozen=True)
class LayerConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rope_neox: bool
    rope_freq_scale: float
    norm_eps: float
    tied_output: bool
    sliding_window: int


def read_config(model, metadata: dict) -> LayerConfig:
    """From a `_core.Model` (already validated by the engine) and its metadata; architectures
    and RoPE scalings this module does not implement are refused by name."""
    c = model.config()
    arch = c["architecture"]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"relufy supports the architectures {', '.join(ARCHITECTURES)}; this model is {arch!r}"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear", "llama3"):
        raise ValueError(
            f"relufy does not implement {arch}.rope.scaling.type = {scaling!r} (none, linear and llama3 are)"
        )
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    return LayerConfig(
        arch=arch,
        n_vocab=c["n_vocab"],
        n_embd=c["n_embd"],
        n_layer=c["n_layer"],
        n_ff=c["n_ff"],
        n_head=c["n_head"],
        n_head_kv=c["n_head_kv"],
        head_dim=c["head_dim"],
        rope_dim=c["rope_dim"],
        rope_base=float(c["rope_base"]),
        rope_neox=c["rope_style"] == "neox",
        rope_freq_scale=1.0 / factor,
        norm_eps=float(c["norm_eps"]),
        tied_output=bool(c["tied_output"]),
        sliding_window=int(metadata.get(f"{arch}.attention.sliding_window", 0) or 0),
    )


def layer_tensor_names(cfg: LayerConfig, present: set[str]) -> list[str]:
    """The trainable tensors of the model, in GGUF names; raises if the file holds a tensor this
    layer would not use (training it silently away would change the model)."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not cfg.tied_output:
        names.append("output.weight")
    for l in range(cfg.n_layer):
        p = f"blk.{l}."
        names += [
            p + s
            for s in (
                "attn_norm.weight",
                "attn_q.weight",
                "attn_k.weight",
                "attn_v.weight",
                "attn_output.weight",
                "ffn_norm.weight",
                "ffn_gate.weight",
                "ffn_up.weight",
                "ffn_down.weight",
            )
        ]
        names += [
            p + s
            for s in (
                "attn_q.bias",
                "attn_k.bias",
                "attn_v.bias",
                "attn_q_norm.weight",
                "attn_k_norm.weight",
            )
            if p + s in present
        ]
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(f"the model lacks tensors relufy needs: {', '.join(missing[:5])}")
    extra = sorted(present - set(names) - set(FIXED_TENSORS))
    if extra:
        raise ValueError(
            f"relufy does not know what to do with the tensors {', '.join(extra[:5])} of this {cfg.arch} model"
        )
    return names


def fake_quantize(torch, w, qtype: str):
    """`w` (rows, cols) as a GGUF file holds it in `qtype` ("q8_0" or "q4_0": llama.cpp's
    reference rounding, per block of 32, the scale stored in f16), with the gradient passed
    straight through to `w`: training then moves the weights the file will hold."""
    blocks = w.reshape(-1, 32)
    if qtype == "q4_0":
        # d = the block's value of largest magnitude / -8; q = trunc(x / d + 8.5) in 0..15
        big = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        d = big / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(blocks * inv + 8.5).clamp(0, 15) - 8
    elif qtype == "q8_0":
        # d = max |x| / 127; q = x / d rounded half away from zero
        d = blocks.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        x = blocks * inv
        q = torch.sign(x) * torch.floor(x.abs() + 0.5)
    else:
        raise ValueError(f"no fake quantization for {qtype!r}")
    held = (q * d.half().float()).reshape(w.shape)
    return w + (held - w).detach()


def build(torch, cfg: LayerConfig, tensors: dict[str, np.ndarray], fixed: dict[str, np.ndarray]):
    """The model as a `torch.nn.Module` holding float32 parameters named after the GGUF tensors."""
    nn, F = torch.nn, torch.nn.functional

    class LlamaFamily(nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = cfg
            # ParameterDict keys cannot hold dots
            self.w = nn.ParameterDict(
                {
                    k.replace(".", "__"): nn.Parameter(
                        torch.from_numpy(np.ascontiguousarray(v, np.float32)).clone()
                    )
                    for k, v in tensors.items()
                }
            )
            half = cfg.rope_dim // 2
            inv = cfg.rope_freq_scale * cfg.rope_base ** (
                -np.arange(half, dtype=np.float64) * 2 / cfg.rope_dim
            )
            if "rope_freqs.weight" in fixed:
                inv = inv / fixed["rope_freqs.weight"].astype(np.float64)
            self.register_buffer("inv_freq", torch.from_numpy(inv), persistent=False)

        # tensor name -> "q8_0" / "q4_0": read as the file will hold them (quantization-aware)
        fake_quant: dict[str, str] = {}

        def p(self, name: str):
            w = self.w[name.replace(".", "__")]
            qtype = self.fake_quant.get(name)
            return w if qtype is None else fake_quantize(torch, w, qtype)

        def has(self, name: str) -> bool:
            return name.replace(".", "__") in self.w

        def rmsnorm(self, x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * weight

        def rope(self, x, cos, sin):
            # x: (B, T, heads, head_dim); cos/sin: (T, rope_dim / 2)
            r = cfg.rope_dim
            xr, rest = x[..., :r], x[..., r:]
            if cfg.rope_neox:
                a, b = xr[..., : r // 2], xr[..., r // 2 :]
            else:
                a, b = xr[..., 0::2], xr[..., 1::2]
            c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
            ra, rb = a * c - b * s, a * s + b * c
            rotated = (
                torch.cat([ra, rb], -1) if cfg.rope_neox else torch.stack([ra, rb], -1).flatten(-2)
            )
            return torch.cat([rotated, rest], -1)

        def forward(self, ids, blend=1.0, activation: str = "reglu", stats: bool = False):
            """Logits (B, T, n_vocab) of token ids (B, T). The gate activation is
            (1 - blend) * silu(g) + blend * relu(g) (blend 0: the original SwiGLU; 1: exactly
            ReGLU); with activation 'dreglu' the up side blends from u into relu(u) the same way.
            `blend` may be a 0-d tensor, so that a compiled model is not recompiled as it moves.
            With `stats`, also returns per layer the mean |gate activation| (n_layer,), the L1
            term, differentiable; and per neuron the count of exact zeros the target activation
            gives (n_layer, n_ff)."""
            B, T = ids.shape
            hd, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
            pos = torch.arange(T, device=ids.device, dtype=torch.float64)
            ang = pos[:, None] * self.inv_freq[None, :]
            cos, sin = torch.cos(ang), torch.sin(ang)  # float64; each use casts
            x = F.embedding(ids, self.p("token_embd.weight"))  # (B, T, n_embd)
            l1, zeros = [], []
            for l in range(cfg.n_layer):
                b = f"blk.{l}."
                # attention rmsnorm, q/k/v for every position
                h = self.rmsnorm(x, self.p(b + "attn_norm.weight"))
                q, k, v = (
                    F.linear(
                        h,
                        self.p(b + f"attn_{n}.weight"),
                        self.p(b + f"attn_{n}.bias") if self.has(b + f"attn_{n}.bias") else None,
                    )
                    for n in "qkv"
                )
                q, k, v = q.view(B, T, nh, hd), k.view(B, T, nkv, hd), v.view(B, T, nkv, hd)
                if self.has(b + "attn_q_norm.weight"):
                    q = self.rmsnorm(q, self.p(b + "attn_q_norm.weight"))
                    k = self.rmsnorm(k, self.p(b + "attn_k_norm.weight"))
                q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
                # causal attention, each group of n_head / n_head_kv query heads on one kv head
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                if nkv != nh:
                    k, v = (
                        k.repeat_interleave(nh // nkv, dim=1),
                        v.repeat_interleave(nh // nkv, dim=1),
                    )
                a = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=1.0 / math.sqrt(hd)
                )
                x = x + F.linear(
                    a.transpose(1, 2).reshape(B, T, nh * hd), self.p(b + "attn_output.weight")
                )
                # ffn rmsnorm, gate and up, the activation, down
                h = self.rmsnorm(x, self.p(b + "ffn_norm.weight"))
                g = F.linear(h, self.p(b + "ffn_gate.weight"))  # (B, T, n_ff)
                u = F.linear(h, self.p(b + "ffn_up.weight"))
                gate = (1 - blend) * F.silu(g) + blend * F.relu(
                    g
                )  # blend 1: 0 * silu + relu, exactly relu
                up = (1 - blend) * u + blend * F.relu(u) if activation == "dreglu" else u
                if stats:
                    l1.append(
                        gate.abs().mean() + (up.abs().mean() if activation == "dreglu" else 0)
                    )
                    with torch.no_grad():
                        zero = g <= 0
                        if activation == "dreglu":
                            zero = zero | (u <= 0)
                        zeros.append(zero.sum(dim=(0, 1)))
                x = x + F.linear(gate * up, self.p(b + "ffn_down.weight"))
            x = self.rmsnorm(x, self.p("output_norm.weight"))
            out = self.p("token_embd.weight") if cfg.tied_output else self.p("output.weight")
            logits = F.linear(x, out)
            if stats:
                return logits, torch.stack(l1), torch.stack(zeros)
            return logits

        def gguf_tensors(self) -> dict[str, np.ndarray]:
            return {
                k.replace("__", "."): v.detach().float().cpu().numpy() for k, v in self.w.items()
            }

    return LlamaFamily()
