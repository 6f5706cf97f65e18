//! Attention, forward and backward, against the f64 reference (random data,
//! every dtype, both layouts, causal or not, grouped-query heads, head dims
//! and lengths that are not a multiple of any width, more rows than a
//! block), the same bits on every ISA / thread count / block count, NaN
//! kept to the rows that see it, and bad input refused with nothing
//! written.

mod common;

use common::{ulp_at, Rng};
use npukern::*;

/// One problem: q `[B, Hq, Sq, D]` (or BSND), k and v `[B, Hkv, Skv, D]`.
struct Case<T> {
    dims: [usize; 6],
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    dout: Vec<T>,
    o: AttentionOptions,
}

/// Everything one run writes.
#[derive(Clone, PartialEq)]
struct Outs<T> {
    out: Vec<T>,
    mx: Vec<f32>,
    sm: Vec<f32>,
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
}

impl<T: Float> Case<T> {
    fn random(rng: &mut Rng, dims: [usize; 6], causal: bool, layout: AttentionLayout) -> Self {
        let [b, hq, hkv, sq, skv, d] = dims;
        let mut v = |n: usize, a: f64| -> Vec<T> {
            (0..n).map(|_| T::from_f64(rng.uniform(-a, a))).collect()
        };
        Case {
            dims,
            q: v(b * hq * sq * d, 2.0),
            k: v(b * hkv * skv * d, 2.0),
            v: v(b * hkv * skv * d, 1.0),
            dout: v(b * hq * sq * d, 1.0),
            o: AttentionOptions {
                causal,
                scale: 1.0 / (d as f32).sqrt(),
                layout,
            },
        }
    }

    fn qdims(&self) -> [usize; 4] {
        let [b, hq, _, sq, _, d] = self.dims;
        match self.o.layout {
            AttentionLayout::Bnsd => [b, hq, sq, d],
            AttentionLayout::Bsnd => [b, sq, hq, d],
        }
    }

    fn kdims(&self) -> [usize; 4] {
        let [b, _, hkv, _, skv, d] = self.dims;
        match self.o.layout {
            AttentionLayout::Bnsd => [b, hkv, skv, d],
            AttentionLayout::Bsnd => [b, skv, hkv, d],
        }
    }

    /// The forward, then the backward on its outputs.
    fn run(&self, exec: &Exec<'_>) -> Result<Outs<T>> {
        let [b, hq, _, sq, _, _] = self.dims;
        let q = TensorRef::new(&self.q, &self.qdims())?;
        let k = TensorRef::new(&self.k, &self.kdims())?;
        let v = TensorRef::new(&self.v, &self.kdims())?;
        let n = attention_workspace_size(exec, q, k, v, &self.o, false)?;
        let mut ws = vec![0u8; n];
        let zero = T::from_f32(0.0);
        let mut r = Outs {
            out: vec![zero; self.q.len()],
            mx: vec![0.0; b * hq * sq],
            sm: vec![0.0; b * hq * sq],
            dq: vec![zero; self.q.len()],
            dk: vec![zero; self.k.len()],
            dv: vec![zero; self.k.len()],
        };
        attention(
            exec, q, k, v, &self.o, &mut r.out, &mut r.mx, &mut r.sm, &mut ws,
        )?;
        let n = attention_workspace_size(exec, q, k, v, &self.o, true)?;
        let mut ws = vec![0u8; n];
        let sd = [b, hq, sq];
        let saved = AttentionSaved {
            out: TensorRef::new(&r.out, &self.qdims())?,
            dout: TensorRef::new(&self.dout, &self.qdims())?,
            softmax_max: TensorRef::new(&r.mx, &sd)?,
            softmax_sum: TensorRef::new(&r.sm, &sd)?,
        };
        let (mut dq, mut dk, mut dv) = (r.dq.clone(), r.dk.clone(), r.dv.clone());
        attention_backward(
            exec, q, k, v, &saved, &self.o, &mut dq, &mut dk, &mut dv, &mut ws,
        )?;
        r.dq = dq;
        r.dk = dk;
        r.dv = dv;
        Ok(r)
    }
}

