"""PowerInfer model files (PWRI magic, neuron-major ffn_down_t, per-layer predictors) of every
sparse architecture, written by the tests in PowerInfer's layout: dense logits against the
independent float64 reference, and sparse (predictor) logits against dense ones, in prefill and
in token-by-token decode (which runs the fused sparse operator)."""

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from powerinfer_rs import Engine, ModelError, _core
from reference import forward, read_weights
from synth import write_model, write_powerinfer_model

FLOAT_TOL = 2e-4
QUANT_TOL = 1e-4
FLIP_TOL = 5e-3
# Sparse vs dense: the exact predictor selects every neuron whose gate is positive, up to its
# slightly negative threshold; a neuron it could still miss has a gate within rounding of zero,
# so its contribution (proportional to the gate) is within rounding too.
SPARSE_TOL = 1e-4

CASES = [
    # id, arch, dtype, extra writer options
    ("llama-reglu-f16", "llama", Q.F16, {}),
    ("llama-reglu-q4_0", "llama", Q.Q4_0, {}),
    ("llama-reglu-q8_0", "llama", Q.Q8_0, {}),
    ("bamboo-dreglu-q4_1", "bamboo", Q.Q4_1, {}),
    ("bamboo-dreglu-f32-gqa", "bamboo", Q.F32, {"n_head_kv": 2}),
    ("falcon-relu-f16-mqa", "falcon", Q.F16, {"n_head_kv": 1}),
    ("falcon40b-relu-q4_0-norm2", "falcon", Q.Q4_0, {"n_head_kv": 2, "attn_norm_2": True}),
    ("opt-relu-f16", "opt", Q.F16, {}),
    ("opt-relu-q8_0", "opt", Q.Q8_0, {}),
]


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def close_to_reference(got, ref, tol, quantized):
    """Every position within `tol` of the reference. Against the int8 reference one position may
    be further, up to FLIP_TOL: an activation within float32 rounding of an int8 rounding
    boundary can round the other way in the engine, which moves that position by about one
    quantization step (a wrong layer would move every position)."""
    per = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    if not quantized:
        return rel(got, ref) < tol
    return int(np.sum(per >= tol)) <= 1 and float(per.max()) < FLIP_TOL


def decode_logits(engine, ids):
    """Logits of each position, evaluating one token per call (the decode path)."""
    session = engine._session()
    out = np.stack([session.eval([t]) for t in ids])
    return out, session.take_stats()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sparse_equals_dense_equals_reference(tmp_path, case):
    _, arch, dtype, opts = case
    path = write_powerinfer_model(tmp_path / "m.gguf", arch=arch, dtype=dtype, **opts)
    engine = Engine.load(path, threads=2, kv_type="f32")
    cfg = engine.config
    assert cfg["powerinfer"] and cfg["has_predictors"] and cfg["has_down_t"]
    assert cfg["ffn_activation"] == {"bamboo": "dreglu", "llama": "reglu"}.get(arch, "relu")
    assert engine.sparsity == "predictor"  # the default when the file has predictors
    assert engine.sparse_threshold == pytest.approx(-0.1)

    ids = np.random.default_rng(1).integers(0, engine.n_vocab, size=19).tolist()
    w, meta = read_weights(path)
    quantized = dtype not in (Q.F32, Q.F16)
    ref = forward(w, meta, ids, int8_activations=quantized)
    tol = QUANT_TOL if quantized else FLOAT_TOL

    engine.set_sparsity("dense")
    dense = engine.logits(ids)
    assert engine.last_stats["ffn_sparsity"] == 0.0
    assert close_to_reference(dense, ref, tol, quantized), rel(dense, ref)
    dense_decode, _ = decode_logits(engine, ids)
    assert close_to_reference(dense_decode, ref, tol, quantized), rel(dense_decode, ref)

    # the file's cut-off (slightly negative: the exact predictor then misses nothing)
    engine.set_sparsity(
        "predictor", sparse_threshold=engine.sparse_threshold, predictor_recall=True
    )
    sparse = engine.logits(ids)
    assert rel(sparse, dense) < SPARSE_TOL
    assert engine.last_stats["predictor_recall"] > 0.99
    sparse_decode, st = decode_logits(engine, ids)
    # against dense decode: prefill sums in another order, and a rounding flip (see
    # close_to_reference) may separate the two paths at one position
    assert rel(sparse_decode, dense_decode) < SPARSE_TOL
    assert close_to_reference(sparse_decode, ref, tol + SPARSE_TOL, quantized), rel(
        sparse_decode, ref
    )
    # the predictor really skipped neurons (random ReLU weights: about half are inactive)
    assert 0.3 < st["skipped"] / st["neurons"] < 0.7
    assert st["truly_active_selected"] / st["truly_active"] > 0.99
    # without recall tracking (which needs every logit) the predictor's products run inside
    # the operator's pass: the same selection, the sums split another way
    engine.set_sparsity("predictor", sparse_threshold=engine.sparse_threshold)
    bundled, st_fused = decode_logits(engine, ids)
    assert (st_fused["neurons"], st_fused["skipped"]) == (st["neurons"], st["skipped"])
    assert rel(bundled, sparse_decode) < 1e-4
    # each neuron's rows read from its bundle or from the matrices apart: the same kernels on
    # the same bytes in the same order, so the same bits
    assert engine.neuron_bundles  # the default for a model this small
    engine.set_sparsity("predictor", sparse_threshold=engine.sparse_threshold, neuron_bundles=False)
    assert not engine.neuron_bundles
    apart, _ = decode_logits(engine, ids)
    np.testing.assert_array_equal(apart, bundled)


