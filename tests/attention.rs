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
