"""How close powerinfer-rs and llama.cpp compute, on SmolLM2-135M and held-out prose.

1. Logits against a float64 reference (tests/reference.py over the dequantized weights of the
   bundled Q4_1 file): for each of several passages of the Python docs, the relative distance
   ||logits - ref|| / ||ref|| of each engine, and of the engine with an f32 KV cache (to tell the
   cache's share from the int8 activations').
2. Perplexity per `llama-quantize` preset (the bundled file requantized by llama.cpp's own
   quantizer, as benches/presets_vs_llamacpp.py does): both engines over the same token ids and
   windows (llama.cpp's method: windows of --ctx tokens, the second half of each scored), and
   their relative difference.

    python benches/numerics_vs_llamacpp.py [--passages 6] [--tokens 128] [--ctx 256] [--windows 12]

Needs llama-cpp-python built from source (README, "Against llama.cpp") and python3.11-doc.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benches"))

from presets_vs_llamacpp import PRESETS, requantize  # noqa: E402

DOCS = Path("/usr/share/doc/python3.11/html/_sources")


def passages(n: int, chars: int, seed: int) -> list[str]:
    files = sorted(p for p in DOCS.rglob("*.txt") if p.stat().st_size > 4 * chars)
    rng = random.Random(seed)
    out = []
    for f in rng.sample(files, n):
        text = f.read_text(encoding="utf-8", errors="replace")
        start = rng.randrange(len(text) - chars)
        out.append(text[start : start + chars])
    return out


def llama_cpp_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def nll_sums(logits: np.ndarray, chunk: list[int], first: int) -> tuple[float, int]:
    scored = logits[first : len(chunk) - 1]
    targets = np.asarray(chunk[first + 1 :])
    m = scored.max(axis=1, keepdims=True)
    logz = np.log(np.exp(scored - m).sum(axis=1)) + m[:, 0]
    return float((logz - scored[np.arange(len(targets)), targets]).sum()), len(targets)


def logits_table(args, src: str) -> None:
    import llama_cpp
    from powerinfer_rs import Engine
    from reference import forward, read_weights

    w, meta = read_weights(src)
    ours16 = Engine.load(src, n_ctx=args.tokens, threads=args.threads, device="cpu")
    ours32 = Engine.load(src, n_ctx=args.tokens, threads=args.threads, device="cpu", kv_type="f32")
    llm = llama_cpp.Llama(
        model_path=src,
        n_ctx=args.tokens,
        n_batch=args.tokens,
        logits_all=True,
        n_threads=args.threads,
        verbose=False,
    )
    print(
        f"\nLogits vs float64 reference, SmolLM2-135M Q4_1, {args.passages} passages of {args.tokens} tokens"
    )
    print(
        "| passage | powerinfer-rs (f16 KV) | powerinfer-rs (f32 KV) | llama.cpp (f16 KV) | ratio ours/llama.cpp |"
    )
    print("|---|---|---|---|---|")
    rows = []
    for i, text in enumerate(passages(args.passages, 8 * args.tokens, args.seed)):
        ids = ours16.tokenize(text)[: args.tokens]
        ref = forward(w, meta, ids)
        rel = lambda a, ref=ref: float(np.linalg.norm(a - ref) / np.linalg.norm(ref))
        r = (
            rel(ours16.logits(ids).astype(np.float64)),
            rel(ours32.logits(ids).astype(np.float64)),
            rel(llama_cpp_logits(llm, ids)),
        )
        rows.append(r)
        print(f"| {i + 1} | {r[0]:.2%} | {r[1]:.2%} | {r[2]:.2%} | {r[0] / r[2]:.2f} |")
    mean = np.mean(rows, axis=0)
    print(f"| mean | {mean[0]:.2%} | {mean[1]:.2%} | {mean[2]:.2%} | {mean[0] / mean[2]:.2f} |")


def perplexity_table(args, src: str) -> None:
    import llama_cpp
    from powerinfer_rs import Engine

    text = "\n\n".join(passages(40, 2000, args.seed + 1))
    ids = Engine.load(src, threads=1, device="cpu").tokenize(text, add_bos=False)
    ctx, first = args.ctx, args.ctx // 2
    chunks = [ids[c * ctx : (c + 1) * ctx] for c in range(min(args.windows, len(ids) // ctx))]
    print(
        f"\nPerplexity per preset, {len(chunks)} windows of {ctx} tokens (second half scored), same ids for both"
    )
    print("| preset | powerinfer-rs | llama.cpp | difference |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for preset in args.presets.split(","):
            path = src if preset == "Q4_1" else str(Path(d) / f"{preset}.gguf")
            if preset != "Q4_1":
                requantize(src, path, preset)
            ours = Engine.load(path, n_ctx=ctx, threads=args.threads, device="cpu")
            llm = llama_cpp.Llama(
                model_path=path,
                n_ctx=ctx,
                n_batch=ctx,
                logits_all=True,
                n_threads=args.threads,
                verbose=False,
            )
            sums = {"ours": [0.0, 0], "llama.cpp": [0.0, 0]}
            for chunk in chunks:
                for name, logits in (
                    ("ours", ours.logits(chunk).astype(np.float64)),
                    ("llama.cpp", llama_cpp_logits(llm, chunk)),
                ):
                    nll, n = nll_sums(logits, chunk, first)
                    sums[name][0] += nll
                    sums[name][1] += n
            p = {k: float(np.exp(s / n)) for k, (s, n) in sums.items()}
            print(
                f"| {preset} | {p['ours']:.4f} | {p['llama.cpp']:.4f} | {(p['ours'] - p['llama.cpp']) / p['llama.cpp']:+.2%} |"
            )
            del llm, ours


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--skip-logits", action="store_true")
    args = ap.parse_args()

    from powerinfer_rs import default_model_path

    src = default_model_path()
    if not args.skip_logits:
        logits_table(args, src)
    perplexity_table(args, src)


if __name__ == "__main__":
    main()
