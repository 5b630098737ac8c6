"""`powerinfer-rs place`: the hot/cold split of a model under a VRAM budget from a profile's
activation counts, written as PowerInfer's `<model>.generated.gpuidx`. The planner itself (the
integer program and its exact solver) belongs to the runtime, `powerinfer_rs.placement`, which
`Engine.load(device="cuda")` runs too.
"""

from __future__ import annotations

import math

from ..placement import (
    Placement,
    gpu_index_path,
    measure_cpu_bandwidth,
    model_bytes,
    parse_bytes,
    plan,
    write_gpu_index,
)
from ..profile_file import load_profile


def place(
    model: str,
    profile: str,
    vram_budget: str | int,
    output: str | None = None,
    cpu_bandwidth: float | None = None,
    gpu_bandwidth: float = 1000e9,
    sync_latency: float = 20e-6,
    group: int = 64,
    time_limit: float = 10.0,
    n_ctx: int | None = None,
    kv_type: str = "f16",
) -> Placement:
    """Solves the placement for `model` with the activation counts of `profile` (written by
    `profile`) and writes the split (default `<model>.generated.gpuidx`). Bandwidths in
    bytes/s (the CPU one measured when not given), sync latency in seconds; `n_ctx` and
    `kv_type` size the KV cache the GPU layers hold, as `Engine.load` would."""
    budget = parse_bytes(vram_budget)
    if budget <= 0:
        raise ValueError(f"VRAM budget must be positive, got {vram_budget!r}")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    if kv_type not in ("f16", "f32"):
        raise ValueError(f"kv_type must be 'f16' or 'f32', got {kv_type!r}")
    for name, v in (
        ("gpu_bandwidth", gpu_bandwidth),
        ("sync_latency", sync_latency),
        ("time_limit", time_limit),
    ):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive number, got {v!r}")
    prof = load_profile(profile)
    freq = [c / max(prof["n_tokens"], 1) for c in prof["counts"]]
    mb = model_bytes(model, n_ctx)
    cpu_bw = cpu_bandwidth if cpu_bandwidth is not None else measure_cpu_bandwidth()
    p = plan(mb, freq, budget, cpu_bw, gpu_bandwidth, sync_latency, group, time_limit, kv_type)
    p.path = output or gpu_index_path(model)
    write_gpu_index(p.path, p.solution.gpu_neurons, mb.n_ff, budget)
    return p
