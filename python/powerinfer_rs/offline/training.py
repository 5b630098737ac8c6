"""Predictor training: one small MLP per layer, `logits = fc2 @ relu(fc1 @ x)` with no biases
(PowerInfer's layout), trained with numpy on the profile's training set, or with PyTorch
(`device="cuda"`, `"cpu"` or `"auto"`: the same steps, initial weights and batches, as tensors,
for a GPU).

- Loss: binary cross-entropy on sigmoid(logits), positives weighted by the layer's ratio of
  non-firing to firing neurons (capped), AdamW, mini-batches, cosine learning-rate decay.
- Inputs are scaled per feature by their RMS while training; the scale is folded into fc1
  afterwards, so the stored predictor reads the raw residual stream.
- Hidden size per layer: starts from a base size (n_embd / 4 rounded to a power of two), halved
  for skewed layers (where the most frequent 10% of neurons carry most activations, which a
  small predictor learns), then doubled while the predictor's efficiency (predicted sparsity at
  the recall target, divided by the true sparsity) stays under `efficiency_target` and the
  last doubling still bought at least `min_gain` of predicted sparsity; never above
  `max_hidden` (default: the largest power of two <= n_embd, at most 1024), since a predictor
  as wide as the model's hidden size costs about what it saves.
- Or, given the model (`model=`), the hidden size that makes a token read the fewest bytes in
  the layer: the predictor's own weights (in the type `convert` will store them) plus the rows
  of the neurons it does not skip that a skip would save (`PredictorCost`), tried from
  `min_hidden` up, doubling while that falls. On a small model a wide predictor costs more
  than it saves (SmolLM2: 128 x (576 + 1536) weights against 1536 gate rows of 576).
- Cut-off per layer: the largest logit threshold that still keeps `recall_target` of the firing
  neurons on held-out tokens, i.e. the most sparsity that recall allows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from ..profile_file import load_profile, require_neurons
from .profiling import _progress, layer_stats


@dataclass
class PredictorCost:
    """What a predictor costs and saves a token in each layer, in bytes: its weights
    (`weight_bytes` each, in the type `convert` stores them in) and, per neuron it skips, the
    rows the engine then does not read (`skip_bytes[layer]`)."""

    weight_bytes: float
    skip_bytes: list[float]

    def relative_bytes(
        self, layer: int, hidden: int, n_embd: int, n_ff: int, predicted_sparsity: float
    ) -> float:
        """The layer's bytes with this predictor over its bytes without one (< 1: it pays)."""
        without = n_ff * self.skip_bytes[layer]
        own = self.weight_bytes * hidden * (n_embd + n_ff)
        return (own + (1.0 - predicted_sparsity) * without) / without


def predictor_cost(model: str, predictor_type: str = "f16") -> PredictorCost:
    """The bytes of `model`'s FFN rows a skipped neuron saves, per layer: its gate row where
    the gate decides (ReGLU, dReLU: the engine already skips the up and down rows of a neuron
    whose gate is not positive), else its gate and up rows and its down column; and the bytes
    of a predictor weight in `predictor_type` (f32, f16, q8_0 or q4_0)."""
    import gguf

    from .. import _core

    per_weight = {"f32": 4.0, "f16": 2.0}
    if predictor_type in ("q8_0", "q4_0"):
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[predictor_type.upper()]]
        per_weight[predictor_type] = size / block
    if predictor_type not in per_weight:
        raise ValueError(
            f"unknown predictor type {predictor_type!r}: choose one of f32, f16, q8_0, q4_0"
        )
    m = _core.Model(model)
    cfg = m.config()
    gate_decides = cfg.get("ffn_activation") in ("reglu", "dreglu")
    sizes = {t["name"]: t["n_bytes"] for t in m.tensors()}
    n_ff = int(cfg["n_ff"])
    skip = []
    for l in range(int(cfg["n_layer"])):
        mats = ("ffn_gate",) if gate_decides else ("ffn_gate", "ffn_up", "ffn_down")
        names = [f"blk.{l}.{k}.weight" for k in mats]
        if any(n not in sizes for n in names):
            raise ValueError(
                f"{model}: layer {l} has no {' / '.join(mats)} matrices to skip rows of"
            )
        skip.append(sum(sizes[n] for n in names) / n_ff)
    return PredictorCost(per_weight[predictor_type], skip)


