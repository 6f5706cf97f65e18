//! CrossEntropy: the forward (per-row loss and lse; reductions none, sum
//! and mean; label smoothing, z-loss, soft-capping, ignore_index, class
//! weights), the backward (dlogits, out of place and in place) and the
//! fused in-place form, for f32, bf16 and f16 logits with i64 and i32
//! targets: the CPU kernels against the library's f64 reference within the
//! tolerances of tests/cross_entropy.rs, in place and fused against out of
//! place bit for bit where the contract says so, and every output hashed
//! (the online lse's exp and log are the library's own, so its bits must
//! not depend on the target).

use npukern::{bf16, f16};
use npukern::{DType, Element, Exec, Float, Reduction, UbConfig};

use crate::api::{self, CeIn, El};
use crate::ce_options::{variants, Variant};
use crate::data::{same_bits, ulp, Rng};
use crate::hash::BitHash;
use crate::{name, Checker};

/// Most rows and classes of a case, and most elements (the stack buffers).
const ROWS: usize = 5;
const COLS: usize = 2100;
const MAX: usize = 4200;

/// (name, rows, classes, ub_bytes, blocks): short rows, several per tile,
/// and rows longer than one 2048-column segment of the online lse (two
/// segments merged).
const SHAPES: [(&str, usize, usize, usize, u32); 2] =
    [("5x37", 5, 37, 1024, 3), ("2x2100", 2, 2100, 1024, 2)];

const EPS: f64 = f32::EPSILON as f64;

/// Runs every dtype pairing.
pub fn run(c: &mut Checker<'_>) {
    case::<f32, i64>(c, 1);
    case::<bf16, i32>(c, 2);
    case::<f16, i64>(c, 3);
}

/// The fixed-seed data of one shape.
struct Data<'a, T> {
    shape: &'a str,
    rows: usize,
    cols: usize,
    x: &'a [T],
    /// Targets, -1 marking the ignored rows (each variant writes its own
    /// ignore_index there).
    tgt: &'a [i64],
    w: &'a [f32],
    /// Upstream gradient per row; a reducing variant uses the first.
    g: &'a [f32],
}

fn case<T: El, I: Element + TryFrom<i64>>(c: &mut Checker<'_>, seed: u64) {
    for (si, &(shape, rows, cols, ub_bytes, blocks)) in SHAPES.iter().enumerate() {
        let cpu = Exec::cpu().with_ub(UbConfig { ub_bytes, blocks });
        let reference = Exec::reference();
        let mut rng = Rng(seed * 10 + si as u64);
        let len = rows * cols;
        let mut x = [T::from_f32(0.0); MAX];
        // Logits in [-6, 6], every seventh a magnitude up to 24: rows with
        // and without a standout maximum.
        x[..len].iter_mut().for_each(|v| {
            *v = if rng.below(7) == 0 {
                T::from_f32(rng.mag::<f32>().clamp(-24.0, 24.0))
            } else {
                T::from_f32((rng.below(769) as f32 - 384.0) / 64.0)
            }
        });
        let mut tgt = [0i64; ROWS];
        tgt.iter_mut()
            .for_each(|t| *t = rng.below(cols as u64) as i64);
        if rows > 2 {
            tgt[1] = -1;
        }
        let mut w = [0f32; COLS];
        w.iter_mut()
            .for_each(|v| *v = (rng.below(12) + 1) as f32 / 4.0);
        let mut g = [0f32; ROWS];
        g.iter_mut()
            .for_each(|v| *v = (rng.below(8) + 2) as f32 / 4.0);
        let d = Data {
            shape,
            rows,
            cols,
            x: &x[..len],
            tgt: &tgt[..rows],
            w: &w[..cols],
            g: &g[..rows],
        };
        for v in variants() {
            variant::<T, I>(c, (&cpu, &reference), &d, v);
        }
    }
}

/// Counts a call that failed (and returns false).
fn called(c: &mut Checker<'_>, what: &str, r: npukern::Result<()>) -> bool {
    match r {
        Ok(()) => true,
        Err(e) => c.check(what, false, format_args!("call failed: {e:?}")),
    }
}

