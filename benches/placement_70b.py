"""Placement solve time on a 70B-shaped instance: 80 layers x 28672 FFN neurons, groups of 64
(35,840 group variables plus one per layer), power-law activation frequencies, the byte sizes of
a Q4_0 LLaMA-2-70B neuron (gate + up + down rows of 8192 values), per-layer minimum C_l from
the given bandwidths. Reports the greedy solution and the exact solver (the default of
`placement.solve`), and with --highs the integer program solved by HiGHS as well. The last line
is the exact solver's: `placement: exact objective <value> in <seconds> s, optimal: yes|no`.

    python benches/placement_70b.py [--budget 24GiB] [--seed 0] [--highs [--time-limit 60] [--mip-gap 1e-4]]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from powerinfer_rs import placement as pl


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--budget", default="16GiB", help="bytes for FFN neurons (default 16GiB)")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--n-ff", type=int, default=28672)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument(
        "--highs", action="store_true", help="also solve the integer program with HiGHS (seconds)"
    )
    ap.add_argument("--time-limit", type=float, default=60.0, help="HiGHS time limit in seconds")
    ap.add_argument(
        "--mip-gap", type=float, default=1e-4, help="HiGHS relative gap (default 1e-4, as `solve`)"
    )
    ap.add_argument("--cpu-bandwidth", type=float, default=50e9)
    ap.add_argument("--gpu-bandwidth", type=float, default=pl.costs.DEFAULT_GPU_BANDWIDTH)
    ap.add_argument("--sync-latency", type=float, default=pl.costs.DEFAULT_SYNC_LATENCY)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    rng = np.random.default_rng(a.seed)
    # power law per layer, hotter early layers (as profiles of ReLU models show), plus noise
    freq = []
    for l in range(a.layers):
        alpha = 0.9 + 0.6 * l / a.layers
        ranks = rng.permutation(a.n_ff) + 1
        freq.append(
            np.minimum(1.0, 0.9 * ranks ** (-alpha) * a.n_ff ** (alpha * 0.35))
            + rng.random(a.n_ff) * 1e-4
        )
    neuron_bytes = np.full(a.layers, 3 * 8192 / 32 * 18)  # Q4_0: 18 bytes per 32 values, 3 rows
    mins = np.array(
        [
            pl.min_gpu_neurons(b, a.cpu_bandwidth, a.gpu_bandwidth, a.sync_latency, a.n_ff)
            for b in neuron_bytes
        ]
    )
    # layers whose frequency differs get different minimums in practice; vary the sync cost a little
    mins = (mins * rng.uniform(0.5, 2.0, a.layers)).astype(int)
    budget = pl.parse_bytes(a.budget)
    inst = pl.Instance(freq, neuron_bytes, budget, mins, a.group)
    print(
        f"instance: {a.layers} layers x {a.n_ff} neurons, groups of {a.group} -> "
        f"{sum(len(v) for v in inst.group_value)} group variables + {int((mins > 0).sum())} layer variables; "
        f"budget {pl.format_bytes(budget)}, C_l {mins.min()}..{mins.max()} neurons; {os.cpu_count()} cores"
    )
    t0 = time.perf_counter()
    g = pl.greedy(inst)
    tg = time.perf_counter() - t0
    print(f"greedy: objective {g.objective:.10g} in {tg:.3f} s")
    # `solve` as the library runs it: greedy as one incumbent, then the exact solver
    s = pl.solve(inst, solver="exact")
    print(
        f"exact : objective {s.objective:.10g} in {s.seconds:.3f} s (optimal: {_yes(s.optimal)}; {s.status})"
    )
    if g.objective > 0:
        print(f"exact / greedy objective: {s.objective / g.objective:.7f}")
    if a.highs:
        h = pl.solve(inst, solver="highs", time_limit=a.time_limit, mip_gap=a.mip_gap)
        print(
            f"HiGHS : objective {h.objective:.10g} in {h.seconds:.2f} s (optimal: {_yes(h.optimal)}; {h.method}, "
            f"{h.status}, bound {h.bound:.10g})"
        )
        print(f"exact - HiGHS objective: {s.objective - h.objective:.3g}")
    n_gpu = sum(len(n) for n in s.gpu_neurons)
    print(
        f"GPU neurons {n_gpu} of {a.layers * a.n_ff} ({n_gpu / (a.layers * a.n_ff):.1%}), "
        f"layers used {sum(1 for n in s.gpu_neurons if len(n))}"
    )
    print(
        f"placement: {s.method} objective {s.objective:.10g} in {s.seconds:.3f} s, optimal: {_yes(s.optimal)}"
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


if __name__ == "__main__":
    main()
