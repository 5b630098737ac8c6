#!/usr/bin/env bash
# llama.cpp's CUDA build on a GPU machine without network, for side-by-side runs there
# (benches/e2e_vs_llamacpp.py --device cuda): llama-cpp-python built from PyPI's source package
# with GGML_CUDA=on for the card the machine has.
#
#   scripts/llamacpp_cuda.sh pack            here: the source package (SHA-256 checked, the
#                                            version the fixtures use) without what the build
#                                            does not read (llama.cpp's model vocabularies, docs,
#                                            benchmarks, git objects: 77 -> 12 MB), and a wheel
#                                            of diskcache, into .gpu-llamacpp/ (git-ignored)
#   scripts/llamacpp_cuda.sh build [SECONDS] there, carrying .gpu-llamacpp: builds and installs into
#                                            /tmp/llamacpp in the background (setsid; its log in
#                                            /tmp/llamacpp-build.log) and waits up to SECONDS
#                                            (default 540)
#   scripts/llamacpp_cuda.sh wait [SECONDS]  a later call: waits for the build to end
#
# Then, there: PYTHONPATH=/tmp/site:/tmp/llamacpp python3 benches/e2e_vs_llamacpp.py --device cuda
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=/tmp/llamacpp-build.log

report() {
    tail -5 "$LOG" 2>/dev/null
    if [ -f /tmp/llamacpp.done ]; then
        echo "build ended: $(cat /tmp/llamacpp.done)"
    else
        echo "still building"
    fi
}

wait_for() {
    local limit=$1 t=0
    while [ ! -f /tmp/llamacpp.done ] && [ "$t" -lt "$limit" ]; do sleep 5; t=$((t + 5)); done
    report
}

case "${1:-}" in
pack)
    set -e
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    python3 - "$work" <<'EOF'
import hashlib, sys, urllib.request
sys.path.insert(0, "scripts")
import llamacpp_vocabs as v

dest = f"{sys.argv[1]}/sdist.tar.gz"
urllib.request.urlretrieve(v.SDIST, dest)
digest = hashlib.sha256(open(dest, "rb").read()).hexdigest()
if digest != v.SDIST_SHA256:
    raise SystemExit(f"{v.SDIST}: SHA-256 {digest}, expected {v.SDIST_SHA256}")
EOF
    tar xzf "$work/sdist.tar.gz" -C "$work"
    src=$(ls -d "$work"/llama_cpp_python-*)
    rm -rf "$src/vendor/llama.cpp/models" "$src/vendor/llama.cpp/docs" "$src/vendor/llama.cpp/benches" \
        "$src/vendor/llama.cpp/media" "$src/.git"
    rm -rf .gpu-llamacpp && mkdir -p .gpu-llamacpp
    tar czf ".gpu-llamacpp/$(basename "$src").tar.gz" -C "$work" "$(basename "$src")"
    python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu-llamacpp diskcache==5.6.3
    du -sh .gpu-llamacpp/*
    ;;
build)
    limit=${2:-540}
    rm -f /tmp/llamacpp.done
    # scikit-build-core, CMake, ninja and nvcc are on the machine: no build isolation, no index.
    # sm_90 (H100/H200) only: one architecture compiles in a fraction of the time of all
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
    setsid nohup bash -c 'CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$0 -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -v --no-deps --no-build-isolation --no-index \
        --target /tmp/llamacpp .gpu-llamacpp/*.tar.gz .gpu-llamacpp/*.whl > "$1" 2>&1; echo "exit $?" > /tmp/llamacpp.done' \
        "${arch:-90}" "$LOG" < /dev/null > /dev/null 2>&1 &
    wait_for "$limit"
    ;;
wait)
    wait_for "${2:-540}"
    ;;
*)
    sed -n '2,17p' "$0"
    exit 2
    ;;
esac
