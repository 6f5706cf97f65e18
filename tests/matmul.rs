//! Matmul against the f64 reference (random data, every dtype pair, both
//! transposes, accumulate), the same bits on every ISA / thread count /
//! block count, edge shapes (one row, one column, K = 0, K not a multiple
//! of any width, K over a slice), NaN and Inf, and bad input refused with
//! nothing written.

mod common;

use common::{ulp_at, Rng};
use npukern::*;

const POISON: f32 = -7.25;

struct Case<T> {
    a: Vec<T>,
    b: Vec<T>,
    m: usize,
    n: usize,
    k: usize,
    o: MatmulOptions,
}

impl<T: Float> Case<T> {
    fn random(rng: &mut Rng, m: usize, n: usize, k: usize, o: MatmulOptions) -> Self {
        let mut v = |len: usize| -> Vec<T> {
            (0..len)
                .map(|_| T::from_f64(rng.uniform(-2.0, 2.0)))
                .collect()
        };
        Case {
            a: v(m * k),
            b: v(k * n),
            m,
            n,
            k,
            o,
        }
    }

    fn a_dims(&self) -> [usize; 2] {
        if self.o.trans_a {
            [self.k, self.m]
        } else {
            [self.m, self.k]
        }
    }

    fn b_dims(&self) -> [usize; 2] {
        if self.o.trans_b {
            [self.n, self.k]
        } else {
            [self.k, self.n]
        }
    }

    fn run<O: Float>(&self, exec: &Exec<'_>, c: &mut [O]) -> Result<()> {
        let a = TensorRef::new(&self.a, &self.a_dims())?;
        let b = TensorRef::new(&self.b, &self.b_dims())?;
        let n = matmul_workspace_size(exec, a, b, O::DTYPE, &self.o)?;
        let mut ws = vec![0u8; n];
        matmul(exec, a, b, &self.o, c, &mut ws)
    }

    /// `sum_k |a b|` per element (the error bound's scale).
    fn abs_sum(&self, i: usize, j: usize) -> f64 {
        (0..self.k)
            .map(|p| {
                let x = if self.o.trans_a {
                    self.a[p * self.m + i]
                } else {
                    self.a[i * self.k + p]
                };
                let y = if self.o.trans_b {
                    self.b[j * self.k + p]
                } else {
                    self.b[p * self.n + j]
                };
                (x.to_f64() * y.to_f64()).abs()
            })
            .sum()
    }
}

fn init<O: Float>(rng: &mut Rng, len: usize) -> Vec<O> {
    (0..len)
        .map(|_| O::from_f64(rng.uniform(-4.0, 4.0)))
        .collect()
}

/// Every ISA, 1 and 3 threads, a few block counts: the same bits; within
/// the f32-chain bound of the f64 reference.
fn check<T: Float, O: Float>(rng: &mut Rng, m: usize, n: usize, k: usize, o: MatmulOptions) {
    let case = Case::<T>::random(rng, m, n, k, o);
    let c0: Vec<O> = init(rng, m * n);
    let mut want = c0.clone();
    case.run(&Exec::reference(), &mut want).unwrap();
    let mut first: Option<Vec<O>> = None;
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        for (threads, blocks) in [(1usize, 64u32), (3, 5), (2, 1)] {
            let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
            let ub = UbConfig {
                blocks,
                ..UbConfig::default()
            };
            let mut got = c0.clone();
            case.run(&Exec::new(&cpu).with_ub(ub), &mut got).unwrap();
            match &first {
                None => first = Some(got.clone()),
                Some(f) => common::assert_same_bits(&got, f, &format!("{isa} x{threads}/{blocks}")),
            }
        }
    }
    let got = first.unwrap();
    // An f32 chain of K FMAs: |err| <= K u sum|ab| (u = 2^-24), then one
    // rounding to O (its ulp, as the chain's value may sit across a tie).
    let mut worst = 0f64;
    for i in 0..m {
        for j in 0..n {
            let (g, w) = (got[i * n + j].to_f64(), want[i * n + j].to_f64());
            let base = if o.accumulate {
                c0[i * n + j].to_f64().abs()
            } else {
                0.0
            };
            let tol = ulp_at::<O>(w)
                + (k as f64 + 1.0) * (base + case.abs_sum(i, j)) / (1u64 << 24) as f64;
            let score = (g - w).abs() / tol;
            assert!(
                score <= 1.0,
                "{m}x{n}x{k} {:?}/{:?} {o:?}: c[{i},{j}] = {g}, reference {w} (tol {tol})",
                T::DTYPE,
                O::DTYPE
            );
            worst = worst.max(score);
        }
    }
    eprintln!(
        "{m}x{n}x{k} {:?}->{:?} {o:?}: worst {worst:.3} of the bound",
        T::DTYPE,
        O::DTYPE
    );
}

