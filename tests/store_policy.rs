//! The store policy (`Exec::outputs`, `OutputPages`) decides only how large
//! outputs are stored: every operator and dtype writes the same bits with
//! each hint, on one thread and on two, and the hint reaches the plan a
//! backend receives (`NORM_FLAG_STREAM` set or cleared as
//! `docs/performance.md` "Store policy" says).

use std::sync::atomic::{AtomicU32, Ordering};

use npukern::*;

/// A CPU backend on 2 threads that records the last plan's flags.
struct Recording {
    cpu: Cpu<Threads>,
    flags: AtomicU32,
}

// SAFETY: it runs every call on its `Cpu`, writing only what that writes.
unsafe impl Backend for Recording {
    unsafe fn launch(&self, op: Op<'_>) -> Result<()> {
        let flags = match op {
            Op::RmsNorm(c) => c.tiling.flags,
            Op::AddRmsNorm(c) => c.tiling.flags,
            Op::RmsNormGrad(c) => c.tiling.flags,
            Op::EmbeddingDenseGrad(c) => c.tiling.flags,
            Op::Swiglu(c) => c.tiling.flags,
            Op::SwigluGrad(c) => c.tiling.flags,
            Op::Rope(c) => c.tiling.flags,
            _ => u32::MAX,
        };
        self.flags.store(flags, Ordering::Relaxed);
        // SAFETY: forwarded from the trait's contract.
        unsafe { self.cpu.launch(op) }
    }
}

const HINTS: [OutputPages; 3] = [
    OutputPages::Unknown,
    OutputPages::Fresh,
    OutputPages::Resident,
];

/// Runs `f` (one operator call writing its outputs, returned as bits) under
/// each hint, serially and on the recording 2-thread backend; checks the
/// bits are those of the unhinted serial call and that the plan streamed
/// exactly when the hint says (`fresh_streams`: the operator keeps
/// streaming fresh pages).
fn each_hint(name: &str, fresh_streams: bool, f: &mut dyn FnMut(&Exec<'_>) -> Vec<u32>) {
    let want = f(&Exec::cpu());
    let rec = Recording {
        cpu: Cpu::new(Threads::new(2)),
        flags: AtomicU32::new(0),
    };
    for hint in HINTS {
        assert_eq!(
            f(&Exec::cpu().with_outputs(hint)),
            want,
            "{name} {hint:?} serial"
        );
        let got = f(&Exec::new(&rec).with_outputs(hint));
        assert_eq!(got, want, "{name} {hint:?} 2 threads");
        let streamed = rec.flags.load(Ordering::Relaxed) & NORM_FLAG_STREAM != 0;
        let expect = hint != OutputPages::Fresh || fresh_streams;
        assert_eq!(streamed, expect, "{name} {hint:?}: NORM_FLAG_STREAM");
        assert_eq!(hint.stream(true), hint != OutputPages::Fresh);
        assert!(!hint.stream(false));
    }
}

fn data<T: Float>(n: usize, seed: u32) -> Vec<T> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            T::from_f32((s % 2000) as f32 / 500.0 - 2.0)
        })
        .collect()
}

fn bits<T: Float>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

/// Rows of `n` elements of `T` just over the streaming floor.
fn rows_for<T>(n: usize) -> usize {
    STREAM_MIN_BYTES / (n * core::mem::size_of::<T>()) + 3
}

