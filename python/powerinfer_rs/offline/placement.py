"""Hot/cold neuron placement under a VRAM budget: the integer program of the PowerInfer paper
(section 6), solved with HiGHS, written as PowerInfer's `<model>.generated.gpuidx`.

    maximize    sum over groups g of layer l:  freq(l, g) * x(l, g)
    subject to  sum  bytes(l, g) * x(l, g)         <= FFN budget
                per layer l with C_l > 0:  sum size(l, g) x(l, g) >= C_l y_l
                                           sum size(l, g) x(l, g) <= n_ff y_l
                x, y binary

A group is `group` neurons of one layer, taken in order of falling frequency (so a layer's best
choice is always a prefix of its groups, which the program states as x(l, g) >= x(l, g + 1)).
C_l is the smallest GPU neuron count that pays for the CPU-GPU synchronisation:
C_l * T_gpu + T_sync <= C_l * T_cpu with T = bytes per neuron / bandwidth.

Dense tensors are placed first as a fixed cost (per layer attention, norms and predictor, in
layer order, then the output matrix), then the KV cache if every dense tensor fit; whatever is
left goes to FFN neurons, even when some dense tensors did not fit. The greedy solution (groups
by frequency per byte) is computed first, handed to HiGHS as the starting point, and returned
when HiGHS finds nothing better in the time limit.
"""

from __future__ import annotations

import math
import os
import re
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from .. import _core

GGML_I32 = 26
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
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
        # per layer: neurons by falling frequency, then groups of `group` of them
        self.order = [np.argsort(-np.asarray(f, dtype=np.float64), kind="stable") for f in self.freq]
        self.group_value: list[np.ndarray] = []
        self.group_size: list[np.ndarray] = []
        for f, order in zip(self.freq, self.order):
            sorted_f = np.asarray(f, dtype=np.float64)[order]
            starts = np.arange(0, len(sorted_f), self.group)
            self.group_value.append(np.add.reduceat(sorted_f, starts) if len(sorted_f) else np.zeros(0))
            self.group_size.append(np.minimum(self.group, len(sorted_f) - starts))


@dataclass
class Solution:
    """GPU group counts per layer (always a prefix of the frequency-sorted groups)."""

    groups_on_gpu: np.ndarray
    objective: float
    method: str  # "ilp" (HiGHS, optimal), "ilp-feasible" (HiGHS hit the time limit), "greedy"
    seconds: float = 0.0
    status: str = ""
    gpu_neurons: list[np.ndarray] = field(default_factory=list)


def _finish(inst: Instance, counts: np.ndarray, method: str, seconds: float, status: str) -> Solution:
    counts = np.asarray(counts, dtype=np.int64)
    objective = float(sum(v[:k].sum() for v, k in zip(inst.group_value, counts)))
    neurons = []
    for order, sizes, k in zip(inst.order, inst.group_size, counts):
        n = int(sizes[:k].sum())
        neurons.append(np.sort(order[:n]).astype(np.int32))
    return Solution(counts, objective, method, seconds, status, neurons)


def _used_bytes(inst: Instance, counts: np.ndarray) -> float:
    return float(sum(b * s[:k].sum() for b, s, k in zip(inst.neuron_bytes, inst.group_size, counts)))


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


