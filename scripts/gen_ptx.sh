#!/usr/bin/env bash
# Compiles crates/cuda/kernels/powerinfer.cu to the committed PTX the engine loads at run time.
#   scripts/gen_ptx.sh          regenerate crates/cuda/kernels/powerinfer.ptx
#   scripts/gen_ptx.sh --check  fail if the committed PTX is not what the source compiles to
# Uses nvcc 13.0 from PyPI (nvidia-cuda-nvcc and the headers it needs), installed into
# .cache/cuda-13.0 on first use, so no CUDA toolkit is needed. ptxas then assembles the PTX for
# sm_90 as a check and prints each kernel's registers and spills.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=crates/cuda/kernels/powerinfer.cu
PTX=crates/cuda/kernels/powerinfer.ptx
ARCH=compute_75   # Turing and newer; the driver JIT-compiles it for the GPU at hand
TOOLS=.cache/cuda-13.0
VERSION=13.0.88

if [ ! -x "$TOOLS/nvidia/cu13/bin/nvcc" ]; then
    echo "installing nvcc $VERSION into $TOOLS" >&2
    python3 -m pip install -q --no-deps --target "$TOOLS" \
        "nvidia-cuda-nvcc==$VERSION" "nvidia-nvvm==$VERSION" "nvidia-cuda-crt==$VERSION" "nvidia-cuda-runtime==13.0.96"
fi
BIN="$TOOLS/nvidia/cu13/bin"
export PATH="$BIN:$PATH"

out=$(mktemp --suffix=.ptx)
trap 'rm -f "$out"' EXIT
nvcc -ptx -arch=$ARCH -O3 -std=c++17 "$SRC" -o "$out"
ptxas -arch=sm_90 -v "$out" -o /dev/null 2>&1 | grep -E "Compiling entry|registers|spill" | paste - - - >&2 || true
ptxas -arch=sm_90 "$out" -o /dev/null

if [ "${1:-}" = "--check" ]; then
    if ! diff -q "$out" "$PTX" >/dev/null; then
        echo "$PTX is stale: run scripts/gen_ptx.sh and commit the result" >&2
        diff "$out" "$PTX" | head -20 >&2
        exit 1
    fi
    echo "PTX matches $SRC"
else
    cp "$out" "$PTX"
    echo "wrote $PTX ($(wc -c <"$PTX") bytes)"
fi
