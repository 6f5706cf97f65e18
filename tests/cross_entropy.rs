//! CrossEntropy (forward, backward, fused) against the f64 golden model and
//! an independent std-f64 model with a finite-difference gradient check;
//! edge cases; bad input refused with nothing written; the same bits on
//! every ISA, thread count and block count.

#![allow(clippy::needless_range_loop)]

mod common;

use common::*;
use half::{bf16, f16};
use npukern::*;

const EPS: f64 = f32::EPSILON as f64;

/// The three outputs of one forward + one backward.
struct Out<T> {
    loss: Vec<f32>,
    lse: Vec<f32>,
    dx: Vec<T>,
}

struct Case<'a, T, I> {
    x: &'a [T],
    n: usize,
    c: usize,
    tgt: &'a [I],
    w: Option<&'a [f32]>,
    opts: CrossEntropyOptions,
    /// The upstream gradient (N for `None`, else 1).
    g: Vec<f32>,
}

impl<T: Float, I: Element> Case<'_, T, I> {
    fn targets(&self) -> CrossEntropyTargets<'_, I> {
        let t = CrossEntropyTargets::new(TensorRef::new(self.tgt, &[self.n]).unwrap());
        match self.w {
            Some(w) => t.with_weight(TensorRef::new(w, &[self.c]).unwrap()),
            None => t,
        }
    }

    fn logits(&self) -> TensorRef<'_, T> {
        TensorRef::new(self.x, &[self.n, self.c]).unwrap()
    }

    fn forward(&self, e: &Exec<'_>) -> Result<(Vec<f32>, Vec<f32>), Error> {
        let k = if self.opts.reduction == Reduction::None {
            self.n
        } else {
            1
        };
        let mut loss = vec![-7.0f32; k];
        let mut lse = vec![-7.0f32; self.n];
        let mut ws =
            vec![0u8; cross_entropy_workspace_size(e, self.logits(), self.targets(), &self.opts)?];
        cross_entropy(
            e,
            self.logits(),
            self.targets(),
            &self.opts,
            &mut loss,
            Some(&mut lse),
            &mut ws,
        )?;
        Ok((loss, lse))
    }

    fn backward(&self, e: &Exec<'_>, lse: &[f32]) -> Result<Vec<T>, Error> {
        let mut dx = vec![T::from_f64(-7.0); self.x.len()];
        let mut ws =
            vec![
                0u8;
                cross_entropy_grad_workspace_size(e, self.logits(), self.targets(), &self.opts)?
            ];
        cross_entropy_grad(
            e,
            self.logits(),
            self.targets(),
            lse,
            &self.g,
            &self.opts,
            &mut dx,
            &mut ws,
        )?;
        Ok(dx)
    }

    fn run(&self, e: &Exec<'_>) -> Out<T> {
        let (loss, lse) = self.forward(e).unwrap();
        let dx = self.backward(e, &lse).unwrap();
        Out { loss, lse, dx }
    }

    /// The fused form with the factor the backward would use, in place.
    fn fused(&self, e: &Exec<'_>, scale: &[f32]) -> Out<T> {
        self.fused_ws(e, scale, true)
    }

    /// The fused call with its workspace (the exp cache) or with none.
    fn fused_ws(&self, e: &Exec<'_>, scale: &[f32], cache: bool) -> Out<T> {
        let mut x = self.x.to_vec();
        let mut loss = vec![-7.0f32; self.n];
        let mut lse = vec![-7.0f32; self.n];
        let size = cross_entropy_fused_workspace_size(e, self.logits(), self.targets(), &self.opts);
        let mut ws = vec![0u8; if cache { size.unwrap() } else { 0 }];
        let xm = TensorMut::new(&mut x, &[self.n, self.c]).unwrap();
        cross_entropy_fused(
            e,
            xm,
            self.targets(),
            scale,
            &self.opts,
            &mut loss,
            Some(&mut lse),
            &mut ws,
        )
        .unwrap();
        Out { loss, lse, dx: x }
    }
}

fn to_i64<I: Element>(v: I) -> i64 {
    let b = bytemuck::bytes_of(&v);
    if b.len() == 4 {
        i32::from_ne_bytes(b.try_into().unwrap()) as i64
    } else {
        i64::from_ne_bytes(b.try_into().unwrap())
    }
}

/// std-f64 model, written as torch computes it (log_softmax, then nll and
/// the smoothing term): per-row loss (0 when ignored) and lse.
fn model_rows<T: Float, I: Element>(k: &Case<'_, T, I>, z: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (n, c, o) = (k.n, k.c, &k.opts);
    let cap = o.softcap as f64;
    let wc = |j: usize| k.w.map_or(1.0, |w| w[j] as f64);
    let mut loss = vec![0.0; n];
    let mut lse = vec![0.0; n];
    for r in 0..n {
        let x: Vec<f64> = (0..c)
            .map(|j| {
                let v = z[r * c + j];
                if cap > 0.0 {
                    cap * (v / cap).tanh()
                } else {
                    v
                }
            })
            .collect();
        let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let l = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        lse[r] = l;
        let t = to_i64(k.tgt[r]);
        if t == o.ignore_index {
            continue;
        }
        let logp: Vec<f64> = x.iter().map(|v| v - l).collect();
        let nll = -wc(t as usize) * logp[t as usize];
        let smooth: f64 = -(0..c).map(|j| wc(j) * logp[j]).sum::<f64>();
        let ls = o.label_smoothing as f64;
        loss[r] = (1.0 - ls) * nll + ls / c as f64 * smooth + o.lse_square_scale as f64 * l * l;
    }
    (loss, lse)
}