/// Worst `|got - want| / (ulp(want) + tol * max|want|)` over a tensor.
fn score<T: Float>(got: &[T], want: &[T], tol: f64, what: &str) -> f64 {
    let mag = want.iter().map(|w| w.to_f64().abs()).fold(0.0, f64::max);
    let mut worst = 0f64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f64(), w.to_f64());
        let s = (g - w).abs() / (ulp_at::<T>(w) + tol * mag);
        assert!(
            s <= 1.0,
            "{what}[{i}] = {g}, reference {w} (max |ref| {mag})"
        );
        worst = worst.max(s);
    }
    worst
}

/// Every ISA, several thread and block counts: the same bits; within the
/// bound of the f64 reference (normwise `tol` plus one rounding to T).
fn check<T: Float>(rng: &mut Rng, dims: [usize; 6], causal: bool, layout: AttentionLayout) {
    let case = Case::<T>::random(rng, dims, causal, layout);
    let mut first: Option<Outs<T>> = None;
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        for (threads, blocks) in [(1usize, 64u32), (3, 5), (2, 1)] {
            let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
            let ub = UbConfig {
                blocks,
                ..UbConfig::default()
            };
            let got = case.run(&Exec::new(&cpu).with_ub(ub)).unwrap();
            match &first {
                None => first = Some(got),
                Some(f) => {
                    let what = format!("{isa} x{threads}/{blocks}");
                    common::assert_same_bits(&got.out, &f.out, &what);
                    common::assert_same_bits(&got.mx, &f.mx, &what);
                    common::assert_same_bits(&got.sm, &f.sm, &what);
                    common::assert_same_bits(&got.dq, &f.dq, &what);
                    common::assert_same_bits(&got.dk, &f.dk, &what);
                    common::assert_same_bits(&got.dv, &f.dv, &what);
                }
            }
        }
    }
    let got = first.unwrap();
    // The reference's backward reads the kernel's out (its D), as the
    // kernel does: run it on the same forward.
    let want_fwd = case.run(&Exec::reference()).unwrap();
    let want = {
        let [b, hq, _, sq, _, _] = case.dims;
        let exec = Exec::reference();
        let q = TensorRef::new(&case.q, &case.qdims()).unwrap();
        let k = TensorRef::new(&case.k, &case.kdims()).unwrap();
        let v = TensorRef::new(&case.v, &case.kdims()).unwrap();
        let sd = [b, hq, sq];
        let saved = AttentionSaved {
            out: TensorRef::new(&got.out, &case.qdims()).unwrap(),
            dout: TensorRef::new(&case.dout, &case.qdims()).unwrap(),
            softmax_max: TensorRef::new(&got.mx, &sd).unwrap(),
            softmax_sum: TensorRef::new(&got.sm, &sd).unwrap(),
        };
        let (mut dq, mut dk, mut dv) = (got.dq.clone(), got.dk.clone(), got.dv.clone());
        let n = attention_workspace_size(&exec, q, k, v, &case.o, true).unwrap();
        let mut ws = vec![0u8; n];
        attention_backward(
            &exec, q, k, v, &saved, &case.o, &mut dq, &mut dk, &mut dv, &mut ws,
        )
        .unwrap();
        (dq, dk, dv)
    };
    let [_, hq, hkv, sq, skv, d] = dims;
    // f32 chains of D (scores), Skv (out, dq) and G Sq (dk, dv: the
    // group's rows) terms, an exponential of a few ulp: normwise within
    // (D + Skv + G Sq) 2^-20.
    let tol = (d + skv + hq / hkv * sq) as f64 / (1u64 << 20) as f64;
    let what = format!("{dims:?} {:?} causal {causal} {layout:?}", T::DTYPE);
    let s = [
        score(&got.out, &want_fwd.out, tol, &format!("{what} out")),
        score(&got.mx, &want_fwd.mx, tol, &format!("{what} max")),
        score(&got.sm, &want_fwd.sm, tol, &format!("{what} sum")),
        score(&got.dq, &want.0, tol, &format!("{what} dq")),
        score(&got.dk, &want.1, tol, &format!("{what} dk")),
        score(&got.dv, &want.2, tol, &format!("{what} dv")),
    ];
    eprintln!("{what}: worst out/max/sum/dq/dk/dv {s:.3?} of the bound");
}

