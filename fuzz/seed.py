"""Writes the seed corpora of the fuzz targets (fuzz/seeds/): tiny GGUF models of every
architecture the engine runs, written with the `gguf` package as tests/synth.py writes the test
models (PowerInfer files and a GPU index included), a header holding every metadata value type,
and the tokenizer harness's inputs built from the texts of tests/fixtures/tokenizers.

The seeds are kept small (a few hundred KB in all) because they are committed; the fuzzer grows
its own corpus in fuzz/corpus/. The larger llama.cpp-written fixtures (tests/fixtures/llamacpp,
k-quants included) are read by scripts/fuzz.sh as they are.

    python3 fuzz/seed.py            # rewrites fuzz/seeds/
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from synth import write_model, write_powerinfer_model  # noqa: E402
from tokenizer_fuzz import encode_input, fixture_texts, tokenizer_names  # noqa: E402

# The smallest shapes every weight type below accepts (rows of 32 weights).
TINY = dict(n_embd=32, n_layer=1, n_ff=32, n_ctx=16)

# (file name, writer, arguments): one model per architecture, the weight types spread over them.
MODELS = [
    ("llama-q4_0-tied.gguf", write_model, dict(arch="llama", dtype=Q.Q4_0, tied=True)),
    ("llama-q4_0-untied.gguf", write_model, dict(arch="llama", dtype=Q.Q4_0)),
    (
        "mistral-q4_1-yarn.gguf",
        write_model,
        dict(arch="mistral", dtype=Q.Q4_1, rope_scaling=4.0, yarn_original_ctx=8),
    ),
    (
        "llama-f16-rope-freqs.gguf",
        write_model,
        dict(arch="llama", dtype=Q.F16, tied=True, rope_freqs=True, n_embd=16, n_ff=16),
    ),
    ("qwen2-q8_0.gguf", write_model, dict(arch="qwen2", dtype=Q.Q8_0, bias=True, tied=True)),
    ("qwen3-q4_0.gguf", write_model, dict(arch="qwen3", dtype=Q.Q4_0, tied=True)),
    ("gemma-q4_1.gguf", write_model, dict(arch="gemma", dtype=Q.Q4_1, tied=True)),
    (
        "gemma2-q4_0-swa.gguf",
        write_model,
        dict(arch="gemma2", dtype=Q.Q4_0, tied=True, sliding_window=2, n_layer=2),
    ),
    (
        "gemma3-q4_0.gguf",
        write_model,
        dict(arch="gemma3", dtype=Q.Q4_0, tied=True, sliding_window=2, n_layer=2),
    ),
    (
        "phi3-q8_0-longrope.gguf",
        write_model,
        dict(arch="phi3", dtype=Q.Q8_0, tied=True, longrope_original_ctx=8),
    ),
    (
        "llama-relu-pwri.gguf",
        write_powerinfer_model,
        dict(arch="llama", dtype=Q.Q4_1, predictor_dtype=Q.Q8_0),
    ),
    (
        "bamboo-pwri.gguf",
        write_powerinfer_model,
        dict(arch="bamboo", dtype=Q.Q4_0, predictor_dtype=Q.Q8_0),
    ),
    (
        "falcon-pwri.gguf",
        write_powerinfer_model,
        dict(arch="falcon", dtype=Q.Q4_0, n_head_kv=1, predictor_dtype=Q.Q8_0, attn_norm_2=True),
    ),
    (
        "opt-pwri.gguf",
        write_powerinfer_model,
        dict(arch="opt", dtype=Q.Q4_0, predictor_dtype=Q.Q8_0),
    ),
]


def write_every_value_type(path: Path) -> None:
    """A header holding each GGUF metadata value type once, arrays of each, and a custom
    alignment, with two small tensors."""
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("seed.u8", 200)
    w.add_int8("seed.i8", -100)
    w.add_uint16("seed.u16", 60000)
    w.add_int16("seed.i16", -30000)
    w.add_uint32("seed.u32", 4_000_000_000)
    w.add_int32("seed.i32", -2_000_000_000)
    w.add_float32("seed.f32", 1.5)
    w.add_uint64("seed.u64", 1 << 40)
    w.add_int64("seed.i64", -(1 << 40))
    w.add_float64("seed.f64", -2.25)
    w.add_bool("seed.bool", True)
    w.add_string("seed.str", "héllo")
    w.add_array("seed.arr_i32", [1, -2, 3])
    w.add_array("seed.arr_f32", [0.5, 1.5])
    w.add_array("seed.arr_str", ["a", "bc", ""])
    w.add_array("seed.arr_bool", [True, False])
    w.add_custom_alignment(64)
    w.add_tensor("a.weight", np.arange(8, dtype=np.float32))
    w.add_tensor("b.weight", np.arange(32, dtype=np.float16).reshape(2, 16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf_seeds(out: Path) -> None:
    from powerinfer_rs.placement.gpu_index import write_gpu_index

    for name, writer, args in MODELS:
        writer(out / name, **{**TINY, "n_head": 2, "n_head_kv": 1, **args})
    write_every_value_type(out / "every-value-type.gguf")
    write_gpu_index(
        str(out / "split.gpuidx"), [np.array([0, 3, 5]), np.array([], dtype=np.int64)], 8, 1 << 20
    )


def write_tokenizer_seeds(out: Path) -> None:
    """Each fixture text under each check, spread over the tokenizers."""
    n = len(tokenizer_names())
    for i, text in enumerate(fixture_texts()):
        data = text.encode("utf-8")[:512]
        for check in range(4):
            seed = encode_input(
                tokenizer=(i + check) % n, check=check, special=i % 2 == 1, payload=data
            )
            (out / f"{i:03d}-{check}").write_bytes(seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "seeds")
    args = ap.parse_args()
    for kind, write in (("gguf", write_gguf_seeds), ("tokenizer", write_tokenizer_seeds)):
        with tempfile.TemporaryDirectory() as tmp:
            write(Path(tmp))
            dest = args.out / kind
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(tmp, dest)
        files = sorted(dest.iterdir())
        size = sum(f.stat().st_size for f in files)
        print(f"{dest}: {len(files)} files, {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