fn opts(trans_a: bool, trans_b: bool, accumulate: bool) -> MatmulOptions {
    MatmulOptions {
        trans_a,
        trans_b,
        accumulate,
        ..Default::default()
    }
}

#[test]
fn every_dtype_and_transpose_matches_the_reference_with_the_same_bits() {
    let mut rng = Rng(57);
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let o = opts(ta, tb, false);
        check::<f32, f32>(&mut rng, 37, 45, 300, o);
        check::<bf16, bf16>(&mut rng, 37, 45, 300, o);
        check::<bf16, f32>(&mut rng, 20, 33, 17, o);
        check::<f16, f16>(&mut rng, 29, 50, 261, o);
        check::<f16, f32>(&mut rng, 15, 17, 40, o);
    }
}

#[test]
fn accumulate_starts_each_sum_at_c() {
    let mut rng = Rng(58);
    for (ta, tb) in [(false, false), (true, false), (false, true)] {
        check::<f32, f32>(&mut rng, 30, 70, 520, opts(ta, tb, true));
        check::<bf16, f32>(&mut rng, 9, 40, 257, opts(ta, tb, true));
        check::<f16, f32>(&mut rng, 16, 16, 16, opts(ta, tb, true));
    }
}

#[test]
fn edge_shapes() {
    let mut rng = Rng(59);
    let o = MatmulOptions::default();
    for (m, n, k) in [
        (1, 1, 1),
        (1, 100, 33),
        (100, 1, 33),
        (1, 1, 1000),
        (13, 31, 1),
        (15, 33, 255),
        (15, 33, 257),
        (200, 530, 64),
        (169, 17, 513),
    ] {
        check::<f32, f32>(&mut rng, m, n, k, o);
        check::<bf16, bf16>(&mut rng, m, n, k, opts(false, true, false));
    }
}

#[test]
fn larger_than_a_tile_in_every_dimension() {
    let mut rng = Rng(60);
    // Three K slices, the last of 8: a bf16 c's partials written, read
    // and written, read.
    check::<bf16, bf16>(&mut rng, 700, 530, 520, opts(false, true, false));
    check::<f32, f32>(&mut rng, 690, 1030, 300, opts(true, false, true));
    // K in one slice: tiles down a column share their packed b.
    check::<bf16, bf16>(&mut rng, 700, 530, 45, opts(true, false, false));
}

#[test]
fn an_empty_sum_writes_zeros_or_keeps_c() {
    let a: Vec<bf16> = vec![];
    let b: Vec<bf16> = vec![];
    let ta = TensorRef::new(&a, &[3, 0]).unwrap();
    let tb = TensorRef::new(&b, &[0, 4]).unwrap();
    for exec in [Exec::cpu(), Exec::reference()] {
        let mut c = vec![bf16::from_f32(POISON); 12];
        matmul(&exec, ta, tb, &MatmulOptions::default(), &mut c, &mut []).unwrap();
        assert!(c.iter().all(|v| v.to_bits() == 0));
        let mut c = vec![POISON; 12];
        matmul(&exec, ta, tb, &opts(false, false, true), &mut c, &mut []).unwrap();
        assert!(c.iter().all(|&v| v == POISON));
    }
}

