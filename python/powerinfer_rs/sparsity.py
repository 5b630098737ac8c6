"""Cut-off calibration: threshold mode for models without predictors (SwiGLU models such as
SmolLM2), and per-layer predictor cut-offs for a recall target.

Threshold mode computes each FFN gate densely and skips the up and down rows of neurons whose
|act(gate)| is at or below a per-layer threshold. The thresholds come from running the model
densely over some English text and taking, per layer, the quantile of |act(gate)| that equals
the target sparsity. That runs once; the result is cached beside the model file (or in
~/.cache/powerinfer-rs when the model's folder is read-only), keyed by the model file's size and
modification time and by the calibration text.

Input sparsity for a perplexity budget (`max_ppl_increase`): every layer matrix may skip the
inputs whose score |x_i| * |W[:, i]| (the input's magnitude times its weight column's norm) is
small, through an input-major copy of the matrix. Matrices that read one input form a group
(q/k/v, the attention output, gate/up, down) with one cut-off per layer. One dense pass records
each group's scores; per group and skipped share the cut-off and the share of the squared scores
the skipped inputs carry (their "energy"). Shares at which the sparse kernel is not faster than
the dense one on this machine (timed here) are not used. Every group then skips the largest
share whose energy stays under one common bound, and the bound is bisected on the perplexity
the calibration text actually gets, so that it rises by at most `max_ppl_increase`.

Predictor cut-offs come from one dense pass too: per layer, the predictor's logits of the neurons
that truly fired; the cut-off for recall r is their (1 - r) quantile, so that a fraction r of the
firing neurons are selected on the calibration text.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

CACHE_VERSION = 1
#: Targets calibrated together (one dense pass gives every quantile at once).
STANDARD_TARGETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: Tokens per dense calibration window, each evaluated from an empty context.
WINDOW = 256

BUILTIN_SAMPLE = """\
The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only
visitors were gulls. The keeper, a patient woman who had once taught mathematics, kept a log of
every ship that passed. She wrote down the time, the weather and the direction of the wind, and
in the evenings she read the entries back to herself as if they were chapters of a long novel.

When the storm came in October, it arrived faster than the forecast had promised. The sky turned
the colour of wet slate, the sea rose in long grey ridges, and the rain came sideways across the
windows. She climbed the spiral stairs, checked the lamp and wound the clockwork that turned the
lens. Somewhere beyond the reef a fishing boat was trying to find the harbour.

How does a computer remember things? At the lowest level, memory is a long row of numbered boxes,
and each box holds a small number. A program asks for the number in box 1,024, adds seven to it,
and puts the result in box 2,048. Everything else, from photographs to spreadsheets to the words
on this page, is built by agreeing on what those numbers mean. A letter becomes a code, a colour
becomes three intensities of red, green and blue, and a sound becomes thousands of measurements
of air pressure taken every second.

"Are you sure this is the right road?" asked Tom, squinting at the map.
"Not at all," said his sister. "But the river is on our left, and the map says it should be."
"The map also says there is a bridge."
"Then we will find out whether the map is right about bridges."

Bread is one of the oldest prepared foods. Flour and water are mixed into a dough, yeast or a
sourdough starter is added, and the dough is left to rise while microorganisms turn sugars into
carbon dioxide and alcohol. The gas is trapped by a network of gluten proteins, which is why
kneading matters: it stretches and aligns the proteins so that the loaf can hold its shape. Baking
sets the structure, evaporates the alcohol and browns the crust through reactions between sugars
and amino acids.

The committee met on Thursday to review the budget for the coming year. Several members argued
that the library needed new computers, while others pointed out that the roof had leaked twice
during the winter. After a long discussion, they agreed to repair the roof first and to apply for
a grant to cover the computers. The chair thanked everyone for their patience and closed the
meeting a little after nine.

