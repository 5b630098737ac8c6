"""Relufication: turns a SwiGLU model into one whose FFN activations are exactly zero most of the
time, so the sparse operators and predictors have something to skip.

The gate activation becomes ReLU (ReGLU, `relu(gate) * up`, ReluLLaMA's and ProSparse's choice)
or dReLU (`relu(gate) * relu(up)`, TurboSparse's), and the model is trained to recover:

- loss = KL(teacher || student) + ce_weight * cross-entropy + lambda(t) * L1, where the teacher
  is the original model, frozen, its logits computed on the same batch in the same step, and
  L1 is the mean |activation| of the FFN gate (and of the up side for dReLU), averaged over layers;
- the swap is gradual: for the first `blend` share of the steps the gate is
  (1 - b) silu(g) + b relu(g) with b rising linearly from 0 to 1, since the bare swap breaks a
  model outright (SmolLM2-135M: perplexity 25 -> 4,460 with ReLU, 216,659 with dReLU);
- lambda(t) is 0 until the blend ends, then rises along a sine quarter-wave to `l1` at
  `l1_full` of the steps and stays there (ProSparse's progressive regularisation, in one stage);
- AdamW (0.9, 0.95), weight decay 0.01, linear warm-up then cosine decay to a tenth.

Batches are windows of the packed training tokens at offsets drawn from a generator seeded by
(seed, step), so a run is repeatable and a resumed run reads the batches an uninterrupted one
would. On CUDA both models run under bf16 autocast (float32 weights, bf16 products) and the
student is compiled (`torch.compile`) where that works (on the CPU only with `compile=True`: the
compile takes longer than a short run); on the CPU everything is float32, and slow.

Output: a GGUF the engine reads (the source's metadata and tokenizer, `{arch}.ffn_activation`
set, 2-D weights in F16 / Q8_0 / Q4_0 / F32, norms in F32) and a JSON report: per-layer share of
exact zeros, KL to the original and perplexity before and after on the held-out slice, and the
learning curve.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import numpy as np

from .. import _core
from . import packing, torch_model

INSTALL_HINT = "relufy needs PyTorch: pip install 'powerinfer-rs[relufy]'"
ACTIVATIONS = {"reglu": "relu", "relu": "relu", "dreglu": "drelu", "drelu": "drelu"}
# output types: the GGML type of the 2-D weights and the general.file_type llama.cpp gives it
OUT_TYPES = {"f16": ("F16", 1), "q8_0": ("Q8_0", 7), "q4_0": ("Q4_0", 2), "f32": ("F32", 0)}


def import_torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return torch


@dataclass
class RelufySettings:
    """Every number that shapes a run; a checkpoint resumes only under the same ones."""

    activation: str = "reglu"  # "reglu" (relu(gate) * up) or "dreglu" (relu(gate) * relu(up))
    steps: int = 1000
    batch: int = 8  # windows per step
    seq_len: int = 256  # tokens per window
    lr: float = 1e-4  # peak learning rate
    warmup: float = 0.05  # share of steps of linear warm-up
    blend: float = (
        0.3  # share of steps over which silu turns into relu (measured: benches/relufy_swap.py)
    )
    l1: float = 0.3  # peak weight of the L1 penalty (mean |activation| is ~0.25 on SmolLM2)
    l1_full: float = 0.8  # share of steps by which the L1 weight reaches its peak
    ce_weight: float = 0.5  # weight of the next-token cross-entropy beside the KL
    weight_decay: float = 0.01
    seed: int = 0
    # "q8_0" / "q4_0": quantization-aware training for that output type (the student reads its
    # weights as the file will hold them); "" trains in float
    qat: str = ""

    def check(self) -> None:
        if self.activation not in ("reglu", "dreglu"):
            raise ValueError(f"activation must be 'reglu' or 'dreglu', got {self.activation!r}")
        if self.qat not in ("", "q8_0", "q4_0"):
            raise ValueError(f"qat must be '', 'q8_0' or 'q4_0', got {self.qat!r}")
        for name in ("steps", "batch", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("warmup", "blend", "l1_full"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} is a share of the steps in [0, 1], got {v!r}")
        for name in ("lr", "l1", "ce_weight", "weight_decay"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")

    # the schedules, as functions of the step
    def blend_at(self, step: int) -> float:
        end = self.blend * self.steps
        return 1.0 if end <= 0 else min(1.0, step / end)

    def l1_at(self, step: int) -> float:
        start, full = self.blend * self.steps, max(self.l1_full, self.blend) * self.steps
        if step < start:
            return 0.0
        if full <= start:
            return self.l1
        return self.l1 * math.sin(0.5 * math.pi * min(1.0, (step - start) / (full - start)))

    def lr_at(self, step: int) -> float:
        warm = self.warmup * self.steps
        if step < warm:
            return self.lr * (step + 1) / warm
        t = (step - warm) / max(1.0, self.steps - warm)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def model_fingerprint(path: str) -> str:
    """Size and a hash of the first and last MiB: which file a checkpoint belongs to."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return f"{size}:{h.hexdigest()[:16]}"


