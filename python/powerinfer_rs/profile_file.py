"""The activation profile file (`<model>.profile.npz`): per layer, how often each FFN neuron
fired over the profiled tokens, the thresholds that define firing, and the predictor training
set. The offline profiler writes it; the runtime reads it to place hot neurons on the GPU, as
activation frequencies (`activation_frequencies`). For a mixture-of-experts model the units are
experts (`unit` = "expert"): how often each layer routed a token to each expert, and no
training set.
"""

from __future__ import annotations

import os

import numpy as np

PROFILE_VERSION = 1


def save_profile(path: str, p: dict) -> None:
    arrays = {k: np.asarray(v) for k, v in p.items() if k not in ("path", "plot")}
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def load_profile(path: str) -> dict:
    """A profile written by `profile`: counts (n_layer, n_ff) of firings over n_tokens tokens,
    the per-layer thresholds that define firing, and train_x (n_layer, N, n_embd) float16 /
    train_labels (n_layer, N, n_ff/8) packed bits for predictor training."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"profile {path!r} not found (write one with `powerinfer-rs profile`)"
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            p = {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{path!r} is not a readable profile: {e}") from None
    missing = {
        "version",
        "counts",
        "n_tokens",
        "thresholds",
        "train_x",
        "train_labels",
        "n_ff",
    } - set(p)
    if missing:
        raise ValueError(
            f"{path!r} is not a profile written by powerinfer-rs (missing {sorted(missing)})"
        )
    for k in ("version", "n_tokens", "n_ff", "n_embd"):
        p[k] = int(p[k])
    for k in ("model", "architecture", "activation"):
        p[k] = str(p[k])
    p["unit"] = str(p["unit"]) if "unit" in p else "neuron"
    p["target_sparsity"] = float(p["target_sparsity"])
    if p["version"] != PROFILE_VERSION:
        raise ValueError(
            f"{path!r} has profile version {p['version']}, this powerinfer-rs reads {PROFILE_VERSION}"
        )
    return p


def activation_frequencies(profile: dict) -> list[np.ndarray]:
    """Per layer, the share of the profiled tokens on which each FFN neuron fired: a profile's
    `counts` over its `n_tokens` (float64; a profile of no tokens gives zeros)."""
    n_tokens = max(profile["n_tokens"], 1)
    return [np.asarray(c, dtype=np.float64) / n_tokens for c in profile["counts"]]


def require_neurons(profile: dict, what: str) -> dict:
    """`profile`, if it counts neurons; a ValueError naming `what` for an expert profile."""
    if profile.get("unit", "neuron") != "neuron":
        raise ValueError(
            f"{what} reads a profile of FFN neurons; this one counts the experts of a "
            f"mixture-of-experts model ({profile.get('model', '')})"
        )
    return profile
