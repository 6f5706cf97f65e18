//! RmsNorm, AddRmsNorm (out of place and in place) and RmsNormGrad (out of
//! place and in place), differentially: ranks 1-8, gamma over any number of
//! trailing dims, every dtype pairing (x f32/f16/bf16, gamma x's dtype or
//! f32), every option, values including NaN, ±Inf, subnormals, ±65504 and
//! 0-length rows, tilings from the smallest UB to huge.
//!
//! Checked:
//! - every CPU run (each available ISA, serial; the thread runner; another
//!   tiling) fails exactly when the Reference fails, with the same error,
//!   and then leaves every output untouched;
//! - y, rstd, x_sum, dx are bit-identical across ISAs, runners and tilings;
//!   dgamma across ISAs and runners for one tiling (NaN payloads aside);
//! - on inputs of ordinary magnitude, results are within the documented
//!   tolerances of the f64 Reference (tests/norm_accuracy.rs): y 1 ulp (2
//!   under CastBeforeGamma; f32 2e-6 relative), x_sum exact, rstd 1e-6
//!   relative, dx 1 ulp + 1e-5 of the row's gradient scale, dgamma 1e-5 of
//!   sum_m |dy x rstd| (+ 1 f32 ulp when accumulating).
//!
//! Run: `cargo +nightly fuzz run norms`, or the stable recipe in
//! `scripts/fuzz_smoke.sh`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npukern::*;
use npukern_fuzz::{
    assert_same, capped, dims, isas, same_outcome, some_values, ulp_at, ulps, workspace, Bytes,
};

/// Most elements of x.
const CAP: usize = 1024;

/// Every output of one call (absent ones empty).
#[derive(Clone, Debug)]
struct Out<T, G> {
    a: Vec<T>,      // y or dx
    rstd: Vec<f32>, // rstd (forward)
    x_sum: Vec<T>,  // x_sum (AddRmsNorm)
    dg: Vec<f32>,   // dgamma
    dgc: Vec<G>,    // dgamma_cast
}

/// The case: everything but the exec.
struct Case<T, G> {
    op: u8,
    xd: Vec<usize>,
    rows: usize,
    cols: usize,
    gd: Vec<usize>,
    x: Vec<T>,
    x2: Vec<T>,
    g: Vec<G>,
    rstd_in: Vec<f32>,
    dres: Option<Vec<T>>,
    opts: RmsNormOptions,
    gopts: RmsNormGradOptions,
    want_rstd: bool,
    want_x_sum: bool,
    want_dg: bool,
    want_dgc: bool,
    dg_init: Vec<f32>,
    tame: bool,
}

const SENT: f32 = -7.25; // a sentinel every output starts as

/// `Some(v)` when the output is wanted.
fn opt(v: &mut [f32], on: bool) -> Option<&mut [f32]> {
    if on {
        Some(v)
    } else {
        None
    }
}

impl<T: Float, G: Float> Case<T, G> {
    fn fresh(&self) -> Out<T, G> {
        let n = self.x.len();
        Out {
            a: vec![T::from_f32(SENT); n],
            rstd: vec![SENT; if self.want_rstd { self.rows } else { 0 }],
            x_sum: vec![T::from_f32(SENT); if self.want_x_sum { n } else { 0 }],
            dg: if self.want_dg {
                self.dg_init.clone()
            } else {
                Vec::new()
            },
            dgc: vec![G::from_f32(SENT); if self.want_dgc { self.cols } else { 0 }],
        }
    }

    /// Runs the case on `exec`; the outputs are returned whatever happened.
    fn run(&self, exec: &Exec<'_>) -> (Result<()>, Out<T, G>, bool) {
        let mut o = self.fresh();
        capped();
        let r = self.run_into(exec, &mut o);
        (r, o, capped())
    }

