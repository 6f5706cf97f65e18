//! AdamW's f64 golden model: the module docs' formula in f64 from the
//! options themselves, one rounding per output (masters to f32, the param
//! from its master). The compact formats are modelled bit for bit where
//! they are bits (a split master is split from its f32 master) and from
//! the f64 value where they round: stochastic rounding of the exact value
//! with the kernel's random bits. 8-bit moments: each block's new f64
//! moments rounded once to f32, then coded by an f64 model of the code
//! map and its stochastic rounding (`q8_encode_f64`, formulated on the
//! exact normalized value, not its bits), with the kernel's random bits.

use super::formats::{
    join, random, salt, split, ADAMW_SR_MOMENTS, ADAMW_SR_PARAMS, STREAM_MOMENTS, STREAM_PARAMS,
};
use super::plan::powi;
use super::q8::{Q8Grid, Q8_BLOCK, STREAM_Q8};
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

/// One tensor's moments: values of `M`, or 8-bit codes with their block
/// scales.
enum Moment<'a, M> {
    Plain(&'a mut [M]),
    Q8(&'a mut [u8], &'a mut [f32], Q8Grid),
}

impl<M: Float> Moment<'_, M> {
    /// The old value of element `i`.
    fn get(&self, i: usize, signed: bool) -> f64 {
        match self {
            Moment::Plain(m) => m[i].to_f64(),
            Moment::Q8(c, s, grid) => q8_decode_f64(s[grid.scale_of(i)], c[i], signed) as f64,
        }
    }
}

