//! SwiGLU, SwiGluGrad and RoPE against the f64 golden model (random data,
//! every dtype, both forms, both numerics, edge shapes and values), the same
//! bits on every ISA, thread count and tiling, and bad input refused with
//! nothing written.

mod common;

use common::*;
use half::{bf16, f16};
use npukern::*;

/// Allowed |got - want|: `ulps` of T at want, plus `rel32` f32 epsilons of
/// `scale` (the magnitude of the terms that may cancel), plus `abs`.
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

/// ulps of T each numerics mode may be off by (beyond the cancellation term).
fn tol<T: Float>(eager: bool) -> f64 {
    match (T::DTYPE, eager) {
        (DType::F32, _) => 4.0,
        (_, false) => 1.0,
        // Eager rounds intermediates computed in f32 where the model
        // computes them in f64: one may land on the other side of a tie.
        (_, true) => 2.0,
    }
}

fn silu(a: f64) -> f64 {
    a / (1.0 + (-a).exp())
}

/// A mix of the interesting range (|a| < 10) and log-uniform magnitudes.
fn gate_values(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| {
            if i % 3 == 0 {
                rng.mag()
            } else {
                rng.uniform(-10.0, 10.0)
            }
        })
        .collect()
}

fn opts(eager: bool, dim: i64) -> SwigluOptions {
    SwigluOptions {
        dim,
        rounding: if eager {
            ElemRounding::Eager
        } else {
            ElemRounding::Fused
        },
    }
}

/// Runs the two-tensor forward and backward on `exec`.
fn silu_mul_run<T: Float>(
    exec: &Exec<'_>,
    dims: &[usize],
    g: &[T],
    u: &[T],
    dy: &[T],
    o: &SwigluOptions,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let n = g.len();
    let (gt, ut, dyt) = (
        TensorRef::new(g, dims).unwrap(),
        TensorRef::new(u, dims).unwrap(),
        TensorRef::new(dy, dims).unwrap(),
    );
    let mut y = vec![T::from_f32(0.0); n];
    let mut ws = vec![0u8; silu_mul_workspace_size(exec, gt, ut, o).unwrap()];
    silu_mul(exec, gt, ut, o, &mut y, &mut ws).unwrap();
    let (mut da, mut db) = (vec![T::from_f32(0.0); n], vec![T::from_f32(0.0); n]);
    let mut ws = vec![0u8; silu_mul_grad_workspace_size(exec, dyt, gt, ut, o).unwrap()];
    silu_mul_grad(exec, dyt, gt, ut, o, &mut da, &mut db, &mut ws).unwrap();
    (y, da, db)
}

fn check_silu_mul<T: Float>(dims: &[usize], seed: u64) {
    let n: usize = dims.iter().product();
    let mut rng = Rng(seed);
    let g: Vec<T> = gate_values(&mut rng, n)
        .into_iter()
        .map(T::from_f64)
        .collect();
    let u: Vec<T> = vec_of(n, || rng.mag());
    let dy: Vec<T> = vec_of(n, || rng.mag());
    for eager in [false, true] {
        let o = opts(eager, -1);
        let cpu = silu_mul_run(&Exec::cpu(), dims, &g, &u, &dy, &o);
        // The library's own golden model must meet the same bounds.
        let golden = silu_mul_run(&reference(), dims, &g, &u, &dy, &o);
        let r = |v: f64| if eager { T::from_f64(v).to_f64() } else { v };
        let t = tol::<T>(eager);
        for (y, da, db) in [&cpu, &golden] {
            for i in 0..n {
                let (a, b, d) = (g[i].to_f64(), u[i].to_f64(), dy[i].to_f64());
                // Where e^-a overflows f32 (a < -88.7), silu is -0 as PyTorch's
                // formula gives; the exact value is below 1e-38.
                let floor = 1e-37 * (b.abs() + d.abs() * (1.0 + a.abs()));
                let s = 1.0 / (1.0 + (-a).exp());
                let want_y = r(silu(a)) * b;
                assert!(
                    close(y[i], want_y, t, want_y.abs(), 4.0, floor),
                    "{:?} eager={eager} y[{i}] a={a} b={b}: {} vs {want_y}",
                    T::DTYPE,
                    y[i].to_f64()
                );
                let want_da = r(d * b) * s * (1.0 + a * (1.0 - s));
                if r(d * b).is_infinite() {
                    // An eager intermediate overflowed T: PyTorch's (and our)
                    // f32 sigmoid may then be 0 and give NaN (Inf * 0).
                    continue;
                }
                let scale = (d * b).abs() * s * (1.0 + a.abs() * (1.0 - s));
                assert!(
                    close(da[i], want_da, t, scale, 16.0, floor),
                    "{:?} eager={eager} da[{i}] a={a} b={b} dy={d}: {} vs {want_da}",
                    T::DTYPE,
                    da[i].to_f64()
                );
                let want_db = d * r(silu(a));
                assert!(
                    close(db[i], want_db, t, want_db.abs(), 4.0, floor),
                    "{:?} eager={eager} db[{i}]: {} vs {want_db}",
                    T::DTYPE,
                    db[i].to_f64()
                );
            }
        }
        let (y, ry) = (&cpu.0, &golden.0);
        for i in 0..n {
            assert!(ulps(ry[i], y[i]) <= t as u64 || y[i].to_f64().abs() < 1e-30);
        }
    }
}

