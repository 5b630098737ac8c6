"""Placement: the exact solver and the HiGHS integer program against the greedy top-K, brute
force and each other, the per-layer minimum, budget parsing and the `.gpuidx` file format."""

import itertools
import shutil

import gguf
import numpy as np
import pytest
from powerinfer_rs import _core
from powerinfer_rs import placement as pl


def _instance(rng, n_layer, n_ff, group, budget_groups, min_neurons=None, bytes_per_neuron=None):
    freq = [rng.pareto(1.5, n_ff) + rng.random(n_ff) * 1e-3 for _ in range(n_layer)]
    nb = (
        np.full(n_layer, 100.0)
        if bytes_per_neuron is None
        else np.asarray(bytes_per_neuron, dtype=float)
    )
    mins = np.zeros(n_layer, dtype=int) if min_neurons is None else np.asarray(min_neurons)
    return pl.Instance(freq, nb, int(budget_groups * group * nb.min()), mins, group)


def _brute_force(inst):
    """Best objective over every per-layer prefix count that fits and meets C_l."""
    best = -1.0
    choices = [range(len(v) + 1) for v in inst.group_value]
    for counts in itertools.product(*choices):
        used = sum(b * s[:k].sum() for b, s, k in zip(inst.neuron_bytes, inst.group_size, counts))
        if used > inst.budget:
            continue
        if any(k and s[:k].sum() < c for s, k, c in zip(inst.group_size, counts, inst.min_neurons)):
            continue
        best = max(best, sum(v[:k].sum() for v, k in zip(inst.group_value, counts)))
    return best


def _assert_valid(inst, s):
    """Within the budget, every layer at 0 or >= C_l neurons, and those its most frequent ones."""
    assert pl._used_bytes(inst, s.groups_on_gpu) <= inst.budget
    for f, c, chosen in zip(inst.freq, inst.min_neurons, s.gpu_neurons):
        assert len(chosen) == 0 or len(chosen) >= c
        if 0 < len(chosen) < len(f):
            assert f[chosen].min() >= np.delete(f, chosen).max()


def _random_small_instance(rng):
    """Up to 4 layers of up to 5 groups (brute force stays small): last groups often smaller,
    C_l of 0, inside the layer or above it, whole and fractional neuron bytes (one layer may be
    free), and budgets that fit nothing, everything or something in between."""
    n_layer = int(rng.integers(1, 5))
    group = int(rng.integers(1, 6))
    n_ff = rng.integers(1, 5 * group + 1, n_layer)
    freq = [rng.pareto(1.5, n) + rng.random(n) * 1e-3 for n in n_ff]
    if rng.random() < 0.25:  # equal frequencies: ties between groups and layers
        freq = [np.round(f, 1) for f in freq]
    nb = rng.choice([1.0, 2.0, 3.0, 60.0, 100.0, 2.5, 7.25], n_layer)
    if rng.random() < 0.1:
        nb[rng.integers(n_layer)] = 0.0
    mins = np.array([rng.choice([0, int(rng.integers(1, n + 1)), n + 1]) for n in n_ff])
    total = float(sum(b * n for b, n in zip(nb, n_ff)))
    smallest = min((b * min(group, n) for b, n in zip(nb, n_ff) if b > 0), default=1.0)
    budget = [0, int(smallest) - 1, int(np.ceil(total)), int(rng.uniform(0, 1) * total)][
        int(rng.integers(4))
    ]
    return pl.Instance(freq, nb, max(budget, 0), mins, group)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("solver", ["exact", "highs"])
def test_solvers_equal_greedy_top_k_without_minimum(seed, solver):
    rng = np.random.default_rng(seed)
    inst = _instance(rng, n_layer=6, n_ff=512, group=64, budget_groups=17)
    # half a group more budget: the bound must see that it holds nothing
    inst.budget += 32 * 100
    g = pl.greedy(inst)
    s = pl.solve(inst, time_limit=30, mip_gap=0.0, warm_start=False, solver=solver)
    assert s.method == ("exact" if solver == "exact" else "ilp")
    assert s.optimal
    if solver == "exact":
        # equal bytes per group: the Lagrangian bound is met without a search
        assert "bound met" in s.status
    # the global top-K groups by frequency (all groups cost the same)
    values = sorted(
        ((v, l, i) for l, gv in enumerate(inst.group_value) for i, v in enumerate(gv)), reverse=True
    )[:17]
    expected = np.zeros(6, dtype=int)
    for _, l, _ in values:
        expected[l] += 1
    np.testing.assert_array_equal(g.groups_on_gpu, expected)
    np.testing.assert_array_equal(s.groups_on_gpu, expected)
    for a, b in zip(g.gpu_neurons, s.gpu_neurons):
        np.testing.assert_array_equal(a, b)
    assert s.objective == pytest.approx(g.objective)
    assert s.bound >= s.objective - 1e-9