#[test]
fn every_dtype_and_layout_matches_the_reference_with_the_same_bits() {
    let mut rng = Rng(91);
    for layout in [AttentionLayout::Bnsd, AttentionLayout::Bsnd] {
        for causal in [false, true] {
            check::<f32>(&mut rng, [2, 4, 2, 37, 37, 20], causal, layout);
            check::<bf16>(&mut rng, [1, 3, 1, 29, 29, 64], causal, layout);
            check::<f16>(&mut rng, [1, 2, 2, 17, 23, 8], causal, layout);
        }
    }
}

#[test]
fn edge_shapes() {
    let mut rng = Rng(92);
    for dims in [
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 40, 3],
        [1, 1, 1, 40, 1, 17],
        [1, 2, 1, 5, 9, 33],
        [1, 1, 1, 100, 60, 16],
        [1, 1, 1, 60, 100, 16],
    ] {
        check::<f32>(&mut rng, dims, true, AttentionLayout::Bnsd);
        check::<bf16>(&mut rng, dims, false, AttentionLayout::Bsnd);
    }
}

#[test]
fn more_rows_than_a_block_and_keys_past_a_panel() {
    let mut rng = Rng(93);
    check::<bf16>(
        &mut rng,
        [1, 2, 1, 200, 200, 64],
        true,
        AttentionLayout::Bnsd,
    );
    check::<f32>(
        &mut rng,
        [1, 2, 2, 171, 171, 24],
        false,
        AttentionLayout::Bsnd,
    );
}

/// A NaN in a later token's key or value never reaches an earlier causal
/// row: its output, its dq, and the dk / dv of the keys it sees stay
/// finite and equal to a run without the NaN.
#[test]
fn a_causal_row_never_reads_a_later_key() {
    let mut rng = Rng(94);
    let dims = [1, 2, 1, 100, 100, 16];
    let mut case = Case::<f32>::random(&mut rng, dims, true, AttentionLayout::Bnsd);
    let cpu = Cpu::new(Threads::new(2));
    let exec = Exec::new(&cpu);
    let clean = case.run(&exec).unwrap();
    // Key and value 90 poisoned (one key/value head, rows of 16).
    for x in 0..16 {
        case.k[90 * 16 + x] = f32::NAN;
        case.v[90 * 16 + x] = f32::INFINITY;
    }
    let got = case.run(&exec).unwrap();
    for h in 0..2 {
        for i in 0..100 {
            let row = (h * 100 + i) * 16..(h * 100 + i + 1) * 16;
            let clean_rows = (&clean.out[row.clone()], &clean.dq[row.clone()]);
            if i < 90 {
                assert_eq!(
                    (&got.out[row.clone()], &got.dq[row.clone()]),
                    clean_rows,
                    "row {i}"
                );
            } else {
                assert!(
                    got.out[row].iter().all(|x| x.is_nan()),
                    "row {i} sees the NaN key"
                );
            }
        }
    }
    // A NaN query row 95 adds into the dk / dv of the keys it sees
    // (0..=95) and of no other: keys 96.. keep the clean run's sums.
    let mut case = Case::<f32>::random(&mut Rng(94), dims, true, AttentionLayout::Bnsd);
    for x in 0..16 {
        case.q[95 * 16 + x] = f32::NAN;
    }
    let got = case.run(&exec).unwrap();
    assert!(got.dk[95 * 16..96 * 16].iter().all(|x| x.is_nan()));
    assert_eq!(&got.dk[96 * 16..], &clean.dk[96 * 16..]);
    assert_eq!(&got.dv[96 * 16..], &clean.dv[96 * 16..]);
}

