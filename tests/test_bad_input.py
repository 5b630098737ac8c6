"""Bad input gives a Python exception that names the problem; never a crash."""

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import powerinfer_rs
import pytest
from gguf import GGMLQuantizationType as Q
from powerinfer_rs import ContextLengthError, Engine, GGUFError, ModelError, _core
from synth import write_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("m") / "m.gguf")


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine.load(model_path, threads=2, n_ctx=32)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Engine.load(tmp_path / "nope.gguf")


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(GGUFError, match="directory"):
        Engine.load(tmp_path)


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("hello, I am a text file and not a model\n" * 10)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        Engine.load(p)


def test_empty_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"")
    with pytest.raises(GGUFError, match="too short"):
        Engine.load(p)


def test_truncated_header(tmp_path, model_path):
    data = open(model_path, "rb").read()
    p = tmp_path / "t.gguf"
    for cut in (10, 30, 200, 2000):
        p.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated|past the end"):
            Engine.load(p)


def test_tensor_data_past_end_of_file(tmp_path, model_path):
    data = open(model_path, "rb").read()
    p = tmp_path / "t.gguf"
    p.write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFError, match="runs past the end of the file"):
        Engine.load(p)


def test_corrupt_lengths(tmp_path, model_path):
    data = bytearray(open(model_path, "rb").read())
    # First metadata key length lives right after the 24-byte preamble: make it absurd.
    data[24:32] = struct.pack("<Q", 2**62)
    p = tmp_path / "c.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="out of range"):
        Engine.load(p)


def test_unsupported_version(tmp_path, model_path):
    data = bytearray(open(model_path, "rb").read())
    data[4:8] = struct.pack("<I", 1)
    p = tmp_path / "v.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="version 1"):
        Engine.load(p)


def test_unsupported_tensor_type(tmp_path):
    p = write_model(tmp_path / "tq2.gguf", dtype=Q.TQ2_0, n_embd=256, n_ff=256)
    with pytest.raises(ModelError, match=r"TQ2_0.*not supported"):
        Engine.load(p)
    # Inspection still works for files the engine cannot run.
    info = powerinfer_rs.GgufFile(p)
    assert {t["type"] for t in info.tensors()} >= {"TQ2_0"}


def test_unknown_architecture(tmp_path):
    p = write_model(tmp_path / "a.gguf", arch="gptj")
    with pytest.raises(ModelError, match="unknown architecture 'gptj'"):
        Engine.load(p)


def test_missing_required_tensor(tmp_path):
    p = write_model(tmp_path / "m.gguf", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelError, match=r"blk\.1\.ffn_up\.weight is missing"):
        Engine.load(p)


def test_bad_activation_key(tmp_path):
    p = write_model(tmp_path / "m.gguf", activation="gelu")
    with pytest.raises(ModelError, match="ffn_activation"):
        Engine.load(p)


def test_prompt_longer_than_context(engine):
    with pytest.raises(ContextLengthError, match="40 tokens.*32"):
        engine.generate(list(range(5, 45)))
    with pytest.raises(ContextLengthError):
        engine.logits(list(range(5, 45)))
    # ContextLengthError is a ValueError, so generic handlers catch it.
    assert issubclass(ContextLengthError, ValueError)


def test_context_too_large_to_allocate(model_path):
    with pytest.raises(ValueError, match="cannot allocate|too large"):
        _core.Session(_core.Model(model_path, 1), 2**50)
    with pytest.raises(ValueError, match="too large"):
        _core.Session(_core.Model(model_path, 1), 2**63)


def test_session_overflow_from_rust(model_path):
    s = _core.Session(_core.Model(model_path, 1), 8)
    s.eval([1, 2, 3, 4, 5])
    with pytest.raises(ContextLengthError, match="9 tokens needed but the context holds 8"):
        s.eval([1, 2, 3, 4])
    assert s.pos == 5  # the failed call changed nothing


