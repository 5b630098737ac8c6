"""Hot/cold neuron placement under a VRAM budget: the integer program of the PowerInfer paper
(section 6), solved to proven optimality, written as PowerInfer's `<model>.generated.gpuidx`.

    maximize    sum over groups g of layer l:  freq(l, g) * x(l, g)
    subject to  sum  bytes(l, g) * x(l, g)         <= FFN budget
                per layer l with C_l > 0:  sum size(l, g) x(l, g) >= C_l y_l
                                           sum size(l, g) x(l, g) <= n_ff y_l
                x, y binary

A group is `group` neurons of one layer, taken in order of falling frequency (so a layer's best
choice is always a prefix of its groups, which the program states as x(l, g) >= x(l, g + 1)).
C_l is the smallest GPU neuron count that pays for the CPU-GPU synchronisation:
C_l * T_gpu + T_sync <= C_l * T_cpu with T = bytes per neuron / bandwidth.

How it is solved (`exact`). Every neuron of a layer takes the same bytes, so the program is a
choice of one group count k_l per layer, 0 or from the first count meeting C_l up to all groups:
maximize sum_l value_l(k_l) subject to sum_l bytes_l(k_l) <= budget. A Lagrangian multiplier on
the budget (the LP relaxation's break point: each layer's option curve is concave, so sorting
the steps between options by frequency per byte finds it) bounds every placement, with the
budget rounded down to the bytes a placement can reach. The better of the greedy solution
(groups by frequency per byte, layers short of C_l emptied and refilled) and the rounded LP
solution usually meets that bound, which proves it optimal; when it does not (C_l binding,
different neuron sizes between layers), the options the bound rules out are dropped and a
dynamic program over the layers goes through the rest, pruned by the LP relaxation of the
layers still to choose and by dominance, to the optimum. An 80-layer 70B-sized instance takes
well under a second. HiGHS on the integer program itself (`solve(solver="highs")`) is the
general path, taken when that search outgrows its limit, and an independent check.

Dense tensors are placed first as a fixed cost, in the order the GPU executor holds them: per
layer, while they fit, its attention, norms and predictor together with its KV cache, then the
output matrix if every layer fit. Whatever is left goes to FFN neurons of the layers whose dense
part is on the GPU (the executor runs a layer's hot neurons only there; a layer kept on the CPU
gets C_l = n_ff + 1, so none). This one planner serves `Engine.load(device="cuda")`
(`gpu.plan_gpu`) and `powerinfer-rs place`, and what it plans fits the budget.
"""

from __future__ import annotations

import math
import os
import re
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from . import _core

GGML_I32 = 26
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}


def parse_bytes(value: str | int | float) -> int:
    """'8GiB', '8000MB', '1.5G' (binary), '123456' or a number of bytes -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"a size must be a finite number of bytes >= 0, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read the size {value!r}: give bytes or a number with a unit, e.g. '8GiB', '8000MB', '512MiB'"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


# ----------------------------------------------------------------------------- the program


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
    # "exact" (`exact`, proven optimal), "ilp" (HiGHS, stopped at its gap), "ilp-feasible"
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


# ----------------------------------------------------------------------------- the exact solver

# Objective differences below this share of the total frequency are float rounding of the sums
# (summing n values in float64 errs by at most about n * 1.1e-16 of their total, under 1e-11 for
# 80 x 448 groups), not a better placement: "proven optimal" means optimal up to it.
_ROUNDING = 1e-10
# The exact search gives up past this many partial placements (HiGHS then takes over). Models
# with one or a few neuron sizes need none to some thousands; a different size in each of 80
# layers, up to about a million.
_MAX_STATES = 2_000_000


@dataclass
class _Options:
    """Every layer's allowed GPU group counts, layer after layer: k = 0 first, then every k from
    the layer's first count that meets C_l up to all its groups."""

    layer: np.ndarray  # (n_option,) the layer of each option
    count: np.ndarray  # groups on the GPU
    nbytes: (
        np.ndarray
    )  # their bytes: int64 when every neuron is a whole number of bytes, else float64
    value: np.ndarray  # their frequency (a prefix sum of the layer's group values)
    start: np.ndarray  # (n_layer + 1,) where each layer's options begin
    first: np.ndarray  # (n_layer,) smallest nonzero count meeting C_l (n_groups + 1: none does)
    whole_bytes: bool