To solve the equation 3x + 5 = 20, subtract five from both sides to get 3x = 15, then divide both
sides by three. The answer is x = 5. You can check it by putting the value back into the original
equation: three times five is fifteen, and fifteen plus five is twenty.

In the spring the hills behind the village turn green almost overnight. Farmers move their sheep
to the higher pastures, children walk to school along paths lined with wild garlic, and the first
swallows return from Africa. Old people say that you can tell the weather of the whole summer from
the day the swallows arrive, although nobody has ever written down whether they are right.
"""


def _model_identity(model_path: str) -> dict:
    st = os.stat(model_path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_paths(model_path: str) -> list[Path]:
    """Where thresholds are cached: beside the model, then in the user's cache folder."""
    p = Path(model_path).resolve()
    digest = hashlib.sha256(str(p).encode()).hexdigest()[:16]
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "powerinfer-rs"
    return [p.with_name(p.name + ".thresholds.json"), home / f"{p.name}.{digest}.thresholds.json"]


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("version") == CACHE_VERSION else None


def _lookup(
    data: dict | None, identity: dict, text_sha: str, kind: str, target: float, n_layer: int
) -> list[float] | None:
    if not data or data.get("model") != identity:
        return None
    for e in data.get("entries", []):
        if (
            e.get("kind", "sparsity") == kind
            and e.get("text_sha256") == text_sha
            and abs(e.get("target", -1) - target) < 1e-9
        ):
            t = e.get("thresholds")
            if isinstance(t, list) and len(t) == n_layer:
                return [float(v) for v in t]
    return None


def _write(
    paths: list[Path],
    identity: dict,
    text_sha: str,
    kind: str,
    n_tokens: int,
    results: dict[float, list],
    extra: dict | None = None,
) -> Path | None:
    for path in paths:
        data = _read(path)
        if not data or data.get("model") != identity:
            data = {"version": CACHE_VERSION, "model": identity, "entries": []}
        entries = [
            e
            for e in data["entries"]
            if not (
                e.get("kind", "sparsity") == kind
                and e.get("text_sha256") == text_sha
                and e.get("target") in results
            )
        ]
        for target, thresholds in results.items():
            entries.append(
                {
                    "kind": kind,
                    "text_sha256": text_sha,
                    "tokens": n_tokens,
                    "target": target,
                    "thresholds": thresholds,
                    **(extra or {}),
                }
            )
        data["entries"] = entries
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, path)
            return path
        except OSError:
            continue
    return None


def _text_sha(text: str | None) -> tuple[str, str]:
    text = BUILTIN_SAMPLE if text is None else text
    if not isinstance(text, str) or not text.strip():
        raise ValueError("calibration text must be a non-empty string")
    return text, hashlib.sha256(text.encode()).hexdigest()


def _calibration_tokens(engine, text: str) -> tuple[list[int], int]:
    """The calibration text as BOS-prefixed windows laid end to end, and the window length."""
    ids = engine.tokenize(text, add_bos=False)
    if len(ids) < 2 * WINDOW // 4:
        raise ValueError(
            f"calibration text has only {len(ids)} tokens; give at least {2 * WINDOW // 4}"
        )
    bos = engine.tokenizer.bos_token_id if engine.tokenizer.add_bos else None
    window = min(WINDOW, engine.n_ctx)
    per = window - (1 if bos is not None else 0)
    tokens: list[int] = []
    for i in range(0, len(ids), per):
        chunk = ids[i : i + per]
        if len(chunk) >= 2:
            tokens += ([bos] if bos is not None else []) + chunk
    return tokens, window