@pytest.mark.parametrize("arch", ["llama", "falcon"])
def test_predictor_cutoffs_calibrated_for_recall(tmp_path, arch):
    """The per-layer cut-offs calibrated for a recall target keep that share of the truly firing
    neurons, checked against the predictor evaluated in float64 numpy on the captured inputs."""
    path = write_powerinfer_model(tmp_path / "m.gguf", arch=arch, predictor="random")
    engine = Engine.load(path, threads=2, kv_type="f32", sparsity="dense")
    tokens = np.random.default_rng(3).integers(0, engine.n_vocab, size=96).tolist()
    window = 48
    session = _core.Session(engine._model, window, "f32")
    recalls = [0.9, 0.99]
    cuts = np.array(session.calibrate_predictor(tokens, window, recalls))  # (recall, layer)
    # the same windows, densely, with the predictor inputs and activations captured
    session.set_capture(True)
    xs, scores = [], []
    for i in range(0, len(tokens), window):
        session.truncate(0)
        session.eval(tokens[i : i + window])
        x, sc = session.take_capture()
        xs.append(x)
        scores.append(sc)
    xs, scores = np.concatenate(xs, axis=1), np.concatenate(scores, axis=1)
    w, _ = read_weights(path)
    for l in range(engine.n_layer):
        logits = np.maximum(xs[l] @ w[f"blk.{l}.fc1.weight"].T, 0.0) @ w[f"blk.{l}.fc2.weight"].T
        active = logits[scores[l] > 0]
        assert active.size > 100
        for r, cut in zip(recalls, cuts[:, l]):
            kept = np.mean(active >= cut)
            # at least the target (up to float rounding at the cut), and within one histogram
            # bin (1/64 octave) of the exact quantile
            assert r - 0.005 <= kept, (l, r, cut, kept)
            assert kept <= r + 0.02, (l, r, cut, kept)
    # through the engine: calibrated on load, cached beside the model, higher target -> more kept
    text = "the quick brown fox jumps over the lazy dog and then " * 12
    loose = Engine.load(
        path,
        threads=2,
        sparsity="predictor",
        predictor_recall_target=0.9,
        calibration_text=text,
        predictor_recall=True,
    )
    strict = Engine.load(
        path, threads=2, sparsity="predictor", calibration_text=text, predictor_recall=True
    )
    assert strict.predictor_recall_target == 0.99 and loose.predictor_recall_target == 0.9
    assert len(strict.predictor_layer_cutoffs) == engine.n_layer
    assert all(
        a <= b for a, b in zip(strict.predictor_layer_cutoffs, loose.predictor_layer_cutoffs)
    )
    import json

    cache = json.loads((tmp_path / "m.gguf.thresholds.json").read_text())
    assert {e["target"] for e in cache["entries"] if e["kind"] == "predictor_recall"} >= {0.9, 0.99}
    ids = engine.tokenize(text)[:120]
    loose.logits(ids)
    strict.logits(ids)
    assert strict.last_stats["predictor_recall"] > loose.last_stats["predictor_recall"]
    assert strict.last_stats["predictor_recall"] > 0.95
    for bad in (0.0, 1.5, float("nan"), True, "0.9"):
        with pytest.raises(ValueError, match="predictor_recall_target"):
            Engine.load(path, predictor_recall_target=bad)


