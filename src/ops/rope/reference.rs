//! RoPE's f64 golden model.

use super::*;
use crate::ops::dispatch_xg;
use crate::workspace::{Dst, Src};

/// The f64 golden model.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &RopeCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_xg!(call.q.dtype, call.cos.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float, C: Float>(call: &RopeCall) {
    let d = call.tiling.cols as usize;
    let h = d / 2;
    let eager = call.rounding == ElemRounding::Eager;
    let r = |v: f64| if eager { T::from_f64(v).to_f64() } else { v };
    let bwd = call.backward != 0;
    let k_rows = call.tiling.rows as usize - call.q_rows as usize;
    for (x, y, rows) in [
        (call.q, call.q_out, call.q_rows as usize),
        (call.k, call.k_out, k_rows),
    ] {
        if rows == 0 {
            continue;
        }
        let mut bc = Bcast::new(&x, &call.cos, 0);
        for row in 0..rows {
            // SAFETY: validated shapes; the reference runs alone on one thread.
            let (xr, yr, c, s) = unsafe {
                (
                    Src(x.data as *const T).get(row * d, d),
                    Dst(y.data as *mut T).get(row * d, d),
                    Src(call.cos.data as *const C).get(bc.row * d, d),
                    Src(call.sin.data as *const C).get(bc.row * d, d),
                )
            };
            for j in 0..h {
                let (x1, x2) = (xr[j].to_f64(), xr[h + j].to_f64());
                let (c1, c2) = (c[j].to_f64(), c[h + j].to_f64());
                let (s1, s2) = (s[j].to_f64(), s[h + j].to_f64());
                let (y1, y2) = if bwd {
                    (r(x1 * c1) + r(x2 * s2), r(x2 * c2) - r(x1 * s1))
                } else {
                    (r(x1 * c1) - r(x2 * s1), r(x2 * c2) + r(x1 * s2))
                };
                yr[j] = T::from_f64(y1);
                yr[h + j] = T::from_f64(y2);
            }
            bc.next();
        }
    }
}
