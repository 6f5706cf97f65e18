//! Transcendentals written once over `Lanes` (SiLU needs `exp`): range
//! reduction and a polynomial from IEEE add, sub, mul and div alone — no FMA,
//! no libm, no table — so every ISA and the portable lanes give the same bits.
//! Error against f64 over every f32 input: `exp_all_inputs` below.

use super::{Lanes, GROUP};

/// `$vis fn $name`: `$body` inlined on the SIMD lanes, called out of line on
/// lanes with `Lanes::OUTLINED` (the portable ones: see there why).
macro_rules! outlined {
    ($(#[$m:meta])* $vis:vis fn $name:ident($arg:ident: $t:ty) -> $r:ty = $body:ident;) => {
        $(#[$m])*
        #[inline(always)]
        $vis fn $name<L: Lanes>($arg: $t) -> $r {
            #[inline(never)]
            fn called<L: Lanes>($arg: $t) -> $r {
                $body($arg)
            }
            if L::OUTLINED {
                called::<L>($arg)
            } else {
                $body($arg)
            }
        }
    };
}

/// ln 2 split so that `n * LN2_HI` is exact for |n| <= 2^8 (Cody-Waite).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const LOG2E: f32 = core::f32::consts::LOG2_E;
/// Inputs are clamped to [LO, HI]: exp(HI) overflows to +Inf and exp(LO)
/// rounds to +0, so the clamp changes no result, and the scale exponents
/// stay inside `ldexp`'s range.
const HI: f32 = 89.0;
const LO: f32 = -104.0;
/// Cephes `expf`'s minimax coefficients for e^r - 1 - r on |r| <= ln2 / 2.
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// Lane-wise `e^x`: +Inf above 88.72, +0 below -103.97, subnormal results
/// rounded once, NaN in -> NaN out (the input's payload, quieted).
#[inline(always)]
pub fn exp<L: Lanes>(x: L) -> L {
    exp_scale(exp_reduce(x))
}

/// `exp`'s first stage (see `exp_nonpos_reduce`): followed by `exp_scale`,
/// the same bits as `exp`.
#[inline(always)]
pub fn exp_reduce<L: Lanes>(x: L) -> ExpArg<L> {
    // NaN stays NaN.
    reduce(x.clamp(L::splat(LO), L::splat(HI)))
}

/// `exp` for inputs known to be <= 0 or NaN (`x - max` in a softmax): the
/// same bits, without the clamp's upper side (its `min` returns such an
/// input unchanged), one operation fewer in the loss's hottest loop.
#[inline(always)]
pub fn exp_nonpos<L: Lanes>(x: L) -> L {
    exp_scale(exp_nonpos_reduce(x))
}

/// `exp_nonpos`'s first stage: the clamped input split as `x = n ln2 + r`.
/// Followed by `exp_scale`, the same bits as `exp_nonpos`; apart, so that a
/// loop can reduce the next groups while it finishes these (software
/// pipelining: the scheduler then holds two independent chains, not one
/// long one).
#[inline(always)]
pub fn exp_nonpos_reduce<L: Lanes>(x: L) -> ExpArg<L> {
    // `clamp`'s lower side: a NaN lane stays NaN.
    reduce(x.at_least(L::splat(LO)))
}

/// An `exp` argument after range reduction: `x = n ln2 + r`.
#[derive(Clone, Copy)]
pub struct ExpArg<L> {
    r: L,
    n: L,
}

/// The reduction of `x` in [LO, HI] or NaN (Cody-Waite).
#[inline(always)]
fn reduce<L: Lanes>(x: L) -> ExpArg<L> {
    let n = x.mul(L::splat(LOG2E)).round_even();
    let r = x.sub(n.mul(L::splat(LN2_HI))).sub(n.mul(L::splat(LN2_LO)));
    ExpArg { r, n }
}

outlined! {
    /// `exp`'s second stage: `2^n e^r`.
    pub fn exp_scale(e: ExpArg<L>) -> L = exp_scale_body;
}

#[inline(always)]
fn exp_scale_body<L: Lanes>(ExpArg { r, n }: ExpArg<L>) -> L {
    // The polynomial in Estrin's order (three independent pairs, joined by
    // r^2 and r^4): 4 dependent steps, not Horner's 10, so more vectors are
    // in flight in the out-of-order window (SwiGLU's loop: 11% faster) for
    // the same operation count; max error 1.014 ulp, Horner's was 0.990.
    let c = |i: usize| L::splat(P[i]);
    let r2 = r.mul(r);
    let (a, b, d) = (
        c(0).mul(r).add(c(1)),
        c(2).mul(r).add(c(3)),
        c(4).mul(r).add(c(5)),
    );
    let p = a.mul(r2.mul(r2)).add(b.mul(r2).add(d));
    let e = p.mul(r2).add(r).add(L::splat(1.0));
    // n is in -150..=129: one rounding, so subnormal results are rounded
    // like any other.
    e.ldexp(n)
}

/// Lane-wise SiLU, `x / (1 + e^-x)` (PyTorch's formula: the same special
/// values, e.g. -Inf -> NaN, -100 -> -0), in two stages for a pipelined
/// loop: `silu_finish(x, silu_reduce(x))`.
///
/// The first stage: `e^-x`'s range reduction (as `exp_reduce`).
#[inline(always)]
pub fn silu_reduce<L: Lanes>(x: L) -> ExpArg<L> {
    exp_reduce(L::splat(0.0).sub(x))
}

/// SiLU's second stage: `silu(x)` from `silu_reduce(x)`.
#[inline(always)]
pub fn silu_finish<L: Lanes>(x: L, e: ExpArg<L>) -> L {
    x.div(L::splat(1.0).add(exp_scale(e)))
}

/// Cephes `logf`'s minimax coefficients for log(1 + f) - f + f^2/2 on
/// f in [sqrt(1/2) - 1, sqrt(2) - 1], highest degree first.
const LOGP: [f32; 9] = [
    7.037_683_6e-2,
    -1.151_461e-1,
    1.167_699_9e-1,
    -1.242_014_1e-1,
    1.424_932_3e-1,
    -1.666_805_8e-1,
    2.000_071_4e-1,
    -2.499_999_4e-1,
    3.333_333e-1,
];

outlined! {
    /// Lane-wise natural logarithm: `log(+0) = -Inf`, `log(+Inf) = +Inf`,
    /// negative or NaN in -> NaN, subnormals exact. Each lane is split into
    /// `2^e * (1 + f)` with `1 + f` in [sqrt(1/2), sqrt(2)) through its bits
    /// (stored and reloaded: `Lanes` has no integer operations), then Cephes'
    /// polynomial runs over the lanes with IEEE add, sub and mul alone, so
    /// every ISA gives the same bits. Within 1 ulp of f64 (`log_sweep` below).
    pub fn log(x: L) -> L = log_body;
}

#[inline(always)]
fn log_body<L: Lanes>(x: L) -> L {
    let mut a = [0f32; GROUP];
    x.store(&mut a);
    let mut f = [0f32; GROUP];
    let mut e = [0f32; GROUP];
    let mut special = [None::<f32>; GROUP];
    for i in 0..GROUP {
        let v = a[i];
        if v.is_nan() || v < 0.0 {
            special[i] = Some(f32::NAN);
            continue;
        }
        if v == 0.0 {
            special[i] = Some(f32::NEG_INFINITY);
            continue;
        }
        if v == f32::INFINITY {
            special[i] = Some(f32::INFINITY);
            continue;
        }
        let (mut b, mut ex) = (v.to_bits(), 0i32);
        if b < 0x0080_0000 {
            // Subnormal: scale into the normal range (exact).
            b = (v * 33_554_432.0).to_bits();
            ex = -25;
        }
        ex += ((b >> 23) & 0xff) as i32 - 126;
        // The mantissa in [0.5, 1); both adjustments below are exact.
        let m = f32::from_bits((b & 0x007f_ffff) | 0x3f00_0000);
        if m < core::f32::consts::FRAC_1_SQRT_2 {
            ex -= 1;
            f[i] = m + m - 1.0;
        } else {
            f[i] = m - 1.0;
        }
        e[i] = ex as f32;
    }
    let (f, e) = (L::load(&f), L::load(&e));
    let z = f.mul(f);
    let mut y = L::splat(LOGP[0]);
    for c in &LOGP[1..] {
        y = y.mul(f).add(L::splat(*c));
    }
    let y = y.mul(f).mul(z);
    let y = y.add(e.mul(L::splat(LN2_LO)));
    let y = y.sub(z.mul(L::splat(0.5)));
    let r = f.add(y).add(e.mul(L::splat(LN2_HI)));
    if special.iter().all(Option::is_none) {
        return r;
    }
    let mut o = [0f32; GROUP];
    r.store(&mut o);
    for (o, s) in o.iter_mut().zip(special) {
        if let Some(s) = s {
            *o = s;
        }
    }
    L::load(&o)
}

/// Cephes `tanhf`'s coefficients for (tanh(x) - x) / x^3 on |x| < 0.625,
/// highest degree first.
const TANHP: [f32; 5] = [
    -5.704_988_7e-3,
    2.063_909e-2,
    -5.373_971_6e-2,
    1.333_144_2e-1,
    -3.333_328e-1,
];

outlined! {
    /// Lane-wise hyperbolic tangent (Gemma 2's logit soft-capping): on |x| <
    /// 0.625 `x + x^3 P(x^2)` (Cephes), above `1 - 2 / (e^{2|x|} + 1)` with
    /// `exp` above (1 exactly from |x| > 44.4), the sign put back last; NaN in
    /// -> NaN out, -0 -> +0. IEEE add, sub, mul and div alone: the same bits
    /// on every ISA. Within 2 ulp of f64 (`tanh_sweep` below).
    pub fn tanh(x: L) -> L = tanh_body;
}

#[inline(always)]
fn tanh_body<L: Lanes>(x: L) -> L {
    let (zero, one) = (L::splat(0.0), L::splat(1.0));
    let a = x.select_lt(zero, zero.sub(x), x);
    let big = one.sub(L::splat(2.0).div(exp(a.add(a)).add(one)));
    let z = a.mul(a);
    let mut p = L::splat(TANHP[0]);
    for c in &TANHP[1..] {
        p = p.mul(z).add(L::splat(*c));
    }
    let small = p.mul(z).mul(a).add(a);
    let t = a.select_lt(L::splat(0.625), small, big);
    x.select_lt(zero, zero.sub(t), t)
}

/// `(erf(x) / x) - 1` as a polynomial in `x^2` on |x| < 1, highest degree
/// first (a weighted least-squares fit to the relative error, made for
/// npukern; 1.18 ulp in f32 Horner with `x + x * P`).
const ERF_SMALL: [f32; 7] = [
    8.226_168e-5,
    -8.110_921_5e-4,
    5.198_392_6e-3,
    -2.685_837_6e-2,
    1.128_367_8e-1,
    -3.761_263_2e-1,
    1.283_791_7e-1,
];

/// `erfc(x) e^{x^2}` as a polynomial in `u = (x - 2.5) / 1.5` on
/// 1 <= x <= 4, highest degree first (fitted as `ERF_SMALL`; centred so
/// Horner does not cancel).
const ERF_BIG: [f32; 12] = [
    -2.826_408_3e-5,
    9.320_645e-5,
    -1.664_883_3e-4,
    3.753_649_7e-4,
    -9.959_689e-4,
    2.419_792_6e-3,
    -5.575_922_3e-3,
    1.248_603_e-2,
    -2.700_431_8e-2,
    5.611_073e-2,
    -1.115_210_7e-1,
    2.108_063_5e-1,
];

outlined! {
    /// Lane-wise error function (GELU's exact form, `approximate="none"`): on
    /// |x| < 1 `x + x P(x^2)`, above `1 - e^{-x^2} Q(x)` with `exp` above and
    /// |x| clamped to 4 (erf rounds to 1 in f32 from 3.92), the sign put back
    /// last; NaN in -> NaN out, -0 -> +0. IEEE add, sub, mul and div alone:
    /// the same bits on every ISA. Within 2 ulp of f64 (`erf_sweep` below).
    pub fn erf(x: L) -> L = erf_body;
}

#[inline(always)]
fn erf_body<L: Lanes>(x: L) -> L {
    let (zero, one) = (L::splat(0.0), L::splat(1.0));
    let a = x.select_lt(zero, zero.sub(x), x);
    let z = a.mul(a);
    let mut p = L::splat(ERF_SMALL[0]);
    for c in &ERF_SMALL[1..] {
        p = p.mul(z).add(L::splat(*c));
    }
    let small = a.add(a.mul(p));
    // The clamp keeps NaN; +Inf becomes 4, whose erf rounds to 1.
    let b = a.clamp(one, L::splat(4.0));
    let u = b.sub(L::splat(2.5)).mul(L::splat(1.0 / 1.5));
    let mut q = L::splat(ERF_BIG[0]);
    for c in &ERF_BIG[1..] {
        q = q.mul(u).add(L::splat(*c));
    }
    let big = one.sub(exp(zero.sub(b.mul(b))).mul(q));
    let t = a.select_lt(one, small, big);
    x.select_lt(zero, zero.sub(t), t)
}

/// IEEE fusedMultiplyAdd `a * b + c` rounded once, in software (the
/// portable lanes' `mul_add`; no_std has no `f32::mul_add`). The product of
/// two f32 is exact in f64; the f64 sum is made round-to-odd (its error,
/// from TwoSum, sets the last bit), and a round-to-odd value with 53 >=
/// 24 + 2 bits rounds to f32 exactly as the exact sum would.
// (Unused on aarch64, where the portable lanes use the FMA instruction.)
#[cfg_attr(
    all(target_arch = "aarch64", target_feature = "neon"),
    allow(dead_code)
)]
pub fn fma_f32(a: f32, b: f32, c: f32) -> f32 {
    let p = a as f64 * b as f64;
    let q = c as f64;
    let s = p + q;
    if !s.is_finite() {
        return s as f32;
    }
    let bb = s - p;
    let e = (p - (s - bb)) + (q - bb);
    let bits = s.to_bits();
    let s = if e != 0.0 && bits & 1 == 0 {
        // s is not zero here (a sum that rounds to 0 is exact).
        if (e > 0.0) == (s > 0.0) {
            f64::from_bits(bits + 1)
        } else {
            f64::from_bits(bits - 1)
        }
    } else {
        s
    };
    s as f32
}

