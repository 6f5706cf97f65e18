//! SwiGLU and GeGLU (split form, forward and backward; GeGLU with both
//! GELU forms) and RoPE (q and k, cos/sin
//! broadcast, forward and backward) in both numerics modes and every dtype:
//! the CPU kernels against the library's f64 reference (within 2 ulp plus
//! 1e-5 of the terms' magnitude, as tests/elementwise.rs) and hashed — the
//! exp inside SiLU and the tanh/erf inside GELU are the library's own, so
//! their bits must match everywhere.

use npukern::{bf16, f16};
use npukern::{
    ElemRounding, Exec, GegluOptions, GeluApproximate, RopeOptions, SwigluOptions, TensorRef,
    UbConfig,
};

use crate::api::El;
use crate::data::{ulp, Rng};
use crate::hash::BitHash;
use crate::{name, Checker};

const M: usize = 4;
const L: usize = 75;
const HEADS: usize = 3;
const S: usize = 5;
const D: usize = 40;
const Q: usize = 2 * HEADS * S * D;
const K: usize = 2 * S * D;

/// Runs every dtype.
pub fn run(c: &mut Checker<'_>) {
    case::<f32>(c, 11);
    case::<f16>(c, 12);
    case::<bf16>(c, 13);
}

/// Compares `got` with `want` (same shape) within 2 ulp plus 1e-5 of
/// `scale`, and hashes `got`.
fn report<T: El>(c: &mut Checker<'_>, what: &str, got: &[T], want: &[T], scale: f64) {
    c.within(what, got, want, |_, w| {
        2.0 * ulp(T::DTYPE, w) + 1e-5 * scale
    });
    c.hash(what, BitHash::of(got));
}

fn case<T: El>(c: &mut Checker<'_>, seed: u64) {
    let cpu = Exec::cpu().with_ub(UbConfig {
        ub_bytes: 1024,
        blocks: 3,
    });
    let reference = Exec::reference();
    let mut rng = Rng(seed);
    let mut x = [T::from_f32(0.0); M * 2 * L];
    // Gates in -8..8: where SiLU bends.
    x.iter_mut()
        .for_each(|v| *v = T::from_f32((rng.below(1025) as f32 - 512.0) / 64.0));
    let mut dy = [T::from_f32(0.0); M * L];
    rng.fill(&mut dy);
    let dt = T::DTYPE.name();
    for (mode, rounding) in [
        ("fused", ElemRounding::Fused),
        ("eager", ElemRounding::Eager),
    ] {
        let o = SwigluOptions { dim: -1, rounding };
        let run = |e: &Exec<'_>, y: &mut [T], dx: &mut [T]| -> npukern::Result<()> {
            let xt = TensorRef::new(&x, &[M, 2 * L])?;
            let dyt = TensorRef::new(&dy, &[M, L])?;
            npukern::swiglu(e, xt, &o, y, &mut [])?;
            npukern::swiglu_grad(e, dyt, xt, &o, dx, &mut [])
        };
        let (mut y, mut dx) = ([T::from_f32(0.0); M * L], [T::from_f32(0.0); M * 2 * L]);
        let (mut ry, mut rdx) = (y, dx);
        let what = name!("swiglu.{mode}.{dt}.{M}x{}", 2 * L);
        if let Err(e) = run(&cpu, &mut y, &mut dx).and(run(&reference, &mut ry, &mut rdx)) {
            c.check(what.as_str(), false, format_args!("call failed: {e:?}"));
            continue;
        }
        report(c, what.as_str(), &y, &ry, 0.0);
        let what = name!("swiglu_grad.{mode}.{dt}.{M}x{}", 2 * L);
        report(c, what.as_str(), &dx, &rdx, 1e4);
        for (form, approximate) in [
            ("tanh", GeluApproximate::Tanh),
            ("erf", GeluApproximate::None),
        ] {
            let o = GegluOptions {
                rounding,
                approximate,
                ..GegluOptions::default()
            };
            let run =
                |e: &Exec<'_>, y: &mut [T], g: &mut [T], dx: &mut [T]| -> npukern::Result<()> {
                    let xt = TensorRef::new(&x, &[M, 2 * L])?;
                    let dyt = TensorRef::new(&dy, &[M, L])?;
                    npukern::geglu(e, xt, &o, y, Some(g), &mut [])?;
                    npukern::geglu_grad(e, dyt, xt, &o, dx, &mut [])
                };
            let (mut y, mut g, mut dx) = (
                [T::from_f32(0.0); M * L],
                [T::from_f32(0.0); M * L],
                [T::from_f32(0.0); M * 2 * L],
            );
            let (mut ry, mut rg, mut rdx) = (y, g, dx);
            let what = name!("geglu.{form}.{mode}.{dt}.{M}x{}", 2 * L);
            let cpu_run = run(&cpu, &mut y, &mut g, &mut dx);
            if let Err(e) = cpu_run.and(run(&reference, &mut ry, &mut rg, &mut rdx)) {
                c.check(what.as_str(), false, format_args!("call failed: {e:?}"));
                continue;
            }
            report(c, what.as_str(), &y, &ry, 1e1);
            let what = name!("geglu.gelu.{form}.{mode}.{dt}.{M}x{}", 2 * L);
            report(c, what.as_str(), &g, &rg, 1e1);
            let what = name!("geglu_grad.{form}.{mode}.{dt}.{M}x{}", 2 * L);
            report(c, what.as_str(), &dx, &rdx, 1e4);
        }
    }
    let mut q = [T::from_f32(0.0); Q];
    let mut k = [T::from_f32(0.0); K];
    rng.fill(&mut q);
    rng.fill(&mut k);
    let mut cs = [T::from_f32(0.0); S * D];
    let mut sn = [T::from_f32(0.0); S * D];
    cs.iter_mut()
        .chain(sn.iter_mut())
        .for_each(|v| *v = T::from_f32((rng.below(257) as f32 - 128.0) / 128.0));
    for (mode, rounding) in [
        ("fused", ElemRounding::Fused),
        ("eager", ElemRounding::Eager),
    ] {
        for backward in [false, true] {
            let o = RopeOptions { rounding, backward };
            let run = |e: &Exec<'_>, qo: &mut [T], ko: &mut [T]| -> npukern::Result<()> {
                let qt = TensorRef::new(&q, &[2, HEADS, S, D])?;
                let kt = TensorRef::new(&k, &[2, 1, S, D])?;
                let (ct, st) = (TensorRef::new(&cs, &[S, D])?, TensorRef::new(&sn, &[S, D])?);
                npukern::rope(e, qt, Some(kt), ct, st, &o, qo, Some(ko), &mut [])
            };
            let (mut qo, mut ko) = ([T::from_f32(0.0); Q], [T::from_f32(0.0); K]);
            let (mut rq, mut rk) = (qo, ko);
            let dir = if backward { "bwd" } else { "fwd" };
            let what = name!("rope.{dir}.{mode}.{dt}.q");
            if let Err(e) = run(&cpu, &mut qo, &mut ko).and(run(&reference, &mut rq, &mut rk)) {
                c.check(what.as_str(), false, format_args!("call failed: {e:?}"));
                continue;
            }
            // Terms of magnitude up to 2^10 each: cancellation scale 2^11.
            report(c, what.as_str(), &qo, &rq, 2048.0);
            let what = name!("rope.{dir}.{mode}.{dt}.k");
            report(c, what.as_str(), &ko, &rk, 2048.0);
        }
    }
}
