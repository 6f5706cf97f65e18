//! Outputs of 8 MiB or more are written with streaming stores (the plan's
//! `NORM_FLAG_STREAM`), and the CPU kernels then carry each row's first pass
//! inside the previous row's second pass. Neither may change a bit: a large
//! call must equal the same rows computed in small (non-streaming) calls, on
//! every ISA, with the output on a 64-byte line or off it, for row lengths
//! that keep rows on lines (4096) and that do not (4100).

mod common;

use common::{bits, vec_of, Rng};
use npukern::*;

/// Rows whose output is just over the streaming floor.
fn rows_for<T>(n: usize) -> usize {
    (STREAM_MIN_BYTES / (n * core::mem::size_of::<T>())) + 3
}

/// A zeroed buffer and the offset of its first 64-byte-aligned element plus
/// `shift` elements.
fn out_buf<T: Float>(len: usize, shift: usize) -> (Vec<T>, usize) {
    let buf = vec![T::from_f64(0.0); len + 64];
    let size = core::mem::size_of::<T>();
    let mis = buf.as_ptr() as usize % 64;
    let first = if mis == 0 { 0 } else { (64 - mis) / size };
    (buf, first + shift)
}

/// Every executor to compare: each available ISA, serial and on 2 threads.
fn each_exec(f: &mut dyn FnMut(&Exec<'_>, &str)) {
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        let serial = Cpu::new(Serial).with_isa(isa);
        f(&Exec::new(&serial), &format!("{isa:?} serial"));
        let threads = Cpu::new(Threads::new(2)).with_isa(isa);
        f(&Exec::new(&threads), &format!("{isa:?} 2 threads"));
    }
}

/// Rows per small call: under the floor for every dtype and n here.
const CHUNK: usize = 96;

fn forward<T: Float>(n: usize, seed: u64) {
    let m = rows_for::<T>(n);
    let mut rng = Rng(seed);
    let x1: Vec<T> = vec_of(m * n, || rng.uniform(-3.0, 3.0));
    let x2: Vec<T> = vec_of(m * n, || rng.uniform(-3.0, 3.0));
    let g: Vec<T> = vec_of(n, || rng.uniform(-2.0, 2.0));
    let gt = TensorRef::new(&g, &[n]).unwrap();
    let small = Exec::cpu();
    for opts in [
        RmsNormOptions::default(),
        RmsNormOptions {
            rounding: Rounding::CastBeforeGamma,
            gamma_offset: 1.0,
            ..Default::default()
        },
    ] {
        // The expected rows, from small calls.
        let (mut y_w, mut s_w, mut yadd_w) = (vec![], vec![], vec![]);
        for r0 in (0..m).step_by(CHUNK) {
            let rows = CHUNK.min(m - r0);
            let a = TensorRef::new(&x1[r0 * n..(r0 + rows) * n], &[rows, n]).unwrap();
            let b = TensorRef::new(&x2[r0 * n..(r0 + rows) * n], &[rows, n]).unwrap();
            let mut ws = vec![0u8; add_rms_norm_workspace_size(&small, a, b, gt, &opts).unwrap()];
            let mut y = vec![T::from_f64(0.0); rows * n];
            rms_norm(&small, a, gt, &opts, &mut y, None, &mut ws).unwrap();
            y_w.extend(y);
            let (mut y, mut s) = (
                vec![T::from_f64(0.0); rows * n],
                vec![T::from_f64(0.0); rows * n],
            );
            add_rms_norm(&small, a, b, gt, &opts, &mut y, None, Some(&mut s), &mut ws).unwrap();
            yadd_w.extend(y);
            s_w.extend(s);
        }
        let a = TensorRef::new(&x1, &[m, n]).unwrap();
        let b = TensorRef::new(&x2, &[m, n]).unwrap();
        each_exec(&mut |exec, name| {
            let plan = NormTiling::new(m, n, core::mem::size_of::<T>(), 1, false, &exec.ub);
            assert!(
                plan.unwrap().flags & NORM_FLAG_STREAM != 0,
                "{m}x{n} must stream"
            );
            let mut ws = vec![0u8; add_rms_norm_workspace_size(exec, a, b, gt, &opts).unwrap()];
            for shift in [0, 1] {
                let what = format!("{name}, n {n}, output shift {shift}, {opts:?}");
                let (mut yb, o) = out_buf::<T>(m * n, shift);
                rms_norm(exec, a, gt, &opts, &mut yb[o..o + m * n], None, &mut ws).unwrap();
                assert_eq!(bits(&yb[o..o + m * n]), bits(&y_w), "rms_norm y: {what}");
                let (mut yb, o) = out_buf::<T>(m * n, shift);
                let (mut sb, so) = out_buf::<T>(m * n, shift);
                add_rms_norm(
                    exec,
                    a,
                    b,
                    gt,
                    &opts,
                    &mut yb[o..o + m * n],
                    None,
                    Some(&mut sb[so..so + m * n]),
                    &mut ws,
                )
                .unwrap();
                assert_eq!(
                    bits(&yb[o..o + m * n]),
                    bits(&yadd_w),
                    "add_rms_norm y: {what}"
                );
                assert_eq!(
                    bits(&sb[so..so + m * n]),
                    bits(&s_w),
                    "add_rms_norm x_sum: {what}"
                );
                // In place: y streamed, x_sum over x1 with ordinary stores.
                let (mut yb, o) = out_buf::<T>(m * n, shift);
                let (mut xb, xo) = out_buf::<T>(m * n, shift);
                xb[xo..xo + m * n].copy_from_slice(&x1);
                let x1m = TensorMut::new(&mut xb[xo..xo + m * n], &[m, n]).unwrap();
                add_rms_norm_in_place(
                    exec,
                    x1m,
                    b,
                    gt,
                    &opts,
                    &mut yb[o..o + m * n],
                    None,
                    &mut ws,
                )
                .unwrap();
                assert_eq!(bits(&yb[o..o + m * n]), bits(&yadd_w), "in place y: {what}");
                assert_eq!(bits(&xb[xo..xo + m * n]), bits(&s_w), "in place x1: {what}");
            }
        });
    }
}

