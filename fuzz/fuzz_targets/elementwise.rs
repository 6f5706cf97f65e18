//! SwiGLU (split and two-tensor forms), SwiGluGrad and RoPE (forward and
//! backward, any broadcast of cos/sin, with and without k), differentially:
//! arbitrary shapes (wrong ones too), dims, values (NaN, Inf, subnormals),
//! both numerics modes, f32/f16/bf16 (RoPE: cos in x's dtype or f32), any
//! tiling.
//!
//! Checked:
//! - every CPU run (each available ISA; two threads; another tiling) fails
//!   exactly when the Reference fails, with the same error, and then leaves
//!   the outputs untouched;
//! - the outputs are bit-identical across ISAs, runners and tilings (NaN
//!   payloads aside);
//! - on values of ordinary magnitude, within 2 ulp of the Reference plus
//!   1e-5 of the terms' magnitude (cancellation), plus, for eager RoPE with
//!   f32 cos, an ulp at the products (each rounded twice, to f32 then to
//!   the dtype), as tests/elementwise.rs.
//!
//! Run: `cargo +nightly fuzz run elementwise`, or the stable recipe in
//! `scripts/fuzz_smoke.sh`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npukern::*;
use npukern_fuzz::{assert_same, dims, isas, some_values, ulp_at, Bytes};

/// Most elements of any tensor.
const CAP: usize = 4096;

const POISON: f32 = -7.25;

fn ub_of(b: &mut Bytes<'_>) -> UbConfig {
    UbConfig {
        ub_bytes: 1024 + b.below(8) * 4096,
        blocks: 1 + b.below(9) as u32,
    }
}

fn rounding(b: &mut Bytes<'_>) -> ElemRounding {
    if b.bool() {
        ElemRounding::Eager
    } else {
        ElemRounding::Fused
    }
}

/// One operator call: its inputs and a closure-free runner.
enum Case<T, C> {
    Split {
        x: Vec<T>,
        xd: Vec<usize>,
        dy: Vec<T>,
        o: SwigluOptions,
        grad: bool,
        out: usize,
    },
    Two {
        g: Vec<T>,
        u: Vec<T>,
        d: Vec<usize>,
        ud: Vec<usize>,
        dy: Vec<T>,
        o: SwigluOptions,
        grad: bool,
    },
    Rope {
        q: Vec<T>,
        qd: Vec<usize>,
        k: Option<(Vec<T>, Vec<usize>)>,
        c: Vec<C>,
        s: Vec<C>,
        cd: Vec<usize>,
        o: RopeOptions,
    },
}

impl<T: Float, C: Float> Case<T, C> {
    /// Runs on `exec`; returns the outcome and every output.
    fn run(&self, exec: &Exec<'_>) -> (Result<()>, Vec<Vec<T>>) {
        let p = T::from_f32(POISON);
        let mut ws = Vec::new();
        match self {
            Case::Split {
                x,
                xd,
                dy,
                o,
                grad,
                out,
            } => {
                let mut y = vec![p; if *grad { x.len() } else { *out }];
                let r = (|| {
                    let xt = TensorRef::new(x, xd)?;
                    if *grad {
                        let mut hd = xd.clone();
                        let nd = hd.len() as i64;
                        let d = if o.dim < 0 { o.dim + nd } else { o.dim };
                        if (0..nd).contains(&d) {
                            hd[d as usize] /= 2;
                        }
                        let dyt = TensorRef::new(dy, &hd)?;
                        swiglu_grad(exec, dyt, xt, o, &mut y, &mut ws)
                    } else {
                        swiglu(exec, xt, o, &mut y, &mut ws)
                    }
                })();
                (r, vec![y])
            }
            Case::Two {
                g,
                u,
                d,
                ud,
                dy,
                o,
                grad,
            } => {
                let (mut a, mut bb) = (vec![p; g.len()], vec![p; g.len()]);
                let r = (|| {
                    let (gt, ut) = (TensorRef::new(g, d)?, TensorRef::new(u, ud)?);
                    if *grad {
                        let dyt = TensorRef::new(dy, d)?;
                        silu_mul_grad(exec, dyt, gt, ut, o, &mut a, &mut bb, &mut ws)
                    } else {
                        silu_mul(exec, gt, ut, o, &mut a, &mut ws)
                    }
                })();
                (r, vec![a, bb])
            }
            Case::Rope {
                q,
                qd,
                k,
                c,
                s,
                cd,
                o,
            } => {
                let mut qo = vec![p; q.len()];
                let mut ko = vec![p; k.as_ref().map_or(0, |k| k.0.len())];
                let r = (|| {
                    let qt = TensorRef::new(q, qd)?;
                    let kt = match k {
                        Some((k, kd)) => Some(TensorRef::new(k, kd)?),
                        None => None,
                    };
                    let (ct, st) = (TensorRef::new(c, cd)?, TensorRef::new(s, cd)?);
                    let ko = if k.is_some() { Some(&mut ko[..]) } else { None };
                    rope(exec, qt, kt, ct, st, o, &mut qo, ko, &mut ws)
                })();
                (r, vec![qo, ko])
            }
        }
    }

    /// The magnitude of the terms of output `i` of output tensor `t`
    /// (for the cancellation part of the tolerance).
    fn scale(&self, t: usize, i: usize) -> f64 {
        let f = |v: &[T], i: usize| v.get(i).map_or(0.0, |x| x.to_f64().abs());
        match self {
            Case::Split { x, .. } => x
                .iter()
                .map(|v| v.to_f64().abs())
                .fold(1.0, f64::max)
                .powi(3),
            Case::Two { g, u, dy, .. } => (1.0 + f(dy, i)) * (1.0 + f(g, i)) * (1.0 + f(u, i)),
            Case::Rope { q, k, c, s, .. } => {
                let v = if t == 0 {
                    q
                } else {
                    &k.as_ref().map_or(q, |k| &k.0)
                };
                let m = |v: &[C]| v.iter().map(|x| x.to_f64().abs()).fold(1.0, f64::max);
                v.iter().map(|x| x.to_f64().abs()).fold(0.0, f64::max) * 2.0 * m(c).max(m(s))
            }
        }
    }

