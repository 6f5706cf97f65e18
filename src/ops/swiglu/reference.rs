//! SwiGLU's f64 golden model.

use super::*;
use crate::lanes::math::exp_f64;
use crate::ops::elementwise::dispatch_t;
use crate::workspace::{Dst, Src};

/// `silu(a) = a / (1 + e^-a)` in f64.
pub(crate) fn silu_f64(a: f64) -> f64 {
    a / (1.0 + exp_f64(-a))
}

/// The f64 golden model.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &SwigluCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_t!(call.a.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float>(call: &SwigluCall) {
    let (m, n) = (call.tiling.rows as usize, call.tiling.cols as usize);
    let o = operands(call.split, n);
    let a = Src(call.a.data as *const T);
    let b = if call.split != 0 {
        Src((call.a.data as *const T).wrapping_add(o.b_offset))
    } else {
        Src(call.b.data as *const T)
    };
    let y = Dst(call.y.data as *mut T);
    for r in 0..m {
        // SAFETY: validated shapes; the reference runs alone on one thread.
        let (ar, br, yr) = unsafe {
            (
                a.get(r * o.stride, n),
                b.get(r * o.stride, n),
                y.get(r * n, n),
            )
        };
        for j in 0..n {
            let s = silu_f64(ar[j].to_f64());
            let s = match call.rounding {
                ElemRounding::Eager => T::from_f64(s).to_f64(),
                _ => s,
            };
            yr[j] = T::from_f64(s * br[j].to_f64());
        }
    }
}