def test_minimum_per_layer_known_optimum():
    # layer 0: one very hot group, then cold ones; layer 1: three warm groups. Three groups fit.
    # Greedy takes 10 + 5 + 5 and must drop layer 0 (C_0 = 2 groups) -> 15; the optimum is
    # layer 0's two groups (10 + 1) plus one of layer 1 (5) = 16.
    g = 4
    f0 = np.concatenate([np.full(g, 10 / g), np.full(g, 1 / g), np.full(2 * g, 0.1 / g)])
    f1 = np.concatenate(
        [np.full(g, 5 / g), np.full(g, 5 / g) - 1e-6, np.full(g, 5 / g) - 2e-6, np.full(g, 0.01)]
    )
    inst = pl.Instance([f0, f1], [1.0, 1.0], budget=3 * g, min_neurons=[2 * g, 0], group=g)
    greedy = pl.greedy(inst)
    assert greedy.objective == pytest.approx(15, abs=1e-4)
    for solver in ("exact", "highs"):
        s = pl.solve(inst, time_limit=30, mip_gap=0.0, solver=solver)
        assert s.optimal
        assert s.objective == pytest.approx(16, abs=1e-4)
        assert list(s.groups_on_gpu) == [2, 1]
        assert [len(n) for n in s.gpu_neurons] == [2 * g, g]


def test_exact_searches_when_the_bound_is_not_met():
    # layer 0: one neuron of 3 bytes worth 3.1; layer 1: two of 2 bytes worth 2 each; 4 bytes.
    # By value per byte layer 0 comes first and then nothing else fits (greedy and the rounded
    # LP: 3.1); the bound (multiplier 1) is 4.1, and only the search finds layer 1's 4.0.
    inst = pl.Instance(
        [np.array([3.1]), np.array([2.0, 2.0])], [3.0, 2.0], budget=4, min_neurons=[0, 0], group=1
    )
    assert pl.greedy(inst).objective == pytest.approx(3.1)
    s = pl.solve(inst)
    assert s.method == "exact" and s.optimal and "searched" in s.status
    assert s.objective == pytest.approx(4.0)
    assert list(s.groups_on_gpu) == [0, 2]


def test_exact_hands_over_to_highs_past_its_state_limit(monkeypatch):
    inst = pl.Instance(
        [np.array([3.1]), np.array([2.0, 2.0])], [3.0, 2.0], budget=4, min_neurons=[0, 0], group=1
    )
    assert pl.exact(inst, max_states=1) is None
    monkeypatch.setattr(pl.solver, "_MAX_STATES", 1)
    s = pl.solve(inst, mip_gap=0.0)
    assert s.method == "ilp" and s.optimal
    assert s.objective == pytest.approx(4.0)
    with pytest.raises(RuntimeError, match="partial placements"):
        pl.solve(inst, solver="exact")
    with pytest.raises(ValueError, match="solver"):
        pl.solve(inst, solver="cplex")