fn norms<T: Float>() {
    let n = 1000; // rows not on 64-byte lines for any dtype
    let m = rows_for::<T>(n);
    let dt = format!("{:?}", T::DTYPE);
    let (x1, x2, dy) = (
        data::<T>(m * n, 1),
        data::<T>(m * n, 2),
        data::<T>(m * n, 3),
    );
    let g = data::<T>(n, 4);
    let gt = TensorRef::new(&g, &[n]).unwrap();
    let opts = RmsNormOptions::default();
    each_hint(&format!("rms_norm {dt}"), false, &mut |e| {
        let xt = TensorRef::new(&x1, &[m, n]).unwrap();
        let mut ws = vec![0u8; rms_norm_workspace_size(e, xt, gt, &opts).unwrap()];
        let (mut y, mut r) = (vec![T::from_f32(0.0); m * n], vec![0f32; m]);
        rms_norm(e, xt, gt, &opts, &mut y, Some(&mut r), &mut ws).unwrap();
        let mut b = bits(&y);
        b.extend(r.iter().map(|v| v.to_bits()));
        b
    });
    each_hint(&format!("add_rms_norm {dt}"), false, &mut |e| {
        let a = TensorRef::new(&x1, &[m, n]).unwrap();
        let c = TensorRef::new(&x2, &[m, n]).unwrap();
        let mut ws = vec![0u8; add_rms_norm_workspace_size(e, a, c, gt, &opts).unwrap()];
        let (mut y, mut s) = (vec![T::from_f32(0.0); m * n], vec![T::from_f32(0.0); m * n]);
        add_rms_norm(e, a, c, gt, &opts, &mut y, None, Some(&mut s), &mut ws).unwrap();
        let mut b = bits(&y);
        b.extend(bits(&s));
        b
    });
    let rstd = vec![0.7f32; m];
    each_hint(&format!("rms_norm_grad {dt}"), false, &mut |e| {
        let (dyt, xt) = (
            TensorRef::new(&dy, &[m, n]).unwrap(),
            TensorRef::new(&x1, &[m, n]).unwrap(),
        );
        let inputs = RmsNormGradInputs::new(xt, TensorRef::new(&rstd, &[m]).unwrap(), gt);
        let gopts = RmsNormGradOptions::default();
        let mut ws = vec![0u8; rms_norm_grad_workspace_size(e, dyt, &inputs, &gopts).unwrap()];
        let (mut dx, mut dg) = (vec![T::from_f32(0.0); m * n], vec![0f32; n]);
        let out = DgammaOut {
            dgamma: Some(&mut dg[..]),
            dgamma_cast: None,
        };
        rms_norm_grad(e, dyt, &inputs, &gopts, &mut dx, out, &mut ws).unwrap();
        let mut b = bits(&dx);
        b.extend(dg.iter().map(|v| v.to_bits()));
        b
    });
}

fn elementwise<T: Float>() {
    let n = 1000;
    let m = rows_for::<T>(n);
    let dt = format!("{:?}", T::DTYPE);
    let (g, u, dy) = (
        data::<T>(m * n, 5),
        data::<T>(m * n, 6),
        data::<T>(m * n, 7),
    );
    let opts = SwigluOptions::default();
    each_hint(&format!("swiglu {dt}"), false, &mut |e| {
        let (gt, ut) = (
            TensorRef::new(&g, &[m, n]).unwrap(),
            TensorRef::new(&u, &[m, n]).unwrap(),
        );
        let mut y = vec![T::from_f32(0.0); m * n];
        silu_mul(e, gt, ut, &opts, &mut y, &mut []).unwrap();
        bits(&y)
    });
    each_hint(&format!("swiglu_grad {dt}"), false, &mut |e| {
        let d = [m, n];
        let (dyt, gt, ut) = (
            TensorRef::new(&dy, &d).unwrap(),
            TensorRef::new(&g, &d).unwrap(),
            TensorRef::new(&u, &d).unwrap(),
        );
        let (mut da, mut db) = (vec![T::from_f32(0.0); m * n], vec![T::from_f32(0.0); m * n]);
        silu_mul_grad(e, dyt, gt, ut, &opts, &mut da, &mut db, &mut []).unwrap();
        let mut b = bits(&da);
        b.extend(bits(&db));
        b
    });
    // RoPE: [1, heads, seq, 128] q and k, cos/sin [1, 1, seq, 128].
    let (d, seq) = (128usize, 256usize);
    let heads = STREAM_MIN_BYTES / (seq * d * core::mem::size_of::<T>()) + 1;
    let len = heads * seq * d;
    let (q, k) = (data::<T>(len, 8), data::<T>(len, 9));
    let (cos, sin) = (data::<T>(seq * d, 10), data::<T>(seq * d, 11));
    for backward in [false, true] {
        let ropts = RopeOptions {
            backward,
            ..Default::default()
        };
        each_hint(&format!("rope {dt} backward={backward}"), false, &mut |e| {
            let dims = [1, heads, seq, d];
            let cd = [1, 1, seq, d];
            let (ct, st) = (
                TensorRef::new(&cos, &cd).unwrap(),
                TensorRef::new(&sin, &cd).unwrap(),
            );
            let (qt, kt) = (
                TensorRef::new(&q, &dims).unwrap(),
                TensorRef::new(&k, &dims).unwrap(),
            );
            let (mut qo, mut ko) = (vec![T::from_f32(0.0); len], vec![T::from_f32(0.0); len]);
            rope(
                e,
                qt,
                Some(kt),
                ct,
                st,
                &ropts,
                &mut qo,
                Some(&mut ko),
                &mut [],
            )
            .unwrap();
            let mut b = bits(&qo);
            b.extend(bits(&ko));
            b
        });
    }
}

