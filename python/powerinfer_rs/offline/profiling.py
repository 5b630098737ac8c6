"""Activation profiler: runs the engine densely over text and records, per layer, how often each
FFN neuron fires, and optionally the predictor training set (each token's FFN input and which
neurons fired), into one `.npz` file that `train` and `place` read. It also draws the sorted
activation frequencies of every layer (log scale), the picture of the power law.

"Fires" follows the model: for ReLU-family FFNs (ReLU, ReGLU, dReLU) a neuron fires when its
activation is nonzero; SwiGLU and GELU never give exact zeros, so there a neuron fires when
threshold mode would keep it at `target_sparsity`: |act(gate)| above the layer's quantile,
calibrated on the first tokens of the same text.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ..profile_file import PROFILE_VERSION, activation_frequencies, save_profile
from .packing import read_text, text_files

EXACT_ZERO_ACTIVATIONS = ("reglu", "dreglu", "relu")


def read_corpus(paths: list[str] | str, max_chars: int | None = None) -> str:
    """The text of `paths` (files, or folders searched for text files in sorted order, see
    `pack.text_files`) joined by blank lines, stopping once `max_chars` characters are read."""
    parts, total = [], 0
    for f in text_files(paths):
        text = read_text(f)
        parts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    text = "\n\n".join(parts)
    return text[:max_chars] if max_chars is not None else text


def profile(
    engine,
    corpus: list[str] | str,
    tokens: int = 50_000,
    output: str | None = None,
    train_tokens: int = 0,
    target_sparsity: float = 0.5,
    window: int = 256,
    plot: str | bool | None = True,
    progress: bool = True,
) -> dict:
    """Profiles the model of `engine` (an `Engine` on the CPU in dense mode, with a context of
    at least `window`) on up to `tokens` tokens of `corpus`, keeping the FFN inputs and labels
    of the first `train_tokens` of them for predictor training. A mixture-of-experts model's
    profile counts how often each layer routes a token to each expert instead (`unit` =
    "expert"; no training set). Writes `output` (default
    `<model>.profile.npz`) and, unless `plot` is False, a PNG (default `<output>.png`).
    Returns the profile as a dict (see `profile_file.load_profile`)."""
    for name, v in (("tokens", tokens), ("window", window)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 2:
            raise ValueError(f"{name} must be an int >= 2, got {v!r}")
    if not isinstance(train_tokens, int) or isinstance(train_tokens, bool) or train_tokens < 0:
        raise ValueError(f"train_tokens must be an int >= 0, got {train_tokens!r}")
    if not (isinstance(target_sparsity, (int, float)) and 0.0 <= target_sparsity < 1.0):
        raise ValueError(f"target_sparsity must be in [0, 1), got {target_sparsity!r}")
    # capturing FFN inputs and scores is a CPU feature, and it records the dense pass
    if getattr(engine, "device", None) != "cpu" or getattr(engine, "sparsity", None) != "dense":
        raise ValueError("profile() needs an engine loaded with device='cpu' and sparsity='dense'")
    if window > engine.n_ctx:
        raise ValueError(
            f"window {window} is longer than the engine's context ({engine.n_ctx}); load it with n_ctx >= {window}"
        )
    cfg = engine.config
    n_layer, n_embd, n_ff = cfg["n_layer"], cfg["n_embd"], cfg["n_ff"]
    activation = cfg["ffn_activation"]

    # about 3 characters per token is a generous bound for English and code
    text = read_corpus(corpus, max_chars=tokens * 6)
    ids = engine.tokenizer.encode(text)[:tokens]
    if len(ids) < 2:
        raise ValueError("the corpus gives fewer than 2 tokens")
    train_tokens = min(train_tokens, len(ids))

    session = engine._session(window)
    if cfg.get("experts"):
        counts, seen = _count_experts(session, ids, window, progress)
        result = {
            "version": PROFILE_VERSION,
            "model": os.path.basename(engine.path),
            "architecture": cfg["architecture"],
            "activation": activation,
            "unit": "expert",
            "n_tokens": seen,
            "n_ff": cfg["experts"]["n_ff_exp"],
            "n_embd": n_embd,
            "n_expert_used": cfg["experts"]["n_expert_used"],
            "target_sparsity": float("nan"),
            "thresholds": np.zeros(n_layer, dtype=np.float32),
            "counts": counts,
            # (predictors choose neurons, not experts: no training set)
            "train_x": np.zeros((n_layer, 0, n_embd), dtype=np.float16),
            "train_labels": np.zeros((n_layer, 0, (counts.shape[1] + 7) // 8), dtype=np.uint8),
        }
        return _save(result, engine, output, plot)
    if activation in EXACT_ZERO_ACTIVATIONS:
        thresholds = np.zeros(n_layer, dtype=np.float32)
    else:
        calib = ids[: max(2, min(len(ids), 16 * window))]
        thresholds = np.array(
            session.calibrate(calib, window, [float(target_sparsity)])[0], dtype=np.float32
        )

    counts = np.zeros((n_layer, n_ff), dtype=np.int64)
    train_x = np.zeros((n_layer, train_tokens, n_embd), dtype=np.float16)
    train_labels = np.zeros((n_layer, train_tokens, (n_ff + 7) // 8), dtype=np.uint8)
    seen = 0
    bar = _progress(len(ids), progress)
    try:
        for n, inputs, scores in captured_windows(session, ids, window):
            fired = scores > thresholds[:, None, None]  # (n_layer, n, n_ff)
            counts += fired.sum(axis=1)
            keep = min(n, train_tokens - seen) if seen < train_tokens else 0
            if keep > 0:
                train_x[:, seen : seen + keep] = inputs[:, :keep]
                train_labels[:, seen : seen + keep] = np.packbits(fired[:, :keep], axis=-1)
            seen += n
            bar.update(n)
    finally:
        bar.close()

    result = {
        "version": PROFILE_VERSION,
        "model": os.path.basename(engine.path),
        "architecture": cfg["architecture"],
        "activation": activation,
        "n_tokens": seen,
        "n_ff": n_ff,
        "n_embd": n_embd,
        "target_sparsity": float(target_sparsity)
        if activation not in EXACT_ZERO_ACTIVATIONS
        else float("nan"),
        "thresholds": thresholds,
        "counts": counts,
        "train_x": train_x[:, : min(train_tokens, seen)],
        "train_labels": train_labels[:, : min(train_tokens, seen)],
    }
    return _save(result, engine, output, plot)


def _save(result: dict, engine, output: str | None, plot) -> dict:
    output = output or engine.path + ".profile.npz"
    save_profile(output, result)
    result["path"] = output
    if plot:
        result["plot"] = plot_frequencies(
            result, plot if isinstance(plot, str) else output + ".png"
        )
    return result


def _count_experts(session, ids: list[int], window: int, progress: bool):
    """A mixture-of-experts model's routing over `ids`, evaluated densely in windows as
    `captured_windows` does: (counts (n_layer, n_expert) of the tokens each layer routed to
    each expert, tokens evaluated)."""
    session.take_expert_counts()
    counts, seen = None, 0
    bar = _progress(len(ids), progress)
    try:
        for n in _evaluated_windows(session, ids, window):
            c = session.take_expert_counts().astype(np.int64)
            counts = c if counts is None else counts + c
            seen += n
            bar.update(n)
    finally:
        bar.close()
    return counts, seen


def _evaluated_windows(session, ids: list[int], window: int):
    """Evaluates `ids` in windows of `window` tokens, each from an empty context (a one-token
    tail is dropped), yielding each window's length after evaluating it."""
    for start in range(0, len(ids), window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        session.truncate(0)
        session.eval(chunk)
        yield len(chunk)


def captured_windows(session, ids: list[int], window: int):
    """Evaluates `ids` densely in windows (each from an empty context; a one-token tail is
    dropped) and yields (n_tokens, inputs, scores) per window, as `Session.take_capture` gives
    them."""
    session.set_capture(True)
    try:
        for n in _evaluated_windows(session, ids, window):
            inputs, scores = session.take_capture()
            yield n, inputs, scores
    finally:
        session.set_capture(False)


def _progress(total: int, enabled: bool, desc: str = "profiling", unit: str = "tok"):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: count silently without it
        enabled = False
    if not enabled:

        class _Silent:
            def update(self, n: int) -> None: ...
            def close(self) -> None: ...

        return _Silent()
    return tqdm(total=total, unit=unit, desc=desc, smoothing=0.1)


def plot_frequencies(p: dict, path: str) -> str:
    """Sorted activation frequency per layer on a log scale (left) and the share of all
    activations that the most frequent neurons carry (right); for an expert profile, the
    same of how often each expert is routed to."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    freq = np.stack(activation_frequencies(p))
    n_layer, n_ff = freq.shape
    unit = "expert" if p.get("unit") == "expert" else "neuron"
    what = "expert routing" if unit == "expert" else "FFN activation"
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    cmap = plt.get_cmap("viridis")
    rank = np.arange(1, n_ff + 1) / n_ff
    for l in range(n_layer):
        f = np.sort(freq[l])[::-1]
        color = cmap(l / max(n_layer - 1, 1))
        a.plot(rank, np.maximum(f, 1.0 / max(p["n_tokens"], 1) / 2), color=color, lw=0.9)
        total = f.sum()
        if total > 0:
            b.plot(rank, np.cumsum(f) / total, color=color, lw=0.9)
    a.set_yscale("log")
    a.set_xlabel(f"{unit} rank (fraction of the layer, most frequent first)")
    a.set_ylabel(f"{'routing' if unit == 'expert' else 'activation'} frequency")
    a.set_title(f"{p.get('model', '')}: sorted {what} frequency per layer")
    b.plot([0, 1], [0, 1], color="grey", ls="--", lw=0.8)
    b.set_xlabel(f"fraction of {unit}s (most frequent first)")
    b.set_ylabel(f"share of all {'routings' if unit == 'expert' else 'activations'}")
    b.set_title(f"{p['n_tokens']} tokens; colour = layer (dark first)")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, n_layer - 1))
    fig.colorbar(sm, ax=b, label="layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def layer_stats(p: dict) -> list[dict]:
    """Per layer: mean sparsity (share of neurons, or experts, not firing per token) and skew
    (share of activations, or routings, carried by the most frequent 10% of them)."""
    out = []
    counts = np.asarray(p["counts"], dtype=np.float64)
    for c in counts:
        total = c.sum()
        top = np.sort(c)[::-1][: max(1, math.ceil(0.1 * len(c)))]
        out.append(
            {
                "sparsity": 1.0 - total / (len(c) * max(p["n_tokens"], 1)),
                "skew": float(top.sum() / total) if total > 0 else 0.0,
            }
        )
    return out