def check_sparse_prefill_equals_decode(tmp_path, case, seed, thresholds, skips):
    """Prefill of 12 tokens in predictor mode, at the first cut-off of `thresholds` whose share
    of neurons skipped satisfies `skips`, computes per token what token-by-token sparse decode
    computes, with a predictor far from exact (so both differ from dense)."""
    _, arch, dtype, opts = case
    path = write_powerinfer_model(
        tmp_path / "m.gguf", arch=arch, dtype=dtype, predictor="random", **opts
    )
    engine = Engine.load(path, threads=2, kv_type="f32")
    ids = np.random.default_rng(seed).integers(0, engine.n_vocab, size=12).tolist()
    engine.set_sparsity("dense")
    dense = engine.logits(ids)
    for t in thresholds:
        engine.set_sparsity("predictor", sparse_threshold=t)
        prefill = engine.logits(ids)
        if skips(engine.last_stats["ffn_sparsity"]):
            break
    else:
        raise AssertionError("no cut-off in the list skips the share asked for")
    skipped = engine.last_stats["ffn_sparsity"]
    decode, st = decode_logits(engine, ids)
    assert st["skipped"] / st["neurons"] == pytest.approx(skipped)  # the same selections
    assert rel(prefill, decode) < 1e-4
    assert rel(prefill, dense) > 1e-3  # the skipped neurons mattered


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sparse_prefill_equals_sparse_decode(tmp_path, case):
    """Prefill over the union of the tokens' selections: at 95% (but not all) of the neurons
    skipped, the selected (token, neuron) pairs are under DENSE_FRACTION and the union of 12
    tokens' selections holds at most 60% of the rows, so prefill takes the row-sparse path."""
    check_sparse_prefill_equals_decode(
        tmp_path, case, 2, [0.5 * 2**k for k in range(12)], lambda s: 0.95 <= s < 1.0
    )


@pytest.mark.parametrize("case", CASES[:4], ids=[c[0] for c in CASES[:4]])
def test_sparse_prefill_over_most_rows_equals_sparse_decode(tmp_path, case):
    """A prompt whose tokens together select most neurons of short rows computes them through
    the dense products, the cells its tokens did not select zeroed after
    (`sparse::batch_union_reads_dense`): at 30-70% skipped per token, 12 tokens' union is
    nearly every neuron."""
    cutoffs = [0.5 * 2**k for k in range(12)] + [-(0.5 * 2**k) for k in range(12)]
    check_sparse_prefill_equals_decode(tmp_path, case, 3, cutoffs, lambda s: 0.3 <= s <= 0.7)