    fn run_into(&self, exec: &Exec<'_>, o: &mut Out<T, G>) -> Result<()> {
        let xt = TensorRef::new(&self.x, &self.xd)?;
        let gt = TensorRef::new(&self.g, &self.gd)?;
        match self.op {
            0 => {
                let mut ws = workspace(rms_norm_workspace_size(exec, xt, gt, &self.opts)?);
                rms_norm(
                    exec,
                    xt,
                    gt,
                    &self.opts,
                    &mut o.a,
                    opt(&mut o.rstd, self.want_rstd),
                    &mut ws,
                )
            }
            1 => {
                let x2t = TensorRef::new(&self.x2, &self.xd)?;
                let mut ws = workspace(add_rms_norm_workspace_size(exec, xt, x2t, gt, &self.opts)?);
                let xs = if self.want_x_sum {
                    Some(&mut o.x_sum[..])
                } else {
                    None
                };
                add_rms_norm(
                    exec,
                    xt,
                    x2t,
                    gt,
                    &self.opts,
                    &mut o.a,
                    opt(&mut o.rstd, self.want_rstd),
                    xs,
                    &mut ws,
                )
            }
            2 => {
                // In place: x_sum over a copy of x1 (which starts as x1).
                let x2t = TensorRef::new(&self.x2, &self.xd)?;
                let mut ws = workspace(add_rms_norm_workspace_size(exec, xt, x2t, gt, &self.opts)?);
                o.x_sum = self.x.clone();
                let before = o.x_sum.clone();
                let x1 = TensorMut::new(&mut o.x_sum, &self.xd)?;
                let r = add_rms_norm_in_place(
                    exec,
                    x1,
                    x2t,
                    gt,
                    &self.opts,
                    &mut o.a,
                    opt(&mut o.rstd, self.want_rstd),
                    &mut ws,
                );
                if r.is_err() {
                    assert_same(&o.x_sum, &before, "x1 (in place) changed on error");
                    o.x_sum = vec![T::from_f32(SENT); o.x_sum.len()];
                }
                r
            }
            _ => {
                // x2 serves as dy.
                let dyt = TensorRef::new(&self.x2, &self.xd)?;
                let rt = TensorRef::new(&self.rstd_in, &[self.rows])?;
                let dres = match &self.dres {
                    Some(d) => Some(TensorRef::new(d, &self.xd)?),
                    None => None,
                };
                let mut ws = workspace(rms_norm_grad_workspace_size(
                    exec,
                    dyt,
                    &RmsNormGradInputs {
                        x: xt,
                        rstd: rt,
                        gamma: gt,
                        dres,
                    },
                    &self.gopts,
                )?);
                let dg = if self.want_dg {
                    Some(&mut o.dg[..])
                } else {
                    None
                };
                let dgc = if self.want_dgc {
                    Some(&mut o.dgc[..])
                } else {
                    None
                };
                if self.op == 3 {
                    rms_norm_grad(
                        exec,
                        dyt,
                        &RmsNormGradInputs {
                            x: xt,
                            rstd: rt,
                            gamma: gt,
                            dres,
                        },
                        &self.gopts,
                        &mut o.a,
                        DgammaOut {
                            dgamma: dg,
                            dgamma_cast: dgc,
                        },
                        &mut ws,
                    )
                } else {
                    // In place: dx over a copy of dy.
                    o.a = self.x2.clone();
                    let before = o.a.clone();
                    let d = TensorMut::new(&mut o.a, &self.xd)?;
                    let r = rms_norm_grad_in_place(
                        exec,
                        d,
                        &RmsNormGradInputs {
                            x: xt,
                            rstd: rt,
                            gamma: gt,
                            dres,
                        },
                        &self.gopts,
                        DgammaOut {
                            dgamma: dg,
                            dgamma_cast: dgc,
                        },
                        &mut ws,
                    );
                    if r.is_err() {
                        assert_same(&o.a, &before, "dy (in place) changed on error");
                        o.a = vec![T::from_f32(SENT); o.a.len()];
                    }
                    r
                }
            }
        }
    }

    /// Every output equal (NaN-aware); dgamma too when `with_dg`.
    fn same(&self, a: &Out<T, G>, b: &Out<T, G>, with_dg: bool, what: &str) {
        assert_same(&a.a, &b.a, &format!("{what}: y/dx"));
        assert_same(&a.rstd, &b.rstd, &format!("{what}: rstd"));
        assert_same(&a.x_sum, &b.x_sum, &format!("{what}: x_sum"));
        if with_dg {
            assert_same(&a.dg, &b.dg, &format!("{what}: dgamma"));
            assert_same(&a.dgc, &b.dgc, &format!("{what}: dgamma_cast"));
        }
    }

