"""End-to-end sparse decoding, both sides in one process, alternating runs, ratio of medians.

    python benches/sparse_e2e.py synthetic [--layers 2] [--threads 2]
        A ReGLU model with LLaMA-7B layer shape (n_embd 4096, n_ff 11008, 32 heads, Q4_0) and
        fewer layers, written in PowerInfer's layout with predictors: decode tok/s in
        `predictor` mode vs `dense` mode, plus the predictor's recall and the skipped fraction.
    python benches/sparse_e2e.py smollm2 [--threads 2]
        SmolLM2-135M (SwiGLU, no predictors) in `threshold` mode: perplexity on python3.11-doc
        text at 0/30/50/70% target sparsity, and decode tok/s at 50% vs dense.

How the synthetic weights are drawn: the residual stream lives in a 255-dimensional subspace
(orthonormal basis B, never touching dimension 0) plus a constant c in dimension 0 (embeddings
put it there; attention and FFN outputs are written inside the subspace). Gate row j is
B^T g_j + b_j e_0 with |g_j| = 1, so its pre-activation is g_j . z + b_j c, roughly
N(b_j c, 1) over tokens: b_j sets neuron j's firing probability p_j, and the p_j follow a power
law (p ~ rank^-1, a few neurons fire for most tokens, most rarely) averaging 10%. The predictor
is exact up to quantization: fc1 = [B; e_0; -B; -e_0] recovers (z, c) through the ReLU pair
trick, and fc2 row j = [g_j, b_j, -g_j, -b_j] gives the pre-activation back.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def write_synthetic(path: str, n_layer: int, seed: int = 0) -> None:
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize
    ndtri = np.vectorize(statistics.NormalDist().inv_cdf)  # inverse normal CDF

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from synth import add_tiny_tokenizer, tiny_vocab

    rng = np.random.default_rng(seed)
    n_embd, n_ff, n_head, r, c = 4096, 11008, 32, 255, 4.0
    hd = n_embd // n_head
    n_vocab = len(tiny_vocab()[0])
    # orthonormal basis of the subspace, orthogonal to dimension 0
    basis = np.linalg.qr(rng.standard_normal((n_embd - 1, r)))[0].T  # (r, n_embd - 1)
    B = np.zeros((r, n_embd), np.float32)
    B[:, 1:] = basis

    w = GGUFWriter(path, "llama")
    w.add_block_count(n_layer)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hd)
    w.add_float32("powerinfer.sparse_threshold", 0.0)
    add_tiny_tokenizer(w)

    def q4(name, a):
        w.add_tensor(name, quantize(np.ascontiguousarray(a, dtype=np.float32), Q.Q4_0), raw_dtype=Q.Q4_0)

    embd = rng.standard_normal((n_vocab, r)).astype(np.float32) @ B
    embd[:, 0] = c
    w.add_tensor("token_embd.weight", embd.astype(np.float16))
    # firing probabilities: power law over a random ranking, mean 0.10
    rank = rng.permutation(n_ff) + 1.0
    p = np.minimum(0.95, rank ** -1.0 * 0.1 * n_ff / np.sum(rank ** -1.0))
    for _ in range(20):  # renormalise the mean after clipping
        p = np.minimum(0.95, p * 0.10 / p.mean())
    for l in range(n_layer):
        pre = f"blk.{l}."
        w.add_tensor(pre + "attn_norm.weight", np.ones(n_embd, np.float32))
        for name in ("attn_q", "attn_k", "attn_v"):
            q4(pre + name + ".weight", rng.standard_normal((n_embd, n_embd)) * 0.02)
        q4(pre + "attn_output.weight", B.T @ (rng.standard_normal((r, n_embd)) * 0.01))
        w.add_tensor(pre + "ffn_norm.weight", np.ones(n_embd, np.float32))
        g = rng.standard_normal((n_ff, r)).astype(np.float32)
        g /= np.linalg.norm(g, axis=1, keepdims=True)
        bias = (ndtri(p) / c).astype(np.float32)  # P(g.z + b c > 0) = p for z ~ N(0, I)
        gate = g @ B
        gate[:, 0] = bias
        # the model sees x / rms(x); rms is shared by all neurons of a token, so signs hold
        q4(pre + "ffn_gate.weight", gate)
        q4(pre + "ffn_up.weight", rng.standard_normal((n_ff, n_embd)) * 0.02)
        q4(pre + "ffn_down_t.weight", (rng.standard_normal((n_ff, r)) * 0.02).astype(np.float32) @ B)
        e0 = np.zeros((1, n_embd), np.float32)
        e0[0, 0] = 1.0
        fc1 = np.concatenate([B, e0, -B, -e0])  # (512, n_embd)
        fc2 = np.concatenate([g, bias[:, None], -g, -bias[:, None]], axis=1)  # (n_ff, 512)
        q4(pre + "fc1.weight", fc1)
        q4(pre + "fc2.weight", fc2)
        del gate, g
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    q4("output.weight", rng.standard_normal((n_vocab, n_embd)) * 0.02)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "r+b") as f:
        f.write(b"PWRI")


def decode_tps(engine, prompt_ids, n) -> float:
    engine.generate(prompt_ids, max_tokens=n)
    s = engine.last_stats
    return s["decode_tps"]


def paired(engines: dict, prompt_ids, n: int, repeats: int) -> dict:
    res = {k: [] for k in engines}
    for _ in range(repeats):
        for k, e in engines.items():
            res[k].append(decode_tps(e, prompt_ids, n))
    return res


def cmd_synthetic(a) -> None:
    from powerinfer_rs import Engine

    path = a.model or os.path.join(tempfile.gettempdir(), f"powerinfer-synthetic-7b-{a.layers}l.gguf")
    if not os.path.exists(path):
        t = time.time()
        write_synthetic(path, a.layers)
        print(f"wrote {path} ({os.path.getsize(path) / 2**20:.0f} MiB) in {time.time() - t:.0f} s")
    prompt = list(range(3, 35))
    dense = Engine.load(path, threads=a.threads, n_ctx=512, sparsity="dense", device="cpu")
    pred = Engine.load(path, threads=a.threads, n_ctx=512, sparsity="predictor", device="cpu")
    check = Engine.load(path, threads=a.threads, n_ctx=512, sparsity="predictor", device="cpu", predictor_recall=True)
    check.generate(prompt, max_tokens=a.tokens)
    res = paired({"dense": dense, "predictor": pred}, prompt, a.tokens, a.repeats)
    ratios = [p / d for p, d in zip(res["predictor"], res["dense"])]
    print(f"synthetic ReGLU, 7B layer shape, {a.layers} layers, Q4_0, {a.threads} threads, "
          f"{a.tokens} decoded tokens, {a.repeats} alternating pairs")
    print(f"predictor recall {check.last_stats['predictor_recall']:.3f}, FFN neurons skipped {check.last_stats['ffn_sparsity']:.1%}")
    print("| mode | decode tok/s (median) |")
    print("|---|---|")
    print(f"| dense | {statistics.median(res['dense']):.2f} |")
    print(f"| predictor | {statistics.median(res['predictor']):.2f} |")
    print(f"| ratio (median of pairs) | **{statistics.median(ratios):.2f}x** (range {min(ratios):.2f} to {max(ratios):.2f}) |")


def doc_text(max_chars: int) -> str:
    files = sorted(glob.glob("/usr/share/doc/python3.11/html/_sources/tutorial/*.txt"))
    if not files:
        sys.exit("python3.11-doc is not installed (apt-get install python3.11-doc)")
    text = "\n\n".join(open(f, encoding="utf-8").read() for f in files)
    return text[:max_chars]


def cmd_smollm2(a) -> None:
    from powerinfer_rs import Engine

    text = doc_text(a.chars)
    print(f"SmolLM2-135M Q4_1, threshold mode calibrated on the built-in sample; perplexity on "
          f"python3.11-doc tutorial text ({len(text)} chars), ctx {a.ctx}; {a.threads} threads")
    print("| target sparsity | measured FFN sparsity | perplexity | vs dense |")
    print("|---|---|---|---|")
    dense = Engine.load(threads=a.threads, sparsity="dense", device="cpu")
    base = dense.perplexity(text, ctx=a.ctx)
    print(f"| dense | 0.0% | {base:.3f} | |")
    for target in (0.3, 0.5, 0.7):
        e = Engine.load(threads=a.threads, sparsity="threshold", device="cpu", target_sparsity=target)
        ppl = e.perplexity(text, ctx=a.ctx)
        print(f"| {target:.0%} | {e.last_stats['ffn_sparsity']:.1%} | {ppl:.3f} | {ppl / base - 1:+.1%} |")
    sparse = Engine.load(threads=a.threads, sparsity="threshold", device="cpu", target_sparsity=0.5)
    prompt = dense.tokenize(text[:2000])[:128]
    res = paired({"dense": dense, "threshold-0.5": sparse}, prompt, a.tokens, a.repeats)
    ratios = [s / d for s, d in zip(res["threshold-0.5"], res["dense"])]
    print()
    print(f"decode after a {len(prompt)}-token prompt, {a.tokens} tokens, {a.repeats} alternating pairs:")
    print(f"dense {statistics.median(res['dense']):.1f} tok/s, threshold 50% {statistics.median(res['threshold-0.5']):.1f} tok/s, "
          f"ratio **{statistics.median(ratios):.2f}x** (range {min(ratios):.2f} to {max(ratios):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synthetic")
    s.add_argument("--layers", type=int, default=2)
    s.add_argument("--model", default=None, help="reuse or write the synthetic model here")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--tokens", type=int, default=32)
    s.add_argument("--repeats", type=int, default=5)
    s.set_defaults(func=cmd_synthetic)
    m = sub.add_parser("smollm2")
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--ctx", type=int, default=256)
    m.add_argument("--chars", type=int, default=40000)
    m.add_argument("--tokens", type=int, default=64)
    m.add_argument("--repeats", type=int, default=7)
    m.set_defaults(func=cmd_smollm2)
    a = ap.parse_args()
    a.func(a)


if __name__ == "__main__":
    main()