fn model_den<T: Float, I: Element>(k: &Case<'_, T, I>) -> f64 {
    (0..k.n)
        .filter(|&r| to_i64(k.tgt[r]) != k.opts.ignore_index)
        .map(|r| k.w.map_or(1.0, |w| w[to_i64(k.tgt[r]) as usize] as f64))
        .sum()
}

/// The scalar the backward differentiates: sum_i g_i loss_i.
fn model_objective<T: Float, I: Element>(k: &Case<'_, T, I>, z: &[f64]) -> f64 {
    let (rows, _) = model_rows(k, z);
    match k.opts.reduction {
        Reduction::None => rows.iter().zip(&k.g).map(|(l, g)| l * *g as f64).sum(),
        Reduction::Sum => rows.iter().sum::<f64>() * k.g[0] as f64,
        _ => rows.iter().sum::<f64>() / model_den(k) * k.g[0] as f64,
    }
}

/// |got - want| within `ulps` of T at want plus `rel` f32 epsilons of `scale`.
fn close<T: Float>(got: T, want: f64, ulps: f64, scale: f64, rel: f64) -> bool {
    let g = got.to_f64();
    if g.is_nan() || want.is_nan() {
        return g.is_nan() && want.is_nan();
    }
    if g.is_infinite() || want.is_infinite() {
        return g == want;
    }
    (g - want).abs() <= ulps * ulp_at::<T>(want) + rel * EPS * scale
}

/// Checks the CPU against the f64 reference backend: lse within 8 f32
/// epsilons of max(|lse|, 1); each loss within 16 epsilons of the
/// magnitude of its terms; dlogits within 1 ulp of T (4 for f32) plus 16
/// f32 epsilons of the magnitude of their terms.
fn check_against_reference<T: Float, I: Element>(k: &Case<'_, T, I>, what: &str) {
    let cpu = k.run(&Exec::cpu());
    let rf = k.run(&Exec::reference());
    let (n, c, o) = (k.n, k.c, &k.opts);
    let wc = |j: usize| k.w.map_or(1.0, |w| w[j] as f64).abs();
    let w_sum: f64 = (0..c).map(wc).sum();
    let ls = o.label_smoothing as f64;
    let mut scales = vec![0.0; n];
    for r in 0..n {
        let want = rf.lse[r] as f64;
        assert!(
            close::<f32>(cpu.lse[r], want, 0.0, want.abs().max(1.0), 8.0),
            "{what}: lse[{r}] {} vs {want}",
            cpu.lse[r]
        );
        let t = to_i64(k.tgt[r]);
        if t == o.ignore_index {
            continue;
        }
        let xt = k.x[r * c + t as usize].to_f64().abs();
        let maxx = (0..c)
            .map(|j| k.x[r * c + j].to_f64().abs())
            .fold(0.0, f64::max);
        scales[r] = wc(t as usize) * (want.abs() + xt)
            + ls * w_sum * (want.abs() + maxx) / c as f64
            + (o.lse_square_scale as f64 * want * want).abs();
    }
    if o.reduction == Reduction::None {
        for r in 0..n {
            assert!(
                close::<f32>(cpu.loss[r], rf.loss[r] as f64, 1.0, scales[r], 16.0),
                "{what}: loss[{r}] {} vs {}",
                cpu.loss[r],
                rf.loss[r]
            );
        }
    } else {
        let mut s: f64 = scales.iter().sum();
        if o.reduction == Reduction::Mean {
            s /= model_den(k).abs();
        }
        assert!(
            close::<f32>(cpu.loss[0], rf.loss[0] as f64, 1.0, s, 32.0),
            "{what}: loss {} vs {}",
            cpu.loss[0],
            rf.loss[0]
        );
    }
    let ulps = if T::DTYPE == DType::F32 { 4.0 } else { 1.0 };
    let gmax = k.g.iter().map(|v| v.abs() as f64).fold(0.0, f64::max);
    let gs = if o.reduction == Reduction::Mean {
        gmax / model_den(k).abs()
    } else {
        gmax
    };
    for r in 0..n {
        let t = to_i64(k.tgt[r]);
        let a = wc(t.max(0) as usize)
            + ls * w_sum / c as f64
            + 2.0 * (o.lse_square_scale as f64 * rf.lse[r] as f64).abs();
        for j in 0..c {
            let i = r * c + j;
            let want = rf.dx[i].to_f64();
            // The reference rounded once to T: compare with its f64 value
            // through T's grid (1 ulp of T at want).
            let scale = gs * (a + ls * wc(j) / c as f64 + wc(t.max(0) as usize));
            assert!(
                close::<T>(cpu.dx[i], want, ulps, scale, 16.0),
                "{what}: dlogits[{r}, {j}] {} vs {want} (x {})",
                cpu.dx[i].to_f64(),
                k.x[i].to_f64()
            );
        }
    }
}

fn logits<T: Float>(rng: &mut Rng, n: usize, spread: f64) -> Vec<T> {
    vec_of(n, || {
        if rng.below(7) == 0 {
            rng.mag().clamp(-spread * 4.0, spread * 4.0)
        } else {
            rng.uniform(-spread, spread)
        }
    })
}

