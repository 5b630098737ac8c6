#!/usr/bin/env bash
# Builds, here, what scripts/gpu_suite.sh needs on a GPU machine that has no Rust toolchain or
# network, into .gpu/ (git-ignored): the abi3 wheel, the Rust GPU kernel test binary, and
# wheels of the Python dependencies such machines lack (gguf, highspy) for CPython 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/whl
python3 -m maturin build --release --out .gpu >/dev/null
test_bin=$(cargo test --release -p powerinfer-cuda --test gpu_kernels --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_kernels":
        print(m["executable"])')
cp "$test_bin" .gpu/gpu_kernels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
    "highspy==$(python3 -c 'import importlib.metadata as m; print(m.version("highspy"))')"
du -sh .gpu
