//! GeGLU on the CPU: the gated forward (`ops::gated::forward`) with GELU
//! (tanh or erf form, `lanes::math`: the same bits on every ISA).

use super::*;
use crate::lanes::detect::Available;
use crate::lanes::{dispatch_isa, Lanes};
use crate::ops::elementwise::dispatch_t;
use crate::ops::gated::forward::{self, Kern, NoAct, WithAct};
use crate::ops::gated::{GeluErf, GeluTanh};
use crate::runner::Runner;
use crate::workspace::{Dst, Src};

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &GegluCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe { dispatch_isa!(isa, L => dispatch_t!(call.a.dtype, run::<L>(call, runner))) }
}

unsafe fn run<L: Lanes, T: Float>(call: &GegluCall, runner: &dyn Runner) {
    let t = call.tiling;
    let o = layout(call.split, call.activate_left, t.cols as usize);
    let base = call.a.data as *const T;
    let b = if call.split != 0 {
        base.wrapping_add(o.other)
    } else {
        call.b.data as *const T
    };
    let k = Kern {
        a: Src(base.wrapping_add(o.gate)),
        b: Src(b),
        y: Dst(call.y.data as *mut T),
        act: Dst(call.gelu.data as *mut T),
        stride: o.stride,
        eager: call.rounding == ElemRounding::Eager,
        t,
    };
    // An absent gelu output is the empty descriptor (NULL data).
    let act = !call.gelu.data.is_null();
    // SAFETY: forwarded from `cpu`'s contract; `gelu`, when present, has
    // y's shape (`prepare`).
    unsafe {
        match (call.approximate, act) {
            (GeluApproximate::Tanh, false) => forward::run::<L, T, GeluTanh, NoAct>(&k, runner),
            (GeluApproximate::Tanh, true) => forward::run::<L, T, GeluTanh, WithAct>(&k, runner),
            (GeluApproximate::None, false) => forward::run::<L, T, GeluErf, NoAct>(&k, runner),
            (GeluApproximate::None, true) => forward::run::<L, T, GeluErf, WithAct>(&k, runner),
        }
    }
}
