//! The floating-point modes every kernel runs under: round to nearest even,
//! subnormals kept (no flush-to-zero, no denormals-are-zero), no default
//! NaN, every exception masked. A host thread may have set others — PyTorch's
//! `torch.set_flush_denormal(True)` sets x86's FTZ and DAZ on the calling
//! thread only, so a kernel's blocks on that thread flushed while those on
//! a worker thread did not, and the bits depended on the thread count. So
//! each ISA's `Lanes::enter` runs its block through `with_default_modes`:
//! it reads the control register (one instruction) and, only when a mode
//! differs, runs the block under the defaults and restores the caller's
//! register afterwards (also on unwinding).
//!
//! - x86-64: MXCSR's DAZ (6), exception masks (7-12), rounding control
//!   (13-14) and FTZ (15); the defaults are 0x1F80. The status flags (0-5)
//!   the block raises are kept.
//! - AArch64: FPCR's AHP (26), DN (25), FZ (24), RMode (23:22), FZ16 (19),
//!   and FEAT_AFP's NEP (2), AH (1), FIZ (0) (RES0 where the CPU lacks AFP,
//!   so clearing them is harmless); the defaults are all zero. (FPCR's trap
//!   enables are RAZ/WI on the cores that run Linux, and left alone.)
//! - Other targets (the embedded ones): the caller's modes.
//!
//! Under changed modes the block runs behind a call that is never inlined:
//! the compiler assumes the default environment and may move arithmetic
//! across the write of the register, but not into or out of a call it
//! cannot see through.

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
use core::arch::asm;

/// The mode bits of the control register.
#[cfg(target_arch = "x86_64")]
const MODES: u64 = 0xffc0;
/// Their default values.
#[cfg(target_arch = "x86_64")]
const DEFAULTS: u64 = 0x1f80;

/// The mode bits of the control register.
#[cfg(target_arch = "aarch64")]
const MODES: u64 = 1 << 26 | 1 << 25 | 1 << 24 | 3 << 22 | 1 << 19 | 0b111;
/// Their default values.
#[cfg(target_arch = "aarch64")]
const DEFAULTS: u64 = 0;

/// Reads the control register (MXCSR, zero-extended).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn control() -> u64 {
    let mut v = 0u32;
    // SAFETY: SSE is baseline on x86-64; STMXCSR writes the 4 bytes of v.
    unsafe {
        asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack, preserves_flags));
    }
    u64::from(v)
}

/// Writes the control register.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn set_control(v: u64) {
    let v = v as u32;
    // SAFETY: SSE is baseline on x86-64; v holds only MXCSR's defined bits
    // (a value read from it, with mode bits changed).
    unsafe {
        asm!("ldmxcsr [{}]", in(reg) &v, options(nostack, preserves_flags, readonly));
    }
}

/// Reads the control register (FPCR).
#[cfg(target_arch = "aarch64")]
#[inline(always)]
fn control() -> u64 {
    let v: u64;
    // SAFETY: FPCR is readable at EL0.
    unsafe { asm!("mrs {}, fpcr", out(reg) v, options(nomem, nostack, preserves_flags)) };
    v
}

/// Writes the control register.
#[cfg(target_arch = "aarch64")]
#[inline(always)]
fn set_control(v: u64) {
    // SAFETY: FPCR is writable at EL0; only rounding/flush/NaN modes change.
    unsafe { asm!("msr fpcr, {}", in(reg) v, options(nostack, preserves_flags)) };
}

/// Restores the caller's modes when the block ends (also on unwinding),
/// keeping the status flags the block raised (x86: MXCSR holds both).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
struct Restore(u64);

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
impl Drop for Restore {
    #[inline(always)]
    fn drop(&mut self) {
        set_control(self.0 & MODES | control() & !MODES);
    }
}

/// `f()` behind a call the compiler cannot see through.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(never)]
fn opaque<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Runs `f` under the library's floating-point modes (see the module note).
#[inline(always)]
pub(crate) fn with_default_modes<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    {
        with_modes(DEFAULTS, f)
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    f()
}

