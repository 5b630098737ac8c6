"""`hf://owner/repo/file.gguf` model names, against a loopback HTTP server that answers the way the
Hugging Face Hub does (HF_ENDPOINT points `huggingface_hub` at it): download, cache, offline mode,
clear errors for a missing repository, file or revision and for malformed names, and a Hub that
cannot be reached (refused, silent, or huggingface.co from a machine without a network)."""

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from powerinfer_rs import hub
from synth import write_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Serves `files` ({"owner/repo": {"name.gguf": bytes}}) under /{repo}/resolve/{revision}/{name},
    revision "main" or COMMIT, with the headers `hf_hub_download` reads; counts file downloads."""

    def __init__(self, files):
        self.files = files
        self.downloads = 0
        hub_ = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, body: bool):
                parts = self.path.split("?")[0].strip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    return self._error(404, "RepoNotFound")
                repo, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                if repo not in hub_.files:
                    return self._error(
                        401, "RepoNotFound"
                    )  # the Hub hides private and missing repos alike
                if revision not in ("main", COMMIT):
                    return self._error(404, "RevisionNotFound")
                data = hub_.files[repo].get(name)
                if data is None:
                    return self._error(404, "EntryNotFound")
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if body:
                    hub_.downloads += 1
                    self.wfile.write(data)

            def _error(self, status, code):
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def model_bytes(tmp_path):
    return open(write_model(tmp_path / "local.gguf"), "rb").read()


@pytest.fixture
def fake_hub(model_bytes):
    h = FakeHub(
        {"acme/tiny-GGUF": {"tiny-F32.gguf": model_bytes, "sub/dir/tiny.gguf": model_bytes}}
    )
    yield h
    h.stop()


def run_python(code, env_extra):
    env = dict(os.environ, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1", **env_extra)
    env.pop("HF_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


GENERATE = "from powerinfer_rs import Engine; print(Engine.load({name!r}).generate('the then', max_tokens=8))"


def test_engine_loads_a_hub_file_then_runs_offline_from_the_cache(tmp_path, fake_hub, model_bytes):
    from powerinfer_rs import Engine

    local = tmp_path / "same.gguf"
    local.write_bytes(model_bytes)
    want = Engine.load(str(local)).generate("the then", max_tokens=8)
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_CACHE": str(tmp_path / "cache")}

    r = run_python(GENERATE.format(name="hf://acme/tiny-GGUF/tiny-F32.gguf"), env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert fake_hub.downloads == 1
    cached = list((tmp_path / "cache").rglob("tiny-F32.gguf"))
    assert cached and open(cached[0], "rb").read() == model_bytes

    # again: cached, not downloaded a second time (only a metadata request)
    r = run_python(GENERATE.format(name="hf://acme/tiny-GGUF/tiny-F32.gguf"), env)
    assert r.returncode == 0, r.stderr
    assert fake_hub.downloads == 1

    # offline, with the server gone: from the cache
    fake_hub.stop()
    r = run_python(
        GENERATE.format(name="hf://acme/tiny-GGUF/tiny-F32.gguf"), dict(env, HF_HUB_OFFLINE="1")
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"


def test_revision_and_nested_path(tmp_path, fake_hub):
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_CACHE": str(tmp_path / "cache")}
    r = run_python(GENERATE.format(name=f"hf://acme/tiny-GGUF@{COMMIT}/sub/dir/tiny.gguf"), env)
    assert r.returncode == 0, r.stderr
    assert fake_hub.downloads == 1


def test_offline_without_a_cached_copy_is_a_clear_error(tmp_path, fake_hub):
    env = {
        "HF_ENDPOINT": fake_hub.url,
        "HF_HUB_CACHE": str(tmp_path / "empty"),
        "HF_HUB_OFFLINE": "1",
    }
    r = run_python(GENERATE.format(name="hf://acme/tiny-GGUF/tiny-F32.gguf"), env)
    assert r.returncode != 0
    assert (
        "FileNotFoundError" in r.stderr
        and "hf://acme/tiny-GGUF/tiny-F32.gguf" in r.stderr
        and "offline" in r.stderr
    )
    assert fake_hub.downloads == 0


@pytest.mark.parametrize(
    "name, message",
    [
        ("hf://acme/nope/tiny-F32.gguf", "no repository 'acme/nope'"),
        ("hf://acme/tiny-GGUF/missing.gguf", "no file 'missing.gguf'"),
        ("hf://acme/tiny-GGUF@v9/tiny-F32.gguf", "no revision 'v9'"),
    ],
)
def test_missing_repository_file_or_revision_names_it(tmp_path, fake_hub, name, message):
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_CACHE": str(tmp_path / "cache")}
    r = run_python(GENERATE.format(name=name), env)
    assert r.returncode != 0
    assert "FileNotFoundError" in r.stderr and message in r.stderr, r.stderr[-2000:]


def test_cli_takes_hub_names(tmp_path, fake_hub):
    env = dict(
        os.environ,
        HF_ENDPOINT=fake_hub.url,
        HF_HUB_CACHE=str(tmp_path / "cache"),
        HF_HUB_DISABLE_XET="1",
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "powerinfer_rs.cli",
            "info",
            "-m",
            "hf://acme/tiny-GGUF/tiny-F32.gguf",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "llama" in r.stdout
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "powerinfer_rs.cli",
            "run",
            "-m",
            "hf://acme/tiny-GGUF/gone.gguf",
            "hi",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (
        r.returncode == 1
        and "error: hf://acme/tiny-GGUF/gone.gguf" in r.stderr
        and "Traceback" not in r.stderr
    )


@pytest.mark.parametrize(
    "name",
    [
        "hf://",
        "hf://acme",
        "hf://acme/repo",
        "hf://acme/repo/",
        "hf://acme//x.gguf",
        "hf://acme/@/x.gguf",
    ],
)
def test_malformed_hub_names_are_refused(name):
    with pytest.raises(ValueError, match="expected hf://owner/repo"):
        hub.resolve(name)


def test_local_paths_pass_through(tmp_path):
    assert hub.resolve(tmp_path / "x.gguf") == str(tmp_path / "x.gguf")
    assert hub.resolve("relative/hf://x.gguf") == "relative/hf://x.gguf"


# ----- no network: huggingface_hub alone retries its first request for about 30 seconds


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class SilentServer:
    """A port that never answers: it listens with a backlog of one that two connections fill,
    so a further connection attempt waits, as one to a firewalled host does."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.port = self.sock.getsockname()[1]
        self.queued = []
        for _ in range(2):
            c = socket.socket()
            c.setblocking(False)
            try:
                c.connect(("127.0.0.1", self.port))
            except BlockingIOError:
                pass
            self.queued.append(c)

    def close(self):
        for c in self.queued:
            c.close()
        self.sock.close()


