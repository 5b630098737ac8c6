"""GPU benchmark on the real model: SmolLM2-135M-Instruct (Q4_1 + Q8_0) on the CPU, wholly on
the GPU (each token's recorded kernels replayed, and launched one by one), and split about half and half (dense parts and half the neurons on the GPU), in one
process on the same file. For each: the mean relative L2 distance of the logits from a float64
forward pass of the same weights (tests/reference.py) along the CPU's greedy continuation of a
prompt, how often the top token equals float64's, and decode and prefill tok/s.

    python benches/gpu_smollm2.py --out smollm2.json     # on a GPU machine (scripts/gpu_suite.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from powerinfer_rs import Engine
from powerinfer_rs.models import default_model_path
from powerinfer_rs.placement import model_bytes
from reference import forward, read_weights

N_CTX = 512


def decode_tps(engine: Engine, prompt: list[int], n: int) -> float:
    """Greedy decode of `n` tokens, one `eval` per token (no end-of-text stop)."""
    s = engine._session()
    tok = int(np.atleast_2d(s.eval(prompt))[-1].argmax())
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.atleast_2d(s.eval([tok]))[-1].argmax())
    return n / (time.perf_counter() - t0)


def decode_steps_ms(engine: Engine, prompt: list[int], n: int) -> dict[str, float]:
    """Milliseconds per decoded token in each step of the forward pass (`step_times`), from
    one greedy decode of `n` tokens timed apart from the tok/s rounds."""
    s = engine._session()
    s.set_step_times(True)
    tok = int(np.atleast_2d(s.eval(prompt))[-1].argmax())
    s.take_step_times()  # the prompt's
    for _ in range(n):
        tok = int(np.atleast_2d(s.eval([tok]))[-1].argmax())
    times = s.take_step_times()
    times.pop("passes")
    return {step: round(sec * 1e3 / n, 4) for step, sec in times.items() if sec > 0}


def prefill_tps(engine: Engine, ids: list[int], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.logits(ids)
        best = min(best, time.perf_counter() - t0)
    return len(ids) / best


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--decode-tokens", type=int, default=128)
    args = ap.parse_args()

    path = default_model_path()
    cpu = Engine.load(path, device="cpu", n_ctx=N_CTX)
    prompt = cpu.tokenize("The three primary colors are")
    ids = prompt + cpu.tokenize(cpu.generate(prompt, max_tokens=32, temperature=0.0), add_bos=False)
    w, meta = read_weights(path)
    ref = forward(w, meta, ids)
    long_prompt = cpu.tokenize("Write a short story about a lighthouse keeper. " * 12)

    mb = model_bytes(path, N_CTX)
    dense = int(sum(mb.layer_dense_bytes) + mb.kv_cache_bytes + mb.output_bytes)
    half = dense + int(0.5 * mb.n_ff * float(np.sum(mb.neuron_bytes)))
    # cuda_full_launched: the same as cuda_full with each kernel launched (POWERINFER_CUDA_GRAPH=0)
    # instead of each token's recorded kernels replayed
    configs = {
        "cpu": dict(device="cpu"),
        "cuda_full": dict(device="cuda"),
        "cuda_full_launched": dict(device="cuda"),
        "cuda_half": dict(device="cuda", vram_budget=half),
    }
    results = {}
    for name, kwargs in configs.items():
        os.environ["POWERINFER_CUDA_GRAPH"] = "0" if name.endswith("_launched") else "1"
        e = cpu if name == "cpu" else Engine.load(path, n_ctx=N_CTX, **kwargs)
        got = e.logits(ids).astype(np.float64)
        err = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
        r = {
            "mean_rel_err_vs_float64": float(err.mean()),
            "top1_eq_float64": int((got.argmax(1) == ref.argmax(1)).sum()),
            "positions": len(ids),
            "decode_tps": decode_tps(e, prompt, args.decode_tokens),
            "prefill_tps": prefill_tps(e, long_prompt),
            "prefill_tokens": len(long_prompt),
        }
        if e.gpu_report() is not None:
            rep = e.gpu_report()
            r["hot_neuron_fraction"] = rep["hot_neuron_fraction"]
            r["layers_on_gpu"] = rep["layers_on_gpu"]
            r["prompt_rows"] = rep["prompt_rows"]
            r["gpu_neuron_share"] = e.last_stats.get("gpu_neuron_share")
        results[name] = r
        print(name, json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
