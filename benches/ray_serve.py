"""What Ray Serve costs and buys, on one machine, in one run: SmolLM2 served (a) by the plain
server with T threads, (b) under Ray Serve by one replica of T threads, (c) under Ray Serve by
two replicas of T/2 threads each (the same total threads). Prints, for each, the throughput of
C concurrent clients (generated tokens per second over all of them, greedy, fixed length), the
median latency of a one-token request, and the median time between streamed tokens of one
client alone; (b) against (a) is the latency Ray Serve's proxy adds, (c) against (b) what a
second replica buys at equal threads.

    python benches/ray_serve.py [--threads 2] [--clients 8] [--tokens 32] [--rounds 3]

Ray runs as a loopback cluster of this script (`ray start --head`, stopped at the end)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
from powerinfer_rs import default_model_path
from serve_throughput import Server  # benches/ is the script's folder: the same server process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def throughput(url: str, clients: int, tokens: int) -> float:
    """Generated tokens per second of `clients` concurrent greedy completions."""

    def one(i: int) -> int:
        r = httpx.post(
            url + "/v1/completions",
            json={
                "prompt": f"Story number {i}: once upon a time",
                "max_tokens": tokens,
                "temperature": 0,
            },
            timeout=600,
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        n = sum(pool.map(one, range(clients)))
    return n / (time.perf_counter() - t)


def one_token_latency(url: str, n: int = 20) -> float:
    times = []
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            t = time.perf_counter()
            c.post(
                url + "/v1/completions", json={"prompt": f"Hi {i}", "max_tokens": 1}
            ).raise_for_status()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def token_gap(url: str, tokens: int) -> float:
    """Median time between the streamed chunks of one client alone."""
    gaps, last = [], None
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={
            "prompt": "Once upon a time",
            "max_tokens": tokens,
            "stream": True,
            "temperature": 0,
        },
        timeout=600,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return statistics.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2, help="total threads (even)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = default_model_path()
    t = a.threads
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    ray_port = free_port()
    subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={ray_port}",
            f"--num-cpus={t}",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--object-store-memory=100000000",
            "--disable-usage-stats",
        ],
        check=True,
        capture_output=True,
    )
    address = f"127.0.0.1:{ray_port}"

    def ray(*more: str) -> tuple[str, ...]:
        return ("--ray", "--address", address, "--port", str(free_port()), *more)

    # (name, slots, threads, extra arguments): the same total threads and slots in each
    setups = [
        (f"plain server, {t} threads", a.clients, t, ()),
        (f"Ray Serve, 1 replica x {t} threads", a.clients, t, ray()),
        (
            f"Ray Serve, 2 replicas x {t // 2} threads",
            max(1, a.clients // 2),
            max(1, t // 2),
            ray("--replicas", "2"),
        ),
    ]
    results = {}
    try:
        for name, slots, threads, extra in setups:
            server = Server(model, slots, True, threads, extra)
            url = server.url
            try:
                throughput(url, a.clients, 4)  # warm-up
                results[name] = {
                    "throughput_tps": statistics.median(
                        throughput(url, a.clients, a.tokens) for _ in range(a.rounds)
                    ),
                    "one_token_latency_ms": 1000 * one_token_latency(url),
                    "token_gap_ms": 1000 * token_gap(url, 4 * a.tokens),
                }
            finally:
                server.stop()
            r = results[name]
            print(
                f"{name:36s} {r['throughput_tps']:7.1f} tok/s over {a.clients} clients, "
                f"one-token request {r['one_token_latency_ms']:6.1f} ms, "
                f"between streamed tokens {r['token_gap_ms']:5.2f} ms",
                flush=True,
            )
    finally:
        subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "ray"), "stop", "--force"],
            capture_output=True,
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                {"threads": t, "clients": a.clients, "tokens": a.tokens, "results": results},
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
