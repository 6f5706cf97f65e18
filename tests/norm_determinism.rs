//! Reproducibility: y, rstd, x_sum and dx are bit-identical across blocks,
//! ub_bytes (merge-N vs split-D), thread counts and batch sizes; dgamma is
//! bit-identical across thread counts for a given `blocks`. Also: fused
//! AddRmsNorm equals add-then-norm bit for bit, and NaN/Inf propagate.

mod common;

use common::*;
use half::{bf16, f16};
use npukern::*;

fn configs() -> Vec<UbConfig> {
    let mut v = vec![];
    for blocks in [1u32, 3, 64] {
        for ub_bytes in [1024usize, 4096, 65536, 196_608] {
            v.push(UbConfig { ub_bytes, blocks });
        }
    }
    v
}

fn forward_invariance<T: Float>(n: usize, m: usize, seed: u64) {
    let mut rng = Rng(seed);
    let x: Vec<T> = vec_of(m * n, || rng.mag());
    let x2: Vec<T> = vec_of(m * n, || rng.mag());
    let g: Vec<T> = vec_of(n, || rng.uniform(-2.0, 2.0));
    let (xs, gs) = ([m, n], [n]);
    let opts = RmsNormOptions::default();
    let base = run_rms_norm(&Exec::cpu(), &x, &xs, &g, &gs, &opts);
    let base_add = run_add_rms_norm(&Exec::cpu(), &x, &x2, &xs, &g, &gs, &opts);
    for threads in [1usize, 2, 4] {
        let cpu = Cpu::new(Threads::new(threads));
        for ub in configs() {
            let exec = Exec::new(&cpu).with_ub(ub);
            let what = format!("{:?} n={n} threads={threads} {ub:?}", T::DTYPE);
            let f = run_rms_norm(&exec, &x, &xs, &g, &gs, &opts);
            assert_same_bits(&f.y, &base.y, &what);
            assert_same_bits(&f.rstd, &base.rstd, &what);
            let a = run_add_rms_norm(&exec, &x, &x2, &xs, &g, &gs, &opts);
            assert_same_bits(&a.y, &base_add.y, &what);
            assert_same_bits(&a.rstd, &base_add.rstd, &what);
            assert_same_bits(&a.x_sum, &base_add.x_sum, &what);
        }
    }
    // Batch size: each row alone gives the bits it has inside the batch.
    for r in [0, m / 2, m - 1] {
        let row = &x[r * n..(r + 1) * n];
        let one = run_rms_norm(&Exec::cpu(), row, &[1, n], &g, &gs, &opts);
        assert_same_bits(&one.y, &base.y[r * n..(r + 1) * n], "row alone");
        assert_same_bits(&one.rstd, &base.rstd[r..r + 1], "row alone rstd");
    }
}

