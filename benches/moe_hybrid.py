"""Hot experts on the GPU against llama.cpp's `--n-cpu-moe` split at the same VRAM budget, and
against every expert on the CPU: decode tok/s, and prefill tok/s of a 128-token prompt, of one
synthetic mixture of experts in the shape of
Qwen3-30B-A3B's layers (n_embd 2048, 32 query and 4 KV heads of 128, 128 experts of 768, 8 used;
Q4_K experts), whose routers favour a few experts per layer as trained routers do (`skew` in
tests/synth.py; random routers spread tokens almost evenly). `--arch gpt-oss`: gpt-oss-20b's
layers instead (n_embd 2880, 64 query and 8 KV heads of 64 with sinks, 32 experts of 2880, 4
used, biases; MXFP4 experts, the rest Q8_0).

The budget holds attention, norms and KV cache of every layer plus `--share` of the experts'
bytes. "hot": the most routed experts of every layer under that budget (from an expert profile
of the model on random text); "n-cpu-moe": whole layers' experts on the GPU, the experts of the
first N layers on the CPU, N chosen so that the GPU holds the same share; "cpu": the CPU alone.

    python benches/moe_hybrid.py --device cuda --out moe_hybrid.json      # on a GPU machine
    python benches/moe_hybrid.py --arch gpt-oss --out moe_hybrid_gpt_oss.json
    python benches/moe_hybrid.py --device emulated --layers 2 --experts 16 --embd 256 --ff 256 \\
        --heads 4 --kv-heads 2 --gen-tokens 4 --repeats 1                  # a check of the path
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def write(path: Path, a) -> None:
    from gguf import GGMLQuantizationType as Q
    from synth import write_model

    if path.exists():
        return
    tmp = path.with_suffix(".tmp")
    experts = dict(n_expert=a.experts, n_used=a.used, n_ff_exp=a.ff, skew=a.skew)
    if a.arch == "gpt-oss":
        # its files' layout: MXFP4 experts, the rest 8-bit; every other layer sliding, YaRN
        kw = dict(dtype=Q.Q8_0, head_dim=64, sliding_window=128, rope_base=150000.0)
        kw.update(rope_scaling=32.0, yarn_original_ctx=4096)
        experts["dtype"] = Q.MXFP4
    else:
        kw = dict(dtype=Q.Q4_K, head_dim=a.embd * 2 // a.heads)
    write_model(
        tmp,
        arch=a.arch,
        n_layer=a.layers,
        n_embd=a.embd,
        n_head=a.heads,
        n_head_kv=a.kv_heads,
        n_ff=a.ff * a.used,
        n_ctx=4096,
        seed=7,
        experts=experts,
        **kw,
    )
    tmp.rename(path)


def decode_rate(engine, prompt: list[int], n: int) -> tuple[float, float | None]:
    """Decode tok/s of n greedy tokens after `prompt`, and the GPU's share of computed neurons."""
    from powerinfer_rs import _core

    s = engine._session(len(prompt) + n + 8)
    s.truncate(0)
    greedy = _core.Sampler(temperature=0.0)
    tok = s.eval_and_sample(prompt, greedy)
    s.take_split()  # (counted from here)
    t = time.perf_counter()
    for _ in range(n):
        tok = s.eval_and_sample([tok], greedy)
    rate = n / (time.perf_counter() - t)
    split = s.take_split()
    share = None
    if split and (split["gpu_neurons"] + split["cpu_neurons"]):
        share = split["gpu_neurons"] / (split["gpu_neurons"] + split["cpu_neurons"])
    return rate, share


