"""What placing a model costs: the bytes its tensor groups take on the GPU (one FFN neuron, a
layer's dense part, the output, the KV cache), read from the GGUF file's tensor types; the CPU's
memory bandwidth; and from bytes and bandwidths C_l, the fewest GPU neurons of a layer that pay
for a CPU-GPU synchronisation.

It measures and counts; it chooses nothing (that is `planner`'s) and writes no file.
"""

from __future__ import annotations

import math
import numbers
import re
import time
from dataclasses import dataclass

import numpy as np

from .. import _core

# ----------------------------------------------------------------------------- the hardware's speeds

# what `Engine.load(device="cuda")` and `powerinfer-rs place` assume when not told the GPU's
# memory bandwidth and the cost of one CPU-GPU synchronisation
DEFAULT_GPU_BANDWIDTH = 1000e9  # bytes/s
DEFAULT_SYNC_LATENCY = 20e-6  # seconds


def min_gpu_neurons(
    neuron_bytes: float, cpu_bandwidth: float, gpu_bandwidth: float, sync_latency: float, n_ff: int
) -> int:
    """C_l: the fewest neurons for which the GPU plus one synchronisation beats the CPU;
    n_ff + 1 (never) when the GPU is not faster per neuron. Bandwidths in bytes/s must be
    positive; the sync latency in seconds may be 0 (then any number of neurons pays)."""
    for name, value in (("cpu_bandwidth", cpu_bandwidth), ("gpu_bandwidth", gpu_bandwidth)):
        if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number of bytes/s, got {value!r}")
    if not (
        isinstance(sync_latency, numbers.Real) and math.isfinite(sync_latency) and sync_latency >= 0
    ):
        raise ValueError(f"sync_latency must be a number of seconds >= 0, got {sync_latency!r}")
    t_cpu = neuron_bytes / cpu_bandwidth
    t_gpu = neuron_bytes / gpu_bandwidth
    if t_cpu <= t_gpu:
        return n_ff + 1
    return int(math.ceil(sync_latency / (t_cpu - t_gpu)))


def measure_cpu_bandwidth(n_bytes: int = 256 << 20, repeats: int = 3) -> float:
    """Bytes per second one pass of summing a large array reads (a rough stream bandwidth)."""
    a = np.ones(n_bytes // 4, dtype=np.float32)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best


# ----------------------------------------------------------------------------- the model's bytes

_FFN_NEURON_TENSORS = (
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down_t.weight",
    "ffn_down.weight",
    "ffn_up.bias",
)


@dataclass
class ModelBytes:
    n_layer: int
    n_ff: int
    neuron_bytes: np.ndarray  # (n_layer,) bytes of one FFN neuron (gate + up + down rows)
    layer_dense_bytes: np.ndarray  # (n_layer,) attention, norms, predictor, other FFN tensors
    output_bytes: int  # output matrix (the tied embedding when there is none) and output norm
    kv_cache_bytes: int  # f16 K and V for n_ctx positions, all layers
    # (n_layer,) bytes of a layer's whole FFN on the GPU: there a plain file's `ffn_down` is read
    # in its own type, not as the F16 neuron-major copy a split needs; None: n_ff neurons' bytes
    whole_ffn_bytes: np.ndarray | None = None
    # (n_layer,) a mixture-of-experts layer's experts (`ffn_*_exps`; zero in a dense layer).
    # Its router and shared expert are in the dense part, which they go to the GPU with
    expert_bytes: np.ndarray | None = None

    def whole_ffn(self) -> np.ndarray:
        return (
            self.whole_ffn_bytes
            if self.whole_ffn_bytes is not None
            else self.neuron_bytes * self.n_ff
        )


def model_bytes(path: str, n_ctx: int | None = None, config: dict | None = None) -> ModelBytes:
    """Real bytes per tensor group, from the file's tensor types. `config` is the loaded model's
    (`Engine.config`), when there is one, so the file is not opened as a model a second time."""
    f = _core.GgufFile(path)
    cfg = config if config is not None else _core.Model(path, 1).config()
    n_layer, n_ff = cfg["n_layer"], cfg["n_ff"]
    n_ctx = n_ctx or min(cfg["n_ctx_train"], 4096)
    neuron = np.zeros(n_layer)
    whole = np.zeros(n_layer)
    dense = np.zeros(n_layer)
    experts = np.zeros(n_layer)
    # a plain file wholly on the GPU reads its own ffn_down rows (hybrid.rs, `HotDown::Rows`)
    own_down = not cfg.get("has_predictors", False)
    output = 0
    has_output = any(t["name"] == "output.weight" for t in f.tensors())
    for t in f.tensors():
        name = t["name"]
        m = re.match(r"blk\.(\d+)\.(.+)$", name)
        if m:
            l, rest = int(m.group(1)), m.group(2)
            if "_exps." in rest:
                experts[l] += t["n_bytes"]
            elif rest == "ffn_down.weight":
                # neurons read the neuron-major copy the engine builds: F32 for F32, else F16
                neuron[l] += cfg["n_embd"] * (4 if t["type"] == "F32" else 2)
                whole[l] += (
                    t["n_bytes"]
                    if own_down
                    else cfg["n_embd"] * (4 if t["type"] == "F32" else 2) * n_ff
                )
            elif rest in _FFN_NEURON_TENSORS:
                neuron[l] += t["n_bytes"] / n_ff
                whole[l] += t["n_bytes"]
            else:
                dense[l] += t["n_bytes"]
        elif name in ("output.weight", "output_norm.weight", "output_norm.bias") or (
            name == "token_embd.weight" and not has_output
        ):
            output += t["n_bytes"]
    kv = 2 * n_layer * n_ctx * cfg["n_head_kv"] * cfg["head_dim"] * 2
    return ModelBytes(n_layer, n_ff, neuron, dense, int(output), int(kv), whole, experts)


def kv_bytes_per_layer(mb: ModelBytes, kv_type: str) -> float:
    """One layer's KV cache in `kv_type` ("f16" or "f32"; `model_bytes` counts f16)."""
    if kv_type not in ("f16", "f32"):
        raise ValueError(f"kv_type must be 'f16' or 'f32', got {kv_type!r}")
    return mb.kv_cache_bytes / mb.n_layer * (2 if kv_type == "f32" else 1)
