//! Matmul, differentially: arbitrary shapes (wrong ones too: K mismatch,
//! rank, c's length), both transposes, accumulate, f32 / f16 / bf16 with an
//! f32 or same-dtype c (and refused pairs), any value (NaN, Inf,
//! subnormals), any block count.
//!
//! Checked:
//! - every CPU run (each available ISA; one and two threads; another block
//!   count) fails exactly when the Reference fails, with the same error,
//!   and then leaves c untouched;
//! - c is bit-identical across ISAs, runners and block counts (NaN payloads
//!   aside);
//! - on values of ordinary magnitude, within one ulp of c's dtype plus
//!   (K + 1) 2^-24 sum |a b| of the Reference (an f32 chain of K FMAs;
//!   2^-23 for Arm's pair dot, whose sums round to odd), plus the pair
//!   dots' flushes.
//!
//! The work per input is bounded: M N K <= 2^18 multiply-adds, so the
//! scalar f64 Reference and the portable ISA's software FMA stay in
//! milliseconds in the coverage build.
//!
//! Run: `cargo +nightly fuzz run matmul`, or `scripts/fuzz_smoke.sh matmul`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npukern::*;
use npukern_fuzz::{assert_same, isas, some_values, ulp_at, Bytes};

const POISON: f32 = -7.25;
/// Most multiply-adds of one case.
const MACS: usize = 1 << 18;

struct Case<T, O> {
    a: Vec<T>,
    ad: Vec<usize>,
    b: Vec<T>,
    bd: Vec<usize>,
    c0: Vec<O>,
    o: MatmulOptions,
}

impl<T: Float, O: Float> Case<T, O> {
    fn run(&self, exec: &Exec<'_>) -> (Result<()>, Vec<O>) {
        let mut c = self.c0.clone();
        let r = (|| {
            let a = TensorRef::new(&self.a, &self.ad)?;
            let b = TensorRef::new(&self.b, &self.bd)?;
            let n = matmul_workspace_size(exec, a, b, O::DTYPE, &self.o)?;
            let mut ws = vec![0u8; n];
            matmul(exec, a, b, &self.o, &mut c, &mut ws)
        })();
        (r, c)
    }
}

fn dim(b: &mut Bytes<'_>, cap: usize) -> usize {
    const D: [usize; 12] = [0, 1, 2, 3, 5, 13, 14, 15, 16, 17, 31, 33];
    if b.one_in(4) {
        b.below(cap.max(1) + 1)
    } else {
        D[b.below(D.len())].min(cap)
    }
}

fn check<T: Float, O: Float>(b: &mut Bytes<'_>) {
    let tame = b.bool();
    let o = MatmulOptions {
        trans_a: b.bool(),
        trans_b: b.bool(),
        accumulate: b.one_in(3),
        // The bf16 pair dots (refused for f32 and f16 operands); Arm's
        // runs a scalar model on x86, so less often.
        math: if b.one_in(3) {
            if b.one_in(4) {
                MatmulMath::Bf16DotArm
            } else {
                MatmulMath::Bf16Dot
            }
        } else {
            MatmulMath::Chain
        },
    };
    let m = dim(b, 200);
    let n = dim(b, 600);
    let k = dim(b, MACS / (m * n).max(1));
    let mut kb = k;
    if b.one_in(16) {
        kb = dim(b, 40); // a K mismatch (mostly)
    }
    let mut ad = if o.trans_a { vec![k, m] } else { vec![m, k] };
    let bd = if o.trans_b { vec![n, kb] } else { vec![kb, n] };
    let mut alen = m * k;
    if b.one_in(24) {
        ad = vec![m * k]; // rank 1
    }
    if b.one_in(24) {
        alen += 1; // a's data is not its shape's
    }
    let mut clen = m * n;
    if b.one_in(24) {
        clen += 1;
    }
    let case = Case::<T, O> {
        a: some_values(b, alen, tame),
        ad,
        b: some_values(b, kb * n, tame),
        bd,
        c0: if o.accumulate {
            some_values(b, clen, tame)
        } else {
            vec![O::from_f32(POISON); clen]
        },
        o,
    };
    let (want_r, want) = case.run(&Exec::reference());
    let mut first: Option<Vec<O>> = None;
    for isa in isas() {
        for threads in [1usize, 2] {
            let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
            let ub = UbConfig {
                blocks: 1 + b.below(7) as u32,
                ..UbConfig::default()
            };
            let (r, got) = case.run(&Exec::new(&cpu).with_ub(ub));
            assert_eq!(
                r, want_r,
                "{isa} x{threads}: outcome differs from the Reference"
            );
            if r.is_err() {
                assert_same(&got, &case.c0, "c written on error");
                continue;
            }
            match &first {
                None => first = Some(got.clone()),
                Some(f) => assert_same(&got, f, "across ISAs, runners and block counts"),
            }
        }
    }
    let (Some(got), true, Ok(())) = (first, tame, want_r) else {
        return;
    };
    let at = |x: &[T], i: usize| x[i].to_f64().abs();
    for i in 0..m {
        for j in 0..n {
            let mut s = if o.accumulate {
                case.c0[i * n + j].to_f64().abs()
            } else {
                0.0
            };
            for p in 0..k {
                let ai = if o.trans_a { p * m + i } else { i * k + p };
                let bi = if o.trans_b { j * k + p } else { p * n + j };
                s += at(&case.a, ai) * at(&case.b, bi);
            }
            let (g, w) = (got[i * n + j].to_f64(), want[i * n + j].to_f64());
            if g == w || g.is_nan() && w.is_nan() {
                continue;
            }
            // The pair dots flush subnormal inputs and sums: up to 2^-126
            // a step; Arm's rounds each sum to odd: up to an ulp (nearest:
            // half).
            let flushed = if o.math == MatmulMath::Chain {
                0.0
            } else {
                (k as f64 + 1.0) * 2f64.powi(-125)
            };
            let bits = if o.math == MatmulMath::Bf16DotArm { 23 } else { 24 };
            let tol = ulp_at::<O>(w) + (k as f64 + 1.0) * s / (1u64 << bits) as f64 + flushed;
            assert!(
                (g - w).abs() <= tol,
                "c[{i},{j}] = {g}, reference {w} (tol {tol})"
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes(data);
    match b.u8() % 6 {
        0 => check::<f32, f32>(&mut b),
        1 => check::<bf16, bf16>(&mut b),
        2 => check::<bf16, f32>(&mut b),
        3 => check::<f16, f16>(&mut b),
        4 => check::<f16, f32>(&mut b),
        _ => check::<bf16, f16>(&mut b), // refused: c is neither a's dtype nor f32
    }
});
