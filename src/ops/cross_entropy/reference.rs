//! CrossEntropy's f64 golden model: the formulas of `mod.rs` in f64 (max,
//! then the sum of `exp(x - max)`), one rounding of each output.

use super::*;
use crate::lanes::math::{exp_f64, log_f64, tanh_f64};
use crate::ops::elementwise::dispatch_t;
use crate::ops::embedding_dense_grad::{dispatch_index, IndexElem};
use crate::workspace::{Dst, Src};

/// The f64 golden model.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &CrossEntropyCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_t!(call.logits.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float>(call: &CrossEntropyCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_index!(call.target.dtype, reference_ti::<T>(call)) }
}

/// The soft-capped logit in f64.
pub(crate) fn capped_f64(z: f64, cap: f64) -> f64 {
    if cap > 0.0 {
        cap * tanh_f64(z / cap)
    } else {
        z
    }
}

/// `log sum_c exp(x_c)` in f64 with the CPU's special values: NaN when a
/// logit is NaN or +Inf, -Inf when every logit is -Inf.
pub(crate) fn lse_f64(n: usize, x: impl Fn(usize) -> f64) -> f64 {
    let m = (0..n)
        .map(&x)
        .fold(-(f32::MAX as f64), |m, v| if m < v { v } else { m });
    let s: f64 = (0..n).map(|j| exp_f64(x(j) - m)).sum();
    m + log_f64(s)
}

#[allow(clippy::needless_range_loop)]
unsafe fn reference_ti<T: Float, I: IndexElem>(call: &CrossEntropyCall) {
    let (n, c) = (call.tiling.rows as usize, call.tiling.cols as usize);
    let logits = Src(call.logits.data as *const T);
    // SAFETY: validated shapes; the reference runs alone on one thread.
    let tgt = unsafe { Src(call.target.data as *const I).get(0, n) };
    let w: Option<&[f32]> =
        // SAFETY: as above.
        (call.has_weight != 0).then(|| unsafe { Src(call.weight.data as *const f32).get(0, c) });
    let wc = |i: usize| w.map_or(1.0, |w| w[i] as f64);
    let w_sum: f64 = (0..c).map(wc).sum();
    let (ls, zs, cap) = (
        call.label_smoothing as f64,
        call.lse_square_scale as f64,
        call.softcap as f64,
    );
    let ignored = |r: usize| tgt[r].to_i64() == call.ignore_index;
    let den: f64 = (0..n)
        .filter(|&r| !ignored(r))
        .map(|r| wc(tgt[r].to_i64() as usize))
        .sum();
    let fwd = call.mode != CeMode::Backward;
    let bwd = call.mode != CeMode::Forward;
    let mut total = 0f64;
    for r in 0..n {
        // Element by element: dlogits may be the logits, each element read
        // before it is written.
        // SAFETY: inside the logits (validated shape).
        let x = |j: usize| capped_f64(unsafe { logits.get(r * c + j, 1)[0] }.to_f64(), cap);
        let ign = ignored(r);
        let t = tgt[r].to_i64() as usize;
        // The backward recomputes lse as the kernel does (an f32 lse_in
        // has lost `log s` once |max| is large).
        let lse = if fwd || !ign { lse_f64(c, x) } else { 0.0 };
        if fwd {
            if call.has_lse != 0 {
                // SAFETY: lse holds `n` f32.
                unsafe { Dst(call.lse.data as *mut f32).get(r, 1)[0] = lse as f32 };
            }
            let l = if ign {
                0.0
            } else {
                let mut l = wc(t) * (lse - x(t));
                if ls > 0.0 {
                    let smooth: f64 = (0..c).map(|j| wc(j) * (lse - x(j))).sum();
                    l = (1.0 - ls) * l + ls / c as f64 * smooth;
                }
                if zs != 0.0 {
                    l += zs * lse * lse;
                }
                l
            };
            if call.reduces() {
                total += l;
            } else {
                // SAFETY: loss holds `n` f32.
                unsafe { Dst(call.loss.data as *mut f32).get(r, 1)[0] = l as f32 };
            }
        }
        if bwd {
            let d = Dst(call.dlogits.data as *mut T);
            if ign {
                // SAFETY: dlogits holds `n * c` elements.
                unsafe { d.get(r * c, c) }.fill(T::from_f64(0.0));
                continue;
            }
            // SAFETY: grad holds `n` or 1 f32.
            let gsrc = |i: usize| unsafe { Src(call.grad.data as *const f32).get(i, 1)[0] as f64 };
            let g = if call.grad_per_row != 0 {
                gsrc(r)
            } else if call.mode == CeMode::Backward && call.reduction == Reduction::Mean {
                gsrc(0) / den
            } else {
                gsrc(0)
            };
            let a = (1.0 - ls) * wc(t) + ls * w_sum / c as f64 + 2.0 * zs * lse;
            for j in 0..c {
                let xj = x(j);
                let p = exp_f64(xj - lse);
                let mut v = p * a - ls * wc(j) / c as f64;
                if j == t {
                    v -= (1.0 - ls) * wc(t);
                }
                if cap > 0.0 {
                    let th = xj / cap;
                    v *= 1.0 - th * th;
                }
                // SAFETY: dlogits holds `n * c` elements; logit j was read.
                unsafe { d.get(r * c + j, 1)[0] = T::from_f64(g * v) };
            }
        }
    }
    if call.reduces() {
        let l = if call.reduction == Reduction::Mean {
            total / den
        } else {
            total
        };
        // SAFETY: loss holds one f32.
        unsafe { Dst(call.loss.data as *mut f32).get(0, 1)[0] = l as f32 };
    }
}
