//! SwiGluGrad on the CPU: the gated backward (`ops::gated::backward`) with
//! SiLU.

use super::*;
use crate::lanes::detect::Available;
use crate::lanes::{dispatch_isa, Lanes};
use crate::ops::elementwise::dispatch_t;
use crate::ops::gated::backward::{self, Kern};
use crate::ops::gated::Silu;
use crate::runner::Runner;
use crate::workspace::{Dst, Src};

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &SwigluGradCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe { dispatch_isa!(isa, L => dispatch_t!(call.a.dtype, run::<L>(call, runner))) }
}

unsafe fn run<L: Lanes, T: Float>(call: &SwigluGradCall, runner: &dyn Runner) {
    let t = call.tiling;
    let o = operands(call.split, t.cols as usize);
    let (a, da) = (call.a.data as *const T, call.da.data as *mut T);
    let (b, db) = if call.split != 0 {
        (a.wrapping_add(o.b_offset), da.wrapping_add(o.b_offset))
    } else {
        (call.b.data as *const T, call.db.data as *mut T)
    };
    let k = Kern {
        dy: Src(call.dy.data as *const T),
        a: Src(a),
        b: Src(b),
        da: Dst(da),
        db: Dst(db),
        stride: o.stride,
        eager: call.rounding == ElemRounding::Eager,
        t,
    };
    // SAFETY: forwarded from `cpu`'s contract.
    unsafe { backward::run::<L, T, Silu>(&k, runner) }
}
