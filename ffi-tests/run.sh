#!/usr/bin/env bash
# Builds the C11 and C++17 FFI tests against the npukern static and shared
# libraries and runs all four binaries. Used by tests/ffi.rs (so `cargo test`
# runs it); also usable by hand:
#
#   cargo build --release && ffi-tests/run.sh target/release
#
# Arguments: LIBDIR (holding libnpukern.a and libnpukern.so; default
# target/release). Environment: CC (default gcc), CXX (default g++),
# NPK_FFI_BUILD (output directory; default LIBDIR/ffi-tests), NPK_SANITIZE=1
# (build the C/C++ programs with -fsanitize=address,undefined
# -fno-sanitize-recover=all, into LIBDIR/ffi-tests/sanitize, and run them
# against the same, uninstrumented release libraries: any report fails).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
libdir="$(cd "${1:-$root/target/release}" && pwd)"
build="${NPK_FFI_BUILD:-$libdir/ffi-tests}"
sanitize="${NPK_SANITIZE:-0}"
[[ "$sanitize" == 1 ]] && build="$build/sanitize"
cc="${CC:-gcc}"
cxx="${CXX:-g++}"
mkdir -p "$build"

for f in libnpukern.a libnpukern.so; do
  [[ -f "$libdir/$f" ]] || { echo "run.sh: $libdir/$f not found (cargo build --release at the repository root first)" >&2; exit 2; }
done

version="$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$root/Cargo.toml" | head -n1)"
flags=(-Wall -Wextra -Werror -pedantic -O1 -g -I"$root/include" -I"$root/ffi-tests"
       "-DNPK_EXPECTED_VERSION=\"$version\"")
if [[ "$sanitize" == 1 ]]; then
  flags+=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
  # Leaks count too; a report of either sanitizer ends the program non-zero.
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
  echo "run.sh: sanitizers on (address, undefined)"
fi
# What the Rust standard library needs from the system when linked statically
# (`cargo rustc --release --lib --crate-type staticlib -- --print native-static-libs`).
static_libs=(-lgcc_s -lutil -lrt -lpthread -lm -ldl)
# Shared: by name, found at run time through the rpath.
# DT_RPATH (not RUNPATH): it outranks LD_LIBRARY_PATH, which `cargo test`
# points at target/<profile>, where an older libnpukern.so may lie.
shared_libs=(-L"$libdir" -l:libnpukern.so -Wl,--disable-new-dtags,-rpath,"$libdir" -lpthread -lm)

# The C snippets of the README and docs/c.md (each document's first ```c
# block), compiled as the documents have them by test_doc_snippet.c.
snippet_docs=(README.md docs/c.md)
for doc in "${snippet_docs[@]}"; do
  dir="$build/snippet/${doc//\//_}"
  mkdir -p "$dir"
  awk '/^```c$/ {on = 1; next} on && /^```$/ {exit} on' "$root/$doc" > "$dir/snippet.inc"
  [[ -s "$dir/snippet.inc" ]] || { echo "run.sh: no C block in $doc" >&2; exit 2; }
done

set -x
for doc in "${snippet_docs[@]}"; do
  "$cc" -std=c11 "${flags[@]}" -I"$build/snippet/${doc//\//_}" "-DNPK_SNIPPET_OF=\"$doc\"" \
    "$root/ffi-tests/test_doc_snippet.c" "$libdir/libnpukern.a" "${static_libs[@]}" \
    -o "$build/test_snippet_${doc//[\/.]/_}_static"
done
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_c.c" "$libdir/libnpukern.a" "${static_libs[@]}" \
  -o "$build/test_c_static"
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_c.c" "${shared_libs[@]}" -o "$build/test_c_shared"
"$cxx" -std=c++17 "${flags[@]}" -Wnarrowing "$root/ffi-tests/test_cpp.cpp" "$libdir/libnpukern.a" \
  "${static_libs[@]}" -o "$build/test_cpp_static"