@pytest.mark.parametrize("seed", range(8))
def test_exact_equals_brute_force_and_highs_on_small_instances(seed):
    rng = np.random.default_rng(1000 + seed)
    for _ in range(25):
        inst = _random_small_instance(rng)
        s = pl.solve(inst, solver="exact")
        # another thread count than earlier HiGHS runs in this process: that must work too
        h = pl.solve(inst, solver="highs", time_limit=30, mip_gap=0.0, threads=1)
        best = _brute_force(inst)
        assert s.optimal and s.method == "exact"
        assert s.objective == pytest.approx(best, rel=1e-9, abs=1e-9)
        assert s.bound >= best - 1e-9
        _assert_valid(inst, s)
        assert h.optimal
        assert h.objective == pytest.approx(s.objective, rel=1e-9, abs=1e-6)
        assert pl.greedy(inst).objective <= s.objective + 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_exact_equals_highs_optimum_on_mixed_byte_sizes(seed):
    # too many choices for brute force; byte sizes that differ between layers (some fractional)
    # leave part of the budget to trade between layers, so the exact search has work to do
    rng = np.random.default_rng(200 + seed)
    n_layer, group = 8, 8
    n_ff = int(rng.integers(100, 260))
    freq = [rng.pareto(1.2, n_ff) + rng.random(n_ff) * 1e-3 for _ in range(n_layer)]
    nb = rng.choice([60.0, 100.0, 140.0, 13824.0, 16128.0, 99.5], n_layer)
    mins = rng.integers(0, n_ff, n_layer) * (rng.random(n_layer) < 0.7)
    budget = int(rng.uniform(0.05, 0.9) * nb.sum() * n_ff)
    inst = pl.Instance(freq, nb, budget, mins, group)
    s = pl.solve(inst)
    h = pl.solve(inst, solver="highs", time_limit=60, mip_gap=0.0)
    assert s.method == "exact" and s.optimal
    assert h.optimal
    assert s.objective == pytest.approx(h.objective, rel=1e-9)
    _assert_valid(inst, s)
    assert pl.greedy(inst).objective <= s.objective + 1e-9


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("solver", ["exact", "highs"])
def test_solvers_match_brute_force_with_minimums(seed, solver):
    rng = np.random.default_rng(100 + seed)
    n_layer, n_ff, group = 3, 40, 8
    nb = rng.choice([60.0, 100.0, 140.0], n_layer)
    mins = rng.choice([0, 16, 24, 40], n_layer)
    inst = _instance(
        rng,
        n_layer,
        n_ff,
        group,
        budget_groups=int(rng.integers(2, 9)),
        min_neurons=mins,
        bytes_per_neuron=nb,
    )
    s = pl.solve(inst, time_limit=30, mip_gap=0.0, solver=solver)
    assert s.objective == pytest.approx(_brute_force(inst), rel=1e-9, abs=1e-9)
    for l, n in enumerate(s.gpu_neurons):
        assert len(n) == 0 or len(n) >= mins[l]
    used = sum(len(n) * b for n, b in zip(s.gpu_neurons, nb))
    assert used <= inst.budget
    # the greedy fallback is always feasible too
    gr = pl.greedy(inst)
    assert all(len(n) == 0 or len(n) >= mins[l] for l, n in enumerate(gr.gpu_neurons))
    assert gr.objective <= s.objective + 1e-9


def test_instance_rejects_negative_sizes():
    with pytest.raises(ValueError, match="budget"):
        pl.Instance([np.ones(4)], [1.0], -1, [0])
    with pytest.raises(ValueError, match="neuron_bytes"):
        pl.Instance([np.ones(4)], [-1.0], 10, [0])


def test_gpu_neurons_are_the_most_frequent():
    rng = np.random.default_rng(7)
    inst = _instance(rng, 2, 256, 64, budget_groups=3)
    s = pl.solve(inst, mip_gap=0.0)
    for f, chosen in zip(inst.freq, s.gpu_neurons):
        if len(chosen):
            rest = np.setdiff1d(np.arange(len(f)), chosen)
            assert f[chosen].min() >= f[rest].max()


def test_min_gpu_neurons_formula():
    # 1 MB neurons, CPU 50 GB/s, GPU 1000 GB/s, 20 us sync: C = ceil(20e-6 / (2e-5 - 1e-6)) = 2
    assert pl.min_gpu_neurons(1e6, 50e9, 1000e9, 20e-6, 1000) == 2
    # GPU not faster: never worth it
    assert pl.min_gpu_neurons(1e6, 50e9, 40e9, 20e-6, 1000) == 1001
    # small neurons need many of them to pay for one sync
    assert pl.min_gpu_neurons(1e3, 50e9, 1000e9, 20e-6, 4096) == int(
        np.ceil(20e-6 / (1e3 / 50e9 - 1e3 / 1000e9))
    )


