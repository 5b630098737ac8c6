"""End-to-end sparse decoding, both sides in one process, alternating runs, ratio of medians.

    python benches/sparse_e2e.py synthetic [--layers 4] [--threads 2] [--shape 7b|smollm2]
        A ReGLU model with LLaMA-7B layer shape (n_embd 4096, n_ff 11008, 32 heads, Q4_0) and
        fewer layers, or with `--shape smollm2` SmolLM2-135M's (n_embd 576, n_ff 1536, 9 query
        and 3 key/value heads; 30 layers there are its own count), where the fixed costs of a
        layer (the predictor's two small products, selection, fork/join) weigh as much as its
        rows; written twice with the same weights: in PowerInfer's layout (neuron-major
        `ffn_down_t`, predictors) and as a standard GGUF (row-major `ffn_down`, as llama.cpp
        reads it). Decode tok/s of these runs:
          standard dense   every FFN row is read (what a dense engine does with this file);
          dense            PowerInfer layout without predictors: exact, but a neuron whose ReLU
                           gate is <= 0 has its up and down rows skipped, so only the gate matrix
                           is read in full;
          predictor        the predictors choose the neurons; gate, up and down rows are read
                           only for those, from the FFN bundled by neuron (`neuron_bundles`);
                           "rows apart" reads them from the three matrices instead.
        Beside each ratio it prints the byte-count ideal: the weight bytes per token each side
        reads (attention, predictors, the FFN rows at the measured fractions), dense over sparse;
        then where a decoded token's time goes in standard dense and predictor mode, step by
        step (`step_times`: qkv, attend, attn_out, ffn...).
    python benches/sparse_e2e.py smollm2 [--threads 2]
        SmolLM2-135M (SwiGLU, no predictors) in `threshold` mode, the frontier of weight bytes
        skipped against perplexity on unseen python3.11-doc text: the neuron rule at 30/50/70%
        target sparsity and input sparsity at several `max_ppl_increase` budgets; then decode
        tok/s of each against dense.

How the synthetic weights are drawn: the residual stream lives in a 255-dimensional subspace
(orthonormal basis B, never touching dimension 0) plus a constant c in dimension 0 (embeddings
put it there; attention and FFN outputs are written inside the subspace, small enough that the
stream's scale, and with it each neuron's firing rate, barely moves from layer to layer). Gate
row j is B^T g_j + b_j e_0 with |g_j| = 1, so its pre-activation is g_j . z + b_j c, roughly
N(b_j c, 1) over tokens: b_j sets neuron j's firing probability p_j, and the p_j follow a power
law (p ~ rank^-1, a few neurons fire for most tokens, most rarely) averaging 10%; the bench
prints the measured share. The predictor is exact up to quantization: fc1 = [B; e_0; -B; -e_0]
recovers (z, c) through the ReLU pair trick, and fc2 row j = [g_j, b_j, -g_j, -b_j] gives the
pre-activation back.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

Q4_0_BYTES = 18 / 32  # bytes per weight


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    rank: int  # dimension of the residual stream's subspace; the predictor's hidden is 2 (rank + 1)

    @property
    def n_kv(self) -> int:
        return self.n_embd // self.n_head * self.n_head_kv


SHAPES = {
    "7b": Shape(4096, 11008, 32, 32, 255),
    # (a predictor's hidden of 128: a sixth of the gate's rows' bytes, as 512 is at 7B)
    "smollm2": Shape(576, 1536, 9, 3, 63),
}
#: Output scales of attention and FFN: small, so the residual stream keeps its scale.
ATTN_OUT_SCALE, DOWN_SCALE = 0.001, 0.0005


def write_synthetic(
    path: str, n_layer: int, layout: str = "powerinfer", seed: int = 0, shape: str = "7b"
) -> None:
    """The synthetic model; `layout` "powerinfer" (ffn_down_t, predictors, PWRI magic) or
    "standard" (ffn_down, no predictors). The same seed gives the same weights in both."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize

    ndtri = np.vectorize(statistics.NormalDist().inv_cdf)  # inverse normal CDF

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from synth import add_tiny_tokenizer, tiny_vocab

    rng = np.random.default_rng(seed)
    sh = SHAPES[shape]
    n_embd, n_ff, n_head, r, c = sh.n_embd, sh.n_ff, sh.n_head, sh.rank, 4.0
    powerinfer = layout == "powerinfer"
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
    w.add_head_count_kv(sh.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hd)
    if powerinfer:
        w.add_float32("powerinfer.sparse_threshold", 0.0)
    add_tiny_tokenizer(w)

    def q4(name, a):
        w.add_tensor(
            name, quantize(np.ascontiguousarray(a, dtype=np.float32), Q.Q4_0), raw_dtype=Q.Q4_0
        )

    embd = rng.standard_normal((n_vocab, r)).astype(np.float32) @ B
    embd[:, 0] = c
    w.add_tensor("token_embd.weight", embd.astype(np.float16))
    # firing probabilities: power law over a random ranking, mean 0.10
    rank = rng.permutation(n_ff) + 1.0
    p = np.minimum(0.95, rank**-1.0 * 0.1 * n_ff / np.sum(rank**-1.0))
    for _ in range(20):  # renormalise the mean after clipping
        p = np.minimum(0.95, p * 0.10 / p.mean())
    for l in range(n_layer):
        pre = f"blk.{l}."
        w.add_tensor(pre + "attn_norm.weight", np.ones(n_embd, np.float32))
        for name, rows in (("attn_q", n_embd), ("attn_k", sh.n_kv), ("attn_v", sh.n_kv)):
            q4(pre + name + ".weight", rng.standard_normal((rows, n_embd)) * 0.02)
        q4(pre + "attn_output.weight", B.T @ (rng.standard_normal((r, n_embd)) * ATTN_OUT_SCALE))
        w.add_tensor(pre + "ffn_norm.weight", np.ones(n_embd, np.float32))
        g = rng.standard_normal((n_ff, r)).astype(np.float32)
        g /= np.linalg.norm(g, axis=1, keepdims=True)
        bias = (ndtri(p) / c).astype(np.float32)  # P(g.z + b c > 0) = p for z ~ N(0, I)
        gate = g @ B
        gate[:, 0] = bias
        # the model sees x / rms(x); rms is shared by all neurons of a token, so signs hold
        q4(pre + "ffn_gate.weight", gate)
        q4(pre + "ffn_up.weight", rng.standard_normal((n_ff, n_embd)) * 0.02)
        down_t = (rng.standard_normal((n_ff, r)) * DOWN_SCALE).astype(np.float32) @ B
        if powerinfer:
            q4(pre + "ffn_down_t.weight", down_t)
            e0 = np.zeros((1, n_embd), np.float32)
            e0[0, 0] = 1.0
            # fc1 (2 (r + 1), n_embd), fc2 (n_ff, 2 (r + 1))
            fc1 = np.concatenate([B, e0, -B, -e0])
            fc2 = np.concatenate([g, bias[:, None], -g, -bias[:, None]], axis=1)
            q4(pre + "fc1.weight", fc1)
            q4(pre + "fc2.weight", fc2)
        else:
            q4(pre + "ffn_down.weight", down_t.T)
        del gate, g, down_t
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    q4("output.weight", rng.standard_normal((n_vocab, n_embd)) * 0.02)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if powerinfer:
        with open(path, "r+b") as f:
            f.write(b"PWRI")


