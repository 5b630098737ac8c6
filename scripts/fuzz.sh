#!/usr/bin/env bash
# Coverage-guided fuzzing: the GGUF reader, the tensor table and the model constructor (cargo fuzz,
# libFuzzer; fuzz/fuzz_targets/) and the tokenizers built from GGUF vocabularies (atheris;
# fuzz/tokenizer_fuzz.py). Fails when a target crashes: the input is left in
# fuzz/artifacts/<target>/ and the panic or assertion is printed above it.
# Usage: scripts/fuzz.sh [seconds in all, default 60] [target ...]
#   targets: gguf_header gguf_tensors model_build tokenizer (default: all, the time split evenly)
set -euo pipefail
cd "$(dirname "$0")/.."

TOTAL=${1:-60}
shift $(( $# > 0 ? 1 : 0 ))
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(gguf_header gguf_tensors model_build tokenizer)
PER=$(( TOTAL / ${#TARGETS[@]} ))
[ "$PER" -ge 1 ] || PER=1
PY=${PYTHON:-python3}

# Builds and runs are niced: CI machines and development boxes have few cores to share.
export CARGO_TARGET_DIR=fuzz/target
# a crash prints where it happened
export RUST_BACKTRACE=1
# No sanitizer (that would need a nightly toolchain): libFuzzer's coverage instrumentation and
# the panics of debug assertions and overflow checks (-a) are what the stable toolchain gives.
FUZZ_FLAGS=(--sanitizer none -O -a)
# Each input gets 10 s; a model the file describes gets 2 GiB.
LIBFUZZER_FLAGS=(-max_total_time="$PER" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1)

rust_targets=()
for t in "${TARGETS[@]}"; do [ "$t" = tokenizer ] || rust_targets+=("$t"); done
if [ ${#rust_targets[@]} -gt 0 ]; then
    command -v cargo-fuzz >/dev/null || nice -n 19 cargo install cargo-fuzz --locked
    for t in "${rust_targets[@]}"; do
        nice -n 19 cargo fuzz build "${FUZZ_FLAGS[@]}" "$t"
    done
fi
if [[ " ${TARGETS[*]} " == *" tokenizer "* ]]; then
    $PY -c "import atheris" 2>/dev/null || $PY -m pip install -q atheris
fi
BIN_DIR="$CARGO_TARGET_DIR/$(rustc -vV | sed -n 's/^host: //p')/release"

for t in "${TARGETS[@]}"; do
    # fuzz/corpus/<target> is what the fuzzer has found (not committed); the seeds are read
    # from fuzz/seeds/, the fixed findings from fuzz/regressions/fixed/ and, for the GGUF
    # targets, the llama.cpp-written test models.
    mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
    echo "== $t: ${PER} s"
    if [ "$t" = tokenizer ]; then
        run=(nice -n 19 $PY fuzz/tokenizer_fuzz.py "fuzz/corpus/$t" fuzz/seeds/tokenizer)
    else
        # the binary itself rather than `cargo fuzz run`, which prints a crashing input whole
        run=(nice -n 19 "$BIN_DIR/$t" "fuzz/corpus/$t" fuzz/seeds/gguf fuzz/regressions/fixed
            tests/fixtures/llamacpp)
    fi
    # libFuzzer's progress goes to a log (thousands of lines); its final figures are printed,
    # and on a crash the last lines, with the panic
    log="fuzz/artifacts/$t.log"
    if "${run[@]}" "${LIBFUZZER_FLAGS[@]}" -artifact_prefix="fuzz/artifacts/$t/" >"$log" 2>&1; then
        grep -E "^#[0-9]+ +DONE|^Done [0-9]+ runs|stat::number_of_executed_units" "$log" || true
    else
        tail -n 60 "$log"
        echo "fuzzing $t crashed; the input is in fuzz/artifacts/$t/ (log: $log)" >&2
        exit 1
    fi
done
