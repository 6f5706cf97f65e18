//! GeGLU's f64 golden model.

use super::*;
use crate::lanes::math::{erf_f64, exp_f64, tanh_f64};
use crate::ops::elementwise::dispatch_t;
use crate::workspace::{Dst, Src};

/// `sqrt(2 / pi)` in f64.
const BETA: f64 = core::f64::consts::SQRT_2 * core::f64::consts::FRAC_2_SQRT_PI * 0.5;
const KAPPA: f64 = 0.044_715;

/// `(gelu(x), gelu'(x))` in f64 for `approximate`.
pub(crate) fn gelu_f64(x: f64, approximate: GeluApproximate) -> (f64, f64) {
    match approximate {
        GeluApproximate::None => {
            let cdf = 0.5 * (1.0 + erf_f64(x * core::f64::consts::FRAC_1_SQRT_2));
            let pdf = exp_f64(-0.5 * x * x)
                * (core::f64::consts::FRAC_2_SQRT_PI * core::f64::consts::FRAC_1_SQRT_2 * 0.5);
            (x * cdf, cdf + x * pdf)
        }
        _ => {
            let t = tanh_f64(BETA * (x + KAPPA * x * x * x));
            let d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * BETA * (1.0 + 3.0 * KAPPA * x * x);
            (0.5 * x * (1.0 + t), d)
        }
    }
}

/// The f64 golden model.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &GegluCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_t!(call.a.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float>(call: &GegluCall) {
    let (m, n) = (call.tiling.rows as usize, call.tiling.cols as usize);
    let o = layout(call.split, call.activate_left, n);
    let base = call.a.data as *const T;
    let a = Src(base.wrapping_add(o.gate));
    let b = if call.split != 0 {
        Src(base.wrapping_add(o.other))
    } else {
        Src(call.b.data as *const T)
    };
    let y = Dst(call.y.data as *mut T);
    let act = Dst(call.gelu.data as *mut T);
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
            let g = gelu_f64(ar[j].to_f64(), call.approximate).0;
            let g = match call.rounding {
                ElemRounding::Eager => T::from_f64(g).to_f64(),
                _ => g,
            };
            yr[j] = T::from_f64(g * br[j].to_f64());
            if !act.0.is_null() {
                // SAFETY: as above (gelu has y's shape).
                unsafe { act.get(r * n + j, 1)[0] = T::from_f64(g) };
            }
        }
    }
}
