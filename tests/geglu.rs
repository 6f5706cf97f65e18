//! GeGLU and GeGluGrad against f64 (random data, every dtype, both GELU
//! forms, both forms of the operands, both numerics, edge shapes and
//! values), the same bits on every ISA, thread count and tiling, and bad
//! input refused with nothing written.

mod common;

use common::*;
use half::{bf16, f16};
use npukern::*;

const BETA: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const KAPPA: f64 = 0.044_715;

/// erf in f64, independent of the library's: Abramowitz-Stegun 7.1.6's
/// series (all terms positive).
fn erf(x: f64) -> f64 {
    let a = x.abs();
    if a > 6.0 {
        return x.signum();
    }
    let (mut term, mut sum) = (a, a);
    for k in 1..300 {
        term *= 2.0 * a * a / (2 * k + 1) as f64;
        sum += term;
    }
    (2.0 / std::f64::consts::PI.sqrt() * (-a * a).exp() * sum).min(1.0) * x.signum()
}

/// (gelu(x), gelu'(x), the f32 evaluation's condition: the magnitude of the
/// terms its f32 formula cancels, for y and for the derivative).
fn gelu(x: f64, tanh_form: bool) -> (f64, f64, f64, f64) {
    if tanh_form {
        let t = (BETA * (x + KAPPA * x * x * x)).tanh();
        let inner = BETA * (1.0 + 3.0 * KAPPA * x * x);
        let d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * inner;
        (0.5 * x * (1.0 + t), d, x.abs(), 1.0 + x.abs() * inner)
    } else {
        let c = 0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2));
        let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
        (x * c, c + x * pdf, x.abs(), 1.0 + x.abs() * 0.5)
    }
}

/// Allowed |got - want|: `ulps` of T at want, plus `rel32` f32 epsilons of
/// `scale` (what the f32 formula may cancel), plus `abs`.
fn close<T: Float>(got: T, want: f64, ulps: f64, scale: f64, rel32: f64, abs: f64) -> bool {
    let g = got.to_f64();
    if g.is_nan() || want.is_nan() {
        return g.is_nan() && want.is_nan();
    }
    if g.is_infinite() || want.is_infinite() || T::from_f64(want).to_f64().is_infinite() {
        return g == T::from_f64(want).to_f64();
    }
    (g - want).abs() <= ulps * ulp_at::<T>(want) + rel32 * f32::EPSILON as f64 * scale + abs
}

/// ulps of T each numerics mode may be off by (beyond the cancellation
/// term): as SwiGLU's (tests/elementwise.rs).
fn tol<T: Float>(eager: bool) -> f64 {
    match (T::DTYPE, eager) {
        (DType::F32, _) => 4.0,
        (_, false) => 1.0,
        (_, true) => 2.0,
    }
}

fn opts(eager: bool, tanh_form: bool, dim: i64, left: bool) -> GegluOptions {
    GegluOptions {
        dim,
        rounding: if eager {
            ElemRounding::Eager
        } else {
            ElemRounding::Fused
        },
        approximate: if tanh_form {
            GeluApproximate::Tanh
        } else {
            GeluApproximate::None
        },
        activate_left: left,
    }
}

/// The interesting range (|a| < 8) and log-uniform magnitudes.
fn gate_values(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| {
            if i % 3 == 0 {
                rng.mag()
            } else {
                rng.uniform(-8.0, 8.0)
            }
        })
        .collect()
}

/// The two-tensor forward and backward on `exec`.
fn gelu_mul_run<T: Float>(
    exec: &Exec<'_>,
    dims: &[usize],
    g: &[T],
    u: &[T],
    dy: &[T],
    o: &GegluOptions,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let n = g.len();
    let (gt, ut, dyt) = (
        TensorRef::new(g, dims).unwrap(),
        TensorRef::new(u, dims).unwrap(),
        TensorRef::new(dy, dims).unwrap(),
    );
    let mut y = vec![T::from_f32(0.0); n];
    let mut ws = vec![0u8; gelu_mul_workspace_size(exec, gt, ut, o).unwrap()];
    gelu_mul(exec, gt, ut, o, &mut y, &mut ws).unwrap();
    let (mut da, mut db) = (vec![T::from_f32(0.0); n], vec![T::from_f32(0.0); n]);
    let mut ws = vec![0u8; gelu_mul_grad_workspace_size(exec, dyt, gt, ut, o).unwrap()];
    gelu_mul_grad(exec, dyt, gt, ut, o, &mut da, &mut db, &mut ws).unwrap();
    (y, da, db)
}

/// For the report: the largest error in ulps of T (at the f64 value) per
/// output where the gate is >= 0, and over every gate the largest error in
/// f32 epsilons of the magnitude the f32 formula cancels (`|a b|`, `|a dy|`).
#[derive(Default, Debug)]
struct Worst {
    y: f64,
    da: f64,
    db: f64,
    y_eps: f64,
    db_eps: f64,
}

