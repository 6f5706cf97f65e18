#!/usr/bin/env bash
# Beyond the host: every step exits non-zero on failure.
#
#   packages  (not in the default set) every Debian package the default
#             steps need, in one apt-get run (scripts/test.sh runs it first)
#   nostd     the no_std, no-alloc consumer (embedded/host) built and run on the
#             host, and the symbol check: the no-feature library (as the
#             consumer builds it) and the consumer reference no `std` /
#             `alloc` symbol
#   embedded  the no-feature library for thumbv7em-none-eabihf (Cortex-M4F, as
#             the firmware's workspace builds it) and riscv32imac-unknown-none-elf
#             (symbol-checked too)
#   aarch64   `cargo test -p npukern` (the integration tests) for
#             aarch64-unknown-linux-gnu under qemu-user,
#             bit hashes included: with the NEON lanes (automatic selection:
#             `neonbf16` where qemu's CPU has FEAT_BF16, and every cross-ISA
#             test compares it with `neon` and `portable`), then the
#             integration tests with the portable `wide` lanes forced
#             (NPK_MAX_CPU_ISA=portable), less the cross-ISA tests (under the
#             ceiling they repeat the first run's portable case)
#   cortex-m  the consumer on a Cortex-M4F under qemu-system-arm (mps2-an386),
#             reporting through semihosting, exiting with its status
#
#   embedded-aarch64  (not in the default set) the no-feature library for
#             aarch64-unknown-none, symbol-checked (16 min of CPU)
#   aarch64-lanes  (not in the default set) the library's unit tests on
#             aarch64 under qemu-user: the lanes (NEON conversions, math
#             sweeps thinned by NPK_SWEEP_THIN) on every ISA (a second
#             optimized build of the crate, 16 min of CPU)
#   aarch64-exhaustive  (not in the default set) the NEON conversions on all
#             2^32 f32 inputs under qemu-user (the ignored test in lanes/neon.rs)
#   aarch64-insns  (not in the default set) instructions executed per output
#             element, portable vs NEON vs NEON+BF16, for the norms at the seed
#             shapes, and per multiply-add for the matmul (the FMA chain, Arm's
#             pair dot): examples/one_call.rs under qemu-user with the counting
#             plugin scripts/qemu/insn_count.c (a proxy for cost: no timing
#             without the hardware). NPK_INSN_SHAPES="ROWSxCOLS ..." and
#             NPK_INSN_MATMUL_SHAPES="MxK ..." override the shapes.
#
# Usage: scripts/cross.sh [step...]   (no step: the first four, in that order)
#   NPK_CROSS_CACHE   where the cross builds' target directories live
#                     (default ~/.cache/npukern/cross; one subdirectory per
#                     checkout path, reused when present: cargo's dep-info
#                     paths are relative, so a target directory shared by two
#                     checkouts can pass one checkout's stale build off as
#                     the other's; a cache whose checkout is gone is removed)
#   NPK_BLESS=1       rewrite embedded/expected_hashes.txt from the host consumer
#   NPK_SWEEP_THIN=N  aarch64-lanes: the math sweeps take every N-th of their inputs
#                     (default 17; 1 runs them whole, as x86's cargo test does)
#   NPK_CROSS_SEED_CASES=1  also build and run tests/seed_cases.rs and the
#                     8 MiB streaming-output tests (tests/norm_streaming.rs) on
#                     aarch64: full-size cases, minutes each under qemu-user, so
#                     left out by default
#
# Targets other than the host's are built with Debian's Rust (rustc-web,
# cargo-web, rust-web-src: a compiler with its library source, so
# -Zbuild-std can build core/std for targets rustup cannot fetch here). The
# Debian packages are installed when missing (apt-get, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE_ROOT=${NPK_CROSS_CACHE:-$HOME/.cache/npukern/cross}
CACHE=$CACHE_ROOT/$(printf %s "$ROOT" | cksum | cut -d' ' -f1)
mkdir -p "$CACHE"
printf '%s\n' "$ROOT" >"$CACHE/checkout"
# Each checkout path has a cache of its own (~1 GB): a machine that tests
# many temporary clones filled its disk with them (26 GB). A cache whose
# checkout is gone is removed; one that names no checkout (made before the
# name was kept) once it is a week old.
for d in "$CACHE_ROOT"/*/; do
    d=${d%/}
    [ "$d" = "$CACHE" ] && continue
    if [ -f "$d/checkout" ]; then
        [ -d "$(cat "$d/checkout")" ] && continue
    elif [ -z "$(find "$d" -maxdepth 0 -mtime +7)" ]; then
        continue
    fi
    echo "== removing the cross-build cache of a gone checkout: $d"
    rm -rf "$d"
done

STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(nostd embedded aarch64 cortex-m)
for s in "${STEPS[@]}"; do
    case $s in packages | nostd | embedded | embedded-aarch64 | aarch64 | aarch64-lanes | aarch64-exhaustive | aarch64-insns | cortex-m) ;; *)
        echo "cross.sh: unknown step '$s' (packages nostd embedded embedded-aarch64 aarch64 aarch64-lanes aarch64-exhaustive aarch64-insns cortex-m)" >&2
        exit 2
        ;;
    esac
done
wants() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

# --- Debian packages --------------------------------------------------------
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'; }
APT_UPDATED=0
ensure() {
    local missing=()
    for p in "$@"; do installed "$p" || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "== apt-get install ${missing[*]}"
    local sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    if [ $APT_UPDATED -eq 0 ]; then
        "${sudo[@]}" apt-get update -qq
        APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
# Debian's Rust for -Zbuild-std; rust-lld (rust-web-llvm's link to lld-N)
# links the bare-metal targets.
debian_rust() {
    ensure rustc-web cargo-web rust-web-src rust-web-llvm
    local lld
    lld=$(readlink /usr/bin/rust-lld)
    ensure "$lld"
}
deb_cargo() { RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc RUSTC_BOOTSTRAP=1 /usr/bin/cargo "$@"; }

step_start() {
    echo "== cross: $1"
    T0=$SECONDS
}
step_end() { echo "== cross: $1 done in $((SECONDS - T0)) s"; }

# Every Debian package of the default steps in one apt-get run: what
# scripts/test.sh does first, so that the steps it runs side by side never
# call apt-get (two at once would contend for dpkg's lock).
if wants packages; then
    step_start packages
    ensure rustc-web cargo-web rust-web-src rust-web-llvm gcc-aarch64-linux-gnu libc6-dev-arm64-cross \
        qemu-user qemu-system-arm
    debian_rust
    step_end packages
fi

# --- the symbol check -------------------------------------------------------
# Legacy (_ZN3std, _ZN5alloc) and v0 (_R...3std) mangled paths into std or
# alloc, and the global allocator's entry points.
STD_SYMS='_ZN3std|_ZN5alloc|_R[[:alnum:]_]*(3std|5alloc)|__rust_(alloc|dealloc|realloc|alloc_zeroed|no_alloc_shim)|__rg_(alloc|dealloc|realloc)'
symbols() { # every symbol name in an ELF object, archive (rlib) or executable
    # readelf, not nm: binutils' nm hands objects that carry LLVM bitcode
    # (rustc's .llvmbc) to its LTO plugin, which fails on newer bitcode and
    # then lists nothing.
    readelf -sW "$1" | awk '$1 ~ /^[0-9]+:$/ && NF >= 8 { print $8 }'
}
no_std_symbols() { # file...: fails, listing them, if any symbol matches
    local f all hits
    for f in "$@"; do
        all=$(symbols "$f")
        if [ -z "$all" ]; then
            echo "FAIL: no symbols read from $f" >&2
            return 1
        fi
        hits=$(grep -E "$STD_SYMS" <<<"$all" || true)
        if [ -n "$hits" ]; then
            echo "FAIL: $f references std/alloc:" >&2
            echo "$hits" | head -20 >&2
            return 1
        fi
        echo "no std/alloc symbol among the $(wc -l <<<"$all") of ${f#"$CACHE"/}"
    done
}
# The check must be able to fail: a crate that uses std and alloc is caught.
symbol_check_control() {
    local d="$CACHE/control"
    mkdir -p "$d"
    printf '%s\n' '#![no_std]' 'extern crate alloc; extern crate std;' \
        '#[no_mangle] pub extern "C" fn control(n: usize) -> usize {' \
        '    let v: alloc::vec::Vec<u8> = alloc::vec![1; n]; std::thread::yield_now(); v.len() }' \
        >"$d/control.rs"
    rustc --edition 2021 --crate-type rlib -O --crate-name control -o "$d/libcontrol.rlib" "$d/control.rs"
    if no_std_symbols "$d/libcontrol.rlib" >/dev/null 2>&1; then
        echo "FAIL: the symbol check missed std/alloc in a crate that uses them" >&2
        return 1
    fi
    echo "symbol check control: std/alloc use detected as it must be"
}
# The rlib cargo just built for package npukern (from its JSON messages).
npukern_rlib() {
    sed -n '/"reason":"compiler-artifact"/{/"name":"npukern"/s/.*"filenames":\["\([^"]*\.rlib\)".*/\1/p}' | tail -1
}