    /// What eager numerics may add beyond the share of `scale` (the terms'
    /// magnitude, `Case::scale`): with f32 cos each product is rounded
    /// twice (to f32, then to T), so one may land on the other side of a
    /// tie of T: an ulp of T at each of the two products
    /// (tests/elementwise.rs allows the same).
    fn double_rounding(&self, scale: f64) -> f64 {
        match self {
            Case::Rope { o, .. } if o.rounding == ElemRounding::Eager && C::DTYPE != T::DTYPE => {
                ulp_at::<T>(scale)
            }
            _ => 0.0,
        }
    }
}

fn check<T: Float, C: Float>(b: &mut Bytes<'_>) {
    let tame = b.bool();
    let case: Case<T, C> = match b.below(3) {
        0 => {
            let rank = 1 + b.below(4);
            let mut xd = dims(b, rank, CAP);
            let dim = b.below(rank + 2) as i64 - (rank as i64 + 1)
                + if b.bool() { rank as i64 } else { 0 };
            if b.one_in(8) {
                let i = b.below(rank);
                xd[i] |= 1;
            }
            let n: usize = xd.iter().product();
            let o = SwigluOptions {
                dim,
                rounding: rounding(b),
            };
            let out = if b.one_in(16) { n / 2 + 1 } else { n / 2 };
            Case::Split {
                x: some_values(b, n, tame),
                xd,
                dy: some_values(b, n / 2, tame),
                o,
                grad: b.bool(),
                out,
            }
        }
        1 => {
            let rank = 1 + b.below(3);
            let d = dims(b, rank, CAP);
            let ud = if b.one_in(16) {
                dims(b, rank, CAP)
            } else {
                d.clone()
            };
            let (n, un) = (d.iter().product(), ud.iter().product());
            let o = SwigluOptions {
                dim: -1,
                rounding: rounding(b),
            };
            Case::Two {
                g: some_values(b, n, tame),
                u: some_values(b, un, tame),
                d,
                ud,
                dy: some_values(b, n, tame),
                o,
                grad: b.bool(),
            }
        }
        _ => {
            let rank = 1 + b.below(4);
            let mut qd = dims(b, rank, CAP / 2);
            let hd = 2 * (1 + b.below(40));
            if b.one_in(16) {
                qd[rank - 1] = hd + 1;
            } else {
                qd[rank - 1] = hd;
            }
            while qd.iter().product::<usize>() > CAP {
                qd[0] /= 2;
            }
            // cos: a suffix of q's dims, some of them 1.
            let crank = 1 + b.below(rank);
            let mut cd: Vec<usize> = qd[rank - crank..].to_vec();
            for i in 0..crank - 1 {
                if b.bool() {
                    cd[i] = 1;
                }
            }
            if b.one_in(16) {
                cd[0] += 1;
            }
            let cn = cd.iter().product();
            let k = if b.bool() {
                let mut kd = qd.clone();
                if rank > 1 && b.bool() {
                    kd[0] = 1 + b.below(3);
                }
                let kn = kd.iter().product();
                Some((some_values(b, kn, tame), kd))
            } else {
                None
            };
            let o = RopeOptions {
                rounding: rounding(b),
                backward: b.bool(),
            };
            let qn = qd.iter().product();
            Case::Rope {
                q: some_values(b, qn, tame),
                qd,
                k,
                c: some_values(b, cn, tame),
                s: some_values(b, cn, tame),
                cd,
                o,
            }
        }
    };
    let (want_r, want) = case.run(&Exec::reference());
    let mut first: Option<Vec<Vec<T>>> = None;
    for isa in isas() {
        for threads in [1usize, 2] {
            let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
            let ub = if threads == 1 {
                UbConfig::default()
            } else {
                ub_of(b)
            };
            let (r, got) = case.run(&Exec::new(&cpu).with_ub(ub));
            assert_eq!(
                r, want_r,
                "{isa} x{threads}: outcome differs from the Reference"
            );
            if r.is_err() {
                for o in &got {
                    assert!(
                        o.iter().all(|v| v.to_f32() == POISON),
                        "{isa}: output written on error"
                    );
                }
                continue;
            }
            match &first {
                None => first = Some(got.clone()),
                Some(f) => {
                    for (g, w) in got.iter().zip(f) {
                        assert_same(g, w, "across ISAs, runners and tilings");
                    }
                }
            }
            if tame {
                for (t, (g, w)) in got.iter().zip(&want).enumerate() {
                    for i in 0..g.len() {
                        let (x, y) = (g[i].to_f64(), w[i].to_f64());
                        if x.is_nan() && y.is_nan() || x == y {
                            continue;
                        }
                        let scale = case.scale(t, i);
                        let tol = 2.0 * ulp_at::<T>(y)
                            + 1e-5 * scale
                            + case.double_rounding(scale)
                            + 1e-30;
                        assert!(
                            (x - y).abs() <= tol,
                            "{isa}: out {t}[{i}] {x} vs reference {y}"
                        );
                    }
                }
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes(data);
    match (b.u8() % 3, b.bool()) {
        (0, _) => check::<f32, f32>(&mut b),
        (1, false) => check::<f16, f16>(&mut b),
        (1, true) => check::<f16, f32>(&mut b),
        (_, false) => check::<bf16, bf16>(&mut b),
        (_, true) => check::<bf16, f32>(&mut b),
    }
});