def _load_source(model_path: str):
    """The engine's view of the file (validated), its metadata, config and weights."""
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"model file {model_path!r} does not exist")
    with open(model_path, "rb") as f:
        if f.read(4) == b"PWRI":
            raise ValueError(
                f"{model_path} is a PowerInfer GGUF (ReLU-family with predictors); relufy takes a plain SwiGLU GGUF"
            )
    model = _core.Model(model_path, 1)
    metadata = model.metadata()
    cfg = torch_model.read_config(model, metadata)
    act = model.config()["ffn_activation"]
    if act != "swiglu":
        raise ValueError(
            f"{model_path} already has a {act} FFN; relufy turns SwiGLU models into ReLU-family ones"
        )
    gf = _core.GgufFile(model_path)
    present = {t["name"] for t in gf.tensors()}
    names = torch_model.layer_tensor_names(cfg, present)
    tensors = {n: gf.read_tensor(n) for n in names}
    fixed = {n: gf.read_tensor(n) for n in torch_model.FIXED_TENSORS if n in present}
    return model, metadata, cfg, tensors, fixed


def _check_writable(path: str) -> None:
    """Fails before hours of training, not after; leaves nothing behind."""
    probe = f"{path}.probe"
    try:
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise OSError(f"cannot write the output {path!r}: {e.strerror or e}") from e