# --- steps ------------------------------------------------------------------
if wants nostd; then
    step_start nostd
    symbol_check_control
    host_dir="$CACHE/host"
    (cd embedded && cargo fmt --all -- --check &&
        cargo clippy --release --locked -p npukern-embedded-checks -p npukern-nostd-host \
            --target-dir "$host_dir" -- -D warnings)
    # The library without default features (no std, no alloc), as the
    # consumer links it: one build of it serves both symbol checks.
    rlib=$( (cd embedded && cargo build --release --locked -p npukern-nostd-host --target-dir "$host_dir" \
        --message-format=json-render-diagnostics) | npukern_rlib)
    [ -n "$rlib" ] || { echo "FAIL: no rlib path from cargo" >&2; exit 1; }
    no_std_symbols "$rlib"
    host_bin="$host_dir/release/npukern-nostd-host"
    no_std_symbols "$host_bin"
    if [ "${NPK_BLESS:-0}" = 1 ]; then
        {
            echo "# Bit hashes of the no_std consumer's outputs (embedded/checks), written by"
            echo "# NPK_BLESS=1 scripts/cross.sh on x86_64; every target must reproduce them."
            "$host_bin" --bless | sed -n 's/^hash //p'
        } >embedded/expected_hashes.txt
        echo "blessed embedded/expected_hashes.txt"
        (cd embedded && cargo build --release --locked -p npukern-nostd-host --target-dir "$host_dir")
    fi
    "$host_bin" >"$CACHE/nostd-host.log" || {
        grep -v '^ok\|^hash' "$CACHE/nostd-host.log" >&2
        echo "FAIL: the no_std consumer failed on the host (log: $CACHE/nostd-host.log)" >&2
        exit 1
    }
    tail -1 "$CACHE/nostd-host.log"
    step_end nostd