def test_min_gpu_neurons_rejects_speeds_it_cannot_divide_by():
    """A bandwidth of zero (or negative, infinite, NaN) is named in a ValueError rather than
    dividing by zero; a sync latency of 0 means any number of neurons pays, a negative one is an
    error. `plan` passes the same error on."""
    for cpu, gpu in ((0.0, 1000e9), (50e9, 0), (-1.0, 1000e9), (50e9, float("inf"))):
        name = "cpu_bandwidth" if cpu <= 0 else "gpu_bandwidth"
        with pytest.raises(ValueError, match=name):
            pl.min_gpu_neurons(1e6, cpu, gpu, 20e-6, 1000)
    with pytest.raises(ValueError, match="cpu_bandwidth"):
        pl.min_gpu_neurons(1e6, float("nan"), 1000e9, 20e-6, 1000)
    with pytest.raises(ValueError, match="sync_latency"):
        pl.min_gpu_neurons(1e6, 50e9, 1000e9, -20e-6, 1000)
    assert pl.min_gpu_neurons(1e6, 50e9, 1000e9, 0.0, 1000) == 0
    mb = pl.ModelBytes(
        n_layer=1,
        n_ff=64,
        neuron_bytes=np.array([1000.0]),
        layer_dense_bytes=np.array([50_000.0]),
        output_bytes=20_000,
        kv_cache_bytes=10_000,
    )
    with pytest.raises(ValueError, match="gpu_bandwidth"):
        pl.plan(mb, [np.linspace(1, 0, 64)], 10**6, 50e9, 0.0, 20e-6)


def test_kv_bytes_per_layer_knows_f16_and_f32_only():
    """`model_bytes` counts an f16 cache; f32 takes twice that, and any other type is named in a
    ValueError rather than sized as f16."""
    mb = pl.ModelBytes(
        n_layer=2,
        n_ff=64,
        neuron_bytes=np.array([1000.0, 1000.0]),
        layer_dense_bytes=np.array([50_000.0, 50_000.0]),
        output_bytes=20_000,
        kv_cache_bytes=10_000,
    )
    assert pl.kv_bytes_per_layer(mb, "f16") == 5_000
    assert pl.kv_bytes_per_layer(mb, "f32") == 10_000
    for bad in ("q8_0", "F16", ""):
        with pytest.raises(ValueError, match=f"kv_type must be 'f16' or 'f32', got {bad!r}"):
            pl.kv_bytes_per_layer(mb, bad)
    with pytest.raises(ValueError, match="'q8_0'"):
        pl.plan(mb, [np.linspace(1, 0, 64)] * 2, 10**6, 50e9, 1000e9, 0.0, kv_type="q8_0")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("8GiB", 8 << 30),
        ("8000MB", 8_000_000_000),
        ("512MiB", 512 << 20),
        ("1.5G", int(1.5 * (1 << 30))),
        ("123456", 123456),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert pl.parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["8 parsecs", "", "GiB", "-5", float("nan"), True])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        pl.parse_bytes(bad)


def test_gpu_index_round_trip_and_layout(tmp_path):
    n_ff = 96
    neurons = [np.array([0, 5, 7, 95]), np.array([], dtype=int), np.arange(n_ff)]
    path = str(tmp_path / "m.gguf.generated.gpuidx")
    pl.write_gpu_index(path, neurons, n_ff, vram_capacity=3 << 30)
    with open(path, "rb") as fh:
        head = fh.read(8)
    assert head[:4] == b"PWRI" and int.from_bytes(head[4:], "little") == 3

    back = _core.read_gpu_index(path)
    assert back["vram_capacity"] == 3 << 30
    assert len(back["gpu_idx"]) == 3
    for n, mask, bucket in zip(neurons, back["gpu_idx"], back["gpu_bucket"]):
        expected = np.zeros(n_ff, dtype=np.int32)
        expected[n] = 1
        np.testing.assert_array_equal(mask, expected)
        np.testing.assert_array_equal(bucket, np.sort(n).astype(np.int32))
        assert mask.dtype == np.int32 and bucket.dtype == np.int32

    # PowerInfer's order and types, read independently with the gguf package
    plain = tmp_path / "plain.gguf"
    shutil.copy(path, plain)
    with open(plain, "r+b") as fh:
        fh.write(b"GGUF")
    r = gguf.GGUFReader(str(plain))
    names = [t.name for t in r.tensors]
    assert names == [f"blk.{i}.{k}" for i in range(3) for k in ("gpu_idx", "gpu_bucket")]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.I32 for t in r.tensors)
    assert r.fields["general.architecture"].contents() == "generic.gpu_index"
    assert r.fields["split.vram_capacity"].types[0] == gguf.GGUFValueType.UINT64
    assert r.fields["generic.gpu_index.block_count"].contents() == 3


