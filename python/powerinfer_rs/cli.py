"""The `powerinfer-rs` command: run, chat, serve (OpenAI-compatible HTTP), info, perplexity, and the
offline toolchain (profile, train-predictors, convert, place)."""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys

from . import _core, hub, settings
from .models import INSTALL_HINT
from .placement.costs import DEFAULT_GPU_BANDWIDTH, DEFAULT_SYNC_LATENCY


def _model_path(arg: str | None) -> str:
    """The model file: `arg` (a path or an hf://owner/repo/file.gguf name, downloaded and
    cached), or the default model."""
    if arg:
        return hub.resolve(arg)
    from .models import default_model_path

    return default_model_path()


def _add_model_and_text(
    p: argparse.ArgumentParser, model_help: str, corpus_help: str, eval_help: str
) -> None:
    """MODEL (positional or -m), --corpus and --eval, as `pack` and `relufy` take them."""
    p.add_argument("model_pos", nargs="?", metavar="MODEL")
    p.add_argument(
        "-m", "--model", default=None, help=f"{model_help} (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("--corpus", nargs="+", required=True, help=corpus_help)
    p.add_argument("--eval", nargs="+", default=None, help=eval_help)


def _engine_settings(a: argparse.Namespace, **overrides) -> settings.EngineSettings:
    """The `EngineSettings` the arguments `settings.add_arguments` made say."""
    return settings.from_args(settings.EngineSettings, a, **overrides)


def _sampling(a: argparse.Namespace) -> settings.SamplingSettings:
    """The `SamplingSettings` the command line says, with a seed drawn here when sampling
    without one, so that the line printing the sampling can name it (and the answer be had
    again with --seed)."""
    s = settings.from_args(settings.SamplingSettings, a)
    if s.seed is None and s.temperature > 0:
        s = dataclasses.replace(s, seed=random.getrandbits(32))
    return s


def _device_line(engine) -> str:
    r = engine.gpu_report()
    if r is None:
        return "device: cpu"
    mib = 1 << 20
    return (
        f"device: {engine.device} ({r['gpu_name']}), {r['weight_bytes'] / mib:.0f} MiB of weights on the GPU "
        f"(budget {r['vram_budget'] / mib:.0f} MiB), {r['layers_on_gpu']}/{r['n_layer']} layers, "
        + (
            f"{r['hot_expert_fraction']:.1%} of experts on the GPU"
            if "hot_expert_fraction" in r
            else f"{r['hot_neuron_fraction']:.1%} of FFN neurons hot"
        )
        + f" ({r['placement_source']} split)"
    )


def _sparsity_line(engine, s: dict) -> str:
    line = f"sparsity: {engine.sparsity}"
    if engine.max_ppl_increase is not None:
        line += f" (input sparsity, max perplexity increase {engine.max_ppl_increase:.1%})"
    elif engine.sparsity == "threshold":
        line += f" (target {engine.target_sparsity:.2f})"
    if "ffn_sparsity" in s:
        line += f", FFN neurons skipped {s['ffn_sparsity']:.1%}"
    if engine.sparsity != "dense" and "weight_bytes_skipped" in s:
        line += f", layer weight bytes skipped {s['weight_bytes_skipped']:.1%}"
    if "predictor_recall" in s:
        line += f", predictor recall {s['predictor_recall']:.1%}"
    return line


def _steps_line(what: str, steps: dict[str, float]) -> str:
    """Where a phase's time went (`--step-times`): each step's milliseconds and share."""
    total = sum(steps.values())
    parts = sorted(steps.items(), key=lambda kv: -kv[1])
    return f"{what} steps ({total * 1e3:.1f} ms): " + ", ".join(
        f"{name} {sec * 1e3:.1f} ms ({sec / total:.0%})" for name, sec in parts
    )


def cmd_run(a: argparse.Namespace) -> int:
    from .engine import Engine

    prompt = a.prompt if a.prompt is not None else a.prompt_pos
    if prompt is None:
        if sys.stdin.isatty():
            print("error: give a prompt with -p/--prompt", file=sys.stderr)
            return 2
        prompt = sys.stdin.read()
    sampling = _sampling(a)  # refused before the model loads
    engine = Engine.load(settings=_engine_settings(a))
    print(sampling.describe(), file=sys.stderr)
    kwargs = sampling.as_kwargs()
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
    if pieces.repetition is not None:
        print(
            f"stopped: the answer was repeating itself ({pieces.repetition.describe()})",
            file=sys.stderr,
        )
    s = engine.last_stats
    print(
        f"prompt: {s['prompt_tokens']} tokens, {s['prefill_tps']:.2f} tok/s | "
        f"generated: {s['generated_tokens']} tokens, {s['decode_tps']:.2f} tok/s | threads: {engine.n_threads}",
        file=sys.stderr,
    )
    print(_sparsity_line(engine, s), file=sys.stderr)
    for key, what in (("prefill_steps_s", "prompt"), ("decode_steps_s", "decode")):
        if s.get(key):
            print(_steps_line(what, s[key]), file=sys.stderr)
    line = _device_line(engine)
    if "gpu_neuron_share" in s:
        line += f"; {s['gpu_neuron_share']:.1%} of computed neurons ran on the GPU"
    print(line, file=sys.stderr)
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
    # the quantization mix: a preset such as Q4_K_M mixes several types
    mix: dict[str, list[int]] = {}
    for t in tensors:
        n_elements = 1
        for d in t["shape"]:
            n_elements *= d
        entry = mix.setdefault(t["type"], [0, 0, 0])
        entry[0] += 1
        entry[1] += t["n_bytes"]
        entry[2] += n_elements
    print("quantization mix:" + ("" if a.tensors else "  (--tensors lists the tensors)"))
    for name, (count, n_bytes, n_elements) in sorted(mix.items(), key=lambda kv: -kv[1][1]):
        bits = 8 * n_bytes / max(n_elements, 1)
        share = n_bytes / max(total, 1)
        print(
            f"  {name:<7} {count:>4} tensors  {n_bytes / 2**20:9.2f} MiB  {share:6.1%}  {bits:5.2f} bits/weight"
        )
    return 0


def cmd_perplexity(a: argparse.Namespace) -> int:
    from .engine import Engine

    texts = []
    for path in a.file:
        with open(path, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    engine = Engine.load(settings=_engine_settings(a, n_ctx=max(a.ctx, a.n_ctx or 0)))

    def progress(done: int, total: int, ppl: float) -> None:
        print(f"[{done}/{total}] ppl {ppl:.4f}", file=sys.stderr)

    import math

    nll, count = engine._perplexity_sums(
        "\n\n".join(texts), a.ctx, max_chunks=a.chunks, progress=progress
    )
    print(f"perplexity: {math.exp(nll / count):.4f} over {count} scored tokens (ctx {a.ctx})")
    print(_sparsity_line(engine, engine.last_stats), file=sys.stderr)
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from .engine import Engine
    from .offline import profile

    model = _model_path(a.model or a.model_pos)
    engine = Engine.load(model, threads=a.threads, n_ctx=a.window, sparsity="dense", device="cpu")
    p = profile(
        engine,
        a.corpus,
        tokens=a.tokens,
        output=a.output,
        train_tokens=a.train_tokens,
        target_sparsity=a.target_sparsity,
        window=a.window,
        plot=False if a.no_plot else (a.plot or True),
        progress=not a.quiet,
    )
    from .offline.profiling import layer_stats

    stats = layer_stats(p)
    if p.get("unit") == "expert":
        print(
            f"profiled {p['n_tokens']} tokens: how often each layer routes to each of its "
            f"{p['counts'].shape[1]} experts ({p['n_expert_used']} per token)"
        )
    else:
        print(
            f"profiled {p['n_tokens']} tokens ({p['activation']}); training set {p['train_x'].shape[1]} tokens"
        )
    print("layer  sparsity  top10%_share")
    for l, st in enumerate(stats):
        print(f"{l:5d}  {st['sparsity']:8.3f}  {st['skew']:12.3f}")
    print(f"wrote {p['path']}" + (f" and {p['plot']}" if "plot" in p else ""))
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from .offline import train

    r = train(
        a.profile,
        output=a.output,
        recall_target=a.recall,
        efficiency_target=a.efficiency,
        hidden=a.hidden,
        min_hidden=a.min_hidden,
        max_hidden=a.max_hidden,
        min_gain=a.min_gain,
        epochs=a.epochs,
        batch=a.batch,
        lr=a.lr,
        seed=a.seed,
        progress=not a.quiet,
        report=a.report,
        device=a.device,
        model=a.model,
        predictor_type=a.predictor_type,
    )
    print(r["table"])
    print(f"wrote {r['path']} and {r['report']}")
    return 0


def cmd_convert(a: argparse.Namespace) -> int:
    from .offline import convert

    out = convert(
        a.source,
        a.predictors,
        output=a.output,
        outtype=a.outtype,
        predictor_type=a.predictor_type,
        sparse_threshold=a.sparse_threshold,
        down_type=a.down_type,
    )
    print(f"wrote {out}")
    return 0


def cmd_pack(a: argparse.Namespace) -> int:
    from .engine import Engine
    from .offline.packing import pack

    engine = Engine.load(_model_path(a.model or a.model_pos), threads=1, device="cpu")
    shard = pack(
        engine.tokenizer,
        a.corpus,
        output=a.output,
        eval_paths=a.eval,
        eval_fraction=a.eval_fraction,
        max_tokens=a.max_tokens,
    )
    m = shard["meta"]
    print(
        f"wrote {a.output}: {m['train_tokens']} training tokens from {len(m['train_files'])} files, "
        f"{m['eval_tokens']} held-out tokens ({m['split']}), {shard['train'].dtype} ids"
    )
    return 0


def cmd_relufy(a: argparse.Namespace) -> int:
    from .offline.relufication import RelufySettings, relufy

    s = RelufySettings(
        activation=a.activation,
        steps=a.steps,
        batch=a.batch,
        seq_len=a.seq_len,
        lr=a.lr,
        warmup=a.warmup,
        blend=a.blend,
        l1=a.l1,
        l1_full=a.l1_full,
        ce_weight=a.ce_weight,
        weight_decay=a.weight_decay,
        seed=a.seed,
        qat=a.outtype if a.qat else "",
    )
    if a.tokens is not None:
        s.steps = max(1, -(-a.tokens // (a.batch * a.seq_len)))
    r = relufy(
        _model_path(a.model or a.model_pos),
        a.corpus,
        a.output,
        s,
        outtype=a.outtype,
        eval_paths=a.eval,
        eval_tokens=a.eval_tokens,
        checkpoint=a.checkpoint,
        checkpoint_every=a.checkpoint_every,
        resume=a.resume,
        report=a.report,
        device=a.device,
        compile=not a.no_compile,
        threads=a.threads,
        max_steps=a.max_steps,
        minutes=a.minutes,
        progress=not a.quiet,
    )
    if not r.get("report"):
        print(
            f"stopped after step {r['step']} of {r['steps']}; continue with --resume {r['checkpoint']}"
        )
        return 0
    print(
        f"exact zeros {r['sparsity']:.1%} of FFN activations (per layer {min(r['sparsity_per_layer']):.1%}"
        f"-{max(r['sparsity_per_layer']):.1%}); held-out perplexity {r['ppl_original']:.2f} -> {r['ppl_relufied']:.2f} "
        f"(engine, {r['outtype']}: {r['ppl_original_engine']:.2f} -> {r['ppl_relufied_engine']:.2f}), KL {r['kl_relufied']:.4f}"
    )
    print(f"wrote {r['output']} and {r['report']}")
    return 0


def cmd_place(a: argparse.Namespace) -> int:
    from .offline import place

    p = place(
        _model_path(a.model or a.model_pos),
        a.profile,
        a.vram_budget,
        output=a.output,
        cpu_bandwidth=a.cpu_bandwidth,
        gpu_bandwidth=a.gpu_bandwidth,
        sync_latency=a.sync_latency,
        group=a.group,
        time_limit=a.time_limit,
        n_ctx=a.ctx_size,
        kv_type=a.kv_type,
    )
    print(p.summary())
    print(f"wrote {p.path}")
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    import os

    from . import chat
    from .engine import Engine

    sampling = _sampling(a)  # refused before the model loads
    engine = Engine.load(settings=_engine_settings(a))
    if a.chat_template:
        template = a.chat_template
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as fh:
                template = fh.read()
        engine.chat_template = template
    return chat.run(engine, sampling, system=a.system)


def cmd_serve(a: argparse.Namespace) -> int:
    import logging
    import os

    from .engine import Engine
    from .server import serve

    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0 picks a free port), got {a.port}")
    if a.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {a.parallel}")
    if a.prompt_cache is not None and a.prompt_cache < 0:
        raise ValueError(f"--prompt-cache must be >= 0, got {a.prompt_cache}")
    if a.n_predict == 0 or a.n_predict < -1:
        raise ValueError(f"--n-predict must be >= 1, or -1 for no limit, got {a.n_predict}")
    n_predict = None if a.n_predict == -1 else a.n_predict
    if a.replicas != "auto" and not (a.replicas.isdigit() and int(a.replicas) >= 1):
        raise ValueError(f"--replicas must be a positive number or 'auto', got {a.replicas!r}")
    if not a.ray and (a.replicas != "1" or a.address or a.max_replicas):
        raise ValueError("--replicas, --max-replicas and --address need --ray")
    api_key = a.api_key if a.api_key is not None else os.environ.get("POWERINFER_API_KEY") or None
    if a.api_key is not None and not a.api_key:
        raise ValueError("--api-key must not be empty")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if a.ray:
        from .server.ray_serve import ServeOptions, serve_with_ray

        replicas = a.replicas if a.replicas == "auto" else int(a.replicas)
        serve_with_ray(
            _engine_settings(a),
            ServeOptions(
                model_id=a.alias,
                api_key=api_key,
                slots=a.parallel,
                batch=not a.no_batch,
                prompt_cache=a.prompt_cache,
                n_predict=n_predict,
            ),
            host=a.host,
            port=a.port,
            replicas=replicas,
            max_replicas=a.max_replicas,
            address=a.address,
        )
        return 0
    engine = Engine.load(settings=_engine_settings(a))
    serve(
        engine,
        host=a.host,
        port=a.port,
        model_id=a.alias,
        api_key=api_key,
        slots=a.parallel,
        batch=not a.no_batch,
        prompt_cache=a.prompt_cache,
        n_predict=n_predict,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="powerinfer-rs", description="Fast local LLM inference (GGUF models)."
    )
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="generate text from a prompt")
    settings.add_arguments(r, settings.EngineSettings())
    r.add_argument(
        "prompt_pos", nargs="?", metavar="PROMPT", help="the prompt (or -p, or standard input)"
    )
    r.add_argument("-p", "--prompt", default=None)
    settings.add_arguments(r, settings.GREEDY)
    r.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    r.add_argument("--echo", action="store_true", help="print the prompt before the output")
    r.set_defaults(func=cmd_run)

    ch = sub.add_parser(
        "chat",
        help="talk with the model in the terminal (streaming, history, /reset; Ctrl-C stops an answer)",
    )
    settings.add_arguments(ch, settings.EngineSettings())
    settings.add_arguments(ch, settings.CHAT)
    ch.add_argument("-s", "--system", default=None, help="system message")
    ch.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template (text or file) instead of the model's",
    )
    ch.set_defaults(func=cmd_chat)

    sv = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models)",
    )
    settings.add_arguments(sv, settings.EngineSettings())
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument(
        "--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)"
    )
    sv.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $POWERINFER_API_KEY, else none)",
    )
    sv.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=4,
        help="generations run at once, round-robin; later requests queue in order (default 4)",
    )
    sv.add_argument(
        "--no-batch",
        action="store_true",
        help="evaluate each client's next token separately instead of in one batch (for comparison)",
    )
    sv.add_argument(
        "--prompt-cache",
        type=int,
        default=None,
        metavar="N",
        help="finished sessions kept so a prompt with the same beginning (next chat turn) is not evaluated again (default: --parallel; 0: off)",
    )
    sv.add_argument(
        "-n",
        "--n-predict",
        type=int,
        default=-1,
        metavar="N",
        help="the most tokens one answer has, when a request names no max_tokens or a larger one (default -1: no limit, an answer runs to an end token or a full context)",
    )
    sv.add_argument(
        "-a",
        "--alias",
        default=None,
        help="model id clients use (default: the file name without .gguf)",
    )
    sv.add_argument(
        "--ray",
        action="store_true",
        help="serve replicas under Ray Serve (pip install 'powerinfer-rs[ray]'), each with its own engine",
    )
    sv.add_argument(
        "--replicas",
        default="1",
        help="with --ray: replicas, or 'auto' to scale between 1 and --max-replicas (default 1)",
    )
    sv.add_argument(
        "--max-replicas", type=int, default=None, help="with --replicas auto: at most (default 4)"
    )
    sv.add_argument(
        "--address",
        default=None,
        help="with --ray: the Ray cluster to join (e.g. 10.0.0.5:6379, or 'auto'; default: a local Ray instance)",
    )
    sv.set_defaults(func=cmd_serve)

    i = sub.add_parser("info", help="show a GGUF file's metadata and tensors")
    i.add_argument("model_pos", nargs="?", metavar="MODEL")
    i.add_argument("-m", "--model", default=None)
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.set_defaults(
        func=lambda a: cmd_info(argparse.Namespace(model=a.model or a.model_pos, tensors=a.tensors))
    )

    q = sub.add_parser("perplexity", help="perplexity of a text file (llama.cpp's method)")
    settings.add_arguments(q, settings.EngineSettings())
    q.add_argument("-f", "--file", action="append", required=True, help="text file (repeatable)")
    q.add_argument("--ctx", type=int, default=512, help="window size (default 512)")
    q.add_argument("--chunks", type=int, default=None, help="score at most this many windows")
    q.set_defaults(func=cmd_perplexity)

    pr = sub.add_parser(
        "profile", help="count FFN neuron activations over text; save the predictor training set"
    )
    pr.add_argument("model_pos", nargs="?", metavar="MODEL")
    pr.add_argument(
        "-m", "--model", default=None, help="GGUF model (default: SmolLM2-135M-Instruct)"
    )
    pr.add_argument(
        "--corpus", nargs="+", required=True, help="text files or folders (*.txt, *.rst, *.md)"
    )
    pr.add_argument("--tokens", type=int, default=50_000, help="tokens to profile (default 50000)")
    pr.add_argument(
        "--train-tokens",
        type=int,
        default=0,
        help="also keep FFN inputs and labels of this many tokens for training",
    )
    pr.add_argument(
        "--target-sparsity",
        type=float,
        default=0.5,
        help="SwiGLU/GELU models: a neuron fires when threshold mode at this sparsity keeps it",
    )
    pr.add_argument(
        "--window", type=int, default=256, help="tokens per evaluation window (default 256)"
    )
    pr.add_argument("-t", "--threads", type=int, default=None)
    pr.add_argument(
        "-o", "--output", default=None, help="profile file (default <model>.profile.npz)"
    )
    pr.add_argument(
        "--plot", default=None, help="PNG of the frequency distribution (default <output>.png)"
    )
    pr.add_argument("--no-plot", action="store_true")
    pr.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    pr.set_defaults(func=cmd_profile)

    tr = sub.add_parser(
        "train-predictors", help="train per-layer activation predictors from a profile"
    )
    tr.add_argument("profile", help="profile written by `powerinfer-rs profile --train-tokens N`")
    tr.add_argument(
        "-o", "--output", default=None, help="predictor file (default <model>.predictors.npz)"
    )
    tr.add_argument("--report", default=None, help="per-layer table (default <output>.txt)")
    tr.add_argument(
        "--recall", type=float, default=0.9, help="recall each layer's cut-off keeps (default 0.9)"
    )
    tr.add_argument(
        "--efficiency",
        type=float,
        default=0.8,
        help="grow the hidden size until predicted/true sparsity reaches this (default 0.8)",
    )
    tr.add_argument(
        "--hidden", type=int, default=None, help="fixed hidden size (default: chosen per layer)"
    )
    tr.add_argument(
        "--model",
        default=None,
        help="the profiled model: size each predictor for the fewest bytes a token reads "
        "(its weights plus the rows it does not skip) instead of by --efficiency",
    )
    tr.add_argument(
        "--predictor-type",
        default="f16",
        choices=["f32", "f16", "q8_0", "q4_0"],
        help="with --model: the type `convert --predictor-type` will store the predictors in",
    )
    tr.add_argument("--min-hidden", type=int, default=32)
    tr.add_argument(
        "--max-hidden",
        type=int,
        default=None,
        help="default: largest power of two <= n_embd, at most 1024",
    )
    tr.add_argument(
        "--min-gain",
        type=float,
        default=0.02,
        help="stop doubling the hidden size when predicted sparsity grows less (default 0.02)",
    )
    tr.add_argument("--epochs", type=int, default=8)
    tr.add_argument("--batch", type=int, default=256)
    tr.add_argument("--lr", type=float, default=2e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument(
        "--device",
        default=None,
        help="train with PyTorch on this device (auto, cpu, cuda, cuda:N; the [relufy] extra) "
        "instead of numpy: the same steps, for a GPU",
    )
    tr.add_argument("-q", "--quiet", action="store_true")
    tr.set_defaults(func=cmd_train)

    cv = sub.add_parser(
        "convert",
        help="write a PowerInfer GGUF (PWRI) from a GGUF or safetensors folder plus predictors",
    )
    cv.add_argument(
        "source",
        help="plain GGUF file, or a Hugging Face folder with config.json and *.safetensors",
    )
    cv.add_argument("predictors", help="predictor file written by train-predictors")
    cv.add_argument(
        "-o", "--output", default=None, help="output (default <source>.powerinfer.gguf)"
    )
    cv.add_argument(
        "--outtype",
        choices=["f32", "f16", "q4_0", "q8_0"],
        default=None,
        help="convert weight matrices (default: keep the source types)",
    )
    cv.add_argument(
        "--down-type",
        choices=["source", "f32", "f16", "q4_0", "q8_0"],
        default=None,
        help="type of ffn_down_t (default: the source's for float models, Q8_0 for quantized ones)",
    )
    cv.add_argument(
        "--predictor-type",
        choices=["f32", "f16", "q4_0", "q8_0"],
        default="f16",
        help="predictor weights (default f16)",
    )
    cv.add_argument(
        "--sparse-threshold",
        type=float,
        default=None,
        help="powerinfer.sparse_threshold (default: median of the trained cut-offs)",
    )
    cv.set_defaults(func=cmd_convert)

    pk = sub.add_parser(
        "pack",
        help="tokenize text files into a compact shard for relufy (held-out files kept apart)",
    )
    _add_model_and_text(
        pk,
        "GGUF model whose tokenizer to use",
        "text files or folders (*.txt, *.rst, *.md, *.pod, *.html)",
        "files or folders held out for evaluation (default: a hashed share of the files)",
    )
    pk.add_argument(
        "--eval-fraction",
        type=float,
        default=0.05,
        help="share of files held out when --eval is not given (default 0.05)",
    )
    pk.add_argument(
        "--max-tokens", type=int, default=None, help="stop after this many training tokens"
    )
    pk.add_argument("-o", "--output", required=True, help="shard file (.npz)")
    pk.set_defaults(func=cmd_pack)

    rf = sub.add_parser(
        "relufy",
        help="train a SwiGLU model into a ReLU-family one whose FFN activations are mostly exactly zero (needs powerinfer-rs[relufy])",
    )
    _add_model_and_text(
        rf,
        "SwiGLU GGUF: llama, mistral, qwen2, qwen3",
        "text files or folders, or one shard written by `pack`",
        "files held out for evaluation (text corpora only)",
    )
    rf.add_argument("-o", "--output", required=True, help="relufied GGUF")
    rf.add_argument(
        "--outtype",
        choices=["f16", "q8_0", "q4_0", "f32"],
        default="f16",
        help="type of the 2-D weights (default f16)",
    )
    rf.add_argument(
        "--activation",
        choices=["reglu", "dreglu"],
        default="reglu",
        help="relu(gate)*up (default) or relu(gate)*relu(up)",
    )
    rf.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    rf.add_argument(
        "--tokens", type=int, default=None, help="train on this many tokens instead of --steps"
    )
    rf.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="as many steps as fit this time (timed on trial steps) instead of --steps",
    )
    rf.add_argument("--batch", type=int, default=8, help="windows per step (default 8)")
    rf.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    rf.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
    rf.add_argument(
        "--warmup", type=float, default=0.05, help="share of steps warming up (default 0.05)"
    )
    rf.add_argument(
        "--blend",
        type=float,
        default=0.3,
        help="share of steps over which SiLU turns into ReLU (default 0.3)",
    )
    rf.add_argument(
        "--l1",
        type=float,
        default=0.3,
        help="peak weight of the L1 penalty on FFN activations (default 0.3)",
    )
    rf.add_argument(
        "--l1-full",
        type=float,
        default=0.8,
        help="share of steps by which the L1 weight peaks (default 0.8)",
    )
    rf.add_argument(
        "--ce-weight",
        type=float,
        default=0.5,
        help="weight of cross-entropy beside the KL to the original (default 0.5)",
    )
    rf.add_argument("--weight-decay", type=float, default=0.01)
    rf.add_argument("--seed", type=int, default=0)
    rf.add_argument(
        "--qat",
        action="store_true",
        help="quantization-aware: train the weights --outtype (q8_0 or q4_0) will hold; a 4-bit "
        "file of a model relufied in float loses most of the training",
    )
    rf.add_argument(
        "--eval-tokens",
        type=int,
        default=16384,
        help="held-out tokens scored before and after (default 16384)",
    )
    rf.add_argument("--checkpoint", default=None, help="checkpoint file (default <output>.ckpt)")
    rf.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="steps between checkpoints (default a tenth of the run)",
    )
    rf.add_argument(
        "--resume", default=None, help="continue from this checkpoint (same model and settings)"
    )
    rf.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop (checkpointed) after this many steps of this call",
    )
    rf.add_argument("--report", default=None, help="JSON report (default <output>.relufy.json)")
    rf.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    rf.add_argument("--no-compile", action="store_true", help="no torch.compile on CUDA")
    rf.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for PyTorch")
    rf.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    rf.set_defaults(func=cmd_relufy)

    pl = sub.add_parser(
        "place",
        help="split FFN neurons between GPU and CPU under a VRAM budget (exact ILP solution)",
    )
    pl.add_argument("model_pos", nargs="?", metavar="MODEL")
    pl.add_argument("-m", "--model", default=None)
    pl.add_argument("--profile", required=True, help="profile written by `powerinfer-rs profile`")
    pl.add_argument("--vram-budget", required=True, help="e.g. 8GiB, 8000MB or a byte count")
    pl.add_argument(
        "-o", "--output", default=None, help="split file (default <model>.generated.gpuidx)"
    )
    pl.add_argument("--cpu-bandwidth", type=float, default=None, help="bytes/s (default: measured)")
    pl.add_argument(
        "--gpu-bandwidth",
        type=float,
        default=DEFAULT_GPU_BANDWIDTH,
        help=f"bytes/s (default {DEFAULT_GPU_BANDWIDTH:g})",
    )
    pl.add_argument(
        "--sync-latency",
        type=float,
        default=DEFAULT_SYNC_LATENCY,
        help=f"seconds per CPU-GPU synchronisation (default {DEFAULT_SYNC_LATENCY:g})",
    )
    pl.add_argument("--group", type=int, default=64, help="neurons per placement unit (default 64)")
    pl.add_argument(
        "--time-limit",
        type=float,
        default=10.0,
        help="time limit in seconds for HiGHS, used only when the exact search gives up (default 10)",
    )
    pl.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=None,
        help="context for the KV cache size (default min(trained, 4096))",
    )
    pl.add_argument(
        "--kv-type",
        choices=("f16", "f32"),
        default="f16",
        help="KV cache element type, as Engine.load's kv_type (default f16)",
    )
    pl.set_defaults(func=cmd_place)
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
    except ImportError as e:
        # an optional extra that is not installed (the message says which)
        if "pip install" not in str(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