def _options(inst: Instance) -> _Options:
    n_layer = len(inst.freq)
    n_neurons = max((int(s.sum()) for s in inst.group_size), default=0)
    # exact integer bytes keep equal sums equal (the search merges them) and make the byte lattice exact
    whole = bool(np.all(inst.neuron_bytes == np.round(inst.neuron_bytes))) and (
        float(inst.neuron_bytes.max(initial=0.0)) * max(n_neurons, 1) * max(n_layer, 1) < 2.0**53
    )
    layer, count, nbytes, value = [], [], [], []
    first = np.zeros(n_layer, dtype=np.int64)
    for l, (gv, gs) in enumerate(zip(inst.group_value, inst.group_size)):
        neurons = np.concatenate([[0], np.cumsum(gs)]).astype(np.int64)
        kept = np.concatenate([[0.0], np.cumsum(gv)])
        # _meets_minimum: k = 0, or k groups holding at least C_l neurons
        first[l] = max(1, int(np.searchsorted(neurons, inst.min_neurons[l], side="left")))
        k = np.concatenate([[0], np.arange(first[l], len(gv) + 1)]).astype(np.int64)
        b = int(inst.neuron_bytes[l]) * neurons[k] if whole else inst.neuron_bytes[l] * neurons[k]
        layer.append(np.full(len(k), l, dtype=np.int64))
        count.append(k)
        nbytes.append(b)
        value.append(kept[k])
    start = np.concatenate([[0], np.cumsum([len(k) for k in count])]).astype(np.int64)
    return _Options(
        np.concatenate(layer),
        np.concatenate(count),
        np.concatenate(nbytes),
        np.concatenate(value),
        start,
        first,
        whole,
    )


def _option_index(opts: _Options, counts: np.ndarray) -> np.ndarray:
    """Option indices of per-layer group counts (each 0 or meeting C_l)."""
    counts = np.asarray(counts, dtype=np.int64)
    return opts.start[:-1] + np.where(counts == 0, 0, counts - opts.first + 1)


