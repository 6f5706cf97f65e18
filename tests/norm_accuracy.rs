//! RmsNorm, AddRmsNorm and RmsNormGrad against the f64 reference on random
//! data (magnitudes 1e-3..1e3), every dtype pairing and option, row lengths
//! 1..110000, merge-N and split-D tilings.
//!
//! Bars (per dtype): y and x_sum within 1 ulp of the correctly rounded f64
//! result for f16/bf16 (2 ulps under CastBeforeGamma, whose reference rounds
//! twice too) and 2e-6 relative for f32; rstd 1e-6 relative; dx within 1 ulp
//! plus 1e-5 of the row's gradient scale (max |rstd * dy * gamma| + max |dres|:
//! dx is a difference of such terms); dgamma within 1e-5 of sum_m |dy * xh|.
//! Run with `--nocapture` to see the measured maxima.

mod common;

use common::*;
use half::{bf16, f16};
use npukern::*;

const LENGTHS: [usize; 8] = [1, 7, 15, 16, 17, 4095, 12288, 110_000];

fn rows_for(n: usize) -> usize {
    match n {
        0..=17 => 37,
        18..=5000 => 9,
        5001..=20000 => 5,
        _ => 2,
    }
}

fn ubs() -> [UbConfig; 2] {
    [
        UbConfig::default(),
        UbConfig {
            ub_bytes: 4096,
            blocks: 3,
        },
    ]
}

fn forward_all<T: Float, G: Float>(seed: u64) -> Stats {
    let mut rng = Rng(seed);
    let mut total = Stats::default();
    let cpu = Exec::cpu();
    let refx = reference();
    for &n in &LENGTHS {
        for (oi, &(off, rounding)) in [
            (0.0f32, Rounding::Fused),
            (1.0, Rounding::Fused),
            (0.0, Rounding::CastBeforeGamma),
            (1.0, Rounding::CastBeforeGamma),
        ]
        .iter()
        .enumerate()
        {
            // One row, and many.
            let m = if oi == 3 { 1 } else { rows_for(n) };
            let x: Vec<T> = vec_of(m * n, || rng.mag());
            let x2: Vec<T> = vec_of(m * n, || rng.mag());
            let g: Vec<G> = if off == 0.0 {
                vec_of(n, || rng.uniform(-2.0, 2.0))
            } else {
                vec_of(n, || rng.uniform(-0.5, 0.5))
            };
            let opts = RmsNormOptions {
                eps: 1e-6,
                gamma_offset: off,
                rounding,
            };
            // Alternate the shape (one or two normalized dims) and the tiling.
            let (xs, gs): (Vec<usize>, Vec<usize>) = if n % 2 == 0 && n > 1 {
                (vec![m, 2, n / 2], vec![2, n / 2])
            } else {
                (vec![m, n], vec![n])
            };
            let ub = ubs()[oi % 2];
            let cpu = cpu.with_ub(ub);
            let mut s = Stats::default();
            let got = run_rms_norm(&cpu, &x, &xs, &g, &gs, &opts);
            let want = run_rms_norm(&refx, &x, &xs, &g, &gs, &opts);
            s.forward(&got.y, &want.y);
            s.rstd(&got.rstd, &want.rstd);
            let got = run_add_rms_norm(&cpu, &x, &x2, &xs, &g, &gs, &opts);
            let want = run_add_rms_norm(&refx, &x, &x2, &xs, &g, &gs, &opts);
            s.forward(&got.y, &want.y);
            s.rstd(&got.rstd, &want.rstd);
            // x_sum is exact: bit-identical to the correctly rounded sum.
            assert_same_bits(
                &got.x_sum,
                &want.x_sum,
                &format!("x_sum {:?} n={n}", T::DTYPE),
            );
            let ulp_bar = if rounding == Rounding::Fused { 1 } else { 2 };
            assert!(
                s.y_ulps <= ulp_bar,
                "{:?}/{:?} n={n} {rounding:?}: y {} ulps",
                T::DTYPE,
                G::DTYPE,
                s.y_ulps
            );
            assert!(s.y_rel <= 2e-6, "{:?} n={n}: y rel {:e}", T::DTYPE, s.y_rel);
            assert!(
                s.rstd_rel <= 1e-6,
                "{:?} n={n}: rstd rel {:e}",
                T::DTYPE,
                s.rstd_rel
            );
            total.merge(&s);
        }
    }
    println!("forward {:?} x / {:?} gamma: {total:?}", T::DTYPE, G::DTYPE);
    total
}

