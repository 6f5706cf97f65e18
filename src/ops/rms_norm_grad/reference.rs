//! RmsNormGrad's f64 golden model.

use super::*;

/// The f64 golden model: dgamma column by column (before dx, which may
/// overwrite dy), then dx row by row.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &RmsNormGradCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_xg!(call.x.dtype, call.gamma.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float, G: Float>(call: &RmsNormGradCall) {
    let (m, n) = (call.tiling.rows as usize, call.tiling.cols as usize);
    let (dy, x) = (call.dy.data as *const T, call.x.data as *const T);
    let rstd = call.rstd.data as *const f32;
    let g = call.gamma.data as *const G;
    let off = call.gamma_offset as f64;
    // SAFETY: all reads and writes below use indices within the validated
    // lengths; raw accesses because dx may alias dy.
    unsafe {
        if call.has_dgamma != 0 || call.has_dgamma_cast != 0 {
            for j in 0..n {
                let mut s = 0.0f64;
                for r in 0..m {
                    let xh = x.add(r * n + j).read().to_f64() * rstd.add(r).read() as f64;
                    s += dy.add(r * n + j).read().to_f64() * xh;
                }
                if call.accumulate_dgamma != 0 {
                    s += (call.dgamma.data as *const f32).add(j).read() as f64;
                }
                if call.has_dgamma != 0 {
                    (call.dgamma.data as *mut f32).add(j).write(s as f32);
                }
                if call.has_dgamma_cast != 0 {
                    (call.dgamma_cast.data as *mut G)
                        .add(j)
                        .write(G::from_f64(s));
                }
            }
        }
        for r in 0..m {
            let rs = rstd.add(r).read() as f64;
            let at = |j: usize| {
                let gg = dy.add(r * n + j).read().to_f64() * (g.add(j).read().to_f64() + off);
                let xh = x.add(r * n + j).read().to_f64() * rs;
                (gg, xh)
            };
            let cc = (0..n)
                .map(|j| {
                    let (gg, xh) = at(j);
                    gg * xh
                })
                .sum::<f64>()
                / n as f64;
            for j in 0..n {
                let (gg, xh) = at(j);
                let mut d = rs * (gg - xh * cc);
                if call.has_dres != 0 {
                    d += (call.dres.data as *const T).add(r * n + j).read().to_f64();
                }
                (call.dx.data as *mut T)
                    .add(r * n + j)
                    .write(T::from_f64(d));
            }
        }
    }
}