def _reachable_budget(opts: _Options, budget: float) -> float:
    """The largest byte count a placement could fill within `budget`, as far as cheaply known:
    with whole bytes every placement's bytes are a multiple of the gcd of all option sizes, so
    the budget rounds down to one. This is what lets the bound see that the fraction of a group
    left at the end of the budget cannot hold anything."""
    if not opts.whole_bytes:
        return float(budget)
    step = int(np.gcd.reduce(opts.nbytes)) if len(opts.nbytes) else 0
    return float((int(math.floor(budget)) // step) * step) if step > 0 else float(budget)


def _dual(opts: _Options, lam: float, reachable: float) -> tuple[float, np.ndarray]:
    """The Lagrangian bound for the multiplier `lam` >= 0 on the budget,
        bound = lam * reachable + sum over layers of max over options (value - lam * bytes),
    which no placement exceeds, and each option's penalty (its layer's max minus its own
    value - lam * bytes): a placement's objective is at most the bound minus its penalties."""
    reduced = opts.value - lam * opts.nbytes.astype(np.float64)
    best = np.maximum.reduceat(reduced, opts.start[:-1])
    return float(lam * reachable + best.sum()), best[opts.layer] - reduced


def _lp_multiplier_and_rounding(
    opts: _Options, reachable: float, budget: float
) -> tuple[list[float], np.ndarray]:
    """Candidates for the multiplier that minimises the bound, and the rounded LP solution.

    Each layer's option curve is concave: group frequency per byte falls along the sorted
    groups, and the first C_l neurons' average is at least any later group's. So the LP
    relaxation (the same as the Lagrangian dual) takes segments (k -> next option) by falling
    frequency per byte until the budget breaks; the best multiplier is the density at the
    break. Rounding: fill in that order and skip what does not fit or would break a layer's
    prefix."""
    same_layer = opts.layer[1:] == opts.layer[:-1]
    seg = np.flatnonzero(same_layer)  # segment from option seg to seg + 1
    d_bytes = (opts.nbytes[seg + 1] - opts.nbytes[seg]).astype(np.float64)
    d_value = opts.value[seg + 1] - opts.value[seg]
    useful = (d_bytes > 0) & (d_value > 0)
    seg, d_bytes, d_value = seg[useful], d_bytes[useful], d_value[useful]
    density = d_value / d_bytes
    order = np.lexsort((seg, -density))  # falling density, a layer's segments in their order
    filled = np.cumsum(d_bytes[order])
    brk = int(np.searchsorted(filled, reachable, side="right"))
    # the dual is piecewise linear in the multiplier with its minimum at the break density; the
    # neighbours cover float ties, and 0 the case where everything fits
    lams = [0.0] + [
        float(density[order[i]]) for i in (brk - 1, brk, brk + 1) if 0 <= i < len(order)
    ]

    # rounding: a layer without bytes keeps its best option; the rest grow along the order
    current = opts.start[:-1].copy()
    free = np.flatnonzero(
        np.asarray(
            [opts.nbytes[a] == opts.nbytes[b - 1] for a, b in zip(opts.start[:-1], opts.start[1:])]
        )
    )
    for l in free:
        a, b = opts.start[l], opts.start[l + 1]
        current[l] = a + int(np.argmax(opts.value[a:b]))
    left = float(budget) - float(opts.nbytes[current].astype(np.float64).sum())
    seg_layer = opts.layer[seg[order]].tolist()
    seg_from = seg[order].tolist()
    seg_bytes = d_bytes[order].tolist()
    smallest_after = (
        np.minimum.accumulate(d_bytes[order][::-1])[::-1].tolist() if len(order) else []
    )
    cur = current.tolist()
    for i, (l, frm, b) in enumerate(zip(seg_layer, seg_from, seg_bytes)):
        if smallest_after[i] > left:
            break
        if cur[l] == frm and b <= left:
            cur[l] = frm + 1
            left -= b
    return lams, np.asarray(cur, dtype=np.int64)


def exact(
    inst: Instance, max_states: int = _MAX_STATES, start: Solution | None = None
) -> Solution | None:
    """The placement proven optimal for one byte size per layer's neurons (every Instance).

    Then a layer's best set of groups is a prefix of its groups by falling frequency, and the
    problem is a choice of one count k_l per layer from {0} U {first k meeting C_l .. all}:
        maximize sum_l value_l(k_l)  subject to  sum_l bytes_l(k_l) <= budget.
    Why the answer is optimal:
      1. Bound. For any multiplier lam >= 0 and any placement within the budget,
         objective = sum_l (value_l(k_l) - lam bytes_l(k_l)) + lam sum_l bytes_l(k_l)
                  <= sum_l max_k (value_l(k) - lam bytes_l(k)) + lam R  -  sum_l penalty_l(k_l),
         where R is the budget rounded down to the bytes a placement can reach (`_reachable_budget`)
         and penalty_l(k) >= 0 is how far option k falls short of its layer's max. The multiplier
         is the LP break density, which minimises this bound (`_lp_multiplier_and_rounding`).
      2. Incumbent. The better of `start` (default `greedy`) and the rounded LP solution; when
         it reaches the bound (up to float rounding of the sums, `_ROUNDING`) it is optimal and
         nothing else runs. That is the usual case: when every layer's groups take the same
         bytes, R holds a whole number of groups and the bound is met.
      3. Search. Otherwise a placement better than the incumbent has penalties summing to less
         than gap = bound - incumbent, so options whose own penalty exceeds the gap are dropped.
         A dynamic program over the remaining layers then goes through every choice of their
         allowed options, as partial placements (bytes, objective) layer by layer, dropping one
         only when it cannot be completed better than the incumbent (by the LP relaxation of
         the layers left, over the bytes it leaves) or when another one dominates it (no more
         bytes, at least the objective: whatever completes one completes the other). Each
         partial placement completed by the penalty-0 options also raises the incumbent. What
         is left at the end holds an optimal placement. The 0-or->=C_l jump needs no special
         case: option 0 and the options from C_l on are simply the choices enumerated.
    Returns None when the search would keep more than `max_states` partial placements."""
    t0 = time.perf_counter()
    if not inst.freq:
        return _finish(
            inst,
            np.zeros(0, dtype=np.int64),
            "exact",
            time.perf_counter() - t0,
            "exact: no layers",
            optimal=True,
            bound=0.0,
        )
    opts = _options(inst)
    budget = float(inst.budget)
    reachable = _reachable_budget(opts, budget)
    lams, rounded = _lp_multiplier_and_rounding(opts, reachable, budget)
    bound, lam, penalty = math.inf, 0.0, None
    for candidate in lams:
        b, p = _dual(opts, candidate, reachable)
        if b < bound:
            bound, lam, penalty = b, candidate, p

    # incumbents: no GPU neurons (always valid), the rounded LP solution, `start`
    best = opts.start[:-1].copy()
    best_value = 0.0
    start = start or greedy(inst)
    for k in (opts.count[rounded], np.asarray(start.groups_on_gpu, dtype=np.int64)):
        if len(k) != len(inst.freq) or not np.all(
            (k == 0) | ((k >= opts.first) & (k <= opts.count[opts.start[1:] - 1]))
        ):
            continue
        chosen = _option_index(opts, k)
        if _used_bytes(inst, k) <= inst.budget and float(opts.value[chosen].sum()) > best_value:
            best, best_value = chosen, float(opts.value[chosen].sum())
    rounding = _ROUNDING * float(sum(np.abs(v).sum() for v in inst.group_value))
    n_states = 0

    if bound - best_value > rounding:
        best, best_value, n_states = _search(
            opts, penalty, bound, reachable, best, best_value, rounding, budget, max_states
        )
        if best is None:
            return None
    # after a search, nothing beats its best placement: that is the bound
    proven = bound if n_states == 0 else best_value
    status = f"exact: multiplier {lam:.6g}, " + (
        "bound met by the incumbent" if n_states == 0 else f"{n_states} partial placements searched"
    )
    return _finish(
        inst,
        opts.count[best],
        "exact",
        time.perf_counter() - t0,
        status,
        optimal=True,
        bound=proven,
    )


def _search(
    opts: _Options,
    penalty: np.ndarray,
    bound: float,
    reachable: float,
    best: np.ndarray,
    best_value: float,
    rounding: float,
    budget: float,
    max_states: int,
) -> tuple[np.ndarray | None, float, int]:
    """The dynamic program of `exact` step 3; returns the best options, their objective and how
    many partial placements it kept (None when that passed `max_states`)."""
    n_layer = len(opts.start) - 1
    gap = bound - best_value
    allowed = penalty <= gap + rounding
    # per layer: the options still allowed (in order of bytes); the penalty-0 one completes
    # partial placements
    per_layer = [np.flatnonzero(allowed[a:b]) + a for a, b in zip(opts.start[:-1], opts.start[1:])]
    lp_choice = np.array(
        [a + int(np.argmin(penalty[a:b])) for a, b in zip(opts.start[:-1], opts.start[1:])]
    )
    searched = [l for l in range(n_layer) if len(per_layer[l]) > 1]
    fixed = [l for l in range(n_layer) if len(per_layer[l]) == 1]
    fixed_opt = np.array([per_layer[l][0] for l in fixed], dtype=np.int64)
    n_stage = len(searched)
    dtype = opts.nbytes.dtype

    # The bound of a partial placement: its objective plus the LP relaxation of the layers still
    # to choose, over their allowed options and the bytes it leaves. Those options lie on the
    # layer's concave curve, so the LP starts every such layer at its cheapest allowed option
    # and fills the steps between allowed options by falling frequency per byte (treating the
    # steps as independent only loosens it). Much tighter than the multiplier alone.
    step_from = (
        np.concatenate([per_layer[l][:-1] for l in searched])
        if searched
        else np.zeros(0, dtype=np.int64)
    )
    step_to = (
        np.concatenate([per_layer[l][1:] for l in searched])
        if searched
        else np.zeros(0, dtype=np.int64)
    )
    step_stage = (
        np.concatenate([np.full(len(per_layer[l]) - 1, i) for i, l in enumerate(searched)])
        if searched
        else np.zeros(0, dtype=np.int64)
    )
    step_bytes = (opts.nbytes[step_to] - opts.nbytes[step_from]).astype(np.float64)
    step_value = opts.value[step_to] - opts.value[step_from]
    # steps that lose frequency are never worth it; those that take no bytes always are
    free = (step_bytes <= 0) & (step_value > 0)
    free_value = np.bincount(step_stage[free], weights=step_value[free], minlength=n_stage)
    paid = (step_bytes > 0) & (step_value > 0)
    step_stage, step_bytes, step_value = step_stage[paid], step_bytes[paid], step_value[paid]
    step_density = step_value / step_bytes
    by_density = np.argsort(-step_density, kind="stable")
    step_stage, step_bytes, step_value, step_density = (
        a[by_density] for a in (step_stage, step_bytes, step_value, step_density)
    )
    cheapest = np.array([per_layer[l][0] for l in searched], dtype=np.int64)
    # suffix sums over the stages: bytes and objective of the cheapest options still to choose
    rest_bytes = np.concatenate([np.cumsum(opts.nbytes[cheapest][::-1])[::-1], [0]]).astype(dtype)
    rest_value = np.concatenate([np.cumsum((opts.value[cheapest] + free_value)[::-1])[::-1], [0.0]])
    # with whole bytes the layers still to choose fill only multiples of their options' gcd
    rest_step = [0] * (n_stage + 1)
    if opts.whole_bytes:
        for i in range(n_stage - 1, -1, -1):
            rest_step[i] = math.gcd(
                rest_step[i + 1], int(np.gcd.reduce(opts.nbytes[per_layer[searched[i]]]))
            )

    def lp_bound(stage: int, s_bytes: np.ndarray, s_value: np.ndarray) -> np.ndarray:
        """Bound of partial placements that chose stages < `stage` (-inf: cannot be completed)."""
        room = reachable - s_bytes.astype(np.float64)
        if rest_step[stage] > 0:
            room = np.floor(room / rest_step[stage]) * rest_step[stage]
        room -= float(rest_bytes[stage])
        mine = step_stage >= stage
        cum_bytes = np.concatenate([[0.0], np.cumsum(step_bytes[mine])])
        cum_value = np.concatenate([[0.0], np.cumsum(step_value[mine])])
        density = np.concatenate([step_density[mine], [0.0]])
        # whole steps that fit, then the fraction of the next one (density 0 past the last)
        full = np.clip(np.searchsorted(cum_bytes, room, side="right") - 1, 0, len(cum_bytes) - 1)
        part = np.maximum(room - cum_bytes[full], 0.0) * density[full]
        value = s_value + rest_value[stage] + cum_value[full] + part
        return np.where(room >= 0, value, -np.inf)

    # what the layers not yet searched add when each takes its penalty-0 option
    tail_bytes = np.zeros(n_stage + 1, dtype=dtype)
    tail_value = np.zeros(n_stage + 1)
    for i in range(n_stage - 1, -1, -1):
        o = lp_choice[searched[i]]
        tail_bytes[i] = tail_bytes[i + 1] + opts.nbytes[o]
        tail_value[i] = tail_value[i + 1] + opts.value[o]

    s_bytes = np.array([opts.nbytes[fixed_opt].sum()], dtype=dtype)
    s_value = np.array([float(opts.value[fixed_opt].sum())])
    history: list[tuple[np.ndarray, np.ndarray]] = []  # per searched layer: (parent state, option)
    n_kept = 1

    def trace(stage: int, state: int) -> np.ndarray:
        chosen = lp_choice.copy()
        chosen[fixed] = fixed_opt
        for i in range(stage - 1, -1, -1):
            parent, option = history[i]
            chosen[searched[i]] = option[state]
            state = parent[state]
        return chosen

    for i, l in enumerate(searched):
        # complete every partial placement with penalty-0 options: a cheap, often better incumbent
        fits = s_bytes + tail_bytes[i] <= budget
        if fits.any():
            j = int(np.argmax(np.where(fits, s_value, -np.inf)))
            if s_value[j] + tail_value[i] > best_value:
                best_value = float(s_value[j] + tail_value[i])
                best = trace(i, j)
        o = per_layer[l]
        if len(s_bytes) * len(o) > 8 * max_states:  # the candidates alone would not fit in memory
            return None, best_value, n_kept + len(s_bytes) * len(o)
        c_bytes = (s_bytes[:, None] + opts.nbytes[o][None, :]).ravel()
        c_value = (s_value[:, None] + opts.value[o][None, :]).ravel()
        # keep what fits and might beat the incumbent by more than the rounding of the sums
        keep = (c_bytes <= budget) & (lp_bound(i + 1, c_bytes, c_value) > best_value + rounding)
        idx = np.flatnonzero(keep)
        parent, option = idx // len(o), o[idx % len(o)]
        c_bytes, c_value = c_bytes[idx], c_value[idx]
        # dominance: by bytes, keep a state only if it beats every state with no more bytes
        srt = np.lexsort((-c_value, c_bytes))
        c_value_s = c_value[srt]
        lead = np.ones(len(srt), dtype=bool)
        lead[1:] = c_value_s[1:] > np.maximum.accumulate(c_value_s)[:-1]
        srt = srt[lead]
        s_bytes, s_value = c_bytes[srt], c_value[srt]
        history.append((parent[srt], option[srt]))
        n_kept += len(srt)
        if n_kept > max_states:
            return None, best_value, n_kept
    if len(s_value):
        j = int(np.argmax(s_value))
        if s_value[j] > best_value:
            best_value = float(s_value[j])
            best = trace(n_stage, j)
    return best, best_value, n_kept


def solve(
    inst: Instance,
    time_limit: float = 10.0,
    mip_gap: float = 1e-4,
    warm_start: bool = True,
    threads: int | None = None,
    solver: str = "auto",
) -> Solution:
    """The placement. `solver`:
    "auto"  `exact` (proven optimal, in milliseconds on real instances); the integer program
            with HiGHS in the rare case the exact search outgrows its state limit;
    "exact" `exact` only (RuntimeError past its state limit);
    "highs" the integer program with HiGHS (`time_limit`, `mip_gap`, `threads`), started from
            the greedy solution (`warm_start`), which is returned when HiGHS finds nothing
            better. HiGHS takes any instance the program can state; it is kept as that general
            path and as an independent check of `exact`."""
    if solver not in ("auto", "exact", "highs"):
        raise ValueError(f"solver must be 'auto', 'exact' or 'highs', got {solver!r}")
    t0 = time.perf_counter()
    start = greedy(inst)
    if solver != "highs":
        result = exact(inst, max_states=_MAX_STATES, start=start)
        if result is not None:
            result.seconds = time.perf_counter() - t0
            return result
        if solver == "exact":
            raise RuntimeError(
                f"the exact placement search passed {_MAX_STATES} partial placements"
            )
    return _solve_highs(inst, start, t0, time_limit, mip_gap, warm_start, threads)


def _solve_highs(
    inst: Instance,
    start: Solution,
    t0: float,
    time_limit: float,
    mip_gap: float,
    warm_start: bool,
    threads: int | None,
) -> Solution:
    """The integer program of the module docstring with HiGHS, from `start` when `warm_start`."""
    import highspy

    n_layer = len(inst.freq)
    n_groups = [len(v) for v in inst.group_value]
    offsets = np.concatenate([[0], np.cumsum(n_groups)]).astype(np.int64)
    n_x = int(offsets[-1])
    constrained = [l for l in range(n_layer) if inst.min_neurons[l] > 0]
    y_col = {l: n_x + i for i, l in enumerate(constrained)}
    n_col = n_x + len(constrained)
    if n_x == 0:
        return start

    # rows, as (row lower, row upper, [(col, coef), ...]) assembled in coordinate form
    rows_i: list[np.ndarray] = []
    cols_j: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    lower: list[float] = []
    upper: list[float] = []

    def add_rows(
        r_idx: np.ndarray, c_idx: np.ndarray, v: np.ndarray, lo: np.ndarray, hi: np.ndarray
    ) -> None:
        base = len(lower)
        rows_i.append(base + r_idx)
        cols_j.append(c_idx)
        vals.append(v)
        lower.extend(lo.tolist())
        upper.extend(hi.tolist())

    sizes = np.concatenate(inst.group_size).astype(np.float64)
    weights = np.concatenate([s * b for s, b in zip(inst.group_size, inst.neuron_bytes)]).astype(
        np.float64
    )
    # budget row
    add_rows(
        np.zeros(n_x, dtype=np.int64),
        np.arange(n_x),
        weights,
        np.array([-np.inf]),
        np.array([float(inst.budget)]),
    )
    # prefix order within a layer: x(l, g) - x(l, g + 1) >= 0
    a_list, b_list = [], []
    for l in range(n_layer):
        if n_groups[l] >= 2:
            a = offsets[l] + np.arange(n_groups[l] - 1)
            a_list.append(a)
            b_list.append(a + 1)
    if a_list:
        a = np.concatenate(a_list)
        b = np.concatenate(b_list)
        r = np.arange(len(a))
        add_rows(
            np.concatenate([r, r]),
            np.concatenate([a, b]),
            np.concatenate([np.ones(len(a)), -np.ones(len(a))]),
            np.zeros(len(a)),
            np.full(len(a), np.inf),
        )
    # per-layer minimum: sum size x - C y >= 0 and sum size x - n_ff y <= 0
    for l in constrained:
        cols = np.arange(offsets[l], offsets[l + 1])
        s = sizes[cols]
        n_ff = float(s.sum())
        idx = np.concatenate([cols, [y_col[l]]])
        add_rows(
            np.zeros(len(idx), dtype=np.int64),
            idx,
            np.concatenate([s, [-float(inst.min_neurons[l])]]),
            np.array([0.0]),
            np.array([np.inf]),
        )
        add_rows(
            np.zeros(len(idx), dtype=np.int64),
            idx,
            np.concatenate([s, [-n_ff]]),
            np.array([-np.inf]),
            np.array([0.0]),
        )

    r = np.concatenate(rows_i)
    c = np.concatenate(cols_j)
    v = np.concatenate(vals)
    # column-wise sparse matrix
    order = np.lexsort((r, c))
    r, c, v = r[order], c[order], v[order]
    starts = np.searchsorted(c, np.arange(n_col + 1)).astype(np.int32)

    lp = highspy.HighsLp()
    lp.num_col_ = n_col
    lp.num_row_ = len(lower)
    lp.col_cost_ = np.concatenate([np.concatenate(inst.group_value), np.zeros(len(constrained))])
    lp.col_lower_ = np.zeros(n_col)
    lp.col_upper_ = np.ones(n_col)
    lp.row_lower_ = np.array(lower, dtype=np.float64)
    lp.row_upper_ = np.array(upper, dtype=np.float64)
    lp.sense_ = highspy.ObjSense.kMaximize
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = starts
    lp.a_matrix_.index_ = r.astype(np.int32)
    lp.a_matrix_.value_ = v
    lp.a_matrix_.num_col_ = n_col
    lp.a_matrix_.num_row_ = len(lower)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n_col

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("threads", int(threads or os.cpu_count() or 1))
    # HiGHS keeps one thread pool per process and refuses to run with another thread count
    # than the first run's unless the pool is reset
    h.resetGlobalScheduler(True)
    if not constrained:
        # a lone knapsack row can stall presolve for minutes
        h.setOptionValue("presolve", "off")
    h.passModel(lp)
    if warm_start:
        x0 = np.zeros(n_col)
        for l in range(n_layer):
            x0[offsets[l] : offsets[l] + start.groups_on_gpu[l]] = 1
        for l in constrained:
            x0[y_col[l]] = 1.0 if start.groups_on_gpu[l] > 0 else 0.0
        sol = highspy.HighsSolution()
        sol.col_value = x0.tolist()
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    seconds = time.perf_counter() - t0
    if info.primal_solution_status != 2:  # no feasible point found
        start.seconds, start.status = seconds, f"HiGHS: {status}; greedy kept"
        return start
    x = np.asarray(h.getSolution().col_value)[:n_x] > 0.5
    # the prefix rows make each layer's choice its first `count` groups
    counts = np.array([int(x[offsets[l] : offsets[l + 1]].sum()) for l in range(n_layer)])
    bound = float(info.mip_dual_bound)
    result = _finish(
        inst,
        counts,
        "ilp" if status == "Optimal" else "ilp-feasible",
        seconds,
        f"HiGHS: {status}, gap {info.mip_gap:.2g}",
        bound=bound,
    )
    # HiGHS stops at mip_gap (relative) or its absolute gap of 1e-6: optimal only when that is
    # within the float rounding of the objective
    scale = float(sum(np.abs(v).sum() for v in inst.group_value))
    result.optimal = status == "Optimal" and bound - result.objective <= max(
        _ROUNDING * scale, 1e-6
    )
    if result.objective < start.objective - 1e-9 or _used_bytes(inst, counts) > inst.budget:
        start.seconds, start.status = seconds, f"HiGHS: {status}; greedy kept (better)"
        return start
    return result


def min_gpu_neurons(
    neuron_bytes: float, cpu_bandwidth: float, gpu_bandwidth: float, sync_latency: float, n_ff: int
) -> int:
    """C_l: the fewest neurons for which the GPU plus one synchronisation beats the CPU;
    n_ff + 1 (never) when the GPU is not faster per neuron."""
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
    # a plain file wholly on the GPU reads its own ffn_down rows (hybrid.rs, `HotDown::Rows`)
    own_down = not cfg.get("has_predictors", False)
    output = 0
    has_output = any(t["name"] == "output.weight" for t in f.tensors())
    for t in f.tensors():
        name = t["name"]
        m = re.match(r"blk\.(\d+)\.(.+)$", name)
        if m:
            l, rest = int(m.group(1)), m.group(2)
            if rest == "ffn_down.weight":
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
    return ModelBytes(n_layer, n_ff, neuron, dense, int(output), int(kv), whole)


# ----------------------------------------------------------------------------- the plan


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
    the output if every layer fit. Returns (dense_on_gpu, output_on_gpu, bytes left)."""
    left = budget
    dense = []
    for l in range(mb.n_layer):
        need = mb.layer_dense_bytes[l] + kv_bytes_per_layer
        if len(dense) == l and need <= left:
            left -= need
            dense.append(True)
        else:
            dense.append(False)
    output = all(dense) and mb.output_bytes <= left
    if output:
        left -= mb.output_bytes
    return dense, output, int(left)


def kv_bytes_per_layer(mb: ModelBytes, kv_type: str) -> float:
    """One layer's KV cache (`model_bytes` counts f16)."""
    return mb.kv_cache_bytes / mb.n_layer * (2 if kv_type == "f32" else 1)


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
    if not dense[0]:
        raise ValueError(
            f"VRAM budget {format_bytes(budget)} is too small for anything: layer 0's attention, norms, predictor and "
            f"KV cache need {format_bytes(mb.layer_dense_bytes[0] + kv)}; use a larger budget or the CPU"
        )
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


# ----------------------------------------------------------------------------- the .gpuidx file


def write_gpu_index(
    path: str, gpu_neurons: list[np.ndarray], n_ff: int, vram_capacity: int
) -> None:
    """Writes `<model>.generated.gpuidx` exactly as PowerInfer's exporter does: GGUF v3 with the
    magic patched to PWRI, architecture `generic.gpu_index`, `generic.gpu_index.block_count`,
    `split.vram_capacity`, and per layer `blk.{i}.gpu_idx` then `blk.{i}.gpu_bucket` (I32)."""
    import gguf

    w = gguf.GGUFWriter(path, "generic.gpu_index")
    for i, neurons in enumerate(gpu_neurons):
        neurons = np.sort(np.asarray(neurons, dtype=np.int64))
        if len(neurons) and (
            neurons[0] < 0 or neurons[-1] >= n_ff or np.any(np.diff(neurons) == 0)
        ):
            raise ValueError(f"layer {i}: GPU neuron indices must be distinct and in [0, {n_ff})")
        mask = np.zeros(n_ff, dtype=np.int32)
        mask[neurons] = 1
        bucket = neurons.astype(np.int32)
        w.add_tensor(
            f"blk.{i}.gpu_idx",
            mask,
            raw_shape=mask.shape[::-1],
            raw_dtype=gguf.GGMLQuantizationType.I32,
        )
        w.add_tensor(
            f"blk.{i}.gpu_bucket",
            bucket,
            raw_shape=bucket.shape[::-1],
            raw_dtype=gguf.GGMLQuantizationType.I32,
        )
    w.add_block_count(len(gpu_neurons))
    w.add_uint64("split.vram_capacity", int(vram_capacity))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "r+b") as fh:
        fh.write(b"PWRI")
        fh.write(struct.pack("<I", 3))


def read_gpu_index(path: str) -> dict:
    """The split as the engine reads it: `vram_capacity` and per-layer `gpu_idx`/`gpu_bucket`."""
    return _core.read_gpu_index(path)


def gpu_index_path(model_path: str) -> str:
    return model_path + ".generated.gpuidx"