fn backward<T: Float>(n: usize, seed: u64) {
    let m = rows_for::<T>(n);
    let mut rng = Rng(seed);
    let dy: Vec<T> = vec_of(m * n, || rng.uniform(-3.0, 3.0));
    let x: Vec<T> = vec_of(m * n, || rng.uniform(-3.0, 3.0));
    let dres: Vec<T> = vec_of(m * n, || rng.uniform(-1.0, 1.0));
    let rstd: Vec<f32> = (0..m).map(|_| rng.uniform(0.2, 2.0) as f32).collect();
    let g: Vec<f32> = vec_of(n, || rng.uniform(-2.0, 2.0));
    let gt = TensorRef::new(&g, &[n]).unwrap();
    let small = Exec::cpu();
    let opts = RmsNormGradOptions::default();
    for with_dres in [false, true] {
        let mut want = vec![];
        for r0 in (0..m).step_by(CHUNK) {
            let rows = CHUNK.min(m - r0);
            let dims = [rows, n];
            let span = r0 * n..(r0 + rows) * n;
            let rt = TensorRef::new(&rstd[r0..r0 + rows], &[rows]).unwrap();
            let dr = with_dres.then(|| TensorRef::new(&dres[span.clone()], &dims).unwrap());
            let (dyt, xt) = (
                TensorRef::new(&dy[span.clone()], &dims).unwrap(),
                TensorRef::new(&x[span.clone()], &dims).unwrap(),
            );
            let mut ws = vec![
                0u8;
                rms_norm_grad_workspace_size(
                    &small,
                    dyt,
                    &RmsNormGradInputs {
                        x: xt,
                        rstd: rt,
                        gamma: gt,
                        dres: dr
                    },
                    &opts
                )
                .unwrap()
            ];
            let mut dx = vec![T::from_f64(0.0); rows * n];
            rms_norm_grad(
                &small,
                dyt,
                &RmsNormGradInputs {
                    x: xt,
                    rstd: rt,
                    gamma: gt,
                    dres: dr,
                },
                &opts,
                &mut dx,
                DgammaOut::default(),
                &mut ws,
            )
            .unwrap();
            want.extend(dx);
        }
        let (dyt, xt) = (
            TensorRef::new(&dy, &[m, n]).unwrap(),
            TensorRef::new(&x, &[m, n]).unwrap(),
        );
        let rt = TensorRef::new(&rstd, &[m]).unwrap();
        let dr = with_dres.then(|| TensorRef::new(&dres, &[m, n]).unwrap());
        each_exec(&mut |exec, name| {
            let mut ws = vec![
                0u8;
                rms_norm_grad_workspace_size(
                    exec,
                    dyt,
                    &RmsNormGradInputs {
                        x: xt,
                        rstd: rt,
                        gamma: gt,
                        dres: dr
                    },
                    &opts
                )
                .unwrap()
            ];
            for shift in [0, 1] {
                let (mut b, o) = out_buf::<T>(m * n, shift);
                let mut dg = vec![0f32; n];
                rms_norm_grad(
                    exec,
                    dyt,
                    &RmsNormGradInputs {
                        x: xt,
                        rstd: rt,
                        gamma: gt,
                        dres: dr,
                    },
                    &opts,
                    &mut b[o..o + m * n],
                    DgammaOut {
                        dgamma: Some(&mut dg),
                        dgamma_cast: None,
                    },
                    &mut ws,
                )
                .unwrap();
                assert_eq!(
                    bits(&b[o..o + m * n]),
                    bits(&want),
                    "dx: {name}, n {n}, shift {shift}, dres {with_dres}"
                );
            }
        });
    }
}