#[test]
fn silu_mul_matches_f64_every_dtype_and_shape() {
    for (k, dims) in [
        vec![1usize],
        vec![1, 1],
        vec![7],
        vec![3, 17],
        vec![2, 3, 33],
        vec![5, 1000],
        vec![2, 4099],
    ]
    .iter()
    .enumerate()
    {
        check_silu_mul::<f32>(dims, 10 + k as u64);
        check_silu_mul::<bf16>(dims, 20 + k as u64);
        check_silu_mul::<f16>(dims, 30 + k as u64);
    }
}

/// The split form equals the two-tensor form on the halves, for every dim.
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
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for r in 0..outer {
        a.extend_from_slice(&x[r * 2 * l..r * 2 * l + l]);
        b.extend_from_slice(&x[r * 2 * l + l..(r + 1) * 2 * l]);
    }
    let exec = Exec::cpu();
    for eager in [false, true] {
        let o = opts(eager, dim);
        let (y2, da, db) = silu_mul_run(&exec, &half, &a, &b, &dy, &o);
        let xt = TensorRef::new(&x, dims).unwrap();
        let mut y = vec![T::from_f32(0.0); n / 2];
        let mut ws = vec![0u8; swiglu_workspace_size(&exec, xt, &o).unwrap()];
        swiglu(&exec, xt, &o, &mut y, &mut ws).unwrap();
        assert_same_bits(&y, &y2, "swiglu vs silu_mul");
        let mut dx = vec![T::from_f32(0.0); n];
        let dyt = TensorRef::new(&dy, &half).unwrap();
        swiglu_grad(&exec, dyt, xt, &o, &mut dx, &mut ws).unwrap();
        let (mut wa, mut wb) = (Vec::new(), Vec::new());
        for r in 0..outer {
            wa.extend_from_slice(&dx[r * 2 * l..r * 2 * l + l]);
            wb.extend_from_slice(&dx[r * 2 * l + l..(r + 1) * 2 * l]);
        }
        assert_same_bits(&wa, &da, "dx first half vs dgate");
        assert_same_bits(&wb, &db, "dx second half vs dup");
    }
}

#[test]
fn swiglu_split_form_equals_the_halves() {
    check_split::<bf16>(&[4, 64], -1, 1);
    check_split::<f16>(&[3, 10, 7], 1, 2);
    check_split::<f32>(&[6, 2, 5], 0, 3);
    check_split::<bf16>(&[2, 3, 4, 22], -1, 4);
    check_split::<f32>(&[2, 2], -2, 5);
}