def solve(inst: Instance, time_limit: float = 10.0, mip_gap: float = 1e-4, warm_start: bool = True, threads: int | None = None) -> Solution:
    """The integer program with HiGHS, started from the greedy solution; greedy is returned
    when HiGHS finds nothing better within `time_limit` seconds."""
    import highspy

    t0 = time.perf_counter()
    start = greedy(inst)
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

    def add_rows(r_idx: np.ndarray, c_idx: np.ndarray, v: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        base = len(lower)
        rows_i.append(base + r_idx)
        cols_j.append(c_idx)
        vals.append(v)
        lower.extend(lo.tolist())
        upper.extend(hi.tolist())

    sizes = np.concatenate(inst.group_size).astype(np.float64)
    weights = np.concatenate([s * b for s, b in zip(inst.group_size, inst.neuron_bytes)]).astype(np.float64)
    # budget row
    add_rows(np.zeros(n_x, dtype=np.int64), np.arange(n_x), weights, np.array([-np.inf]), np.array([float(inst.budget)]))
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
        add_rows(np.concatenate([r, r]), np.concatenate([a, b]), np.concatenate([np.ones(len(a)), -np.ones(len(a))]),
                 np.zeros(len(a)), np.full(len(a), np.inf))
    # per-layer minimum: sum size x - C y >= 0 and sum size x - n_ff y <= 0
    for l in constrained:
        cols = np.arange(offsets[l], offsets[l + 1])
        s = sizes[cols]
        n_ff = float(s.sum())
        idx = np.concatenate([cols, [y_col[l]]])
        add_rows(np.zeros(len(idx), dtype=np.int64), idx, np.concatenate([s, [-float(inst.min_neurons[l])]]),
                 np.array([0.0]), np.array([np.inf]))
        add_rows(np.zeros(len(idx), dtype=np.int64), idx, np.concatenate([s, [-n_ff]]),
                 np.array([-np.inf]), np.array([0.0]))

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
    if not constrained:
        # a lone knapsack row can stall presolve for minutes
        h.setOptionValue("presolve", "off")
    h.passModel(lp)
    if warm_start:
        x0 = np.zeros(n_col)
        for l in range(n_layer):
            x0[offsets[l]:offsets[l] + start.groups_on_gpu[l]] = 1
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
    counts = np.array([int(x[offsets[l]:offsets[l + 1]].sum()) for l in range(n_layer)])
    result = _finish(inst, counts, "ilp" if status == "Optimal" else "ilp-feasible", seconds, f"HiGHS: {status}")
    if result.objective < start.objective - 1e-9 or _used_bytes(inst, counts) > inst.budget:
        start.seconds, start.status = seconds, f"HiGHS: {status}; greedy kept (better)"
        return start
    return result


def min_gpu_neurons(neuron_bytes: float, cpu_bandwidth: float, gpu_bandwidth: float, sync_latency: float, n_ff: int) -> int:
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

_FFN_NEURON_TENSORS = ("ffn_gate.weight", "ffn_up.weight", "ffn_down_t.weight", "ffn_down.weight", "ffn_up.bias")


@dataclass
class ModelBytes:
    n_layer: int
    n_ff: int
    neuron_bytes: np.ndarray  # (n_layer,) bytes of one FFN neuron (gate + up + down rows)
    layer_dense_bytes: np.ndarray  # (n_layer,) attention, norms, predictor, other FFN tensors
    output_bytes: int  # output matrix (the tied embedding when there is none) and output norm
    kv_cache_bytes: int  # f16 K and V for n_ctx positions, all layers


def model_bytes(path: str, n_ctx: int | None = None) -> ModelBytes:
    """Real bytes per tensor group, from the file's tensor types."""
    f = _core.GgufFile(path)
    model = _core.Model(path, 1)
    cfg = model.config()
    n_layer, n_ff = cfg["n_layer"], cfg["n_ff"]
    n_ctx = n_ctx or min(cfg["n_ctx_train"], 4096)
    neuron = np.zeros(n_layer)
    dense = np.zeros(n_layer)
    output = 0
    has_output = any(t["name"] == "output.weight" for t in f.tensors())
    for t in f.tensors():
        name = t["name"]
        m = re.match(r"blk\.(\d+)\.(.+)$", name)
        if m:
            l, rest = int(m.group(1)), m.group(2)
            if rest in _FFN_NEURON_TENSORS:
                neuron[l] += t["n_bytes"] / n_ff
            else:
                dense[l] += t["n_bytes"]
        elif name in ("output.weight", "output_norm.weight", "output_norm.bias") or (name == "token_embd.weight" and not has_output):
            output += t["n_bytes"]
    kv = 2 * n_layer * n_ctx * cfg["n_head_kv"] * cfg["head_dim"] * 2
    return ModelBytes(n_layer, n_ff, neuron, dense, int(output), int(kv))


# ----------------------------------------------------------------------------- the plan


@dataclass
class Placement:
    budget: int
    dense_layers_on_gpu: int
    output_on_gpu: bool
    kv_cache_on_gpu: bool
    dense_bytes: int
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
            f"({self.dense_layers_on_gpu} layers' attention/norms/predictors, output {'yes' if self.output_on_gpu else 'no'}, "
            f"KV cache {'yes' if self.kv_cache_on_gpu else 'no'}), FFN neurons {format_bytes(self.ffn_bytes)}",
            f"solver: {s.method} ({s.status}, {s.seconds:.2f} s), objective {s.objective:.4g}, {n_gpu} neurons on the GPU",
        ]
        lines.append("layer  gpu_neurons  C_l  hot_share")
        for l, (g, h, c) in enumerate(zip(s.gpu_neurons, self.hot_share, self.min_neurons)):
            lines.append(f"{l:5d}  {len(g):11d}  {int(c):4d}  {h:9.3f}")
        return "\n".join(lines)