fn check_gelu_mul<T: Float>(dims: &[usize], seed: u64, tanh_form: bool, worst: &mut Worst) {
    let n: usize = dims.iter().product();
    let mut rng = Rng(seed);
    let g: Vec<T> = gate_values(&mut rng, n)
        .into_iter()
        .map(T::from_f64)
        .collect();
    let u: Vec<T> = vec_of(n, || rng.mag());
    let dy: Vec<T> = vec_of(n, || rng.mag());
    for eager in [false, true] {
        let o = opts(eager, tanh_form, -1, false);
        let cpu = gelu_mul_run(&Exec::cpu(), dims, &g, &u, &dy, &o);
        // The library's own golden model must meet the same bounds.
        let golden = gelu_mul_run(&reference(), dims, &g, &u, &dy, &o);
        let r = |v: f64| if eager { T::from_f64(v).to_f64() } else { v };
        let t = tol::<T>(eager);
        for (k, (y, da, db)) in [&cpu, &golden].into_iter().enumerate() {
            for i in 0..n {
                let (a, b, d) = (g[i].to_f64(), u[i].to_f64(), dy[i].to_f64());
                let (act, dact, ca, cd) = gelu(a, tanh_form);
                let floor = 1e-37 * (b.abs() + d.abs()) * (1.0 + a.abs());
                let what = |w: &str, got: T, want: f64| {
                    format!(
                        "{:?} tanh={tanh_form} eager={eager} {w}[{i}] a={a} b={b} dy={d}: {} vs {want}",
                        T::DTYPE,
                        got.to_f64()
                    )
                };
                let want_y = r(act) * b;
                let ok = close(y[i], want_y, t, ca * b.abs(), 8.0, floor);
                assert!(ok, "{}", what("y", y[i], want_y));
                let gb = r(d * b);
                if gb.is_infinite() || (a.abs() > 1.8e19 && tanh_form) {
                    // An eager intermediate overflowed T, or x^2 overflows
                    // f32: PyTorch's formula (and ours) gives NaN there.
                    continue;
                }
                let want_da = gb * dact;
                let ok = close(da[i], want_da, t, gb.abs() * cd, 16.0, floor);
                assert!(ok, "{}", what("da", da[i], want_da));
                let want_db = d * r(act);
                let ok = close(db[i], want_db, t, ca * d.abs(), 8.0, floor);
                assert!(ok, "{}", what("db", db[i], want_db));
                if k == 0 && !eager && a.abs() < 8.0 {
                    let fin = |e: f64| if e.is_finite() { e } else { 0.0 };
                    let u = |got: T, w: f64| fin((got.to_f64() - w).abs() / ulp_at::<T>(w));
                    let eps = |got: T, w: f64, sc: f64| {
                        fin((got.to_f64() - w).abs() / (f32::EPSILON as f64 * sc))
                    };
                    if a >= 0.0 {
                        worst.y = worst.y.max(u(y[i], want_y));
                        worst.db = worst.db.max(u(db[i], want_db));
                        worst.da = worst.da.max(u(da[i], want_da));
                    }
                    worst.y_eps = worst.y_eps.max(eps(y[i], want_y, ca * b.abs()));
                    worst.db_eps = worst.db_eps.max(eps(db[i], want_db, ca * d.abs()));
                }
            }
        }
    }
}

const SHAPES: [&[usize]; 8] = [
    &[1],
    &[1, 1],
    &[7],
    &[3, 17],
    &[2, 3, 33],
    &[5, 1000],
    &[2, 4099],
    &[1, 20000],
];

#[test]
fn gelu_mul_matches_f64_every_dtype_form_and_shape() {
    for tanh_form in [true, false] {
        let (mut w32, mut wb, mut wh) = (Worst::default(), Worst::default(), Worst::default());
        for (k, dims) in SHAPES.iter().enumerate() {
            check_gelu_mul::<f32>(dims, 10 + k as u64, tanh_form, &mut w32);
            check_gelu_mul::<bf16>(dims, 20 + k as u64, tanh_form, &mut wb);
            check_gelu_mul::<f16>(dims, 30 + k as u64, tanh_form, &mut wh);
        }
        println!(
            "tanh={tanh_form}, fused, |gate| < 8: ulps of the dtype (gate >= 0), \
             f32 eps of |gate*up| (all): f32 {w32:?}, bf16 {wb:?}, f16 {wh:?}"
        );
    }
}

