"""The k-quant family of tensor formats (Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS) and gpt-oss's
MXFP4: the engine's decoding is bit-exact against the `gguf` package's numpy dequantizers, and
whole models in these formats match the float64 reference (which decodes the weights with
`gguf`)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize
from powerinfer_rs import Engine, GgufFile, _core
from reference import forward, read_weights
from synth import RANDOM_BLOCK_TYPES, random_blocks, write_model

TYPES = list(RANDOM_BLOCK_TYPES)


@pytest.mark.parametrize("dtype", TYPES, ids=[t.name for t in TYPES])
def test_decoding_is_bit_exact(tmp_path, dtype):
    rng = np.random.default_rng(dtype.value)
    rows, cols = 5, 768
    raw = random_blocks(dtype, rows, cols, 0.5, rng)
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("t", raw, raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GgufFile(path)
    assert [t["type"] for t in f.tensors()] == [dtype.name]
    got = f.read_tensor("t")
    want = dequantize(raw, dtype).astype(np.float32)
    assert got.shape == want.shape == (rows, cols)
    assert np.isfinite(want).all()
    # bit for bit (signed zeros included)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# Against a reference that rounds activations to int8 as the engine does, only float error
# remains (as for the legacy formats in test_synthetic_models.py), except where an activation
# sits within f32 error of an int8 rounding tie: f32 and f64 then round it apart, which moves
# that token's logits by up to ~1e-3 here and, through attention, every later token's by up to
# ~1% (measured on these random-block weights). So each token is checked alone, at position 0:
# most must agree to float error, every one to the int8 rounding's own size.
QUANT_TOL = 1e-4
FLIPPED_TIE_TOL = 1e-2


@pytest.mark.parametrize("dtype", TYPES, ids=[t.name for t in TYPES])
def test_model_logits_match_float64_reference(tmp_path, dtype):
    # k-quant rows are whole 256-weight super-blocks
    path = write_model(
        tmp_path / "m.gguf", dtype=dtype, n_embd=256, n_ff=512, n_head=4, n_head_kv=2
    )
    engine = Engine.load(path, threads=2, kv_type="f32")
    ids = np.random.default_rng(1).integers(0, engine.n_vocab, size=12).tolist()
    w, meta = read_weights(path)
    per_token = []
    for t in ids:
        got, ref = engine.logits([t])[0], forward(w, meta, [t], int8_activations=True)[0]
        per_token.append(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert np.median(per_token) < QUANT_TOL, f"{dtype.name}: per-token relative errors {per_token}"
    assert max(per_token) < FLIPPED_TIE_TOL, f"{dtype.name}: per-token relative errors {per_token}"
    # a whole prompt at once and a token at a time (decode) give the same
    got = engine.logits(ids)
    s = _core.Session(engine._model, 16, "f32")
    steps = np.stack([s.eval([t]) for t in ids])
    np.testing.assert_allclose(steps, got, rtol=0, atol=1e-4 * np.abs(got).max())


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# Each level's logits for every file: a prompt (the row-group kernels) and then the same ids one
# at a time (the one-token kernels), in a process of its own (the level is decided once).
LEVEL_LOGITS = """
import sys, numpy as np, powerinfer_rs
from powerinfer_rs import Engine
out = {"level": np.array(powerinfer_rs.simd_level())}
for i, path in enumerate(sys.argv[2:]):
    engine = Engine.load(path, threads=2, kv_type="f32")
    ids = np.random.default_rng(3).integers(0, engine.n_vocab, size=9).tolist()
    out[f"prompt{i}"] = engine.logits(ids)
    out[f"steps{i}"] = np.stack([engine.logits([t])[0] for t in ids])
np.savez(sys.argv[1], **out)
"""


@pytest.mark.skipif(
    not _cpu_flags() & {"avx_vnni", "avx512_vnni"}, reason="no 256-bit VNNI on this CPU"
)
def test_the_avx_vnni_level_gives_the_avx2_levels_logits_bit_for_bit(tmp_path):
    """Its kernels sum the same integers (`vpdpbusd` where AVX2 takes `vpmaddubsw`), so whole
    models give the same bits at both levels: every format that has VNNI kernels, in prompts
    and one token at a time (on an AVX-512 CPU without AVX-VNNI, in AVX-512's encoding)."""
    dtypes = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.IQ4_NL, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K]
    paths = [
        write_model(
            tmp_path / f"{t.name}.gguf", dtype=t, n_embd=256, n_ff=512, n_head=4, n_head_kv=2
        )
        for t in dtypes
    ]
    results = {}
    for level in ("avx2", "avxvnni"):
        out = tmp_path / f"{level}.npz"
        env = {**os.environ, "POWERINFER_SIMD": level}
        subprocess.run(
            [sys.executable, "-c", LEVEL_LOGITS, str(out), *map(str, paths)],
            env=env,
            check=True,
            timeout=300,
        )
        results[level] = np.load(out)
    assert str(results["avx2"]["level"]) == "avx2"
    assert str(results["avxvnni"]["level"]) == "avxvnni"
    for i, t in enumerate(dtypes):
        for kind in ("prompt", "steps"):
            a, b = results["avx2"][f"{kind}{i}"], results["avxvnni"][f"{kind}{i}"]
            assert np.isfinite(a).all(), f"{t.name} {kind}"
            np.testing.assert_array_equal(
                a.view(np.uint32), b.view(np.uint32), err_msg=f"{t.name} {kind}"
            )


def test_an_unsupported_format_still_names_itself(tmp_path):
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("t", np.zeros((2, 66), np.uint8), raw_dtype=Q.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GgufFile(path)
    assert f.tensors()[0]["type"] == "IQ2_XXS"
    with pytest.raises(ValueError, match=r"IQ2_XXS.*not supported"):
        f.read_tensor("t")
    with pytest.raises(ValueError, match="no tensor named 'u'"):
        f.read_tensor("u")
