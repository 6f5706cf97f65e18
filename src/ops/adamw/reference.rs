//! AdamW's f64 golden model: the module docs' formula in f64 from the
//! options themselves, one rounding per output (masters to f32, the param
//! from its master). The compact formats are modelled bit for bit where
//! they are bits (a split master is split from its f32 master) and from
//! the f64 value where they round: stochastic rounding of the exact value
//! with the kernel's random bits.

use super::formats::{
    join, random, salt, split, ADAMW_SR_MOMENTS, ADAMW_SR_PARAMS, STREAM_MOMENTS, STREAM_PARAMS,
};
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
            (DType::F16, DType::BF16) => by_g::<f16, bf16>(call, c),
            (DType::F16, _) => by_g::<f16, f32>(call, c),
            (_, DType::BF16) => by_g::<f32, bf16>(call, c),
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

/// `x` rounded to bf16 stochastically: up in magnitude when `r` (16 bits)
/// plus the exact fraction of bf16's step below `x` reaches one step.
fn round_bf16_f64(x: f64, r: u32) -> bf16 {
    if !x.is_finite() {
        return bf16::from_f64(x);
    }
    let a = x.abs();
    // The largest f32 <= a, then its bf16 truncation.
    let mut f = a as f32;
    if f as f64 > a {
        f = f32::from_bits(f.to_bits() - 1);
    }
    let lo = f.to_bits() & 0xffff_0000;
    let e = ((lo >> 23) & 0xff).max(1) as i32;
    // 2^(e - 134), built from its bits (no_std has no powi).
    let step = f64::from_bits(((e - 134 + 1023) as u64) << 52);
    let frac = (a - f32::from_bits(lo) as f64) / step;
    let bits = if frac * 65536.0 + r as f64 >= 65536.0 {
        lo + 0x1_0000
    } else {
        lo
    };
    let b = bf16::from_bits((bits >> 16) as u16);
    if x < 0.0 {
        -b
    } else {
        b
    }
}

/// An output of the step: rounded to nearest, or stochastically to bf16
/// with random bits `r` (`M` is then bf16 by validation).
fn put<M: Float>(x: f64, r: Option<u32>) -> M {
    match r {
        Some(r) => M::from_f32(round_bf16_f64(x, r).to_f32()),
        None => M::from_f64(x),
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
    let st = &call.state;
    let split_masters = st.split_masters != 0;
    let sr_m = (st.rounding & ADAMW_SR_MOMENTS != 0).then(|| salt(st.seed, o.step, STREAM_MOMENTS));
    let sr_p = (st.rounding & ADAMW_SR_PARAMS != 0).then(|| salt(st.seed, o.step, STREAM_PARAMS));
    // SAFETY: the front end lowered the lists (and the keys).
    let ([ps, gs, ms, vs, xs, ws], keys) = unsafe { (call.tables(), call.keys()) };
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
                dst(ws, r)
                    .filter(|_| !split_masters)
                    .map(|d| Dst(d as *mut f32).get(0, n)),
            )
        };
        // SAFETY: as above; split masters' low halves are i16.
        let mut low = dst(ws, r)
            .filter(|_| split_masters)
            .map(|d| unsafe { Dst(d as *mut i16).get(0, n) });
        let (mut x, mut w) = (x, w);
        let key = keys.get(r).copied().unwrap_or(0);
        for i in 0..n {
            let k = key.wrapping_add(i as u64);
            let rm = sr_m.map(|s| random(s, k));
            let mut gi = g[i].to_f64() / scale * coef * sign;
            let mut pi = match (&w, &low) {
                (Some(w), _) => w[i] as f64,
                (None, Some(l)) => join((p[i].to_f32().to_bits() >> 16) as u16, l[i]) as f64,
                (None, None) => p[i].to_f64(),
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
            m[i] = put(mi, rm.map(|r| r & 0xffff));
            v[i] = put(vi, rm.map(|r| r >> 16));
            let d = match &mut x {
                Some(x) => {
                    let old = x[i].to_f64();
                    let mx = if vi < old { old } else { vi };
                    x[i] = put(mx, rm.map(|r| r >> 16));
                    mx
                }
                None => vi,
            };
            pi -= o.lr / bc1 * mi / (crate::lanes::sqrt_f64(d) / bc2s + o.eps);
            match (&mut w, &mut low) {
                (Some(w), _) => {
                    w[i] = pi as f32;
                    p[i] = P::from_f32(w[i]);
                }
                (None, Some(l)) => {
                    let (hi, lo) = split(pi as f32);
                    p[i] = P::from_f32(f32::from_bits((hi as u32) << 16));
                    l[i] = lo;
                }
                (None, None) => p[i] = put(pi, sr_p.map(|s| random(s, k) >> 16)),
            }
        }
    }
}