def _calibrated(
    engine, kind: str, target: float, text: str | None, targets: tuple[float, ...], run
) -> list[float]:
    """Per-layer cut-offs of `kind` for `target`, from the cache or from `run(session, tokens,
    window, targets)` over `text` (default: the built-in sample), cached with `targets`."""
    from . import _core

    text, text_sha = _text_sha(text)
    identity = _model_identity(engine.path)
    paths = cache_paths(engine.path)
    n_layer = engine.n_layer
    for path in paths:
        found = _lookup(_read(path), identity, text_sha, kind, target, n_layer)
        if found is not None:
            return found
    tokens, window = _calibration_tokens(engine, text)
    targets = tuple(sorted(set(targets) | {target}))
    # a CPU session even when the engine runs on the GPU (calibration is a dense CPU pass);
    # windows are cut exactly where the BOS-prefixed chunks start
    session = _core.Session(engine._model, window, engine.kv_type)
    results = run(session, tokens, window, list(targets))
    by_target = {t: r for t, r in zip(targets, results)}
    _write(paths, identity, text_sha, kind, len(tokens), by_target)
    return by_target[target]


def gate_cutoffs(engine, target: float, text: str | None = None) -> list[float]:
    """Per-layer |act(gate)| cut-offs for `target` sparsity on `engine`'s model, from the cache
    or from a dense calibration run over `text` (default: a built-in English sample)."""
    return _calibrated(
        engine, "sparsity", target, text, STANDARD_TARGETS, lambda s, *a: s.calibrate(*a)
    )


#: Recall targets calibrated together for predictor cut-offs.
STANDARD_RECALLS = (0.9, 0.95, 0.99, 0.999)


def predictor_cutoffs(engine, recall: float, text: str | None = None) -> list[float]:
    """Per-layer predictor cut-offs keeping `recall` of the truly firing neurons on `text`
    (default: the built-in sample), from the cache or from a dense calibration run."""
    return _calibrated(
        engine,
        "predictor_recall",
        recall,
        text,
        STANDARD_RECALLS,
        lambda s, *a: s.calibrate_predictor(*a),
    )


#: Shares of a group's inputs input sparsity may skip.
INPUT_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
INPUT_GROUPS = ("qkv", "attn_output", "ffn_gate_up", "ffn_down")
#: Bisection steps over the energy bound (log-spaced).
_BISECT_STEPS = 12


def _nll(engine, tokens: list[int], window: int, input_cutoffs=None) -> tuple[float, int, dict]:
    """Summed negative log-likelihood of each window's tokens after its first, evaluated from an
    empty cache, with the given input cut-offs (None: dense); and the session's counters."""
    import numpy as np

    from . import _core

    session = _core.Session(engine._model, window, engine.kv_type)
    if input_cutoffs is not None:
        session.set_sparsity("threshold", input_cutoffs=input_cutoffs)
    nll, count = 0.0, 0
    for i in range(0, len(tokens), window):
        chunk = tokens[i : i + window]
        if len(chunk) < 2:
            break
        session.truncate(0)
        logits = session.eval(chunk, all_logits=True).astype(np.float64)[:-1]
        m = logits.max(axis=1, keepdims=True)
        logz = np.log(np.exp(logits - m).sum(axis=1)) + m[:, 0]
        nll += float((logz - logits[np.arange(len(chunk) - 1), chunk[1:]]).sum())
        count += len(chunk) - 1
    return nll, count, session.take_stats()


def _lookup_plan(
    data: dict | None, identity: dict, text_sha: str, target: float, n_layer: int
) -> dict | None:
    if not data or data.get("model") != identity:
        return None
    for e in data.get("entries", []):
        if (
            e.get("kind") == "input_ppl"
            and e.get("text_sha256") == text_sha
            and abs(e.get("target", -1) - target) < 1e-12
        ):
            t = e.get("thresholds")
            if (
                isinstance(t, list)
                and len(t) == n_layer
                and all(isinstance(r, list) and len(r) == 4 for r in t)
            ):
                return e
    return None