/// Compares `got` with `want` within `tol(i, want)` and hashes `got`.
fn report<T: Float>(
    c: &mut Checker<'_>,
    what: &str,
    got: &[T],
    want: &[T],
    tol: impl Fn(usize, f64) -> f64,
) {
    c.within(what, got, want, tol);
    c.hash(what, BitHash::of(got));
}

/// Checks that `got` has `want`'s bits.
fn same<T: Float>(c: &mut Checker<'_>, what: &str, got: &[T], want: &[T], of: &str) {
    c.check(
        what,
        same_bits(got, want),
        format_args!("bits differ from {of}"),
    );
}

fn variant<T: El, I: Element + TryFrom<i64>>(
    c: &mut Checker<'_>,
    (cpu, reference): (&Exec<'_>, &Exec<'_>),
    d: &Data<'_, T>,
    (vname, o, weighted): Variant,
) {
    let (n, k) = (d.rows, d.cols);
    let what = name!(
        "cross_entropy.{vname}.{}_{}.{}",
        T::DTYPE.name(),
        I::DTYPE.name(),
        d.shape
    );
    let what = what.as_str();
    // The targets with this variant's ignore_index in the ignored rows.
    let mut t64 = [0i64; ROWS];
    let mut tgt = [I::zeroed(); ROWS];
    for r in 0..n {
        t64[r] = if d.tgt[r] < 0 {
            o.ignore_index
        } else {
            d.tgt[r]
        };
        match I::try_from(t64[r]) {
            Ok(v) => tgt[r] = v,
            Err(_) => {
                c.check(
                    what,
                    false,
                    format_args!("target {} unrepresentable", t64[r]),
                );
                return;
            }
        }
    }
    let (t64, tgt) = (&t64[..n], &tgt[..n]);
    let a = CeIn {
        x: d.x,
        dims: [n, k],
        tgt,
        w: weighted.then_some(d.w),
    };
    let reduced = o.reduction != Reduction::None;
    let nl = if reduced { 1 } else { n };
    let grad = &d.g[..nl];

    // Forward.
    let (mut loss, mut rloss, mut lse, mut rlse) =
        ([0f32; ROWS], [0f32; ROWS], [0f32; ROWS], [0f32; ROWS]);
    let (loss, rloss) = (&mut loss[..nl], &mut rloss[..nl]);
    let (lse, rlse) = (&mut lse[..n], &mut rlse[..n]);
    if !(called(c, what, api::cross_entropy(cpu, &a, &o, loss, lse))
        && called(c, what, api::cross_entropy(reference, &a, &o, rloss, rlse)))
    {
        return;
    }
    let (loss, lse, rlse): (&[f32], &[f32], &[f32]) = (loss, lse, rlse);
    // The magnitude of each row's loss terms (as tests/cross_entropy.rs).
    let wc = |j: usize| {
        if weighted {
            (d.w[j] as f64).abs()
        } else {
            1.0
        }
    };
    let w_sum: f64 = (0..k).map(wc).sum();
    let (ls, zs) = (o.label_smoothing as f64, o.lse_square_scale as f64);
    let ignored = |r: usize| t64[r] == o.ignore_index;
    let den: f64 = (0..n)
        .filter(|&r| !ignored(r))
        .map(|r| wc(t64[r] as usize))
        .sum();
    let mut scales = [0f64; ROWS];
    for r in (0..n).filter(|&r| !ignored(r)) {
        let l = (rlse[r] as f64).abs();
        let xv = |j: usize| d.x[r * k + j].to_f64().abs();
        let maxx = (0..k).map(xv).fold(0.0, f64::max);
        scales[r] = wc(t64[r] as usize) * (l + xv(t64[r] as usize))
            + ls * w_sum * (l + maxx) / k as f64
            + (zs * l * l).abs();
    }
    let scales = &scales[..n];
    let lse_tol = |_: usize, w: f64| 8.0 * EPS * w.abs().max(1.0);
    report(c, name!("{what}.lse").as_str(), lse, rlse, lse_tol);
    let row_loss_tol = |r: usize, w: f64| ulp(DType::F32, w) + 16.0 * EPS * scales[r];
    if reduced {
        let mut s: f64 = scales.iter().sum();
        if o.reduction == Reduction::Mean {
            s /= den.abs();
        }
        let tol = |_: usize, w: f64| ulp(DType::F32, w) + 32.0 * EPS * s;
        report(c, name!("{what}.loss").as_str(), loss, rloss, tol);
    } else {
        report(c, name!("{what}.loss").as_str(), loss, rloss, row_loss_tol);
    }

    // Backward, each from its own forward's lse.
    let z = T::from_f32(0.0);
    let (mut dx, mut rdx) = ([z; MAX], [z; MAX]);
    let (dx, rdx) = (&mut dx[..n * k], &mut rdx[..n * k]);
    let dname = name!("{what}.dlogits");
    let dname = dname.as_str();
    if !(called(
        c,
        dname,
        api::cross_entropy_grad(cpu, &a, lse, grad, &o, dx, false),
    ) && called(
        c,
        dname,
        api::cross_entropy_grad(reference, &a, rlse, grad, &o, rdx, false),
    )) {
        return;
    }
    // 1 ulp of T (4 for f32) plus 16 f32 epsilons of the terms' magnitude.
    let ulps = if T::DTYPE == DType::F32 { 4.0 } else { 1.0 };
    let dx_tol = |gs: f64| {
        move |i: usize, w: f64| {
            let (r, j) = (i / k, i % k);
            let wt = wc(t64[r].max(0) as usize);
            let a = wt + ls * w_sum / k as f64 + 2.0 * (zs * rlse[r] as f64).abs();
            let scale = gs * (a + ls * wc(j) / k as f64 + wt);
            ulps * ulp(T::DTYPE, w) + 16.0 * EPS * scale
        }
    };
    let gmax = grad.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
    let gs = if o.reduction == Reduction::Mean {
        gmax / den.abs()
    } else {
        gmax
    };
    report(c, dname, dx, rdx, dx_tol(gs));
    // In place over a copy of the logits: the same bits.
    let mut dx2 = [z; MAX];
    let dx2 = &mut dx2[..n * k];
    dx2.copy_from_slice(d.x);
    let ip = name!("{what}.dlogits_in_place");
    let ip = ip.as_str();
    if called(
        c,
        ip,
        api::cross_entropy_grad(cpu, &a, lse, grad, &o, dx2, true),
    ) {
        same(c, ip, dx2, dx, "out of place");
    }

    // Fused, in place, with the backward's upstream gradient as the
    // factor: per-row loss and lse, dlogits against the reference's fused
    // form; its lse is the forward's, and (but for a mean, whose backward
    // divides by the weight sum) its dlogits the backward's.
    let fname = name!("{what}.fused");
    let fname = fname.as_str();
    let (mut fl, mut rfl, mut flse, mut rflse) =
        ([0f32; ROWS], [0f32; ROWS], [0f32; ROWS], [0f32; ROWS]);
    let (fl, rfl, flse, rflse) = (&mut fl[..n], &mut rfl[..n], &mut flse[..n], &mut rflse[..n]);
    let (fx, rfx) = (&mut dx2[..], &mut rdx[..]);
    fx.copy_from_slice(d.x);
    rfx.copy_from_slice(d.x);
    if !(called(
        c,
        fname,
        api::cross_entropy_fused(cpu, &a, grad, &o, (fl, flse), fx),
    ) && called(
        c,
        fname,
        api::cross_entropy_fused(reference, &a, grad, &o, (rfl, rflse), rfx),
    )) {
        return;
    }
    report(c, name!("{fname}.loss").as_str(), fl, rfl, row_loss_tol);
    report(c, name!("{fname}.dlogits").as_str(), fx, rfx, dx_tol(gmax));
    same(c, name!("{fname}.lse").as_str(), flse, lse, "the forward's");
    if !reduced {
        same(
            c,
            name!("{fname}.loss_bits").as_str(),
            fl,
            loss,
            "the forward's",
        );
    }
    if o.reduction != Reduction::Mean {
        same(
            c,
            name!("{fname}.dlogits_bits").as_str(),
            fx,
            dx,
            "the backward's",
        );
    }
}
