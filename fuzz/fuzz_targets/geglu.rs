//! GeGLU (split form with and without its gelu output, two-tensor form) and
//! GeGluGrad, differentially: arbitrary shapes (wrong ones too), dims,
//! values (NaN, Inf, subnormals), both GELU forms, both halves activated,
//! both numerics modes, f32/f16/bf16, any tiling.
//!
//! Checked as `elementwise` does for SwiGLU (the kernels are shared):
//! - every CPU run (each available ISA; two threads; another tiling) fails
//!   exactly when the Reference fails, with the same error, and then leaves
//!   the outputs untouched;
//! - the outputs are bit-identical across ISAs, runners and tilings (NaN
//!   payloads aside);
//! - on values of ordinary magnitude, within 2 ulp of the Reference plus
//!   1e-5 of the terms' magnitude (cancellation).
//!
//! Run: `cargo +nightly fuzz run geglu`, or `scripts/fuzz_smoke.sh geglu`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npukern::*;
use npukern_fuzz::{assert_same, dims, isas, some_values, ulp_at, Bytes};

/// Most elements of any tensor.
const CAP: usize = 4096;

const POISON: f32 = -7.25;

/// One call: the operands (`u` empty for the split form), its options and
/// which outputs.
struct Case<T> {
    x: Vec<T>,
    xd: Vec<usize>,
    u: Vec<T>,
    ud: Vec<usize>,
    dy: Vec<T>,
    o: GegluOptions,
    grad: bool,
    act: bool,
    out: usize,
}

impl<T: Float> Case<T> {
    fn split(&self) -> bool {
        self.u.is_empty()
    }

    /// Runs on `exec`; returns the outcome and every output.
    fn run(&self, exec: &Exec<'_>) -> (Result<()>, Vec<Vec<T>>) {
        let p = T::from_f32(POISON);
        let mut ws = Vec::new();
        let o = &self.o;
        let n = self.x.len();
        let mut y = vec![p; if self.grad { n } else { self.out }];
        let mut y2 = vec![p; if self.split() { self.out } else { n }];
        let r = (|| {
            let xt = TensorRef::new(&self.x, &self.xd)?;
            if !self.split() {
                let ut = TensorRef::new(&self.u, &self.ud)?;
                return if self.grad {
                    let dyt = TensorRef::new(&self.dy, &self.xd)?;
                    gelu_mul_grad(exec, dyt, xt, ut, o, &mut y, &mut y2, &mut ws)
                } else {
                    gelu_mul(exec, xt, ut, o, &mut y, &mut ws)
                };
            }
            if self.grad {
                let mut hd = self.xd.clone();
                let nd = hd.len() as i64;
                let d = if o.dim < 0 { o.dim + nd } else { o.dim };
                if (0..nd).contains(&d) {
                    hd[d as usize] /= 2;
                }
                let dyt = TensorRef::new(&self.dy, &hd)?;
                geglu_grad(exec, dyt, xt, o, &mut y, &mut ws)
            } else {
                let act = if self.act { Some(&mut y2[..]) } else { None };
                geglu(exec, xt, o, &mut y, act, &mut ws)
            }
        })();
        (r, vec![y, y2])
    }

    /// The magnitude of the terms of an output (for the cancellation part
    /// of the tolerance): GELU's tanh form cubes its input.
    fn scale(&self) -> f64 {
        let m = |v: &[T]| v.iter().map(|x| x.to_f64().abs()).fold(1.0, f64::max);
        m(&self.x).powi(3) * m(&self.u) * m(&self.dy)
    }
}

fn check<T: Float>(b: &mut Bytes<'_>) {
    let tame = b.bool();
    let o = GegluOptions {
        dim: -1,
        rounding: if b.bool() {
            ElemRounding::Eager
        } else {
            ElemRounding::Fused
        },
        approximate: if b.bool() {
            GeluApproximate::None
        } else {
            GeluApproximate::Tanh
        },
        activate_left: b.bool(),
    };
    let case: Case<T> = if b.bool() {
        let rank = 1 + b.below(4);
        let mut xd = dims(b, rank, CAP);
        let dim =
            b.below(rank + 2) as i64 - (rank as i64 + 1) + if b.bool() { rank as i64 } else { 0 };
        if b.one_in(8) {
            let i = b.below(rank);
            xd[i] |= 1;
        }
        let n: usize = xd.iter().product();
        let out = if b.one_in(16) { n / 2 + 1 } else { n / 2 };
        Case {
            x: some_values(b, n, tame),
            xd,
            u: Vec::new(),
            ud: Vec::new(),
            dy: some_values(b, n / 2, tame),
            o: GegluOptions { dim, ..o },
            grad: b.bool(),
            act: b.bool(),
            out,
        }
    } else {
        let rank = 1 + b.below(3);
        let d = dims(b, rank, CAP);
        let ud = if b.one_in(16) {
            dims(b, rank, CAP)
        } else {
            d.clone()
        };
        let (n, un) = (d.iter().product(), ud.iter().product::<usize>());
        Case {
            x: some_values(b, n, tame),
            xd: d,
            u: some_values(b, un.max(1), tame),
            ud,
            dy: some_values(b, n, tame),
            o,
            grad: b.bool(),
            act: false,
            out: n,
        }
    };
    let (want_r, want) = case.run(&Exec::reference());
    // Once per case: a pass over every operand (per element it made a
    // 4096-element case quadratic, 19 s in the coverage build).
    let scale = case.scale();
    let mut first: Option<Vec<Vec<T>>> = None;
    for isa in isas() {
        for threads in [1usize, 2] {
            let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
            let ub = if threads == 1 {
                UbConfig::default()
            } else {
                UbConfig {
                    ub_bytes: 1024 + b.below(8) * 4096,
                    blocks: 1 + b.below(9) as u32,
                }
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
                        let tol = 2.0 * ulp_at::<T>(y) + 1e-5 * scale + 1e-30;
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
    match b.u8() % 3 {
        0 => check::<f32>(&mut b),
        1 => check::<f16>(&mut b),
        _ => check::<bf16>(&mut b),
    }
});
