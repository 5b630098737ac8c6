"""Writes a PowerInfer GGUF from a plain GGUF file or a Hugging Face safetensors folder plus
trained predictors, in PowerInfer's own layout (what its `convert-hf-to-powerinfer-gguf.py`
writes, so PowerInfer can load the result too):

- every layer's predictor first (`blk.{i}.fc1.weight` (H_i, n_embd), `blk.{i}.fc2.weight`
  (n_ff, H_i)), then the model's tensors in source order, with `ffn_down` (n_embd, n_ff)
  replaced by `ffn_down_t` (n_ff, n_embd): row j is neuron j's output vector;
- `powerinfer.sparse_threshold` (f32) and the magic patched from `GGUF` to `PWRI`.

Two keys PowerInfer ignores are added for this engine: `powerinfer_rs.predictor_thresholds`
(the trained cut-off of every layer) and `{arch}.ffn_activation`, because PowerInfer reads every
`llama` PWRI file as ReGLU, while a converted SwiGLU model (SmolLM2, Llama 2/3, Mistral) must
keep SiLU.

Tensors keep the source type unless `outtype` asks for F32, F16, Q4_0 or Q8_0 (2-D weights only;
norms and biases stay F32). Float sources transpose `ffn_down` exactly. A quantized `ffn_down`
must be dequantized, transposed and quantized again, because its blocks run along the other
axis; doing that in a 4-bit type adds a second rounding as large as the first (8.8% relative
error on SmolLM2's Q4_1 down projection), so by default it is stored as Q8_0 (0.6%), unless
`outtype` or `down_type` says otherwise (`down_type="source"` keeps the source type, e.g. Q4_0
for PowerInfer, whose sparse kernels handle only F16 and Q4_0).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .. import _core

OUT_TYPES = ("f32", "f16", "q4_0", "q8_0")
_ACTIVATION_KEY_VALUE = {
    "swiglu": "silu",
    "reglu": "relu",
    "dreglu": "drelu",
    "relu": "relu",
    "gelu": "gelu",
}


def _qtype(name: str):
    import gguf

    table = {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
    }
    if name not in table:
        raise ValueError(f"unsupported output type {name!r}: choose one of {', '.join(OUT_TYPES)}")
    return table[name]


def _encode(data: np.ndarray, qtype) -> np.ndarray:
    """float32 (rows, cols) -> the array GGUFWriter stores for `qtype`."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if data.shape[-1] % block:
        raise ValueError(
            f"rows of {data.shape[-1]} values cannot be stored as {qtype.name} (blocks of {block})"
        )
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def _predictor_cutoffs(pred: dict, sparse_threshold: float | None) -> tuple[float, np.ndarray]:
    per_layer = np.asarray(pred["thresholds"], dtype=np.float32)
    if sparse_threshold is None:
        # PowerInfer reads one cut-off for all layers: the median of the trained ones
        sparse_threshold = float(np.median(per_layer)) if len(per_layer) else 0.0
    return float(sparse_threshold), per_layer


def convert(
    source: str,
    predictors: str | dict,
    output: str | None = None,
    outtype: str | None = None,
    predictor_type: str = "f16",
    sparse_threshold: float | None = None,
    down_type: str | None = None,
) -> str:
    """Converts `source` (GGUF file or safetensors folder) with `predictors` (a file written by
    `train`, or its dict) into a PowerInfer GGUF at `output` (default `<source>.powerinfer.gguf`).
    Returns the output path."""
    from .training import load_predictors

    pred = load_predictors(predictors) if isinstance(predictors, (str, os.PathLike)) else predictors
    if outtype is not None:
        _qtype(outtype)
    if down_type not in (None, "source"):
        _qtype(down_type)
    ptype = _qtype(predictor_type)
    src = Path(source)
    if src.is_dir():
        output = output or str(src / "model.powerinfer.gguf")
        _convert_safetensors(src, pred, output, outtype, ptype, sparse_threshold)
    elif src.is_file():
        output = output or str(src.with_suffix("")) + ".powerinfer.gguf"
        _convert_gguf(src, pred, output, outtype, ptype, sparse_threshold, down_type)
    else:
        raise FileNotFoundError(f"conversion source {source!r} does not exist")
    return output


