//! SwiGluGrad's f64 golden model.

use super::*;
use crate::lanes::math::exp_f64;
use crate::ops::elementwise::dispatch_t;
use crate::workspace::{Dst, Src};

/// The f64 golden model.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &SwigluGradCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_t!(call.a.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float>(call: &SwigluGradCall) {
    let (m, n) = (call.tiling.rows as usize, call.tiling.cols as usize);
    let o = operands(call.split, n);
    let (a, da) = (call.a.data as *const T, call.da.data as *mut T);
    let (b, db) = if call.split != 0 {
        (a.wrapping_add(o.b_offset), da.wrapping_add(o.b_offset))
    } else {
        (call.b.data as *const T, call.db.data as *mut T)
    };
    let eager = call.rounding == ElemRounding::Eager;
    let r = |v: f64| if eager { T::from_f64(v).to_f64() } else { v };
    for row in 0..m {
        // SAFETY: validated shapes; the reference runs alone on one thread.
        let (dyr, ar, br, dar, dbr) = unsafe {
            (
                Src(call.dy.data as *const T).get(row * n, n),
                Src(a).get(row * o.stride, n),
                Src(b).get(row * o.stride, n),
                Dst(da).get(row * o.stride, n),
                Dst(db).get(row * o.stride, n),
            )
        };
        for j in 0..n {
            let (g, x, u) = (dyr[j].to_f64(), ar[j].to_f64(), br[j].to_f64());
            let den = 1.0 + exp_f64(-x);
            let s = 1.0 / den;
            dar[j] = T::from_f64(r(g * u) * s * (1.0 + x * (1.0 - s)));
            dbr[j] = T::from_f64(g * r(x / den));
        }
    }
}
