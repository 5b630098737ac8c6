"""Quality of input sparsity on SmolLM2, in float64, independent of the engine: what skipping a
share of the inputs of the layer matrices costs in perplexity, and what the input-major copy's
type adds.

    python benches/input_sparsity_f64.py [--windows 4] [--ctx 256]

Per token, each matrix W skips the inputs with the smallest |x_i| * |W[:, i]| (WINA's score);
the product then reads an input-major copy of W: the dequantized original ("exact", what a
float copy gives), or the original re-quantized per input row to Q8_0 or Q4_1 (what a copy of
a 4-bit file costs in rounding). Prints perplexity on python3.11-doc library text (files 40-59)
against dense: every matrix at 25% and 40%, then each matrix group alone at 50/70/85% (Q8_0).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import reference as R

GROUPS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "attn_output": ("attn_output",),
    "ffn_gate_up": ("ffn_gate", "ffn_up"),
    "ffn_down": ("ffn_down",),
}
ALL = [m for g in GROUPS.values() for m in g]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256)
    a = ap.parse_args()
    from powerinfer_rs import _core, default_model_path
    from powerinfer_rs.tokenizer import GGUFTokenizer

    path = default_model_path()
    w, meta = R.read_weights(path)
    tok = GGUFTokenizer(_core.Model(path, 1).metadata(), model_path=path)
    files = sorted(glob.glob("/usr/share/doc/python3.11/html/_sources/library/*.txt"))[40:60]
    if not files:
        sys.exit("python3.11-doc is not installed (apt-get install python3.11-doc)")
    ids = tok.encode("".join(open(f, encoding="utf-8").read() for f in files), add_bos=False)
    windows = [ids[i * a.ctx : (i + 1) * a.ctx] for i in range(a.windows)]
    m = lambda k: meta[f"llama.{k}"]
    n_layer, n_head, n_kv = (
        m("block_count"),
        m("attention.head_count"),
        m("attention.head_count_kv"),
    )
    hd, base, eps = (
        m("embedding_length") // n_head,
        m("rope.freq_base"),
        m("attention.layer_norm_rms_epsilon"),
    )
    norms = {k: np.linalg.norm(v, axis=0) for k, v in w.items() if v.ndim == 2}
    copies: dict = {}

    def copy(name: str, kind: str) -> np.ndarray:
        if kind == "exact":
            return w[name]
        if (name, kind) not in copies:
            qt = {"Q8_0": T.Q8_0, "Q4_1": T.Q4_1}[kind]
            wt = np.ascontiguousarray(w[name].T, dtype=np.float32)  # one row per input
            copies[(name, kind)] = dequantize(quantize(wt, qt), qt).astype(np.float64).T
        return copies[(name, kind)]

    def ppl(shares: dict, kind: str = "exact") -> float:
        nll, count = 0.0, 0
        for toks in windows:
            n = len(toks)
            pos = np.arange(n)
            mask = np.triu(np.full((n, n), -np.inf), k=1)

            def mm(x, l, mat):
                name = f"blk.{l}.{mat}.weight"
                s = shares.get(mat, 0.0)
                if s <= 0:
                    return x @ w[name].T
                score = np.abs(x) * norms[name]
                k = int(round(s * x.shape[1]))
                cut = np.partition(score, k - 1, axis=1)[:, k - 1 : k]
                return np.where(score > cut, x, 0.0) @ copy(name, kind).T

            x = w["token_embd.weight"][toks]
            for l in range(n_layer):
                p = f"blk.{l}."
                h = R.rmsnorm(x, w[p + "attn_norm.weight"], eps)
                q = R.rope(mm(h, l, "attn_q"), pos, n_head, hd, hd, base, False).reshape(
                    n, n_head, hd
                )
                k = R.rope(mm(h, l, "attn_k"), pos, n_kv, hd, hd, base, False).reshape(n, n_kv, hd)
                v = mm(h, l, "attn_v").reshape(n, n_kv, hd)
                att = np.zeros((n, n_head, hd))
                for hh in range(n_head):
                    g = hh // (n_head // n_kv)
                    sc = q[:, hh] @ k[:, g].T / np.sqrt(hd) + mask
                    sc = np.exp(sc - sc.max(1, keepdims=True))
                    att[:, hh] = sc / sc.sum(1, keepdims=True) @ v[:, g]
                x = x + mm(att.reshape(n, -1), l, "attn_output")
                h = R.rmsnorm(x, w[p + "ffn_norm.weight"], eps)
                gate, up = mm(h, l, "ffn_gate"), mm(h, l, "ffn_up")
                x = x + mm(gate / (1 + np.exp(-gate)) * up, l, "ffn_down")
            logits = R.rmsnorm(x, w["output_norm.weight"], eps) @ w["token_embd.weight"].T
            logits -= logits.max(1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
            nll -= logp[np.arange(n - 1), np.asarray(toks[1:])].sum()
            count += n - 1
        return float(np.exp(nll / count))

    dense = ppl({})
    print(
        f"SmolLM2-135M Q4_1, float64; {a.windows} windows of {a.ctx} tokens of python3.11-doc library text"
    )
    print(f"dense perplexity {dense:.3f}")
    print("| inputs skipped, every matrix | copy | perplexity | vs dense |")
    print("|---|---|---|---|")
    for share in (0.25, 0.4):
        for kind in ("exact", "Q8_0", "Q4_1"):
            r = ppl({mat: share for mat in ALL}, kind)
            print(f"| {share:.0%} | {kind} | {r:.3f} | {r / dense - 1:+.1%} |", flush=True)
    print()
    print("| group alone (Q8_0 copy) | 50% | 70% | 85% |")
    print("|---|---|---|---|")
    for g, mats in GROUPS.items():
        cells = [
            f"{ppl({mat: s for mat in mats}, 'Q8_0') / dense - 1:+.1%}" for s in (0.5, 0.7, 0.85)
        ]
        print(f"| {g} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
