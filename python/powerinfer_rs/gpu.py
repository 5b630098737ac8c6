"""Device selection and GPU placement for `Engine.load(device=..., vram_budget=...)`.

What goes to the GPU, in the order PowerInfer fills VRAM: each layer's attention, norms and
predictor (layer by layer, while they fit), the KV cache of those layers, the output layer if
every layer fit, then the hot FFN neurons in the space left. The neuron split comes from

1. `<model>.generated.gpuidx` (PowerInfer's file, written by `powerinfer-rs place`), when its
   `split.vram_capacity` equals the budget;
2. else a profile (`profile=` or `<model>.profile.npz`), solved with the placement ILP and
   written to `<model>.generated.gpuidx`;
3. else an even split: the same share of every layer's neurons (lowest indices first), with a
   notice, since without activation counts nothing says which neurons are hot.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import numpy as np

from . import _core
from .placement import (
    dense_first,
    gpu_index_path,
    kv_bytes_per_layer,
    measure_cpu_bandwidth,
    model_bytes,
    plan,
    write_gpu_index,
)
from .profile_file import load_profile

# what `Engine.load(device=...)` and `--device` accept
DEVICES = ("auto", "cpu", "cuda", "emulated")


def notice(msg: str) -> None:
    print(f"powerinfer-rs: {msg}", file=sys.stderr)


def cuda_available() -> tuple[bool, str]:
    """(usable, why not)."""
    try:
        devices = _core.cuda_devices()
    except _core.CudaUnavailableError as e:
        return False, str(e)
    return bool(devices), "no CUDA device"


@dataclass
class GpuPlacement:
    """The split handed to `_core.GpuModel`, and where it came from."""

    budget: int
    dense_on_gpu: list[bool]
    neuron_on_gpu: list[np.ndarray]
    output_on_gpu: bool
    source: str  # "gpuidx", "profile", "even", "all", "layers"
    gpuidx_path: str | None = None
    hot_share: list[float] | None = (
        None  # per layer, from a profile: activations the GPU neurons carry
    )
    notes: list[str] = field(default_factory=list)


def plan_gpu(
    path: str,
    budget: int,
    n_ctx: int,
    kv_type: str,
    profile: str | None = None,
    gpu_layers: int | None = None,
    config: dict | None = None,
) -> GpuPlacement:
    """The GPU split for `path` under `budget` bytes (see the module doc). `gpu_layers` asks for
    llama.cpp-style layer offload instead: the first `gpu_layers` layers wholly on the GPU.
    `config` is the loaded model's, so the file is not opened as a model again."""
    mb = model_bytes(path, n_ctx, config)
    kv_per_layer = kv_bytes_per_layer(mb, kv_type)
    n_ff = mb.n_ff
    if gpu_layers is not None:
        if (
            not isinstance(gpu_layers, int)
            or isinstance(gpu_layers, bool)
            or not (0 <= gpu_layers <= mb.n_layer)
        ):
            raise ValueError(f"gpu_layers must be an int in [0, {mb.n_layer}], got {gpu_layers!r}")
        dense = [l < gpu_layers for l in range(mb.n_layer)]
        neurons = [np.full(n_ff, l < gpu_layers) for l in range(mb.n_layer)]
        return GpuPlacement(budget, dense, neurons, gpu_layers == mb.n_layer, "layers")

    dense, output, left = dense_first(mb, budget, kv_per_layer)
    if not any(dense):
        raise ValueError(
            f"VRAM budget of {budget} bytes does not hold layer 0's attention, norms and KV cache "
            f"({int(mb.layer_dense_bytes[0] + kv_per_layer)} bytes); use a larger budget or device='cpu'"
        )
    # every FFN wholly on the GPU: plain files then read their own ffn_down (fewer bytes)
    ffn_total = float(np.sum(mb.whole_ffn()))
    if left >= ffn_total and all(dense):
        return GpuPlacement(budget, dense, [np.full(n_ff, d) for d in dense], output, "all")

    idx_path = gpu_index_path(path)
    if os.path.exists(idx_path):
        index = _core.read_gpu_index(idx_path)
        if index["vram_capacity"] == budget and len(index["gpu_idx"]) == mb.n_layer:
            masks = [np.asarray(m).astype(bool) for m in index["gpu_idx"]]
            if any(len(m) != n_ff for m in masks):
                raise _core.ModelError(
                    f"{idx_path} does not match the model's {n_ff} neurons per layer"
                )
            # a file planned elsewhere may give neurons to layers whose dense part does not fit
            # here: the executor runs hot neurons only in GPU layers, so say what is left out
            dropped = sum(int(m.sum()) for m, d in zip(masks, dense) if not d)
            notes = []
            if dropped:
                masks = [m & d for m, d in zip(masks, dense)]
                notes.append(
                    f"{idx_path} places {dropped} neurons in layers whose attention and KV cache do not fit "
                    f"in {budget} bytes; those stay on the CPU"
                )
            return GpuPlacement(budget, dense, masks, output, "gpuidx", idx_path, notes=notes)

    if profile is None and os.path.exists(path + ".profile.npz"):
        profile = path + ".profile.npz"
    if profile is not None:
        prof = load_profile(profile)
        freq = [np.asarray(c, dtype=np.float64) / max(prof["n_tokens"], 1) for c in prof["counts"]]
        p = plan(mb, freq, budget, measure_cpu_bandwidth(), 1000e9, 20e-6, kv_type=kv_type)
        assert p.dense_layers_on_gpu == sum(dense) and p.output_on_gpu == output, (
            "one rule places the dense parts"
        )
        masks = []
        for g in p.solution.gpu_neurons:
            m = np.zeros(n_ff, dtype=bool)
            m[np.asarray(g, dtype=np.int64)] = True
            masks.append(m)
        write_gpu_index(idx_path, p.solution.gpu_neurons, n_ff, budget)
        return GpuPlacement(
            budget, dense, masks, output, "profile", idx_path, [float(h) for h in p.hot_share]
        )

    # no counts: the same share of every GPU layer's neurons
    per_layer_bytes = np.asarray(mb.neuron_bytes, dtype=np.float64)
    gpu_layers_bytes = float(sum(b for b, d in zip(per_layer_bytes, dense) if d))
    k = int(min(n_ff, left // max(gpu_layers_bytes, 1.0))) if gpu_layers_bytes else 0
    masks = [np.arange(n_ff) < (k if d else 0) for d in dense]
    note = (
        f"no activation profile for {os.path.basename(path)}: {k} of {n_ff} neurons per layer go to the GPU, "
        "chosen by index; run `powerinfer-rs profile` and `place` for a measured hot set"
    )
    return GpuPlacement(budget, dense, masks, output, "even", notes=[note])