/// The split form equals the two-tensor form on the halves (the gate the
/// second half by default, the first with `activate_left`), for every dim;
/// the `gelu` output is `gelu(gate)`, rounded once.
fn check_split<T: Float>(dims: &[usize], dim: i64, seed: u64) {
    let n: usize = dims.iter().product();
    let nd = dims.len() as i64;
    let d = if dim < 0 { dim + nd } else { dim } as usize;
    let mut rng = Rng(seed);
    let x: Vec<T> = gate_values(&mut rng, n)
        .into_iter()
        .map(T::from_f64)
        .collect();
    let outer: usize = dims[..d].iter().product();
    let l = n / outer / 2;
    let mut half = dims.to_vec();
    half[d] /= 2;
    let dy: Vec<T> = vec_of(n / 2, || rng.mag());
    let (mut first, mut second) = (Vec::new(), Vec::new());
    for r in 0..outer {
        first.extend_from_slice(&x[r * 2 * l..r * 2 * l + l]);
        second.extend_from_slice(&x[r * 2 * l + l..(r + 1) * 2 * l]);
    }
    let exec = Exec::cpu();
    for (eager, tanh_form, left) in [
        (false, true, false),
        (true, true, true),
        (false, false, true),
        (true, false, false),
    ] {
        let o = opts(eager, tanh_form, dim, left);
        let (gate, up) = if left {
            (&first, &second)
        } else {
            (&second, &first)
        };
        let (y2, dg, du) = gelu_mul_run(&exec, &half, gate, up, &dy, &o);
        let xt = TensorRef::new(&x, dims).unwrap();
        let mut y = vec![T::from_f32(0.0); n / 2];
        let mut act = vec![T::from_f32(0.0); n / 2];
        let mut ws = vec![0u8; geglu_workspace_size(&exec, xt, &o).unwrap()];
        geglu(&exec, xt, &o, &mut y, Some(&mut act), &mut ws).unwrap();
        assert_same_bits(&y, &y2, "geglu vs gelu_mul");
        let mut y1 = vec![T::from_f32(0.0); n / 2];
        geglu(&exec, xt, &o, &mut y1, None, &mut ws).unwrap();
        assert_same_bits(&y1, &y2, "geglu without the gelu output");
        for (i, (g, a)) in gate.iter().zip(&act).enumerate() {
            let want = gelu(g.to_f64(), tanh_form).0;
            let ok = close(*a, want, tol::<T>(false), g.to_f64().abs(), 8.0, 1e-37);
            assert!(ok, "gelu[{i}] at {}: {} vs {want}", g.to_f64(), a.to_f64());
        }
        let mut dx = vec![T::from_f32(0.0); n];
        let dyt = TensorRef::new(&dy, &half).unwrap();
        geglu_grad(&exec, dyt, xt, &o, &mut dx, &mut ws).unwrap();
        let (mut w1, mut w2) = (Vec::new(), Vec::new());
        for r in 0..outer {
            w1.extend_from_slice(&dx[r * 2 * l..r * 2 * l + l]);
            w2.extend_from_slice(&dx[r * 2 * l + l..(r + 1) * 2 * l]);
        }
        let (wg, wu) = if left { (&w1, &w2) } else { (&w2, &w1) };
        assert_same_bits(wg, &dg, "dx's gate half vs dgate");
        assert_same_bits(wu, &du, "dx's other half vs dup");
    }
}

#[test]
fn geglu_split_form_equals_the_halves() {
    check_split::<bf16>(&[4, 64], -1, 1);
    check_split::<f16>(&[3, 10, 7], 1, 2);
    check_split::<f32>(&[6, 2, 5], 0, 3);
    check_split::<bf16>(&[2, 3, 4, 22], -1, 4);
    check_split::<f32>(&[2, 2], -2, 5);
    check_split::<f32>(&[1, 2], -1, 6);
}

#[test]
fn geglu_special_values() {
    let a = [
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1e30,
        -1e30,
        1e-30,
        -1e-30,
        -100.0,
        1e19,
        -12.0,
        3.0,
        -3.0,
        1e-45,
        2.0,
    ];
    let b = [
        1.0f32,
        -2.0,
        1.0,
        1.0,
        1.0,
        0.5,
        0.5,
        1e30,
        1e30,
        1.0,
        1.0,
        1.0,
        f32::INFINITY,
        f32::NAN,
        1.0,
        0.0,
    ];
    let dy = [1.0f32; 16];
    for tanh_form in [true, false] {
        let o = opts(false, tanh_form, -1, false);
        let (y, da, db) = gelu_mul_run(&Exec::cpu(), &[16], &a, &b, &dy, &o);
        for i in 0..16 {
            let (x, u) = (a[i] as f64, b[i] as f64);
            if x.is_infinite() || x.is_nan() {
                continue;
            }
            let want = gelu(x, tanh_form).0 * u;
            let ok = close(y[i], want, 4.0, x.abs() * u.abs(), 8.0, 1e-37);
            assert!(ok, "tanh={tanh_form} y at a={x} b={u}: {} vs {want}", y[i]);
        }
        assert_eq!(y[2], f32::INFINITY, "gelu(+Inf) = +Inf");
        assert!(y[3].is_nan(), "-Inf * 0 is NaN, as PyTorch's formula");
        assert!(y[4].is_nan() && da[4].is_nan() && db[4].is_nan());
        assert_eq!(y[9], 0.0, "gelu(-100) = 0");
        assert_eq!(da[9], 0.0);
        assert_eq!(y[0], 0.0);
        assert_eq!(da[0], 0.5, "gelu'(0) = 1/2");
        assert_eq!(y[5], 5e29);
        if tanh_form {
            // x^2 overflows f32: PyTorch's formula (and ours) gives NaN.
            assert!(da[5].is_nan());
        } else {
            assert_eq!(da[5], 0.5);
        }
        assert_eq!(db[10], 1e19);
    }
}

