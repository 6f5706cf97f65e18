//! Attention, differentially: arbitrary shapes (wrong ones too: heads that
//! do not divide, mismatched batch or head dim, rank, an output's length),
//! both layouts, causal or not, f32 / f16 / bf16, any value (NaN, Inf,
//! subnormals), any scale (non-finite refused), any block count; the
//! forward, then the backward on its outputs and a random dout.
//!
//! Checked:
//! - every CPU run (each available ISA; one and two threads; another block
//!   count) fails exactly when the Reference fails, with the same error,
//!   and then leaves every output untouched;
//! - the outputs are bit-identical across ISAs, runners and block counts
//!   (NaN payloads aside);
//! - on values of ordinary magnitude, within one ulp of the dtype plus a
//!   normwise `(D + Skv + G Sq + D smax) 2^-20` of the Reference (G: query
//!   heads per key/value head ; smax: the
//!   largest score's bound `|scale| D max|q| max|k|`; the CPU's backward
//!   reads the Reference's out and stats, as the Reference's does).
//!
//! The work per input is bounded: `B Hq Sq Skv D <= 2^13` (each factor
//! counted as at least 1), the Reference's backward included (`WORK`).
//!
//! Run: `cargo +nightly fuzz run attention`, or `scripts/fuzz_smoke.sh attention`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npukern::*;
use npukern_fuzz::{assert_same, isas, some_values, ulp_at, Bytes};

const POISON: f32 = -7.25;
/// Most `B Hq Sq Skv D` of one case. It bounds the Reference's backward
/// too: `B Hq Sq Skv D` steps while a KV head's group has at most 512 rows
/// (their stats kept), and past that `Skv < 16`. (When every key
/// recomputed its rows' stats, `B Hq Sq Skv^2 D`, one row of 3838 keys
/// took 5 s, past the 10-s timeout on a busy machine:
/// seeds/attention/timeout-backward-3838-keys.)
const WORK: usize = 1 << 13;

struct Case<T> {
    q: Vec<T>,
    qd: Vec<usize>,
    k: Vec<T>,
    kd: Vec<usize>,
    v: Vec<T>,
    dout: Vec<T>,
    /// `[B, Hq, Sq]`.
    sd: Vec<usize>,
    /// The stats' lengths (off by one: refused).
    stats: usize,
    o: AttentionOptions,
}

/// Everything a forward and a backward write.
struct Outs<T> {
    out: Vec<T>,
    mx: Vec<f32>,
    sm: Vec<f32>,
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
}

impl<T: Float> Case<T> {
    fn fresh(&self) -> Outs<T> {
        let p = T::from_f32(POISON);
        Outs {
            out: vec![p; self.q.len()],
            mx: vec![POISON; self.stats],
            sm: vec![POISON; self.stats],
            dq: vec![p; self.q.len()],
            dk: vec![p; self.k.len()],
            dv: vec![p; self.k.len()],
        }
    }

    /// The forward's outcome, the backward's (on the forward's outputs, or
    /// `saved`'s when given: the CPU's backward reads the same tensors as
    /// the Reference's), and the outputs.
    fn run(&self, exec: &Exec<'_>, saved: Option<&Outs<T>>) -> (Result<()>, Result<()>, Outs<T>) {
        let mut r = self.fresh();
        let q = TensorRef::new(&self.q, &self.qd);
        let k = TensorRef::new(&self.k, &self.kd);
        let v = TensorRef::new(&self.v, &self.kd);
        let (Ok(q), Ok(k), Ok(v)) = (q, k, v) else {
            unreachable!("descriptors are built from their data's lengths")
        };
        let fwd = (|| {
            let n = attention_workspace_size(exec, q, k, v, &self.o, false)?;
            let mut ws = vec![0u8; n];
            attention(exec, q, k, v, &self.o, &mut r.out, &mut r.mx, &mut r.sm, &mut ws)
        })();
        let src = saved.unwrap_or(&r);
        let (out, mx, sm) = (src.out.clone(), src.mx.clone(), src.sm.clone());
        let bwd = (|| {
            let sd = &self.sd;
            let saved = AttentionSaved {
                out: TensorRef::new(&out, &self.qd)?,
                dout: TensorRef::new(&self.dout, &self.qd)?,
                softmax_max: TensorRef::new(&mx, sd)?,
                softmax_sum: TensorRef::new(&sm, sd)?,
            };
            let n = attention_workspace_size(exec, q, k, v, &self.o, true)?;
            let mut ws = vec![0u8; n];
            attention_backward(exec, q, k, v, &saved, &self.o, &mut r.dq, &mut r.dk, &mut r.dv, &mut ws)
        })();
        (fwd, bwd, r)
    }
}

fn dim(b: &mut Bytes<'_>, cap: usize) -> usize {
    const D: [usize; 10] = [0, 1, 2, 3, 5, 13, 14, 16, 17, 33];
    if b.one_in(4) {
        b.below(cap.max(1) + 1)
    } else {
        D[b.below(D.len())].min(cap)
    }
}

