//! Matmul's f64 golden model: each element's sum in f64 (c's value first
//! with `accumulate`), rounded once to c's dtype.

use super::*;
use crate::ops::dispatch_xg;

/// The f64 golden model.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &MatmulCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_xg!(call.a.dtype, call.c.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float, O: Float>(call: &MatmulCall) {
    let t = &call.tiling;
    let (m, n, k) = (t.m as usize, t.n as usize, t.k as usize);
    let (a, b, c) = (
        call.a.data as *const T,
        call.b.data as *const T,
        call.c.data as *mut O,
    );
    let (ta, tb) = (call.trans_a != 0, call.trans_b != 0);
    for i in 0..m {
        for j in 0..n {
            // SAFETY: validated shapes; the reference runs alone.
            unsafe {
                let mut s = if call.accumulate != 0 {
                    (*c.add(i * n + j)).to_f64()
                } else {
                    0.0
                };
                for p in 0..k {
                    let x = *a.add(if ta { p * m + i } else { i * k + p });
                    let y = *b.add(if tb { j * k + p } else { p * n + j });
                    s += x.to_f64() * y.to_f64();
                }
                *c.add(i * n + j) = O::from_f64(s);
            }
        }
    }
}