fn targets<I: Element + TryFrom<i64>>(
    rng: &mut Rng,
    n: usize,
    c: usize,
    ignore_every: u64,
) -> Vec<I>
where
    <I as TryFrom<i64>>::Error: core::fmt::Debug,
{
    (0..n)
        .map(|_| {
            let t = if ignore_every > 0 && rng.below(ignore_every) == 0 {
                -100
            } else {
                rng.below(c as u64) as i64
            };
            I::try_from(t).unwrap()
        })
        .collect()
}

fn grad_for(rng: &mut Rng, n: usize, r: Reduction) -> Vec<f32> {
    let k = if r == Reduction::None { n } else { 1 };
    (0..k).map(|_| rng.uniform(0.25, 2.0) as f32).collect()
}

fn options(red: Reduction, ls: f32, zs: f32, cap: f32) -> CrossEntropyOptions {
    CrossEntropyOptions {
        reduction: red,
        label_smoothing: ls,
        lse_square_scale: zs,
        softcap: cap,
        ..Default::default()
    }
}

const REDUCTIONS: [Reduction; 3] = [Reduction::None, Reduction::Sum, Reduction::Mean];

fn sweep<T: Float, I: Element + TryFrom<i64>>(seed: u64)
where
    <I as TryFrom<i64>>::Error: core::fmt::Debug,
{
    let mut rng = Rng(seed);
    let shapes = [(1, 1), (1, 7), (3, 33), (5, 100), (4, 1000), (3, 4099)];
    for (si, &(n, c)) in shapes.iter().enumerate() {
        let x: Vec<T> = logits(&mut rng, n * c, 6.0);
        let tgt: Vec<I> = targets(&mut rng, n, c, 4);
        let w: Vec<f32> = (0..c).map(|_| rng.uniform(0.1, 3.0) as f32).collect();
        for (vi, (ls, zs, cap, weighted)) in [
            (0.0, 0.0, 0.0, false),
            (0.1, 0.0, 0.0, true),
            (0.0, 1e-3, 0.0, false),
            (0.0, 0.0, 5.0, true),
            (0.2, 1e-4, 3.0, true),
        ]
        .into_iter()
        .enumerate()
        {
            let red = REDUCTIONS[(si + vi) % 3];
            let k = Case {
                x: &x,
                n,
                c,
                tgt: &tgt,
                w: weighted.then_some(&w[..]),
                opts: options(red, ls, zs, cap),
                g: grad_for(&mut rng, n, red),
            };
            check_against_reference(&k, &format!("{:?} {n}x{c} variant {vi} {red:?}", T::DTYPE));
        }
    }
}

#[test]
fn matches_the_f64_reference_every_dtype_and_option() {
    sweep::<f32, i64>(1);
    sweep::<bf16, i64>(2);
    sweep::<f16, i32>(3);
    sweep::<bf16, i32>(4);
}

/// Rows longer than a UB tile (a Llama 3 vocabulary among them).
#[test]
fn long_rows() {
    let mut rng = Rng(5);
    for (n, c) in [(2, 50_000), (1, 128_256)] {
        let x: Vec<bf16> = logits(&mut rng, n * c, 10.0);
        let tgt: Vec<i64> = targets(&mut rng, n, c, 0);
        let w: Vec<f32> = (0..c).map(|_| rng.uniform(0.5, 2.0) as f32).collect();
        for (ls, weighted) in [(0.0, false), (0.1, true)] {
            let k = Case {
                x: &x,
                n,
                c,
                tgt: &tgt,
                w: weighted.then_some(&w[..]),
                opts: options(Reduction::Mean, ls, 1e-4, 0.0),
                g: vec![1.0],
            };
            check_against_reference(&k, &format!("{n}x{c} ls {ls}"));
            // lse within a few f32 ulp of the std-f64 model.
            let z: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
            let (_, lse) = model_rows(&k, &z);
            let got = k.forward(&Exec::cpu()).unwrap().1;
            for r in 0..n {
                let e = (got[r] as f64 - lse[r]).abs() / ulp_at::<f32>(lse[r]);
                assert!(
                    e <= 4.0,
                    "{n}x{c}: lse[{r}] {} vs {} ({e} ulp)",
                    got[r],
                    lse[r]
                );
            }
        }
    }
}

