"""GPU benchmark: hybrid CPU+GPU decoding vs CPU-only sparse vs layer offload, on a synthetic
ReGLU model of LLaMA-13B shape (40 layers, n_embd 5120, n_ff 13824, F16, ~27 GB) that this
script writes itself, and the same model wholly on the GPU. Run on a GPU machine:

    python benches/hybrid_13b.py                      # 13B shape, --vram-budget 8GiB
    python benches/hybrid_13b.py --layers 8 --budget 1.6GiB   # fewer layers, budget scaled

The model is built so that its predictors select about 10% of each layer's neurons with a
power-law hot set: every token embedding carries a constant component, predictor hidden unit 0
reads it, and fc2's column 0 gives neuron j the offset that makes it fire with probability p_j
(p_j ~ rank^-alpha over a random permutation, mean --active); the other hidden units add unit
Gaussian noise, so which neurons fire changes from token to token. The placement is solved by
`placement.plan` with those p_j as the profile and written as `.generated.gpuidx`.

All configurations run in this one process on the same file; the table reports decode tok/s
and the ratios. The full-GPU run also reports the bytes a token reads (dense weights, the
selected neurons' rows, the KV cache) over its time, as a fraction of the device-to-device copy
bandwidth measured here with torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from gguf import GGUFWriter
from synth import add_tiny_tokenizer, tiny_vocab


def firing_probabilities(rng, n_ff: int, mean: float, alpha: float) -> np.ndarray:
    """p_j = min(0.98, a * rank_j^-alpha) over a random rank permutation, with a chosen so the
    mean is `mean`."""
    ranks = rng.permutation(n_ff) + 1.0
    lo, hi = 0.0, 1e3
    for _ in range(100):
        a = (lo + hi) / 2
        if np.minimum(0.98, a * ranks**-alpha).mean() < mean:
            lo = a
        else:
            hi = a
    return np.minimum(0.98, hi * ranks**-alpha)


def write_model(
    path: str,
    n_layer: int,
    n_embd: int,
    n_ff: int,
    n_head: int,
    hidden: int,
    mean: float,
    alpha: float,
    seed: int = 0,
):
    """Streams the model to disk tensor by tensor (it does not fit in memory twice). Returns the
    per-layer firing probabilities."""
    from statistics import NormalDist

    rng = np.random.default_rng(seed)
    n_vocab = len(tiny_vocab()[0])
    hd = n_embd // n_head
    # one pool of random f16 values; big matrices are windows of it (speed, not realism)
    pool = (rng.standard_normal(1 << 26) * 0.02).astype(np.float16)

    def big(rows, cols):
        n = rows * cols
        reps = -(-n // len(pool))
        start = int(rng.integers(0, len(pool)))
        flat = np.roll(pool, -start) if reps == 1 else np.tile(np.roll(pool, -start), reps)
        return flat[:n].reshape(rows, cols)

    inv = NormalDist().inv_cdf
    probs = [firing_probabilities(rng, n_ff, mean, alpha) for _ in range(n_layer)]
    # (name, shape, maker): written one at a time, in this order
    tensors: list[tuple[str, tuple[int, ...], callable]] = []
    emb = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    emb[:, 0] = 4.0  # the constant component predictor hidden unit 0 reads
    tensors.append(("token_embd.weight", (n_vocab, n_embd), lambda: emb.astype(np.float16)))
    ones = lambda: np.ones(n_embd, dtype=np.float32)
    for l in range(n_layer):
        p = f"blk.{l}."

        def fc1():
            a = (rng.standard_normal((hidden, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
            a[0] = 0.0
            a[0, 0] = 0.25  # relu(x[0] / 4) = 1
            return a.astype(np.float16)

        def fc2(l=l):
            noise = rng.standard_normal((n_ff, hidden)).astype(np.float32) * np.sqrt(
                2.0 / (hidden - 1)
            )
            noise[:, 0] = [inv(float(min(max(q, 1e-6), 1 - 1e-6))) for q in probs[l]]
            return noise.astype(np.float16)

        sq, ff = (n_embd, n_embd), (n_ff, n_embd)
        tensors += [
            (p + "fc1.weight", (hidden, n_embd), fc1),
            (p + "fc2.weight", (n_ff, hidden), fc2),
            (p + "attn_norm.weight", (n_embd,), ones),
            (p + "attn_q.weight", sq, lambda sq=sq: big(*sq)),
            (p + "attn_k.weight", sq, lambda sq=sq: big(*sq)),
            (p + "attn_v.weight", sq, lambda sq=sq: big(*sq)),
            (p + "attn_output.weight", sq, lambda sq=sq: big(*sq) * np.float16(0.1)),
            (p + "ffn_norm.weight", (n_embd,), ones),
            (p + "ffn_gate.weight", ff, lambda ff=ff: big(*ff)),
            (p + "ffn_up.weight", ff, lambda ff=ff: big(*ff)),
            (p + "ffn_down_t.weight", ff, lambda ff=ff: big(*ff) * np.float16(0.1)),
        ]
    tensors.append(("output_norm.weight", (n_embd,), ones))
    tensors.append(("output.weight", (n_vocab, n_embd), lambda: big(n_vocab, n_embd)))

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
    w.add_string("llama.ffn_activation", "relu")
    add_tiny_tokenizer(w)
    for name, shape, _ in tensors:
        dt = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, make in tensors:
        w.write_tensor_data(make())
    w.close()
    with open(path, "r+b") as fh:  # PowerInfer's magic: ffn_down_t and predictors, ReGLU
        fh.write(b"PWRI")
    return probs


def decode_tps(engine, n_tokens: int, repeats: int) -> tuple[float, dict]:
    """Median decode tok/s over `repeats` runs of `n_tokens` greedy steps after a short prompt,
    timed around the session's eval calls (no end-of-text stop), and the FFN counters."""
    out, stats = [], {}
    for _ in range(repeats):
        s = engine._session()
        logits = s.eval(engine.tokenize("the an the in the", add_bos=False))
        t = time.perf_counter()
        for _ in range(n_tokens):
            logits = s.eval([int(np.argmax(logits))])
        out.append(n_tokens / (time.perf_counter() - t))
        engine._ffn_stats(s, stats)
    return statistics.median(out), stats


