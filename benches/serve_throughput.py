"""Throughput of concurrent generations, batched decode vs one evaluation per client, both sides in
one run on the same machine, alternating, ratio of medians.

    python benches/serve_throughput.py [--model PATH] [--clients 1 2 4 8] [--tokens 64] [--reps 3]

1. Engine: `Engine.step_many` over N greedy generations, `batch=True` (the tokens of all
   clients in one evaluation) vs `batch=False` (one evaluation per client): aggregate decode
   tok/s and the ratio. The texts must be identical both ways (checked).
2. HTTP: `powerinfer-rs serve --parallel N` with and without `--no-batch`, and, when
   llama-cpp-python with its server extra is installed, llama-cpp-python's OpenAI server
   (`python -m llama_cpp.server`, llama.cpp underneath) on the same file with the same threads;
   N concurrent streaming chat requests through the `openai` client: aggregate tok/s
   (completion tokens over wall time, prompts included) and the ratios. Our prompt cache is off
   here (the same questions come back every rep).
3. Prompt cache: time to the first token of a chat's second turn (a ~600-token conversation)
   with the default prompt cache vs `--prompt-cache 0`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from serving import Server as TestServer  # noqa: E402

PROMPTS = [
    "The history of the Roman Empire",
    "A recipe for bread:",
    "def fibonacci(n):",
    "The three laws of motion are",
    "Once upon a time, in a small village,",
    "The weather today is",
    "Python is a programming language that",
    "In 1969, the first humans",
]
QUESTIONS = [
    "Tell me about the Roman Empire.",
    "How do I bake bread?",
    "Explain recursion.",
    "What are Newton's laws?",
    "Write a short story about a village.",
    "What causes rain?",
    "Why is Python popular?",
    "Describe the Moon landing.",
]


def engine_side(engine, n: int, tokens: int, batch: bool) -> tuple[float, list[str]]:
    gens = [
        engine.stream(PROMPTS[i % len(PROMPTS)], max_tokens=tokens, temperature=0) for i in range(n)
    ]
    # prompts first (not timed): every generation past its prompt
    engine.step_many(gens, batch=False)
    texts = [""] * n
    decoded = 0
    t = time.perf_counter()
    while True:
        live = [i for i, g in enumerate(gens) if not g.done]
        if not live:
            break
        for i, r in zip(live, engine.step_many([gens[i] for i in live], batch=batch)):
            if isinstance(r, Exception):
                raise r
            texts[i] += r
        decoded += len(live)
    return decoded / (time.perf_counter() - t), texts


class LlamaCppServer:
    """llama-cpp-python's OpenAI-compatible server on a free port (one request at a time)."""

    def __init__(self, model: str, model_id: str, threads: int):
        import socket

        import httpx

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            model,
            "--model_alias",
            model_id,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "1024",
            "--n_threads",
            str(threads),
            "--n_threads_batch",
            str(threads),
            # by default a new request interrupts the running one; here every request runs to its end
            "--interrupt_requests",
            "False",
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("llama_cpp.server exited")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("llama_cpp.server did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def Server(  # noqa: N802  (built like a class, where the benches start one)
    model: str, n: int, batch: bool, threads: int | None, extra: tuple[str, ...] = ()
) -> TestServer:
    """`powerinfer-rs serve` with `n` slots (batched or not) on the CPU, started and stopped as
    the tests start theirs (tests/serving.py)."""
    args = ["--parallel", str(n), "--device", "cpu", *extra]
    args += ([] if batch else ["--no-batch"]) + (["-t", str(threads)] if threads else [])
    return TestServer(model, *args, n_ctx=1024)


