//! RmsNorm's f64 golden model.

use super::*;

/// The f64 golden model.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &RmsNormCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_xg!(call.x.dtype, call.gamma.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float, G: Float>(call: &RmsNormCall) {
    let (m, n) = (call.tiling.rows as usize, call.tiling.cols as usize);
    // SAFETY: validated lengths; the reference runs alone on one thread.
    let (x, g) = unsafe {
        (
            Src(call.x.data as *const T).get(0, m * n),
            Src(call.gamma.data as *const G).get(0, n),
        )
    };
    let y = Dst(call.y.data as *mut T);
    let off = call.gamma_offset as f64;
    for r in 0..m {
        let xr = &x[r * n..(r + 1) * n];
        let ss: f64 = xr.iter().map(|v| v.to_f64() * v.to_f64()).sum();
        let rstd = 1.0 / sqrt_f64(ss / n as f64 + call.eps as f64);
        if call.has_rstd != 0 {
            // SAFETY: rstd has m elements.
            unsafe { Dst(call.rstd.data as *mut f32).get(r, 1)[0] = rstd as f32 };
        }
        // SAFETY: row r of y; validated not to overlap the inputs.
        let yr = unsafe { y.get(r * n, n) };
        for j in 0..n {
            let h = xr[j].to_f64() * rstd;
            let h = match call.rounding {
                Rounding::Fused => h,
                Rounding::CastBeforeGamma => T::from_f64(h).to_f64(),
            };
            yr[j] = T::from_f64(h * (g[j].to_f64() + off));
        }
    }
}