/// MXCSR's FTZ (15) and DAZ (6).
#[cfg(target_arch = "x86_64")]
const FTZ_DAZ: u64 = 1 << 15 | 1 << 6;

/// Runs `f` under the defaults plus x86's flush-to-zero and
/// denormals-are-zero (MXCSR's FTZ and DAZ), then restores the caller's
/// modes: an FMA then reads subnormal operands as zeros of their sign and
/// flushes a result that is tiny after rounding (x86 detects tininess after
/// rounding, with an unbounded exponent) to a zero of its sign, which is
/// each step of VDPBF16PS (`ops::matmul::pack::ftz_fma`'s model, checked
/// against the instruction and this mode in tests/matmul_dot.rs).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn with_flush_to_zero<R>(f: impl FnOnce() -> R) -> R {
    with_modes(DEFAULTS | FTZ_DAZ, f)
}

/// Runs `f` with the control register's mode bits `modes`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
fn with_modes<R>(modes: u64, f: impl FnOnce() -> R) -> R {
    let saved = control();
    if saved & MODES == modes {
        return f();
    }
    let _restore = Restore(saved);
    set_control(saved & !MODES | modes);
    opaque(f)
}

#[cfg(all(test, any(target_arch = "x86_64", target_arch = "aarch64")))]
mod tests {
    use super::*;

    /// The modes a host may set: flush-to-zero and round toward zero.
    #[cfg(target_arch = "x86_64")]
    const HOST: u64 = 1 << 15 | 1 << 6 | 3 << 13;
    #[cfg(target_arch = "aarch64")]
    const HOST: u64 = 1 << 24 | 3 << 22;

    /// 2^-140 from 2^-70 squared, and 1 + 1.5 2^-24: the subnormal kept
    /// and the sum rounded up to 1 + 2^-23 only under the default modes.
    #[inline(never)]
    fn probe(x: f32, y: f32) -> (f32, f32) {
        (
            core::hint::black_box(x) * core::hint::black_box(x),
            core::hint::black_box(1.0f32) + core::hint::black_box(y),
        )
    }

    #[test]
    fn a_block_runs_under_the_defaults_and_the_callers_modes_come_back() {
        let (x, y) = (2f32.powi(-70), 2f32.powi(-24) * 1.5);
        let want = (2f32.powi(-140), 1.0 + 2f32.powi(-23));
        assert_eq!(with_default_modes(|| probe(x, y)), want);
        let saved = control();
        set_control(saved & !MODES | DEFAULTS | HOST);
        // The host's modes are in force outside the block...
        let host = probe(x, y);
        let inside = with_default_modes(|| probe(x, y));
        let after = control();
        set_control(saved);
        assert_eq!(host.0, 0.0, "the host flushes");
        assert_eq!(host.1, 1.0, "the host rounds toward zero");
        // ...and not inside it; after it they are the host's again.
        assert_eq!(inside, want);
        assert_eq!(after & MODES, (saved & !MODES | DEFAULTS | HOST) & MODES);
    }

    /// Under `with_flush_to_zero` a subnormal result is a zero of its sign
    /// and a subnormal operand reads as zero, rounding stays to nearest,
    /// and the caller's modes come back.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn flush_to_zero_flushes_inside_only() {
        let (x, y) = (2f32.powi(-70), 2f32.powi(-24) * 1.5);
        let saved = control();
        let inside = with_flush_to_zero(|| probe(x, y));
        let sub = with_flush_to_zero(|| core::hint::black_box(2f32.powi(-140)) * 2.0);
        assert_eq!(inside, (0.0, 1.0 + 2f32.powi(-23)));
        assert_eq!(sub, 0.0);
        assert_eq!(control() & MODES, saved & MODES);
        assert_eq!(probe(x, y).0, 2f32.powi(-140));
    }
}