fi

# The Cortex-M4F firmware (npukern-cortex-m4f), in the cortex-m step's
# target directory: the embedded step symbol-checks the no-feature library
# it links, and the cortex-m step runs it, one build between them. (Building
# only the checks package gave its dependencies other feature sets, hence
# other hashes: the cortex-m step then compiled `core`, the library and
# every dependency a second time, 8 min of CPU.) Prints the library's
# rlib.
thumbv7em_firmware() {
    (cd embedded && deb_cargo build --release --locked -p npukern-cortex-m4f -Zbuild-std=core \
        --target thumbv7em-none-eabihf --target-dir "$CACHE/embedded" \
        --message-format=json-render-diagnostics) | npukern_rlib
}

if wants embedded || wants embedded-aarch64; then
    step_start embedded
    debian_rust
    # Both targets in one cargo run: their `core` and library builds share
    # the cores (one rustc front end at a time leaves the other core idle).
    # aarch64-unknown-none is the opt-in step embedded-aarch64: its build
    # (three lane sets, Debian's rustc) took 16+ min of CPU, the longest of
    # CI's cross builds, and its code is the aarch64 step's less `std`.
    others=(riscv32imac-unknown-none-elf)
    wants embedded-aarch64 && others+=(aarch64-unknown-none)
    targets=()
    for t in "${others[@]}"; do targets+=(--target "$t"); done
    # Beside the firmware's build (another workspace, another target
    # directory): each is one codegen unit on one core at a time, so the two
    # together take the cores one alone leaves idle.
    others_json=$(mktemp)
    deb_cargo build -p npukern --lib --release --locked --no-default-features \
        -Zbuild-std=core "${targets[@]}" --target-dir "$CACHE/target" \
        --message-format=json-render-diagnostics >"$others_json" &
    others_pid=$!
    rlib=$(thumbv7em_firmware) || { wait "$others_pid" || true; exit 1; }
    wait "$others_pid" || { echo "FAIL: the ${others[*]} build" >&2; exit 1; }
    json=$(cat "$others_json")
    rm -f "$others_json"
    for t in "${others[@]}"; do
        rlib_t=$({ grep -F "/$t/release/" <<<"$json" || true; } | npukern_rlib)
        [ -n "$rlib_t" ] || { echo "FAIL: no rlib for $t" >&2; exit 1; }
        no_std_symbols "$rlib_t"
    done
    [ -n "$rlib" ] || { echo "FAIL: no rlib for thumbv7em-none-eabihf" >&2; exit 1; }
    no_std_symbols "$rlib"
    step_end embedded
fi