fn backward_all<T: Float, G: Float>(seed: u64) -> Stats {
    let mut rng = Rng(seed);
    let mut total = Stats::default();
    let cpu = Exec::cpu();
    let refx = reference();
    for &n in &LENGTHS {
        for (oi, &(off, with_dres, accumulate)) in [
            (0.0f32, false, false),
            (1.0, true, false),
            (0.0, true, true),
            (1.0, false, true),
        ]
        .iter()
        .enumerate()
        {
            let m = if oi == 3 { 1 } else { rows_for(n) };
            let x: Vec<T> = vec_of(m * n, || rng.mag());
            let dy: Vec<T> = vec_of(m * n, || rng.mag());
            let dres: Vec<T> = vec_of(m * n, || rng.mag());
            let g: Vec<G> = vec_of(n, || rng.uniform(-2.0, 2.0));
            let (xs, gs) = (vec![m, n], vec![n]);
            let fwd = run_rms_norm(
                &cpu,
                &x,
                &xs,
                &g,
                &gs,
                &RmsNormOptions {
                    gamma_offset: off,
                    ..Default::default()
                },
            );
            let opts = RmsNormGradOptions {
                gamma_offset: off,
                dgamma_mode: if accumulate {
                    DgammaMode::Accumulate
                } else {
                    DgammaMode::Overwrite
                },
            };
            let init: Vec<f32> = (0..n).map(|_| rng.mag() as f32).collect();
            let ub = ubs()[oi % 2];
            let dres = with_dres.then_some(&dres[..]);
            let got = run_grad(
                &cpu.with_ub(ub),
                &dy,
                &x,
                &xs,
                &fwd.rstd,
                &g,
                &gs,
                dres,
                &opts,
                Some(init.clone()),
            );
            let want = run_grad(
                &refx,
                &dy,
                &x,
                &xs,
                &fwd.rstd,
                &g,
                &gs,
                dres,
                &opts,
                Some(init.clone()),
            );
            let mut s = Stats::default();
            s.dx(
                &got.dx,
                &want.dx,
                n,
                &dx_scale(&dy, &g, off, &fwd.rstd, dres, n),
            );
            let mut cond = dgamma_condition(&dy, &x, &fwd.rstd, n);
            if accumulate {
                for (c, i) in cond.iter_mut().zip(&init) {
                    *c += (*i as f64).abs();
                }
            }
            s.dgamma(&got.dgamma, &want.dgamma, &cond);
            // The cast output is the f32 dgamma rounded once.
            for (c, f) in got.dgamma_cast.iter().zip(&got.dgamma) {
                assert_eq!(c.to_f32().to_bits(), G::from_f32(*f).to_f32().to_bits());
            }
            assert!(
                s.dx_score <= 1.0,
                "{:?} n={n}: dx score {}",
                T::DTYPE,
                s.dx_score
            );
            assert!(
                s.dgamma_cond_rel <= 1e-5,
                "{:?} n={n}: dgamma {:e}",
                T::DTYPE,
                s.dgamma_cond_rel
            );
            total.merge(&s);
        }
    }
    println!(
        "backward {:?} x / {:?} gamma: {total:?}",
        T::DTYPE,
        G::DTYPE
    );
    total
}

#[test]
fn forward_f32() {
    forward_all::<f32, f32>(1);
}
#[test]
fn forward_f16() {
    forward_all::<f16, f16>(2);
}
#[test]
fn forward_f16_gamma_f32() {
    forward_all::<f16, f32>(3);
}
#[test]
fn forward_bf16() {
    forward_all::<bf16, bf16>(4);
}
#[test]
fn forward_bf16_gamma_f32() {
    forward_all::<bf16, f32>(5);
}
#[test]
fn backward_f32() {
    backward_all::<f32, f32>(11);
}
#[test]
fn backward_f16() {
    backward_all::<f16, f16>(12);
}
#[test]
fn backward_f16_gamma_f32() {
    backward_all::<f16, f32>(13);
}
#[test]
fn backward_bf16() {
    backward_all::<bf16, bf16>(14);
}
#[test]
fn backward_bf16_gamma_f32() {
    backward_all::<bf16, f32>(15);
}