/// The golden model itself: its loss against torch's formulation in std
/// f64, its gradient against central differences of that loss.
#[test]
fn reference_matches_an_independent_model_and_finite_differences() {
    let mut rng = Rng(6);
    let (n, c) = (4, 9);
    let x: Vec<f32> = logits(&mut rng, n * c, 3.0);
    let tgt: Vec<i64> = vec![3, -100, 0, 8];
    let w: Vec<f32> = (0..c).map(|_| rng.uniform(0.2, 2.0) as f32).collect();
    for (red, ls, zs, cap, weighted) in [
        (Reduction::None, 0.0, 0.0, 0.0, false),
        (Reduction::Sum, 0.1, 0.0, 0.0, true),
        (Reduction::Mean, 0.3, 1e-2, 0.0, true),
        (Reduction::Mean, 0.0, 0.0, 2.0, false),
        (Reduction::None, 0.2, 1e-3, 1.5, true),
    ] {
        let k = Case {
            x: &x,
            n,
            c,
            tgt: &tgt,
            w: weighted.then_some(&w[..]),
            opts: options(red, ls, zs, cap),
            g: grad_for(&mut rng, n, red),
        };
        let rf = k.run(&Exec::reference());
        let z: Vec<f64> = x.iter().map(|v| *v as f64).collect();
        let (rows, lse) = model_rows(&k, &z);
        for r in 0..n {
            assert!(rel(rf.lse[r] as f64, lse[r]) < 1e-7, "lse {r}");
        }
        let want = match red {
            Reduction::None => rows.clone(),
            Reduction::Sum => vec![rows.iter().sum()],
            _ => vec![rows.iter().sum::<f64>() / model_den(&k)],
        };
        for (g, w) in rf.loss.iter().zip(&want) {
            assert!(
                (*g as f64 - w).abs() <= 1e-7 * w.abs().max(1e-3),
                "{red:?}: {g} vs {w}"
            );
        }
        for i in 0..n * c {
            let h = 1e-6;
            let (mut zp, mut zm) = (z.clone(), z.clone());
            zp[i] += h;
            zm[i] -= h;
            let fd = (model_objective(&k, &zp) - model_objective(&k, &zm)) / (2.0 * h);
            let got = rf.dx[i] as f64;
            // The backward recomputes the row's sum in f64 here (the golden
            // model): what is left is the f32 rounding of each output.
            assert!(
                (got - fd).abs() <= 1e-6 * fd.abs() + 5e-7,
                "{red:?} ls {ls} zs {zs} cap {cap}: d[{i}] {got} vs {fd}"
            );
        }
    }
}

/// Special values: huge and tiny magnitudes, -Inf (masked) columns, NaN
/// and +Inf rows (NaN loss and gradient, like torch), ignored rows.
#[test]
fn special_values() {
    let c = 37;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let mut rng = Rng(7);
    let base =
        |rng: &mut Rng| -> Vec<f32> { (0..c).map(|_| rng.uniform(-3.0, 3.0) as f32).collect() };
    let mut r = base(&mut rng);
    r[5] = 1e4;
    r[6] = -1e4;
    rows.push(r);
    rows.push(
        (0..c)
            .map(|j| if j % 2 == 0 { 88.0 } else { -88.0 })
            .collect(),
    );
    rows.push(
        (0..c)
            .map(|j| f32::from_bits(j as u32 * 1000 + 1))
            .collect(),
    ); // subnormals
    let mut r = base(&mut rng);
    for v in r.iter_mut().skip(20) {
        *v = f32::NEG_INFINITY; // masked padding classes
    }
    rows.push(r);
    let mut r = base(&mut rng);
    r[9] = f32::NAN;
    rows.push(r);
    let mut r = base(&mut rng);
    r[3] = f32::INFINITY;
    rows.push(r);
    let mut r = base(&mut rng);
    r[11] = f32::NAN;
    rows.push(r); // ignored below: loss 0, gradient 0
    let x: Vec<f32> = rows.concat();
    let n = rows.len();
    let tgt: Vec<i64> = vec![5, 0, 3, 2, 1, 4, -100];
    for red in REDUCTIONS {
        let k = Case {
            x: &x,
            n,
            c,
            tgt: &tgt,
            w: None,
            opts: options(red, 0.0, 0.0, 0.0),
            g: grad_for(&mut Rng(8), n, red),
        };
        let o = k.run(&Exec::cpu());
        let rf = k.run(&Exec::reference());
        if red == Reduction::None {
            // 1e4 - ...: loss 0 exactly (p = 1).
            assert_eq!(o.loss[0], 0.0);
            assert!(o.loss[4].is_nan() && o.loss[5].is_nan(), "{:?}", o.loss);
            assert_eq!(o.loss[6], 0.0);
            for r in [0, 1, 2, 3] {
                assert!(
                    rel(o.loss[r] as f64, rf.loss[r] as f64) < 1e-5,
                    "row {r}: {} vs {}",
                    o.loss[r],
                    rf.loss[r]
                );
            }
        } else {
            assert!(o.loss[0].is_nan());
        }
        assert!(o.lse[4].is_nan() && o.lse[5].is_nan() && o.lse[6].is_nan());
        assert!((o.lse[0] - 1e4).abs() <= 0.0, "{}", o.lse[0]);
        assert!(o.dx[4 * c..6 * c].iter().all(|v| v.is_nan()));
        assert!(o.dx[6 * c..].iter().all(|v| *v == 0.0));
        for i in 0..4 * c {
            assert!(
                close::<f32>(o.dx[i], rf.dx[i] as f64, 4.0, 4.0, 16.0),
                "{red:?} d[{i}] {} vs {}",
                o.dx[i],
                rf.dx[i]
            );
        }
        // Masked classes get exactly 0.
        assert!(o.dx[3 * c + 20..4 * c].iter().all(|v| *v == 0.0));
    }
}

#[test]
fn empty_and_all_ignored() {
    for (n, tgt) in [(0usize, vec![]), (3, vec![-100i64, -100, -100])] {
        let c = 5;
        let x = vec![0.5f32; n * c];
        for red in [Reduction::Sum, Reduction::Mean] {
            let k = Case {
                x: &x,
                n,
                c,
                tgt: &tgt,
                w: None,
                opts: options(red, 0.1, 1e-3, 0.0),
                g: vec![1.0],
            };
            for e in [Exec::cpu(), Exec::reference()] {
                let (loss, _) = k.forward(&e).unwrap();
                if red == Reduction::Sum {
                    assert_eq!(loss[0], 0.0);
                } else {
                    assert!(loss[0].is_nan(), "mean of nothing is 0/0");
                }
                if n > 0 && red == Reduction::Sum {
                    assert!(k.backward(&e, &[1.0; 3]).unwrap().iter().all(|v| *v == 0.0));
                }
            }
        }
    }
}

