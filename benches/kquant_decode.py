"""Decode and prefill time of the k-quant family against Q4_0, one run, same machine, one
thread: a 4-layer synthetic model (n_embd 1024, n_ff 2816) per format, 16 decode tokens and a
64-token prompt, best of 3.

    python benches/kquant_decode.py
"""

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gguf import GGMLQuantizationType as Q
from powerinfer_rs import _core
from synth import write_model


def main() -> None:
    times, prefill = {}, {}
    with tempfile.TemporaryDirectory() as d:
        for dt in [Q.Q4_0, Q.Q5_0, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]:
            p = write_model(
                Path(d) / f"{dt.name}.gguf",
                dtype=dt,
                n_embd=1024,
                n_ff=2816,
                n_layer=4,
                n_head=8,
                n_head_kv=8,
            )
            s = _core.Session(_core.Model(p, 1), 64, "f16")
            s.eval([1])
            best = float("inf")
            for _ in range(3):
                s.truncate(1)
                t = time.perf_counter()
                for i in range(16):
                    s.eval([5 + i])
                best = min(best, (time.perf_counter() - t) / 16)
            times[dt.name] = best
            best = float("inf")
            for _ in range(3):
                s.truncate(0)
                t = time.perf_counter()
                s.eval(list(range(5, 69)))
                best = min(best, (time.perf_counter() - t) / 64)
            prefill[dt.name] = best
    print("type    decode ms/token       prefill ms/token")
    for name, t in times.items():
        p = prefill[name]
        print(
            f"{name:7s} {t * 1e3:7.2f} ({t / times['Q4_0']:4.2f}x Q4_0)  {p * 1e3:7.3f} ({p / prefill['Q4_0']:4.2f}x Q4_0)"
        )


if __name__ == "__main__":
    main()