async def http_side(url: str, n: int, tokens: int) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)

    async def one(q: str) -> int:
        r = await client.chat.completions.create(
            model=_MODEL_ID,
            messages=[{"role": "user", "content": q}],
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        used, chunks = None, 0
        async for c in r:
            if c.usage is not None:
                used = c.usage.completion_tokens
            if c.choices and c.choices[0].delta.content:
                chunks += 1
        return (
            used if used is not None else chunks
        )  # servers without include_usage: one token per chunk

    async with client:
        t = time.perf_counter()
        counts = await asyncio.gather(*[one(QUESTIONS[i % len(QUESTIONS)]) for i in range(n)])
        return sum(counts) / (time.perf_counter() - t)


_MODEL_ID = ""


def second_turn_ttft(url: str, rep: int) -> float:
    """Sends a chat's first turn (a long system prompt), then times the second turn's first token."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    system = f"Session {rep}. " + " ".join(
        f"Rule {i}: answer politely, briefly and only about the topic at hand." for i in range(40)
    )
    turn1 = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    r = client.chat.completions.create(
        model=_MODEL_ID, messages=turn1, max_tokens=16, temperature=0
    )
    turn2 = turn1 + [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "And of Spain?"},
    ]
    t = time.perf_counter()
    for c in client.chat.completions.create(
        model=_MODEL_ID, messages=turn2, max_tokens=8, temperature=0, stream=True
    ):
        if c.choices and c.choices[0].delta.content:
            return time.perf_counter() - t
    return time.perf_counter() - t


def main() -> int:
    global _MODEL_ID
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--no-http", action="store_true", help="engine side only")
    a = ap.parse_args()

    import os

    from powerinfer_rs import Engine, default_model_path

    model = a.model or default_model_path()
    _MODEL_ID = (
        os.path.basename(model)[: -len(".gguf")]
        if model.endswith(".gguf")
        else os.path.basename(model)
    )
    engine = Engine.load(model, n_ctx=1024, threads=a.threads, device="cpu")
    print(
        f"model {os.path.basename(model)}, threads {engine.n_threads}, {a.tokens} tokens per client, {a.reps} alternating reps, medians"
    )
    print("\nengine (Engine.step_many), aggregate decode tok/s")
    print(f"{'clients':>8} {'one by one':>11} {'batched':>9} {'ratio':>7}")
    for n in a.clients:
        sep, bat = [], []
        for _ in range(a.reps):
            r1, t1 = engine_side(engine, n, a.tokens, batch=False)
            r2, t2 = engine_side(engine, n, a.tokens, batch=True)
            if t1 != t2:
                raise SystemExit(f"batched texts differ from one-by-one texts with {n} clients")
            sep.append(r1)
            bat.append(r2)
        s, b = statistics.median(sep), statistics.median(bat)
        print(f"{n:>8} {s:>11.1f} {b:>9.1f} {b / s:>6.2f}x")

    if a.no_http:
        return 0
    print("\nprompt cache: time to the first token of a second chat turn, seconds")
    servers = {
        "off": Server(model, 1, True, a.threads, ("--prompt-cache", "0")),
        "on": Server(model, 1, True, a.threads),
    }
    try:
        res = {k: [] for k in servers}
        for rep in range(a.reps):
            for k, srv in servers.items():
                res[k].append(second_turn_ttft(srv.url, rep))
    finally:
        for srv in servers.values():
            srv.stop()
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    print(f"{'--prompt-cache 0':>17} {'cached':>8} {'speed-up':>9}")
    print(f"{off:>17.3f} {on:>8.3f} {off / on:>8.2f}x")
    try:
        import llama_cpp.server.app  # noqa: F401

        with_llamacpp = True
    except ImportError:
        with_llamacpp = False
    print("\nHTTP (streaming chat through the openai client), aggregate completion tok/s")
    head = f"{'clients':>8} {'--no-batch':>11} {'batched':>9} {'ratio':>7}"
    if with_llamacpp:
        head += f" {'llama-cpp-python':>17} {'batched/llama.cpp':>18}"
    print(head)
    for n in a.clients:
        # no prompt cache here: the same questions come back every rep, and this measures batching
        servers = {
            "sep": Server(model, n, False, a.threads, ("--prompt-cache", "0")),
            "bat": Server(model, n, True, a.threads, ("--prompt-cache", "0")),
        }
        if with_llamacpp:
            servers["lcpp"] = LlamaCppServer(model, _MODEL_ID, engine.n_threads)
        try:
            res = {k: [] for k in servers}
            for _ in range(a.reps):
                for k, srv in servers.items():
                    res[k].append(asyncio.run(http_side(srv.url, n, a.tokens)))
        finally:
            for srv in servers.values():
                srv.stop()
        med = {k: statistics.median(v) for k, v in res.items()}
        line = f"{n:>8} {med['sep']:>11.1f} {med['bat']:>9.1f} {med['bat'] / med['sep']:>6.2f}x"
        if with_llamacpp:
            line += f" {med['lcpp']:>17.1f} {med['bat'] / med['lcpp']:>17.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