def plan(
    mb: ModelBytes,
    freq: list[np.ndarray],
    budget: int,
    cpu_bandwidth: float,
    gpu_bandwidth: float,
    sync_latency: float,
    group: int = 64,
    time_limit: float = 10.0,
) -> Placement:
    """Dense tensors first, then the KV cache if everything dense fit, then the neuron ILP."""
    if len(freq) != mb.n_layer:
        raise ValueError(f"the profile has {len(freq)} layers but the model has {mb.n_layer}")
    for l, fl in enumerate(freq):
        if len(fl) != mb.n_ff:
            raise ValueError(f"the profile's layer {l} has {len(fl)} neurons but the model has {mb.n_ff}")
    left = budget
    dense_layers = 0
    for l in range(mb.n_layer):
        if mb.layer_dense_bytes[l] > left:
            break
        left -= mb.layer_dense_bytes[l]
        dense_layers += 1
    output_on_gpu = dense_layers == mb.n_layer and mb.output_bytes <= left
    if output_on_gpu:
        left -= mb.output_bytes
    kv_on_gpu = output_on_gpu and mb.kv_cache_bytes <= left
    if kv_on_gpu:
        left -= mb.kv_cache_bytes
    smallest_group = float(np.min(mb.neuron_bytes)) * min(group, mb.n_ff)
    if dense_layers == 0 and left < smallest_group:
        raise ValueError(
            f"VRAM budget {format_bytes(budget)} is too small for anything: layer 0's attention, norms and predictor "
            f"need {format_bytes(mb.layer_dense_bytes[0])} and one group of {group} FFN neurons {format_bytes(smallest_group)}"
        )
    min_neurons = np.array(
        [min_gpu_neurons(b, cpu_bandwidth, gpu_bandwidth, sync_latency, mb.n_ff) for b in mb.neuron_bytes]
    )
    inst = Instance(freq, mb.neuron_bytes, int(left), min_neurons, group)
    sol = solve(inst, time_limit=time_limit)
    hot = np.array([
        float(np.asarray(f)[g].sum() / max(np.asarray(f).sum(), 1e-30)) for f, g in zip(freq, sol.gpu_neurons)
    ])
    dense_bytes = budget - left
    return Placement(budget, dense_layers, output_on_gpu, kv_on_gpu, int(dense_bytes), int(_used_bytes(inst, sol.groups_on_gpu)), sol, hot, min_neurons)


# ----------------------------------------------------------------------------- the .gpuidx file


def write_gpu_index(path: str, gpu_neurons: list[np.ndarray], n_ff: int, vram_capacity: int) -> None:
    """Writes `<model>.generated.gpuidx` exactly as PowerInfer's exporter does: GGUF v3 with the
    magic patched to PWRI, architecture `generic.gpu_index`, `generic.gpu_index.block_count`,
    `split.vram_capacity`, and per layer `blk.{i}.gpu_idx` then `blk.{i}.gpu_bucket` (I32)."""
    import gguf

    w = gguf.GGUFWriter(path, "generic.gpu_index")
    for i, neurons in enumerate(gpu_neurons):
        neurons = np.sort(np.asarray(neurons, dtype=np.int64))
        if len(neurons) and (neurons[0] < 0 or neurons[-1] >= n_ff or np.any(np.diff(neurons) == 0)):
            raise ValueError(f"layer {i}: GPU neuron indices must be distinct and in [0, {n_ff})")
        mask = np.zeros(n_ff, dtype=np.int32)
        mask[neurons] = 1
        bucket = neurons.astype(np.int32)
        w.add_tensor(f"blk.{i}.gpu_idx", mask, raw_shape=mask.shape[::-1], raw_dtype=gguf.GGMLQuantizationType.I32)
        w.add_tensor(f"blk.{i}.gpu_bucket", bucket, raw_shape=bucket.shape[::-1], raw_dtype=gguf.GGMLQuantizationType.I32)
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


def place(
    model: str,
    profile: str,
    vram_budget: str | int,
    output: str | None = None,
    cpu_bandwidth: float | None = None,
    gpu_bandwidth: float = 1000e9,
    sync_latency: float = 20e-6,
    group: int = 64,
    time_limit: float = 10.0,
    n_ctx: int | None = None,
) -> Placement:
    """Solves the placement for `model` with the activation counts of `profile` (written by
    `profile`) and writes the split (default `<model>.generated.gpuidx`). Bandwidths in
    bytes/s (the CPU one measured when not given), sync latency in seconds."""
    from .profiling import load_profile

    budget = parse_bytes(vram_budget)
    if budget <= 0:
        raise ValueError(f"VRAM budget must be positive, got {vram_budget!r}")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    for name, v in (("gpu_bandwidth", gpu_bandwidth), ("sync_latency", sync_latency), ("time_limit", time_limit)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive number, got {v!r}")
    prof = load_profile(profile)
    freq = [c / max(prof["n_tokens"], 1) for c in prof["counts"]]
    mb = model_bytes(model, n_ctx)
    cpu_bw = cpu_bandwidth if cpu_bandwidth is not None else measure_cpu_bandwidth()
    p = plan(mb, freq, budget, cpu_bw, gpu_bandwidth, sync_latency, group, time_limit)
    p.path = output or gpu_index_path(model)
    write_gpu_index(p.path, p.solution.gpu_neurons, mb.n_ff, budget)
    return p
