#!/usr/bin/env bash
# The project's one test command: formatting, lints, the no_std/no-alloc
# library build, and every test (unit, integration, release-mode seed cases,
# property tests, the header check, the C/C++ programs against the static and
# shared libraries, again under ASan/UBSan), then a short run of every fuzz
# target.
#
# Three jobs run beside the others, each with its output in a log printed
# whole when it ends (never interleaved), and each failing the command if it
# fails: the PyTorch environment's setup (downloads, from the start),
# `scripts/cross.sh aarch64` (the suite under qemu-user, after the Debian
# packages) and the fuzz smoke run (beside the adapter's tests). They take
# up what the other steps leave idle: the downloads wait on the network,
# and much of the rest runs on one core at a time (the codegen-units=1
# embedded builds, qemu-system-arm, pytest, the fuzz runs).
# NPK_SERIAL=1 runs everything one step at a time instead.
set -euo pipefail
cd "$(dirname "$0")/.."

START=$SECONDS
step() { # the heading of a step; the previous one's time
    [ -z "${STEP_NAME:-}" ] || echo "== ($STEP_NAME: $((SECONDS - STEP_T0)) s)"
    join_finished
    STEP_NAME=$1
    STEP_T0=$SECONDS
    echo "== $1 (at $((SECONDS - START)) s)"
}

LOGS=$(mktemp -d)
BG_NAMES=()
BG_PIDS=()
# A background job: its own session (so that it and everything it starts can
# be stopped together), output to $LOGS/NAME.log.
background() { # KEY DESCRIPTION COMMAND...
    local key=$1 what=$2
    shift 2
    echo "== $what: started beside the other steps (its output when it ends)"
    if [ "${NPK_SERIAL:-0}" = 1 ]; then
        "$@"
        return
    fi
    setsid "$@" >"$LOGS/$key.log" 2>&1 </dev/null &
    BG_NAMES+=("$key")
    BG_PIDS+=($!)
}
join() { # KEY: waits for it, prints its output, fails if it failed
    local i status
    for i in "${!BG_NAMES[@]}"; do
        [ "${BG_NAMES[$i]}" = "$1" ] && [ -n "${BG_PIDS[$i]}" ] || continue
        status=0
        wait "${BG_PIDS[$i]}" || status=$?
        BG_PIDS[i]=
        echo "== $1 (ran beside the other steps), its output:"
        cat "$LOGS/$1.log"
        if [ "$status" -ne 0 ]; then
            echo "FAIL: $1 exited with status $status" >&2
            exit "$status"
        fi
    done
}
join_finished() { # between steps: a job that has ended is joined (a failure stops the command early)
    local i
    for i in "${!BG_NAMES[@]}"; do
        if [ -n "${BG_PIDS[$i]}" ] && ! kill -0 "${BG_PIDS[$i]}" 2>/dev/null; then
            join "${BG_NAMES[$i]}"
        fi
    done
}
stop_background() { # on any exit: no job outlives the command
    local pid
    for pid in "${BG_PIDS[@]}"; do
        [ -n "$pid" ] && kill -- "-$pid" 2>/dev/null || true
    done
    rm -rf "$LOGS"
}
trap stop_background EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

background torch-setup "the PyTorch environment (scripts/torch_test.sh --setup: the venv, torch, the pinned transformers)" \
    ./scripts/torch_test.sh --setup

step "cargo fmt --check"
cargo fmt --all -- --check

step "the Debian packages of scripts/cross.sh (apt-get, only what is missing)"
./scripts/cross.sh packages

background aarch64 "scripts/cross.sh aarch64 (the suite on aarch64 under qemu-user)" ./scripts/cross.sh aarch64

step "cargo clippy --workspace --all-targets --all-features -- -D warnings"
cargo clippy --workspace --all-targets --all-features -- -D warnings

step "scripts/cross.sh nostd embedded cortex-m: the no_std, no-alloc library and its consumer (symbol check), embedded targets, Cortex-M4F"
./scripts/cross.sh nostd embedded cortex-m

step "cargo build --release (the C libraries)"
cargo build --release
# Every SIMD intrinsic inlined into its ISA's context: one LLVM keeps out of
# line (a closure called twice, an array iterator's fold) runs as a call per
# instruction, outside the target features: the AVX2 x W^T pack lost 30% of
# the matmul, AVX2 stochastic rounding ran 13-20x slower. CPU detection
# (xgetbv, cpuid) is the only intrinsic allowed out of line.
if nm -C target/release/libnpukern.so | grep -F 'core_arch::' | grep -v -E '_xgetbv|__cpuid'; then
    echo "FAIL: the intrinsics above are called out of line in libnpukern.so" >&2
    exit 1
fi

step "cargo test --release --workspace"
# The C/C++ programs (ffi-tests/tests/ffi.rs) link the libraries just built
# instead of building them once more into <target>/ffi.
target_dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
[ -n "$target_dir" ] || { echo "FAIL: no target directory from cargo metadata" >&2; exit 1; }
NPK_FFI_LIB_DIR="$target_dir/release" cargo test --release --workspace

# Beside the adapter: pytest runs on one core, which the fuzz runs (one
# process each) can have.
# 12 s a target (fuzz_smoke.sh's default is 20): the runs ended after the
# adapter's tests, the last step, and kept CI waiting on them.
background fuzz "scripts/fuzz_smoke.sh (every fuzz target 12 s from its seeds, stable sancov build)" \
    env NPK_FUZZ_SECONDS=12 ./scripts/fuzz_smoke.sh

step "the PyTorch adapter (scripts/torch_test.sh)"
join torch-setup
./scripts/torch_test.sh

step "waiting for scripts/fuzz_smoke.sh"
join fuzz

step "waiting for scripts/cross.sh aarch64"
join aarch64
step "all passed"
echo "== ./scripts/test.sh: $((SECONDS - START)) s"
