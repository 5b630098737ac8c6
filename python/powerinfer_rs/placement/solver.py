"""Solving the placement program (`program.Instance`) to proven optimality.

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

It sees only an `Instance`: no model, no file, no dense tensors, no bandwidths.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np

from .program import Instance, Solution, _finish, _used_bytes, greedy

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
        # program._meets_minimum: k = 0, or k groups holding at least C_l neurons
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
    """The integer program of `program`'s docstring with HiGHS, from `start` when `warm_start`."""
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