    /// Within the documented tolerances of the reference (tame inputs only).
    fn close(&self, got: &Out<T, G>, want: &Out<T, G>) {
        let n = self.cols;
        if self.op <= 2 {
            let bar = if self.opts.rounding == Rounding::Fused {
                1
            } else {
                2
            };
            for (i, (g, w)) in got.a.iter().zip(&want.a).enumerate() {
                if T::DTYPE == DType::F32 {
                    let (g, w) = (g.to_f64(), w.to_f64());
                    let ok = g == w || g.is_nan() && w.is_nan() || ((g - w) / w).abs() <= 2e-6;
                    assert!(ok, "y[{i}] {g:e} vs reference {w:e}: beyond 2e-6 relative");
                } else {
                    let u = ulps(*g, *w);
                    assert!(
                        u <= bar,
                        "y[{i}] {:e} vs reference {:e}: {u} ulps",
                        g.to_f32(),
                        w.to_f32()
                    );
                }
            }
            assert_same(&got.x_sum, &want.x_sum, "x_sum vs reference");
            for (i, (g, w)) in got.rstd.iter().zip(&want.rstd).enumerate() {
                let (g, w) = (*g as f64, *w as f64);
                let ok = g == w || g.is_nan() && w.is_nan() || ((g - w) / w).abs() <= 1e-6;
                assert!(ok, "rstd[{i}] {g:e} vs reference {w:e}");
            }
            return;
        }
        // dx: 1 ulp + 1e-5 x (max_j |rstd dy_j (g_j + off)| + max_j |dres_j|).
        let off = self.gopts.gamma_offset as f64;
        for r in 0..self.rows {
            let (mut a, mut d) = (0f64, 0f64);
            for j in 0..n {
                let t = self.rstd_in[r] as f64
                    * self.x2[r * n + j].to_f64()
                    * (self.g[j].to_f64() + off);
                a = a.max(t.abs());
                if let Some(dr) = &self.dres {
                    d = d.max(dr[r * n + j].to_f64().abs());
                }
            }
            let scale = a + d;
            for j in 0..n {
                let (g, w) = (got.a[r * n + j].to_f64(), want.a[r * n + j].to_f64());
                if g == w || g.is_nan() && w.is_nan() {
                    continue;
                }
                let tol = ulp_at::<T>(w) + 1e-5 * scale;
                assert!(
                    (g - w).abs() <= tol,
                    "dx[{r},{j}] {g:e} vs reference {w:e} (tol {tol:e})"
                );
            }
        }
        // dgamma: 1e-5 x sum_m |dy x rstd| (+ 1 ulp of an accumulated value).
        for j in 0..got.dg.len() {
            let cond: f64 = (0..self.rows)
                .map(|r| {
                    (self.x2[r * n + j].to_f64()
                        * self.x[r * n + j].to_f64()
                        * self.rstd_in[r] as f64)
                        .abs()
                })
                .sum();
            let (g, w) = (got.dg[j] as f64, want.dg[j] as f64);
            if g == w {
                continue;
            }
            let tol = 1e-5 * cond + ulp_at::<f32>(w);
            assert!(
                (g - w).abs() <= tol,
                "dgamma[{j}] {g:e} vs reference {w:e} (tol {tol:e})"
            );
        }
    }
}

fn ub_of(b: &mut Bytes<'_>) -> UbConfig {
    UbConfig {
        ub_bytes: match b.u8() % 8 {
            0 => 1024,
            1 => 1024 + b.below(4096),
            2 => 1 << 24,
            3 if b.one_in(4) => b.below(1024), // invalid: too small
            _ => 1024 << b.below(9),
        },
        blocks: match b.u8() % 4 {
            0 => 1,
            1 => 1 + b.below(70) as u32,
            2 if b.one_in(4) => 0, // invalid
            _ => 64,
        },
    }
}