@dataclass
class LayerResult:
    layer: int
    hidden: int
    threshold: float
    recall: float
    precision: float
    predicted_sparsity: float
    true_sparsity: float
    tried: list[int]
    seconds: float
    # with a model: the layer's bytes with the predictor over without one, for the size kept
    # and for each size tried
    relative_bytes: float | None = None
    tried_bytes: list[float] | None = None


def _pow2(x: float) -> int:
    return 1 << max(0, int(round(math.log2(max(x, 1.0)))))


def initial_hidden(n_embd: int, skew: float, min_hidden: int, max_hidden: int) -> int:
    base = _pow2(n_embd / 4)
    if skew > 0.8:
        base //= 4
    elif skew > 0.5:
        base //= 2
    return int(min(max(base, min_hidden), max_hidden))


def fit_layer(
    x: np.ndarray,
    y: np.ndarray,
    hidden: int,
    epochs: int = 8,
    batch: int = 256,
    lr: float = 2e-3,
    weight_decay: float = 1e-4,
    seed: int = 0,
    device: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Trains fc1 (hidden, d) and fc2 (n_ff, hidden) on inputs x (N, d) and 0/1 labels y
    (N, n_ff), float32. Returns the weights for raw (unscaled) inputs. `device` None trains
    with numpy, else with PyTorch on that device ("auto": CUDA where there is one)."""
    if device is not None:
        return _fit_layer_torch(x, y, hidden, epochs, batch, lr, weight_decay, seed, device)
    rng = np.random.default_rng(seed)
    n, d = x.shape
    n_ff = y.shape[1]
    scale = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=0)).astype(np.float32) + 1e-6
    xs = x / scale
    p = float(y.mean())
    pos_weight = np.float32(min((1.0 - p) / max(p, 1e-6), 50.0)) if 0 < p < 1 else np.float32(1.0)

    w1 = (rng.standard_normal((hidden, d)) * math.sqrt(2.0 / d)).astype(np.float32)
    w2 = (rng.standard_normal((n_ff, hidden)) * math.sqrt(1.0 / hidden)).astype(np.float32)
    params = [w1, w2]
    m = [np.zeros_like(w) for w in params]
    v = [np.zeros_like(w) for w in params]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    steps_per_epoch = max(1, n // batch)
    total = epochs * steps_per_epoch
    step = 0
    for _ in range(epochs):
        perm = rng.permutation(n)
        for b in range(steps_per_epoch):
            idx = perm[b * batch : (b + 1) * batch]
            xb, yb = xs[idx], y[idx]
            # forward: z (B, H) -> a = relu(z) -> logits (B, n_ff)
            z = xb @ w1.T
            a = np.maximum(z, 0)
            logits = a @ w2.T
            prob = 1.0 / (1.0 + np.exp(-np.clip(logits, -30, 30)))
            # d loss / d logits for -[w y log s + (1 - y) log(1 - s)], averaged
            g = (prob * (pos_weight * yb + 1.0 - yb) - pos_weight * yb) / np.float32(
                len(idx) * n_ff
            )
            gw2 = g.T @ a
            ga = g @ w2
            ga *= z > 0
            gw1 = ga.T @ xb
            step += 1
            rate = lr * 0.5 * (1.0 + math.cos(math.pi * step / total))
            for w, gw, mw, vw in zip(params, (gw1, gw2), m, v):
                mw *= beta1
                mw += (1 - beta1) * gw
                vw *= beta2
                vw += (1 - beta2) * gw * gw
                mhat = mw / (1 - beta1**step)
                vhat = vw / (1 - beta2**step)
                w -= rate * (mhat / (np.sqrt(vhat) + eps) + weight_decay * w)
    return (w1 / scale).astype(np.float32), w2


def torch_device(device: str):
    """PyTorch and the device `device` names ("auto": CUDA where there is one, else the CPU)."""
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"predictor training on device {device!r} needs PyTorch: "
            "pip install 'powerinfer-rs[relufy]' (or torch)"
        ) from None
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: PyTorch sees no CUDA GPU here")
    return torch, dev


def _fit_layer_torch(x, y, hidden, epochs, batch, lr, weight_decay, seed, device):
    """`fit_layer` in PyTorch: the same initial weights, batches and update, step by step
    (numpy draws them, so both see the same numbers), in float32 tensors on `device`."""
    torch, dev = torch_device(device)
    rng = np.random.default_rng(seed)
    n, d = x.shape
    n_ff = y.shape[1]
    scale = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=0)).astype(np.float32) + 1e-6
    p = float(y.mean())
    pos_weight = min((1.0 - p) / max(p, 1e-6), 50.0) if 0 < p < 1 else 1.0
    w1_init = (rng.standard_normal((hidden, d)) * math.sqrt(2.0 / d)).astype(np.float32)
    w2_init = (rng.standard_normal((n_ff, hidden)) * math.sqrt(1.0 / hidden)).astype(np.float32)
    with torch.no_grad():
        xs = torch.from_numpy(np.ascontiguousarray(x / scale, dtype=np.float32)).to(dev)
        yt = torch.from_numpy(np.ascontiguousarray(y, dtype=np.float32)).to(dev)
        params = [torch.from_numpy(w1_init).to(dev), torch.from_numpy(w2_init).to(dev)]
        m = [torch.zeros_like(w) for w in params]
        v = [torch.zeros_like(w) for w in params]
        beta1, beta2, eps = 0.9, 0.999, 1e-8
        steps_per_epoch = max(1, n // batch)
        total = epochs * steps_per_epoch
        step = 0
        w1, w2 = params
        for _ in range(epochs):
            perm = torch.from_numpy(rng.permutation(n)).to(dev)
            for b in range(steps_per_epoch):
                idx = perm[b * batch : (b + 1) * batch]
                xb, yb = xs[idx], yt[idx]
                # forward: z (B, H) -> a = relu(z) -> logits (B, n_ff)
                z = xb @ w1.T
                a = torch.clamp_min(z, 0)
                prob = torch.sigmoid(torch.clamp(a @ w2.T, -30, 30))
                g = (prob * (pos_weight * yb + 1.0 - yb) - pos_weight * yb) / float(len(idx) * n_ff)
                gw2 = g.T @ a
                ga = (g @ w2) * (z > 0)
                gw1 = ga.T @ xb
                step += 1
                rate = lr * 0.5 * (1.0 + math.cos(math.pi * step / total))
                for w, gw, mw, vw in zip(params, (gw1, gw2), m, v):
                    mw.mul_(beta1).add_((1 - beta1) * gw)
                    vw.mul_(beta2).add_((1 - beta2) * gw * gw)
                    mhat = mw / (1 - beta1**step)
                    vhat = vw / (1 - beta2**step)
                    w -= rate * (mhat / (torch.sqrt(vhat) + eps) + weight_decay * w)
        fc1 = (w1.cpu().numpy() / scale).astype(np.float32)
        return fc1, w2.cpu().numpy().astype(np.float32)


def predictor_logits(x: np.ndarray, fc1: np.ndarray, fc2: np.ndarray) -> np.ndarray:
    return np.maximum(x @ fc1.T, 0) @ fc2.T


def evaluate(logits: np.ndarray, y: np.ndarray, recall_target: float) -> dict:
    """The cut-off keeping `recall_target` of the firing neurons, and what it gives."""
    pos = logits[y > 0.5]
    if len(pos) == 0:
        threshold = float(np.max(logits)) + 1.0
    else:
        # largest t with mean(pos >= t) >= recall_target
        k = int(math.floor((1.0 - recall_target) * len(pos)))
        threshold = float(np.partition(pos, k)[k])
    pred = logits >= threshold
    tp = float((pred & (y > 0.5)).sum())
    return {
        "threshold": threshold,
        "recall": tp / max(len(pos), 1),
        "precision": tp / max(float(pred.sum()), 1.0),
        "predicted_sparsity": 1.0 - float(pred.mean()),
        "true_sparsity": 1.0 - float(y.mean()),
    }


def train(
    profile: str | dict,
    output: str | None = None,
    recall_target: float = 0.9,
    efficiency_target: float = 0.8,
    hidden: int | None = None,
    min_hidden: int = 32,
    max_hidden: int | None = None,
    min_gain: float = 0.02,
    epochs: int = 8,
    batch: int = 256,
    lr: float = 2e-3,
    val_fraction: float = 0.1,
    seed: int = 0,
    layers: list[int] | None = None,
    progress: bool = True,
    report: str | None = None,
    device: str | None = None,
    model: str | None = None,
    predictor_type: str = "f16",
) -> dict:
    """Trains every layer's predictor from a profile and writes them (default
    `<profile>.predictors.npz`) with the per-layer table (default `<output>.txt`). `hidden` fixes
    the hidden size instead of searching; `model` (the profiled file) searches for the size that
    reads the fewest bytes, the predictors stored in `predictor_type` (see `PredictorCost`). `device`: None trains with numpy; "cuda", "cpu" or
    "auto" with PyTorch (see `fit_layer`). Returns {'fc1': [...], 'fc2': [...], 'thresholds',
    'layers': [LayerResult...], 'path', 'report'}."""
    p = load_profile(profile) if isinstance(profile, str) else profile
    require_neurons(p, "predictor training")
    if not (0.0 < recall_target <= 1.0):
        raise ValueError(f"recall_target must be in (0, 1], got {recall_target!r}")
    if not (0.0 < val_fraction < 0.5):
        raise ValueError(f"val_fraction must be in (0, 0.5), got {val_fraction!r}")
    if hidden is not None and (not isinstance(hidden, int) or hidden < 1):
        raise ValueError(f"hidden must be a positive int, got {hidden!r}")
    tx, tl = p["train_x"], p["train_labels"]
    n_layer, n, n_embd = tx.shape
    if max_hidden is None:
        max_hidden = max(min_hidden, min(1024, 1 << int(math.floor(math.log2(max(n_embd, 1))))))
    if min_hidden < 1 or max_hidden < min_hidden:
        raise ValueError(f"need 1 <= min_hidden <= max_hidden, got {min_hidden}, {max_hidden}")
    n_ff = int(p["n_ff"])
    n_val = max(1, int(round(val_fraction * n)))
    if n - n_val < batch // 4 or n < 16:
        raise ValueError(
            f"the profile holds {n} training tokens; predictor training needs a few thousand "
            "(profile with --train-tokens)"
        )
    if device is not None:
        torch_device(device)  # PyTorch there, and the device name valid, before any work
    stats = layer_stats(p)
    cost = predictor_cost(model, predictor_type) if model is not None else None
    if cost is not None and len(cost.skip_bytes) != n_layer:
        raise ValueError(f"{model} has {len(cost.skip_bytes)} layers; the profile has {n_layer}")
    which = list(range(n_layer)) if layers is None else list(layers)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    val_idx, train_idx = perm[:n_val], perm[n_val:]

    fc1s: list[np.ndarray] = []
    fc2s: list[np.ndarray] = []
    results: list[LayerResult] = []
    bar = _progress(len(which), progress, desc="training predictors", unit="layer")
    for l in which:
        t0 = time.perf_counter()
        x = tx[l].astype(np.float32)
        y = np.unpackbits(tl[l], axis=-1, count=n_ff).astype(np.float32)
        if hidden:
            h = hidden
        elif cost is not None:
            h = min_hidden
        else:
            h = initial_hidden(n_embd, stats[l]["skew"], min_hidden, max_hidden)
        tried: list[int] = []
        tried_bytes: list[float] = []
        best = None
        while True:
            tried.append(h)
            fc1, fc2 = fit_layer(
                x[train_idx], y[train_idx], h, epochs, batch, lr, seed=seed + l, device=device
            )
            ev = evaluate(predictor_logits(x[val_idx], fc1, fc2), y[val_idx], recall_target)
            if cost is not None:
                # fewer bytes read is better; stop at the first size that reads more
                ev["relative_bytes"] = cost.relative_bytes(
                    l, h, n_embd, n_ff, ev["predicted_sparsity"]
                )
                tried_bytes.append(ev["relative_bytes"])
                better = best is None or ev["relative_bytes"] < best[2]["relative_bytes"]
                if better:
                    best = (fc1, fc2, ev, h)
                if hidden is not None or not better or h * 2 > max_hidden:
                    break
                h *= 2
                continue
            efficiency = ev["predicted_sparsity"] / max(ev["true_sparsity"], 1e-9)
            gain = ev["predicted_sparsity"] - (best[2]["predicted_sparsity"] if best else -1.0)
            if best is None or gain > 0:
                best = (fc1, fc2, ev, h)
            if (
                hidden is not None
                or efficiency >= efficiency_target
                or gain < min_gain
                or h * 2 > max_hidden
            ):
                break
            h *= 2
        fc1, fc2, ev, h = best
        fc1s.append(fc1)
        fc2s.append(fc2)
        results.append(
            LayerResult(
                l,
                h,
                ev["threshold"],
                ev["recall"],
                ev["precision"],
                ev["predicted_sparsity"],
                ev["true_sparsity"],
                tried,
                time.perf_counter() - t0,
                ev.get("relative_bytes"),
                tried_bytes if cost is not None else None,
            )
        )
        bar.update(1)
    bar.close()

    table = format_table(results, p, recall_target)
    out = {
        "fc1": fc1s,
        "fc2": fc2s,
        "thresholds": np.array([r.threshold for r in results], dtype=np.float32),
        "layers": results,
        "table": table,
    }
    if layers is None:
        output = (
            output
            or (p.get("path") or "predictors").removesuffix(".profile.npz") + ".predictors.npz"
        )
        save_predictors(output, out)
        report = report or output + ".txt"
        with open(report, "w") as fh:
            fh.write(table + "\n")
        out["path"], out["report"] = output, report
    return out


def format_table(results: list[LayerResult], p: dict, recall_target: float) -> str:
    sized = bool(results) and all(r.relative_bytes is not None for r in results)
    lines = [
        f"predictors for {p.get('model', '?')}: {p['train_x'].shape[1]} training tokens, recall target {recall_target:.2f}"
        + (
            f", labels = threshold rule at sparsity {p['target_sparsity']:.2f}"
            if not math.isnan(p["target_sparsity"])
            else ""
        ),
        "layer  hidden  threshold  recall  precision  pred_sparsity  true_sparsity  tried"
        + ("  bytes vs none" if sized else ""),
    ]
    for r in results:
        lines.append(
            f"{r.layer:5d}  {r.hidden:6d}  {r.threshold:9.3f}  {r.recall:6.3f}  {r.precision:9.3f}  "
            f"{r.predicted_sparsity:13.3f}  {r.true_sparsity:13.3f}  {','.join(map(str, r.tried))}"
            + (f"  {r.relative_bytes:.3f}" if sized else "")
        )
    if results:
        lines.append(
            f"mean         {'':9s}  {np.mean([r.recall for r in results]):6.3f}  "
            f"{np.mean([r.precision for r in results]):9.3f}  {np.mean([r.predicted_sparsity for r in results]):13.3f}  "
            f"{np.mean([r.true_sparsity for r in results]):13.3f}"
            + (f"  {'':5s}  {np.mean([r.relative_bytes for r in results]):.3f}" if sized else "")
        )
    return "\n".join(lines)


def save_predictors(path: str, out: dict) -> None:
    arrays = {"thresholds": out["thresholds"], "n_layer": np.array(len(out["fc1"]))}
    for l, (a, b) in enumerate(zip(out["fc1"], out["fc2"])):
        arrays[f"fc1_{l}"] = a
        arrays[f"fc2_{l}"] = b
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def load_predictors(path: str) -> dict:
    """{'fc1': [(H_l, n_embd)], 'fc2': [(n_ff, H_l)], 'thresholds': (n_layer,)} float32."""
    try:
        with np.load(path, allow_pickle=False) as z:
            n = int(z["n_layer"])
            return {
                "fc1": [z[f"fc1_{l}"].astype(np.float32) for l in range(n)],
                "fc2": [z[f"fc2_{l}"].astype(np.float32) for l in range(n)],
                "thresholds": z["thresholds"].astype(np.float32),
            }
    except FileNotFoundError:
        raise FileNotFoundError(
            f"predictors {path!r} not found (train them with `powerinfer-rs train-predictors`)"
        ) from None
    except (KeyError, ValueError, OSError, EOFError) as e:
        raise ValueError(
            f"{path!r} is not a predictor file written by powerinfer-rs: {e}"
        ) from None
