"""The GPU split for `Engine.load(device=..., vram_budget=...)`: which parts of a model go to
the GPU, and from which source.

What goes to the GPU, in the order PowerInfer fills VRAM: each layer's attention, norms and
predictor (layer by layer, while they fit), the KV cache of those layers, the output layer if
every layer fit, then the hot FFN neurons in the space left. The neuron split comes from

1. `<model>.generated.gpuidx` (PowerInfer's file, written by `powerinfer-rs place`), when its
   `split.vram_capacity` equals the budget;
2. else a profile (`profile=` or `<model>.profile.npz`), solved with the placement ILP and
   written to `<model>.generated.gpuidx`;
3. else an even split: the same share of every layer's neurons (lowest indices first), with a
   notice, since without activation counts nothing says which neurons are hot.

It picks the source and states the result; the plans, their costs and the file are
`placement`'s, and which device runs them is `device`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .placement import (
    DEFAULT_GPU_BANDWIDTH,
    DEFAULT_SYNC_LATENCY,
    dense_first,
    even_split,
    gpu_index_path,
    kv_bytes_per_layer,
    measure_cpu_bandwidth,
    model_bytes,
    neuron_mask,
    plan,
    read_gpu_masks,
    whole_ffn_fits,
    write_gpu_index,
)
from .profile_file import activation_frequencies, load_profile, require_neurons


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
    if mb.expert_bytes is not None and mb.expert_bytes.any():
        return _experts_on_cpu(mb, budget, kv_per_layer, gpu_layers)
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
    if whole_ffn_fits(mb, dense, left):
        return GpuPlacement(budget, dense, [np.full(n_ff, True) for _ in dense], output, "all")

    idx_path = gpu_index_path(path)
    masks = read_gpu_masks(idx_path, mb.n_layer, n_ff, budget)
    if masks is not None:
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
        freq = activation_frequencies(require_neurons(load_profile(profile), "GPU placement"))
        p = plan(
            mb,
            freq,
            budget,
            measure_cpu_bandwidth(),
            DEFAULT_GPU_BANDWIDTH,
            DEFAULT_SYNC_LATENCY,
            kv_type=kv_type,
        )
        assert p.dense_layers_on_gpu == sum(dense) and p.output_on_gpu == output, (
            "one rule places the dense parts"
        )
        write_gpu_index(idx_path, p.solution.gpu_neurons, n_ff, budget)
        return GpuPlacement(
            budget,
            dense,
            [neuron_mask(g, n_ff) for g in p.solution.gpu_neurons],
            output,
            "profile",
            idx_path,
            [float(h) for h in p.hot_share],
        )

    masks = even_split(mb, dense, left)
    note = (
        f"no activation profile for {os.path.basename(path)}: {int(masks[0].sum())} of {n_ff} neurons "
        "per layer go to the GPU, chosen by index; run `powerinfer-rs profile` and `place` for a "
        "measured hot set"
    )
    return GpuPlacement(budget, dense, masks, output, "even", notes=[note])


def _experts_on_cpu(mb, budget: int, kv_per_layer: float, gpu_layers: int | None) -> GpuPlacement:
    """A mixture-of-experts model: attention, norms and KV cache of the layers that fit (or of
    the first `gpu_layers`), and the output layer if all fit, go to the GPU; every layer's
    router and experts run on the CPU (llama.cpp's `-ot exps=CPU`)."""
    if gpu_layers is not None:
        if (
            not isinstance(gpu_layers, int)
            or isinstance(gpu_layers, bool)
            or not (0 <= gpu_layers <= mb.n_layer)
        ):
            raise ValueError(f"gpu_layers must be an int in [0, {mb.n_layer}], got {gpu_layers!r}")
        dense = [l < gpu_layers for l in range(mb.n_layer)]
        output, source = gpu_layers == mb.n_layer, "layers"
    else:
        dense, output, _ = dense_first(mb, budget, kv_per_layer)
        source = "experts-on-cpu"
    note = (
        f"mixture of experts: the experts of all {mb.n_layer} layers run on the CPU "
        f"({sum(mb.expert_bytes) / 2**20:.0f} MiB); attention and the KV cache of "
        f"{sum(dense)} layers on the GPU"
    )
    neurons = [np.zeros(mb.n_ff, dtype=bool) for _ in range(mb.n_layer)]
    return GpuPlacement(budget, dense, neurons, output, source, notes=[note])
