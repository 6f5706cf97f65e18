//! The no_std consumer on a Cortex-M4F: runs every check on the stack and
//! reports through semihosting, exiting QEMU with the outcome (0 = pass).
//! Run by scripts/cross.sh on `qemu-system-arm -M mps2-an386`.
#![no_std]
#![no_main]

use core::fmt::{self, Write};

use cortex_m_rt::entry;
use cortex_m_semihosting::{debug, hio};

/// Semihosting stdout; output is dropped when the host has none.
struct Out(Option<hio::HostStream>);

impl Write for Out {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        match &mut self.0 {
            Some(h) => h.write_all(s.as_bytes()).map_err(|_| fmt::Error),
            None => Ok(()),
        }
    }
}

#[entry]
fn main() -> ! {
    let mut out = Out(hio::hstdout().ok());
    let outcome = npukern_embedded_checks::run_all(&mut out, false);
    let _ = writeln!(out, "{outcome}");
    debug::exit(if outcome.ok() {
        debug::EXIT_SUCCESS
    } else {
        debug::EXIT_FAILURE
    });
    // Only reached when no debugger/emulator handles the exit request.
    loop {
        cortex_m::asm::wfi();
    }
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    let _ = writeln!(Out(hio::hstderr().ok()), "panic: {info}");
    debug::exit(debug::EXIT_FAILURE);
    loop {
        cortex_m::asm::wfi();
    }
}
