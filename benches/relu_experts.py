"""ReLU-gated experts against SwiGLU ones of the same shape: decode tok/s and weight bytes read
per token of two synthetic SmallThinker-shape files that differ only in their experts'
activation (`smallthinker.ffn_activation` "relu", the architecture's own, or "silu"). A ReLU
gate lets a token skip the up rows of the neurons it zeroes (exact); random weights zero about
half of them. Both files in one run, alternating, on this machine.

    python benches/relu_experts.py [--embd 1024 --experts 32 --used 4 --ff 768 --layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gguf import GGMLQuantizationType as Q  # noqa: E402
from powerinfer_rs import _core  # noqa: E402
from synth import write_model  # noqa: E402


def decode(path: str, threads: int, tokens: int) -> tuple[float, int]:
    """tok/s of `tokens` decode steps after a 4-token prompt, and bytes read per token."""
    session = _core.Session(_core.Model(path, threads), tokens + 8, "f16")
    session.eval([5, 6, 7, 8])
    session.take_stats()
    start = time.perf_counter()
    for t in range(tokens):
        session.eval([10 + t % 200])
    elapsed = time.perf_counter() - start
    return tokens / elapsed, session.take_stats()["weight_bytes_read"] // tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--ff", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        paths = {}
        for act in ("relu", "silu"):
            paths[act] = write_model(
                Path(d) / f"{act}.gguf",
                arch="smallthinker",
                n_embd=args.embd,
                n_ff=args.ff,
                n_head=8,
                n_head_kv=4,
                n_layer=args.layers,
                dtype=Q.Q4_0,
                activation=act,
                weight_scale=0.5,
                experts=dict(n_expert=args.experts, n_used=args.used, n_ff_exp=args.ff),
            )
        tps: dict[str, list[float]] = {"relu": [], "silu": []}
        read = {}
        for _ in range(args.repeats):
            for act, path in paths.items():
                t, b = decode(path, args.threads, args.tokens)
                tps[act].append(t)
                read[act] = b
    med = {a: statistics.median(v) for a, v in tps.items()}
    for act in ("relu", "silu"):
        print(f"{act}: {med[act]:.1f} tok/s (median of {args.repeats}), {read[act]} bytes/token")
    print(
        f"relu / silu: {med['relu'] / med['silu']:.3f}x tok/s, "
        f"{read['relu'] / read['silu']:.3f}x bytes read"
    )


if __name__ == "__main__":
    main()