#[test]
fn streamed_forward_equals_small_calls() {
    for n in [4096, 4100] {
        forward::<bf16>(n, 1);
        forward::<f16>(n, 2);
        forward::<f32>(n, 3);
    }
}

#[test]
fn streamed_backward_equals_small_calls() {
    for n in [4096, 4100] {
        backward::<bf16>(n, 4);
        backward::<f16>(n, 5);
        backward::<f32>(n, 6);
    }
}

/// EmbeddingDenseGrad into a table of 8 MiB or more streams its zero fill
/// and copied rows: the table must equal the same rows computed as vocab
/// shards small enough not to stream (untouched, single, repeated and
/// padding rows alike), for a table that starts on a line and one that
/// does not.
fn embedding<G: Float, O: Float>(seed: u64) {
    let (h, n) = (1000usize, 3000usize);
    let v = STREAM_MIN_BYTES / (h * core::mem::size_of::<G>()) + 40;
    let mut rng = Rng(seed);
    let grad: Vec<G> = vec_of(n * h, || rng.uniform(-2.0, 2.0));
    // Zipf-like ids: a few hot rows, many single ones, long untouched runs.
    let idx: Vec<i64> = (0..n)
        .map(|_| ((v as f64).powf(rng.unit()) as i64 - 1).clamp(0, v as i64 - 1))
        .collect();
    let (gt, it) = (
        TensorRef::new(&grad, &[n, h]).unwrap(),
        TensorRef::new(&idx, &[n]).unwrap(),
    );
    let small = Exec::cpu();
    let shard = v / 9;
    for scale in [false, true] {
        let base = EmbeddingGradOptions {
            padding_idx: idx[5],
            scale_grad_by_freq: scale,
            ..Default::default()
        };
        let mut want = vec![];
        for start in (0..v).step_by(shard) {
            let rows = shard.min(v - start);
            let o = EmbeddingGradOptions {
                vocab_start: start as i64,
                out_of_range: IndexPolicy::Ignore,
                ..base
            };
            let mut ws =
                vec![0u8; embedding_dense_grad_workspace_size(&small, gt, it, rows, &o).unwrap()];
            let mut out = vec![O::from_f64(7.0); rows * h];
            embedding_dense_grad(&small, gt, it, rows, &o, &mut out, &mut ws).unwrap();
            want.extend(out);
        }
        each_exec(&mut |exec, name| {
            let mut ws =
                vec![0u8; embedding_dense_grad_workspace_size(exec, gt, it, v, &base).unwrap()];
            for shift in [0, 1] {
                let (mut b, o) = out_buf::<O>(v * h, shift);
                embedding_dense_grad(exec, gt, it, v, &base, &mut b[o..o + v * h], &mut ws)
                    .unwrap();
                assert_eq!(
                    bits(&b[o..o + v * h]),
                    bits(&want),
                    "table: {name}, shift {shift}, scale {scale}"
                );
            }
        });
    }
}

#[test]
fn streamed_embedding_equals_small_shards() {
    embedding::<bf16, bf16>(7);
    embedding::<f32, f32>(8);
    embedding::<f16, f32>(9);
}