def _check_predictors(pred: dict, n_layer: int, n_embd: int, n_ff: int) -> None:
    if (
        len(pred["fc1"]) != n_layer
        or len(pred["fc2"]) != n_layer
        or len(pred["thresholds"]) != n_layer
    ):
        raise ValueError(
            f"the predictors cover {len(pred['fc1'])} layers but the model has {n_layer}"
        )
    for l, (a, b) in enumerate(zip(pred["fc1"], pred["fc2"])):
        if a.ndim != 2 or a.shape[1] != n_embd or b.shape != (n_ff, a.shape[0]):
            raise ValueError(
                f"layer {l} predictor has fc1 {a.shape} and fc2 {b.shape}; the model needs (H, {n_embd}) and ({n_ff}, H)"
            )


def _add_predictors(w, pred: dict, ptype) -> None:
    for l, (a, b) in enumerate(zip(pred["fc1"], pred["fc2"])):
        w.add_tensor(f"blk.{l}.fc1.weight", _encode(a, ptype), raw_dtype=ptype)
        w.add_tensor(f"blk.{l}.fc2.weight", _encode(b, ptype), raw_dtype=ptype)


def _add_sparse_keys(
    w, arch: str, activation: str, pred: dict, sparse_threshold: float | None
) -> None:
    global_thr, per_layer = _predictor_cutoffs(pred, sparse_threshold)
    w.add_float32("powerinfer.sparse_threshold", global_thr)
    w.add_array("powerinfer_rs.predictor_thresholds", [float(t) for t in per_layer])
    w.add_string(f"{arch}.ffn_activation", _ACTIVATION_KEY_VALUE[activation])


def _finish(w, output: str) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(output, "r+b") as fh:
        fh.write(b"PWRI")


