//! SwiGLU on the CPU: the gated forward (`ops::gated::forward`) with SiLU
//! (`lanes::math`'s exp: the same bits on every ISA).

use super::*;
use crate::lanes::detect::Available;
use crate::lanes::{dispatch_isa, Lanes};
use crate::ops::elementwise::dispatch_t;
use crate::ops::gated::forward::{self, Kern, NoAct};
use crate::ops::gated::Silu;
use crate::runner::Runner;
use crate::workspace::{Dst, Src};

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &SwigluCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe { dispatch_isa!(isa, L => dispatch_t!(call.a.dtype, run::<L>(call, runner))) }
}

unsafe fn run<L: Lanes, T: Float>(call: &SwigluCall, runner: &dyn Runner) {
    let t = call.tiling;
    let o = operands(call.split, t.cols as usize);
    let a = call.a.data as *const T;
    let b = if call.split != 0 {
        a.wrapping_add(o.b_offset)
    } else {
        call.b.data as *const T
    };
    let k = Kern {
        a: Src(a),
        b: Src(b),
        y: Dst(call.y.data as *mut T),
        act: Dst(core::ptr::null_mut()),
        stride: o.stride,
        eager: call.rounding == ElemRounding::Eager,
        t,
    };
    // SAFETY: forwarded from `cpu`'s contract; no act output.
    unsafe { forward::run::<L, T, Silu, NoAct>(&k, runner) }
}
