"""Hot/cold neuron placement under a VRAM budget: the integer program of the PowerInfer paper
(section 6), solved to proven optimality, written as PowerInfer's `<model>.generated.gpuidx`.
`Engine.load(device="cuda")` (`gpu.plan_gpu`) and `powerinfer-rs place` both plan with it.

Modules, in the order a plan flows through them: `units` (byte counts in and out), `costs` (the
bytes of a model's parts, the CPU bandwidth, C_l), `program` (the integer program: `Instance`,
`Solution`, `greedy`), `solver` (`solve`: the exact solver, HiGHS as the general path),
`planner` (`plan`: dense parts first, then the neurons), `gpu_index` (the `.gpuidx` file).
This file only hands their names on.
"""

from .costs import (
    DEFAULT_GPU_BANDWIDTH,
    DEFAULT_SYNC_LATENCY,
    ModelBytes,
    kv_bytes_per_layer,
    measure_cpu_bandwidth,
    min_gpu_neurons,
    model_bytes,
)
from .gpu_index import (
    gpu_index_path,
    neuron_mask,
    read_gpu_index,
    read_gpu_masks,
    write_gpu_index,
)
from .planner import Placement, dense_first, even_split, plan, whole_ffn_fits
from .program import Instance, Solution, greedy
from .program import _used_bytes as _used_bytes  # checks a placement's bytes in the tests
from .solver import exact, solve
from .units import format_bytes, parse_bytes

__all__ = [
    "parse_bytes",
    "format_bytes",
    "DEFAULT_GPU_BANDWIDTH",
    "DEFAULT_SYNC_LATENCY",
    "ModelBytes",
    "model_bytes",
    "kv_bytes_per_layer",
    "measure_cpu_bandwidth",
    "min_gpu_neurons",
    "Instance",
    "Solution",
    "greedy",
    "exact",
    "solve",
    "Placement",
    "dense_first",
    "whole_ffn_fits",
    "even_split",
    "plan",
    "gpu_index_path",
    "read_gpu_index",
    "read_gpu_masks",
    "neuron_mask",
    "write_gpu_index",
]