/// Codes one block (`x`: its new moments, rounded once to f32) with the
/// f64 model, against the block's largest |value| (its bit pattern, as the
/// kernel takes it: a NaN if any).
fn q8_store(
    c: &mut [u8],
    scale: &mut f32,
    x: &[f32],
    (salt, shift): (u32, u32),
    key: u64,
    signed: bool,
) {
    let s = f32::from_bits(
        x.iter()
            .map(|v| v.to_bits() & 0x7fff_ffff)
            .max()
            .unwrap_or(0),
    );
    *scale = s;
    for (j, (c, &v)) in c.iter_mut().zip(x).enumerate() {
        let r = random(salt, key.wrapping_add(j as u64)) >> shift;
        *c = q8_encode_f64(v, s, r, signed);
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
    let q8 = st.quantized_moments != 0;
    let sr_m = (st.rounding & ADAMW_SR_MOMENTS != 0).then(|| salt(st.seed, o.step, STREAM_MOMENTS));
    let sr_p = (st.rounding & ADAMW_SR_PARAMS != 0).then(|| salt(st.seed, o.step, STREAM_PARAMS));
    let q8_salt = salt(st.seed, o.step, STREAM_Q8);
    // SAFETY: the front end lowered the lists (and the keys).
    let ([ps, gs, ms, vs, xs, ws], keys, rows) =
        unsafe { (call.tables(), call.keys(), call.q8_rows()) };
    // SAFETY: as above.
    let [sms, svs, sxs] = unsafe { call.scale_tables() };
    let dst = |l: &[ListSeg], r: usize| l.get(r).map(|s| s.data);
    for r in 0..ps.len() {
        let n = ps[r].numel;
        let grid = Q8Grid::new(n, rows.get(r).map_or(0, |&l| l as usize));
        let nq = grid.scales_len(n);
        // SAFETY: validated, pairwise disjoint tensors of `n` elements (u8
        // codes and `nq` f32 scales with 8-bit moments); the reference runs
        // alone on one thread.
        let moment = |l: &[ListSeg], sl: &[ListSeg]| unsafe {
            if q8 {
                Moment::Q8(
                    Dst(l[r].data as *mut u8).get(0, n),
                    Dst(sl[r].data as *mut f32).get(0, nq),
                    grid,
                )
            } else {
                Moment::Plain(Dst(l[r].data as *mut M).get(0, n))
            }
        };
        let (mut m, mut v) = (moment(ms, sms), moment(vs, svs));
        let mut x = (ams && !xs.is_empty()).then(|| moment(xs, sxs));
        // SAFETY: as above.
        let (p, g, w) = unsafe {
            (
                Dst(ps[r].data as *mut P).get(0, n),
                Src(gs[r].data as *const G).get(0, n),
                dst(ws, r)
                    .filter(|_| !split_masters)
                    .map(|d| Dst(d as *mut f32).get(0, n)),
            )
        };
        // SAFETY: as above; split masters' low halves are i16.
        let mut low = dst(ws, r)
            .filter(|_| split_masters)
            .map(|d| unsafe { Dst(d as *mut i16).get(0, n) });
        let mut w = w;
        let key = keys.get(r).copied().unwrap_or(0);
        // Quantization blocks (one block of everything without 8-bit
        // moments would do as well: elements are independent then).
        let mut next = 0;
        while next < n {
            let at = next;
            let len = if q8 {
                grid.block_len(at)
            } else {
                (n - at).min(Q8_BLOCK)
            };
            next += len;
            // The block's new moments rounded once to f32 (8-bit moments).
            let (mut nm, mut nv, mut nx) = ([0f32; Q8_BLOCK], [0f32; Q8_BLOCK], [0f32; Q8_BLOCK]);
            for j in 0..len {
                let i = at + j;
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
                let mi = m.get(i, true) * o.beta1 + gi * (1.0 - o.beta1);
                let vi = v.get(i, false) * o.beta2 + gi * gi * (1.0 - o.beta2);
                (nm[j], nv[j]) = (mi as f32, vi as f32);
                if let Moment::Plain(m) = &mut m {
                    m[i] = put(mi, rm.map(|r| r & 0xffff));
                }
                if let Moment::Plain(v) = &mut v {
                    v[i] = put(vi, rm.map(|r| r >> 16));
                }
                let d = match &mut x {
                    Some(x) => {
                        let old = x.get(i, false);
                        let mx = if vi < old { old } else { vi };
                        nx[j] = mx as f32;
                        if let Moment::Plain(x) = x {
                            x[i] = put(mx, rm.map(|r| r >> 16));
                        }
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
            let k0 = key.wrapping_add(at as u64);
            let q = if q8 { grid.scale_of(at) } else { 0 };
            // exp_avg takes the hash's low 16 bits, exp_avg_sq and its
            // maximum the high 16.
            for (mm, new, shift, signed) in [
                (Some(&mut m), &nm, 0, true),
                (Some(&mut v), &nv, 16, false),
                (x.as_mut(), &nx, 16, false),
            ] {
                if let Some(Moment::Q8(c, s, _)) = mm {
                    q8_store(
                        &mut c[at..at + len],
                        &mut s[q],
                        &new[..len],
                        (q8_salt, shift),
                        k0,
                        signed,
                    );
                }
            }
        }
    }
}

/// 2^e for a normal f64 exponent, from its bits (f64::powi is std-only).
fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// The f64 model of `q8::q8_encode`: the code of `x` in a block of scale
/// `scale`, rounded stochastically with the 16 random bits `r & 0xffff`,
/// from exact arithmetic on the normalized value (not from its bit
/// pattern).
pub(crate) fn q8_encode_f64(x: f32, scale: f32, r: u32, signed: bool) -> u8 {
    if !scale.is_finite() || scale == 0.0 {
        return 0;
    }
    let r = (r & 0xffff) as f64;
    let two16 = pow2(16);
    // y = min((|x| pre) rcp, 1): the prescaling is exact, the reciprocal and
    // the product rounded once to f32 (f64's 53 bits round each once more
    // without a double-rounding error: 53 >= 2 * 24 + 2).
    let pre = if scale.abs() < f32::MIN_POSITIVE {
        pow2(64)
    } else {
        1.0
    };
    let rcp = (1.0 / (scale as f64 * pre)) as f32 as f64;
    let y = ((x.abs() as f64 * pre) * rcp) as f32 as f64;
    let y = if y > 1.0 { 1.0 } else { y };
    let emin = if signed { -14 } else { -30 };
    let mag = if y >= pow2(emin) {
        let e = ((y.to_bits() >> 52) & 0x7ff) as i32 - 1023;
        let step = pow2(e - 3);
        // A positive quotient below 2^53: truncation is the floor.
        let below = (y / step) as u64 as f64;
        let frac = y / step - below;
        let q = below as u32 + (frac * two16 + r >= two16) as u32;
        let (e, f) = if q == 16 { (e + 1, 0) } else { (e, q - 8) };
        (((e - emin + 1) as u32) << 3) | f
    } else if !signed {
        // Never 0 from a positive value (q8's one biased rule).
        8 * (y > 0.0) as u32
    } else if r < y * pow2(16 - emin) {
        8
    } else {
        0
    };
    let sign = if signed && x.is_sign_negative() {
        0x80
    } else {
        0
    };
    (mag | sign) as u8
}

/// The f64 model of `q8::q8_decode`: `scale` times the code's exact
/// magnitude, rounded once to f32.
pub(crate) fn q8_decode_f64(scale: f32, c: u8, signed: bool) -> f32 {
    let (e, bias) = if signed {
        ((c >> 3) & 15, 15)
    } else {
        (c >> 3, 31)
    };
    let mag = if e == 0 {
        0.0
    } else {
        pow2(e as i32 - bias) * (1.0 + (c & 7) as f64 / 8.0)
    };
    let v = scale as f64 * mag;
    (if signed && c & 0x80 != 0 { -v } else { v }) as f32
}