/// C = 1: lse = x, loss 0, gradient 0 (without smoothing or z-loss).
#[test]
fn one_class() {
    let x = vec![3.5f32, -2.0];
    let k = Case {
        x: &x,
        n: 2,
        c: 1,
        tgt: &[0i32, 0],
        w: None,
        opts: options(Reduction::None, 0.0, 0.0, 0.0),
        g: vec![1.0, 2.0],
    };
    let o = k.run(&Exec::cpu());
    assert_eq!(o.lse, x);
    assert_eq!(o.loss, vec![0.0, 0.0]);
    assert_eq!(o.dx, vec![0.0, 0.0]);
}

/// Out-of-range targets: `IndexOutOfRange` naming the row and value, and
/// no output written (the in-place logits included).
#[test]
fn bad_targets_are_refused_and_nothing_is_written() {
    let (n, c) = (4, 10);
    let x: Vec<bf16> = logits(&mut Rng(9), n * c, 2.0);
    for (bad, row) in [(10i64, 2usize), (-1, 1), (-101, 3), (i64::MIN, 0)] {
        let mut tgt = vec![1i64, 2, 3, 4];
        tgt[row] = bad;
        let k = Case {
            x: &x,
            n,
            c,
            tgt: &tgt,
            w: None,
            opts: options(Reduction::None, 0.0, 0.0, 0.0),
            g: vec![1.0; n],
        };
        let want = Error::IndexOutOfRange {
            arg: "target",
            position: row as u64,
            value: bad,
            start: 0,
            end: c as i64,
        };
        let mut loss = vec![-7.0f32; n];
        let mut lse = vec![-7.0f32; n];
        let e = Exec::cpu();
        let r = cross_entropy(
            &e,
            k.logits(),
            k.targets(),
            &k.opts,
            &mut loss,
            Some(&mut lse),
            &mut [],
        );
        assert_eq!(r, Err(want));
        assert!(loss.iter().chain(&lse).all(|v| *v == -7.0));
        let mut dx = vec![bf16::from_f32(-7.0); n * c];
        let r = cross_entropy_grad(
            &e,
            k.logits(),
            k.targets(),
            &[1.0; 4],
            &k.g,
            &k.opts,
            &mut dx,
            &mut [],
        );
        assert_eq!(r, Err(want));
        assert!(dx.iter().all(|v| v.to_f32() == -7.0));
        let mut xi = x.clone();
        let r = cross_entropy_fused(
            &e,
            TensorMut::new(&mut xi, &[n, c]).unwrap(),
            k.targets(),
            &[1.0],
            &k.opts,
            &mut loss,
            None,
            &mut [],
        );
        assert_eq!(r, Err(want));
        assert_eq!(bits(&xi), bits(&x));
        let msg = format!("{}", r.unwrap_err());
        assert!(msg.contains(&format!("target[{row}] = {bad}")), "{msg}");
        // The valid range, so a caller sees what was expected.
        assert!(msg.contains(&format!("<= target < {c}")), "{msg}");
    }
    // ignore_index may be any value, a valid class included.
    let k = Case {
        x: &x,
        n,
        c,
        tgt: &[7i64, -5, 7, 0],
        w: None,
        opts: CrossEntropyOptions {
            ignore_index: -5,
            reduction: Reduction::None,
            ..Default::default()
        },
        g: vec![1.0; n],
    };
    assert_eq!(k.forward(&Exec::cpu()).unwrap().0[1], 0.0);
}

#[test]
fn bad_shapes_and_options_are_refused() {
    let x = vec![0f32; 12];
    let tgt = vec![0i64; 3];
    let e = Exec::cpu();
    let t = CrossEntropyTargets::new(TensorRef::new(&tgt, &[3]).unwrap());
    let xr = TensorRef::new(&x, &[3, 4]).unwrap();
    let mut loss = vec![0f32; 3];
    for (o, arg) in [
        (options(Reduction::None, 1.5, 0.0, 0.0), "label_smoothing"),
        (
            options(Reduction::None, f32::NAN, 0.0, 0.0),
            "label_smoothing",
        ),
        (
            options(Reduction::None, 0.0, f32::INFINITY, 0.0),
            "lse_square_scale",
        ),
        (options(Reduction::None, 0.0, 0.0, -1.0), "softcap"),
        (
            options(Reduction::None, 0.0, -1e-4, 0.0),
            "lse_square_scale",
        ),
    ] {
        let r = cross_entropy(&e, xr, t, &o, &mut loss, None, &mut []);
        assert_eq!(r.unwrap_err().argument(), arg);
    }
    let o = options(Reduction::Mean, 0.0, 0.0, 0.0);
    let r = cross_entropy(&e, xr, t, &o, &mut loss, None, &mut []);
    assert_eq!(r.unwrap_err().argument(), "loss"); // 3 elements for a mean
    let x1 = TensorRef::new(&x, &[12]).unwrap();
    let r = cross_entropy(&e, x1, t, &o, &mut loss[..1], None, &mut []);
    assert_eq!(r.unwrap_err().argument(), "logits");
    let w = vec![1f32; 3];
    let tw = t.with_weight(TensorRef::new(&w, &[3]).unwrap());
    let r = cross_entropy(&e, xr, tw, &o, &mut loss[..1], None, &mut []);
    assert_eq!(r.unwrap_err().argument(), "weight");
    // The workspace of a mean is N f32 (plus alignment slack).
    let ws = cross_entropy_workspace_size(&e, xr, t, &o).unwrap();
    assert_eq!(ws, 3 * 4 + 64);
    let r = cross_entropy(&e, xr, t, &o, &mut loss[..1], None, &mut vec![0u8; ws - 1]);
    assert!(matches!(r, Err(Error::WorkspaceTooSmall { .. })));
}