/// Bad input is refused with a clear error and nothing is written.
#[test]
fn bad_input_is_refused_and_nothing_is_written() {
    let exec = Exec::cpu();
    let o = AttentionOptions {
        causal: true,
        scale: 0.25,
        layout: AttentionLayout::Bnsd,
    };
    let q = vec![1.0f32; 2 * 4 * 5 * 8];
    let k = vec![1.0f32; 2 * 4 * 5 * 8];
    let poison = -7.25f32;
    let run = |qd: &[usize], kd: &[usize], vd: &[usize], o: &AttentionOptions, stats: usize| {
        let qt = TensorRef::new(&q[..qd.iter().product()], qd)?;
        let kt = TensorRef::new(&k[..kd.iter().product()], kd)?;
        let vt = TensorRef::new(&k[..vd.iter().product()], vd)?;
        let mut out = vec![poison; qd.iter().product()];
        let (mut mx, mut sm) = (vec![poison; stats], vec![poison; stats]);
        let n = attention_workspace_size(&exec, qt, kt, vt, o, false).unwrap_or(0);
        let mut ws = vec![0u8; n];
        let r = attention(&exec, qt, kt, vt, o, &mut out, &mut mx, &mut sm, &mut ws);
        if r.is_err() {
            assert!(
                out.iter().chain(&mx).chain(&sm).all(|x| *x == poison),
                "written on error"
            );
        }
        r
    };
    let msg = |r: Result<()>| format!("{}", r.unwrap_err());
    assert!(run(&[2, 4, 5, 8], &[2, 2, 5, 8], &[2, 2, 5, 8], &o, 40).is_ok());
    // Heads that do not divide.
    let e = msg(run(&[2, 4, 5, 8], &[2, 3, 5, 8], &[2, 3, 5, 8], &o, 40));
    assert!(e.contains("do not divide"), "{e}");
    // v's shape is not k's.
    let e = msg(run(&[2, 4, 5, 8], &[2, 2, 5, 8], &[2, 2, 4, 8], &o, 40));
    assert!(e.contains("not k's"), "{e}");
    // head_dim differs.
    let e = msg(run(&[2, 4, 5, 8], &[2, 2, 5, 4], &[2, 2, 5, 4], &o, 40));
    assert!(e.contains("head_dim"), "{e}");
    // Rank 3.
    let e = msg(run(&[8, 5, 8], &[2, 2, 5, 8], &[2, 2, 5, 8], &o, 40));
    assert!(e.contains("rank 3"), "{e}");
    // No keys.
    let e = msg(run(&[2, 4, 5, 8], &[2, 2, 0, 8], &[2, 2, 0, 8], &o, 40));
    assert!(e.contains("no keys"), "{e}");
    // A non-finite scale.
    let nan = AttentionOptions {
        scale: f32::NAN,
        ..o
    };
    let e = msg(run(&[2, 4, 5, 8], &[2, 2, 5, 8], &[2, 2, 5, 8], &nan, 40));
    assert!(e.contains("scale"), "{e}");
    // Stats of the wrong length.
    assert!(run(&[2, 4, 5, 8], &[2, 2, 5, 8], &[2, 2, 5, 8], &o, 39).is_err());
    // The workspace too small.
    let qt = TensorRef::new(&q, &[2, 4, 5, 8]).unwrap();
    let kt = TensorRef::new(&k[..160], &[2, 2, 5, 8]).unwrap();
    let mut out = vec![poison; q.len()];
    let (mut mx, mut sm) = (vec![poison; 40], vec![poison; 40]);
    let mut ws = vec![0u8; 64];
    let r = attention(&exec, qt, kt, kt, &o, &mut out, &mut mx, &mut sm, &mut ws);
    assert!(matches!(r, Err(Error::WorkspaceTooSmall { .. })), "{r:?}");
    assert!(out.iter().all(|x| *x == poison));
}

/// A backward with no query rows writes zero dk and dv.
#[test]
fn no_query_rows_give_zero_key_gradients() {
    let exec = Exec::cpu();
    let o = AttentionOptions::default();
    let (q, k) = (Vec::<bf16>::new(), vec![bf16::from_f32(1.0); 2 * 3 * 4]);
    let qt = TensorRef::new(&q, &[1, 2, 0, 4]).unwrap();
    let kt = TensorRef::new(&k, &[1, 2, 3, 4]).unwrap();
    let e: Vec<f32> = Vec::new();
    let saved = AttentionSaved {
        out: qt,
        dout: qt,
        softmax_max: TensorRef::new(&e, &[1, 2, 0]).unwrap(),
        softmax_sum: TensorRef::new(&e, &[1, 2, 0]).unwrap(),
    };
    let mut ws = vec![0u8; attention_workspace_size(&exec, qt, kt, kt, &o, true).unwrap()];
    let (mut dk, mut dv) = (
        vec![bf16::from_f32(3.0); k.len()],
        vec![bf16::from_f32(3.0); k.len()],
    );
    attention_backward(
        &exec,
        qt,
        kt,
        kt,
        &saved,
        &o,
        &mut [],
        &mut dk,
        &mut dv,
        &mut ws,
    )
    .unwrap();
    assert!(dk.iter().chain(&dv).all(|x| x.to_f32() == 0.0));
}
