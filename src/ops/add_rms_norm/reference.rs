//! AddRmsNorm's f64 golden model.

use super::*;

/// The f64 golden model (x_sum rounded to x's dtype, then the exact norm).
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &AddRmsNormCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_xg!(call.x1.dtype, call.gamma.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float, G: Float>(call: &AddRmsNormCall) {
    let (m, n) = (call.tiling.rows as usize, call.tiling.cols as usize);
    let (x1, x2) = (call.x1.data as *const T, call.x2.data as *const T);
    let g = call.gamma.data as *const G;
    let off = call.gamma_offset as f64;
    // Raw element reads/writes: x_sum may alias x1, so no slices are formed.
    // SAFETY: i < m*n, inside x1 and x2 (validated lengths).
    let sum = |i: usize| unsafe {
        T::from_f64(x1.add(i).read().to_f64() + x2.add(i).read().to_f64()).to_f64()
    };
    for r in 0..m {
        let ss: f64 = (0..n).map(|j| sum(r * n + j) * sum(r * n + j)).sum();
        let rstd = 1.0 / sqrt_f64(ss / n as f64 + call.eps as f64);
        if call.has_rstd != 0 {
            // SAFETY: rstd has m elements.
            unsafe { (call.rstd.data as *mut f32).add(r).write(rstd as f32) };
        }
        for j in 0..n {
            let i = r * n + j;
            let s = sum(i);
            let h = s * rstd;
            let h = match call.rounding {
                Rounding::Fused => h,
                Rounding::CastBeforeGamma => T::from_f64(h).to_f64(),
            };
            // SAFETY: as above.
            unsafe {
                let gj = g.add(j).read().to_f64() + off;
                (call.y.data as *mut T).add(i).write(T::from_f64(h * gj));
                if call.has_x_sum != 0 {
                    (call.x_sum.data as *mut T).add(i).write(T::from_f64(s));
                }
            }
        }
    }
}
