"""The placement program of the PowerInfer paper (section 6): which FFN neurons go to the GPU.

    maximize    sum over groups g of layer l:  freq(l, g) * x(l, g)
    subject to  sum  bytes(l, g) * x(l, g)         <= FFN budget
                per layer l with C_l > 0:  sum size(l, g) x(l, g) >= C_l y_l
                                           sum size(l, g) x(l, g) <= n_ff y_l
                x, y binary

A group is `group` neurons of one layer, taken in order of falling frequency (so a layer's best
choice is always a prefix of its groups, which the program states as x(l, g) >= x(l, g + 1)).
C_l is the smallest GPU neuron count that pays for the CPU-GPU synchronisation:
C_l * T_gpu + T_sync <= C_l * T_cpu with T = bytes per neuron / bandwidth
(`costs.min_gpu_neurons`). Here live the problem (`Instance`), an answer (`Solution`) and the
greedy answer every solver starts from.

It must not read model files or measure hardware (the numbers arrive in an `Instance`), and it
proves nothing about optimality: that is `solver`'s.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Instance:
    """One placement problem over the FFN neurons.

    `freq[l]` (n_ff_l,) activation frequencies; `neuron_bytes[l]` bytes one neuron of layer l
    takes on the GPU; `budget` bytes for neurons; `min_neurons[l]` is C_l (0: no minimum)."""

    freq: list[np.ndarray]
    neuron_bytes: np.ndarray
    budget: int
    min_neurons: np.ndarray
    group: int = 64

    def __post_init__(self) -> None:
        self.neuron_bytes = np.asarray(self.neuron_bytes, dtype=np.float64)
        self.min_neurons = np.asarray(self.min_neurons, dtype=np.int64)
        if self.group < 1:
            raise ValueError(f"group size must be >= 1, got {self.group}")
        if len(self.neuron_bytes) != len(self.freq) or len(self.min_neurons) != len(self.freq):
            raise ValueError("freq, neuron_bytes and min_neurons need one entry per layer")
        if not np.all(np.isfinite(self.neuron_bytes)) or np.any(self.neuron_bytes < 0):
            raise ValueError("neuron_bytes must be finite and >= 0")
        if not (math.isfinite(self.budget) and self.budget >= 0):
            raise ValueError(f"budget must be a finite number of bytes >= 0, got {self.budget!r}")
        # per layer: neurons by falling frequency, then groups of `group` of them
        self.order = [
            np.argsort(-np.asarray(f, dtype=np.float64), kind="stable") for f in self.freq
        ]
        self.group_value: list[np.ndarray] = []
        self.group_size: list[np.ndarray] = []
        for f, order in zip(self.freq, self.order):
            sorted_f = np.asarray(f, dtype=np.float64)[order]
            starts = np.arange(0, len(sorted_f), self.group)
            self.group_value.append(
                np.add.reduceat(sorted_f, starts) if len(sorted_f) else np.zeros(0)
            )
            self.group_size.append(np.minimum(self.group, len(sorted_f) - starts))


@dataclass
class Solution:
    """GPU group counts per layer (always a prefix of the frequency-sorted groups)."""

    groups_on_gpu: np.ndarray
    objective: float
    # "exact" (`solver.exact`, proven optimal), "ilp" (HiGHS, stopped at its gap), "ilp-feasible"
    # (HiGHS hit the time limit), "greedy"
    method: str
    seconds: float = 0.0
    status: str = ""
    gpu_neurons: list[np.ndarray] = field(default_factory=list)
    optimal: bool = False  # proven: no placement within the budget keeps more frequency
    bound: float = math.inf  # proven upper bound on any placement's objective (inf: none known)


def _finish(
    inst: Instance,
    counts: np.ndarray,
    method: str,
    seconds: float,
    status: str,
    optimal: bool = False,
    bound: float = math.inf,
) -> Solution:
    counts = np.asarray(counts, dtype=np.int64)
    objective = float(sum(v[:k].sum() for v, k in zip(inst.group_value, counts)))
    neurons = []
    for order, sizes, k in zip(inst.order, inst.group_size, counts):
        n = int(sizes[:k].sum())
        neurons.append(np.sort(order[:n]).astype(np.int32))
    return Solution(counts, objective, method, seconds, status, neurons, optimal, bound)


def _used_bytes(inst: Instance, counts: np.ndarray) -> float:
    return float(
        sum(b * s[:k].sum() for b, s, k in zip(inst.neuron_bytes, inst.group_size, counts))
    )


def _meets_minimum(inst: Instance, l: int, k: int) -> bool:
    n = inst.group_size[l][:k].sum()
    return k == 0 or n >= inst.min_neurons[l]


def greedy(inst: Instance) -> Solution:
    """Groups by frequency per byte while they fit; then layers short of their C_l are emptied
    and their bytes refilled from layers that meet it. With all C_l = 0 and equal neuron sizes
    this is the exact top-K."""
    t0 = time.perf_counter()
    n_layer = len(inst.freq)
    items = [
        (inst.group_value[l][g] / (inst.group_size[l][g] * inst.neuron_bytes[l]), l, g)
        for l in range(n_layer)
        for g in range(len(inst.group_value[l]))
        if inst.neuron_bytes[l] > 0
    ]
    items.sort(key=lambda t: (-t[0], t[1], t[2]))
    counts = np.zeros(n_layer, dtype=np.int64)

    def fill(allowed: np.ndarray) -> None:
        left = inst.budget - _used_bytes(inst, counts)
        for _, l, g in items:
            # groups are taken in order within a layer: g must be the layer's next group
            if not allowed[l] or g != counts[l]:
                continue
            cost = inst.group_size[l][g] * inst.neuron_bytes[l]
            if cost <= left:
                counts[l] += 1
                left -= cost

    fill(np.ones(n_layer, dtype=bool))
    short = np.array([not _meets_minimum(inst, l, counts[l]) for l in range(n_layer)])
    if short.any():
        # empty the short layers; refill only layers that already meet their minimum (or have none)
        counts[short] = 0
        fill((counts > 0) | (inst.min_neurons <= 0))
    return _finish(inst, counts, "greedy", time.perf_counter() - t0, "greedy")
