"""Batched decode across sessions (`_core.eval_batch` / `decode_batch`, what the server uses for
concurrent clients): each session's logits must be exactly those of a single-token `eval`, for
every architecture, weight type and sparsity mode, with sessions at different positions."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from powerinfer_rs import _core
from synth import write_model, write_powerinfer_model

PROMPTS = [[1, 5, 9, 3], [7], [2, 2, 4, 11, 6, 8, 40], [33, 34]]


def sessions(model, sparsity, n_ctx=32):
    out = []
    for p in PROMPTS:
        s = _core.Session(model, n_ctx, "f16")
        s.set_sparsity(*sparsity)
        s.eval(p)
        s.take_stats()
        out.append(s)
    return out


CASES = [
    ("llama swiglu f32", lambda p: write_model(p, dtype=Q.F32), ("dense",)),
    ("llama swiglu q4_1", lambda p: write_model(p, dtype=Q.Q4_1), ("dense",)),
    (
        "llama swiglu q8_0 threshold",
        lambda p: write_model(p, dtype=Q.Q8_0),
        ("threshold", 0.0, [0.05, 0.05]),
    ),
    (
        "llama swiglu q8_0 input sparsity",
        lambda p: write_model(p, dtype=Q.Q8_0),
        ("threshold", 0.0, None, False, None, [[1.3, 0.8, 1.1, 0.17]] * 2),
    ),
    ("qwen2 biases", lambda p: write_model(p, arch="qwen2", bias=True), ("dense",)),
    (
        "reglu powerinfer predictor",
        lambda p: write_powerinfer_model(p, dtype=Q.F16),
        ("predictor", -0.1),
    ),
    (
        "reglu powerinfer dense (down_t only)",
        lambda p: write_powerinfer_model(p, dtype=Q.Q4_0),
        ("dense",),
    ),
    ("bamboo predictor", lambda p: write_powerinfer_model(p, arch="bamboo"), ("predictor", -0.1)),
    (
        "falcon-40b predictor",
        lambda p: write_powerinfer_model(p, arch="falcon", attn_norm_2=True),
        ("predictor", -0.1),
    ),
    (
        "opt predictor",
        lambda p: write_powerinfer_model(p, arch="opt", ffn_bias=True),
        ("predictor", -0.1),
    ),
]


@pytest.mark.parametrize("name,make,sparsity", CASES, ids=[c[0] for c in CASES])
def test_batched_decode_equals_single_decode(tmp_path, name, make, sparsity):
    model = _core.Model(make(tmp_path / "m.gguf"), 0)
    single, batched = sessions(model, sparsity), sessions(model, sparsity)
    for step, tokens in enumerate([[3, 10, 4, 1], [1, 1, 1, 2], [9, 8, 7, 6]]):
        want = np.stack([s.eval([t]) for s, t in zip(single, tokens)])
        got = _core.eval_batch(batched, tokens)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want, err_msg=f"{name}, step {step}")
        for a, b in zip(single, batched):
            assert a.pos == b.pos and a.tokens == b.tokens
            assert a.take_stats() == b.take_stats()
    # a batch of one, and a sub-batch, still agree
    np.testing.assert_array_equal(_core.eval_batch(batched[1:2], [5]), single[1].eval([5])[None])


def test_hybrid_sessions_batch_too(tmp_path):
    """Sessions of the hybrid executor (on the emulated device, half the neurons hot), alone or
    mixed with CPU sessions, in one batch: each row is that session's single-token `eval`, and
    a refused batch changes no session."""
    model = _core.Model(write_powerinfer_model(tmp_path / "m.gguf", dtype=Q.F16), 0)
    n_layer, n_ff = 2, 96
    placed = _core.GpuModel(
        model,
        [True] * n_layer,
        [[j % 2 == 0 for j in range(n_ff)]] * n_layer,
        True,
        device="emulated",
    )

    def make(kinds):
        out = []
        for p, kind in zip(PROMPTS, kinds):
            s = _core.Session(model, 32, "f16", gpu=placed if kind == "hybrid" else None)
            s.set_sparsity("predictor", -0.1)
            s.eval(p)
            out.append(s)
        return out

    for kinds in (["hybrid"] * 4, ["hybrid", "cpu", "cpu", "hybrid"]):
        single, batched = make(kinds), make(kinds)
        assert [s.device for s in batched] == [
            "emulated" if k == "hybrid" else "cpu" for k in kinds
        ]
        for tokens in ([3, 10, 4, 1], [1, 1, 1, 2]):
            want = np.stack([s.eval([t]) for s, t in zip(single, tokens)])
            np.testing.assert_array_equal(_core.eval_batch(batched, tokens), want)
        positions = [s.pos for s in batched]
        with pytest.raises(ValueError, match="out of range"):
            _core.eval_batch(batched, [1, 2, 3, 10**6])
        assert [s.pos for s in batched] == positions


def test_hybrid_sessions_calibrate_on_their_cpu_state(tmp_path):
    """Calibration of a hybrid session (emulated device, half the neurons hot) is the CPU's
    dense pass: the same cut-offs as a CPU session's, and the session is left empty, in its
    mode, decoding as a fresh one."""
    model = _core.Model(write_powerinfer_model(tmp_path / "m.gguf", dtype=Q.F16), 0)
    n_layer, n_ff = 2, 96
    placed = _core.GpuModel(
        model,
        [True] * n_layer,
        [[j % 2 == 0 for j in range(n_ff)]] * n_layer,
        True,
        device="emulated",
    )
    tokens = [(7 * i + 3) % 50 for i in range(40)]
    cpu, hybrid, fresh = (_core.Session(model, 32, "f16", gpu=g) for g in (None, placed, placed))
    for s in (hybrid, fresh):
        s.set_sparsity("predictor", -0.1)
    hybrid.eval([1, 2, 3])
    assert hybrid.calibrate(tokens, 16, [0.3, 0.6]) == cpu.calibrate(tokens, 16, [0.3, 0.6])
    assert hybrid.calibrate_predictor(tokens, 16, [0.9]) == cpu.calibrate_predictor(
        tokens, 16, [0.9]
    )
    assert hybrid.pos == 0 and hybrid.tokens == []
    np.testing.assert_array_equal(
        hybrid.eval([5, 6, 7], all_logits=True), fresh.eval([5, 6, 7], all_logits=True)
    )


def test_decode_batch_samples_each_session_with_its_own_sampler(tmp_path):
    model = _core.Model(write_model(tmp_path / "m.gguf"), 0)
    single, batched = sessions(model, ("dense",)), sessions(model, ("dense",))
    make = lambda i: _core.Sampler(
        temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.3, seed=100 + i
    )
    s_samplers = [make(i) for i in range(len(PROMPTS))]
    b_samplers = [make(i) for i in range(len(PROMPTS))]
    tokens = [3, 10, 4, 1]
    for _ in range(6):
        want = [s.eval_and_sample([t], smp) for s, t, smp in zip(single, tokens, s_samplers)]
        got = _core.decode_batch(batched, tokens, b_samplers)
        assert got == want
        tokens = got


def test_batched_decode_refuses_bad_batches(tmp_path):
    model = _core.Model(write_model(tmp_path / "m.gguf"), 0)
    other = _core.Model(write_model(tmp_path / "o.gguf", seed=1), 0)
    a, b = _core.Session(model, 2), _core.Session(model, 2)
    with pytest.raises(ValueError, match="one token per session"):
        _core.eval_batch([a, b], [1])
    with pytest.raises(ValueError, match="twice"):
        _core.eval_batch([a, a], [1, 2])
    with pytest.raises(ValueError, match="out of range"):
        _core.eval_batch([a, b], [1, 10**6])
    with pytest.raises(ValueError, match="another model"):
        _core.eval_batch([a, _core.Session(other, 2)], [1, 2])
    with pytest.raises(ValueError, match="one sampler per session"):
        _core.decode_batch([a, b], [1, 2], [_core.Sampler()])
    shared = _core.Sampler()
    with pytest.raises(ValueError, match="twice"):
        _core.decode_batch([a, b], [1, 2], [shared, shared])
    with pytest.raises(ValueError):
        _core.eval_batch([], [])
    _core.eval_batch([a, b], [1, 2])
    _core.eval_batch([a, b], [1, 2])
    with pytest.raises(_core.ContextLengthError):
        _core.eval_batch([a, b], [1, 2])
    assert a.pos == b.pos == 2  # a refused batch changes nothing


def test_engine_step_many_gives_each_generation_its_own_text(tmp_path, monkeypatch):
    """Generations driven together by `Engine.step_many` (prompts of different lengths, some
    sampled, one with a stop string, one cut by max_tokens, one joining late) produce exactly the
    text each gives alone."""
    from powerinfer_rs import Engine

    engine = Engine.load(write_model(tmp_path / "m.gguf"), n_ctx=128, device="cpu")
    requests = [
        ("the cat", dict(max_tokens=30, temperature=0)),
        ("in an hour the", dict(max_tokens=12, temperature=0.8, top_p=0.9, seed=5)),
        (
            "a",
            dict(max_tokens=40, temperature=1.0, top_k=0, min_p=0.0, seed=11, repeat_penalty=1.2),
        ),
        ("the the the", dict(max_tokens=25, temperature=0)),
    ]
    full = engine.generate("the the the", max_tokens=25, temperature=0)
    requests[3][1]["stop"] = full[8:10]
    want = [engine.generate(p, **kw) for p, kw in requests]

    batch_sizes = []
    real = _core.decode_batch

    def observed(sessions, tokens, samplers):
        batch_sizes.append(len(sessions))
        return real(sessions, tokens, samplers)

    monkeypatch.setattr(_core, "decode_batch", observed)
    gens = [engine.stream(p, **kw) for p, kw in requests[:3]]
    texts = [""] * len(requests)
    late = None
    rounds = 0
    while True:
        active = [g for g in gens if not g.done] + (
            [late] if late is not None and not late.done else []
        )
        if not active:
            break
        for g, r in zip(active, engine.step_many(active)):
            assert isinstance(r, str), r
            texts[(gens + [late]).index(g)] += r
        rounds += 1
        if rounds == 3:
            late = engine.stream(requests[3][0], **requests[3][1])
    assert texts == want
    assert max(batch_sizes) == 4 and sum(batch_sizes) > 40  # the tokens really went in batches
    assert gens[1].finish_reason == "length" and late.finish_reason == "stop"


def test_batches_over_the_same_sessions_in_any_order_do_not_deadlock(tmp_path):
    """Two threads batch the same two sessions in opposite orders until the context is full:
    neither waits on the other forever, every batch either runs whole or is refused, and each
    thread stops at a ContextLengthError (each asks for more batches than the context holds)."""
    import threading

    n_ctx, batches = 40, 60
    model = _core.Model(write_model(tmp_path / "m.gguf"), 0)
    a, b = _core.Session(model, n_ctx), _core.Session(model, n_ctx)
    errors = []

    def run(pair):
        try:
            for _ in range(batches):
                _core.eval_batch(pair, [1, 2])
        except Exception as e:  # only a full context may stop it
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=([a, b],)),
        threading.Thread(target=run, args=([b, a],)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert len(errors) == 2, errors
    assert all(isinstance(e, _core.ContextLengthError) for e in errors)
    assert a.pos == b.pos == n_ctx