/// The same bits on every ISA, thread count and UB size (a UB of 1 KiB
/// cuts each 1061-long row into several tiles).
#[test]
fn geglu_bits_are_the_same_everywhere() {
    let mut rng = Rng(77);
    let (m, n) = (37, 1061);
    let g: Vec<bf16> = gate_values(&mut rng, m * n)
        .into_iter()
        .map(bf16::from_f64)
        .collect();
    let u: Vec<bf16> = vec_of(m * n, || rng.mag());
    let dy: Vec<bf16> = vec_of(m * n, || rng.mag());
    let gf: Vec<f32> = g.iter().map(|v| v.to_f32()).collect();
    let uf: Vec<f32> = u.iter().map(|v| v.to_f32()).collect();
    let dyf: Vec<f32> = dy.iter().map(|v| v.to_f32()).collect();
    for tanh_form in [true, false] {
        for eager in [false, true] {
            let o = opts(eager, tanh_form, -1, false);
            let e = Exec::new(&CPU_SERIAL);
            let base = gelu_mul_run(&e, &[m, n], &g, &u, &dy, &o);
            let base32 = gelu_mul_run(&e, &[m, n], &gf, &uf, &dyf, &o);
            for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
                for threads in [1, 3] {
                    for ub in [
                        UbConfig::default(),
                        UbConfig {
                            ub_bytes: 1024,
                            blocks: 7,
                        },
                    ] {
                        let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
                        let e = Exec::new(&cpu).with_ub(ub);
                        let (y, da, db) = gelu_mul_run(&e, &[m, n], &g, &u, &dy, &o);
                        assert_same_bits(&y, &base.0, "y");
                        assert_same_bits(&da, &base.1, "da");
                        assert_same_bits(&db, &base.2, "db");
                        let (y, da, db) = gelu_mul_run(&e, &[m, n], &gf, &uf, &dyf, &o);
                        assert_same_bits(&y, &base32.0, "y f32");
                        assert_same_bits(&da, &base32.1, "da f32");
                        assert_same_bits(&db, &base32.2, "db f32");
                    }
                }
            }
        }
    }
}

#[test]
fn bad_input_is_refused_and_nothing_is_written() {
    let e = Exec::cpu();
    let x = vec![1.0f32; 12];
    let xt = TensorRef::new(&x, &[2, 6]).unwrap();
    let o = GegluOptions::default();
    let sentinel = -7.0f32;
    // An odd split size, a dim out of range, outputs of the wrong size.
    let odd = TensorRef::new(&x[..10], &[2, 5]).unwrap();
    let mut y = vec![sentinel; 6];
    assert!(geglu(&e, odd, &o, &mut y[..5], None, &mut []).is_err());
    let bad_dim = GegluOptions { dim: 2, ..o };
    assert!(geglu(&e, xt, &bad_dim, &mut y, None, &mut []).is_err());
    let mut g = vec![sentinel; 5];
    assert!(geglu(&e, xt, &o, &mut y, Some(&mut g), &mut []).is_err());
    assert!(geglu(&e, xt, &o, &mut y[..5], None, &mut []).is_err());
    let mut dx = vec![sentinel; 11];
    let dyt = TensorRef::new(&x[..6], &[2, 3]).unwrap();
    assert!(geglu_grad(&e, dyt, xt, &o, &mut dx, &mut []).is_err());
    // gate and up of different shapes.
    let up = TensorRef::new(&x[..6], &[3, 2]).unwrap();
    let gate = TensorRef::new(&x[6..], &[2, 3]).unwrap();
    assert!(gelu_mul(&e, gate, up, &o, &mut y, &mut []).is_err());
    assert!(y.iter().chain(&g).chain(&dx).all(|v| *v == sentinel));
}