def paired(engines: dict, prompt_ids, n: int, repeats: int, prefill: dict | None = None) -> dict:
    """Decode tok/s of each engine, alternating, `repeats` rounds; prefill tok/s into `prefill`.
    An untimed round first: what an engine builds on first use (neuron-major copies, bundles) and
    the first touch of its weights are load costs, not decode speed."""
    res = {k: [] for k in engines}
    for e in engines.values():
        e.generate(prompt_ids, max_tokens=4, ignore_eos=True)
    for _ in range(repeats):
        for k, e in engines.items():
            e.generate(prompt_ids, max_tokens=n, ignore_eos=True)
            res[k].append(e.last_stats["decode_tps"])
            if prefill is not None:
                prefill.setdefault(k, []).append(e.last_stats["prefill_tps"])
    return res


def layer_bytes(n_layer: int, sh: Shape) -> dict:
    """Weight bytes per token of the synthetic model's parts (Q4_0)."""
    hidden = 2 * (sh.rank + 1)
    return {
        "attention": n_layer * (2 * sh.n_embd + 2 * sh.n_kv) * sh.n_embd * Q4_0_BYTES,
        "ffn_matrix": n_layer * sh.n_ff * sh.n_embd * Q4_0_BYTES,  # one of gate, up, down
        "predictor": n_layer * (hidden * sh.n_embd + sh.n_ff * hidden) * Q4_0_BYTES,
    }


