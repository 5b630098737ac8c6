"""End-to-end speed: powerinfer-rs vs llama.cpp (llama-cpp-python) on the same GGUF file, the
same thread count and the same token ids, in one process, runs alternating between the two.

Measures prefill tok/s (one batch of --prompt-tokens) and decode tok/s (--gen-tokens greedy
tokens after that prompt) and prints the ratios (powerinfer-rs / llama.cpp; > 1 means faster).

    python benches/e2e_vs_llamacpp.py --threads 2
    python benches/e2e_vs_llamacpp.py --device cuda --out smollm2_cuda.json   # both wholly on the GPU

llama-cpp-python must be built from source with flags this CPU supports, e.g. on AVX2 machines:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" pip install --no-binary llama-cpp-python llama-cpp-python
and for --device cuda with GGML_CUDA=on (scripts/llamacpp_cuda.sh builds it on a GPU machine).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time

import numpy as np

DOCS = "/usr/share/doc/python3.11/html/_sources"


def prompt_text() -> str:
    files = sorted(glob.glob(os.path.join(DOCS, "tutorial", "*.rst.txt")))
    if files:
        return "\n".join(open(f, encoding="utf-8").read() for f in files[:4])
    words = "the quick brown fox jumps over the lazy dog while engineers measure tokens per second".split()
    return " ".join(words[i % len(words)] for i in range(4000))


class Ours:
    name = "powerinfer-rs"

    def __init__(
        self, path: str, threads: int, n_ctx: int, mmap: bool = False, device: str = "cpu"
    ):
        from powerinfer_rs import Engine, _core

        self._core = _core
        self.n_ctx = n_ctx
        self.engine = None
        if device == "cpu":
            # as Engine.load on the CPU: the weights copied into memory unless `mmap`
            self.model = _core.Model(path, threads, not mmap)
        else:
            # no budget: every layer wholly on the device
            self.engine = Engine.load(path, device=device, n_ctx=n_ctx, threads=threads)

    def _session(self):
        if self.engine is not None:
            return self.engine._session(self.n_ctx)
        return self._core.Session(self.model, self.n_ctx)

    def prefill(self, ids: list[int]) -> float:
        s = self._session()
        t = time.perf_counter()
        s.eval(ids)
        return time.perf_counter() - t

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        s = self._session()
        greedy = self._core.Sampler(temperature=0.0)
        tok = s.eval_and_sample(ids, greedy)
        out = [tok]
        t = time.perf_counter()
        for _ in range(n):
            tok = s.eval_and_sample([tok], greedy)
            out.append(tok)
        return time.perf_counter() - t, out


class LlamaCpp:
    name = "llama.cpp"

    def __init__(
        self, path: str, threads: int, n_ctx: int, n_batch: int, mmap: bool = False, gpu=False
    ):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=path,
            n_gpu_layers=-1 if gpu else 0,  # -1: every layer on the GPU
            use_mmap=mmap,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t

    def _last_logits(self) -> np.ndarray:
        # Without logits_all, llama-cpp-python keeps no copy: read the context's buffer directly.
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        llm = self.llm
        llm.reset()
        llm.eval(ids)
        tok = int(np.argmax(self._last_logits()))
        out = [tok]
        t = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
            tok = int(np.argmax(self._last_logits()))
            out.append(tok)
        return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2-135M Q4_1)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--mmap",
        action="store_true",
        help="both read the weights from the file's map (default: both copy them into memory at "
        "load, as powerinfer-rs does on the CPU and llama.cpp with --no-mmap)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: both engines hold the whole model on the GPU (llama.cpp built with "
        "GGML_CUDA=on)",
    )
    ap.add_argument("--out", default=None, help="JSON file of the results")
    args = ap.parse_args()

    from powerinfer_rs import Engine, default_model_path

    path = args.model or default_model_path()
    n_ctx = args.prompt_tokens + args.gen_tokens + 16
    ids = Engine.load(path, threads=1, device="cpu").tokenize(prompt_text())[: args.prompt_tokens]
    if len(ids) < args.prompt_tokens:
        raise SystemExit(f"prompt text has only {len(ids)} tokens")

    engines = [
        Ours(path, args.threads, n_ctx, args.mmap, args.device),
        LlamaCpp(path, args.threads, n_ctx, args.prompt_tokens, args.mmap, args.device == "cuda"),
    ]
    prefill = {e.name: [] for e in engines}
    decode = {e.name: [] for e in engines}
    tokens = {}
    for e in engines:  # warm-up: page in the weights, start the thread pools
        e.prefill(ids[:64])
    for _ in range(args.repeats):
        for e in engines:
            prefill[e.name].append(args.prompt_tokens / e.prefill(ids))
            dt, out = e.decode(ids, args.gen_tokens)
            decode[e.name].append(args.gen_tokens / dt)
            tokens[e.name] = out

    same = 0
    for a, b in zip(tokens["powerinfer-rs"], tokens["llama.cpp"]):
        if a != b:
            break
        same += 1
    print(
        f"model: {os.path.basename(path)}  device: {args.device}  threads: {args.threads}  "
        f"repeats: {args.repeats} (median shown)"
    )
    print(
        f"| engine | prefill tok/s ({args.prompt_tokens} tokens) | decode tok/s ({args.gen_tokens} tokens) |"
    )
    print("|---|---|---|")
    for e in engines:
        print(
            f"| {e.name} | {statistics.median(prefill[e.name]):.1f} | {statistics.median(decode[e.name]):.1f} |"
        )
    ratio_p = [a / b for a, b in zip(prefill["powerinfer-rs"], prefill["llama.cpp"])]
    ratio_d = [a / b for a, b in zip(decode["powerinfer-rs"], decode["llama.cpp"])]
    print(
        f"| ratio (powerinfer-rs / llama.cpp) | {statistics.median(ratio_p):.2f}x "
        f"(min {min(ratio_p):.2f}, max {max(ratio_p):.2f}) | {statistics.median(ratio_d):.2f}x "
        f"(min {min(ratio_d):.2f}, max {max(ratio_d):.2f}) |"
    )
    print(
        f"greedy decode: the first {same} of {len(tokens['llama.cpp'])} tokens are identical to llama.cpp's"
    )
    if args.out:
        rows = {}
        for kind, runs in (("prefill_tok_s", prefill), ("decode_tok_s", decode)):
            ours, theirs = runs["powerinfer-rs"], runs["llama.cpp"]
            ratios = [a / b for a, b in zip(ours, theirs)]
            rows[kind] = {
                "ours": statistics.median(ours),
                "theirs": statistics.median(theirs),
                "ratio": statistics.median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
            }
        with open(args.out, "w") as fh:
            json.dump(
                {
                    "model": os.path.basename(path),
                    "device": args.device,
                    "threads": args.threads,
                    "prompt_tokens": args.prompt_tokens,
                    "gen_tokens": args.gen_tokens,
                    "repeats": args.repeats,
                    **rows,
                    "greedy_tokens_identical": same,
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