fn case<T: Float, G: Float>(b: &mut Bytes<'_>, op: u8) -> Case<T, G> {
    let max_rank = if b.one_in(4) { 8 } else { 3 };
    let rank = 1 + b.below(max_rank);
    let xd = dims(b, rank, CAP);
    let g_rank = 1 + b.below(rank);
    let gd = xd[rank - g_rank..].to_vec();
    let rows: usize = xd[..rank - g_rank].iter().product();
    let cols: usize = gd.iter().product();
    let tame = b.bool();
    let n = rows * cols;
    let x = some_values::<T>(b, n, tame);
    let x2 = some_values::<T>(b, n, tame);
    let g = some_values::<G>(b, cols, tame);
    let rstd_in = if tame {
        // Consistent with x (as a forward pass would give), so xh = x rstd
        // is normalized and the documented dx bound applies.
        (0..rows)
            .map(|r| {
                let ms = x[r * cols..(r + 1) * cols]
                    .iter()
                    .map(|v| v.to_f64() * v.to_f64())
                    .sum::<f64>()
                    / cols.max(1) as f64;
                (1.0 / (ms + 1e-6).sqrt()) as f32
            })
            .collect()
    } else {
        some_values::<f32>(b, rows, false)
    };
    let dres = if b.bool() {
        Some(some_values::<T>(b, n, tame))
    } else {
        None
    };
    let small = |b: &mut Bytes<'_>| {
        if tame {
            b.below(8) as f32 * 0.25
        } else {
            b.f32()
        }
    };
    let opts = RmsNormOptions {
        eps: if tame {
            [0.0, 1e-6, 1e-5, 0.25][b.below(4)]
        } else {
            b.f32()
        },
        gamma_offset: small(b),
        rounding: if b.bool() {
            Rounding::Fused
        } else {
            Rounding::CastBeforeGamma
        },
    };
    let gopts = RmsNormGradOptions {
        gamma_offset: small(b),
        dgamma_mode: if b.bool() {
            DgammaMode::Overwrite
        } else {
            DgammaMode::Accumulate
        },
    };
    let dg_init = some_values::<f32>(b, cols, tame);
    Case {
        op,
        xd,
        rows,
        cols,
        gd,
        x,
        x2,
        g,
        rstd_in,
        dres,
        opts,
        gopts,
        want_rstd: !b.u8().is_multiple_of(4),
        want_x_sum: op == 2 || b.bool(),
        want_dg: !b.u8().is_multiple_of(4),
        want_dgc: b.one_in(3),
        dg_init,
        tame,
    }
}

/// True when `ub` is a tiling the plan accepts.
fn valid(ub: &UbConfig) -> bool {
    ub.ub_bytes >= 1024 && ub.blocks >= 1
}

fn check<T: Float, G: Float>(b: &mut Bytes<'_>, op: u8) {
    let c = case::<T, G>(b, op);
    let (ub, ub2) = (ub_of(b), ub_of(b));
    let (want_r, want, want_cap) = c.run(&Exec::reference());
    let fresh = c.fresh();
    if want_r.is_err() {
        c.same(&want, &fresh, true, "reference wrote on error");
    }
    // The result a CPU run under `ub` must have: the reference's, or an
    // error for an invalid tiling.
    let expect = |r: &Result<()>, cap: bool, ub: &UbConfig, what: &str| {
        if valid(ub) {
            assert!(
                same_outcome(r, cap, &want_r, want_cap),
                "{what}: {r:?} differs from the reference's {want_r:?}"
            );
        } else {
            assert!(r.is_err(), "{what}: an invalid tiling {ub:?} was accepted");
        }
    };
    // Each ISA, serial, tiling `ub`.
    let mut first: Option<Out<T, G>> = None;
    for isa in isas() {
        let cpu = Cpu::new(Serial).with_isa(isa);
        let (r, got, cap) = c.run(&Exec::new(&cpu).with_ub(ub));
        expect(&r, cap, &ub, &format!("{isa:?}"));
        if r.is_err() {
            c.same(&got, &fresh, true, "an output changed on error");
            continue;
        }
        match &first {
            None => first = Some(got.clone()),
            Some(f) => c.same(&got, f, true, &format!("{isa:?} vs the first ISA")),
        }
        if c.tame && isa == Isa::Portable && want_r.is_ok() {
            c.close(&got, &want);
        }
    }
    // Two threads, same tiling: everything identical, dgamma included.
    if b.one_in(3) {
        let threads = Cpu::new(Threads::new(2));
        let (r, got, cap) = c.run(&Exec::new(&threads).with_ub(ub));
        expect(&r, cap, &ub, "threads");
        if let (Ok(()), Some(f)) = (&r, &first) {
            c.same(&got, f, true, "threads vs serial");
        }
    }
    // Another tiling: all but dgamma identical.
    let (r2, got2, cap2) = c.run(&Exec::new(&CPU_SERIAL).with_ub(ub2));
    expect(&r2, cap2, &ub2, "tiling 2");
    if let (Ok(()), Some(f)) = (r2, &first) {
        c.same(&got2, f, false, "another tiling");
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes(data);
    let op = b.u8() % 5;
    match (b.u8() % 3, b.bool()) {
        (0, _) => check::<f32, f32>(&mut b, op),
        (1, false) => check::<f16, f16>(&mut b, op),
        (1, true) => check::<f16, f32>(&mut b, op),
        (_, false) => check::<bf16, bf16>(&mut b, op),
        (_, true) => check::<bf16, f32>(&mut b, op),
    }
});