/// `erf x` in f64 for the golden models: `2/sqrt(pi) e^{-x^2} sum_n 2^n
/// x^{2n+1} / (1 3 .. (2n+1))` (every term positive: no cancellation),
/// summed until the terms stop counting; +-1 beyond |x| = 6 (erfc(6) is
/// below half an f64 ulp of 1); NaN -> NaN.
pub fn erf_f64(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let a = if x < 0.0 { -x } else { x };
    let v = if a >= 6.0 {
        1.0
    } else {
        let z = a * a;
        let (mut term, mut sum, mut k) = (a, a, 0u32);
        while k < 400 {
            k += 1;
            term *= 2.0 * z / (2 * k + 1) as f64;
            sum += term;
            // `<=`: at x = 0 or a subnormal x, term and the threshold are
            // both 0, and `<` ran all 400 rounds (a 19 s fuzz input).
            if term <= sum * 1e-18 {
                break;
            }
        }
        let v = core::f64::consts::FRAC_2_SQRT_PI * exp_f64(-z) * sum;
        if v > 1.0 {
            1.0
        } else {
            v
        }
    };
    if x < 0.0 {
        -v
    } else {
        v
    }
}

/// `ln x` in f64 for the golden models: `x = 2^e * m` with m in
/// [sqrt(1/2), sqrt(2)), `ln m = 2 atanh((m - 1) / (m + 1))` summed to 22
/// odd terms (truncation < 1e-19), plus `e ln 2`; within 2 ulp of f64.
/// `ln(0) = -Inf`, negative or NaN -> NaN, `ln(+Inf) = +Inf`.
pub fn log_f64(x: f64) -> f64 {
    if x.is_nan() || x < 0.0 {
        return f64::NAN;
    }
    if x == 0.0 {
        return f64::NEG_INFINITY;
    }
    if x == f64::INFINITY {
        return x;
    }
    let (mut b, mut e) = (x.to_bits(), 0i64);
    if b < (1u64 << 52) {
        b = (x * 18_014_398_509_481_984.0).to_bits(); // 2^54
        e = -54;
    }
    e += ((b >> 52) & 0x7ff) as i64 - 1022;
    let mut m = f64::from_bits((b & 0x000f_ffff_ffff_ffff) | 0x3fe0_0000_0000_0000);
    if m < core::f64::consts::FRAC_1_SQRT_2 {
        e -= 1;
        m *= 2.0;
    }
    let u = (m - 1.0) / (m + 1.0);
    let u2 = u * u;
    let mut s = 0.0f64;
    for k in (0..22).rev() {
        s = s * u2 + 1.0 / (2 * k + 1) as f64;
    }
    2.0 * u * s + e as f64 * core::f64::consts::LN_2
}