def test_threshold_sparse_prefill_equals_decode(tmp_path):
    """Threshold mode at 90%: prefill of a few tokens reads only the union's up and down rows and
    equals token-by-token decode."""
    path = write_model(tmp_path / "m.gguf", dtype=Q.Q8_0)
    engine = Engine.load(path, threads=2, kv_type="f32", sparsity="threshold", target_sparsity=0.9)
    ids = list(range(40, 46))
    prefill = engine.logits(ids)
    # the selected (token, neuron) pairs are under DENSE_FRACTION, and their union is a strict
    # subset of the rows (at most 6 tokens x the selected share)
    assert 6 * (1 - engine.last_stats["ffn_sparsity"]) < 0.85
    decode, _ = decode_logits(engine, ids)
    assert rel(prefill, decode) < 1e-4
    # the gate given (threshold mode computes it densely), the up rows read first: from the
    # bundles (forced on, as the default is) or apart, the same bits
    engine.set_sparsity("threshold", target_sparsity=0.9, neuron_bundles=False)
    np.testing.assert_array_equal(decode_logits(engine, ids)[0], decode)
    engine.set_sparsity("threshold", target_sparsity=0.9, neuron_bundles=True)
    np.testing.assert_array_equal(decode_logits(engine, ids)[0], decode)
    engine.set_sparsity("dense")
    assert not engine.neuron_bundles
    assert rel(prefill, engine.logits(ids)) > 1e-3


def test_predictor_recall_measures_misses(tmp_path):
    """A predictor with its sign flipped selects only inactive neurons: recall near 0, and the
    logits differ from dense."""
    path = write_powerinfer_model(tmp_path / "m.gguf", predictor="negated", threshold=0.0)
    # at the file's cut-off (calibrated ones would select nearly everything to reach the recall)
    engine = Engine.load(path, threads=2, predictor_recall=True, sparse_threshold=0.0)
    ids = list(range(3, 30))
    out = engine.generate(ids, max_tokens=8)
    assert isinstance(out, str)
    assert engine.last_stats["predictor_recall"] < 0.05
    sparse = engine.logits(ids)
    engine.set_sparsity("dense")
    assert rel(sparse, engine.logits(ids)) > 0.05


def test_step_times_cover_the_pass_and_change_nothing(tmp_path):
    """`step_times=True` reports the seconds of each forward-pass step, the sparse FFN's among
    them, for the prompt and for decode; the steps lie inside the measured evaluation, and the
    timed passes give the untimed passes' logits bit for bit."""
    path = write_powerinfer_model(tmp_path / "m.gguf", dtype=Q.Q4_0)
    timed = Engine.load(path, threads=2, step_times=True)
    plain = Engine.load(path, threads=2)
    ids = list(range(3, 20))
    assert np.array_equal(timed.logits(ids), plain.logits(ids))
    assert timed.generate(ids, max_tokens=6) == plain.generate(ids, max_tokens=6)
    st = timed.last_stats
    assert timed.sparsity == "predictor" and st["ffn_sparsity"] > 0
    for phase, seconds in (("prefill_steps_s", "prefill_s"), ("decode_steps_s", "decode_s")):
        steps = st[phase]
        assert {"embed", "norm", "qkv", "attend", "attn_out", "ffn", "residual", "logits"} <= set(
            steps
        ), steps
        assert all(v > 0 for v in steps.values()), steps
        assert sum(steps.values()) <= st[seconds], (steps, st[seconds])
    assert "decode_steps_s" not in plain.last_stats
    assert "prefill_steps_s" not in plain.last_stats
    # the core: one pass per evaluation, nothing while off
    s = _core.Session(_core.Model(path, 1), 16)
    assert s.take_step_times() is None
    s.set_step_times(True)
    s.eval([3, 4, 5])
    s.eval([6])
    times = s.take_step_times()
    assert times["passes"] == 2 and times["ffn"] > 0
    assert s.take_step_times()["passes"] == 0
    s.set_step_times(False)
    assert s.take_step_times() is None
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="step_times must be True or False"):
            Engine.load(path, step_times=bad)
    # a GPU's steps return before their kernels finish: refused by name
    with pytest.raises(ValueError, match="step_times times the CPU's passes"):
        Engine.load(path, device="emulated", step_times=True)


