#!/usr/bin/env bash
# A short run of every fuzz target (fuzz/fuzz_targets/*), part of
# scripts/test.sh. Stable toolchain only: the targets are built with the
# sancov instrumentation libFuzzer needs passed by hand (what `cargo fuzz`
# does on nightly), with debug assertions and overflow checks, for the host
# triple (so build scripts stay uninstrumented). Each target starts from its
# committed seed corpus (fuzz/seeds/<target>, copied to a temporary
# directory: the seeds include every past finding, so this also replays
# them) and runs for NPK_FUZZ_SECONDS (default 20) seconds. Any crash, panic,
# leak or timeout fails the script; the input is kept in
# fuzz/artifacts/<target>/.
#
#   scripts/fuzz_smoke.sh                 # every target, 20 s each
#   NPK_FUZZ_SECONDS=600 scripts/fuzz_smoke.sh capi   # one target, longer
#
# Long campaigns: see docs/testing.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root/fuzz"

secs="${NPK_FUZZ_SECONDS:-20}"
host="$(rustc -vV | sed -n 's/^host: //p')"
target_dir="${NPK_FUZZ_TARGET_DIR:-$root/fuzz/target/cov}"
if [[ $# -gt 0 ]]; then
  targets=("$@")
else
  mapfile -t targets < <(sed -n 's/^name = "\(.*\)"/\1/p' Cargo.toml | grep -v '^npukern-fuzz$')
fi

export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
echo "== fuzz smoke: building ${targets[*]} (sancov, $host)"
bins=()
for t in "${targets[@]}"; do bins+=(--bin "$t"); done
cargo build --release --locked --target "$host" --target-dir "$target_dir" "${bins[@]}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
status=0
for t in "${targets[@]}"; do
  corpus="$work/$t"
  mkdir -p "$corpus" "$root/fuzz/artifacts/$t"
  if [[ -d "$root/fuzz/seeds/$t" ]]; then cp "$root/fuzz/seeds/$t"/* "$corpus"/ 2>/dev/null || true; fi
  echo "== fuzz smoke: $t for ${secs}s ($(ls "$corpus" | wc -l) seeds)"
  log="$work/$t.log"
  if "$target_dir/$host/release/$t" "$corpus" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$root/fuzz/artifacts/$t/" -print_final_stats=1 >"$log" 2>&1; then
    grep -E '^stat::number_of_executed_units|^Done' "$log" | tr '\n' ' '
    echo
  else
    tail -n 40 "$log"
    echo "fuzz smoke: $t FAILED; the input is in fuzz/artifacts/$t/ (reproduce: $target_dir/$host/release/$t <file>)" >&2
    status=1
  fi
done
exit $status