/// Worst `|got - want| / (ulp(want) + tol * max|want|)` must be <= 1.
fn close<T: Float>(got: &[T], want: &[T], tol: f64, what: &str) {
    let mag = want.iter().map(|w| w.to_f64().abs()).fold(0.0, f64::max);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f64(), w.to_f64());
        if g == w || !mag.is_finite() {
            continue;
        }
        assert!(
            (g - w).abs() <= ulp_at::<T>(w) + tol * mag,
            "{what}[{i}] = {g}, reference {w} (max |ref| {mag})"
        );
    }
}

fn check<T: Float>(b: &mut Bytes<'_>) {
    let tame = b.bool();
    let layout = if b.bool() {
        AttentionLayout::Bsnd
    } else {
        AttentionLayout::Bnsd
    };
    let bs = 1 + b.below(2);
    let hkv = dim(b, 3);
    let hq = if b.one_in(8) { dim(b, 4) } else { hkv * (1 + b.below(3)) };
    let d = dim(b, 40);
    // Each factor counted as at least 1: an empty one still leaves loops.
    let per_query = bs * hq.max(1) * d.max(1);
    let sq = dim(b, WORK / per_query);
    let per_key = per_query * sq.max(1);
    let skv = if b.bool() { sq } else { dim(b, WORK / per_key) };
    let skv = skv.min(WORK / per_key);
    let scale = match b.below(16) {
        0 => f32::NAN,
        1 => 0.0,
        2 => -0.5,
        _ => 1.0 / (d.max(1) as f32).sqrt(),
    };
    let o = AttentionOptions {
        causal: b.bool(),
        scale,
        layout,
    };
    let shape = |h: usize, s: usize| match layout {
        AttentionLayout::Bnsd => vec![bs, h, s, d],
        AttentionLayout::Bsnd => vec![bs, s, h, d],
    };
    let mut qd = shape(hq, sq);
    let mut kd = shape(hkv, skv);
    if b.one_in(24) {
        kd[3] += 1; // head_dim mismatch
    }
    if b.one_in(24) {
        qd = vec![bs * hq, sq, d]; // rank 3
    }
    let (qn, kn) = (qd.iter().product::<usize>(), kd.iter().product::<usize>());
    let case = Case::<T> {
        q: some_values(b, qn, tame),
        qd,
        k: some_values(b, kn, tame),
        kd,
        v: some_values(b, kn, tame),
        dout: some_values(b, qn, tame),
        sd: vec![bs, hq, sq],
        stats: bs * hq * sq + usize::from(b.one_in(24)), // an output's length off by one
        o,
    };
    let (wf, wb, want) = case.run(&Exec::reference(), None);
    let mut first: Option<Outs<T>> = None;
    for isa in isas() {
        for threads in [1usize, 2] {
            let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
            let ub = UbConfig {
                blocks: 1 + b.below(7) as u32,
                ..UbConfig::default()
            };
            let exec = Exec::new(&cpu).with_ub(ub);
            // The backward reads the Reference's forward (as the Reference's
            // backward does): its outcome then depends on the call alone.
            let (f, bw, got) = case.run(&exec, Some(&want));
            assert_eq!(f, wf, "{isa} x{threads}: forward outcome differs from the Reference");
            assert_eq!(bw, wb, "{isa} x{threads}: backward outcome differs from the Reference");
            let fresh = case.fresh();
            if f.is_err() {
                assert_same(&got.out, &fresh.out, "out written on error");
                assert_same(&got.mx, &fresh.mx, "softmax_max written on error");
                assert_same(&got.sm, &fresh.sm, "softmax_sum written on error");
            }
            if bw.is_err() {
                assert_same(&got.dq, &fresh.dq, "dq written on error");
                assert_same(&got.dk, &fresh.dk, "dk written on error");
                assert_same(&got.dv, &fresh.dv, "dv written on error");
            }
            match &first {
                None => first = Some(got),
                Some(fst) => {
                    let w = "across ISAs, runners and block counts";
                    assert_same(&got.out, &fst.out, w);
                    assert_same(&got.mx, &fst.mx, w);
                    assert_same(&got.sm, &fst.sm, w);
                    assert_same(&got.dq, &fst.dq, w);
                    assert_same(&got.dk, &fst.dk, w);
                    assert_same(&got.dv, &fst.dv, w);
                }
            }
        }
    }
    let Some(got) = first else { return };
    if !tame || wf.is_err() || wb.is_err() {
        return;
    }
    // A score's chain errs by up to D u sum|q k| scale, and e^s turns that
    // absolute error into a relative one: the bound grows with the scores.
    let amax = |x: &[T]| x.iter().map(|v| v.to_f64().abs()).fold(0.0, f64::max);
    let smax = (scale as f64).abs() * d as f64 * amax(&case.q) * amax(&case.k);
    // dk and dv sum over the group's rows: G Sq terms.
    let terms = d + skv + hq / hkv.max(1) * sq;
    let tol = (terms as f64 + d as f64 * smax) / (1u64 << 20) as f64;
    close(&got.out, &want.out, tol, "out");
    close(&got.dq, &want.dq, tol, "dq");
    close(&got.dk, &want.dk, tol, "dk");
    close(&got.dv, &want.dv, tol, "dv");
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes(data);
    match b.u8() % 3 {
        0 => check::<f32>(&mut b),
        1 => check::<bf16>(&mut b),
        _ => check::<f16>(&mut b),
    }
});
