//! Algebraic properties of the kernels, checked by proptest on random shapes
//! and values (every ISA this machine has, small tilings so several blocks
//! and split rows occur):
//!
//! - EmbeddingDenseGrad is linear in grad: scaling grad by a power of two
//!   scales the table exactly; grad1 + grad2 gives the sum of the two tables
//!   within the f32 rounding of the sums; and permuting positions while
//!   keeping the order of the positions that share an index leaves the
//!   table bit-identical (sums run in ascending position order per row).
//! - RmsNorm with eps = 0 is invariant, bit for bit, to scaling x by a power
//!   of two within range (y unchanged, rstd scaled exactly).
//! - AddRmsNorm(x, 0) equals RmsNorm(x) bit for bit (y and rstd; x_sum = x).
//! - The in-place forms (AddRmsNorm's x_sum over x1, RmsNormGrad's dx over
//!   dy) agree bit for bit with the out-of-place forms.
//! - Padding lanes never contribute: for every row length (every N mod 16),
//!   a row holding ±Inf gives rstd = 0 and y = ±0 / NaN exactly where x is
//!   finite / infinite, a NaN row gives NaN, and the finite rows batched with
//!   it give the bits they give alone.

use npukern::*;
use proptest::prelude::*;

/// A small tiling: several blocks, rows split across chunks from ~250 columns.
fn small_ub() -> UbConfig {
    UbConfig {
        ub_bytes: 1024,
        blocks: 3,
    }
}

/// The CPU backends to check: every available ISA, serial.
fn cpus() -> Vec<Cpu> {
    Isa::ALL
        .into_iter()
        .filter(|i| i.is_available())
        .map(|i| Cpu::new(Serial).with_isa(i))
        .collect()
}

fn bits<T: Float>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

/// Values with magnitudes 2^-20 .. 2^20 and random signs (no -0.0).
fn vals(n: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec((-20i32..=20, 1.0f32..2.0, any::<bool>()), n).prop_map(|v| {
        v.into_iter()
            .map(|(e, m, neg)| if neg { -m } else { m } * 2f32.powi(e))
            .collect()
    })
}

fn rms<T: Float>(
    exec: &Exec<'_>,
    x: &[T],
    g: &[T],
    n: usize,
    opts: &RmsNormOptions,
) -> (Vec<T>, Vec<f32>) {
    let rows = x.len() / n;
    let (xt, gt) = (
        TensorRef::new(x, &[rows, n]).unwrap(),
        TensorRef::new(g, &[n]).unwrap(),
    );
    let mut ws = vec![0u8; rms_norm_workspace_size(exec, xt, gt, opts).unwrap()];
    let (mut y, mut r) = (vec![T::from_f32(0.0); x.len()], vec![0f32; rows]);
    rms_norm(exec, xt, gt, opts, &mut y, Some(&mut r), &mut ws).unwrap();
    (y, r)
}

fn emb(exec: &Exec<'_>, grad: &[f32], idx: &[i64], h: usize, nw: usize) -> Vec<f32> {
    let gt = TensorRef::new(grad, &[idx.len(), h]).unwrap();
    let it = TensorRef::new(idx, &[idx.len()]).unwrap();
    let opts = EmbeddingGradOptions::default();
    let mut ws = vec![0u8; embedding_dense_grad_workspace_size(exec, gt, it, nw, &opts).unwrap()];
    let mut out = vec![0f32; nw * h];
    embedding_dense_grad(exec, gt, it, nw, &opts, &mut out, &mut ws).unwrap();
    out
}