fn embedding<G: Float, O: Float>() {
    let h = 1000;
    let v = rows_for::<G>(h); // the plan counts the table at grad's element size
    let n = 3000;
    let dt = format!("{:?}->{:?}", G::DTYPE, O::DTYPE);
    let grad = data::<G>(n * h, 12);
    let idx: Vec<i64> = (0..n as i64).map(|i| (i * 7919) % v as i64).collect();
    let opts = EmbeddingGradOptions::default();
    each_hint(&format!("embedding_dense_grad {dt}"), true, &mut |e| {
        let (gt, it) = (
            TensorRef::new(&grad, &[n, h]).unwrap(),
            TensorRef::new(&idx, &[n]).unwrap(),
        );
        let mut ws = vec![0u8; embedding_dense_grad_workspace_size(e, gt, it, v, &opts).unwrap()];
        let mut out = vec![O::from_f32(1.0); v * h];
        embedding_dense_grad(e, gt, it, v, &opts, &mut out, &mut ws).unwrap();
        bits(&out)
    });
}

#[test]
fn norms_same_bits_under_every_hint() {
    norms::<f32>();
    norms::<bf16>();
    norms::<f16>();
}

#[test]
fn elementwise_same_bits_under_every_hint() {
    elementwise::<f32>();
    elementwise::<bf16>();
    elementwise::<f16>();
}

#[test]
fn embedding_same_bits_under_every_hint() {
    embedding::<f32, f32>();
    embedding::<bf16, bf16>();
    embedding::<bf16, f32>();
    embedding::<f16, f16>();
}

#[test]
fn small_outputs_never_stream() {
    let x = data::<f32>(64 * 64, 1);
    let g = data::<f32>(64, 2);
    let rec = Recording {
        cpu: Cpu::new(Threads::new(2)),
        flags: AtomicU32::new(0),
    };
    for hint in HINTS {
        let e = Exec::new(&rec).with_outputs(hint);
        let (xt, gt) = (
            TensorRef::new(&x, &[64, 64]).unwrap(),
            TensorRef::new(&g, &[64]).unwrap(),
        );
        let mut y = vec![0f32; 64 * 64];
        rms_norm(
            &e,
            xt,
            gt,
            &RmsNormOptions::default(),
            &mut y,
            None,
            &mut vec![0u8; 1 << 20],
        )
        .unwrap();
        assert_eq!(
            rec.flags.load(Ordering::Relaxed) & NORM_FLAG_STREAM,
            0,
            "{hint:?}"
        );
    }
}