def test_gpu_index_reader_rejects_inconsistent_files(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "bad.gpuidx"), "generic.gpu_index")
    mask = np.array([1, 0, 1, 0], dtype=np.int32)
    w.add_tensor("blk.0.gpu_idx", mask, raw_dtype=gguf.GGMLQuantizationType.I32)
    w.add_tensor(
        "blk.0.gpu_bucket",
        np.array([0, 3], dtype=np.int32),
        raw_dtype=gguf.GGMLQuantizationType.I32,
    )
    w.add_uint64("split.vram_capacity", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(_core.ModelError, match="gpu_bucket"):
        _core.read_gpu_index(str(tmp_path / "bad.gpuidx"))

    w = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(_core.ModelError, match="not a GPU index"):
        _core.read_gpu_index(str(tmp_path / "model.gguf"))
    with pytest.raises(FileNotFoundError):
        _core.read_gpu_index(str(tmp_path / "missing.gpuidx"))


def test_plan_places_dense_first_and_rejects_tiny_budgets():
    """Each layer's dense part goes with its own KV cache, in layer order, then the output, then
    neurons, and only in layers that are on the GPU; the whole plan fits the budget."""
    mb = pl.ModelBytes(
        n_layer=2,
        n_ff=128,
        neuron_bytes=np.array([1000.0, 1000.0]),
        layer_dense_bytes=np.array([50_000.0, 50_000.0]),
        output_bytes=20_000,
        kv_cache_bytes=10_000,
    )
    freq = [
        np.linspace(0.5, 0, 128),
        np.linspace(1, 0, 128),
    ]  # layer 1's neurons are the hotter ones
    # everything dense fits, each layer with its KV cache, then the output, then 64 neurons
    budget = 50_000 * 2 + 10_000 + 20_000 + 64_000
    p = pl.plan(mb, freq, budget, 50e9, 1000e9, 0.0, group=64)
    assert p.dense_layers_on_gpu == 2 and p.output_on_gpu and p.kv_cache_layers_on_gpu == 2
    assert (
        sum(len(n) for n in p.solution.gpu_neurons) == 64 and len(p.solution.gpu_neurons[1]) == 64
    )
    assert p.dense_bytes + p.ffn_bytes <= budget
    # an f32 KV cache takes twice the room: 10,000 bytes fewer for neurons
    p = pl.plan(mb, freq, budget, 50e9, 1000e9, 0.0, group=16, kv_type="f32")
    assert p.dense_bytes == 50_000 * 2 + 20_000 + 20_000 and p.ffn_bytes == 48_000
    # layer 1's dense part and KV cache do not fit: its neurons, though hotter, stay on the CPU
    # (the executor runs hot neurons only in GPU layers), and layer 0 takes what is left
    budget = 50_000 + 45_000
    p = pl.plan(mb, freq, budget, 50e9, 1000e9, 0.0, group=32)
    assert p.dense_layers_on_gpu == 1 and not p.output_on_gpu and p.kv_cache_layers_on_gpu == 1
    assert len(p.solution.gpu_neurons[0]) == 32 and len(p.solution.gpu_neurons[1]) == 0
    assert p.dense_bytes == 55_000 and p.dense_bytes + p.ffn_bytes <= budget
    with pytest.raises(ValueError, match="too small for anything"):
        pl.plan(mb, freq, 1000, 50e9, 1000e9, 0.0, group=64)
    with pytest.raises(
        ValueError, match="too small for anything"
    ):  # layer 0's dense part fits, its KV cache does not
        pl.plan(mb, freq, 52_000, 50e9, 1000e9, 0.0, group=64)
    with pytest.raises(ValueError, match="layers"):
        pl.plan(mb, freq[:1], 10**9, 50e9, 1000e9, 0.0)
