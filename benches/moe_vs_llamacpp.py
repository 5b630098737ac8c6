"""Mixture-of-experts speed on the CPU: powerinfer-rs vs llama.cpp (llama-cpp-python) on a
synthetic model of Qwen3-30B-A3B's layer shape (n_embd 2048, 32 query and 4 KV heads of 128,
q/k norms, 128 experts of 768 neurons, 8 used per token), a few layers, in the types llama.cpp's
own quantizer writes for it (Q4_K_M by default, and Q4_0), the same thread count and token ids,
in one process, runs alternating between the two. `--shape gpt-oss-20b`: gpt-oss-20b's layer
instead (n_embd 2880, 64 query and 8 KV heads of 64 with sinks, 32 experts of 2880 neurons, 4
used, biases, every other layer sliding over 128 positions), its experts MXFP4 as its files
hold them and the rest Q8_0 (written directly: preset "MXFP4").

Prefill: one batch of --prompt-tokens; decode: --gen-tokens greedy tokens after it. Prints
tok/s, the ratios (powerinfer-rs / llama.cpp; > 1 means faster) and, for decode, the bytes a
token reads (attention, routers, its 8 experts) against the machine's measured copy bandwidth.

    python benches/moe_vs_llamacpp.py --threads 2

The float16 source (1.2 GB a layer) and the quantized files are kept in --workdir, so later
runs skip writing them. Needs llama-cpp-python built from source (see e2e_vs_llamacpp.py).
POWERINFER_SIMD=avx2 caps powerinfer-rs at AVX2 (llama.cpp stays as built).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from e2e_vs_llamacpp import LlamaCpp, Ours  # noqa: E402

# The layers (their config.json), the vocabulary aside
SHAPES = {
    "qwen3-30b-a3b": dict(
        arch="qwen3moe",
        n_embd=2048,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_ff=6144,
        experts=dict(n_expert=128, n_used=8, n_ff_exp=768),
    ),
    "gpt-oss-20b": dict(
        arch="gpt-oss",
        n_embd=2880,
        n_head=64,
        n_head_kv=8,
        head_dim=64,
        n_ff=2880,
        sliding_window=128,
        rope_base=150000.0,
        rope_scaling=32.0,
        yarn_original_ctx=4096,
        experts=dict(n_expert=32, n_used=4, n_ff_exp=2880),
    ),
}


def source(workdir: Path, shape: str, layers: int) -> Path:
    """The float16 model, written once."""
    from gguf import GGMLQuantizationType as Q
    from synth import write_model

    path = workdir / f"{shape}-{layers}l-f16.gguf"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        write_model(tmp, dtype=Q.F16, n_layer=layers, n_ctx=4096, seed=3, **SHAPES[shape])
        tmp.rename(path)
    return path


def quantized(workdir: Path, shape: str, layers: int, preset: str) -> Path:
    """The source quantized by llama.cpp's quantizer into `preset`, written once; "MXFP4":
    MXFP4 experts and the rest Q8_0, written directly."""
    import llama_cpp

    path = workdir / f"{shape}-{layers}l-{preset}.gguf"
    if not path.exists() and preset == "MXFP4":
        from gguf import GGMLQuantizationType as Q
        from synth import write_model

        kw = dict(SHAPES[shape])
        kw["experts"] = dict(kw["experts"], dtype=Q.MXFP4)
        tmp = path.with_suffix(".tmp")
        write_model(tmp, dtype=Q.Q8_0, n_layer=layers, n_ctx=4096, seed=3, **kw)
        tmp.rename(path)
    if not path.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset}")
        params.nthread = os.cpu_count() or 1
        src = str(source(workdir, shape, layers)).encode()
        if llama_cpp.llama_model_quantize(src, str(path).encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not quantize to {preset}")
    return path


def decode_bytes(path: Path, n_used: int, n_expert: int) -> int:
    """Bytes of weights one decode token reads: attention, norms, router, and its n_used of
    n_expert experts (the tiny vocabulary's classifier and embedding row aside)."""
    from gguf import GGUFReader

    total = 0
    for t in GGUFReader(str(path)).tensors:
        if not t.name.startswith("blk."):
            continue
        n = int(t.n_bytes)
        total += n * n_used // n_expert if "_exps." in t.name else n
    return total


def copy_bandwidth() -> float:
    """Bytes per second of a large numpy copy (a read and a write per byte): the machine's
    memory speed as one core sees it."""
    a = np.ones(256 << 20, dtype=np.uint8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--presets", help="default: Q4_K_M,Q4_0 (gpt-oss-20b: MXFP4)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/powerinfer-moe-bench")
    ap.add_argument(
        "--mmap",
        action="store_true",
        help="both read the weights from the file's map (default: both copy them into memory)",
    )
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    presets = args.presets or ("MXFP4" if args.shape == "gpt-oss-20b" else "Q4_K_M,Q4_0")
    experts = SHAPES[args.shape]["experts"]

    from powerinfer_rs import _core

    ids = np.random.default_rng(0).integers(3, 260, size=args.prompt_tokens).tolist()
    n_ctx = args.prompt_tokens + args.gen_tokens + 16
    bandwidth = copy_bandwidth()
    print(
        f"{args.layers} layers of {args.shape}'s shape, threads {args.threads}, "
        f"powerinfer-rs SIMD {_core.simd_level()}, repeats {args.repeats} (median shown); "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"| type | engine | prefill tok/s ({args.prompt_tokens}) | decode tok/s "
        f"({args.gen_tokens}) | decode GB/s of weights |"
    )
    print("|---|---|---|---|---|")
    for preset in presets.split(","):
        path = str(quantized(workdir, args.shape, args.layers, preset))
        per_token = decode_bytes(Path(path), experts["n_used"], experts["n_expert"])
        engines = [
            Ours(path, args.threads, n_ctx, args.mmap),
            LlamaCpp(path, args.threads, n_ctx, 512, args.mmap),
        ]
        prefill = {e.name: [] for e in engines}
        decode = {e.name: [] for e in engines}
        tokens = {}
        for e in engines:  # page in the weights, start the thread pools
            e.prefill(ids[:32])
        for _ in range(args.repeats):
            for e in engines:
                prefill[e.name].append(args.prompt_tokens / e.prefill(ids))
                dt, out = e.decode(ids, args.gen_tokens)
                decode[e.name].append(args.gen_tokens / dt)
                tokens[e.name] = out
        for e in engines:
            d = statistics.median(decode[e.name])
            print(
                f"| {preset} | {e.name} | {statistics.median(prefill[e.name]):.1f} | {d:.1f} "
                f"| {d * per_token / 1e9:.1f} |"
            )
        rp = [a / b for a, b in zip(prefill["powerinfer-rs"], prefill["llama.cpp"])]
        rd = [a / b for a, b in zip(decode["powerinfer-rs"], decode["llama.cpp"])]
        same = next(
            (i for i, (a, b) in enumerate(zip(*tokens.values())) if a != b),
            len(tokens["llama.cpp"]),
        )
        print(
            f"| {preset} | ratio | {statistics.median(rp):.2f}x ({min(rp):.2f}-{max(rp):.2f}) "
            f"| {statistics.median(rd):.2f}x ({min(rd):.2f}-{max(rd):.2f}) "
            f"| greedy: first {same} tokens identical |"
        )
        del engines


if __name__ == "__main__":
    main()