fn backward_invariance<T: Float>(n: usize, m: usize, seed: u64) {
    let mut rng = Rng(seed);
    let x: Vec<T> = vec_of(m * n, || rng.mag());
    let dy: Vec<T> = vec_of(m * n, || rng.mag());
    let g: Vec<T> = vec_of(n, || rng.uniform(-2.0, 2.0));
    let (xs, gs) = ([m, n], [n]);
    let rstd = run_rms_norm(&Exec::cpu(), &x, &xs, &g, &gs, &RmsNormOptions::default()).rstd;
    let opts = RmsNormGradOptions::default();
    let base = run_grad(
        &Exec::cpu(),
        &dy,
        &x,
        &xs,
        &rstd,
        &g,
        &gs,
        None,
        &opts,
        None,
    );
    for ub in configs() {
        // dgamma for this `blocks`, from a single thread.
        let serial = run_grad(
            &Exec::cpu().with_ub(ub),
            &dy,
            &x,
            &xs,
            &rstd,
            &g,
            &gs,
            None,
            &opts,
            None,
        );
        assert_same_bits(&serial.dx, &base.dx, "dx across tilings");
        for threads in [2usize, 4] {
            let cpu = Cpu::new(Threads::new(threads));
            let exec = Exec::new(&cpu).with_ub(ub);
            let what = format!("{:?} n={n} threads={threads} {ub:?}", T::DTYPE);
            let b = run_grad(&exec, &dy, &x, &xs, &rstd, &g, &gs, None, &opts, None);
            assert_same_bits(&b.dx, &base.dx, &what);
            assert_same_bits(&b.dgamma, &serial.dgamma, &what);
        }
        // Split-D and merge-N give the same dgamma too (row order per block is fixed).
        let other = UbConfig {
            ub_bytes: 196_608,
            blocks: ub.blocks,
        };
        let o = run_grad(
            &Exec::cpu().with_ub(other),
            &dy,
            &x,
            &xs,
            &rstd,
            &g,
            &gs,
            None,
            &opts,
            None,
        );
        assert_same_bits(&o.dgamma, &serial.dgamma, "dgamma merge-N vs split-D");
    }
    for r in [0, m - 1] {
        let sl = r * n..(r + 1) * n;
        let one = run_grad(
            &Exec::cpu(),
            &dy[sl.clone()],
            &x[sl.clone()],
            &[1, n],
            &rstd[r..r + 1],
            &g,
            &gs,
            None,
            &opts,
            None,
        );
        assert_same_bits(&one.dx, &base.dx[sl], "dx row alone");
    }
}

#[test]
fn forward_bits_invariant() {
    for (i, n) in [1usize, 17, 4095, 12288].into_iter().enumerate() {
        forward_invariance::<bf16>(n, 11, 100 + i as u64);
        forward_invariance::<f32>(n, 5, 200 + i as u64);
    }
    forward_invariance::<f16>(110_000, 3, 300);
}

#[test]
fn backward_bits_invariant() {
    for (i, n) in [1usize, 17, 4095, 12288].into_iter().enumerate() {
        backward_invariance::<bf16>(n, 11, 400 + i as u64);
        backward_invariance::<f16>(n, 5, 500 + i as u64);
    }
    backward_invariance::<f32>(110_000, 3, 600);
}

#[test]
fn fused_add_equals_add_then_norm() {
    let mut rng = Rng(7);
    for n in [7usize, 16, 4095, 110_000] {
        let m = 3;
        let x1: Vec<bf16> = vec_of(m * n, || rng.mag());
        let x2: Vec<bf16> = vec_of(m * n, || rng.mag());
        let g: Vec<f32> = vec_of(n, || rng.uniform(-2.0, 2.0));
        let opts = RmsNormOptions::default();
        let fused = run_add_rms_norm(&Exec::cpu(), &x1, &x2, &[m, n], &g, &[n], &opts);
        let added: Vec<bf16> = x1
            .iter()
            .zip(&x2)
            .map(|(a, b)| bf16::from_f32(a.to_f32() + b.to_f32()))
            .collect();
        assert_same_bits(&fused.x_sum, &added, "x_sum = round(x1 + x2)");
        let sep = run_rms_norm(&Exec::cpu(), &added, &[m, n], &g, &[n], &opts);
        assert_same_bits(&fused.y, &sep.y, "y");
        assert_same_bits(&fused.rstd, &sep.rstd, "rstd");
        // In place over x1 gives the same bits.
        let mut inplace = x1.clone();
        let mut y = vec![bf16::ZERO; m * n];
        let mut rstd = vec![0f32; m];
        let exec = Exec::cpu().with_ub(UbConfig {
            ub_bytes: 2048,
            blocks: 2,
        });
        let (x2t, gt) = (
            TensorRef::new(&x2, &[m, n]).unwrap(),
            TensorRef::new(&g, &[n]).unwrap(),
        );
        let ws_len = add_rms_norm_workspace_size(&exec, x2t, x2t, gt, &opts).unwrap();
        let mut ws = vec![0u8; ws_len];
        add_rms_norm_in_place(
            &exec,
            TensorMut::new(&mut inplace, &[m, n]).unwrap(),
            x2t,
            gt,
            &opts,
            &mut y,
            Some(&mut rstd),
            &mut ws,
        )
        .unwrap();
        assert_same_bits(&inplace, &added, "in-place x_sum");
        assert_same_bits(&y, &sep.y, "in-place y");
    }
}