def cmd_synthetic(a) -> None:
    from powerinfer_rs import Engine

    if a.layers is None:
        a.layers = 30 if a.shape == "smollm2" else 4
    paths = {}
    for layout in ("powerinfer", "standard"):
        path = os.path.join(
            a.dir or tempfile.gettempdir(),
            f"powerinfer-synthetic-{a.shape}-{a.layers}l-{layout}-v2.gguf",
        )
        if not os.path.exists(path):
            t = time.time()
            write_synthetic(path + ".tmp", a.layers, layout, shape=a.shape)
            os.replace(path + ".tmp", path)
            print(
                f"wrote {path} ({os.path.getsize(path) / 2**20:.0f} MiB) in {time.time() - t:.0f} s"
            )
        paths[layout] = path
    load = lambda layout, mode, **kw: Engine.load(
        paths[layout],
        threads=a.threads,
        n_ctx=max(512, a.prompt + a.tokens + 8),
        sparsity=mode,
        device="cpu",
        **kw,
    )
    engines = {
        "standard dense": load("standard", "dense"),
        "dense": load("powerinfer", "dense"),
        "predictor": load("powerinfer", "predictor", neuron_bundles=True),
        "predictor, rows apart": load("powerinfer", "predictor", neuron_bundles=False),
    }
    # token ids past the tiny vocabulary's specials, cycling through it for long prompts
    n_vocab = engines["dense"].n_vocab
    prompt = [3 + i % (n_vocab - 3) for i in range(a.prompt)]
    # fractions of (token, layer, neuron) triples: truly firing, selected, and both
    check = load("powerinfer", "predictor", predictor_recall=True)
    check.generate(prompt, max_tokens=a.tokens)
    st = check.last_stats
    active, recall, selected = st["ffn_active"], st["predictor_recall"], 1.0 - st["ffn_sparsity"]
    caught = active * recall  # firing and selected: their up and down rows are read
    by = layer_bytes(a.layers, SHAPES[a.shape])
    read = {
        "standard dense": by["attention"] + 3 * by["ffn_matrix"],
        "dense": by["attention"] + by["ffn_matrix"] * (1 + 2 * active),
        "predictor": by["attention"] + by["predictor"] + by["ffn_matrix"] * (selected + 2 * caught),
    }
    read["predictor, rows apart"] = read["predictor"]
    pre: dict = {}
    res = paired(engines, prompt, a.tokens, a.repeats, pre)
    tps = {k: statistics.median(v) for k, v in res.items()}
    print(
        f"synthetic ReGLU, {a.shape} layer shape, {a.layers} layers, Q4_0, {a.threads} threads, "
        f"{a.tokens} decoded tokens after a {len(prompt)}-token prompt, {a.repeats} alternating rounds"
    )
    print(
        f"neurons firing {active:.1%}, predictor selects {selected:.1%} (FFN neurons skipped {1 - selected:.1%}), "
        f"predictor recall {recall:.3f}"
    )
    print(
        "| run | weight MB read per token | decode tok/s (median) | GB/s | prefill tok/s (median) |"
    )
    print("|---|---|---|---|---|")
    for k in engines:
        print(
            f"| {k} | {read[k] / 1e6:.1f} | {tps[k]:.2f} | {read[k] * tps[k] / 1e9:.1f} | {statistics.median(pre[k]):.1f} |"
        )
    print()
    print("| predictor vs | measured (median of rounds) | byte-count ideal | measured / ideal |")
    print("|---|---|---|---|")
    for base in ("standard dense", "dense"):
        ratios = [p / d for p, d in zip(res["predictor"], res[base])]
        ideal = read[base] / read["predictor"]
        m = statistics.median(ratios)
        print(
            f"| {base} | **{m:.2f}x** ({min(ratios):.2f} to {max(ratios):.2f}) | {ideal:.2f}x | {m / ideal:.2f} |"
        )
    ratios = [p / d for p, d in zip(res["predictor"], res["predictor, rows apart"])]
    print(
        f"\npredictor, rows bundled by neuron vs apart: {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f} to {max(ratios):.2f})"
    )
    print()
    for base in ("standard dense", "dense"):
        ratios = [p / d for p, d in zip(pre["predictor"], pre[base])]
        print(
            f"prefill, predictor vs {base}: {statistics.median(ratios):.2f}x ({min(ratios):.2f} to {max(ratios):.2f})"
        )
    # where a decoded token's time goes in each (`step_times`), apart from the rounds above
    from gpu_smollm2 import decode_steps_ms  # benches/ is the script's folder

    sides = ("standard dense", "predictor")
    steps = {k: decode_steps_ms(engines[k], prompt, a.tokens) for k in sides}
    names = [n for n in steps["standard dense"] if n in steps["predictor"]]
    print("\n| step: ms per decoded token | standard dense | predictor |")
    print("|---|---|---|")
    for n in sorted(names, key=lambda n: -steps["standard dense"][n]):
        print(f"| {n} | {steps['standard dense'][n]:.3f} | {steps['predictor'][n]:.3f} |")
    print(
        f"| all | {sum(steps['standard dense'].values()):.3f} | {sum(steps['predictor'].values()):.3f} |"
    )


