//! Shared test helpers: a seeded PRNG, random data, ulp distances, and
//! one-call wrappers that size the workspace and run an operator.
#![allow(dead_code)]

use half::{bf16, f16};
use npukern::*;

pub mod owned;
pub mod pair_dot;

/// splitmix64: small, seeded, reproducible.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn uniform(&mut self, a: f64, b: f64) -> f64 {
        a + (b - a) * self.unit()
    }
    /// Random sign times a magnitude log-uniform in [1e-3, 1e3].
    pub fn mag(&mut self) -> f64 {
        let m = 10f64.powf(self.uniform(-3.0, 3.0));
        if self.next_u64() & 1 == 0 {
            m
        } else {
            -m
        }
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

pub fn vec_of<T: Float>(n: usize, mut f: impl FnMut() -> f64) -> Vec<T> {
    (0..n).map(|_| T::from_f64(f())).collect()
}

/// Orders float bits monotonically (so the difference counts ulps).
fn ordered(bits: u64, sign_bit: u64) -> i128 {
    if bits & sign_bit != 0 {
        -((bits & !sign_bit) as i128)
    } else {
        bits as i128
    }
}

/// Distance in ulps of T between a and b; NaN vs NaN is 0, NaN vs number is max.
pub fn ulps<T: Float>(a: T, b: T) -> u64 {
    let (x, y) = (a.to_f64(), b.to_f64());
    if x.is_nan() || y.is_nan() {
        return if x.is_nan() && y.is_nan() {
            0
        } else {
            u64::MAX
        };
    }
    let (ba, bb, sb) = match T::DTYPE {
        DType::F32 => (
            a.to_f32().to_bits() as u64,
            b.to_f32().to_bits() as u64,
            1u64 << 31,
        ),
        DType::F16 => (
            f16::from_f32(a.to_f32()).to_bits() as u64,
            f16::from_f32(b.to_f32()).to_bits() as u64,
            1u64 << 15,
        ),
        _ => (
            bf16::from_f32(a.to_f32()).to_bits() as u64,
            bf16::from_f32(b.to_f32()).to_bits() as u64,
            1u64 << 15,
        ),
    };
    (ordered(ba, sb) - ordered(bb, sb)).unsigned_abs() as u64
}

/// |a - b| / |b| with NaN == NaN and Inf == Inf (same sign) counting as 0.
pub fn rel(a: f64, b: f64) -> f64 {
    if a.is_nan() && b.is_nan() || a == b {
        return 0.0;
    }
    if a.is_nan() || b.is_nan() || a.is_infinite() || b.is_infinite() {
        return f64::INFINITY;
    }
    (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
}

pub fn bits<T: Float>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

/// Output of one RmsNorm run.
pub struct Fwd<T> {
    pub y: Vec<T>,
    pub rstd: Vec<f32>,
    pub x_sum: Vec<T>,
}

pub fn rows_of(xs: &[usize], gs: &[usize]) -> usize {
    xs[..xs.len() - gs.len()].iter().product()
}

pub fn run_rms_norm<T: Float, G: Float>(
    exec: &Exec<'_>,
    x: &[T],
    xs: &[usize],
    g: &[G],
    gs: &[usize],
    opts: &RmsNormOptions,
) -> Fwd<T> {
    let xt = TensorRef::new(x, xs).unwrap();
    let gt = TensorRef::new(g, gs).unwrap();
    let mut ws = vec![0u8; rms_norm_workspace_size(exec, xt, gt, opts).unwrap()];
    let mut y = vec![T::from_f64(0.0); x.len()];
    let mut rstd = vec![0f32; rows_of(xs, gs)];
    rms_norm(exec, xt, gt, opts, &mut y, Some(&mut rstd), &mut ws).unwrap();
    Fwd {
        y,
        rstd,
        x_sum: vec![],
    }
}

pub fn run_add_rms_norm<T: Float, G: Float>(
    exec: &Exec<'_>,
    x1: &[T],
    x2: &[T],
    xs: &[usize],
    g: &[G],
    gs: &[usize],
    opts: &RmsNormOptions,
) -> Fwd<T> {
    let (a, b) = (
        TensorRef::new(x1, xs).unwrap(),
        TensorRef::new(x2, xs).unwrap(),
    );
    let gt = TensorRef::new(g, gs).unwrap();
    let mut ws = vec![0u8; add_rms_norm_workspace_size(exec, a, b, gt, opts).unwrap()];
    let mut y = vec![T::from_f64(0.0); x1.len()];
    let mut s = vec![T::from_f64(0.0); x1.len()];
    let mut rstd = vec![0f32; rows_of(xs, gs)];
    add_rms_norm(
        exec,
        a,
        b,
        gt,
        opts,
        &mut y,
        Some(&mut rstd),
        Some(&mut s),
        &mut ws,
    )
    .unwrap();
    Fwd { y, rstd, x_sum: s }
}

/// Output of one RmsNormGrad run.
pub struct Bwd<T, G> {
    pub dx: Vec<T>,
    pub dgamma: Vec<f32>,
    pub dgamma_cast: Vec<G>,
}

#[allow(clippy::too_many_arguments)]
pub fn run_grad<T: Float, G: Float>(
    exec: &Exec<'_>,
    dy: &[T],
    x: &[T],
    xs: &[usize],
    rstd: &[f32],
    g: &[G],
    gs: &[usize],
    dres: Option<&[T]>,
    opts: &RmsNormGradOptions,
    dgamma_init: Option<Vec<f32>>,
) -> Bwd<T, G> {
    let (dyt, xt) = (
        TensorRef::new(dy, xs).unwrap(),
        TensorRef::new(x, xs).unwrap(),
    );
    let rt = TensorRef::new(rstd, &[rstd.len()]).unwrap();
    let gt = TensorRef::new(g, gs).unwrap();
    let dres = dres.map(|d| TensorRef::new(d, xs).unwrap());
    let inputs = RmsNormGradInputs {
        x: xt,
        rstd: rt,
        gamma: gt,
        dres,
    };
    let mut ws = vec![0u8; rms_norm_grad_workspace_size(exec, dyt, &inputs, opts).unwrap()];
    let mut dx = vec![T::from_f64(0.0); x.len()];
    let mut dgamma = dgamma_init.unwrap_or_else(|| vec![f32::NAN; g.len()]);
    let mut dgc = vec![G::from_f64(0.0); g.len()];
    rms_norm_grad(
        exec,
        dyt,
        &inputs,
        opts,
        &mut dx,
        DgammaOut {
            dgamma: Some(&mut dgamma),
            dgamma_cast: Some(&mut dgc),
        },
        &mut ws,
    )
    .unwrap();
    Bwd {
        dx,
        dgamma,
        dgamma_cast: dgc,
    }
}

pub fn reference() -> Exec<'static> {
    Exec::reference()
}

/// Calls `f` with a CPU executor for every available ISA, 1-3 threads and
/// each of `blocks` plan cuts, and a label naming the three (the
/// determinism tests' sweep).
pub fn for_every_exec(blocks: &[u32], mut f: impl FnMut(&Exec<'_>, &str)) {
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        for threads in [1usize, 2, 3] {
            for &b in blocks {
                let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
                let exec = Exec::new(&cpu).with_ub(UbConfig {
                    blocks: b,
                    ..UbConfig::default()
                });
                f(&exec, &format!("{isa:?} {threads} threads {b} blocks"));
            }
        }
    }
}

/// One ulp of T at |v| (the spacing above |v| rounded to T).
pub fn ulp_at<T: Float>(v: f64) -> f64 {
    let a = v.abs();
    match T::DTYPE {
        DType::F32 => {
            let t = a as f32;
            (f32::from_bits(t.to_bits() + 1) as f64 - t as f64).abs()
        }
        DType::F16 => {
            let t = f16::from_f64(a);
            (f16::from_bits(t.to_bits() + 1).to_f64() - t.to_f64()).abs()
        }
        _ => {
            let t = bf16::from_f64(a);
            (bf16::from_bits(t.to_bits() + 1).to_f64() - t.to_f64()).abs()
        }
    }
}

/// Running maxima of the error measures, printed at the end of a test.
#[derive(Default, Debug, Clone, Copy)]
pub struct Stats {
    /// Max ulp distance of y / x_sum (f16, bf16) from the reference.
    pub y_ulps: u64,
    /// Max relative error of y (f32).
    pub y_rel: f64,
    /// Max relative error of rstd.
    pub rstd_rel: f64,
    /// Max |dx - ref| / (ulp(ref) + 1e-5 * row scale) (must be <= 1).
    pub dx_score: f64,
    /// Max |dx - ref| / row scale.
    pub dx_rowrel: f64,
    /// Max |dgamma - ref| / sum_m |dy * xh| (the condition-aware relative error).
    pub dgamma_cond_rel: f64,
    /// Max |dgamma - ref| / |ref|.
    pub dgamma_rel: f64,
}

impl Stats {
    pub fn merge(&mut self, o: &Stats) {
        self.y_ulps = self.y_ulps.max(o.y_ulps);
        self.y_rel = self.y_rel.max(o.y_rel);
        self.rstd_rel = self.rstd_rel.max(o.rstd_rel);
        self.dx_score = self.dx_score.max(o.dx_score);
        self.dx_rowrel = self.dx_rowrel.max(o.dx_rowrel);
        self.dgamma_cond_rel = self.dgamma_cond_rel.max(o.dgamma_cond_rel);
        self.dgamma_rel = self.dgamma_rel.max(o.dgamma_rel);
    }

    /// Compares a forward output with the reference's.
    pub fn forward<T: Float>(&mut self, got: &[T], want: &[T]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            if T::DTYPE == DType::F32 {
                self.y_rel = self.y_rel.max(rel(g.to_f64(), w.to_f64()));
            } else {
                self.y_ulps = self.y_ulps.max(ulps(*g, *w));
            }
        }
    }

    pub fn rstd(&mut self, got: &[f32], want: &[f32]) {
        for (g, w) in got.iter().zip(want) {
            self.rstd_rel = self.rstd_rel.max(rel(*g as f64, *w as f64));
        }
    }

    /// `scale[r]`: the row's gradient scale, max_j |rstd * dy_j * gamma_j| + max_j |dres_j|
    /// (dx is a difference of such terms, so its rounding error scales with them).
    pub fn dx<T: Float>(&mut self, got: &[T], want: &[T], n: usize, scale: &[f64]) {
        for ((gr, wr), &rowmax) in got.chunks(n.max(1)).zip(want.chunks(n.max(1))).zip(scale) {
            for (g, w) in gr.iter().zip(wr) {
                let (g, w) = (g.to_f64(), w.to_f64());
                if g.is_nan() && w.is_nan() || g == w {
                    continue;
                }
                let err = (g - w).abs();
                let tol = ulp_at::<T>(w) + 1e-5 * rowmax;
                self.dx_score = self.dx_score.max(err / tol);
                self.dx_rowrel = self.dx_rowrel.max(err / rowmax.max(f64::MIN_POSITIVE));
            }
        }
    }

    pub fn dgamma(&mut self, got: &[f32], want: &[f32], cond: &[f64]) {
        for ((g, w), c) in got.iter().zip(want).zip(cond) {
            let (g, w) = (*g as f64, *w as f64);
            if g == w {
                continue;
            }
            self.dgamma_cond_rel = self
                .dgamma_cond_rel
                .max((g - w).abs() / c.max(f64::MIN_POSITIVE));
            self.dgamma_rel = self.dgamma_rel.max(rel(g, w));
        }
    }
}

