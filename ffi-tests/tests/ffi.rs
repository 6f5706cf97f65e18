//! Builds and runs the C11 and C++17 programs of `ffi-tests/` against the
//! static and the shared library, so `cargo test` (and `cargo test
//! --release`) runs them.
//!
//! What it does:
//! 1. finds the profile directory this test binary was built in
//!    (`<target>/<profile>/deps/ffi-*` → `<target>/<profile>`);
//! 2. runs `cargo build -p npukern-capi` for that profile into `<target>/ffi`
//!    (`--release` for `release`), which writes `libnpukern.a` and
//!    `libnpukern.so` to `<target>/ffi/<profile>`;
//! 3. runs `ffi-tests/run.sh <that dir>`, which compiles the programs with
//!    the system gcc/g++ (`-Wall -Wextra -Werror -pedantic`), links each once
//!    statically and once dynamically, and runs them; then once more with
//!    `NPK_SANITIZE=1` (built with `-fsanitize=address,undefined`).
//!
//! With `NPK_FFI_LIB_DIR` set, step 2 is skipped and the libraries are taken
//! from that directory: `scripts/test.sh` sets it to `target/release` after
//! its own `cargo build --release` (the same library, so CI compiles it once
//! instead of twice; a directory built from other sources tests those).
//!
//! Needs bash, gcc and g++ (`CC`/`CXX` override) with the address and
//! undefined-behaviour sanitizer runtimes (libasan, libubsan: gcc's own
//! dependencies on Debian) for the second run. Set `NPK_SKIP_FFI=1` to skip
//! on a machine without a C toolchain, `NPK_SKIP_SANITIZE=1` to skip only the
//! sanitizer run (the test then only prints why).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root (this package is its `ffi-tests/` member).
fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repository root")
}

/// `<target>/<profile>` of this test binary.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("deps/");
    deps.parent().expect("<target>/<profile>").to_path_buf()
}

/// Builds the C libraries into `<target>/ffi/<profile>` and returns that
/// directory. A separate target dir: the running `cargo test` holds the lock
/// of its own.
fn build_library(profile_dir: &Path) -> PathBuf {
    let root = repo_root();
    let target_dir = profile_dir.parent().expect("<target>").join("ffi");
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .expect("profile directory name");
    let mut cmd = Command::new(env!("CARGO"));
    cmd.arg("build")
        .args(["-p", "npukern-capi"])
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir);
    match profile {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    let status = cmd.status().expect("run cargo build -p npukern-capi");
    assert!(
        status.success(),
        "cargo build -p npukern-capi failed: {status}"
    );
    target_dir.join(profile)
}

/// Builds the libraries and runs `ffi-tests/run.sh` on them (`NPK_SANITIZE`
/// set as given); asserts that it passed and that every program reported
/// a clean count.
fn run_programs(sanitize: bool) {
    if std::env::var_os("NPK_SKIP_FFI").is_some_and(|v| v == "1") {
        eprintln!("NPK_SKIP_FFI=1: the C/C++ FFI tests were skipped");
        return;
    }
    let dir = match std::env::var_os("NPK_FFI_LIB_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => build_library(&profile_dir()),
    };
    let script = repo_root().join("ffi-tests/run.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(&dir)
        .env("NPK_SANITIZE", if sanitize { "1" } else { "0" })
        .output()
        .expect("run ffi-tests/run.sh (needs bash, gcc, g++)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(
        out.status.success(),
        "ffi-tests/run.sh (NPK_SANITIZE={}) failed ({}); see the output above",
        sanitize as u8,
        out.status
    );
    // C and C++, static and shared, the grad-stats and fuzz-regression
    // programs, plus the two runs under an ISA ceiling (and the pkg-config
    // build where pkg-config exists) reported clean counts.
    assert!(stdout.matches(" passed, 0 failed").count() >= 8, "{stdout}");
}

#[test]
fn c_and_cpp_programs_pass() {
    run_programs(false);
}

/// The same programs built with `-fsanitize=address,undefined
/// -fno-sanitize-recover=all` (against the same release libraries): any
/// AddressSanitizer, LeakSanitizer or UBSan report fails the run.
#[test]
fn c_and_cpp_programs_pass_under_sanitizers() {
    if std::env::var_os("NPK_SKIP_SANITIZE").is_some_and(|v| v == "1") {
        eprintln!("NPK_SKIP_SANITIZE=1: the sanitizer run was skipped");
        return;
    }
    run_programs(true);
}