/// In place, out of place and fused give the same bits; the fused loss is
/// the forward's per-row loss.
#[test]
fn in_place_and_fused_match() {
    let mut rng = Rng(10);
    let (n, c) = (6, 333);
    let x: Vec<bf16> = logits(&mut rng, n * c, 5.0);
    let tgt: Vec<i64> = targets(&mut rng, n, c, 3);
    let w: Vec<f32> = (0..c).map(|_| rng.uniform(0.5, 2.0) as f32).collect();
    for (red, scale) in [(Reduction::None, None), (Reduction::Sum, Some(1.5f32))] {
        let k = Case {
            x: &x,
            n,
            c,
            tgt: &tgt,
            w: Some(&w),
            opts: options(red, 0.1, 1e-4, 30.0),
            g: match scale {
                Some(s) => vec![s],
                None => grad_for(&mut rng, n, red),
            },
        };
        let e = Exec::cpu();
        let o = k.run(&e);
        let mut xi = x.clone();
        let mut ws = vec![0u8; 0];
        cross_entropy_grad_in_place(
            &e,
            TensorMut::new(&mut xi, &[n, c]).unwrap(),
            k.targets(),
            &o.lse,
            &k.g,
            &k.opts,
            &mut ws,
        )
        .unwrap();
        assert_eq!(bits(&xi), bits(&o.dx));
        let f = k.fused(&e, &k.g);
        assert_eq!(bits(&f.dx), bits(&o.dx));
        assert_eq!(f.lse, o.lse);
        // Without its workspace (the exp cache) the fused call recomputes
        // the exps: the same bits.
        let f0 = k.fused_ws(&e, &k.g, false);
        assert_eq!(
            (bits(&f0.dx), &f0.lse, &f0.loss),
            (bits(&f.dx), &f.lse, &f.loss)
        );
        let plain = Case {
            opts: options(red, 0.0, 0.0, 0.0),
            g: k.g.clone(),
            ..k
        };
        let (fc, fr) = (
            plain.fused_ws(&e, &plain.g, true),
            plain.fused_ws(&e, &plain.g, false),
        );
        assert_eq!((bits(&fc.dx), &fc.lse), (bits(&fr.dx), &fr.lse));
        assert_eq!(bits(&fc.dx), bits(&plain.run(&e).dx));
        let none = Case {
            opts: options(Reduction::None, 0.1, 1e-4, 30.0),
            g: vec![0.0; n],
            ..k
        };
        assert_eq!(f.loss, none.forward(&e).unwrap().0);
    }
}

/// The same bits on every ISA, thread count and block count.
#[test]
fn bits_are_the_same_everywhere() {
    let mut rng = Rng(11);
    let (n, c) = (29, 4133);
    let x: Vec<bf16> = logits(&mut rng, n * c, 8.0);
    let xf: Vec<f32> = logits(&mut rng, n * c, 8.0);
    let tgt: Vec<i32> = targets(&mut rng, n, c, 5);
    let w: Vec<f32> = (0..c).map(|_| rng.uniform(0.5, 2.0) as f32).collect();
    let run = |e: &Exec<'_>| {
        let a = Case {
            x: &x,
            n,
            c,
            tgt: &tgt,
            w: Some(&w),
            opts: options(Reduction::Mean, 0.1, 1e-4, 30.0),
            g: vec![0.75],
        };
        let b = Case {
            x: &xf,
            n,
            c,
            tgt: &tgt,
            w: None,
            opts: options(Reduction::None, 0.0, 0.0, 0.0),
            g: (0..n).map(|i| i as f32 * 0.1).collect(),
        };
        let (oa, ob) = (a.run(e), b.run(e));
        let fa = a.fused(e, &[0.25]);
        (
            oa.loss,
            oa.lse,
            bits(&oa.dx),
            ob.loss,
            ob.lse,
            bits(&ob.dx),
            fa.loss,
            bits(&fa.dx),
        )
    };
    let base = run(&Exec::new(&CPU_SERIAL));
    let mut seen = 0;
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        seen += 1;
        for threads in [1, 2, 3] {
            for ub in [
                UbConfig::default(),
                UbConfig {
                    ub_bytes: 1024,
                    blocks: 7,
                },
            ] {
                let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
                let got = run(&Exec::new(&cpu).with_ub(ub));
                let same = |a: &[f32], b: &[f32]| {
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()) && a.len() == b.len()
                };
                assert!(
                    same(&got.0, &base.0) && same(&got.1, &base.1),
                    "{isa:?} {threads}"
                );
                assert!(
                    got.2 == base.2 && got.5 == base.5 && got.7 == base.7,
                    "{isa:?} {threads}"
                );
                assert!(same(&got.3, &base.3) && same(&got.4, &base.4) && same(&got.6, &base.6));
            }
        }
    }
    assert!(seen >= 1);
}