/// sum_m |dy * x * rstd| per column: the scale of dgamma's rounding error.
pub fn dgamma_condition<T: Float>(dy: &[T], x: &[T], rstd: &[f32], n: usize) -> Vec<f64> {
    let mut c = vec![0f64; n];
    for (r, (dr, xr)) in dy.chunks(n.max(1)).zip(x.chunks(n.max(1))).enumerate() {
        for j in 0..n {
            c[j] += (dr[j].to_f64() * xr[j].to_f64() * rstd[r] as f64).abs();
        }
    }
    c
}

/// Asserts two outputs are bit-identical, naming the first difference.
#[track_caller]
pub fn assert_same_bits<T: Float>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    // A NaN matches any NaN: IEEE 754 leaves the payload and sign of a NaN
    // made from two NaN operands unspecified, and compilers commute `*` and
    // `+` operands differently per ISA; only NaN-ness is part of the promise.
    let differ = |i: usize| {
        let (a, b) = (got[i].to_f32(), want[i].to_f32());
        !(a.is_nan() && b.is_nan()) && a.to_bits() != b.to_bits()
    };
    if let Some(i) = (0..got.len()).find(|&i| differ(i)) {
        panic!(
            "{what}: first difference at {i} of {}: {:e} vs {:e}",
            got.len(),
            got[i].to_f32(),
            want[i].to_f32()
        );
    }
}

/// Per row: max_j |rstd * dy_j * (gamma_j + off)| + max_j |dres_j|.
pub fn dx_scale<T: Float, G: Float>(
    dy: &[T],
    g: &[G],
    off: f32,
    rstd: &[f32],
    dres: Option<&[T]>,
    n: usize,
) -> Vec<f64> {
    (0..rstd.len())
        .map(|r| {
            let mut a = 0f64;
            let mut d = 0f64;
            for j in 0..n {
                let t =
                    (rstd[r] as f64 * dy[r * n + j].to_f64() * (g[j].to_f64() + off as f64)).abs();
                a = a.max(t);
                if let Some(dr) = dres {
                    d = d.max(dr[r * n + j].to_f64().abs());
                }
            }
            a + d
        })
        .collect()
}
