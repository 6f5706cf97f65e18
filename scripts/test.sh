#!/usr/bin/env bash
# The project's one test command: formatting, lints, the no_std/no-alloc
# library build, and every test (unit, integration, release-mode seed cases,
# property tests, the header check, the C/C++ programs against the static and
# shared libraries, again under ASan/UBSan), then a short run of every fuzz
# target.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy --workspace --all-targets --all-features -- -D warnings"
cargo clippy --workspace --all-targets --all-features -- -D warnings

echo "== no_std, no alloc: the rlib without default features"
cargo rustc -p npukern --lib --release --no-default-features --crate-type rlib

echo "== scripts/cross.sh: no_std consumer + symbol check, embedded targets, aarch64, Cortex-M4F"
./scripts/cross.sh

echo "== cargo test --release --workspace"
cargo test --release --workspace

echo "== the PyTorch adapter (scripts/torch_test.sh)"
./scripts/torch_test.sh

echo "== scripts/fuzz_smoke.sh: every fuzz target ~20 s from its seeds (stable sancov build)"
./scripts/fuzz_smoke.sh