def prefill_rate(engine, prompt: list[int]) -> float:
    """Prompt tok/s of `prompt` evaluated from an empty context."""
    s = engine._session(len(prompt) + 8)
    s.truncate(0)
    t = time.perf_counter()
    s.eval(prompt)
    return len(prompt) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "emulated"])
    ap.add_argument("--arch", default="qwen3moe", choices=["qwen3moe", "gpt-oss"])
    ap.add_argument("--layers", type=int, default=8)
    # (the shape's defaults: Qwen3-30B-A3B's, or gpt-oss-20b's with --arch gpt-oss)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--used", type=int)
    ap.add_argument("--ff", type=int)
    ap.add_argument("--embd", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--skew", type=float, default=0.1)
    ap.add_argument("--share", type=float, default=0.25, help="share of expert bytes in VRAM")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: all)")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/powerinfer-moe-hybrid")
    ap.add_argument("--out", default=None, help="JSON file of the results")
    a = ap.parse_args()
    shape = {
        "qwen3moe": dict(experts=128, used=8, ff=768, embd=2048, heads=32, kv_heads=4),
        "gpt-oss": dict(experts=32, used=4, ff=2880, embd=2880, heads=64, kv_heads=8),
    }[a.arch]
    for k, v in shape.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    from powerinfer_rs import Engine
    from powerinfer_rs.offline import profile
    from powerinfer_rs.placement import model_bytes

    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / (
        f"{a.arch}-{a.layers}l-{a.experts}x{a.ff}-{a.embd}-skew{a.skew}.gguf".replace("/", "_")
    )
    write(path, a)
    n_ctx = 256
    threads = a.threads or os.cpu_count() or 1
    cpu = Engine.load(str(path), device="cpu", n_ctx=n_ctx, threads=threads)
    corpus = workdir / "corpus.txt"
    rng = np.random.default_rng(1)
    corpus.write_text(" ".join("".join(rng.choice(list("etaoinshrdlu"), 5)) for _ in range(3000)))
    prof = profile(cpu, str(corpus), tokens=4096, window=256, plot=False, progress=False)
    counts = prof["counts"].astype(np.float64)
    top = np.sort(counts, axis=1)[:, ::-1]
    k = max(1, round(a.share * a.experts))
    routed_by_top = float(top[:, :k].sum() / counts.sum())

    mb = model_bytes(str(path), n_ctx)
    budget = int(
        sum(mb.layer_dense_bytes)
        + mb.kv_cache_bytes
        + mb.output_bytes
        + a.share * float(sum(mb.expert_bytes))
    )
    n_cpu_moe = a.layers - round(a.share * a.layers)
    engines = {
        "cpu": cpu,
        "hot": Engine.load(
            str(path),
            device=a.device,
            n_ctx=n_ctx,
            threads=threads,
            vram_budget=budget,
            profile=prof["path"],
        ),
        "n-cpu-moe": Engine.load(
            str(path), device=a.device, n_ctx=n_ctx, threads=threads, n_cpu_moe=n_cpu_moe
        ),
    }
    prompt = rng.integers(3, 260, size=16).tolist()
    long_prompt = rng.integers(3, 260, size=128).tolist()
    rates = {name: [] for name in engines}
    prefill = {name: [] for name in engines}
    shares = {}
    for e in engines.values():
        decode_rate(e, prompt, 2)
    for _ in range(a.repeats):
        for name, e in engines.items():
            r, share = decode_rate(e, prompt, a.gen_tokens)
            rates[name].append(r)
            shares[name] = share
            prefill[name].append(prefill_rate(e, long_prompt))
    med = {name: statistics.median(v) for name, v in rates.items()}
    med_prefill = {name: statistics.median(v) for name, v in prefill.items()}
    reports = {n: e.gpu_report() for n, e in engines.items() if e.gpu_report() is not None}
    print(
        f"{path.name}: budget {budget / 2**20:.0f} MiB ({a.share:.0%} of the experts), "
        f"device {a.device}, {threads} CPU threads; the top {k} experts of a layer take "
        f"{routed_by_top:.0%} of its routings"
    )
    print(
        "| split | experts on the GPU | routed neurons on the GPU | decode tok/s | prefill tok/s |"
    )
    print("|---|---|---|---|---|")
    for name in engines:
        r = reports.get(name)
        placed = f"{r['hot_experts']} of {r['total_experts']}" if r else "0"
        sh = shares.get(name)
        print(
            f"| {name} | {placed} | {'-' if sh is None else f'{sh:.0%}'} | {med[name]:.1f} "
            f"| {med_prefill[name]:.1f} |"
        )
    ratio_split = [h / n for h, n in zip(rates["hot"], rates["n-cpu-moe"])]
    ratio_cpu = [h / c for h, c in zip(rates["hot"], rates["cpu"])]
    print(
        f"hot / n-cpu-moe: {statistics.median(ratio_split):.2f}x; "
        f"hot / cpu: {statistics.median(ratio_cpu):.2f}x"
    )
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    "model": path.name,
                    "device": a.device,
                    "budget": budget,
                    "share": a.share,
                    "routed_by_top_share": routed_by_top,
                    "decode_tok_s": med,
                    "prefill_tok_s": med_prefill,
                    "prefill_tokens": len(long_prompt),
                    "gpu_neuron_share": shares,
                    "reports": reports,
                    "hot_over_n_cpu_moe": statistics.median(ratio_split),
                    "hot_over_cpu": statistics.median(ratio_cpu),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
