"""`powerinfer-rs place`: the hot/cold split of a model under a VRAM budget from a profile's
activation counts, written as PowerInfer's `<model>.generated.gpuidx`. The planner itself (the
integer program and its exact solver) belongs to the runtime, `powerinfer_rs.placement`, which
`Engine.load(device="cuda")` runs too.
"""

from __future__ import annotations

import math

from ..placement import (
    DEFAULT_GPU_BANDWIDTH,
    DEFAULT_SYNC_LATENCY,
    Placement,
    gpu_index_path,
    measure_cpu_bandwidth,
    model_bytes,
    parse_bytes,
    plan,
    write_gpu_index,
)
from ..profile_file import activation_frequencies, load_profile, require_neurons


def place(
    model: str,
    profile: str,
    vram_budget: str | int,
    output: str | None = None,
    cpu_bandwidth: float | None = None,
    gpu_bandwidth: float = DEFAULT_GPU_BANDWIDTH,
    sync_latency: float = DEFAULT_SYNC_LATENCY,
    group: int = 64,
    time_limit: float = 10.0,
    n_ctx: int | None = None,
    kv_type: str = "f16",
) -> Placement:
    """Solves the placement for `model` with the activation counts of `profile` (written by
    `profile`) and writes the split (default `<model>.generated.gpuidx`). Bandwidths in
    bytes/s (the CPU one measured when not given), sync latency in seconds; `n_ctx` and
    `kv_type` size the KV cache the GPU layers hold, as `Engine.load` would. The planner checks
    the bandwidths, the sync latency and `kv_type`."""
    budget = parse_bytes(vram_budget)
    if budget <= 0:
        raise ValueError(f"VRAM budget must be positive, got {vram_budget!r}")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise ValueError(f"time_limit must be a positive number, got {time_limit!r}")
    freq = activation_frequencies(require_neurons(load_profile(profile), "placement"))
    mb = model_bytes(model, n_ctx)
    cpu_bw = cpu_bandwidth if cpu_bandwidth is not None else measure_cpu_bandwidth()
    p = plan(mb, freq, budget, cpu_bw, gpu_bandwidth, sync_latency, group, time_limit, kv_type)
    p.path = output or gpu_index_path(model)
    write_gpu_index(p.path, p.solution.gpu_neurons, mb.n_ff, budget)
    return p