def input_sparsity_plan(
    engine, max_ppl_increase: float, text: str | None = None, progress=None
) -> dict:
    """Input cut-offs for `engine`'s model that raise the perplexity of `text` (default: the
    built-in sample) by at most `max_ppl_increase` (0.02 = 2%), from the cache or calibrated
    now (see the module docstring). Returns a dict: "thresholds" (per layer, one cut-off per
    group of INPUT_GROUPS, 0 where nothing is skipped), "levels" (the skipped shares),
    "ppl_dense", "ppl" (on the calibration text), "weight_bytes_skipped" (share of the layer
    weight bytes not read, the copies counted at their own size), "faster" (per group, the
    shares at which the sparse kernel beat the dense one when timed)."""
    from . import _core

    text, text_sha = _text_sha(text)
    identity = _model_identity(engine.path)
    paths = cache_paths(engine.path)
    n_layer = engine.n_layer
    for path in paths:
        found = _lookup_plan(_read(path), identity, text_sha, max_ppl_increase, n_layer)
        if found is not None:
            return found
    tokens, window = _calibration_tokens(engine, text)
    if len(tokens) < 2 * WINDOW:
        raise ValueError(
            f"calibration text has only {len(tokens)} tokens; measuring a perplexity budget needs at least "
            f"{2 * WINDOW} (give a longer calibration_text)"
        )
    session = _core.Session(engine._model, window, engine.kv_type)
    cal = session.calibrate_inputs(
        tokens, window, list(INPUT_LEVELS)
    )  # [level][layer][group] = (cut, energy)
    # which shares pay on this machine: one token's products of a middle layer, timed
    mid = n_layer // 2
    faster = [
        [engine._model.time_input_sparsity(mid, g, lv, 21)[:2] for lv in INPUT_LEVELS]
        for g in range(4)
    ]
    allowed = [[d > sp for d, sp in row] for row in faster]

    def plan(bound: float) -> tuple[list[list[float]], list[list[float]]]:
        thresholds, levels = [], []
        for l in range(n_layer):
            cuts, shares = [0.0] * 4, [0.0] * 4
            for g in range(4):
                for k, lv in enumerate(INPUT_LEVELS):
                    cut, energy = cal[k][l][g]
                    if allowed[g][k] and energy <= bound and cut > 0:
                        cuts[g], shares[g] = float(cut), lv
            thresholds.append(cuts)
            levels.append(shares)
        return thresholds, levels

    nll0, count, st0 = _nll(engine, tokens, window)
    ppl0 = math.exp(nll0 / count)
    limit = ppl0 * (1 + max_ppl_increase)
    best = {
        "thresholds": [[0.0] * 4 for _ in range(n_layer)],
        "levels": [[0.0] * 4 for _ in range(n_layer)],
        "ppl": ppl0,
        "stats": st0,
    }
    lo, hi = -7.0, 0.0  # log10 of the energy bound
    for step in range(_BISECT_STEPS):
        mid_bound = (lo + hi) / 2
        thresholds, levels = plan(10**mid_bound)
        nll, _, st = _nll(engine, tokens, window, thresholds)
        ppl = math.exp(nll / count)
        if progress is not None:
            progress(step + 1, _BISECT_STEPS, 10**mid_bound, ppl / ppl0 - 1)
        if ppl <= limit:
            lo = mid_bound
            best = {"thresholds": thresholds, "levels": levels, "ppl": ppl, "stats": st}
        else:
            hi = mid_bound
    st = best.pop("stats")
    result = dict(
        best,
        ppl_dense=ppl0,
        weight_bytes_skipped=1 - st["weight_bytes_read"] / st["weight_bytes"]
        if st["weight_bytes"]
        else 0.0,
        faster={
            name: [lv for lv, ok in zip(INPUT_LEVELS, allowed[g]) if ok]
            for g, name in enumerate(INPUT_GROUPS)
        },
    )
    extra = {k: v for k, v in result.items() if k != "thresholds"}
    _write(
        paths,
        identity,
        text_sha,
        "input_ppl",
        len(tokens),
        {max_ppl_increase: result["thresholds"]},
        extra,
    )
    result.update(kind="input_ppl", target=max_ppl_increase)
    return result
