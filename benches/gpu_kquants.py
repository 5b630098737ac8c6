"""GPU benchmark of the quantized types downloaded files use: for each type, a plain SwiGLU
model of LLaMA layer shape (default 16 layers, n_embd 2048, n_ff 5632, 32 heads, 8 KV heads:
TinyLlama-1.1B's layers, ~1.0 B layer parameters) with every matrix in that type, decoded
greedily on the CPU and wholly on the GPU in one process, the GPU both replaying each token's
recorded kernels (a CUDA graph, the default) and launching them one by one
(POWERINFER_CUDA_GRAPH=0). Reports decode tok/s on each, the ratios, the weight bytes a GPU token reads over its time as a fraction of the device-to-device
copy rate measured in the same run, and the relative distance of the GPU's logits from the
CPU's on a prompt (they read the input in int8 blocks of 32 on the GPU, 256 on the CPU for the
K-quants, so a few percent apart there; equal to rounding for Q4_0/Q8_0).

    python benches/gpu_kquants.py --out kquants.json          # on a GPU machine
    python benches/gpu_kquants.py --layers 2 --n-embd 256 --n-ff 512 --device emulated   # a dry run

Weights are valid blocks of random bytes with random-signed scales sized so that the decoded
weights have standard deviation ~0.02 (the `gguf` package decodes these formats but cannot
encode them; speed does not depend on the values).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from synth import F16_FIELDS, add_tiny_tokenizer, tiny_vocab

SCALE_FIELDS = {**F16_FIELDS, Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,)}
TYPES = {t.name.lower(): t for t in SCALE_FIELDS}


def unit_std(dtype: Q, rng) -> float:
    """Standard deviation of decoded random blocks whose scales are uniform(0.5, 1) in size."""
    block_len, block_bytes = GGML_QUANT_SIZES[dtype]
    raw = blocks(dtype, 64 * 256 // block_len, 1.0, rng)
    return float(dequantize(raw.reshape(64, -1), dtype).std())


def blocks(dtype: Q, n_blocks: int, unit: float, rng) -> np.ndarray:
    _, block_bytes = GGML_QUANT_SIZES[dtype]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in SCALE_FIELDS[dtype]:
        v = (rng.uniform(0.5, 1.0, n_blocks) * rng.choice([-1.0, 1.0], n_blocks) * unit).astype(
            np.float16
        )
        raw[:, off : off + 2] = v.view(np.uint8).reshape(n_blocks, 2)
    return raw


def write_model(
    path: str,
    dtype: Q,
    n_layer: int,
    n_embd: int,
    n_ff: int,
    n_head: int,
    n_head_kv: int,
    seed: int = 0,
) -> int:
    """Streams the model to disk; returns the bytes of the matrices a decode step reads."""
    rng = np.random.default_rng(seed)
    block_len, block_bytes = GGML_QUANT_SIZES[dtype]
    unit = 0.02 / unit_std(dtype, rng)
    n_vocab = len(tiny_vocab()[0])
    hd = n_embd // n_head
    kv = n_head_kv * hd
    tensors = [("token_embd.weight", (n_vocab, n_embd), None)]
    for l in range(n_layer):
        p = f"blk.{l}."
        tensors += [
            (p + "attn_norm.weight", (n_embd,), None),
            (p + "ffn_norm.weight", (n_embd,), None),
        ]
        for name, rows, cols in [
            ("attn_q", n_embd, n_embd),
            ("attn_k", kv, n_embd),
            ("attn_v", kv, n_embd),
            ("attn_output", n_embd, n_embd),
            ("ffn_gate", n_ff, n_embd),
            ("ffn_up", n_ff, n_embd),
            ("ffn_down", n_embd, n_ff),
        ]:
            tensors.append((p + name + ".weight", (rows, cols), dtype))
    tensors += [
        ("output_norm.weight", (n_embd,), None),
        ("output.weight", (n_vocab, n_embd), dtype),
    ]

    w = GGUFWriter(path, "llama")
    w.add_block_count(n_layer)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hd)
    add_tiny_tokenizer(w)
    read = 0
    for name, shape, t in tensors:
        if t is None:
            dt = np.float32 if len(shape) == 1 else np.float16
            w.add_tensor_info(
                name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize
            )
        else:
            nbytes = shape[0] * shape[1] // block_len * block_bytes
            w.add_tensor_info(
                name, (shape[0], nbytes // shape[0]), np.dtype(np.uint8), nbytes, raw_dtype=t
            )
            read += nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, shape, t in tensors:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        elif t is None:
            w.write_tensor_data((rng.standard_normal(shape) * 0.5).astype(np.float16))
        else:
            w.write_tensor_data(
                blocks(t, shape[0] * shape[1] // block_len, unit, rng).reshape(shape[0], -1)
            )
    w.close()
    return read


def decode_tps(engine, n_tokens: int, repeats: int, record: bool = True) -> float:
    """Median greedy decode tok/s; `record=False` launches each kernel (a session's choice,
    made when it is created)."""
    out = []
    for _ in range(repeats):
        os.environ["POWERINFER_CUDA_GRAPH"] = "1" if record else "0"
        s = engine._session()
        os.environ.pop("POWERINFER_CUDA_GRAPH")
        logits = s.eval(engine.tokenize("the an the in the", add_bos=False))
        t = time.perf_counter()
        for _ in range(n_tokens):
            logits = s.eval([int(np.argmax(np.atleast_2d(logits)[-1]))])
        out.append(n_tokens / (time.perf_counter() - t))
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--types",
        nargs="*",
        default=["q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs"],
        choices=sorted(TYPES),
    )
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-ff", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda, or emulated for a dry run")
    ap.add_argument("--model", default="/tmp/gpu_kquants.gguf")
    ap.add_argument("--out", default=None, help="JSON results file")
    a = ap.parse_args()

    from powerinfer_rs import Engine

    copy_rate = None
    if a.device == "cuda":
        from hybrid_13b import hbm_bandwidth

        copy_rate = hbm_bandwidth()
        print(f"device-to-device copy: {copy_rate / 1e12:.2f} TB/s", flush=True)
    results = {
        "shape": dict(
            layers=a.layers, n_embd=a.n_embd, n_ff=a.n_ff, heads=a.heads, kv_heads=a.kv_heads
        ),
        "copy_rate_bytes_s": copy_rate,
        "types": {},
    }
    print(
        f"{'type':8} {'GiB':>6} {'cpu tok/s':>10} {'launched':>9} {'graph':>8} {'graph/cpu':>9} {'of copy':>8} {'gpu-cpu dist':>13}",
        flush=True,
    )
    for name in a.types:
        t0 = time.perf_counter()
        read = write_model(a.model, TYPES[name], a.layers, a.n_embd, a.n_ff, a.heads, a.kv_heads)
        write_s = time.perf_counter() - t0
        cpu = Engine.load(a.model, device="cpu", n_ctx=256)
        gpu = Engine.load(a.model, device=a.device, n_ctx=256)
        ids = cpu.tokenize("the an in the of the in an the", add_bos=False)
        ref, got = cpu.logits(ids).astype(np.float64), gpu.logits(ids).astype(np.float64)
        dist = float((np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)).mean())
        r = {
            "weight_bytes_per_token": read,
            "write_s": write_s,
            "logit_distance_gpu_cpu": dist,
            "cpu_tps": decode_tps(cpu, a.tokens, a.repeats),
            "gpu_tps": decode_tps(gpu, a.tokens, a.repeats),
            "gpu_launched_tps": decode_tps(gpu, a.tokens, a.repeats, record=False),
        }
        r["gpu_vs_cpu"] = r["gpu_tps"] / r["cpu_tps"]
        r["graph_vs_launched"] = r["gpu_tps"] / r["gpu_launched_tps"]
        r["gpu_bytes_s"] = read * r["gpu_tps"]
        frac = r["gpu_bytes_s"] / copy_rate if copy_rate else float("nan")
        r["gpu_fraction_of_copy_rate"] = frac
        results["types"][name] = r
        print(
            f"{name:8} {read / 2**30:6.2f} {r['cpu_tps']:10.1f} {r['gpu_launched_tps']:9.1f} {r['gpu_tps']:8.1f} {r['gpu_vs_cpu']:8.1f}x {frac:8.1%} {dist:13.4f}",
            flush=True,
        )
        del cpu, gpu
        os.remove(a.model)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