/// An embedding case: H, num_weights, indices (duplicates likely), grad.
fn emb_case() -> impl Strategy<Value = (usize, usize, Vec<i64>, Vec<f32>, Vec<f32>)> {
    (1usize..40, 1usize..12, 1usize..60).prop_flat_map(|(h, nw, n)| {
        (
            Just(h),
            Just(nw),
            prop::collection::vec(0..nw as i64, n),
            vals(n * h),
            vals(n * h),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn embedding_is_linear_in_grad((h, nw, idx, g1, g2) in emb_case(), k in -8i32..8) {
        for cpu in cpus() {
            let exec = Exec::new(&cpu).with_ub(small_ub());
            let (e1, e2) = (emb(&exec, &g1, &idx, h, nw), emb(&exec, &g2, &idx, h, nw));
            // Scaling by 2^k is exact at every step.
            let s = 2f32.powi(k);
            let scaled: Vec<f32> = g1.iter().map(|v| v * s).collect();
            let want: Vec<f32> = e1.iter().map(|v| v * s).collect();
            prop_assert_eq!(bits(&emb(&exec, &scaled, &idx, h, nw)), bits(&want));
            // Additivity within the f32 rounding of the sums.
            let sum: Vec<f32> = g1.iter().zip(&g2).map(|(a, b)| a + b).collect();
            let e = emb(&exec, &sum, &idx, h, nw);
            for r in 0..nw {
                let count = idx.iter().filter(|&&i| i as usize == r).count() as f64;
                for j in 0..h {
                    let mag: f64 = idx.iter().enumerate().filter(|(_, &i)| i as usize == r)
                        .map(|(p, _)| (g1[p * h + j] as f64).abs() + (g2[p * h + j] as f64).abs())
                        .sum();
                    let want = e1[r * h + j] as f64 + e2[r * h + j] as f64;
                    let tol = (3.0 * count + 2.0) * 2f64.powi(-24) * mag;
                    prop_assert!((e[r * h + j] as f64 - want).abs() <= tol,
                        "row {} col {}: {} vs {} + {}", r, j, e[r * h + j], e1[r * h + j], e2[r * h + j]);
                }
            }
        }
    }

    #[test]
    fn embedding_ignores_order_across_indices((h, nw, idx, g, _g2) in emb_case(), keys in prop::collection::vec(any::<u32>(), 60)) {
        // A permutation that keeps the relative order of equal indices:
        // sort positions by random keys, then refill each index's slots with
        // that index's positions in ascending order.
        let n = idx.len();
        let mut perm: Vec<usize> = (0..n).collect();
        perm.sort_by_key(|&p| keys[p]);
        for v in 0..nw as i64 {
            let mut mine = (0..n).filter(|&p| idx[p] == v);
            for slot in perm.iter_mut() {
                if idx[*slot] == v {
                    *slot = mine.next().unwrap();
                }
            }
        }
        let pidx: Vec<i64> = perm.iter().map(|&p| idx[p]).collect();
        let pg: Vec<f32> = perm.iter().flat_map(|&p| g[p * h..(p + 1) * h].iter().copied()).collect();
        for cpu in cpus() {
            let exec = Exec::new(&cpu).with_ub(small_ub());
            prop_assert_eq!(bits(&emb(&exec, &g, &idx, h, nw)), bits(&emb(&exec, &pg, &pidx, h, nw)));
        }
    }

    #[test]
    fn rms_norm_scale_invariant(n in 1usize..300, rows in 1usize..4, k in -12i32..12, seed in vals(1200), gs in vals(300)) {
        let x = &seed[..rows * n];
        let g = &gs[..n];
        let opts = RmsNormOptions { eps: 0.0, ..Default::default() };
        let s = 2f32.powi(k);
        let xs: Vec<f32> = x.iter().map(|v| v * s).collect();
        for cpu in cpus() {
            let exec = Exec::new(&cpu).with_ub(small_ub());
            let (y, r) = rms(&exec, x, g, n, &opts);
            let (ys, rs) = rms(&exec, &xs, g, n, &opts);
            prop_assert_eq!(bits(&y), bits(&ys));
            let want: Vec<f32> = r.iter().map(|v| v / s).collect();
            prop_assert_eq!(bits(&rs), bits(&want));
        }
    }

    #[test]
    fn add_rms_norm_of_zero_is_rms_norm(n in 1usize..300, rows in 1usize..4, seed in vals(1200), gs in vals(300), cast in any::<bool>()) {
        let x: Vec<bf16> = seed[..rows * n].iter().map(|&v| bf16::from_f32(v)).collect();
        let g: Vec<bf16> = gs[..n].iter().map(|&v| bf16::from_f32(v)).collect();
        let zero = vec![bf16::from_f32(0.0); x.len()];
        let opts = RmsNormOptions {
            rounding: if cast { Rounding::CastBeforeGamma } else { Rounding::Fused },
            ..Default::default()
        };
        for cpu in cpus() {
            let exec = Exec::new(&cpu).with_ub(small_ub());
            let (y, r) = rms(&exec, &x, &g, n, &opts);
            let (xt, zt, gt) = (
                TensorRef::new(&x, &[rows, n]).unwrap(),
                TensorRef::new(&zero, &[rows, n]).unwrap(),
                TensorRef::new(&g, &[n]).unwrap(),
            );
            let mut ws = vec![0u8; add_rms_norm_workspace_size(&exec, xt, zt, gt, &opts).unwrap()];
            let (mut y2, mut r2, mut s2) = (vec![bf16::ZERO; x.len()], vec![0f32; rows], vec![bf16::ZERO; x.len()]);
            add_rms_norm(&exec, xt, zt, gt, &opts, &mut y2, Some(&mut r2), Some(&mut s2), &mut ws).unwrap();
            prop_assert_eq!(bits(&y), bits(&y2));
            prop_assert_eq!(bits(&r), bits(&r2));
            prop_assert_eq!(bits(&x), bits(&s2));
        }
    }

    #[test]
    fn in_place_equals_out_of_place(n in 1usize..300, rows in 1usize..4, a in vals(1200), b in vals(1200), gs in vals(300), with_dres in any::<bool>()) {
        let len = rows * n;
        let x1: Vec<f16> = a[..len].iter().map(|&v| f16::from_f32(v * 1e-3)).collect();
        let x2: Vec<f16> = b[..len].iter().map(|&v| f16::from_f32(v * 1e-3)).collect();
        let g: Vec<f32> = gs[..n].to_vec();
        let opts = RmsNormOptions::default();
        let dims = [rows, n];
        for cpu in cpus() {
            let exec = Exec::new(&cpu).with_ub(small_ub());
            let (t1, t2, gt) = (
                TensorRef::new(&x1, &dims).unwrap(),
                TensorRef::new(&x2, &dims).unwrap(),
                TensorRef::new(&g, &[n]).unwrap(),
            );
            // AddRmsNorm: x_sum out of place, then over x1.
            let mut ws = vec![0u8; add_rms_norm_workspace_size(&exec, t1, t2, gt, &opts).unwrap()];
            let (mut y, mut r, mut s) = (vec![f16::ZERO; len], vec![0f32; rows], vec![f16::ZERO; len]);
            add_rms_norm(&exec, t1, t2, gt, &opts, &mut y, Some(&mut r), Some(&mut s), &mut ws).unwrap();
            let mut inplace = x1.clone();
            let (mut yi, mut ri) = (vec![f16::ZERO; len], vec![0f32; rows]);
            add_rms_norm_in_place(&exec, TensorMut::new(&mut inplace, &dims).unwrap(), t2, gt, &opts,
                &mut yi, Some(&mut ri), &mut ws).unwrap();
            prop_assert_eq!(bits(&y), bits(&yi));
            prop_assert_eq!(bits(&r), bits(&ri));
            prop_assert_eq!(bits(&s), bits(&inplace));
            // RmsNormGrad: dx out of place, then over dy (x2 as dy, x1 as x).
            let rt = TensorRef::new(&r, &[rows]).unwrap();
            let dres = with_dres.then_some(t1);
            let gopts = RmsNormGradOptions::default();
            let inputs = RmsNormGradInputs { x: t1, rstd: rt, gamma: gt, dres };
            let mut ws = vec![0u8; rms_norm_grad_workspace_size(&exec, t2, &inputs, &gopts).unwrap()];
            let (mut dx, mut dg) = (vec![f16::ZERO; len], vec![0f32; n]);
            rms_norm_grad(&exec, t2, &inputs, &gopts, &mut dx, DgammaOut { dgamma: Some(&mut dg), dgamma_cast: None }, &mut ws).unwrap();
            let mut dy = x2.clone();
            let mut dgi = vec![0f32; n];
            rms_norm_grad_in_place(&exec, TensorMut::new(&mut dy, &dims).unwrap(), &inputs, &gopts, DgammaOut { dgamma: Some(&mut dgi), dgamma_cast: None }, &mut ws).unwrap();
            prop_assert_eq!(bits(&dx), bits(&dy));
            prop_assert_eq!(bits(&dg), bits(&dgi));
        }
    }

    #[test]
    fn padding_lanes_never_contribute(n in 1usize..70, at in 0usize..70, nan in any::<bool>(), seed in vals(140), gs in vals(70)) {
        // Row 0 holds a non-finite value (often in the last, partial group
        // of 16); row 1 is finite.
        let at = at % n;
        let mut x = seed[..2 * n].to_vec();
        x[at] = if nan { f32::NAN } else if at % 2 == 0 { f32::INFINITY } else { f32::NEG_INFINITY };
        let g = &gs[..n];
        let opts = RmsNormOptions::default();
        for cpu in cpus() {
            let exec = Exec::new(&cpu).with_ub(small_ub());
            let (y, r) = rms(&exec, &x, g, n, &opts);
            let (alone, ralone) = rms(&exec, &x[n..], g, n, &opts);
            prop_assert_eq!(bits(&y[n..]), bits(&alone));
            prop_assert_eq!(r[1].to_bits(), ralone[0].to_bits());
            if nan {
                prop_assert!(r[0].is_nan() && y[..n].iter().all(|v| v.is_nan()));
            } else {
                prop_assert_eq!(r[0], 0.0);
                for j in 0..n {
                    let want = if x[j].is_finite() { (x[j] * 0.0 * g[j]).to_bits() } else { f32::NAN.to_bits() };
                    prop_assert!(y[j].to_bits() == want || y[j].is_nan() && !x[j].is_finite(),
                        "y[{}] = {} for x {} (n {})", j, y[j], x[j], n);
                }
            }
        }
    }
}