def doc_text(max_chars: int) -> str:
    files = sorted(glob.glob("/usr/share/doc/python3.11/html/_sources/tutorial/*.txt"))
    if not files:
        sys.exit("python3.11-doc is not installed (apt-get install python3.11-doc)")
    text = "\n\n".join(open(f, encoding="utf-8").read() for f in files)
    return text[:max_chars]


def cmd_smollm2(a) -> None:
    from powerinfer_rs import Engine

    text = doc_text(a.chars)
    print(
        f"SmolLM2-135M Q4_1; cut-offs calibrated on the built-in sample; perplexity on python3.11-doc "
        f"tutorial text ({len(text)} chars, unseen in calibration), ctx {a.ctx}; {a.threads} threads"
    )
    print("| mode | FFN neurons skipped | layer weight bytes skipped | perplexity | vs dense |")
    print("|---|---|---|---|---|")
    dense = Engine.load(threads=a.threads, sparsity="dense", device="cpu")
    base = dense.perplexity(text, ctx=a.ctx)
    print(f"| dense | 0.0% | 0.0% | {base:.3f} | |")
    engines = {"dense": dense}
    for target in (0.3, 0.5, 0.7):
        e = Engine.load(
            threads=a.threads, sparsity="threshold", device="cpu", target_sparsity=target
        )
        ppl = e.perplexity(text, ctx=a.ctx)
        st = e.last_stats
        print(
            f"| neuron rule |act(gate)|, target {target:.0%} | {st['ffn_sparsity']:.1%} | {st['weight_bytes_skipped']:+.1%} | {ppl:.3f} | {ppl / base - 1:+.1%} |"
        )
        if target == 0.5:
            engines["neurons 50%"] = e
    for budget in a.budgets:
        e = Engine.load(
            threads=a.threads, sparsity="threshold", device="cpu", max_ppl_increase=budget
        )
        ppl = e.perplexity(text, ctx=a.ctx)
        st = e.last_stats
        print(
            f"| input sparsity, max_ppl_increase {budget:g} | {st['ffn_sparsity']:.1%} | {st['weight_bytes_skipped']:+.1%} | {ppl:.3f} | {ppl / base - 1:+.1%} |"
        )
        engines[f"inputs {budget:g}"] = e
    faster = e.input_sparsity["faster"]
    print()
    print(
        "shares of a group's inputs at which the sparse kernel beat the dense one when timed: "
        + "; ".join(
            f"{g} {', '.join(f'{v:.0%}' for v in lv) or 'none'}" for g, lv in faster.items()
        )
    )
    prompt = dense.tokenize(text[:2000])[:128]
    res = paired(engines, prompt, a.tokens, a.repeats)
    print()
    print(
        f"decode after a {len(prompt)}-token prompt, {a.tokens} tokens, {a.repeats} alternating rounds:"
    )
    print("| mode | decode tok/s | vs dense |")
    print("|---|---|---|")
    for name, runs in res.items():
        ratios = [s / d for s, d in zip(runs, res["dense"])]
        print(
            f"| {name} | {statistics.median(runs):.1f} | {statistics.median(ratios):.2f}x ({min(ratios):.2f} to {max(ratios):.2f}) |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synthetic")
    s.add_argument("--layers", type=int, default=None, help="default: 4 (7b), 30 (smollm2)")
    s.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    s.add_argument(
        "--dir",
        default=None,
        help="reuse or write the synthetic models in this folder (default: the temp folder)",
    )
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--tokens", type=int, default=32)
    s.add_argument("--prompt", type=int, default=32, help="prompt tokens (prefill tok/s)")
    s.add_argument("--repeats", type=int, default=5)
    s.set_defaults(func=cmd_synthetic)
    m = sub.add_parser("smollm2")
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--ctx", type=int, default=256)
    m.add_argument("--chars", type=int, default=40000)
    m.add_argument("--tokens", type=int, default=64)
    m.add_argument("--repeats", type=int, default=7)
    m.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=[0.02, 0.05, 0.1, 0.2],
        help="max_ppl_increase values",
    )
    m.set_defaults(func=cmd_smollm2)
    a = ap.parse_args()
    a.func(a)


if __name__ == "__main__":
    main()
