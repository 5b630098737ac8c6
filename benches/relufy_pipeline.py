"""The offline pipeline on a relufied model, measured: profile -> train-predictors -> convert ->
place, then predictor recall, the share of FFN neurons skipped, perplexity of held-out text, and
decode tok/s on the CPU (dense vs predictor mode, alternating runs, median) and, where CUDA is
there, on the GPU (the converted model wholly on the GPU vs the hybrid split the placement
chose). Everything in one process on one machine; the relufy report of the run that made the
model is merged in, and the whole written as JSON (`benches/results/relufy.json`'s layout).

    python benches/relufy_pipeline.py RELUFIED.gguf --report RELUFIED.relufy.json \\
        --corpus /usr/share/doc/python3.11/html/_sources --eval-text FILE_OR_DIR --out relufy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import numpy as np
from gpu_smollm2 import (  # benches/ is the script's folder: the same greedy decode timing
    decode_steps_ms,
    decode_tps,
)
from powerinfer_rs import Engine, _core, offline
from powerinfer_rs.offline.profiling import read_corpus
from powerinfer_rs.placement import model_bytes


def alternating(
    engines: list[Engine], prompt: list[int], n: int, repeats: int
) -> tuple[list[float], list[list[float]]]:
    """Medians of runs of the engines in turn, and per round each engine's tok/s over the
    first's."""
    runs: list[list[float]] = [[] for _ in engines]
    for _ in range(repeats):
        for e, r in zip(engines, runs):
            r.append(decode_tps(e, prompt, n))
    ratios = [[y / x for x, y in zip(runs[0], r)] for r in runs]
    return [statistics.median(r) for r in runs], ratios


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("POWERINFER_COMMIT", "unknown")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model", help="relufied GGUF (powerinfer-rs relufy)")
    ap.add_argument("--report", required=True, help="its relufy report (JSON)")
    ap.add_argument(
        "--corpus", required=True, nargs="+", help="text to profile (the training text)"
    )
    ap.add_argument("--eval-text", required=True, nargs="+", help="held-out text for perplexity")
    ap.add_argument("--out", required=True, help="JSON results")
    ap.add_argument(
        "--workdir",
        default=None,
        help="where the profile, predictors and converted model go (default beside --out)",
    )
    ap.add_argument("--tokens", type=int, default=60_000, help="tokens to profile")
    ap.add_argument(
        "--train-tokens",
        type=int,
        default=40_000,
        help="of them, tokens kept for predictor training",
    )
    ap.add_argument("--recall", type=float, default=0.95, help="recall target of the predictors")
    ap.add_argument("--eval-chars", type=int, default=40_000)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default all)")
    ap.add_argument(
        "--thread-sweep",
        default="16,8,4,2,1",
        help="thread counts (those up to the CPU count) at which the three CPU decodes are "
        "timed again, 3 alternating rounds each: on many cores a small model's decode is bound "
        "by fork/joins, and the sweep shows where (default 16,8,4,2,1; '' for none)",
    )
    ap.add_argument(
        "--gpu-share",
        type=float,
        default=0.5,
        help="hybrid: share of the FFN neuron bytes the VRAM budget holds",
    )
    ap.add_argument(
        "--source",
        default=None,
        help="the model before relufication, for its perplexity on the same text",
    )
    ap.add_argument(
        "--device",
        default="auto",
        help="where the predictors train: PyTorch on auto/cpu/cuda, or 'numpy' (default auto)",
    )
    ap.add_argument(
        "--cutoff-sparsity",
        type=float,
        default=0.85,
        help="share of neurons a calibrated positive cut-off on the ReLU skips (threshold mode)",
    )
    ap.add_argument(
        "--predictor-type",
        default="q8_0",
        choices=["f32", "f16", "q8_0", "q4_0"],
        help="the predictors' weight type in the converted file (default q8_0: half F16's bytes, "
        "the same selections on SmolLM2; PowerInfer's own files carry f16)",
    )
    ap.add_argument(
        "--size-by",
        default="sparsity",
        choices=["bytes", "sparsity"],
        help="predictor hidden sizes: train's efficiency rule (default), or the fewest bytes a "
        "token reads (train-predictors --model)",
    )
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="keep the profile, predictors and converted model of an earlier run in --workdir",
    )
    a = ap.parse_args()
    if a.device == "numpy":
        a.device = None
    work = a.workdir or os.path.join(os.path.dirname(os.path.abspath(a.out)), "relufy-pipeline")
    os.makedirs(work, exist_ok=True)
    with open(a.report) as fh:
        report = json.load(fh)
    prof_path, pred_path = (
        os.path.join(work, "relufied.profile.npz"),
        os.path.join(work, "relufied.predictors.npz"),
    )
    pw_path = os.path.join(work, "relufied.powerinfer.gguf")
    seconds = {}

    dense_src = Engine.load(a.model, n_ctx=a.ctx, device="cpu", sparsity="dense", threads=a.threads)
    if not (a.reuse and os.path.exists(pw_path)):
        t = time.perf_counter()
        offline.profile(
            dense_src,
            a.corpus,
            tokens=a.tokens,
            train_tokens=a.train_tokens,
            window=a.ctx,
            output=prof_path,
            plot=os.path.join(work, "relufied.power_law.png"),
            progress=False,
        )
        seconds["profile"] = time.perf_counter() - t
        t = time.perf_counter()
        trained = offline.train(
            prof_path,
            output=pred_path,
            recall_target=a.recall,
            progress=False,
            device=a.device,
            # --size-by bytes: each predictor as wide as reads the fewest bytes
            model=a.model if a.size_by == "bytes" else None,
            predictor_type=a.predictor_type,
        )
        print(trained["table"], flush=True)
        seconds["train_predictors"] = time.perf_counter() - t
        t = time.perf_counter()
        offline.convert(a.model, pred_path, output=pw_path, predictor_type=a.predictor_type)
        seconds["convert"] = time.perf_counter() - t
    prof = offline.load_profile(prof_path)

    text = read_corpus(a.eval_text, max_chars=a.eval_chars)
    ppl_source = (
        Engine.load(
            a.source, n_ctx=a.ctx, device="cpu", sparsity="dense", threads=a.threads
        ).perplexity(text, ctx=a.ctx)
        if a.source
        else None
    )
    ppl_dense = dense_src.perplexity(text, ctx=a.ctx)
    sparse = Engine.load(
        pw_path,
        n_ctx=a.ctx,
        device="cpu",
        sparsity="predictor",
        predictor_recall=True,
        threads=a.threads,
    )
    ppl_predictor = sparse.perplexity(text, ctx=a.ctx)
    recall, skipped = (
        sparse.last_stats.get("predictor_recall"),
        sparse.last_stats.get("ffn_sparsity"),
    )
    print(
        f"perplexity dense {ppl_dense:.3f}, predictor mode {ppl_predictor:.3f}; recall {recall:.3f}, skipped {skipped:.3f}",
        flush=True,
    )

    # a positive cut-off on the ReLU at inference (FATReLU, ProSparse's last step, training-free):
    # threshold mode calibrated on the profile text for `--cutoff-sparsity` of the neurons skipped
    cut = Engine.load(
        a.model,
        n_ctx=512,
        device="cpu",
        sparsity="threshold",
        target_sparsity=a.cutoff_sparsity,
        calibration_text=read_corpus(a.corpus, max_chars=20_000),
        threads=a.threads,
    )
    ppl_cutoff = cut.perplexity(text, ctx=a.ctx)
    skipped_cutoff = cut.last_stats.get("ffn_sparsity")
    print(
        f"cut-off for {a.cutoff_sparsity:.0%} skipped: perplexity {ppl_cutoff:.3f}, skipped {skipped_cutoff:.3f}",
        flush=True,
    )

    prompt = dense_src.tokenize("Python is an easy to learn, powerful programming language. It has")
    # three ways to decode the relufied model on the CPU: every row read (the plain file, as a
    # SwiGLU model decodes), dense with the exact ReLU skip (the converted file without its
    # predictors: every gate row, up and down rows only where the gate is positive), and
    # predictor mode (gate rows only of the neurons the predictor selects)
    cpu_all_rows_engine = Engine.load(
        a.model, n_ctx=512, device="cpu", sparsity="dense", threads=a.threads
    )
    cpu_dense_engine = Engine.load(
        pw_path, n_ctx=512, device="cpu", sparsity="dense", threads=a.threads
    )
    cpu_sparse_engine = Engine.load(
        pw_path, n_ctx=512, device="cpu", sparsity="predictor", threads=a.threads
    )
    (r, d, s, c), (_, skip_ratios, ratios_all, cut_ratios) = alternating(
        [cpu_all_rows_engine, cpu_dense_engine, cpu_sparse_engine, cut],
        prompt,
        a.decode_tokens,
        a.repeats,
    )
    ratios = [y / x for x, y in zip(skip_ratios, ratios_all)]
    decode = {
        "cpu_all_rows": r,
        "cpu_dense": d,
        "cpu_predictor": s,
        "cpu_ratio_median": statistics.median(ratios),
        "cpu_ratio_range": [min(ratios), max(ratios)],
        "cpu_dense_over_all_rows": statistics.median(skip_ratios),
        "cpu_predictor_over_all_rows": statistics.median(ratios_all),
        "cpu_cutoff": c,
        "cpu_cutoff_over_all_rows": statistics.median(cut_ratios),
    }
    print(
        f"CPU decode every row {r:.1f} tok/s, dense with the exact ReLU skip {d:.1f} "
        f"({statistics.median(skip_ratios):.2f}x), predictor {s:.1f} "
        f"({statistics.median(ratios):.2f}x dense, {statistics.median(ratios_all):.2f}x every row), "
        f"cut-off {c:.1f} ({statistics.median(cut_ratios):.2f}x every row)",
        flush=True,
    )

    # the same three at each thread count of the sweep
    by_threads = {}
    cpus = os.cpu_count() or 1
    for t in sorted({int(v) for v in a.thread_sweep.split(",") if v.strip()}, reverse=True):
        if not 1 <= t <= cpus:
            continue
        three = [
            Engine.load(path, n_ctx=512, device="cpu", sparsity=mode, threads=t)
            for path, mode in ((a.model, "dense"), (pw_path, "dense"), (pw_path, "predictor"))
        ]
        (r_t, d_t, s_t), (_, skip_t, pred_t) = alternating(three, prompt, a.decode_tokens, 3)
        # where each way's token goes at this thread count
        steps = {
            name: decode_steps_ms(e, prompt, a.decode_tokens)
            for name, e in zip(("all_rows", "dense", "predictor"), three)
        }
        by_threads[str(t)] = {
            "all_rows": r_t,
            "dense": d_t,
            "predictor": s_t,
            "predictor_over_dense": statistics.median([y / x for x, y in zip(skip_t, pred_t)]),
            "steps_ms_per_token": steps,
        }
        print(
            f"  {t} threads: every row {r_t:.1f}, exact ReLU skip {d_t:.1f}, predictor {s_t:.1f} "
            f"tok/s ({by_threads[str(t)]['predictor_over_dense']:.2f}x dense)",
            flush=True,
        )
        for name, ms in steps.items():
            top = sorted(ms.items(), key=lambda kv: -kv[1])[:4]
            print(
                f"    {name}: {sum(ms.values()):.3f} ms per token, "
                + ", ".join(f"{k} {v:.3f}" for k, v in top),
                flush=True,
            )
        del three
    decode["cpu_by_threads"] = by_threads

    gpu_name = None
    try:
        devices = _core.cuda_devices()
    except _core.CudaUnavailableError:
        devices = []
    if devices:
        gpu_name = devices[0].get("name")
        mb = model_bytes(pw_path, 512)
        budget = int(
            sum(mb.layer_dense_bytes)
            + mb.kv_cache_bytes
            + mb.output_bytes
            + a.gpu_share * mb.n_ff * float(np.sum(mb.neuron_bytes))
        )
        t = time.perf_counter()
        # sized for the KV cache of the engines below (n_ctx 512), as Engine.load sizes it
        placed = offline.place(pw_path, prof_path, vram_budget=budget, n_ctx=512)
        seconds["place"] = time.perf_counter() - t
        full = Engine.load(pw_path, n_ctx=512, device="cuda")
        hybrid = Engine.load(
            pw_path, n_ctx=512, device="cuda", vram_budget=budget, profile=prof_path
        )
        (f, h), _ = alternating([full, hybrid], prompt, a.decode_tokens, a.repeats)
        decode.update(
            {
                "gpu_full": f,
                "gpu_hybrid": h,
                "gpu_hybrid_neuron_fraction": hybrid.gpu_report()["hot_neuron_fraction"],
                "placement": {
                    "solver": placed.solution.method,
                    "status": placed.solution.status,
                    "hot_share": [float(v) for v in placed.hot_share],
                },
            }
        )
        print(f"GPU decode whole model {f:.1f} tok/s, hybrid {h:.1f} tok/s", flush=True)

    result = {
        "commit": commit(),
        "gpu": gpu_name,
        "cpu_threads": cpu_dense_engine.n_threads,
        **{
            k: report.get(k)
            for k in (
                "activation",
                "hyperparameters",
                "train_tokens",
                "train_minutes",
                "device",
                "sparsity",
                "sparsity_per_layer",
                "ppl_original",
                "ppl_relufied",
                "ppl_original_engine",
                "ppl_relufied_engine",
                "kl_relufied",
                "eval_text",
                "curve",
            )
        },
        "predictor_recall": recall,
        "predictor_recall_target": a.recall,
        "skipped": skipped,
        "eval_chars": len(text),
        "ppl_eval_source": ppl_source,
        "ppl_eval_dense": ppl_dense,
        "ppl_eval_predictor": ppl_predictor,
        "cutoff_sparsity_target": a.cutoff_sparsity,
        "ppl_eval_cutoff": ppl_cutoff,
        "skipped_cutoff": skipped_cutoff,
        "profiled_fire_share": float(
            prof["counts"].sum() / (prof["n_tokens"] * prof["counts"].size)
        ),
        "predictors": {
            "size_by": a.size_by,
            "type": a.predictor_type,
            "hidden": [int(f.shape[0]) for f in offline.load_predictors(pred_path)["fc1"]],
        },
        "decode_tps": decode,
        "pipeline_seconds": seconds,
    }
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
