"""Speed per quantization preset: SmolLM2-135M requantized by llama.cpp's own quantizer into each
`llama-quantize` preset (Q2_K, Q3_K_M, Q4_K_S, Q4_K_M, Q5_K_M, Q6_K, IQ4_XS, and Q4_0 and the
bundled Q4_1 for reference), then powerinfer-rs and llama.cpp on the same file, the same
threads and the same token ids, in one process, runs alternating (see e2e_vs_llamacpp.py).
Prints prefill and decode tok/s, their ratios (> 1: powerinfer-rs faster), how many greedy
tokens agree, and the relative difference of the last prompt token's logits.

    python benches/presets_vs_llamacpp.py --threads 2
    python benches/presets_vs_llamacpp.py --threads 2 --wide

SmolLM2's rows are 576 wide, so most of its tensors fall back to 32-weight formats; `--wide`
instead quantizes a random 4-layer llama of n_embd 2048, n_ff 5632 (Llama 3.2 1B's widths,
every tensor a k-quant), written in F32 with the `gguf` package (tests/synth.py).

The presets are requantized from the bundled Q4_1 file (`allow_requantize`): the same file for
both engines, which is what a speed comparison needs. Needs llama-cpp-python built from source.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_vs_llamacpp import LlamaCpp, Ours, prompt_text

PRESETS = ["Q4_1", "Q4_0", "Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"]


def requantize(src: str, dst: str, preset: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset}")
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize to {preset}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument(
        "--wide", action="store_true", help="a random 2048-wide model instead of SmolLM2"
    )
    args = ap.parse_args()

    from powerinfer_rs import Engine, default_model_path

    n_ctx = args.prompt_tokens + args.gen_tokens + 16
    with tempfile.TemporaryDirectory() as d:
        if args.wide:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from gguf import GGMLQuantizationType
            from synth import write_model

            src, name = str(Path(d) / "f32.gguf"), "random llama, 4 layers of 2048 x 5632"
            write_model(
                src,
                arch="llama",
                dtype=GGMLQuantizationType.F32,
                n_embd=2048,
                n_ff=5632,
                n_layer=4,
                n_head=16,
                n_head_kv=4,
                n_ctx=1024,
                seed=3,
            )
            presets = [p for p in args.presets.split(",") if p != "Q4_1"]
        else:
            src, name, presets = default_model_path(), "SmolLM2-135M", args.presets.split(",")
        ids = Engine.load(src, threads=1, device="cpu").tokenize(prompt_text())[
            : args.prompt_tokens
        ]
        print(
            f"{name}, threads {args.threads}, prompt {args.prompt_tokens} tokens, decode {args.gen_tokens}, median of {args.repeats}"
        )
        print(
            "| preset | MiB | prefill tok/s ours / llama.cpp | ratio | decode tok/s ours / llama.cpp | ratio | greedy tokens equal | logits diff |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for preset in presets:
            path = src if preset == "Q4_1" and not args.wide else str(Path(d) / f"{preset}.gguf")
            if path != src:
                requantize(src, path, preset)
            ours, theirs = (
                Ours(path, args.threads, n_ctx),
                LlamaCpp(path, args.threads, n_ctx, args.prompt_tokens),
            )
            engines = [ours, theirs]
            for e in engines:  # warm-up
                e.prefill(ids[:32])
            pre = {e.name: [] for e in engines}
            dec = {e.name: [] for e in engines}
            out = {}
            for _ in range(args.repeats):
                for e in engines:
                    pre[e.name].append(args.prompt_tokens / e.prefill(ids))
                    dt, out[e.name] = e.decode(ids, args.gen_tokens)
                    dec[e.name].append(args.gen_tokens / dt)
            same = next(
                (i for i, (a, b) in enumerate(zip(out[ours.name], out[theirs.name])) if a != b),
                len(out[ours.name]),
            )
            s = ours._core.Session(ours.model, n_ctx)
            mine = s.eval(ids)
            theirs.prefill(ids)
            ref = theirs._last_logits().astype(np.float64)
            diff = np.linalg.norm(mine - ref) / np.linalg.norm(ref)
            med = lambda xs: statistics.median(xs)
            rp = med([a / b for a, b in zip(pre[ours.name], pre[theirs.name])])
            rd = med([a / b for a, b in zip(dec[ours.name], dec[theirs.name])])
            mib = Path(path).stat().st_size / 2**20
            print(
                f"| {preset} | {mib:.0f} | {med(pre[ours.name]):.0f} / {med(pre[theirs.name]):.0f} | {rp:.2f}x "
                f"| {med(dec[ours.name]):.0f} / {med(dec[theirs.name]):.0f} | {rd:.2f}x | {same} of {len(out[ours.name])} | {diff:.1%} |",
                flush=True,
            )
            del ours, theirs, engines


if __name__ == "__main__":
    main()