#[test]
fn grad_in_place_and_cast_match() {
    let mut rng = Rng(8);
    let (m, n) = (6usize, 300usize);
    let x: Vec<f16> = vec_of(m * n, || rng.mag());
    let dy: Vec<f16> = vec_of(m * n, || rng.mag());
    let dres: Vec<f16> = vec_of(m * n, || rng.mag());
    let g: Vec<f16> = vec_of(n, || rng.uniform(-2.0, 2.0));
    let rstd = run_rms_norm(
        &Exec::cpu(),
        &x,
        &[m, n],
        &g,
        &[n],
        &RmsNormOptions::default(),
    )
    .rstd;
    let opts = RmsNormGradOptions::default();
    let sep = run_grad(
        &Exec::cpu(),
        &dy,
        &x,
        &[m, n],
        &rstd,
        &g,
        &[n],
        Some(&dres),
        &opts,
        None,
    );
    let mut buf = dy.clone();
    let mut dg = vec![0f32; n];
    let (xt, gt) = (
        TensorRef::new(&x, &[m, n]).unwrap(),
        TensorRef::new(&g, &[n]).unwrap(),
    );
    let exec = Exec::cpu().with_ub(UbConfig {
        ub_bytes: 1024,
        blocks: 64,
    });
    let rt = TensorRef::new(&rstd, &[m]).unwrap();
    let dres_t = TensorRef::new(&dres, &[m, n]).unwrap();
    let mut ws = vec![
        0u8;
        rms_norm_grad_workspace_size(
            &exec,
            xt,
            &RmsNormGradInputs {
                x: xt,
                rstd: rt,
                gamma: gt,
                dres: Some(dres_t)
            },
            &opts
        )
        .unwrap()
    ];
    rms_norm_grad_in_place(
        &exec,
        TensorMut::new(&mut buf, &[m, n]).unwrap(),
        &RmsNormGradInputs {
            x: xt,
            rstd: rt,
            gamma: gt,
            dres: Some(dres_t),
        },
        &opts,
        DgammaOut {
            dgamma: Some(&mut dg),
            dgamma_cast: None,
        },
        &mut ws,
    )
    .unwrap();
    assert_same_bits(&buf, &sep.dx, "dx in place");
}

#[test]
fn nan_and_inf_propagate() {
    let n = 33;
    let mut x = vec![f16::from_f32(0.5); 4 * n];
    x[3] = f16::NAN; // row 0: NaN
    x[n + 5] = f16::INFINITY; // row 1: Inf -> rstd 0, Inf * 0 = NaN, others 0
    let g = vec![70000.0f32; n]; // rows 2, 3: 0.5 * rstd(=2) * 70000 = 70000 > 65504 -> Inf in f16
    let opts = RmsNormOptions {
        eps: 0.0,
        ..Default::default()
    };
    let cpu = run_rms_norm(&Exec::cpu(), &x, &[4, n], &g, &[n], &opts);
    let refx = run_rms_norm(&reference(), &x, &[4, n], &g, &[n], &opts);
    assert!(cpu.rstd[0].is_nan() && cpu.y[..n].iter().all(|v| v.is_nan()));
    assert_eq!(cpu.rstd[1], 0.0);
    assert!(cpu.y[n + 5].is_nan());
    assert!(
        cpu.y[2 * n..3 * n].iter().all(|v| *v == f16::INFINITY),
        "overflow rounds to Inf, never clamps"
    );
    assert_same_bits(&cpu.y, &refx.y, "NaN/Inf vs reference");
    // Backward: a NaN in dy spreads over its row's dx and into dgamma's column.
    let mut dy = vec![f16::from_f32(1.0); 4 * n];
    dy[2 * n + 1] = f16::NAN;
    let xs = vec![f16::from_f32(0.25); 4 * n];
    let rstd = vec![2.0f32; 4];
    let b = run_grad(
        &Exec::cpu(),
        &dy,
        &xs,
        &[4, n],
        &rstd,
        &g,
        &[n],
        None,
        &RmsNormGradOptions::default(),
        None,
    );
    assert!(b.dx[2 * n..3 * n].iter().all(|v| v.is_nan()));
    assert!(b.dx[..n].iter().all(|v| !v.is_nan()));
    assert!(b.dgamma[1].is_nan() && !b.dgamma[0].is_nan());
}

