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

from . import _core
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
    # mixture-of-experts models: per layer, per expert, on the GPU
    expert_on_gpu: list[np.ndarray] | None = None


def plan_gpu(
    path: str,
    budget: int,
    n_ctx: int,
    kv_type: str,
    profile: str | None = None,
    gpu_layers: int | None = None,
    config: dict | None = None,
    n_cpu_moe: int | None = None,
) -> GpuPlacement:
    """The GPU split for `path` under `budget` bytes (see the module doc). `gpu_layers` asks for
    llama.cpp-style layer offload instead: the first `gpu_layers` layers wholly on the GPU.
    `config` is the loaded model's, so the file is not opened as a model again. Mixtures of
    experts place experts instead of neurons (`_expert_plan`); `n_cpu_moe` is llama.cpp's split
    for them."""
    mb = model_bytes(path, n_ctx, config)
    kv_per_layer = kv_bytes_per_layer(mb, kv_type)
    n_ff = mb.n_ff
    if mb.expert_bytes is not None and mb.expert_bytes.any():
        cfg = config if config is not None else _core.Model(path, 1).config()
        return _expert_plan(path, mb, cfg, budget, kv_per_layer, gpu_layers, n_cpu_moe, profile)
    if n_cpu_moe is not None:
        raise ValueError("n_cpu_moe places experts: this model is not a mixture of experts")
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


def _layer_count(value, name: str, n_layer: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not (0 <= value <= n_layer):
        raise ValueError(f"{name} must be an int in [0, {n_layer}], got {value!r}")
    return value


def _expert_plan(
    path: str,
    mb,
    cfg: dict,
    budget: int,
    kv_per_layer: float,
    gpu_layers: int | None,
    n_cpu_moe: int | None,
    profile: str | None,
) -> GpuPlacement:
    """A mixture-of-experts model's split. Attention, norms and KV cache go first, layer by
    layer (a router and a shared expert with their layer), then the output layer (as for dense
    models). Then the experts of the GPU layers, most routings per byte first (from an expert
    profile: `profile`, or `<model>.profile.npz`), while they fit: within a layer the experts
    have one size, so that is its most routed ones, and where every layer's experts have one
    type it is the split that serves the most routings from the GPU; without a profile, the
    same number per layer, lowest indices first.

    `n_cpu_moe` is llama.cpp's `--n-cpu-moe N`: every layer on the GPU, the experts of the first
    N on the CPU, the others' on the GPU; `gpu_layers` its `-ngl N`: the first N layers wholly
    on the GPU, experts included. Both ignore the budget, as llama.cpp does."""
    n_layer, n_expert = mb.n_layer, cfg["experts"]["n_expert"]
    per_expert = mb.expert_bytes / n_expert  # (n_layer,) bytes of one expert's three matrices
    notes: list[str] = []
    if n_cpu_moe is not None:
        n_cpu_moe = _layer_count(n_cpu_moe, "n_cpu_moe", n_layer)
        dense, output = [True] * n_layer, True
        experts = [np.full(n_expert, l >= n_cpu_moe) for l in range(n_layer)]
        source = "n-cpu-moe"
    elif gpu_layers is not None:
        gpu_layers = _layer_count(gpu_layers, "gpu_layers", n_layer)
        dense, output = [l < gpu_layers for l in range(n_layer)], gpu_layers == n_layer
        experts = [np.full(n_expert, l < gpu_layers) for l in range(n_layer)]
        source = "layers"
    else:
        dense, output, left = dense_first(mb, budget, kv_per_layer)
        if profile is None and os.path.exists(path + ".profile.npz"):
            profile = path + ".profile.npz"
        experts = [np.zeros(n_expert, dtype=bool) for _ in range(n_layer)]
        if profile is not None:
            p = load_profile(profile)
            if p["unit"] != "expert" or p["counts"].shape != (n_layer, n_expert):
                raise ValueError(
                    f"{profile} is not an expert profile of this model (write one with "
                    "`powerinfer-rs profile`)"
                )
            freq = np.asarray(p["counts"], dtype=np.float64)
            source = "profile"
        else:
            # no counts: the same share of every layer, lowest indices first
            freq = -np.tile(np.arange(n_expert, dtype=np.float64), (n_layer, 1))
            source = "even"
            notes.append(
                f"no expert profile for {os.path.basename(path)}: the experts on the GPU are "
                "chosen by index; run `powerinfer-rs profile` for the most routed ones"
            )
        order = sorted(
            ((l, e) for l in range(n_layer) if dense[l] for e in range(n_expert)),
            key=lambda le: (-freq[le] / per_expert[le[0]], le[1], le[0]),
        )
        for l, e in order:
            if per_expert[l] <= left:
                experts[l][e] = True
                left -= per_expert[l]
    on_gpu = sum(int(x.sum()) for x in experts)
    notes.append(
        f"mixture of experts: {on_gpu} of {n_layer * n_expert} experts on the GPU "
        f"({sum(int(x.sum()) * b for x, b in zip(experts, per_expert)) / 2**20:.0f} MiB), "
        f"attention, routers, shared experts and the KV cache of {sum(dense)} of {n_layer} "
        "layers; the other experts on the CPU"
    )
    neurons = [np.zeros(mb.n_ff, dtype=bool) for _ in range(n_layer)]
    return GpuPlacement(budget, dense, neurons, output, source, notes=notes, expert_on_gpu=experts)
