//! A bf16 matmul case for the pair dots' bit-for-bit tests
//! (tests/matmul_dot.rs, tests/matmul_dot_arm.rs): operands, the
//! per-element model's c, and the check that every ISA, thread and block
//! count gives the model's bits.

use half::bf16;
use npukern::*;

/// A pair dot's model of one element: c's starting value (0, or c's own
/// under `accumulate`), then row i of op(a) against column j of op(b).
pub type Model = fn(f32, &[bf16], &[bf16]) -> f32;

/// One bf16 matmul: `a`, `b` as stored (by the transposes of `o`).
pub struct Case {
    pub a: Vec<bf16>,
    pub b: Vec<bf16>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub o: MatmulOptions,
}

impl Case {
    pub fn new(
        m: usize,
        n: usize,
        k: usize,
        o: MatmulOptions,
        mut v: impl FnMut() -> bf16,
    ) -> Self {
        Case {
            a: (0..m * k).map(|_| v()).collect(),
            b: (0..k * n).map(|_| v()).collect(),
            m,
            n,
            k,
            o,
        }
    }

    pub fn run<O: Float>(&self, exec: &Exec<'_>, c: &mut [O]) -> Result<()> {
        let (m, n, k) = (self.m, self.n, self.k);
        let ad = if self.o.trans_a { [k, m] } else { [m, k] };
        let bd = if self.o.trans_b { [n, k] } else { [k, n] };
        let a = TensorRef::new(&self.a, &ad)?;
        let b = TensorRef::new(&self.b, &bd)?;
        let mut ws = vec![0u8; matmul_workspace_size(exec, a, b, O::DTYPE, &self.o)?];
        matmul(exec, a, b, &self.o, c, &mut ws)
    }

    /// Row i of op(a) and column j of op(b).
    pub fn vectors(&self, i: usize, j: usize) -> (Vec<bf16>, Vec<bf16>) {
        let (m, n, k) = (self.m, self.n, self.k);
        let x = (0..k)
            .map(|p| self.a[if self.o.trans_a { p * m + i } else { i * k + p }])
            .collect();
        let y = (0..k)
            .map(|p| self.b[if self.o.trans_b { j * k + p } else { p * n + j }])
            .collect();
        (x, y)
    }

    /// The model's c from `c0`.
    pub fn want<O: Float>(&self, model: Model, c0: &[O]) -> Vec<O> {
        let mut w = c0.to_vec();
        for i in 0..self.m {
            for j in 0..self.n {
                let (x, y) = self.vectors(i, j);
                let start = if self.o.accumulate {
                    c0[i * self.n + j].to_f64() as f32
                } else {
                    0.0
                };
                if self.k > 0 || !self.o.accumulate {
                    w[i * self.n + j] = O::from_f32(model(start, &x, &y));
                }
            }
        }
        w
    }

    /// Every ISA and each (threads, blocks) of `runs`: the model's bits.
    pub fn check<O: Float>(&self, model: Model, c0: &[O], runs: &[(usize, u32)]) -> Vec<O> {
        let want = self.want(model, c0);
        for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
            for &(threads, blocks) in runs {
                let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
                let ub = UbConfig {
                    blocks,
                    ..UbConfig::default()
                };
                let mut got = c0.to_vec();
                self.run(&Exec::new(&cpu).with_ub(ub), &mut got).unwrap();
                super::assert_same_bits(
                    &got,
                    &want,
                    &format!(
                        "{}x{}x{} {:?} -> {:?} on {isa} x{threads}/{blocks}",
                        self.m,
                        self.n,
                        self.k,
                        self.o,
                        O::DTYPE
                    ),
                );
            }
        }
        want
    }
}

/// The options of `math` with these transposes and `accumulate`.
pub fn opts(math: MatmulMath, trans_a: bool, trans_b: bool, accumulate: bool) -> MatmulOptions {
    MatmulOptions {
        trans_a,
        trans_b,
        accumulate,
        math,
    }
}

/// Uniform [-2, 2] bf16.
pub fn uniform(rng: &mut super::Rng) -> impl FnMut() -> bf16 + '_ {
    move || bf16::from_f64(rng.uniform(-2.0, 2.0))
}

/// Every layout (the four transposes) of each shape, uniform operands,
/// into a bf16 and an f32 c: the model's bits on every ISA and each run.
pub fn every_layout(
    math: MatmulMath,
    model: Model,
    runs: &[(usize, u32)],
    shapes: &[(usize, usize, usize)],
    seed: u64,
) {
    let mut rng = super::Rng(seed);
    for (ta, tb) in [(false, true), (false, false), (true, false), (true, true)] {
        for &(m, n, k) in shapes {
            let case = Case::new(m, n, k, opts(math, ta, tb, false), uniform(&mut rng));
            case.check::<bf16>(model, &vec![bf16::from_f32(-7.25); m * n], runs);
            case.check::<f32>(model, &vec![-7.25f32; m * n], runs);
        }
    }
}

/// `accumulate` into an f32 c whose first and last starting sums are
/// subnormal (read as zero once a product is added): the model's bits; an
/// empty sum (K = 0) keeps c.
pub fn accumulate(
    math: MatmulMath,
    model: Model,
    runs: &[(usize, u32)],
    shapes: &[(usize, usize, usize)],
) {
    let mut rng = super::Rng(0xacc);
    for (ta, tb) in [(false, true), (true, false)] {
        for &(m, n, k) in shapes {
            let case = Case::new(m, n, k, opts(math, ta, tb, true), uniform(&mut rng));
            let mut c0: Vec<f32> = (0..m * n).map(|_| rng.uniform(-4.0, 4.0) as f32).collect();
            c0[0] = f32::from_bits(0x0040_0000);
            c0[m * n - 1] = -f32::from_bits(3);
            let want = case.check(model, &c0, runs);
            if k == 0 {
                assert_eq!(want, c0, "an empty sum keeps c");
            }
        }
    }
}

/// Each output of `got` (f32 c of `case`, no accumulate) within `(K + 1)
/// 2^-bits sum |a b|` of the f64 sum; returns the worst share of that bound.
pub fn within_bound(case: &Case, got: &[f32], bits: i32) -> f64 {
    let (m, n, k) = (case.m, case.n, case.k);
    let mut worst = 0f64;
    for i in 0..m {
        for j in 0..n {
            let (x, y) = case.vectors(i, j);
            let (w, s) = x.iter().zip(&y).fold((0f64, 0f64), |(w, s), (a, b)| {
                let p = a.to_f64() * b.to_f64();
                (w + p, s + p.abs())
            });
            let tol = (k as f64 + 1.0) * s * 2f64.powi(-bits);
            let score = (f64::from(got[i * n + j]) - w).abs() / tol;
            assert!(score <= 1.0, "c[{i},{j}] = {}, f64 {w}", got[i * n + j]);
            worst = worst.max(score);
        }
    }
    worst
}