def hbm_bandwidth() -> float:
    import torch

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / statistics.median(times)  # read + write


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--n-embd", type=int, default=5120)
    ap.add_argument("--n-ff", type=int, default=13824)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=256, help="predictor hidden size")
    ap.add_argument("--active", type=float, default=0.1, help="mean fraction of neurons that fire")
    ap.add_argument(
        "--alpha", type=float, default=0.8, help="power-law exponent of the firing frequencies"
    )
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="/tmp/hybrid_13b.gguf")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument(
        "--skip", nargs="*", default=[], help="configurations to leave out: cpu offload hybrid full"
    )
    a = ap.parse_args()

    from powerinfer_rs import Engine
    from powerinfer_rs.placement import (
        gpu_index_path,
        model_bytes,
        parse_bytes,
        plan,
        write_gpu_index,
    )

    t0 = time.time()
    probs = write_model(a.model, a.layers, a.n_embd, a.n_ff, a.heads, a.hidden, a.active, a.alpha)
    size = os.path.getsize(a.model)
    print(f"wrote {a.model}: {size / 2**30:.1f} GiB in {time.time() - t0:.0f} s", flush=True)

    budget = parse_bytes(a.budget)
    n_ctx = 256
    mb = model_bytes(a.model, n_ctx)
    p = plan(mb, probs, budget, cpu_bandwidth=50e9, gpu_bandwidth=2e12, sync_latency=20e-6)
    write_gpu_index(gpu_index_path(a.model), p.solution.gpu_neurons, a.n_ff, budget)
    layer_bytes = mb.layer_dense_bytes + mb.neuron_bytes * a.n_ff + mb.kv_cache_bytes / a.layers
    k = 0
    while k < a.layers and layer_bytes[: k + 1].sum() <= budget:
        k += 1
    print(
        f"placement: {p.dense_layers_on_gpu} layers' dense part, {sum(len(g) for g in p.solution.gpu_neurons)} hot neurons, "
        f"mean profiled hot share {float(np.mean(p.hot_share)):.2f}; layer offload fits {k} layers",
        flush=True,
    )

    results: dict[str, dict] = {}
    # The predictors use the file's cut-off (0, as PowerInfer's converter writes it): this model's
    # gates are random, so the neurons that "truly fire" are about half of them whatever the
    # predictor says, and a cut-off calibrated for recall of those would select nearly all.
    pred = dict(sparsity="predictor", sparse_threshold=0.0)
    configs = [
        ("cpu", dict(device="cpu", **pred)),
        ("offload", dict(device="cuda", sparsity="dense", gpu_layers=k)),
        ("hybrid", dict(device="cuda", vram_budget=budget, **pred)),
        ("full", dict(device="cuda", vram_budget=int(size * 1.5), **pred)),
    ]
    for name, kw in configs:
        if name in a.skip:
            continue
        t = time.time()
        e = Engine.load(a.model, n_ctx=n_ctx, **kw)
        load_s = time.time() - t
        tps, stats = decode_tps(e, a.tokens, a.repeats)
        r = dict(tps=tps, load_s=load_s, report=e.gpu_report(), stats=stats)
        results[name] = r
        print(
            f"{name:8s} {tps:8.2f} tok/s  (load {load_s:.0f} s) {json.dumps(r['report']) if r['report'] else ''}",
            flush=True,
        )
        del e

    if "full" in results:
        # A GPU layer with no cold neurons does not report its predictor's selections to the
        # host, so the full run has no ffn_sparsity; the hybrid run's (the same predictors and
        # cut-off, so the same selections) stands in for it, and the source is recorded.
        source = next(
            (
                n
                for n in ("full", "hybrid", "cpu")
                if n in results and "ffn_sparsity" in results[n]["stats"]
            ),
            None,
        )
        share = 1 - results[source]["stats"]["ffn_sparsity"] if source else 1.0
        results["full"]["selected_share"] = dict(
            value=share, measured_in=source or "none: all neurons counted"
        )
        dense = float(mb.layer_dense_bytes.sum() + mb.output_bytes)
        neurons = float(share * a.n_ff * mb.neuron_bytes.sum())
        kv = mb.kv_cache_bytes * (a.tokens / n_ctx)  # about half the positions on average, f16
        per_token = dense + neurons + kv
        bw = hbm_bandwidth()
        achieved = per_token * results["full"]["tps"]
        results["full"].update(
            bytes_per_token=per_token, hbm_copy_bandwidth=bw, hbm_fraction=achieved / bw
        )

    print("\nconfiguration   tok/s   vs offload")
    base = results.get("offload", {}).get("tps")
    for name, r in results.items():
        ratio = f"{r['tps'] / base:6.2f}x" if base else "   n/a"
        print(f"{name:13s} {r['tps']:8.2f}   {ratio}")
    if "full" in results:
        f = results["full"]
        print(
            f"full GPU: {f['bytes_per_token'] / 2**30:.2f} GiB read per token "
            f"({f['selected_share']['value']:.1%} of the neurons, as measured in {f['selected_share']['measured_in']}), "
            f"{f['hbm_fraction']:.1%} of the measured copy bandwidth ({f['hbm_copy_bandwidth'] / 1e12:.2f} TB/s)"
        )
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
