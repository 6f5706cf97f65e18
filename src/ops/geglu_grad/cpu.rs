//! GeGluGrad on the CPU: the gated backward (`ops::gated::backward`) with
//! GELU (tanh or erf form).

use super::*;
use crate::lanes::detect::Available;
use crate::lanes::{dispatch_isa, Lanes};
use crate::ops::elementwise::dispatch_t;
use crate::ops::gated::backward::{self, Kern};
use crate::ops::gated::{GeluErf, GeluTanh};
use crate::runner::Runner;
use crate::workspace::{Dst, Src};

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &GegluGradCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe { dispatch_isa!(isa, L => dispatch_t!(call.a.dtype, run::<L>(call, runner))) }
}

unsafe fn run<L: Lanes, T: Float>(call: &GegluGradCall, runner: &dyn Runner) {
    let t = call.tiling;
    let o = layout(call.split, call.activate_left, t.cols as usize);
    let (x, dx) = (call.a.data as *const T, call.da.data as *mut T);
    let (b, db) = if call.split != 0 {
        (x.wrapping_add(o.other), dx.wrapping_add(o.other))
    } else {
        (call.b.data as *const T, call.db.data as *mut T)
    };
    let k = Kern {
        dy: Src(call.dy.data as *const T),
        a: Src(x.wrapping_add(o.gate)),
        b: Src(b),
        da: Dst(dx.wrapping_add(o.gate)),
        db: Dst(db),
        stride: o.stride,
        eager: call.rounding == ElemRounding::Eager,
        t,
    };
    // SAFETY: forwarded from `cpu`'s contract.
    unsafe {
        match call.approximate {
            GeluApproximate::None => backward::run::<L, T, GeluErf>(&k, runner),
            _ => backward::run::<L, T, GeluTanh>(&k, runner),
        }
    }
}
