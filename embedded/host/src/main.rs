//! The no_std consumer as a Linux program: `#![no_std]`, `#![no_main]`, no
//! allocator, its own panic handler, and only three libc functions (write,
//! exit, abort) for output and status. Exit status 0 when every check passed.
//! `--bless` prints the hashes without failing on a mismatch (scripts/cross.sh
//! turns that output into `expected_hashes.txt`).
#![no_std]
#![no_main]

use core::ffi::{c_char, c_int, CStr};
use core::fmt::{self, Write};

#[link(name = "c")]
extern "C" {
    fn write(fd: c_int, buf: *const u8, count: usize) -> isize;
    fn exit(status: c_int) -> !;
    fn abort() -> !;
}

/// File descriptor 1 or 2 as a `fmt::Write`.
struct Fd(c_int);

impl Write for Fd {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut b = s.as_bytes();
        while !b.is_empty() {
            // SAFETY: `b` is a live byte slice; write reads at most `b.len()` bytes.
            let n = unsafe { write(self.0, b.as_ptr(), b.len()) };
            if n <= 0 {
                return Err(fmt::Error);
            }
            b = &b[n as usize..];
        }
        Ok(())
    }
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    let _ = writeln!(Fd(2), "panic: {info}");
    // SAFETY: abort has no preconditions.
    unsafe { abort() }
}

/// The precompiled `core` (built for unwinding) names the unwinder's
/// personality routine in its unwind tables; with `panic = "abort"` nothing
/// unwinds, so it is never called. Defining it here is what lets a stable
/// toolchain link a `no_std` executable without the `std` crate.
#[no_mangle]
pub extern "C" fn rust_eh_personality() {}

/// The C entry point (crt1's `__libc_start_main` calls it).
#[no_mangle]
extern "C" fn main(argc: c_int, argv: *const *const c_char) -> c_int {
    let mut bless = false;
    for i in 1..argc.max(0) as usize {
        // SAFETY: the C runtime passes `argc` valid NUL-terminated strings in `argv`.
        let arg = unsafe { CStr::from_ptr(*argv.add(i)) };
        bless |= arg.to_bytes() == b"--bless";
    }
    let mut out = Fd(1);
    let outcome = npukern_embedded_checks::run_all(&mut out, bless);
    let _ = writeln!(out, "{outcome}");
    // SAFETY: exit has no preconditions; it flushes nothing we rely on.
    unsafe { exit(if outcome.ok() { 0 } else { 1 }) }
}