/// Rows whose logits all sit far from 0 (a fully masked row filled with a
/// finite -1e30 among them): the loss comes from `m - x_t` and `log s`, not
/// from an `lse` rounded at the scale of the logits (which kept nothing of
/// `log s`: all logits -1e10 gave a loss of 0). Within 8 f32 epsilons of
/// max(loss, 1) of the f64 model of the same f32 inputs, at every offset.
#[test]
fn far_from_zero_logits() {
    let c = 37;
    let mut rng = Rng(11);
    for offset in [1e3f64, 1e5, -1e5, 1e10, -1e10, -1e30, 3e38] {
        let n = 4;
        let mut x: Vec<f32> = (0..n * c)
            .map(|_| (offset + rng.uniform(-4.0, 4.0)) as f32)
            .collect();
        x[c..2 * c].fill(offset as f32); // a row of one value: loss ln C
        let tgt: Vec<i64> = targets(&mut rng, n, c, 0);
        let k = Case {
            x: &x,
            n,
            c,
            tgt: &tgt,
            w: None,
            opts: options(Reduction::None, 0.0, 0.0, 0.0),
            g: grad_for(&mut Rng(12), n, Reduction::None),
        };
        let (loss, _) = k.forward(&Exec::cpu()).unwrap();
        // torch's formulation in f64: -log_softmax = (m - x_t) + ln sum exp(x - m)
        // (the golden model's `x - lse` keeps nothing of ln s at 1e30 in f64 either).
        let want: Vec<f64> = (0..n)
            .map(|r| {
                let row: Vec<f64> = x[r * c..(r + 1) * c].iter().map(|v| *v as f64).collect();
                let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let ln_s = row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                (m - row[tgt[r] as usize]) + ln_s
            })
            .collect();
        for r in 0..n {
            assert!(
                (loss[r] as f64 - want[r]).abs() <= 8.0 * EPS * want[r].abs().max(1.0),
                "offset {offset}: loss[{r}] {} vs {}",
                loss[r],
                want[r]
            );
        }
        assert!(((loss[1] as f64) - (c as f64).ln()).abs() <= 4.0 * EPS);
    }
}

/// The gradient where the row's max is huge: the backward recomputes the
/// row's sum, so p stays normalized (8 equal logits at 1e6 gave 0.1271 and
/// at 1e7 8% off when it trusted an f32 lse). Forward then backward and the
/// fused form, every dtype that can hold the values.
#[test]
fn gradient_at_a_large_row_max() {
    for &m in &[1e6f32, 1e7, -1e7, 3e8, -1e10, 1e30] {
        let (n, c) = (2, 8);
        // Row 0: 8 equal logits; row 1: one logit 1 above 7 equal ones.
        let mut x = vec![m; n * c];
        x[c + 3] = m + ulp_f32(m).max(1.0);
        let tgt = [2i64, 3];
        let k = Case {
            x: &x,
            n,
            c,
            tgt: &tgt,
            w: None,
            opts: options(Reduction::Sum, 0.0, 0.0, 0.0),
            g: vec![1.0],
        };
        for o in [k.run(&Exec::cpu()), k.fused(&Exec::cpu(), &[1.0])] {
            for j in 0..c {
                let want = if j == 2 { 0.125 - 1.0 } else { 0.125 };
                assert!(
                    (o.dx[j] as f64 - want).abs() <= 2.0 * EPS,
                    "m {m}: dx[0][{j}] = {} vs {want}",
                    o.dx[j]
                );
            }
            // Row 1 against f64 softmax of the same (exactly representable) logits.
            let top = x[c + 3] as f64;
            let z: Vec<f64> = x[c..].iter().map(|&v| v as f64 - top).collect();
            let s: f64 = z.iter().map(|v| v.exp()).sum();
            for j in 0..c {
                let want = z[j].exp() / s - if j == 3 { 1.0 } else { 0.0 };
                assert!(
                    (o.dx[c + j] as f64 - want).abs() <= 4.0 * EPS,
                    "m {m}: dx[1][{j}] = {} vs {want}",
                    o.dx[c + j]
                );
            }
        }
    }
}

fn ulp_f32(v: f32) -> f32 {
    f32::from_bits(v.abs().to_bits() + 1) - v.abs()
}

