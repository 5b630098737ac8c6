"""The offline pipeline end to end on SmolLM2-135M: profile -> train-predictors -> convert -> run
in predictor mode, measured against dense.

Profiling text and evaluation text are disjoint parts of Debian's python3.11-doc: the profile
reads the documentation's sources from the start (sorted paths: c-api, extending, faq, ...); the
evaluation reads `tutorial/`. Reported:

- recall and predicted sparsity of the stored predictors on the evaluation text, against the
  labels the profiler defines (threshold mode's rule at the profile's target sparsity), computed
  in numpy from the dense model's captured FFN inputs and the predictors as stored (F16);
- the fraction of FFN neurons the engine skips in predictor mode;
- perplexity of the source model (dense), the converted model (dense) and the converted model in
  predictor mode;
- decode tokens/s of predictor mode vs dense on the converted model (alternating runs, median).

    python benches/offline_smollm2.py [--tokens 24000] [--train-tokens 20000] [--workdir /tmp/pi-offline]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from powerinfer_rs import Engine, offline
from powerinfer_rs.models import default_model_path
from powerinfer_rs.offline import training
from powerinfer_rs.offline.profiling import captured_windows

DOCS = "/usr/share/doc/python3.11/html/_sources"


def predictor_quality(
    engine: Engine, text_ids: list[int], prof: dict, preds: dict, window: int = 256
) -> tuple[float, float]:
    """Recall and predicted sparsity over every layer and token of `text_ids`."""
    s = engine._session(window)
    s.set_sparsity("dense")
    tp = pos = kept = total = 0
    fc1 = [a.astype(np.float16).astype(np.float32) for a in preds["fc1"]]
    fc2 = [b.astype(np.float16).astype(np.float32) for b in preds["fc2"]]
    for _, x, scores in captured_windows(s, text_ids, window):
        for l in range(x.shape[0]):
            labels = scores[l] > prof["thresholds"][l]
            pred = training.predictor_logits(x[l], fc1[l], fc2[l]) >= preds["thresholds"][l]
            tp += int((pred & labels).sum())
            pos += int(labels.sum())
            kept += int(pred.sum())
            total += pred.size
    return tp / max(pos, 1), 1.0 - kept / max(total, 1)


def decode_tps(engine: Engine, prompt: str, n: int) -> float:
    engine.generate(prompt, max_tokens=n, temperature=0.0)
    return engine.last_stats["decode_tps"]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=24000)
    ap.add_argument("--train-tokens", type=int, default=20000)
    ap.add_argument("--target-sparsity", type=float, default=0.5)
    ap.add_argument("--recall", type=float, default=0.9)
    ap.add_argument("--workdir", default="/tmp/pi-offline")
    ap.add_argument("--eval-chars", type=int, default=20000)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--reuse", action="store_true", help="reuse profile/predictors/model in workdir"
    )
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    src = default_model_path()
    prof_path = os.path.join(a.workdir, "smollm2.profile.npz")
    pred_path = os.path.join(a.workdir, "smollm2.predictors.npz")
    out_path = os.path.join(a.workdir, "smollm2.powerinfer.gguf")

    t0 = time.perf_counter()
    if not (a.reuse and os.path.exists(prof_path)):
        offline.profile(
            Engine.load(src, n_ctx=256, device="cpu"),
            DOCS,
            tokens=a.tokens,
            train_tokens=a.train_tokens,
            target_sparsity=a.target_sparsity,
            output=prof_path,
            progress=True,
        )
    t_prof = time.perf_counter() - t0
    t0 = time.perf_counter()
    if not (a.reuse and os.path.exists(pred_path)):
        r = offline.train(prof_path, output=pred_path, recall_target=a.recall)
        print(r["table"])
    t_train = time.perf_counter() - t0
    t0 = time.perf_counter()
    if not (a.reuse and os.path.exists(out_path)):
        offline.convert(src, pred_path, output=out_path)
    t_conv = time.perf_counter() - t0
    print(f"profile {t_prof:.0f} s, train {t_train:.0f} s, convert {t_conv:.0f} s")

    prof = offline.load_profile(prof_path)
    preds = offline.load_predictors(pred_path)
    text = offline.profiling.read_corpus(os.path.join(DOCS, "tutorial"), max_chars=a.eval_chars)

    dense_src = Engine.load(src, sparsity="dense", device="cpu")
    dense_conv = Engine.load(out_path, sparsity="dense", device="cpu")
    sparse_conv = Engine.load(out_path, sparsity="predictor", device="cpu")
    ids = dense_src.tokenizer.encode(text)
    recall, pred_sparsity = predictor_quality(dense_conv, ids, prof, preds, a.ctx)

    ppl_src = dense_src.perplexity(text, ctx=a.ctx)
    ppl_dense = dense_conv.perplexity(text, ctx=a.ctx)
    ppl_sparse = sparse_conv.perplexity(text, ctx=a.ctx)
    skipped = sparse_conv.last_stats.get("ffn_sparsity", float("nan"))

    prompt = "Python is an easy to learn, powerful programming language. It has"
    ratios, d_all, s_all = [], [], []
    for _ in range(a.repeats):
        d = decode_tps(dense_conv, prompt, a.decode_tokens)
        s = decode_tps(sparse_conv, prompt, a.decode_tokens)
        d_all.append(d)
        s_all.append(s)
        ratios.append(s / d)

    print(f"\nevaluation text: python3.11-doc tutorial/, {len(ids)} tokens, ctx {a.ctx}")
    print(
        f"labels: threshold rule at sparsity {prof['target_sparsity']:.2f}; predictor recall target {a.recall:.2f}"
    )
    print("| measure | value |\n|---|---|")
    print(f"| predictor recall (eval text) | {recall:.3f} |")
    print(f"| predicted sparsity (eval text) | {pred_sparsity:.3f} |")
    print(f"| FFN neurons skipped by the engine | {skipped:.3f} |")
    print(f"| perplexity, source GGUF dense | {ppl_src:.3f} |")
    print(f"| perplexity, converted dense | {ppl_dense:.3f} ({ppl_dense / ppl_src - 1:+.1%}) |")
    print(
        f"| perplexity, converted predictor mode | {ppl_sparse:.3f} ({ppl_sparse / ppl_dense - 1:+.1%} vs converted dense) |"
    )
    print(
        f"| decode tok/s dense / predictor | {statistics.median(d_all):.1f} / {statistics.median(s_all):.1f} |"
    )
    print(
        f"| decode ratio predictor / dense (median of {a.repeats} pairs) | {statistics.median(ratios):.2f}x "
        f"(range {min(ratios):.2f}-{max(ratios):.2f}) |"
    )


if __name__ == "__main__":
    main()