def test_threshold_from_file_and_override(tmp_path, monkeypatch):
    path = write_powerinfer_model(tmp_path / "m.gguf", predictor="random", threshold=0.0)
    ids = list(range(3, 30))
    # the file's global cut-off (without an override, per-layer ones are calibrated instead)
    assert Engine.load(path, threads=2, sparsity="dense").config["sparse_threshold"] == 0.0
    base = Engine.load(path, threads=2, sparse_threshold=0.0)
    base.logits(ids)
    mid = base.last_stats["ffn_sparsity"]
    assert 0.05 < mid < 0.95
    # a high cut-off skips (nearly) everything; a very low one nothing
    high = Engine.load(path, threads=2, sparse_threshold=1e6)
    high.logits(ids)
    assert high.last_stats["ffn_sparsity"] == 1.0
    low = Engine.load(path, threads=2, sparse_threshold=-1e6)
    low.logits(ids)
    assert low.last_stats["ffn_sparsity"] == 0.0
    # PowerInfer's environment variable, when no argument is given
    monkeypatch.setenv("LLAMA_SPARSE_PRED_THRESHOLD", "1e6")
    env = Engine.load(path, threads=2)
    assert env.sparse_threshold == 1e6
    monkeypatch.setenv("LLAMA_SPARSE_PRED_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="LLAMA_SPARSE_PRED_THRESHOLD"):
        Engine.load(path, threads=2)


def test_opt_biases_match_reference(tmp_path):
    """OPT with nonzero FFN norm and up biases (the predictor is then only approximate): dense
    logits still match the reference exactly; predictor mode runs and skips neurons."""
    path = write_powerinfer_model(tmp_path / "m.gguf", arch="opt", dtype=Q.F32, ffn_bias=True)
    engine = Engine.load(path, threads=2, kv_type="f32", sparsity="dense")
    ids = list(range(5, 40))
    w, meta = read_weights(path)
    assert rel(engine.logits(ids), forward(w, meta, ids)) < FLOAT_TOL
    assert engine.config["n_ctx_train"] == 256  # the learned position table's rows minus 2
    engine.set_sparsity("predictor")
    engine.logits(ids)
    assert engine.last_stats["ffn_sparsity"] > 0.2


def test_opt_context_is_bounded_by_position_table(tmp_path):
    path = write_powerinfer_model(tmp_path / "m.gguf", arch="opt", n_ctx=64)
    with pytest.raises(ValueError, match="position"):
        _core.Session(_core.Model(path, 1), 65)
    engine = Engine.load(path, threads=1)
    assert engine.n_ctx == 64


@pytest.mark.parametrize("dtype", [Q.F16, Q.Q4_0, Q.Q8_0], ids=["f16", "q4_0", "q8_0"])
def test_quantized_predictors(tmp_path, dtype):
    """Predictor weights in F16 or quantized (PowerInfer's quantized files use Q4_0)."""
    path = write_powerinfer_model(
        tmp_path / "m.gguf", dtype=Q.Q4_0, predictor_dtype=dtype, threshold=-0.1
    )
    engine = Engine.load(path, threads=2, predictor_recall=True, sparse_threshold=-0.1)
    ids = list(range(3, 30))
    sparse = engine.logits(ids)
    assert engine.last_stats["predictor_recall"] > 0.97
    engine.set_sparsity("dense")
    # a 4-bit predictor is coarser: it misses a few more weakly active neurons
    assert rel(sparse, engine.logits(ids)) < (2e-2 if dtype == Q.Q4_0 else 5e-3)


# ----- threshold mode (models without predictors)


def test_threshold_mode_calibrates_and_caches(tmp_path):
    path = write_model(tmp_path / "m.gguf", dtype=Q.F32)
    text = "the quick brown fox jumps over the lazy dog and then " * 20
    engine = Engine.load(
        path, threads=2, sparsity="threshold", target_sparsity=0.5, calibration_text=text
    )
    assert engine.sparsity == "threshold" and len(engine.gate_cutoffs) == engine.n_layer
    cache = tmp_path / "m.gguf.thresholds.json"
    assert cache.exists()
    # on the calibration text itself the measured sparsity is the target
    ids = engine.tokenize(text)[:200]
    engine.logits(ids)
    assert engine.last_stats["ffn_sparsity"] == pytest.approx(0.5, abs=0.05)
    # decode computes the same thing as prefill
    prefill = engine.logits(ids[:30])
    decode, _ = decode_logits(engine, ids[:30])
    assert rel(decode, prefill) < 1e-4

    # the second load reads the cache: prove it by planting different thresholds there
    import json

    data = json.loads(cache.read_text())
    for e in data["entries"]:
        e["thresholds"] = [123.0] * engine.n_layer
    cache.write_text(json.dumps(data))
    again = Engine.load(
        path, threads=2, sparsity="threshold", target_sparsity=0.5, calibration_text=text
    )
    assert again.gate_cutoffs == [123.0] * engine.n_layer
    again.logits(ids[:20])
    assert again.last_stats["ffn_sparsity"] > 0.99


def test_threshold_mode_at_zero_target_equals_dense(tmp_path):
    path = write_model(tmp_path / "m.gguf", dtype=Q.F32)
    ids = list(range(3, 40))
    dense = Engine.load(path, threads=2, kv_type="f32")
    sparse = Engine.load(path, threads=2, kv_type="f32", sparsity="threshold", target_sparsity=0.0)
    assert rel(sparse.logits(ids), dense.logits(ids)) < 1e-6
    assert sparse.last_stats["ffn_sparsity"] < 1e-3


def test_threshold_sparsity_grows_with_target(tmp_path):
    path = write_model(tmp_path / "m.gguf", dtype=Q.Q8_0)
    ids = list(range(3, 60))
    measured = []
    for target in (0.3, 0.7):
        e = Engine.load(path, threads=2, sparsity="threshold", target_sparsity=target)
        e.logits(ids)
        measured.append(e.last_stats["ffn_sparsity"])
    assert measured[0] < measured[1]


# ----- bad input


def test_pwri_file_without_down_t(tmp_path):
    path = write_powerinfer_model(tmp_path / "m.gguf", skip=("blk.1.ffn_down_t.weight",))
    with pytest.raises(ModelError, match=r"PWRI.*blk\.1\.ffn_down_t\.weight"):
        Engine.load(path)


def test_predictor_shape_mismatch(tmp_path):
    path = write_powerinfer_model(tmp_path / "m.gguf", fc2_rows=80)
    with pytest.raises(
        ModelError,
        match=r"predictor blk\.0\.fc2\.weight has shape \[80, 192\], expected \[96, 192\]",
    ):
        Engine.load(path)


def test_predictor_half_missing(tmp_path):
    path = write_powerinfer_model(tmp_path / "m.gguf", skip=("blk.0.fc2.weight",))
    with pytest.raises(ModelError, match="only one of"):
        Engine.load(path)


def test_bad_sparsity_arguments(tmp_path):
    plain = write_model(tmp_path / "plain.gguf")
    pw = write_powerinfer_model(tmp_path / "pw.gguf")
    with pytest.raises(ValueError, match="needs a model with predictors"):
        Engine.load(plain, sparsity="predictor")
    with pytest.raises(ValueError, match="sparsity must be"):
        Engine.load(pw, sparsity="sparse")
    for bad in (1.0, -0.1, float("nan"), "half", True):
        with pytest.raises(ValueError, match="target_sparsity"):
            Engine.load(plain, sparsity="threshold", target_sparsity=bad)
    for bad in (float("nan"), float("inf"), "0.5"):
        with pytest.raises(ValueError, match="sparse_threshold"):
            Engine.load(pw, sparse_threshold=bad)
    with pytest.raises(ValueError, match="calibration text"):
        Engine.load(plain, sparsity="threshold", calibration_text="   ")
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match="neuron_bundles must be True, False or None"):
            Engine.load(pw, neuron_bundles=bad)
    # the core checks too
    s = _core.Session(_core.Model(pw, 1), 16)
    with pytest.raises(ValueError, match="finite"):
        s.set_sparsity("predictor", predictor_cutoff=math.nan)
    with pytest.raises(ValueError, match="layer 1 gate cut-off must be finite"):
        s.set_sparsity("threshold", gate_cutoffs=[0.1, math.inf])
    with pytest.raises(ValueError, match="needs 2 gate cut-offs"):
        s.set_sparsity("threshold", gate_cutoffs=[0.1])
    with pytest.raises(ValueError, match="target sparsity"):
        s.calibrate(list(range(3, 20)), 8, [1.5])