def test_generation_stops_at_full_context(engine):
    out = engine.generate(list(range(5, 30)), max_tokens=100)
    assert isinstance(out, str)
    s = engine.last_stats
    assert s["prompt_tokens"] + s["generated_tokens"] <= engine.n_ctx + 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"top_k": -3}, "top_k"),
        ({"repeat_penalty": 0.0}, "repeat_penalty"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"seed": -5}, "seed"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_values(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate("the", **kwargs)


def test_invalid_token_ids(engine, model_path):
    with pytest.raises(ValueError, match="out of range"):
        engine.logits([1, 10**6])
    with pytest.raises(OverflowError):
        engine.logits([-1])
    with pytest.raises(ValueError, match="empty"):
        engine.logits([])
    with pytest.raises(ValueError, match="out of range"):
        engine.detokenize([10**6])


def test_invalid_load_arguments(model_path):
    with pytest.raises(ValueError, match="threads"):
        Engine.load(model_path, threads=0)
    with pytest.raises(ValueError, match="n_ctx"):
        Engine.load(model_path, n_ctx=0)
    with pytest.raises(ValueError, match="kv_type"):
        Engine.load(model_path, kv_type="q8")
    with pytest.raises(ValueError, match="KV cache type"):
        _core.Session(_core.Model(model_path, 1), 8, "bf16")
    with pytest.raises(ValueError, match="use_mmap must be"):
        Engine.load(model_path, use_mmap="no")


def test_weights_larger_than_the_memory_available(model_path, monkeypatch):
    # the check before copying the weights, with the memory the kernel reports made smaller
    # than the file: a clear error instead of the kernel's out-of-memory killer
    from powerinfer_rs import engine

    size = os.path.getsize(model_path)
    monkeypatch.setattr(engine, "_available_memory", lambda: size - 1)
    with pytest.raises(MemoryError, match="use_mmap=True"):
        Engine.load(model_path, use_mmap=False, device="cpu")
    # left to the default it maps the file instead, and runs
    e = Engine.load(model_path, device="cpu")
    assert not e.weights_in_memory
    assert e.generate("Hi", max_tokens=2, ignore_eos=True)


@pytest.mark.parametrize(
    "value", [float("nan"), 0, 0.0, -0.1, 1.5, float("inf"), True, "0.02", None]
)
def test_invalid_max_ppl_increase(model_path, value):
    if value is None:  # the budget is for threshold mode only
        with pytest.raises(ValueError, match="max_ppl_increase .*needs sparsity='threshold'"):
            Engine.load(model_path, sparsity="dense", max_ppl_increase=0.02)
        return
    with pytest.raises(ValueError, match=r"max_ppl_increase must be a number in \(0, 1\]"):
        Engine.load(model_path, sparsity="threshold", max_ppl_increase=value)


def test_perplexity_budget_needs_enough_calibration_text(model_path):
    with pytest.raises(ValueError, match="calibration text has only .* tokens"):
        Engine.load(model_path, max_ppl_increase=0.02, calibration_text="a short text")


def test_sampler_rejects_bad_values_from_rust():
    with pytest.raises(ValueError, match="top_p"):
        _core.Sampler(top_p=2.0)
    s = _core.Sampler()
    with pytest.raises(ValueError, match="empty"):
        s.sample(np.zeros(0, dtype=np.float32), [])


REGRESSIONS = sorted(
    (Path(__file__).resolve().parent.parent / "fuzz" / "regressions" / "fixed").glob("*.gguf")
)


@pytest.mark.parametrize("path", REGRESSIONS, ids=lambda p: p.name)
def test_files_the_fuzzer_found_are_clear_errors(path):
    """Each input that once crashed the reader or the model build (fuzz/regressions/fixed) is
    refused with an exception naming the problem; in a child process, so that an abort or a
    panic shows as a failure here instead of ending the test run."""
    code = (
        "import sys\nfrom powerinfer_rs import _core\n"
        "try:\n    _core.Model(sys.argv[1], 1)\n"
        "except (_core.GGUFError, _core.ModelError) as e:\n    print(type(e).__name__, e)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith(("GGUFError", "ModelError")), run.stdout


def test_the_fuzzers_findings_are_kept():
    assert len(REGRESSIONS) >= 2