@pytest.fixture
def endpoint(monkeypatch, tmp_path):
    """Points huggingface_hub, in this process, at an endpoint and an empty cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def point(url: str) -> None:
        monkeypatch.setattr(constants, "ENDPOINT", url)

    return point


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_an_unreachable_hub_is_a_clear_error_at_once(endpoint, kind):
    """A refused connection, and an endpoint that never answers: the error comes within the
    connection test's timeout, naming the endpoint, why, and that the file is not cached."""
    silent = SilentServer() if kind == "silent" else None
    port = silent.port if silent else _closed_port()
    endpoint(f"http://127.0.0.1:{port}")
    start = time.monotonic()
    try:
        with pytest.raises(FileNotFoundError) as e:
            hub.resolve("hf://acme/tiny-GGUF/tiny-F32.gguf")
    finally:
        if silent:
            silent.close()
    seconds = time.monotonic() - start
    assert seconds < hub.CONNECT_TIMEOUT + 1.5, seconds
    message = str(e.value)
    assert f"the Hugging Face Hub at http://127.0.0.1:{port} cannot be reached" in message
    assert "not in the cache" in message and message.startswith("hf://acme/tiny-GGUF/tiny-F32.gguf")
    why = "connection refused" if kind == "refused" else f"no answer from 127.0.0.1:{port}"
    assert why in message, message


def test_an_unreachable_hub_gives_the_cached_copy_at_once(tmp_path, fake_hub, model_bytes):
    """Downloaded once, the file loads from the cache when the Hub goes away (the connection
    test fails), without HF_HUB_OFFLINE."""
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_CACHE": str(tmp_path / "cache")}
    name = "hf://acme/tiny-GGUF/tiny-F32.gguf"
    first = run_python(GENERATE.format(name=name), env)
    assert first.returncode == 0, first.stderr
    fake_hub.stop()
    start = time.monotonic()
    r = run_python(GENERATE.format(name=name), env)
    seconds = time.monotonic() - start
    assert r.returncode == 0, r.stderr
    assert r.stdout == first.stdout and fake_hub.downloads == 1
    assert seconds < 15, seconds


def test_without_a_network_the_cli_says_so_at_once(tmp_path):
    """As a user meets it: `powerinfer-rs run -m hf://...` on a machine that cannot reach
    huggingface.co fails within seconds with a message naming the problem (huggingface_hub
    alone retries for about 30 seconds first)."""
    if hub.unreachable("https://huggingface.co") is None:
        pytest.skip("huggingface.co can be reached from this machine")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "empty"), HF_HUB_DISABLE_TELEMETRY="1")
    for name in ("HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    start = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "powerinfer_rs.cli",
            "run",
            "-m",
            "hf://acme/tiny-GGUF/x.gguf",
            "hi",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    seconds = time.monotonic() - start
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert (
        "error: hf://acme/tiny-GGUF/x.gguf: the Hugging Face Hub at https://huggingface.co "
        "cannot be reached" in r.stderr
    ), r.stderr
    assert "not in the cache" in r.stderr
    assert seconds < 15, seconds