/// Label smoothing on rows of one large repeated value: `sum_c (m - x_c)`
/// has no Inf - Inf (a row of 3e38 gave NaN; torch 2.0794 = ln 8), and no
/// cancellation far from 0.
#[test]
fn label_smoothing_at_huge_logits() {
    for &v in &[3e38f32, -3e38, 1e30, 1e7, -1e10, 0.5] {
        let x = vec![v; 8];
        let k = Case {
            x: &x,
            n: 1,
            c: 8,
            tgt: &[2i64],
            w: None,
            opts: options(Reduction::Mean, 0.1, 0.0, 0.0),
            g: vec![1.0],
        };
        for o in [k.run(&Exec::cpu()), k.fused(&Exec::cpu(), &[1.0])] {
            let want = 8f64.ln();
            assert!(
                (o.loss[0] as f64 - want).abs() <= 4.0 * EPS * want,
                "{v}: loss {} vs {want}",
                o.loss[0]
            );
            for j in 0..8 {
                let want = 0.125 - 0.1 / 8.0 - if j == 2 { 0.9 } else { 0.0 };
                assert!(
                    (o.dx[j] as f64 - want).abs() <= 4.0 * EPS,
                    "{v}: dx[{j}] = {} vs {want}",
                    o.dx[j]
                );
            }
        }
    }
    // Weighted, spread around a huge offset: against the f64 model.
    let mut rng = Rng(31);
    let c = 37;
    let off = 1e6f64;
    let x: Vec<f32> = (0..c)
        .map(|_| (off + rng.uniform(-8.0, 8.0)) as f32)
        .collect();
    let w: Vec<f32> = (0..c).map(|_| rng.uniform(0.5, 1.5) as f32).collect();
    let k = Case {
        x: &x,
        n: 1,
        c,
        tgt: &[5i64],
        w: Some(&w),
        opts: options(Reduction::None, 0.2, 0.0, 0.0),
        g: vec![1.0],
    };
    let z: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let (want, _) = model_rows(&k, &z);
    let got = k.run(&Exec::cpu()).loss[0] as f64;
    assert!(
        (got - want[0]).abs() <= 16.0 * EPS * want[0].abs().max(1.0),
        "{got} vs {}",
        want[0]
    );
}

/// z-loss on a single class: the gradient is `2 z lse` exactly formed
/// (`(p - 1) a_t + p extra`, p = 1), not `p (1 + 2 z lse) - 1`'s
/// cancellation (1e-4 off in relative terms).
#[test]
fn z_loss_on_one_class() {
    let x = vec![3.5f32, -2.0, 40.0];
    let zs = 1e-4f32;
    let k = Case {
        x: &x,
        n: 3,
        c: 1,
        tgt: &[0i32, 0, 0],
        w: None,
        opts: options(Reduction::None, 0.0, zs, 0.0),
        g: vec![1.0, 2.0, 0.5],
    };
    for o in [k.run(&Exec::cpu()), k.fused(&Exec::cpu(), &k.g)] {
        for r in 0..3 {
            let want = k.g[r] as f64 * 2.0 * zs as f64 * x[r] as f64;
            assert!(
                (o.dx[r] as f64 - want).abs() <= 2.0 * EPS * want.abs(),
                "row {r}: {} vs {want}",
                o.dx[r]
            );
        }
    }
}

/// `cross_entropy_reduce` and `cross_entropy_grad_scale` are the forward's
/// reduction and the backward's factor bit for bit (one definition), for
/// rows split over several fused calls; bad arguments are refused.
#[test]
fn reduce_and_grad_scale_are_the_ops_own() {
    let mut rng = Rng(77);
    let (n, c) = (37, 50);
    let x: Vec<bf16> = logits(&mut rng, n * c, 3.0);
    let tgt: Vec<i64> = targets(&mut rng, n, c, 5);
    let w: Vec<f32> = (0..c).map(|_| rng.uniform(0.25, 1.25) as f32).collect();
    for weight in [None, Some(&w[..])] {
        for red in [Reduction::Sum, Reduction::Mean] {
            let k = Case {
                x: &x,
                n,
                c,
                tgt: &tgt,
                w: weight,
                opts: options(red, 0.1, 1e-3, 0.0),
                g: vec![0.75],
            };
            let e = Exec::cpu();
            let reduced = k.forward(&e).unwrap().0[0];
            let rows = Case {
                opts: options(Reduction::None, 0.1, 1e-3, 0.0),
                g: vec![1.0; n],
                ..k
            }
            .forward(&e)
            .unwrap()
            .0;
            let got = cross_entropy_reduce(&rows, k.targets(), &k.opts).unwrap();
            assert_eq!(got.to_bits(), reduced.to_bits(), "{red:?}");
            // The backward's bits from the fused form with the factor.
            let scale = cross_entropy_grad_scale(k.targets(), 0.75, &k.opts).unwrap();
            let back = k.run(&e).dx;
            let fused = k.fused(&e, &[scale]).dx;
            assert_eq!(bits(&back), bits(&fused), "{red:?}");
        }
    }
    let t = CrossEntropyTargets::new(TensorRef::new(&tgt, &[n]).unwrap());
    let rows = vec![1f32; n];
    let none = options(Reduction::None, 0.0, 0.0, 0.0);
    assert_eq!(
        cross_entropy_reduce(&rows, t, &none)
            .unwrap_err()
            .argument(),
        "reduction"
    );
    let mean = options(Reduction::Mean, 0.0, 0.0, 0.0);
    assert_eq!(
        cross_entropy_reduce(&rows[1..], t, &mean)
            .unwrap_err()
            .argument(),
        "target"
    );
    let short = vec![1f32; 3];
    let tw = t.with_weight(TensorRef::new(&short, &[3]).unwrap());
    assert_eq!(
        cross_entropy_grad_scale(tw, 1.0, &mean)
            .unwrap_err()
            .argument(),
        "target"
    );
    // Every row ignored: a sum of 0, a mean of NaN, as torch.
    let ign = vec![-100i64; 4];
    let ti = CrossEntropyTargets::new(TensorRef::new(&ign, &[4]).unwrap());
    let zeros = [0f32; 4]; // the ignored rows' losses
    assert_eq!(
        cross_entropy_reduce(&zeros, ti, &options(Reduction::Sum, 0.0, 0.0, 0.0)).unwrap(),
        0.0
    );
    assert!(cross_entropy_reduce(&zeros, ti, &mean).unwrap().is_nan());
}