/// `tanh x` in f64 for the golden models: on |x| < 1 the quotient of the
/// sinh and cosh Taylor sums (no cancellation near 0), above it `1 - 2 /
/// (e^{2|x|} + 1)`; NaN -> NaN.
pub fn tanh_f64(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let a = if x < 0.0 { -x } else { x };
    let t = if a < 1.0 {
        let (mut sh, mut ch, mut c) = (0.0f64, 0.0f64, 1.0f64);
        for k in 0..30u32 {
            if k % 2 == 0 {
                ch += c;
            } else {
                sh += c;
            }
            c *= a / (k + 1) as f64;
        }
        sh / ch
    } else {
        1.0 - 2.0 / (exp_f64(2.0 * a) + 1.0)
    };
    if x < 0.0 {
        -t
    } else {
        t
    }
}

/// `e^x` in f64 for the golden models (no libm in `no_std`): Cody-Waite
/// reduction to |r| <= ln2/2, a degree-18 Taylor sum (truncation < 1e-25
/// relative), and an exact scale by 2^n in two steps; within 2 ulp of f64.
pub fn exp_f64(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x > 709.8 {
        return f64::INFINITY;
    }
    if x < -745.2 {
        return 0.0;
    }
    const R: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    const HI64: f64 = 6.931_471_803_691_238e-1;
    const LO64: f64 = 1.908_214_929_270_587_7e-10;
    let n = (x * core::f64::consts::LOG2_E + R) - R;
    let r = (x - n * HI64) - n * LO64;
    let mut s = 1.0f64;
    for k in (1..=18).rev() {
        s = 1.0 + s * r / k as f64;
    }
    let n = n as i64;
    let h = n / 2;
    let pow = |k: i64| f64::from_bits(((k + 1023) as u64) << 52);
    s * pow(h) * pow(n - h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lanes::{Portable, GROUP};

    fn exp1(x: f32) -> f32 {
        let mut o = [0f32; GROUP];
        exp(Portable::splat(x)).store(&mut o);
        o[0]
    }

    #[test]
    fn edges() {
        assert_eq!(exp1(0.0), 1.0);
        assert_eq!(exp1(-0.0), 1.0);
        assert_eq!(exp1(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp1(f32::NEG_INFINITY).to_bits(), 0);
        assert_eq!(exp1(88.8), f32::INFINITY);
        assert_eq!(exp1(-104.5).to_bits(), 0);
        assert!(exp1(f32::NAN).is_nan());
        // Subnormal results: e^-100 = 3.72e-44 (26 * 2^-149).
        let s = exp1(-100.0);
        assert!(s > 0.0 && s < f32::MIN_POSITIVE, "{s}");
        assert_eq!(s.to_bits(), (exp_f64(-100.0) as f32).to_bits());
        assert!((exp_f64(1.0) - core::f64::consts::E).abs() < 1e-15);
        assert_eq!(exp_f64(-800.0), 0.0);
        assert!(exp_f64(-740.0) > 0.0);
    }

    /// Max error in f32 ulps of `got` against the f64 `want` (ulps of the
    /// f32 nearest `want`; +Inf is right above f32::MAX's rounding range).
    #[cfg(feature = "std")]
    fn ulps(got: f32, want: f64) -> f64 {
        if got.is_nan() || want.is_nan() {
            return if got.is_nan() && want.is_nan() {
                0.0
            } else {
                f64::INFINITY
            };
        }
        let w32 = want as f32;
        let ulp = if w32.is_infinite() || w32 >= f32::MAX {
            2f64.powi(104)
        } else {
            let e = (w32.to_bits() >> 23) as i32 & 0xff;
            2f64.powi(e.max(1) - 150)
        };
        let g = if got.is_infinite() {
            2f64.powi(128)
        } else {
            got as f64
        };
        let w = if w32.is_infinite() {
            2f64.powi(128)
        } else {
            want
        };
        ((g - w) / ulp).abs()
    }

    /// Every `stride`-th f32 bit pattern (from `start`): every ISA this CPU
    /// has gives Portable's bits, and the largest error against f64 `exp`.
    #[cfg(feature = "std")]
    fn sweep(start: u32, stride: u32) -> (f64, u32, u64) {
        use crate::lanes::{detect, Isa};
        let mut worst = (0f64, 0u32);
        let mut differ = 0u64;
        let mut x = [0f32; GROUP];
        let mut want = [0f32; GROUP];
        let mut got = [0f32; GROUP];
        let mut b = start as u64;
        while b <= u32::MAX as u64 {
            for (i, v) in x.iter_mut().enumerate() {
                *v = f32::from_bits(((b + i as u64 * stride as u64) & 0xffff_ffff) as u32);
            }
            exp(Portable::load(&x)).store(&mut want);
            for (i, v) in x.iter().enumerate() {
                let e = ulps(want[i], (*v as f64).exp());
                if e > worst.0 {
                    worst = (e, v.to_bits());
                }
            }
            for isa in Isa::ALL {
                let Ok(a) = detect::resolve(Some(isa)) else {
                    continue;
                };
                // SAFETY: `a` proves the ISA is available.
                dispatch_isa!(a, L => unsafe { L::enter(|| exp(L::load(&x)).store(&mut got)) });
                differ += got
                    .iter()
                    .zip(&want)
                    .filter(|(g, w)| g.to_bits() != w.to_bits())
                    .count() as u64;
            }
            b += GROUP as u64 * stride as u64;
        }
        (worst.0, worst.1, differ)
    }

    /// A sweep's stride times `NPK_SWEEP_THIN` (default 1): under an
    /// emulator (scripts/cross.sh's aarch64 step) the sweeps take every
    /// 17th of their inputs — still every exponent, minutes instead of half
    /// an hour; natively they run whole.
    #[cfg(feature = "std")]
    fn thinned(stride: u32) -> u32 {
        let thin = std::env::var("NPK_SWEEP_THIN")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .filter(|&t| t > 0)
            .unwrap_or(1);
        stride.saturating_mul(thin)
    }

    /// `log` and `tanh` on every `stride`-th f32 bit pattern: the same bits
    /// on every ISA as on Portable, and the worst error against std's f64.
    #[cfg(feature = "std")]
    fn sweep_fn(
        stride: u32,
        f: fn([f32; GROUP], crate::lanes::detect::Available) -> [f32; GROUP],
        want: fn(f64) -> f64,
    ) -> (f64, u32, u64) {
        use crate::lanes::{detect, Isa};
        let mut worst = (0f64, 0u32);
        let mut differ = 0u64;
        let portable = detect::resolve(Some(Isa::Portable)).expect("portable");
        let mut b = 3u64;
        while b <= u32::MAX as u64 {
            let x: [f32; GROUP] = core::array::from_fn(|i| {
                f32::from_bits(((b + i as u64 * stride as u64) & 0xffff_ffff) as u32)
            });
            let w = f(x, portable);
            for (i, v) in x.iter().enumerate() {
                let e = ulps(w[i], want(*v as f64));
                if e > worst.0 {
                    worst = (e, v.to_bits());
                }
            }
            for isa in Isa::ALL {
                let Ok(a) = detect::resolve(Some(isa)) else {
                    continue;
                };
                let g = f(x, a);
                differ += g
                    .iter()
                    .zip(&w)
                    .filter(|(g, w)| g.to_bits() != w.to_bits())
                    .count() as u64;
            }
            b += GROUP as u64 * stride as u64;
        }
        (worst.0, worst.1, differ)
    }

    #[cfg(feature = "std")]
    fn log_on(x: [f32; GROUP], a: crate::lanes::detect::Available) -> [f32; GROUP] {
        let mut o = [0f32; GROUP];
        // SAFETY: `a` proves the ISA is available.
        dispatch_isa!(a, L => unsafe { L::enter(|| log(L::load(&x)).store(&mut o)) });
        o
    }

    #[cfg(feature = "std")]
    fn tanh_on(x: [f32; GROUP], a: crate::lanes::detect::Available) -> [f32; GROUP] {
        let mut o = [0f32; GROUP];
        // SAFETY: `a` proves the ISA is available.
        dispatch_isa!(a, L => unsafe { L::enter(|| tanh(L::load(&x)).store(&mut o)) });
        o
    }

    #[cfg(feature = "std")]
    fn erf_on(x: [f32; GROUP], a: crate::lanes::detect::Available) -> [f32; GROUP] {
        let mut o = [0f32; GROUP];
        // SAFETY: `a` proves the ISA is available.
        dispatch_isa!(a, L => unsafe { L::enter(|| erf(L::load(&x)).store(&mut o)) });
        o
    }

    /// 2^32 / 67 inputs: `erf` within 2 ulp of the f64 model, the same bits
    /// on every ISA; the f64 model within 4e-15 of values from mpmath (30
    /// digits).
    #[test]
    #[cfg(feature = "std")]
    fn erf_sweep() {
        for (v, w) in [
            (1e-300, 1.128_379_167_095_512_6e-300),
            (1e-8, 1.128_379_167_095_512_6e-8),
            (0.1, 0.112_462_916_018_284_9),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (1.5, 0.966_105_146_475_310_7),
            (2.5, 0.999_593_047_982_555),
            (3.9, 0.999_999_965_207_751_4),
            (5.0, 0.999_999_999_998_462_5),
            (-3.0, -0.999_977_909_503_001_4),
        ] {
            let g = erf_f64(v);
            assert!((g - w).abs() <= 4e-15 * w.abs(), "{v}: {g} vs {w}");
        }
        assert_eq!(erf_f64(7.0), 1.0);
        assert!(erf_f64(f64::NAN).is_nan());
        let (worst, at, differ) = sweep_fn(thinned(67), erf_on, erf_f64);
        std::println!("erf: max error {worst:.3} ulp (at {at:#010x})");
        assert_eq!(differ, 0, "lanes whose bits differ from Portable's");
        assert!(worst <= 2.0, "{worst} ulp at {at:#x}");
        let e = erf_on(
            [f32::INFINITY; GROUP],
            crate::lanes::detect::resolve(None).expect("isa"),
        );
        assert_eq!(e[0], 1.0);
    }

    /// 2^32 / 67 inputs: `log` within 1 ulp of f64 `ln`, the same bits on
    /// every ISA; the f64 model within 1e-15 of std's.
    #[test]
    #[cfg(feature = "std")]
    fn log_sweep() {
        let (worst, at, differ) = sweep_fn(thinned(67), log_on, f64::ln);
        std::println!("log: max error {worst:.3} ulp (at {at:#010x})");
        assert_eq!(differ, 0, "lanes whose bits differ from Portable's");
        assert!(worst <= 1.0, "{worst} ulp at {at:#x}");
        for v in [
            1e-310, 1e-300, 0.3, 0.7072, 1.0, 1.5, 2.0, 11.76, 1e300, 5e-324,
        ] {
            let (g, w) = (log_f64(v), v.ln());
            assert!((g - w).abs() <= 2e-16 * w.abs().max(1.0), "{v}: {g} vs {w}");
        }
        assert_eq!(log_f64(0.0), f64::NEG_INFINITY);
        assert!(log_f64(-1.0).is_nan());
    }

    /// 2^32 / 67 inputs: `tanh` within 2 ulp of f64 `tanh`, the same bits on
    /// every ISA; the f64 model within 1e-15 of std's.
    #[test]
    #[cfg(feature = "std")]
    fn tanh_sweep() {
        let (worst, at, differ) = sweep_fn(thinned(67), tanh_on, f64::tanh);
        std::println!("tanh: max error {worst:.3} ulp (at {at:#010x})");
        assert_eq!(differ, 0, "lanes whose bits differ from Portable's");
        assert!(worst <= 2.0, "{worst} ulp at {at:#x}");
        for v in [1e-300, -1e-8, 0.1, -0.624, 0.9999, 1.0, -3.0, 20.0, 400.0] {
            let (g, w) = (tanh_f64(v), v.tanh());
            assert!((g - w).abs() <= 1e-15 * w.abs(), "{v}: {g} vs {w}");
        }
    }

    /// The bound the sweeps hold `exp` to: all 2^32 inputs measured 1.014.
    const MAX_ULP: f64 = 1.02;

    /// 2^32 / 61 inputs spread over every exponent: within 1.02 ulp of f64
    /// `exp` (`MAX_ULP`), the same bits on every ISA.
    #[test]
    #[cfg(feature = "std")]
    fn dense_sweep_within_one_ulp_on_every_isa() {
        let (worst, at, differ) = sweep(7, thinned(61));
        assert_eq!(differ, 0, "lanes whose bits differ from Portable's");
        assert!(worst <= MAX_ULP, "{worst} ulp at {at:#x}");
    }

    /// `exp_nonpos` is `exp` on its domain (every 97th negative bit
    /// pattern, both zeros, -Inf and NaNs), on every ISA.
    #[test]
    #[cfg(feature = "std")]
    fn exp_nonpos_is_exp() {
        use crate::lanes::{detect, Isa};
        let mut inputs: std::vec::Vec<f32> = (0x8000_0000u32..=u32::MAX)
            .step_by(thinned(97) as usize)
            .map(f32::from_bits)
            .collect();
        inputs.extend([
            0.0,
            -0.0,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            -103.97,
            -87.3,
        ]);
        for isa in Isa::ALL {
            let Ok(a) = detect::resolve(Some(isa)) else {
                continue;
            };
            for x in inputs.chunks(GROUP) {
                let mut x16 = [0f32; GROUP];
                x16[..x.len()].copy_from_slice(x);
                let (mut want, mut got) = ([0f32; GROUP], [0f32; GROUP]);
                // SAFETY: `a` proves the ISA is available.
                dispatch_isa!(a, L => unsafe {
                    L::enter(|| {
                        exp(L::load(&x16)).store(&mut want);
                        exp_nonpos(L::load(&x16)).store(&mut got);
                    })
                });
                for i in 0..GROUP {
                    assert_eq!(
                        got[i].to_bits(),
                        want[i].to_bits(),
                        "{isa:?} at {:e}",
                        x16[i]
                    );
                }
            }
        }
    }

    /// All 2^32 inputs (about a minute in release, one thread):
    /// `cargo test --release -p npukern --lib -- --ignored exp_all_inputs --nocapture`.
    #[test]
    #[cfg(feature = "std")]
    #[ignore = "2^32 inputs: run with --release --ignored"]
    fn exp_all_inputs() {
        let (worst, at, differ) = sweep(0, 1);
        std::println!(
            "exp: max error {worst:.3} ulp (at {at:#010x}); {differ} lanes differ across ISAs"
        );
        assert_eq!(differ, 0);
        assert!(worst <= MAX_ULP, "{worst} ulp at {at:#x}");
    }
}