#[test]
fn nan_and_inf_propagate_and_subnormals_are_kept() {
    let (m, n, k) = (5, 20, 40);
    let mut rng = Rng(61);
    let mut case = Case::<f32>::random(&mut rng, m, n, k, MatmulOptions::default());
    case.a[0] = f32::NAN; // row 0: NaN everywhere
    case.a[k + 3] = f32::INFINITY; // row 1: +-Inf (or NaN where b is 0)
    for v in &mut case.a[2 * k..3 * k] {
        *v = 1e-20; // row 2 ...
    }
    for p in 0..k {
        for v in &mut case.b[p * n..p * n + 4] {
            *v = 1e-20; // ... times columns 0..4: products of 1e-40, subnormal
        }
    }
    case.b[3 * n + 7] = 0.0; // Inf * 0 at (1, 7): NaN
    let mut want = vec![0f32; m * n];
    case.run(&Exec::reference(), &mut want).unwrap();
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        let cpu = Cpu::new(Serial).with_isa(isa);
        let mut got = vec![0f32; m * n];
        case.run(&Exec::new(&cpu), &mut got).unwrap();
        assert!(got[..n].iter().all(|v| v.is_nan()), "{isa}: NaN row");
        assert!(got[n + 7].is_nan(), "{isa}: Inf * 0");
        assert!(got[n + 8].is_infinite());
        for j in 0..4 {
            // Each product and sum rounds to a subnormal (spacing 1.4e-45).
            let (g, w) = (got[2 * n + j] as f64, want[2 * n + j] as f64);
            assert!(
                g != 0.0 && (g - w).abs() <= 1.5e-45 * k as f64,
                "{isa}: subnormal sums {g} vs {w}"
            );
        }
    }
}

#[test]
fn bad_input_is_refused_and_nothing_is_written() {
    let a = vec![1f32; 6];
    let b = vec![1f32; 12];
    let a23 = TensorRef::new(&a, &[2, 3]).unwrap();
    let b34 = TensorRef::new(&b, &[3, 4]).unwrap();
    let b43 = TensorRef::new(&b, &[4, 3]).unwrap();
    let b26 = TensorRef::new(&b, &[2, 6]).unwrap();
    let a6 = TensorRef::new(&a, &[6]).unwrap();
    let e = Exec::cpu();
    let mut ws = vec![0u8; 1 << 22];
    type Bad<'a> = (
        TensorRef<'a, f32>,
        TensorRef<'a, f32>,
        MatmulOptions,
        usize,
        &'static str,
    );
    let cases: [Bad<'_>; 5] = [
        (a23, b43, MatmulOptions::default(), 8, "b"),
        (a23, b26, MatmulOptions::default(), 12, "b"),
        (a6, b34, MatmulOptions::default(), 4, "a"),
        (a23, b34, MatmulOptions::default(), 7, "c"),
        (a23, b34, opts(true, false, false), 8, "b"),
    ];
    for (x, y, o, len, arg) in cases {
        let mut c = vec![POISON; len];
        let r = matmul(&e, x, y, &o, &mut c, &mut ws);
        let err = r.expect_err("refused");
        assert_eq!(err.argument(), arg, "{err}");
        assert!(c.iter().all(|&v| v == POISON));
    }
    // Accumulate into a 16-bit c; a 16-bit c of another dtype.
    let ab = vec![bf16::ONE; 6];
    let bb = vec![bf16::ONE; 12];
    let (xa, xb) = (
        TensorRef::new(&ab, &[2, 3]).unwrap(),
        TensorRef::new(&bb, &[3, 4]).unwrap(),
    );
    let mut c = vec![bf16::from_f32(POISON); 8];
    let err = matmul(&e, xa, xb, &opts(false, false, true), &mut c, &mut ws).unwrap_err();
    assert_eq!(err.argument(), "c");
    let mut c = vec![f16::from_f32(POISON); 8];
    let err = matmul(&e, xa, xb, &MatmulOptions::default(), &mut c, &mut ws).unwrap_err();
    assert_eq!(err.argument(), "c");
    // Too small a workspace.
    let mut c = vec![POISON; 8];
    let err = matmul(
        &e,
        a23,
        b34,
        &MatmulOptions::default(),
        &mut c,
        &mut [0u8; 16],
    )
    .unwrap_err();
    assert!(matches!(err, Error::WorkspaceTooSmall { .. }), "{err}");
    assert!(c.iter().all(|&v| v == POISON));
}

