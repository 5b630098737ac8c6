"""Engine logits on tiny synthetic models against the independent float64 numpy reference."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from powerinfer_rs import Engine, _core
from reference import forward, read_weights
from synth import write_model

# Relative error ||engine - reference|| / ||reference|| over all logits.
# Float weights: the engine computes in f32 (reference in f64), so only rounding differs.
FLOAT_TOL = 2e-4
# Quantized weights: the engine also rounds activations to int8 per 32-block (as llama.cpp does).
# Against a reference that does the same rounding only float error remains (an occasional
# rounding tie flipped by f32 vs f64 arithmetic included) ...
QUANT_TOL = 1e-4
# ... and against the plain float64 reference the int8 rounding shows, about 1% per matmul on
# these random weights, compounding over the layers.
QUANT_VS_FLOAT_TOL = 8e-2

CASES = [
    # id, arch, activation key, dtype, tied, bias, GQA heads
    ("llama-swiglu-f32-gqa", "llama", None, Q.F32, False, False, (4, 2)),
    ("llama-swiglu-f16-mha", "llama", None, Q.F16, True, False, (4, 4)),
    ("qwen2-neox-swiglu-bias-f32", "qwen2", None, Q.F32, True, True, (4, 1)),
    ("llama-reglu-f32", "llama", "relu", Q.F32, False, False, (4, 2)),
    ("bamboo-dreglu-f32", "bamboo", None, Q.F32, False, False, (4, 2)),
    ("mistral-swiglu-bf16", "mistral", None, Q.BF16, False, False, (4, 2)),
    ("llama-reglu-q8_0", "llama", "relu", Q.Q8_0, False, False, (4, 2)),
    ("bamboo-dreglu-q4_0", "bamboo", None, Q.Q4_0, False, False, (4, 2)),
    ("qwen2-neox-swiglu-q4_1", "qwen2", None, Q.Q4_1, False, True, (4, 2)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_logits_match_float64_reference(tmp_path, case):
    _, arch, act, dtype, tied, bias, (n_head, n_kv) = case
    path = write_model(
        tmp_path / "m.gguf",
        arch=arch,
        activation=act,
        dtype=dtype,
        tied=tied,
        bias=bias,
        n_head=n_head,
        n_head_kv=n_kv,
    )
    # An f32 KV cache keeps the comparison exact; the f16 cache is checked separately below.
    engine = Engine.load(path, threads=2, kv_type="f32")
    expected_act = {"relu": "reglu", None: "dreglu" if arch == "bamboo" else "swiglu"}[act]
    assert engine.config["ffn_activation"] == expected_act
    assert engine.config["rope_style"] == ("neox" if arch == "qwen2" else "normal")

    rng = np.random.default_rng(1)
    ids = rng.integers(0, engine.n_vocab, size=23).tolist()
    got = engine.logits(ids)
    assert got.shape == (23, engine.n_vocab) and got.dtype == np.float32

    w, meta = read_weights(path)
    quantized = dtype not in (Q.F32, Q.F16, Q.BF16)
    ref = forward(w, meta, ids, int8_activations=quantized)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    tol = QUANT_TOL if quantized else FLOAT_TOL
    assert rel < tol, f"relative error {rel:.2e} >= {tol}"
    if quantized:
        plain = forward(w, meta, ids)
        rel_plain = np.linalg.norm(got - plain) / np.linalg.norm(plain)
        assert rel_plain < QUANT_VS_FLOAT_TOL, (
            f"relative error vs float64 weights-only reference {rel_plain:.2e}"
        )
    # The reference is sensitive enough to catch a wrong RoPE or activation: check that a
    # deliberately wrong reference is far away.
    wrong_act = "relu" if expected_act == "swiglu" else "silu"
    wrong = forward(w, meta, ids, activation=wrong_act, int8_activations=quantized)
    wrong_rel = np.linalg.norm(got - wrong) / np.linalg.norm(wrong)
    assert wrong_rel > 5 * max(rel, FLOAT_TOL), (
        f"wrong activation only {wrong_rel:.2e} away (right: {rel:.2e})"
    )
    print(f"relative error {rel:.2e} (tolerance {tol}); wrong activation {wrong_rel:.2e}")


@pytest.mark.parametrize("dtype", [Q.F32, Q.Q8_0])
def test_incremental_decode_equals_batched_prefill(tmp_path, dtype):
    """KV cache: evaluating one token at a time gives the same logits as one batched pass."""
    path = write_model(tmp_path / "m.gguf", dtype=dtype, n_layer=3)
    model = _core.Model(path, 2)
    ids = list(range(3, 40))
    batched = _core.Session(model, 64, "f32").eval(ids, all_logits=True)
    s = _core.Session(model, 64, "f32")
    first = s.eval(ids[:10], all_logits=True)
    steps = [s.eval([t]) for t in ids[10:]]
    inc = np.vstack([first, np.stack(steps)])
    assert s.pos == len(ids)
    np.testing.assert_allclose(inc, batched, rtol=0, atol=2e-4 * np.abs(batched).max())


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_decode_at_long_context_equals_batched_prefill(tmp_path, kv_type):
    """Past a few hundred cached positions, decode cuts the cache into pieces attended on
    different threads and merged (flash-decoding); the logits equal one batched pass, which
    attends row by row, and the float64 reference."""
    path = write_model(tmp_path / "m.gguf", n_layer=2, n_ctx=1024, n_head=4, n_head_kv=2)
    model = _core.Model(path, 3)
    rng = np.random.default_rng(1)
    ids = [int(t) for t in rng.integers(3, 200, size=700)]
    batched = _core.Session(model, 1024, kv_type).eval(ids, all_logits=True)
    s = _core.Session(model, 1024, kv_type)
    s.eval(ids[:660])
    steps = np.stack([s.eval([t]) for t in ids[660:]])
    np.testing.assert_allclose(steps, batched[660:], rtol=0, atol=2e-4 * np.abs(batched).max())
    w, meta = read_weights(path)
    ref = forward(w, meta, ids)[660:]
    rel = np.linalg.norm(steps - ref) / np.linalg.norm(ref)
    assert rel < (2e-5 if kv_type == "f32" else 5e-3), rel  # f16 rounds each cached value


def test_a_prompt_longer_than_a_pass_equals_any_other_split(tmp_path):
    """A prompt past `UBATCH` (512) tokens runs in several passes; a token's logits do not
    depend on which pass it ran in, nor on where the passes begin: bit for bit the same as
    feeding the prompt in pieces of 300 (row groups, attention in blocks) or of 6 (the
    small-batch kernels)."""
    path = write_model(tmp_path / "m.gguf", dtype=Q.Q8_0, n_layer=2, n_ctx=1200)
    model = _core.Model(path, 2)
    rng = np.random.default_rng(3)
    ids = [int(t) for t in rng.integers(3, 200, size=1100)]
    whole = _core.Session(model, 1200).eval(ids, all_logits=True)
    for piece in (300, 6):
        s = _core.Session(model, 1200)
        parts = np.vstack(
            [s.eval(ids[i : i + piece], all_logits=True) for i in range(0, len(ids), piece)]
        )
        np.testing.assert_array_equal(parts, whole, err_msg=f"pieces of {piece}")


def test_thread_count_does_not_change_results_beyond_rounding(tmp_path):
    path = write_model(tmp_path / "m.gguf", dtype=Q.Q4_1)
    ids = list(range(5, 30))
    a = Engine.load(path, threads=1).logits(ids)
    b = Engine.load(path, threads=3).logits(ids)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(a).max())


def test_powerinfer_magic_llama_is_relu_gated(tmp_path):
    """A `PWRI` llama file is a ReLU model (ReluLLaMA/ProSparse), as PowerInfer reads it."""
    path = write_model(tmp_path / "m.gguf", magic=b"PWRI")
    engine = Engine.load(path, kv_type="f32")
    assert engine.config["ffn_activation"] == "reglu"
    w, meta = read_weights_pwri(path)
    ids = [5, 9, 77, 200, 13]
    rel = np.linalg.norm(engine.logits(ids) - forward(w, meta, ids, "relu")) / np.linalg.norm(
        forward(w, meta, ids, "relu")
    )
    assert rel < FLOAT_TOL


def read_weights_pwri(path):
    # The gguf package only reads the GGUF magic: read a copy with the magic restored.
    import shutil

    copy = str(path) + ".gguf-magic"
    shutil.copy(path, copy)
    with open(copy, "r+b") as f:
        f.write(b"GGUF")
    return read_weights(copy)


def test_f16_kv_cache_stays_close_to_f32(tmp_path):
    """The default f16 KV cache rounds keys and values to 11 significant bits (relative step
    about 5e-4 per value, compounding over layers)."""
    path = write_model(tmp_path / "m.gguf", n_layer=3)
    ids = list(range(3, 60))
    exact = Engine.load(path, kv_type="f32").logits(ids)
    half = Engine.load(path).logits(ids)
    rel = np.linalg.norm(half - exact) / np.linalg.norm(exact)
    assert 0 < rel < 5e-3, rel
    w, meta = read_weights(path)
    ref = forward(w, meta, ids)
    assert np.linalg.norm(half - ref) / np.linalg.norm(ref) < 5e-3