#[test]
fn swiglu_special_values() {
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
        88.0,
        -88.0,
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
    let (y, da, db) = silu_mul_run(&Exec::cpu(), &[16], &a, &b, &dy, &opts(false, -1));
    for i in 0..16 {
        let want = silu(a[i] as f64) * b[i] as f64;
        assert!(
            close(y[i], want, 4.0, want.abs(), 4.0, 1e-37),
            "y at a={} b={}: {} vs {want}",
            a[i],
            b[i],
            y[i]
        );
    }
    assert!(
        y[3].is_nan() && y[4].is_nan(),
        "-Inf and NaN gates give NaN (as PyTorch)"
    );
    assert_eq!(
        y[9].to_bits(),
        (-0.0f32).to_bits(),
        "silu(-100) = -0 as PyTorch's formula"
    );
    assert!(da[4].is_nan() && db[4].is_nan());
    assert_eq!(db[2], f32::INFINITY);
}

/// The same bits on every ISA, thread count and UB size.
#[test]
fn elementwise_bits_are_the_same_everywhere() {
    let mut rng = Rng(77);
    let (m, n) = (37, 1061);
    let g: Vec<bf16> = gate_values(&mut rng, m * n)
        .into_iter()
        .map(bf16::from_f64)
        .collect();
    let u: Vec<bf16> = vec_of(m * n, || rng.mag());
    let dy: Vec<bf16> = vec_of(m * n, || rng.mag());
    let (b, s, h, d) = (2, 5, 3, 80);
    let q: Vec<f16> = vec_of(b * h * s * d, || rng.mag());
    let k: Vec<f16> = vec_of(b * s * d, || rng.mag());
    let cs: Vec<f16> = vec_of(s * d, || rng.uniform(-1.0, 1.0));
    let sn: Vec<f16> = vec_of(s * d, || rng.uniform(-1.0, 1.0));
    let base = {
        let e = Exec::new(&CPU_SERIAL);
        (
            silu_mul_run(&e, &[m, n], &g, &u, &dy, &opts(true, -1)),
            rope_run(
                &e,
                &q,
                &[b, h, s, d],
                &k,
                &[b, 1, s, d],
                &cs,
                &sn,
                &[s, d],
                false,
                false,
            ),
        )
    };
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        for threads in [1, 2, 3] {
            for ub in [
                UbConfig::default(),
                UbConfig {
                    ub_bytes: 1024,
                    blocks: 7,
                },
            ] {
                let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
                let e = Exec::new(&cpu).with_ub(ub);
                let (y, da, db) = silu_mul_run(&e, &[m, n], &g, &u, &dy, &opts(true, -1));
                assert_same_bits(&y, &base.0 .0, "y");
                assert_same_bits(&da, &base.0 .1, "da");
                assert_same_bits(&db, &base.0 .2, "db");
                let (qo, ko) = rope_run(
                    &e,
                    &q,
                    &[b, h, s, d],
                    &k,
                    &[b, 1, s, d],
                    &cs,
                    &sn,
                    &[s, d],
                    false,
                    false,
                );
                assert_same_bits(&qo, &base.1 .0, "q_out");
                assert_same_bits(&ko, &base.1 .1, "k_out");
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn rope_run<T: Float, C: Float>(
    exec: &Exec<'_>,
    q: &[T],
    qd: &[usize],
    k: &[T],
    kd: &[usize],
    cos: &[C],
    sin: &[C],
    cd: &[usize],
    eager: bool,
    backward: bool,
) -> (Vec<T>, Vec<T>) {
    let o = RopeOptions {
        rounding: if eager {
            ElemRounding::Eager
        } else {
            ElemRounding::Fused
        },
        backward,
    };
    let (qt, kt) = (
        TensorRef::new(q, qd).unwrap(),
        TensorRef::new(k, kd).unwrap(),
    );
    let (ct, st) = (
        TensorRef::new(cos, cd).unwrap(),
        TensorRef::new(sin, cd).unwrap(),
    );
    let mut qo = vec![T::from_f32(0.0); q.len()];
    let mut ko = vec![T::from_f32(0.0); k.len()];
    let mut ws = vec![0u8; rope_workspace_size(exec, qt, Some(kt), ct, st, &o).unwrap()];
    rope(
        exec,
        qt,
        Some(kt),
        ct,
        st,
        &o,
        &mut qo,
        Some(&mut ko),
        &mut ws,
    )
    .unwrap();
    (qo, ko)
}

/// The cos row of x's row `r` under right-aligned broadcasting.
fn cos_row(xd: &[usize], cd: &[usize], r: usize) -> usize {
    let (nx, nc) = (xd.len(), cd.len());
    let mut rem = r;
    let mut row = 0;
    let mut stride = 1;
    for i in (0..nx - 1).rev() {
        let coord = rem % xd[i];
        rem /= xd[i];
        let c = if i + nc >= nx { cd[i + nc - nx] } else { 1 };
        if c != 1 {
            row += coord * stride;
        }
        stride *= c;
    }
    row
}

#[allow(clippy::too_many_arguments)]
fn check_rope_one<T: Float, C: Float>(
    x: &[T],
    xd: &[usize],
    got: &[T],
    cos: &[C],
    sin: &[C],
    cd: &[usize],
    eager: bool,
    bwd: bool,
) {
    let d = xd[xd.len() - 1];
    let h = d / 2;
    let r = |v: f64| if eager { T::from_f64(v).to_f64() } else { v };
    for row in 0..x.len() / d {
        let cr = cos_row(xd, cd, row);
        for j in 0..h {
            let (x1, x2) = (x[row * d + j].to_f64(), x[row * d + h + j].to_f64());
            let c = |i: usize| cos[cr * d + i].to_f64();
            let s = |i: usize| sin[cr * d + i].to_f64();
            let (w1, w2, sc1, sc2) = if bwd {
                (
                    r(x1 * c(j)) + r(x2 * s(h + j)),
                    r(x2 * c(h + j)) - r(x1 * s(j)),
                    (x1 * c(j)).abs() + (x2 * s(h + j)).abs(),
                    (x2 * c(h + j)).abs() + (x1 * s(j)).abs(),
                )
            } else {
                (
                    r(x1 * c(j)) - r(x2 * s(j)),
                    r(x2 * c(h + j)) + r(x1 * s(h + j)),
                    (x1 * c(j)).abs() + (x2 * s(j)).abs(),
                    (x2 * c(h + j)).abs() + (x1 * s(h + j)).abs(),
                )
            };
            // Eager with f32 cos: each product is rounded twice (f32, then T).
            let extra = |sc: f64| {
                if eager && C::DTYPE != T::DTYPE {
                    ulp_at::<T>(sc)
                } else {
                    0.0
                }
            };
            for (g, w, sc) in [(got[row * d + j], w1, sc1), (got[row * d + h + j], w2, sc2)] {
                assert!(
                    close(g, w, tol::<T>(eager), sc, 4.0, extra(sc)),
                    "{:?}/{:?} eager={eager} bwd={bwd} row {row} col {j}: {} vs {w}",
                    T::DTYPE,
                    C::DTYPE,
                    g.to_f64()
                );
            }
        }
    }
}

fn check_rope<T: Float, C: Float>(qd: &[usize], kd: &[usize], cd: &[usize], seed: u64) {
    let mut rng = Rng(seed);
    let q: Vec<T> = vec_of(qd.iter().product(), || rng.mag());
    let k: Vec<T> = vec_of(kd.iter().product(), || rng.mag());
    let cn: usize = cd.iter().product();
    let cos: Vec<C> = vec_of(cn, || rng.uniform(-1.0, 1.0));
    let sin: Vec<C> = vec_of(cn, || rng.uniform(-1.0, 1.0));
    for eager in [false, true] {
        for bwd in [false, true] {
            let (qo, ko) = rope_run(&Exec::cpu(), &q, qd, &k, kd, &cos, &sin, cd, eager, bwd);
            check_rope_one(&q, qd, &qo, &cos, &sin, cd, eager, bwd);
            check_rope_one(&k, kd, &ko, &cos, &sin, cd, eager, bwd);
            let (rq, rk) = rope_run(&reference(), &q, qd, &k, kd, &cos, &sin, cd, eager, bwd);
            check_rope_one(&q, qd, &rq, &cos, &sin, cd, eager, bwd);
            check_rope_one(&k, kd, &rk, &cos, &sin, cd, eager, bwd);
        }
    }
}

#[test]
fn rope_matches_f64_every_layout_and_dtype() {
    // Hugging Face: [b, heads, s, d], cos [b, 1, s, d]; GQA k with fewer heads.
    check_rope::<bf16, bf16>(&[2, 4, 9, 64], &[2, 2, 9, 64], &[2, 1, 9, 64], 1);
    check_rope::<f16, f16>(&[1, 3, 5, 128], &[1, 1, 5, 128], &[5, 128], 2);
    check_rope::<f32, f32>(&[2, 3, 7, 80], &[2, 3, 7, 80], &[1, 1, 7, 80], 3);
    // torch_npu's [b, s, n, d] with r1 [1, s, 1, d]; f32 cos for 16-bit x.
    check_rope::<bf16, f32>(&[2, 6, 3, 96], &[2, 6, 1, 96], &[1, 6, 1, 96], 4);
    check_rope::<f16, f32>(&[3, 2, 2], &[1, 2], &[2], 5);
    // Odd half widths, one column pair, per-row cos.
    check_rope::<bf16, bf16>(&[4, 6], &[4, 6], &[4, 6], 6);
    check_rope::<f32, f32>(&[1, 1, 1, 2], &[1, 1, 1, 2], &[1, 2], 7);
    check_rope::<f16, f16>(&[2, 33, 258], &[1, 33, 258], &[33, 258], 8);
}

/// The backward is the forward's adjoint: <rope(x), g> = <x, rope_bwd(g)>.
#[test]
fn rope_backward_is_the_adjoint() {
    let mut rng = Rng(99);
    let (xd, cd) = ([2usize, 3, 5, 16], [2usize, 1, 5, 16]);
    let n: usize = xd.iter().product();
    let x: Vec<f32> = vec_of(n, || rng.uniform(-1.0, 1.0));
    let g: Vec<f32> = vec_of(n, || rng.uniform(-1.0, 1.0));
    let cn: usize = cd.iter().product();
    let cos: Vec<f32> = vec_of(cn, || rng.uniform(-1.0, 1.0));
    let sin: Vec<f32> = vec_of(cn, || rng.uniform(-1.0, 1.0));
    let e = Exec::cpu();
    let kd = [2usize, 1, 5, 16];
    let (fx, _) = rope_run(&e, &x, &xd, &x[..160], &kd, &cos, &sin, &cd, false, false);
    let (bg, _) = rope_run(&e, &g, &xd, &g[..160], &kd, &cos, &sin, &cd, false, true);
    let lhs: f64 = fx.iter().zip(&g).map(|(a, b)| *a as f64 * *b as f64).sum();
    let rhs: f64 = x.iter().zip(&bg).map(|(a, b)| *a as f64 * *b as f64).sum();
    assert!(
        (lhs - rhs).abs() < 1e-4 * (1.0 + lhs.abs()),
        "{lhs} vs {rhs}"
    );
}

/// A row longer than a UB tile is cut into chunks: same bits as one chunk.
#[test]
fn long_rows_are_chunked_with_the_same_bits() {
    let mut rng = Rng(3);
    let n = 100_003;
    let g: Vec<f16> = gate_values(&mut rng, n)
        .into_iter()
        .map(f16::from_f64)
        .collect();
    let u: Vec<f16> = vec_of(n, || rng.mag());
    let dy: Vec<f16> = vec_of(n, || rng.mag());
    let big = silu_mul_run(&Exec::cpu(), &[1, n], &g, &u, &dy, &opts(false, -1));
    let small = Exec::cpu().with_ub(UbConfig {
        ub_bytes: 1024,
        blocks: 64,
    });
    let t = EltTiling::new(1, n, 3, false, 0, 0, &small.ub).unwrap();
    assert!(t.chunks_per_row > 1 && t.blocks > 1, "{t:?}");
    let cut = silu_mul_run(&small, &[1, n], &g, &u, &dy, &opts(false, -1));
    assert_same_bits(&cut.0, &big.0, "y");
    assert_same_bits(&cut.1, &big.1, "da");
    assert_same_bits(&cut.2, &big.2, "db");
}

#[test]
fn bad_input_is_refused_and_nothing_is_written() {
    let e = Exec::cpu();
    let poison = bf16::from_bits(0x7fa5);
    let x = vec![bf16::from_f32(1.0); 2 * 6];
    let o = opts(false, -1);
    let mut ws = [0u8; 0];
    // Odd split size.
    let xt = TensorRef::new(&x, &[4, 3]).unwrap();
    let mut y = vec![poison; 6];
    let err = swiglu(&e, xt, &o, &mut y, &mut ws).unwrap_err();
    assert_eq!(err.argument(), "x", "{err}");
    // dim out of range.
    let xt = TensorRef::new(&x, &[2, 6]).unwrap();
    let err = swiglu(&e, xt, &opts(false, 2), &mut y, &mut ws).unwrap_err();
    assert_eq!(err.argument(), "dim", "{err}");
    let err = swiglu(&e, xt, &opts(false, -3), &mut y, &mut ws).unwrap_err();
    assert_eq!(err.argument(), "dim", "{err}");
    // Wrong output length.
    let mut y5 = vec![poison; 5];
    assert!(swiglu(&e, xt, &o, &mut y5, &mut ws).is_err());
    // gate / up shapes differ.
    let up = vec![bf16::from_f32(1.0); 12];
    let (gt, ut) = (
        TensorRef::new(&x, &[2, 6]).unwrap(),
        TensorRef::new(&up, &[3, 4]).unwrap(),
    );
    let mut y12 = vec![poison; 12];
    let err = silu_mul(&e, gt, ut, &o, &mut y12, &mut ws).unwrap_err();
    assert_eq!(err.argument(), "up", "{err}");
    // dy shape wrong for the backward.
    let dy = vec![bf16::from_f32(1.0); 12];
    let dyt = TensorRef::new(&dy, &[2, 6]).unwrap();
    let mut dx = vec![poison; 12];
    let err = swiglu_grad(&e, dyt, xt, &o, &mut dx, &mut ws).unwrap_err();
    assert_eq!(err.argument(), "dy", "{err}");
    assert!(y
        .iter()
        .chain(&y5)
        .chain(&y12)
        .chain(&dx)
        .all(|v| v.to_bits() == 0x7fa5));
    // RoPE: odd head_dim, a cos that does not broadcast, k_out without k.
    let q = vec![bf16::from_f32(1.0); 2 * 3 * 6];
    let c = vec![bf16::from_f32(0.5); 3 * 6];
    let mut qo = vec![poison; 36];
    let ro = RopeOptions::default();
    let qt = TensorRef::new(&q, &[4, 9]).unwrap();
    let ct = TensorRef::new(&c[..9], &[1, 9]).unwrap();
    let err = rope(&e, qt, None, ct, ct, &ro, &mut qo, None, &mut ws).unwrap_err();
    assert_eq!(err.argument(), "q", "{err}");
    let qt = TensorRef::new(&q, &[2, 3, 6]).unwrap();
    let ct = TensorRef::new(&c[..12], &[2, 6]).unwrap();
    let err = rope(&e, qt, None, ct, ct, &ro, &mut qo, None, &mut ws).unwrap_err();
    assert_eq!(err.argument(), "q", "{err}");
    let ct = TensorRef::new(&c, &[3, 6]).unwrap();
    let mut ko = vec![poison; 36];
    let err = rope(&e, qt, None, ct, ct, &ro, &mut qo, Some(&mut ko), &mut ws).unwrap_err();
    assert_eq!(err.argument(), "k_out", "{err}");
    let st = TensorRef::new(&c[..6], &[1, 6]).unwrap();
    let err = rope(&e, qt, None, ct, st, &ro, &mut qo, None, &mut ws).unwrap_err();
    assert_eq!(err.argument(), "sin", "{err}");
    assert!(qo.iter().chain(&ko).all(|v| v.to_bits() == 0x7fa5));
}
