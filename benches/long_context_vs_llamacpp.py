"""Speed and memory at long context: powerinfer-rs and llama.cpp (llama-cpp-python) on the same
GGUF file, the same threads and the same token ids, sweeping the prompt length (default 128,
1024 and 4096 tokens). For each length and engine: prefill tok/s of the whole prompt, decode tok/s
of --gen-tokens greedy tokens right after it (each attending over the whole prompt), and the
process's peak RSS. Every measurement runs in a fresh process (so peak RSS is that engine's at
that length alone); the engines alternate, repeats take the median.

    python benches/long_context_vs_llamacpp.py --threads 2 [--lengths 128,1024,4096] [--repeats 3]

llama.cpp runs with llama-cpp-python's defaults for batching (n_batch = n_ubatch = 512) and
attention (no flash attention) and an f16 KV cache, like powerinfer-rs's default.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def prompt_ids(path: str, n: int) -> list[int]:
    """`n` token ids of the Python tutorial (repeated if it is shorter)."""
    from e2e_vs_llamacpp import DOCS
    from powerinfer_rs import Engine

    files = sorted(Path(DOCS, "tutorial").glob("*.rst.txt"))
    text = "\n".join(f.read_text(encoding="utf-8") for f in files)
    ids = Engine.load(path, threads=1, device="cpu").tokenize(text, add_bos=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def worker(engine: str, path: str, threads: int, n_prompt: int, n_gen: int) -> dict:
    ids = prompt_ids(path, n_prompt)
    n_ctx = n_prompt + n_gen + 16
    if engine == "ours":
        from powerinfer_rs import _core

        model = _core.Model(path, threads)
        greedy = _core.Sampler(temperature=0.0)
        warm = _core.Session(model, 64)
        warm.eval(ids[:32])
        del warm
        s = _core.Session(model, n_ctx)
        t = time.perf_counter()
        tok = s.eval_and_sample(ids, greedy)
        prefill = time.perf_counter() - t
        out = [tok]
        t = time.perf_counter()
        for _ in range(n_gen):
            tok = s.eval_and_sample([tok], greedy)
            out.append(tok)
        decode = time.perf_counter() - t
    else:
        import numpy as np
        from llama_cpp import Llama

        llm = Llama(
            model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        llm.eval(ids[:32])
        llm.reset()
        logits = lambda: np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        t = time.perf_counter()
        llm.eval(ids)
        tok = int(np.argmax(logits()))
        prefill = time.perf_counter() - t
        out = [tok]
        t = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([tok])
            tok = int(np.argmax(logits()))
            out.append(tok)
        decode = time.perf_counter() - t
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "prefill_tps": n_prompt / prefill,
        "decode_tps": n_gen / decode,
        "rss_mb": rss_mb,
        "tokens": out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2-135M Q4_1)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--lengths", default="128,1024,4096")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    from powerinfer_rs import default_model_path

    path = args.model or default_model_path()
    if args.worker:
        print(json.dumps(worker(args.worker, path, args.threads, args.prompt, args.gen_tokens)))
        return

    lengths = [int(x) for x in args.lengths.split(",")]
    runs = {(n, e): [] for n in lengths for e in ("ours", "llama.cpp")}
    for _ in range(args.repeats):
        for n in lengths:
            for e in ("ours", "llama.cpp"):
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    e,
                    "--prompt",
                    str(n),
                    "-m",
                    path,
                    "-t",
                    str(args.threads),
                    "--gen-tokens",
                    str(args.gen_tokens),
                ]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"{e} at {n} tokens failed:\n{r.stderr[-3000:]}")
                runs[(n, e)].append(json.loads(r.stdout.strip().splitlines()[-1]))

    med = lambda rs, k: statistics.median(r[k] for r in rs)
    print(
        f"model: {os.path.basename(path)}  threads: {args.threads}  decode: {args.gen_tokens} tokens after the prompt  "
        f"median of {args.repeats}"
    )
    print(
        "| prompt tokens | prefill tok/s ours / llama.cpp | ratio | decode tok/s ours / llama.cpp | ratio | peak RSS MB ours / llama.cpp | greedy tokens equal |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in lengths:
        o, l = runs[(n, "ours")], runs[(n, "llama.cpp")]
        a, b = o[-1]["tokens"], l[-1]["tokens"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(
            f"| {n} | {med(o, 'prefill_tps'):.0f} / {med(l, 'prefill_tps'):.0f} | {med(o, 'prefill_tps') / med(l, 'prefill_tps'):.2f}x "
            f"| {med(o, 'decode_tps'):.1f} / {med(l, 'decode_tps'):.1f} | {med(o, 'decode_tps') / med(l, 'decode_tps'):.2f}x "
            f"| {med(o, 'rss_mb'):.0f} / {med(l, 'rss_mb'):.0f} | {same}/{len(a)} |"
        )


if __name__ == "__main__":
    main()