#[test]
fn the_plan_cuts_tiles_over_workers_and_sizes_arenas() {
    let a = vec![bf16::ONE; 512 * 1024];
    let b = vec![bf16::ONE; 1024 * 2816];
    let ta = TensorRef::new(&a, &[512, 1024]).unwrap();
    let tb = TensorRef::new(&b, &[2816, 1024]).unwrap();
    let o = opts(false, true, false);
    for blocks in [1u32, 2, 64] {
        let e = Exec::cpu().with_ub(UbConfig {
            blocks,
            ..UbConfig::default()
        });
        // With K > kc every c keeps f32 partials (an f32 c too: its own
        // rows are n apart, 4 KiB for n = 1024, one L1 set).
        let bytes = matmul_workspace_size(&e, ta, tb, DType::BF16, &o).unwrap();
        let f32_bytes = matmul_workspace_size(&e, ta, tb, DType::F32, &o).unwrap();
        let workers = (blocks as usize).min(6 * 2); // 6 column tiles, up to 2-4 row tiles
        assert_eq!(bytes, f32_bytes, "every c with K > kc keeps partials");
        let short = TensorRef::new(&a[..512 * 256], &[512, 256]).unwrap();
        let tb_short = TensorRef::new(&b[..2816 * 256], &[2816, 256]).unwrap();
        let no_partials = matmul_workspace_size(&e, short, tb_short, DType::F32, &o).unwrap();
        assert!(no_partials < f32_bytes, "K <= kc: no partials");
        assert!(bytes <= workers * (3 << 20), "{blocks}: {bytes}");
    }
}

/// A step-sized bf16 product (x W^T, 512 x 1024 x 512, uniform [-2, 2]) on
/// the detected ISA, against float64 rounded once: the share of outputs
/// that differ from it and the worst distance in bf16 steps of the result
/// (docs/accuracy.md quotes both beside torch's bf16 `mm`).
#[test]
fn a_step_sized_bf16_product_against_float64() {
    let (m, n, k) = (512, 512, 1024);
    for math in [MatmulMath::Chain, MatmulMath::Bf16Dot] {
        let mut rng = Rng(62);
        let o = MatmulOptions {
            math,
            ..opts(false, true, false)
        };
        let case = Case::<bf16>::random(&mut rng, m, n, k, o);
        let (mut got, mut want) = (vec![bf16::ZERO; m * n], vec![bf16::ZERO; m * n]);
        case.run(&Exec::cpu(), &mut got).unwrap();
        case.run(&Exec::reference(), &mut want).unwrap();
        let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| common::ulps(*g, *w))
            .max()
            .unwrap();
        eprintln!(
            "512x1024x512 bf16 {math:?}: {:.3}% differ from round(f64), worst {worst} bf16 steps",
            100.0 * differ as f64 / (m * n) as f64
        );
        // An f32 chain of 1024 FMAs (or of 512 pairs of them) moves a bf16
        // result by at most a step but where the sum cancels to a small
        // value.
        assert!(
            differ * 100 < m * n,
            "{math:?}: {differ} of {} differ",
            m * n
        );
    }
}
