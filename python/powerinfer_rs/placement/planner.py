"""The plan of one model under one VRAM budget: dense tensors first, then FFN neurons.

Dense tensors are placed first as a fixed cost, in the order the GPU executor holds them: per
layer, while they fit, its attention, norms and predictor together with its KV cache, then the
output matrix if every layer fit. Whatever is left goes to FFN neurons of the layers whose dense
part is on the GPU (the executor runs a layer's hot neurons only there; a layer kept on the CPU
gets C_l = n_ff + 1, so none), solved as the placement program (`solver.solve`). This one
planner serves `Engine.load(device="cuda")` (`gpu.plan_gpu`) and `powerinfer-rs place`, and what
it plans fits the budget. Two plans need no program: every FFN whole on the GPU when it all fits
(`whole_ffn_fits`), and without activation counts the same share of every GPU layer (`even_split`).

It takes the model's costs as given (`costs`) and writes no file (`gpu_index` does, for the
callers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .costs import ModelBytes, kv_bytes_per_layer, min_gpu_neurons
from .program import Instance, Solution, _used_bytes
from .solver import solve
from .units import format_bytes


@dataclass
class Placement:
    budget: int
    dense_layers_on_gpu: int
    output_on_gpu: bool
    kv_cache_layers_on_gpu: int  # each GPU layer holds its own KV cache
    dense_bytes: int  # dense parts, their KV cache and the output
    ffn_bytes: int
    solution: Solution
    hot_share: np.ndarray  # (n_layer,) share of the layer's activations its GPU neurons carry
    min_neurons: np.ndarray
    path: str | None = None

    def summary(self) -> str:
        s = self.solution
        n_gpu = sum(len(g) for g in s.gpu_neurons)
        lines = [
            f"budget {format_bytes(self.budget)}: dense {format_bytes(self.dense_bytes)} "
            f"({self.dense_layers_on_gpu} layers' attention/norms/predictors and KV cache, output {'yes' if self.output_on_gpu else 'no'}), "
            f"FFN neurons {format_bytes(self.ffn_bytes)}",
            f"solver: {s.method} ({s.status}, {s.seconds:.2f} s), objective {s.objective:.4g}, {n_gpu} neurons on the GPU",
        ]
        lines.append("layer  gpu_neurons  C_l  hot_share")
        for l, (g, h, c) in enumerate(zip(s.gpu_neurons, self.hot_share, self.min_neurons)):
            lines.append(f"{l:5d}  {len(g):11d}  {int(c):4d}  {h:9.3f}")
        return "\n".join(lines)


def dense_first(
    mb: ModelBytes, budget: int, kv_bytes_per_layer: float
) -> tuple[list[bool], bool, int]:
    """Layers whose attention, norms and predictor plus their KV cache fit, in layer order; then
    the output if every layer fit. Returns (dense_on_gpu, output_on_gpu, bytes left); a budget
    that does not hold layer 0 is an error (nothing could run on the GPU)."""
    left = budget
    dense = []
    for l in range(mb.n_layer):
        need = mb.layer_dense_bytes[l] + kv_bytes_per_layer
        if len(dense) == l and need <= left:
            left -= need
            dense.append(True)
        else:
            dense.append(False)
    if not dense[0]:
        raise ValueError(
            f"VRAM budget {format_bytes(budget)} is too small for anything: it does not hold layer 0's attention, "
            f"norms, predictor and KV cache ({format_bytes(mb.layer_dense_bytes[0] + kv_bytes_per_layer)}); "
            "use a larger budget or the CPU (device='cpu')"
        )
    output = all(dense) and mb.output_bytes <= left
    if output:
        left -= mb.output_bytes
    return dense, output, int(left)


def whole_ffn_fits(mb: ModelBytes, dense_on_gpu: list[bool], left: int) -> bool:
    """Every layer's dense part is on the GPU and the `left` bytes hold every FFN whole: then
    nothing needs choosing (and plain files read their own `ffn_down`, fewer bytes than a split)."""
    return all(dense_on_gpu) and left >= float(np.sum(mb.whole_ffn()))


def even_split(mb: ModelBytes, dense_on_gpu: list[bool], left: int) -> list[np.ndarray]:
    """The split without activation counts: the same number of neurons in every layer whose
    dense part is on the GPU, as many as `left` bytes hold, lowest indices first (nothing says
    which neurons are hot). Per layer, a bool mask of `n_ff`."""
    neuron_bytes = np.asarray(mb.neuron_bytes, dtype=np.float64)
    gpu_layers_bytes = float(sum(b for b, d in zip(neuron_bytes, dense_on_gpu) if d))
    k = int(min(mb.n_ff, left // max(gpu_layers_bytes, 1.0))) if gpu_layers_bytes else 0
    return [np.arange(mb.n_ff) < (k if d else 0) for d in dense_on_gpu]


def plan(
    mb: ModelBytes,
    freq: list[np.ndarray],
    budget: int,
    cpu_bandwidth: float,
    gpu_bandwidth: float,
    sync_latency: float,
    group: int = 64,
    time_limit: float = 10.0,
    kv_type: str = "f16",
) -> Placement:
    """Dense parts with their KV cache first (`dense_first`), then the neuron program over the
    layers that are on the GPU."""
    if len(freq) != mb.n_layer:
        raise ValueError(f"the profile has {len(freq)} layers but the model has {mb.n_layer}")
    for l, fl in enumerate(freq):
        if len(fl) != mb.n_ff:
            raise ValueError(
                f"the profile's layer {l} has {len(fl)} neurons but the model has {mb.n_ff}"
            )
    kv = kv_bytes_per_layer(mb, kv_type)
    dense, output_on_gpu, left = dense_first(mb, budget, kv)
    min_neurons = np.array(
        [
            min_gpu_neurons(b, cpu_bandwidth, gpu_bandwidth, sync_latency, mb.n_ff)
            if d
            else mb.n_ff + 1
            for b, d in zip(mb.neuron_bytes, dense)
        ]
    )
    inst = Instance(freq, mb.neuron_bytes, int(left), min_neurons, group)
    sol = solve(inst, time_limit=time_limit)
    hot = np.array(
        [
            float(np.asarray(f)[g].sum() / max(np.asarray(f).sum(), 1e-30))
            for f, g in zip(freq, sol.gpu_neurons)
        ]
    )
    n_dense = sum(dense)
    return Placement(
        budget,
        n_dense,
        output_on_gpu,
        n_dense,
        int(budget - left),
        int(_used_bytes(inst, sol.groups_on_gpu)),
        sol,
        hot,
        min_neurons,
    )