def _windows(tokens: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """Up to `count` consecutive, non-overlapping windows of seq_len + 1 tokens."""
    n = min(count, (len(tokens) - 1) // seq_len)
    return (
        np.stack(
            [tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64) for i in range(n)]
        )
        if n
        else np.zeros((0, seq_len + 1), np.int64)
    )


def relufy(
    model: str,
    corpus: list[str] | str,
    output: str,
    settings: RelufySettings | None = None,
    outtype: str = "f16",
    eval_paths: list[str] | str | None = None,
    eval_tokens: int = 16_384,
    eval_every: int | None = None,
    checkpoint: str | None = None,
    checkpoint_every: int | None = None,
    resume: str | None = None,
    report: str | None = None,
    device: str = "auto",
    compile: bool | None = None,
    threads: int | None = None,
    max_steps: int | None = None,
    minutes: float | None = None,
    progress: bool = True,
) -> dict:
    """Relufies `model` (a SwiGLU GGUF of llama, mistral, qwen2 or qwen3) on `corpus` (text
    files, folders, or one shard written by `pack`) and writes the result to `output`. Returns
    the report (also written to `report`, default `<output without .gguf>.relufy.json`).

    `checkpoint` (default `<output>.ckpt`) is written every `checkpoint_every` steps and at the
    end; `resume` continues from one. `max_steps` stops after that many steps of this call
    (checkpointed, no output written): a long run can go in pieces. `minutes` replaces
    `settings.steps` by as many steps as fit that time (timed on a few trial steps, then undone;
    a resumed run keeps its checkpoint's count)."""
    settings = dataclasses.replace(settings) if settings else RelufySettings()
    settings.check()
    if minutes is not None and not (isinstance(minutes, (int, float)) and 0 < minutes < 1e6):
        raise ValueError(f"minutes must be a positive number, got {minutes!r}")
    if outtype not in OUT_TYPES:
        raise ValueError(
            f"unsupported output type {outtype!r}: choose one of {', '.join(OUT_TYPES)}"
        )
    if settings.qat and settings.qat != outtype:
        raise ValueError(
            f"quantization-aware training is for the output type: qat {settings.qat!r} needs "
            f"outtype {settings.qat!r}, not {outtype!r}"
        )
    if outtype == "q4_0" and not settings.qat:
        warnings.warn(
            "a Q4_0 file of a model relufied in float loses most of the training (its rounding "
            "is larger than what training changes); train for it with qat='q4_0' (--qat)",
            stacklevel=2,
        )
    model = os.fspath(model)
    output = os.fspath(output)
    if os.path.abspath(output) == os.path.abspath(model):
        raise ValueError("the output would overwrite the input model; choose another path")
    torch = import_torch()
    _, metadata, cfg, tensors, fixed = _load_source(model)
    if cfg.sliding_window and settings.seq_len > cfg.sliding_window:
        raise ValueError(
            f"seq_len {settings.seq_len} exceeds the model's sliding window {cfg.sliding_window}"
        )
    _check_writable(output)
    checkpoint = checkpoint or f"{output}.ckpt"
    report = report or (output[:-5] if output.endswith(".gguf") else output) + ".relufy.json"

    from ..tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer(metadata, model_path=model)
    corpus_list = [corpus] if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    if not corpus_list:
        raise ValueError("no corpus given")
    if len(corpus_list) == 1 and packing.is_shard(corpus_list[0]):
        shard = packing.load_shard(corpus_list[0], tokenizer)
    else:
        shard = packing.pack(tokenizer, corpus_list, eval_paths=eval_paths)
    train_tokens, eval_stream = shard["train"], shard["eval"]
    need = settings.batch * (settings.seq_len + 1)
    if len(train_tokens) < need:
        raise ValueError(
            f"the corpus has {len(train_tokens)} training tokens, fewer than one batch "
            f"({settings.batch} x {settings.seq_len + 1}); give more text or a smaller batch/seq_len"
        )
    if int(train_tokens.max(initial=0)) >= cfg.n_vocab:
        raise ValueError("the corpus holds token ids beyond the model's vocabulary")
    eval_len = min(settings.seq_len, max(1, len(eval_stream) - 1))
    eval_windows = _windows(eval_stream, eval_len, max(1, eval_tokens // eval_len))
    if len(eval_windows) == 0:
        raise ValueError(
            "the held-out slice of the corpus is empty; give more files or --eval files"
        )

    dev = _pick_device(torch, device)
    if threads:
        torch.set_num_threads(threads)
    cuda = dev.type == "cuda"
    if not cuda:
        warnings.warn(
            "relufy on the CPU trains in float32 and is slow; a CUDA GPU is 50-100x faster",
            stacklevel=2,
        )
    torch.manual_seed(settings.seed)

    student = torch_model.build(torch, cfg, tensors, fixed).to(dev)
    teacher = torch_model.build(torch, cfg, tensors, fixed).to(dev)
    if settings.qat:
        # the student reads each weight as the output file will hold it
        student.fake_quant = {
            name: t for name, v in tensors.items() if (t := _stored_type(name, v, outtype))
        }
    del tensors
    # the teacher keeps float32 weights (and float64 RoPE frequencies): under autocast its
    # products run in bf16 all the same
    teacher.requires_grad_(False).eval()
    opt = torch.optim.AdamW(
        student.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    state = {"step": 0, "curve": [], "seconds": 0.0}
    fingerprint = model_fingerprint(model)
    if resume:
        if minutes is not None:
            # the step count a time budget chose is the checkpoint's
            settings = dataclasses.replace(
                settings, steps=_checkpoint_settings(torch, resume).get("steps", settings.steps)
            )
        state = _restore(torch, resume, student, opt, settings, fingerprint)
    compiled = None
    # compiled on CUDA unless told not to; on the CPU only when asked (the compile takes longer
    # than a short run there)
    if compile or (compile is None and cuda):
        try:
            compiled = torch.compile(student)
        except Exception as e:  # pragma: no cover - depends on the CUDA toolchain
            warnings.warn(f"torch.compile failed ({e}); training eagerly", stacklevel=2)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else _nullcontext()

    def train_step(step: int) -> dict:
        """One optimizer step on batch `step`; returns its numbers."""
        nonlocal compiled
        ids = _batch(train_tokens, settings, step)
        x, y = torch.from_numpy(ids[:, :-1]).to(dev), torch.from_numpy(ids[:, 1:]).to(dev)
        for group in opt.param_groups:
            group["lr"] = settings.lr_at(step)
        blend, lam = settings.blend_at(step), settings.l1_at(step)
        with torch.no_grad(), autocast:
            t_logits = teacher(x, blend=0.0)
        b = torch.tensor(blend, dtype=torch.float32, device=dev)
        try:
            with autocast:
                # `compiled or student` would ask the compiled module's len()
                s_logits, l1, zeros = (student if compiled is None else compiled)(
                    x, blend=b, activation=settings.activation, stats=True
                )
        except Exception as e:  # pragma: no cover - torch.compile failing at its first call
            if compiled is None:
                raise
            warnings.warn(
                f"torch.compile failed at the first step ({type(e).__name__}: {e}); training eagerly",
                stacklevel=2,
            )
            compiled = None
            with autocast:
                s_logits, l1, zeros = student(
                    x, blend=b, activation=settings.activation, stats=True
                )
        kl, ce = _kl_ce(torch, s_logits, t_logits, y)
        loss = kl + settings.ce_weight * ce + lam * l1.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        zero = float(zeros.sum()) / (cfg.n_layer * cfg.n_ff * x.numel())
        return {
            "loss": loss.item(),
            "kl": kl.item(),
            "zero": zero,
            "blend": blend,
            "l1_weight": lam,
        }

    tokens_per_step = settings.batch * settings.seq_len
    if minutes is not None and not resume:
        # as many steps as fit the time: a few trial steps timed, then undone
        saved = (
            {k: v.detach().clone() for k, v in student.state_dict().items()},
            copy.deepcopy(opt.state_dict()),
        )
        for i in range(8):
            if i == 3:
                _sync(torch, dev)
                t_probe = time.time()
            train_step(i)
        _sync(torch, dev)
        per_step = (time.time() - t_probe) / 5
        student.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        settings = dataclasses.replace(settings, steps=max(1, int(minutes * 60 / per_step)))
        if progress:
            print(
                f"relufy: {per_step * 1000:.0f} ms a step ({tokens_per_step / per_step:.0f} tokens/s): "
                f"{settings.steps} steps in {minutes:g} minutes",
                file=sys.stderr,
                flush=True,
            )

    eval_every = eval_every or max(1, settings.steps // 10)
    checkpoint_every = checkpoint_every or max(1, settings.steps // 10)
    few = eval_windows[: max(1, min(len(eval_windows), 8))]  # the learning curve's cheap evaluation

    def evaluate(windows, blend, model=student):
        return _evaluate(torch, model, teacher, windows, blend, settings.activation, dev, autocast)

    if not state["curve"]:
        # where training starts: the bare swap, beside the original's perplexity
        bare = evaluate(few, 1.0)
        state["curve"].append(
            {
                "step": 0,
                "tokens": 0,
                "ppl_original": evaluate(few, 0.0, teacher)["ppl"],
                **_brief(bare),
            }
        )

    bar = _progress_bar(settings.steps, state["step"], progress)
    t0 = time.time()
    seconds_before, first_step = state["seconds"], state["step"]
    stop_at = (
        settings.steps if max_steps is None else min(settings.steps, state["step"] + max_steps)
    )
    while state["step"] < stop_at:
        r = train_step(state["step"])
        state["step"] += 1
        state["seconds"] = seconds_before + time.time() - t0
        if bar is not None:
            bar.update(1)
            done = (state["step"] - first_step) * tokens_per_step
            bar.set_postfix(
                tok_s=f"{done / max(time.time() - t0, 1e-9):.0f}",
                loss=f"{r['loss']:.3f}",
                kl=f"{r['kl']:.3f}",
                zeros=f"{r['zero']:.1%}",
                blend=f"{r['blend']:.2f}",
                refresh=False,
            )
        if state["step"] % eval_every == 0 or state["step"] == settings.steps:
            e = evaluate(few, 1.0)
            state["curve"].append(
                {
                    "step": state["step"],
                    "tokens": state["step"] * tokens_per_step,
                    "train_zero_share": r["zero"],
                    "l1_weight": r["l1_weight"],
                    "minutes": state["seconds"] / 60,
                    **_brief(e),
                }
            )
            if bar is not None:
                bar.write(
                    f"step {state['step']}: eval ppl {e['ppl']:.2f}, kl {e['kl']:.4f}, zeros {e['zero_share']:.1%}"
                )
        if state["step"] % checkpoint_every == 0 or state["step"] == stop_at:
            _save(torch, checkpoint, student, opt, settings, fingerprint, state)
    if bar is not None:
        bar.close()
    if state["step"] < settings.steps:
        return {
            "finished": False,
            "step": state["step"],
            "steps": settings.steps,
            "checkpoint": checkpoint,
            "curve": state["curve"],
        }

    # the held-out slice: the original, the relufied model in float, and both GGUFs in the engine
    before = evaluate(eval_windows, 0.0, teacher)
    after = evaluate(eval_windows, 1.0)
    _write_gguf(
        model,
        output,
        student.gguf_tensors(),
        outtype,
        {
            "activation": ACTIVATIONS[settings.activation],
            "train_tokens": state["step"] * tokens_per_step,
        },
    )
    engine_before = _engine_perplexity(model, eval_windows)
    engine_after = _engine_perplexity(output, eval_windows)
    result = {
        "model": os.path.basename(model),
        "output": output,
        "outtype": outtype,
        "architecture": cfg.arch,
        "activation": settings.activation,
        "device": _device_name(torch, dev),
        "hyperparameters": asdict(settings),
        "train_tokens": state["step"] * tokens_per_step,
        "train_minutes": state["seconds"] / 60,
        "corpus": {k: shard["meta"][k] for k in ("train_tokens", "eval_tokens", "split")},
        "eval_text": shard["meta"]["eval_files"] or shard["meta"]["split"],
        "eval_tokens": int(eval_windows[:, 1:].size),
        "sparsity": after["zero_share"],
        "sparsity_per_layer": after["zero_share_per_layer"],
        "kl_original": before["kl"],
        "kl_relufied": after["kl"],
        "ppl_original": before["ppl"],
        "ppl_relufied": after["ppl"],
        "ppl_original_engine": engine_before,
        "ppl_relufied_engine": engine_after,
        "neuron_zero_share": after["neuron_zero_share"],
        "curve": state["curve"],
    }
    with open(report, "w") as fh:
        json.dump(result, fh, indent=1)
    result["report"] = report
    return result


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _pick_device(torch, device: str):
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but PyTorch sees no CUDA GPU")
    return torch.device(device)


def _device_name(torch, dev) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({torch.get_num_threads()} threads)"


def _batch(tokens: np.ndarray, s: RelufySettings, step: int) -> np.ndarray:
    """(batch, seq_len + 1) windows at offsets drawn from (seed, step) alone."""
    rng = np.random.default_rng([s.seed, step])
    starts = rng.integers(0, len(tokens) - s.seq_len, size=s.batch)
    return np.stack([tokens[i : i + s.seq_len + 1].astype(np.int64) for i in starts])


def _kl_ce(torch, s_logits, t_logits, targets):
    """KL(teacher || student) per token and the student's cross-entropy, both in float32."""
    F = torch.nn.functional
    s = F.log_softmax(s_logits.float(), -1)
    t = F.log_softmax(t_logits.float(), -1)
    kl = (t.exp() * (t - s)).sum(-1).mean()
    ce = F.nll_loss(s.flatten(0, 1), targets.flatten())
    return kl, ce


def _evaluate(
    torch, student, teacher, windows: np.ndarray, blend: float, activation: str, dev, autocast
) -> dict:
    """Perplexity, KL to the teacher and exact-zero shares of `student` at `blend` over windows."""
    nll = kl = 0.0
    count = 0
    zeros = None
    positions = 0
    with torch.no_grad():
        for row in windows:
            ids = torch.from_numpy(row[None, :]).to(dev)
            x, y = ids[:, :-1], ids[:, 1:]
            with autocast:
                s_logits, _, z = student(x, blend=blend, activation=activation, stats=True)
                t_logits = teacher(x, blend=0.0)
            k, c = _kl_ce(torch, s_logits, t_logits, y)
            n = y.numel()
            nll += float(c) * n
            kl += float(k) * n
            count += n
            z = z.to(torch.float64).cpu().numpy()  # (n_layer, n_ff)
            zeros = z if zeros is None else zeros + z
            positions += x.numel()
    per_neuron = zeros / positions
    per_layer = per_neuron.mean(1)
    return {
        "ppl": math.exp(nll / count),
        "kl": kl / count,
        "zero_share": float(per_layer.mean()),
        "zero_share_per_layer": [float(v) for v in per_layer],
        "neuron_zero_share": per_neuron.astype(np.float32).tolist(),
    }


def _brief(e: dict) -> dict:
    return {"ppl": e["ppl"], "kl": e["kl"], "zero_share": e["zero_share"]}


def _engine_perplexity(path: str, windows: np.ndarray) -> float:
    """Perplexity of the windows' next tokens as the engine computes them from the GGUF file."""
    model = _core.Model(path, 0)
    session = _core.Session(model, int(windows.shape[1]))
    nll, count = 0.0, 0
    for row in windows:
        session.truncate(0)
        logits = np.asarray(session.eval([int(t) for t in row[:-1]], True), dtype=np.float64)
        logits -= logits.max(1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        nll -= float(logp[np.arange(len(row) - 1), row[1:]].sum())
        count += len(row) - 1
    return math.exp(nll / count)


def _progress_bar(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", desc="relufy", file=sys.stderr)


def _save(
    torch, path: str, student, opt, settings: RelufySettings, fingerprint: str, state: dict
) -> None:
    tmp = f"{path}.tmp"
    torch.save(
        {
            "student": student.state_dict(),
            "optimizer": opt.state_dict(),
            "settings": asdict(settings),
            "model": fingerprint,
            "state": state,
        },
        tmp,
    )
    os.replace(tmp, path)


def _sync(torch, dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _checkpoint_settings(torch, path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)["settings"]
    except Exception:
        return {}  # _restore says what is wrong with the file


def _restore(torch, path: str, student, opt, settings: RelufySettings, fingerprint: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
        ck_model, ck_settings = ck["model"], ck["settings"]
    except Exception as e:
        raise ValueError(f"{path} is not a relufy checkpoint ({e})") from e
    if ck_model != fingerprint:
        raise ValueError(f"checkpoint {path} was written for another model file than this one")
    differ = {
        k: (v, getattr(settings, k))
        for k, v in ck_settings.items()
        if getattr(settings, k, None) != v
    }
    if differ:
        raise ValueError(
            f"checkpoint {path} was written with other settings: "
            + ", ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in differ.items())
        )
    student.load_state_dict(ck["student"])
    opt.load_state_dict(ck["optimizer"])
    return ck["state"]


def requantize(source: str, output: str, outtype: str) -> str:
    """A copy of a relufied (or any plain llama-family) GGUF with its 2-D weights in `outtype`."""
    if outtype not in OUT_TYPES:
        raise ValueError(
            f"unsupported output type {outtype!r}: choose one of {', '.join(OUT_TYPES)}"
        )
    gf = _core.GgufFile(source)
    tensors = {t["name"]: gf.read_tensor(t["name"]) for t in gf.tensors()}
    _write_gguf(source, output, tensors, outtype, {})
    return output


def _stored_type(name: str, data: np.ndarray, outtype: str) -> str | None:
    """The type a written tensor is stored in: `outtype` for the 2-D weights, except that the
    output matrix (the token embeddings where they are tied) stays in Q8_0 under a 4-bit type,
    as llama.cpp's quantizer keeps it finer (relufied SmolLM2 in Q4_0: perplexity 25.7 with it
    in Q4_0, 23.7 in Q8_0, 19.0 all in F16); None for what is stored in F32 (norms)."""
    if data.ndim != 2 or name == "rope_freqs.weight":
        return None
    if outtype == "q4_0" and name in ("output.weight", "token_embd.weight"):
        return "q8_0"
    return outtype


def _write_gguf(
    source: str, output: str, tensors: dict[str, np.ndarray], outtype: str, relufied: dict
) -> None:
    """The source's metadata and tensor order with `tensors` replacing theirs (2-D ones stored
    in `outtype`, others in F32) and, for a relufied model, its activation and training tokens.
    Written beside the output and moved into place when complete."""
    import gguf

    from .conversion import _encode

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    tmp = f"{output}.tmp"
    w = gguf.GGUFWriter(tmp, arch)
    skip = {"general.architecture", "general.file_type"}
    if relufied:
        skip |= {f"{arch}.ffn_activation", "powerinfer_rs.relufy.train_tokens"}
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in skip:
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        w.add_key_value(f.name, f.contents(), vtype, sub)
    w.add_file_type(OUT_TYPES[outtype][1])
    if relufied:
        w.add_string(f"{arch}.ffn_activation", relufied["activation"])
        w.add_uint64("powerinfer_rs.relufy.train_tokens", int(relufied["train_tokens"]))
    for t in reader.tensors:
        data = tensors.get(t.name)
        stored = _stored_type(t.name, data, outtype) if data is not None else None
        if stored is not None:
            qtype = gguf.GGMLQuantizationType[OUT_TYPES[stored][0]]
            w.add_tensor(t.name, _encode(data, qtype), raw_dtype=qtype)
        elif data is not None:
            w.add_tensor(t.name, np.ascontiguousarray(data, np.float32))
        else:
            shape = tuple(int(d) for d in reversed(t.shape))
            w.add_tensor(
                t.name,
                t.data,
                raw_shape=None if t.data.dtype == np.uint8 else shape,
                raw_dtype=t.tensor_type,
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, output)
