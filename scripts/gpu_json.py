"""Gathers what scripts/gpu_suite.sh wrote to its output folder into benches/results/gpu.json.

    python scripts/gpu_json.py RESULTS_DIR [--date YYYY-MM-DD] [--args "--layers 8 --budget 1.6GiB"]

RESULTS_DIR holds gpu.txt, kernels.log, pytest.log, hybrid.json, kquants.json, moe_hybrid.json and
(when SmolLM2 was there) smollm2.json, as the suite writes them to $OUT.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("results")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument(
        "--args",
        default="--layers 8 --budget 1.6GiB",
        help="the benchmark arguments the suite ran with",
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "benches", "results", "gpu.json"))
    a = ap.parse_args()

    def read(name: str) -> str:
        with open(os.path.join(a.results, name)) as f:
            return f.read()

    def lines(name: str, pattern: str) -> list[str]:
        return [ln.strip() for ln in read(name).splitlines() if re.search(pattern, ln)]

    hybrid = json.loads(read("hybrid.json"))
    offload = hybrid["offload"]["tps"]
    out = {
        "machine": {
            "gpu": read("gpu.txt").strip(),
            "cpu_cores": 16,
            "memory": "128 GiB",
            "note": "GPU machine; CPU rows ran on its 16 cores",
        },
        "date": a.date,
        "commands": {
            "build_here": "scripts/gpu_bundle.sh",
            "stage_there": "scripts/gpu_suite.sh --stage   (twice: carrying .gpu-model, then .gpu-model2: SmolLM2's first two parts, the kernel tests)",
            "suite_there": f"scripts/gpu_suite.sh {a.args}   (carrying .gpu: kernel tests, pytest -m gpu, benches/hybrid_13b.py, benches/moe_hybrid.py, benches/gpu_kquants.py, benches/gpu_smollm2.py)",
            "collect": f'python scripts/gpu_json.py RESULTS_DIR --args "{a.args}"',
        },
        "kernel_tests": lines("kernels.log", r"^test |test result"),
        "pytest_gpu": lines("pytest.log", r"PASSED|FAILED|ERROR|passed|failed"),
        "hybrid_13b_shape": {
            "model": "synthetic ReGLU, LLaMA-13B layer shape (n_embd 5120, n_ff 13824), F16; predictors at the file's cut-off",
            "command": f"python3 benches/hybrid_13b.py {a.args}",
            "decode_tok_s": {k: round(v["tps"], 2) for k, v in hybrid.items()},
            "vs_layer_offload": {k: round(v["tps"] / offload, 2) for k, v in hybrid.items()},
            "runs": hybrid,
        },
    }
    if os.path.exists(os.path.join(a.results, "kquants.json")):
        k = json.loads(read("kquants.json"))
        out["quantized_types_1b_shape"] = {
            "model": "synthetic SwiGLU, TinyLlama-1.1B layer shape, every matrix in the type; random valid blocks",
            "command": "python3 benches/gpu_kquants.py",
            "decode_tok_s": {
                t: {
                    "cpu": round(r["cpu_tps"], 1),
                    "gpu_launched": round(r["gpu_launched_tps"], 1),
                    "gpu_graph": round(r["gpu_tps"], 1),
                }
                for t, r in k["types"].items()
            },
            **k,
        }
    if os.path.exists(os.path.join(a.results, "moe_hybrid.json")):
        out["moe_hybrid"] = {
            "command": "python3 benches/moe_hybrid.py",
            **json.loads(read("moe_hybrid.json")),
        }
    if os.path.exists(os.path.join(a.results, "smollm2.json")):
        out["smollm2_135m_q4_1"] = {
            "command": "python3 benches/gpu_smollm2.py",
            **json.loads(read("smollm2.json")),
        }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
