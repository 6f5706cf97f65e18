//! AdamW's f64 golden model: the module docs' formula in f64 from the
//! options themselves, one rounding per output (masters to f32, the param
//! from its master).

use super::plan::powi;
use super::{AdamWCall, ADAMW_AMSGRAD, ADAMW_L2, ADAMW_MAXIMIZE};
use crate::dtype::{DType, Float};
use crate::ops::grad_stats::reference::stats;
use crate::tensor_list::{ListSeg, TableList};
use crate::workspace::{Dst, Src};
use half::{bf16, f16};

/// The f64 golden model.
///
/// # Safety
/// As for `cpu::cpu`.
pub(crate) unsafe fn reference(call: &AdamWCall) {
    // SAFETY: the front end lowered the lists.
    let grads = unsafe { call.grads.rows() };
    // SAFETY: forwarded.
    let Some(coef) = (unsafe { super::cpu::decide(call, || stats(&mut TableList(grads)).norm()) })
    else {
        return;
    };
    let c = coef as f64;
    // SAFETY: forwarded.
    unsafe {
        match (call.params.dtype, call.exp_avgs.dtype) {
            (DType::BF16, DType::BF16) => by_g::<bf16, bf16>(call, c),
            (DType::BF16, _) => by_g::<bf16, f32>(call, c),
            (DType::F16, DType::F16) => by_g::<f16, f16>(call, c),
            (DType::F16, _) => by_g::<f16, f32>(call, c),
            _ => by_g::<f32, f32>(call, c),
        }
    }
}

unsafe fn by_g<P: Float, M: Float>(call: &AdamWCall, c: f64) {
    // SAFETY: forwarded.
    unsafe {
        match call.grads.dtype {
            DType::BF16 => step::<P, bf16, M>(call, c),
            DType::F16 => step::<P, f16, M>(call, c),
            _ => step::<P, f32, M>(call, c),
        }
    }
}

unsafe fn step<P: Float, G: Float, M: Float>(call: &AdamWCall, coef: f64) {
    let o = &call.options;
    let bc1 = 1.0 - powi(o.beta1, o.step);
    let bc2s = crate::lanes::sqrt_f64(1.0 - powi(o.beta2, o.step));
    let scale = call.consts.grad_scale as f64;
    let sign = if o.has(ADAMW_MAXIMIZE) { -1.0 } else { 1.0 };
    let l2 = o.has(ADAMW_L2);
    let ams = o.has(ADAMW_AMSGRAD);
    // SAFETY: the front end lowered the lists.
    let [ps, gs, ms, vs, xs, ws] = unsafe { call.tables() };
    let dst = |l: &[ListSeg], r: usize| l.get(r).map(|s| s.data);
    for r in 0..ps.len() {
        let n = ps[r].numel;
        // SAFETY: validated, pairwise disjoint tensors of `n` elements; the
        // reference runs alone on one thread.
        let (p, g, m, v, x, w) = unsafe {
            (
                Dst(ps[r].data as *mut P).get(0, n),
                Src(gs[r].data as *const G).get(0, n),
                Dst(ms[r].data as *mut M).get(0, n),
                Dst(vs[r].data as *mut M).get(0, n),
                dst(xs, r)
                    .filter(|_| ams)
                    .map(|d| Dst(d as *mut M).get(0, n)),
                dst(ws, r).map(|d| Dst(d as *mut f32).get(0, n)),
            )
        };
        let (mut x, mut w) = (x, w);
        for i in 0..n {
            let mut gi = g[i].to_f64() / scale * coef * sign;
            let mut pi = match &w {
                Some(w) => w[i] as f64,
                None => p[i].to_f64(),
            };
            if l2 {
                // torch adds the term only for a nonzero decay (as the
                // kernel): p * 0 would be NaN for an infinite p.
                if o.weight_decay != 0.0 {
                    gi += pi * o.weight_decay;
                }
            } else {
                pi *= 1.0 - o.lr * o.weight_decay;
            }
            let mi = m[i].to_f64() * o.beta1 + gi * (1.0 - o.beta1);
            let vi = v[i].to_f64() * o.beta2 + gi * gi * (1.0 - o.beta2);
            m[i] = M::from_f64(mi);
            v[i] = M::from_f64(vi);
            let d = match &mut x {
                Some(x) => {
                    let old = x[i].to_f64();
                    let mx = if vi < old { old } else { vi };
                    x[i] = M::from_f64(mx);
                    mx
                }
                None => vi,
            };
            pi -= o.lr / bc1 * mi / (crate::lanes::sqrt_f64(d) / bc2s + o.eps);
            match &mut w {
                Some(w) => {
                    w[i] = pi as f32;
                    p[i] = P::from_f32(w[i]);
                }
                None => p[i] = P::from_f64(pi),
            }
        }
    }
}