# `cargo test -p npukern` on aarch64 under qemu-user: cargo's own
# arguments, then `--` and the test harness's. A target directory of its
# own: scripts/test.sh runs this step beside the others, and a shared one
# would make either cargo wait for the other's lock.
aarch64_test() {
    local cargo_args=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
        cargo_args+=("$1")
        shift
    done
    [ $# -gt 0 ] && shift
    debian_rust
    ensure gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
        CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" \
        deb_cargo test -p npukern --release --locked --target aarch64-unknown-linux-gnu \
        -Zbuild-std=std,panic_unwind,test --target-dir "$CACHE/target-aarch64" "${cargo_args[@]}" -- "$@"
}

# The tests that compare every ISA the machine has (each checks the same
# bits, or the checked-in hashes, for every available ISA, portable
# included). With NPK_MAX_CPU_ISA=portable only portable is available, so
# under it they repeat the portable case of the NEON run: skipped there.
# The matmul's and attention's own checks loop over every ISA too (and a
# step-sized product's bits are the same on each): their repeat under
# portable took 284 s of qemu-user, 17% of the aarch64 step.
CROSS_ISA_TESTS=(output_bits_match_the_checked_in_hashes bits_are_the_same_everywhere
    bit_identical_across_threads_blocks_ub_and_isa bit_identical_across_isas
    bits_identical_across_isas infinite_rstd_gives_the_same_dx_for_every_row_length
    every_dtype_and_transpose_matches_the_reference_with_the_same_bits
    every_dtype_and_layout_matches_the_reference_with_the_same_bits
    accumulate_starts_each_sum_at_c edge_shapes larger_than_a_tile_in_every_dimension
    more_rows_than_a_block_and_keys_past_a_panel a_step_sized_bf16_product_against_float64)

if wants aarch64; then
    step_start aarch64
    # The library's unit tests and every integration test file, except
    # tests/seed_cases.rs and tests/norm_streaming.rs (full-size cases,
    # minutes each under qemu-user): those two are not built unless
    # NPK_CROSS_SEED_CASES=1. Examples are not built (no test runs them).
    tests=()
    for f in tests/*.rs; do
        t=$(basename "$f" .rs)
        if [ "${NPK_CROSS_SEED_CASES:-0}" != 1 ] && { [ "$t" = seed_cases ] || [ "$t" = norm_streaming ]; }; then
            continue
        fi
        # The store policy (the plan's store flag per page hint, the same
        # bits under each) is target-independent code, and aarch64's lanes
        # never stream: x86 runs it; here its >8 MiB outputs took 142 s of
        # qemu-user (NPK_CROSS_SEED_CASES=1 runs it too).
        if [ "${NPK_CROSS_SEED_CASES:-0}" != 1 ] && [ "$t" = store_policy ]; then
            continue
        fi
        tests+=(--test "$t")
    done
    echo "== aarch64: NEON lanes (automatic selection), integration tests"
    # The library's own unit tests are the step aarch64-lanes (not in the
    # default set): their harness is a second optimized build of the crate,
    # 16 min of CPU with Debian's rustc, which CI's 30 minutes cannot hold.
    NPK_MAX_CPU_ISA= aarch64_test "${tests[@]}" --
    # The integration tests through the dispatch with portable forced: the
    # accuracy, error and option tests on the portable lanes as aarch64
    # compiles them. The cross-ISA tests ran every ISA, portable included,
    # in the run above.
    skip=()
    for t in "${CROSS_ISA_TESTS[@]}"; do skip+=(--skip "$t"); done
    # Files whose every test checks every available ISA (portable among
    # them in the run above) are left out whole: tests/matmul_dot.rs's pair
    # dot took 273 s of qemu-user here repeating that run's portable case
    # (its one other test, a refusal, is ISA-independent and ran above);
    # tests/matmul_dot_arm.rs likewise.
    ptests=()
    for ((i = 1; i < ${#tests[@]}; i += 2)); do
        case "${tests[$i]}" in
            matmul_dot | matmul_dot_arm | host_fp_modes) ;;
            *) ptests+=(--test "${tests[$i]}") ;;
        esac
    done

    echo "== aarch64: portable lanes forced (NPK_MAX_CPU_ISA=portable), integration tests"
    NPK_MAX_CPU_ISA=portable aarch64_test "${ptests[@]}" -- "${skip[@]}"
    step_end aarch64
fi

if wants aarch64-lanes; then
    step_start aarch64-lanes
    # The lanes' math sweeps (exp, log, tanh, erf over the f32 bit patterns)
    # take every 17th of their inputs here (NPK_SWEEP_THIN): under qemu-user
    # the whole sweeps took half an hour of CPU; every exponent is still
    # covered, and x86 runs them whole. NPK_SWEEP_THIN=1 runs them whole here.
    NPK_SWEEP_THIN=${NPK_SWEEP_THIN:-17} NPK_MAX_CPU_ISA= aarch64_test --lib --
    step_end aarch64-lanes
fi

if wants aarch64-exhaustive; then
    step_start aarch64-exhaustive
    NPK_MAX_CPU_ISA= aarch64_test -- --ignored --exact --nocapture \
        lanes::neon::tests::neon_conversions_equal_the_definitions_on_all_2_pow_32_inputs
    step_end aarch64-exhaustive
fi

if wants aarch64-insns; then
    step_start aarch64-insns
    debian_rust
    ensure gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
    plugin="$CACHE/insn_count.so"
    gcc -shared -fPIC -O2 -fvisibility=hidden -Wall -Wextra -Werror -o "$plugin" scripts/qemu/insn_count.c
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
        deb_cargo build -p npukern --release --locked --target aarch64-unknown-linux-gnu \
        -Zbuild-std=std,panic_abort --example one_call --target-dir "$CACHE/target-insns"
    bin="$CACHE/target-insns/aarch64-unknown-linux-gnu/release/examples/one_call"
    # Instructions of the whole program with REPS calls.
    count() { # isa op dtype rows cols reps
        NPK_MAX_CPU_ISA=$1 qemu-aarch64 -L /usr/aarch64-linux-gnu -plugin "$plugin" \
            "$bin" "$2" "$3" "$4" "$5" "$6" 2>&1 | sed -n 's/^insns //p'
    }
    read -r -a shapes <<<"${NPK_INSN_SHAPES:-1024x12288 2048x4096 8192x5120 4096x4096}"
    # One row: `label`, then the instructions of one call of op on each
    # ISA per unit (`units` a call), printed with `fmt`.
    insn_row() { # label op dtype rows cols units fmt
        local line="$1" isa one two
        for isa in portable neon neonbf16; do
            one=$(count "$isa" "$2" "$3" "$4" "$5" 1)
            two=$(count "$isa" "$2" "$3" "$4" "$5" 2)
            [ -n "$one" ] && [ -n "$two" ] || { echo "FAIL: no count ($isa $2 $3 $4x$5)" >&2; exit 1; }
            line+=" $(awk -v a="$one" -v b="$two" -v e="$6" -v f="$7" 'BEGIN { printf f, (b - a) / e }') |"
        done
        echo "$line"
    }
    echo "| op | shape | dtype | portable | neon | neonbf16 |"
    echo "|---|---|---|---|---|---|"
    for op in rms_norm add_rms_norm rms_norm_grad; do
        for shape in "${shapes[@]}"; do
            rows=${shape%x*} cols=${shape#*x}
            for dt in bf16 f16 f32; do
                insn_row "| $op | $shape | $dt |" "$op" "$dt" "$rows" "$cols" $((rows * cols)) "%.2f"
            done
        done
    done
    # The matmul: instructions per multiply-add of `x W^T` (M = N = ROWS,
    # K = COLS): the FMA chain, and Arm's pair dot (BFMMLA on neonbf16,
    # the scalar model on the others).
    read -r -a mshapes <<<"${NPK_INSN_MATMUL_SHAPES:-96x512}"
    echo
    echo "| op | M=N x K | dtype | portable | neon | neonbf16 |"
    echo "|---|---|---|---|---|---|"
    for shape in "${mshapes[@]}"; do
        rows=${shape%x*} cols=${shape#*x}
        for opdt in matmul:f32 matmul:bf16 matmul_bf16_dot_arm:bf16; do
            op=${opdt%:*} dt=${opdt#*:}
            insn_row "| $op | $shape | $dt |" "$op" "$dt" "$rows" "$cols" $((rows * rows * cols)) "%.3f"
        done
    done
    step_end aarch64-insns
fi

if wants cortex-m; then
    step_start cortex-m
    debian_rust
    ensure qemu-system-arm
    thumbv7em_firmware >/dev/null
    elf="$CACHE/embedded/thumbv7em-none-eabihf/release/npukern-cortex-m4f"
    # Semihosting output goes to stdout; the program's exit request ends QEMU
    # with its status (the timeout guards against a hang).
    if ! timeout 600 qemu-system-arm -M mps2-an386 -cpu cortex-m4 -nographic -monitor none \
        -serial none -semihosting-config enable=on,target=native -kernel "$elf" \
        >"$CACHE/cortex-m.log"; then
        grep -v '^ok\|^hash' "$CACHE/cortex-m.log" >&2
        echo "FAIL: the no_std consumer failed on the Cortex-M4F (log: $CACHE/cortex-m.log)" >&2
        exit 1
    fi
    tail -1 "$CACHE/cortex-m.log"
    step_end cortex-m
fi
