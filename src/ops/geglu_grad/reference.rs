//! GeGluGrad's f64 golden model.

use super::*;
use crate::ops::elementwise::dispatch_t;
use crate::ops::geglu::reference::gelu_f64;
use crate::workspace::{Dst, Src};

/// The f64 golden model.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &GegluGradCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_t!(call.a.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float>(call: &GegluGradCall) {
    let (m, n) = (call.tiling.rows as usize, call.tiling.cols as usize);
    let o = layout(call.split, call.activate_left, n);
    let (x, dx) = (call.a.data as *const T, call.da.data as *mut T);
    let (b, db) = if call.split != 0 {
        (x.wrapping_add(o.other), dx.wrapping_add(o.other))
    } else {
        (call.b.data as *const T, call.db.data as *mut T)
    };
    let (a, da) = (x.wrapping_add(o.gate), dx.wrapping_add(o.gate));
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
            let (g, v, u) = (dyr[j].to_f64(), ar[j].to_f64(), br[j].to_f64());
            let (act, d) = gelu_f64(v, call.approximate);
            dar[j] = T::from_f64(r(g * u) * d);
            dbr[j] = T::from_f64(g * r(act));
        }
    }
}
