"""The architectures whose differences are data inside the one layer: Qwen 3, Gemma 1-3, Phi-3,
Llama 3's RoPE (frequency factors, linear scaling), YaRN and LongRoPE, each against the independent
float64 reference (tests/reference.py) on a tiny random model written as llama.cpp's converter writes
such files. Sliding-window layers are checked both with the whole context cached and with the
ring that keeps only the window, over prompts longer than one pass."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from powerinfer_rs import _core
from reference import forward, read_weights
from synth import write_model

# ||engine - reference|| / ||reference|| over all logits: f32 against f64, rounding only
FLOAT_TOL = 2e-4

CASES = {
    # id: write_model arguments
    "qwen3-qk-norm-wide-heads": dict(arch="qwen3", head_dim=32),
    "gemma-geglu-scaled-embeddings": dict(arch="gemma", tied=True, head_dim=32, n_head_kv=1),
    "gemma2-softcap-post-norms-window": dict(arch="gemma2", tied=True, n_layer=3, sliding_window=8),
    "gemma3-qk-norm-window-two-bases": dict(
        arch="gemma3",
        tied=True,
        n_layer=7,
        sliding_window=8,
        rope_base=1e6,
        rope_scaling=4.0,
        head_dim=32,
    ),
    "phi3-fused-qkv-gate-up": dict(arch="phi3", n_head_kv=4),
    "llama3-rope-freqs-linear-scaling": dict(arch="llama", rope_freqs=True, rope_scaling=2.0),
    # a context of 4x the original 64 positions, over which the low frequencies interpolate
    "qwen2-yarn": dict(arch="qwen2", bias=True, rope_scaling=4.0, yarn_original_ctx=64),
    # sessions of 64 positions: beyond the original 32, so the long factors
    "phi3-longrope": dict(arch="phi3", n_head_kv=4, longrope_original_ctx=32),
}


def relative_error(got, ref):
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_logits_match_float64_reference(tmp_path, case):
    path = write_model(tmp_path / "m.gguf", **CASES[case])
    model = _core.Model(path, 2)
    ids = np.random.default_rng(1).integers(0, model.config()["n_vocab"], size=40).tolist()
    w, meta = read_weights(path)
    ref = forward(w, meta, ids, n_ctx=64)
    # prefill, then the same tokens one at a time
    got = _core.Session(model, 64, "f32").eval(ids, all_logits=True)
    rel = relative_error(got, ref)
    assert rel < FLOAT_TOL, f"prefill: relative error {rel:.2e}"
    s = _core.Session(model, 64, "f32")
    steps = np.stack([s.eval([t]) for t in ids])
    rel_steps = relative_error(steps, ref)
    assert rel_steps < FLOAT_TOL, f"decode: relative error {rel_steps:.2e}"
    # the reference can tell the architecture's features apart: as a plain llama layer (its
    # keys, without the extra tensors) it is far away
    arch = meta["general.architecture"]
    plain_meta = {
        k.replace(f"{arch}.", "llama.", 1): v for k, v in meta.items() if "rope.scaling" not in k
    }
    plain_meta["general.architecture"] = "llama"
    extra = ("rope_freqs", "rope_factors", "_norm.weight", "post_")
    plain_w = {
        k: v
        for k, v in w.items()
        if not any(e in k for e in extra)
        or "attn_norm" in k
        or "ffn_norm" in k
        or "output_norm" in k
    }
    plain_rel = relative_error(got, forward(plain_w, plain_meta, ids, activation="silu"))
    assert plain_rel > 20 * FLOAT_TOL, f"a plain llama layer is only {plain_rel:.2e} away"


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_sliding_window_ring_over_long_prompts(tmp_path, arch):
    """A context larger than the window's ring: sliding layers keep only the ring, prompts run in
    passes of at most the ring's spare rows; logits equal the reference's for every position,
    in prefill and in decode, and equal a session that caches the whole context."""
    path = write_model(
        tmp_path / "m.gguf",
        arch=arch,
        tied=True,
        n_layer=7 if arch == "gemma3" else 3,
        sliding_window=8,
        n_ctx=2048,
    )
    model = _core.Model(path, 2)
    ids = np.random.default_rng(2).integers(0, model.config()["n_vocab"], size=600).tolist()
    w, meta = read_weights(path)
    ref = forward(w, meta, ids)
    ring = _core.Session(model, 2048, "f32")
    got = np.vstack(
        [ring.eval(ids[:550], all_logits=True)] + [ring.eval([t])[None] for t in ids[550:]]
    )
    rel = relative_error(got, ref)
    assert rel < FLOAT_TOL, f"relative error {rel:.2e}"
    full = _core.Session(model, 600, "f32").eval(ids, all_logits=True)
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-4 * np.abs(full).max())
    # the last token only: the same as the all-logits pass's last row
    last = _core.Session(model, 2048, "f32").eval(ids)
    np.testing.assert_allclose(last, got[-1], rtol=0, atol=1e-4 * np.abs(full).max())


def test_ring_truncation_keeps_only_what_it_still_holds(tmp_path):
    """Rewinding a ring session: a short rewind keeps the prefix (and continues exactly as a
    fresh session would); a rewind past what the ring still holds keeps nothing."""
    path = write_model(
        tmp_path / "m.gguf", arch="gemma2", tied=True, n_layer=2, sliding_window=8, n_ctx=2048
    )
    model = _core.Model(path, 2)
    ids = np.random.default_rng(3).integers(0, model.config()["n_vocab"], size=400).tolist()
    s = _core.Session(model, 2048, "f32")
    s.eval(ids)
    assert s.truncate(390) == 390 and s.pos == 390
    again = s.eval(ids[390:395], all_logits=True)
    fresh = _core.Session(model, 2048, "f32").eval(ids[:395], all_logits=True)[390:]
    np.testing.assert_allclose(again, fresh, rtol=0, atol=1e-4 * np.abs(fresh).max())
    # 395 positions stored, the ring holds 8 + 256: position 10's window is long gone
    assert s.truncate(10) == 0 and s.pos == 0


def test_quantized_gemma3_matches_int8_reference(tmp_path):
    """The new layer features with k-quant weights: the reference rounds activations to int8 as
    the integer kernels do. Two layers: an int8 rounding tie that f32 and f64 break differently
    moves every later token through attention, and deeper random models amplify it."""
    path = write_model(
        tmp_path / "m.gguf",
        arch="gemma3",
        tied=True,
        n_layer=2,
        sliding_window=8,
        dtype=Q.Q4_K,
        n_embd=256,
        n_ff=256,
        head_dim=64,
    )
    model = _core.Model(path, 2)
    ids = np.random.default_rng(4).integers(0, model.config()["n_vocab"], size=24).tolist()
    w, meta = read_weights(path)
    ref = forward(w, meta, ids, int8_activations=True)
    s = _core.Session(model, 64, "f32")
    steps = np.stack([s.eval([t]) for t in ids])
    per_token = [relative_error(a, b) for a, b in zip(steps, ref)]
    assert np.median(per_token) < 1e-4 and max(per_token) < 1e-2, per_token


def test_longrope_picks_its_factors_by_the_session_context(tmp_path):
    """LongRoPE's short factors for a session within the original context (32), the long ones
    beyond it, each matching the reference and far from the other."""
    path = write_model(tmp_path / "m.gguf", arch="phi3", n_head_kv=4, longrope_original_ctx=32)
    model = _core.Model(path, 2)
    ids = np.random.default_rng(3).integers(0, model.config()["n_vocab"], size=20).tolist()
    w, meta = read_weights(path)
    short, long = forward(w, meta, ids, n_ctx=32), forward(w, meta, ids, n_ctx=64)
    assert relative_error(short, long) > 20 * FLOAT_TOL
    for n_ctx, ref in [(32, short), (64, long)]:
        got = _core.Session(model, n_ctx, "f32").eval(ids, all_logits=True)
        assert relative_error(got, ref) < FLOAT_TOL, f"n_ctx {n_ctx}"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(extra_meta={"rope.scaling.type": "ntk-by-parts"}),
            r"rope.scaling.type = .ntk-by-parts. is not supported \(supported: none, linear, yarn",
        ),
        (
            dict(rope_scaling=0.0, yarn_original_ctx=64),
            r"rope.scaling.factor = 0 is not a positive factor",
        ),
        (dict(extra_meta={"rope.scaling.type": "longrope"}), r"longrope. is not supported"),
        (
            dict(longrope_original_ctx=32, skip=("rope_factors_short.weight",)),
            r"LongRoPE needs both rope_factors_long and rope_factors_short",
        ),
    ],
    ids=["unknown-type", "yarn-zero-factor", "longrope-without-factors", "longrope-half"],
)
def test_bad_rope_scaling_is_named(tmp_path, kwargs, message):
    path = write_model(tmp_path / "m.gguf", arch="phi3", n_head_kv=4, **kwargs)
    with pytest.raises(ValueError, match=message):
        _core.Model(path, 2)