def _convert_gguf(
    src: Path,
    pred: dict,
    output: str,
    outtype: str | None,
    ptype,
    sparse_threshold: float | None,
    down_type: str | None,
) -> None:
    import gguf

    with open(src, "rb") as fh:
        magic = fh.read(4)
    if magic == b"PWRI":
        raise ValueError(f"{src} is already a PowerInfer GGUF (magic PWRI)")
    model = _core.Model(str(src), 1)  # validates the file and tells the architecture
    cfg = model.config()
    arch, n_layer, n_embd, n_ff = cfg["architecture"], cfg["n_layer"], cfg["n_embd"], cfg["n_ff"]
    if arch not in ("llama", "mistral", "qwen2", "bamboo", "falcon", "opt"):
        raise ValueError(f"architecture {arch!r} cannot be converted")
    _check_predictors(pred, n_layer, n_embd, n_ff)
    reader = gguf.GGUFReader(str(src))

    w = gguf.GGUFWriter(output, arch)
    target = _qtype(outtype) if outtype else None
    skip = {
        "general.architecture",
        f"{arch}.ffn_activation",
        "powerinfer.sparse_threshold",
        "powerinfer_rs.predictor_thresholds",
    }
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in skip:
            continue
        if target is not None and field.name == "general.file_type":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        w.add_key_value(field.name, field.contents(), vtype, sub)
    if target is not None:
        w.add_file_type({"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}[outtype])
    _add_sparse_keys(w, arch, cfg["ffn_activation"], pred, sparse_threshold)

    _add_predictors(w, pred, ptype)
    for t in reader.tensors:
        name, ttype = t.name, t.tensor_type
        rows_cols = tuple(int(d) for d in reversed(t.shape))  # row-major shape
        is_matrix = len(rows_cols) == 2 and name.endswith(".weight") and "norm" not in name
        out_type = target if (target is not None and is_matrix) else ttype
        if name.endswith(".ffn_down.weight"):
            if down_type == "source":
                down_out = ttype
            elif down_type is not None:
                down_out = _qtype(down_type)
            elif target is not None or ttype in (
                gguf.GGMLQuantizationType.F32,
                gguf.GGMLQuantizationType.F16,
            ):
                down_out = out_type
            else:
                down_out = gguf.GGMLQuantizationType.Q8_0
            dense = gguf.quants.dequantize(t.data, ttype).reshape(rows_cols)  # (n_embd, n_ff)
            w.add_tensor(
                name.replace("ffn_down", "ffn_down_t"),
                _encode(dense.T, down_out),
                raw_dtype=down_out,
            )
        elif name.endswith(".ffn_down.bias"):
            w.add_tensor(
                name.replace("ffn_down", "ffn_down_t"), np.asarray(t.data, dtype=np.float32)
            )
        elif out_type == ttype:
            w.add_tensor(
                name,
                t.data,
                raw_shape=None if t.data.dtype == np.uint8 else rows_cols,
                raw_dtype=ttype,
            )
        else:
            dense = gguf.quants.dequantize(t.data, ttype).reshape(rows_cols)
            w.add_tensor(name, _encode(dense, out_type), raw_dtype=out_type)
    _finish(w, output)


# ----------------------------------------------------------------------------- safetensors


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face stores q and k rotated by halves; ggml's LLaMA RoPE rotates adjacent pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_safetensors(
    src: Path, pred: dict, output: str, outtype: str | None, ptype, sparse_threshold: float | None
) -> None:
    import gguf
    from safetensors.numpy import load_file

    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{src} has no config.json")
    hp = json.loads(cfg_path.read_text())
    archs = hp.get("architectures") or []
    if not archs or archs[0] not in ("LlamaForCausalLM", "MistralForCausalLM"):
        raise ValueError(
            f"safetensors conversion supports LlamaForCausalLM and MistralForCausalLM, not {archs}"
        )
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} has no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            tensors[k] = v
    n_layer = hp["num_hidden_layers"]
    n_embd = hp["hidden_size"]
    n_ff = hp["intermediate_size"]
    n_head = hp["num_attention_heads"]
    n_head_kv = hp.get("num_key_value_heads", n_head)
    head_dim = hp.get("head_dim") or n_embd // n_head
    act = {"silu": "swiglu", "relu": "reglu"}.get(hp.get("hidden_act", "silu"))
    if act is None:
        raise ValueError(f"hidden_act {hp.get('hidden_act')!r} is not supported (silu or relu)")
    _check_predictors(pred, n_layer, n_embd, n_ff)

    w = gguf.GGUFWriter(output, "llama")
    w.add_name(src.name)
    w.add_context_length(int(hp.get("max_position_embeddings", 2048)))
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(float(hp.get("rms_norm_eps", 1e-5)))
    w.add_rope_freq_base(float(hp.get("rope_theta", 10000.0)))
    w.add_file_type({None: 1, "f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}[outtype])
    _add_sparse_keys(w, "llama", act, pred, sparse_threshold)
    _add_hf_tokenizer(w, src, hp)

    target = _qtype(outtype or "f16")
    _add_predictors(w, pred, ptype)

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{src} has no tensor {name}")
        return tensors[name].astype(np.float32)

    def matrix(name: str, data: np.ndarray) -> None:
        w.add_tensor(name, _encode(data, target), raw_dtype=target)

    def vector(name: str, data: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))

    matrix("token_embd.weight", get("model.embed_tokens.weight"))
    vector("output_norm.weight", get("model.norm.weight"))
    if "lm_head.weight" in tensors and not hp.get("tie_word_embeddings", False):
        matrix("output.weight", get("lm_head.weight"))
    for l in range(n_layer):
        p = f"model.layers.{l}."
        vector(f"blk.{l}.attn_norm.weight", get(p + "input_layernorm.weight"))
        matrix(f"blk.{l}.attn_q.weight", _permute_qk(get(p + "self_attn.q_proj.weight"), n_head))
        matrix(f"blk.{l}.attn_k.weight", _permute_qk(get(p + "self_attn.k_proj.weight"), n_head_kv))
        matrix(f"blk.{l}.attn_v.weight", get(p + "self_attn.v_proj.weight"))
        matrix(f"blk.{l}.attn_output.weight", get(p + "self_attn.o_proj.weight"))
        vector(f"blk.{l}.ffn_norm.weight", get(p + "post_attention_layernorm.weight"))
        matrix(f"blk.{l}.ffn_gate.weight", get(p + "mlp.gate_proj.weight"))
        matrix(f"blk.{l}.ffn_up.weight", get(p + "mlp.up_proj.weight"))
        matrix(f"blk.{l}.ffn_down_t.weight", get(p + "mlp.down_proj.weight").T)
    _finish(w, output)


def _add_hf_tokenizer(w, src: Path, hp: dict) -> None:
    """gpt2-style vocabulary keys from a byte-level BPE `tokenizer.json`."""
    path = src / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{src} has no tokenizer.json (needed to put the vocabulary in the GGUF)"
        )
    tj = json.loads(path.read_text(encoding="utf-8"))
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(
            f"{path}: only byte-level BPE tokenizers are converted, found {model.get('type')!r}"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for t in tj.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["id"])
    n_vocab = max(hp.get("vocab_size", 0), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [4] * n_vocab  # user-defined until filled
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = 3 if i in special else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, adder in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        v = hp.get(key)
        if isinstance(v, int):
            adder(v)
    w.add_add_bos_token(False)