"$cxx" -std=c++17 "${flags[@]}" "$root/ffi-tests/test_cpp.cpp" "${shared_libs[@]}" -o "$build/test_cpp_shared"
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_grad_stats.c" "$libdir/libnpukern.a" "${static_libs[@]}" \
  -o "$build/test_grad_stats_static"
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_elementwise.c" "$libdir/libnpukern.a" "${static_libs[@]}" \
  -o "$build/test_elementwise_static"
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_geglu.c" "$libdir/libnpukern.a" "${static_libs[@]}" \
  -o "$build/test_geglu_static"
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_matmul.c" "$libdir/libnpukern.a" "${static_libs[@]}" \
  -o "$build/test_matmul_static"
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_attention.c" "$libdir/libnpukern.a" "${static_libs[@]}" \
  -o "$build/test_attention_static"
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_adamw.c" "$libdir/libnpukern.a" "${static_libs[@]}" \
  -o "$build/test_adamw_static"
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_cross_entropy.c" "$libdir/libnpukern.a" "${static_libs[@]}" \
  -o "$build/test_cross_entropy_static"
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_regressions.c" "$libdir/libnpukern.a" "${static_libs[@]}" \
  -o "$build/test_regressions_static"
# The ABI growth test runs against the shared library, as a compiled NPU
# backend would.
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_abi.c" "${shared_libs[@]}" -o "$build/test_abi_shared"
# clang, where installed, is stricter about narrowing in braced initializers.
if command -v clang++ >/dev/null; then
  clang++ -std=c++17 "${flags[@]}" -Wnarrowing "$root/ffi-tests/test_cpp.cpp" "${shared_libs[@]}" \
    -o "$build/test_cpp_clang"
fi
"$cc" -std=c11 "${flags[@]}" "$root/ffi-tests/test_fuzz_regressions.c" "$libdir/libnpukern.a" "${static_libs[@]}" \
  -o "$build/test_fuzz_regressions_static"
set +x

# Make sure each binary is linked the way its name says.
for t in test_c test_cpp; do
  if ! readelf -d "$build/${t}_shared" | grep -q 'NEEDED.*libnpukern\.so'; then
    echo "run.sh: ${t}_shared does not load libnpukern.so" >&2; exit 1
  fi
  if readelf -d "$build/${t}_static" | grep -q 'NEEDED.*libnpukern'; then
    echo "run.sh: ${t}_static loads libnpukern dynamically" >&2; exit 1
  fi
done

# The pkg-config template, as an installed copy would be used: a staged
# prefix whose include/ and lib/ point at this tree and its libraries.
tests=(test_c_static test_c_shared test_cpp_static test_cpp_shared test_grad_stats_static test_elementwise_static test_geglu_static test_matmul_static test_attention_static test_adamw_static test_cross_entropy_static test_regressions_static test_abi_shared
       test_fuzz_regressions_static test_snippet_README_md_static
       test_snippet_docs_c_md_static)
if command -v pkg-config >/dev/null; then
  stage="$build/stage"
  mkdir -p "$stage/include" "$stage/lib/pkgconfig"
  ln -sf "$root/include/npukern.h" "$stage/include/npukern.h"
  ln -sf "$libdir/libnpukern.so" "$stage/lib/libnpukern.so"
  sed -e "s|@PREFIX@|$stage|" -e "s|@VERSION@|$version|" "$root/ffi-tests/npukern.pc.in" \
    > "$stage/lib/pkgconfig/npukern.pc"
  pc_flags="$(PKG_CONFIG_PATH="$stage/lib/pkgconfig" pkg-config --cflags --libs npukern)"
  # shellcheck disable=SC2086 # word splitting of the flags is intended
  "$cc" -std=c11 "${flags[@]}" -I"$root/ffi-tests" "$root/ffi-tests/test_c.c" $pc_flags \
    -Wl,-rpath,"$stage/lib" -lpthread -lm -o "$build/test_c_pkgconfig"
  tests+=(test_c_pkgconfig)
else
  echo "run.sh: pkg-config not found; the .pc template is not exercised"
fi

if [[ -x "$build/test_cpp_clang" ]] && command -v clang++ >/dev/null; then tests+=(test_cpp_clang); fi

status=0
run() { # NAME [ENV=VALUE...]
  local t="$1"
  shift
  echo "== $t $*"
  if ! env "$@" "$build/$t"; then
    echo "run.sh: $t $* FAILED" >&2
    status=1
  fi
}
for t in "${tests[@]}"; do run "$t"; done
# Under an ISA ceiling (see npk_exec.isa), so the narrower kernels run and
# forcing a wider ISA is NPK_ERR_ISA_UNAVAILABLE even on an AVX-512 machine.
run test_c_static NPK_MAX_CPU_ISA=portable NPK_REQUIRE_ISA_UNAVAILABLE=1
run test_cpp_shared NPK_MAX_CPU_ISA=avx2
exit $status