/// Every kernel under every ISA this machine has gives the portable bits
/// (y, rstd, x_sum, dx and dgamma), in every dtype, merge-N and split-D.
#[test]
fn bits_identical_across_isas() {
    fn check<T: Float>(n: usize, m: usize, seed: u64) {
        let mut rng = Rng(seed);
        let x: Vec<T> = vec_of(m * n, || rng.mag());
        let x2: Vec<T> = vec_of(m * n, || rng.mag());
        let dy: Vec<T> = vec_of(m * n, || rng.mag());
        let mut g: Vec<T> = vec_of(n, || rng.uniform(-2.0, 2.0));
        // Specials must convert identically too.
        let mut x = x;
        if m * n > 8 {
            x[1] = T::from_f64(f64::NAN);
            x[n.min(m * n - 1)] = T::from_f64(1e30);
            g[0] = T::from_f64(-0.0);
        }
        let (xs, gs) = ([m, n], [n]);
        let base = Cpu::new(Serial).with_isa(Isa::Portable);
        for opts in [
            RmsNormOptions::default(),
            RmsNormOptions {
                gamma_offset: 1.0,
                rounding: Rounding::CastBeforeGamma,
                ..Default::default()
            },
        ] {
            for ub in [
                UbConfig::default(),
                UbConfig {
                    ub_bytes: 2048,
                    blocks: 5,
                },
            ] {
                let pe = Exec::new(&base).with_ub(ub);
                let want = run_rms_norm(&pe, &x, &xs, &g, &gs, &opts);
                let want_add = run_add_rms_norm(&pe, &x, &x2, &xs, &g, &gs, &opts);
                let gopts = RmsNormGradOptions {
                    gamma_offset: opts.gamma_offset,
                    ..Default::default()
                };
                let want_bwd = run_grad(
                    &pe,
                    &dy,
                    &x,
                    &xs,
                    &want.rstd,
                    &g,
                    &gs,
                    Some(&x2),
                    &gopts,
                    None,
                );
                for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
                    let cpu = Cpu::new(Serial).with_isa(isa);
                    let e = Exec::new(&cpu).with_ub(ub);
                    let what = format!("{isa:?} {:?} n={n} {ub:?}", T::DTYPE);
                    let got = run_rms_norm(&e, &x, &xs, &g, &gs, &opts);
                    assert_same_bits(&got.y, &want.y, &what);
                    assert_same_bits(&got.rstd, &want.rstd, &what);
                    let got = run_add_rms_norm(&e, &x, &x2, &xs, &g, &gs, &opts);
                    assert_same_bits(&got.y, &want_add.y, &what);
                    assert_same_bits(&got.x_sum, &want_add.x_sum, &what);
                    let got = run_grad(
                        &e,
                        &dy,
                        &x,
                        &xs,
                        &want.rstd,
                        &g,
                        &gs,
                        Some(&x2),
                        &gopts,
                        None,
                    );
                    assert_same_bits(&got.dx, &want_bwd.dx, &what);
                    assert_same_bits(&got.dgamma, &want_bwd.dgamma, &what);
                    assert_same_bits(&got.dgamma_cast, &want_bwd.dgamma_cast, &what);
                }
            }
        }
    }
    for (i, n) in [1usize, 17, 300, 4095].into_iter().enumerate() {
        check::<f32>(n, 7, 700 + i as u64);
        check::<f16>(n, 7, 710 + i as u64);
        check::<bf16>(n, 7, 720 + i as u64);
    }
    check::<bf16>(110_000, 2, 730);
}
