"""Regenerates tests/fixtures/llamacpp/: tiny random GGUF models and llama.cpp's logits for them,
the oracle tests/test_llamacpp_fixtures.py compares the engine with.

- One F16 model per architecture whose layer differs from LLaMA's (qwen3, gemma, gemma2,
  gemma3, phi3, llama with Llama 3's rope_freqs and linear RoPE scaling, qwen2 with YaRN, phi3 with LongRoPE),
  written with the `gguf` package under the keys llama.cpp's converter writes.
- One F16 model per mixture-of-experts family: Mixtral (llama with experts), qwen2moe,
  qwen3moe, olmoe, smallthinker (with each of its router functions), gpt-oss (and one with
  its MXFP4 experts).
- One F32 llama model (n_embd 256, so that every k-quant fits) quantized by llama.cpp's own
  quantizer into each preset of `llama-quantize`: Q2_K, Q3_K_M, Q4_K_S, Q4_K_M, Q5_K_M, Q6_K,
  IQ4_XS (the float model itself is not kept); and a qwen3moe one into Q4_K_M.

Needs llama-cpp-python built from source (see README, "Against llama.cpp"):

    python scripts/llamacpp_fixtures.py
"""

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import llama_cpp  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from synth import write_model  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "llamacpp"

ARCHITECTURES = {
    "qwen3": dict(arch="qwen3", head_dim=32),
    "gemma": dict(arch="gemma", tied=True, head_dim=32, n_head_kv=1),
    "gemma2": dict(arch="gemma2", tied=True, n_layer=3, sliding_window=8),
    "gemma3": dict(
        arch="gemma3",
        tied=True,
        n_layer=7,
        n_ff=64,
        sliding_window=8,
        rope_base=1e6,
        rope_scaling=4.0,
        head_dim=32,
    ),
    "phi3": dict(arch="phi3", n_head_kv=4),
    "llama3": dict(arch="llama", rope_freqs=True, rope_scaling=2.0),
    "qwen2-yarn": dict(arch="qwen2", bias=True, rope_scaling=4.0, yarn_original_ctx=64),
    # llama.cpp's context (128) and the test's sessions (64) exceed the original 32: long factors
    "phi3-longrope": dict(arch="phi3", n_head_kv=4, longrope_original_ctx=32),
    # mixtures of experts: Mixtral (llama with experts, n_ff wide), Qwen2-MoE with its shared
    # expert and attention biases, Qwen3-MoE, OLMoE (q and k normed whole)
    "mixtral": dict(arch="llama", experts=dict(n_expert=4, n_used=2, n_ff_exp=96, ff_key=False)),
    "qwen2moe": dict(
        arch="qwen2moe", bias=True, experts=dict(n_expert=4, n_used=2, n_ff_exp=64, n_ff_shared=96)
    ),
    "qwen3moe": dict(arch="qwen3moe", head_dim=32, experts=dict(n_expert=8, n_used=3, n_ff_exp=32)),
    "olmoe": dict(
        arch="olmoe", n_head_kv=4, experts=dict(n_expert=4, n_used=2, ff_key=False, n_ff_exp=96)
    ),
    # SmallThinker: the router reads the layer input, ReGLU experts; with a window, the first of
    # every four layers attends fully without RoPE; its two router functions
    "smallthinker": dict(
        arch="smallthinker",
        n_layer=5,
        sliding_window=64,
        weight_scale=0.5,
        experts=dict(n_expert=4, n_used=2, n_ff_exp=64, gating="softmax"),
    ),
    "smallthinker-sigmoid": dict(
        arch="smallthinker",
        weight_scale=0.5,
        experts=dict(n_expert=4, n_used=2, n_ff_exp=64, gating="sigmoid"),
    ),
    # gpt-oss: attention biases and sinks, even layers sliding, YaRN on every layer, biased
    # router and experts, the clamped SwiGLU; and with its MXFP4 experts. (Weights at half
    # scale: at full scale this random model's attention is sharp enough that f16 rounding
    # moves a few tokens' logits by 1-3%, on either side; a seed whose tokens route apart.)
    "gpt-oss": dict(
        arch="gpt-oss",
        n_layer=3,
        sliding_window=8,
        rope_scaling=4.0,
        yarn_original_ctx=64,
        head_dim=32,
        weight_scale=0.5,
        seed=2,
        experts=dict(n_expert=4, n_used=2, n_ff_exp=64),
    ),
}
ARCHITECTURES["gpt-oss-mxfp4"] = dict(
    ARCHITECTURES["gpt-oss"], experts=dict(n_expert=4, n_used=2, n_ff_exp=64, dtype=Q.MXFP4)
)

PRESETS = {
    "Q2_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
    "Q3_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "Q4_K_S": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
    "IQ4_XS": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_XS,
}

N_TOKENS = 24


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    llm = llama_cpp.Llama(
        str(path), n_ctx=128, n_batch=128, n_threads=2, logits_all=True, verbose=False
    )
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def quantize(src: Path, dst: Path, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {dst.name}")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(1).integers(3, 260, size=N_TOKENS).tolist()
    logits = {"ids": np.array(ids, dtype=np.int32)}
    for name, kw in ARCHITECTURES.items():
        path = OUT / f"{name}.gguf"
        write_model(path, dtype=Q.F16, n_ctx=512, **kw)
        logits[name] = llama_cpp_logits(path, ids)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "f32.gguf"
        write_model(
            src,
            arch="llama",
            dtype=Q.F32,
            n_embd=256,
            n_ff=256,
            n_layer=1,
            n_head=4,
            n_head_kv=2,
            n_ctx=512,
            seed=5,
        )
        for name, ftype in PRESETS.items():
            path = OUT / f"llama-{name}.gguf"
            quantize(src, path, ftype)
            logits[f"llama-{name}"] = llama_cpp_logits(path, ids)
        # the experts as llama.cpp's quantizer lays them out in its most used preset
        src = Path(d) / "moe-f32.gguf"
        write_model(
            src,
            arch="qwen3moe",
            dtype=Q.F32,
            n_embd=256,
            n_ff=256,
            n_layer=1,
            n_head=4,
            n_head_kv=2,
            head_dim=64,
            n_ctx=512,
            seed=6,
            experts=dict(n_expert=4, n_used=2, n_ff_exp=256),
        )
        path = OUT / "qwen3moe-Q4_K_M.gguf"
        quantize(src, path, PRESETS["Q4_K_M"])
        logits["qwen3moe-Q4_K_M"] = llama_cpp_logits(path, ids)
    np.savez_compressed(
        OUT / "logits.npz", **logits, llama_cpp_version=np.array(llama_cpp.__version__)
    )
    for p in sorted(OUT.iterdir()):
        print(f"{p.name:24} {p.stat().st_size / 1024:8.1f} KiB")


if __name__ == "__main__":
    main()
