//! RmsNorm, AddRmsNorm (out of place and in place) and RmsNormGrad (out of
//! place and in place, with dres) in every dtype pairing, merge-N and
//! split-D, against the f64 reference within the documented tolerances, and
//! their bits hashed.

use npukern::{bf16, f16};
use npukern::{DType, Exec, Reference, RmsNormGradOptions, RmsNormOptions, Rounding, UbConfig};

use crate::api::{self, El, GradIn};
use crate::data::{same_bits, ulp, Rng};
use crate::hash::BitHash;
use crate::{name, Checker};

/// Largest rows * cols of a case (the stack buffers' length).
const MAX: usize = 900;
/// Most rows / cols of a case.
const ROWS: usize = 6;
const COLS: usize = 300;

/// (name, rows, cols, ub_bytes, blocks): rows that share a 1 KiB tile
/// (merge-N), and rows longer than it (split-D).
const SHAPES: [(&str, usize, usize, usize, u32); 2] =
    [("6x40", 6, 40, 1024, 4), ("3x300", 3, 300, 1024, 2)];

static REF: Reference = Reference;

/// Runs every pairing.
pub fn run(c: &mut Checker<'_>) {
    pair::<f32, f32>(c, 1);
    pair::<f16, f16>(c, 2);
    pair::<f16, f32>(c, 3);
    pair::<bf16, bf16>(c, 4);
    pair::<bf16, f32>(c, 5);
}

fn dname(d: DType) -> &'static str {
    match d {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

/// Counts a call that failed (and returns false).
fn called(c: &mut Checker<'_>, what: &str, r: npukern::Result<()>) -> bool {
    match r {
        Ok(()) => true,
        Err(e) => c.check(what, false, format_args!("call failed: {e:?}")),
    }
}

fn pair<T: El, G: El>(c: &mut Checker<'_>, seed: u64) {
    for (si, &(shape, m, n, ub_bytes, blocks)) in SHAPES.iter().enumerate() {
        let ub = UbConfig { ub_bytes, blocks };
        let (cpu, rf) = (Exec::cpu().with_ub(ub), Exec::new(&REF).with_ub(ub));
        let case = name!("{}_{}.{shape}", dname(T::DTYPE), dname(G::DTYPE));
        let case = case.as_str();
        let (len, dims) = (m * n, [m, n]);
        let mut rng = Rng(seed * 10 + si as u64);
        let z = T::from_f32(0.0);
        let (mut x, mut x2, mut dy, mut dres) = ([z; MAX], [z; MAX], [z; MAX], [z; MAX]);
        let mut g = [G::from_f32(0.0); COLS];
        for v in [&mut x, &mut x2, &mut dy, &mut dres] {
            rng.fill(&mut v[..len]);
        }
        rng.fill(&mut g[..n]);
        // A NaN and an infinity make their rows NaN / zero-rstd rows; the
        // other rows must not notice.
        x[1] = T::from_f32(f32::NAN);
        x[len - 1] = T::from_f32(f32::INFINITY);
        let (x, x2, dy, dres, g) = (&x[..len], &x2[..len], &dy[..len], &dres[..len], &g[..n]);

        // RmsNorm, both roundings.
        let mut rstd = [0f32; ROWS];
        for (oname, opts) in [
            ("fused", RmsNormOptions::default()),
            (
                "cast_offset",
                RmsNormOptions {
                    gamma_offset: 1.0,
                    rounding: Rounding::CastBeforeGamma,
                    ..RmsNormOptions::default()
                },
            ),
        ] {
            let what = name!("rms_norm.{oname}.{case}");
            let what = what.as_str();
            let (mut y, mut yr) = ([z; MAX], [z; MAX]);
            let (mut rs, mut rsr) = ([0f32; ROWS], [0f32; ROWS]);
            let (y, yr, rs, rsr) = (&mut y[..len], &mut yr[..len], &mut rs[..m], &mut rsr[..m]);
            let ok = called(c, what, api::rms_norm(&cpu, (x, &dims), g, &opts, y, rs))
                && called(c, what, api::rms_norm(&rf, (x, &dims), g, &opts, yr, rsr));
            if !ok {
                continue;
            }
            // 1 ulp (2 when rounded twice, like the reference); f32: 2e-6 relative.
            let ulps = if opts.rounding == Rounding::Fused {
                1.0
            } else {
                2.0
            };
            let tol = |_: usize, w: f64| match T::DTYPE {
                DType::F32 => 2e-6 * w.abs(),
                d => ulps * ulp(d, w.abs()),
            };
            c.within(what, y, yr, tol);
            let rstd_what = name!("{what}.rstd");
            c.within(rstd_what.as_str(), rs, rsr, |_, w| 1e-6 * w.abs());
            c.hash(name!("{what}.y").as_str(), BitHash::of(y));
            c.hash(rstd_what.as_str(), BitHash::of(rs));
            if oname == "fused" {
                rstd[..m].copy_from_slice(rs);
            }
        }

        // AddRmsNorm: x_sum bit-exact, y as above; in place gives the same bits.
        let what = name!("add_rms_norm.{case}");
        let what = what.as_str();
        let opts = RmsNormOptions::default();
        let (mut y, mut yr, mut s, mut sr) = ([z; MAX], [z; MAX], [z; MAX], [z; MAX]);
        let (mut rs, mut rsr) = ([0f32; ROWS], [0f32; ROWS]);
        let (y, yr, s, sr) = (&mut y[..len], &mut yr[..len], &mut s[..len], &mut sr[..len]);
        let (rs, rsr) = (&mut rs[..m], &mut rsr[..m]);
        let (mut x1, mut x1r) = ([z; MAX], [z; MAX]);
        x1[..len].copy_from_slice(x);
        x1r[..len].copy_from_slice(x);
        let (x1, x1r) = (&mut x1[..len], &mut x1r[..len]);
        let add = |e: &Exec<'_>, x1: &mut [T], y: &mut [T], rs: &mut [f32], s: &mut [T]| {
            api::add_rms_norm(e, (x1, &dims), x2, g, &opts, y, rs, Some(s))
        };
        if called(c, what, add(&cpu, x1, y, rs, s)) && called(c, what, add(&rf, x1r, yr, rsr, sr)) {
            let ok = same_bits(s, sr);
            c.check(
                name!("{what}.x_sum").as_str(),
                ok,
                format_args!("x_sum differs from the reference's bits"),
            );
            let tol = |_: usize, w: f64| match T::DTYPE {
                DType::F32 => 2e-6 * w.abs(),
                d => ulp(d, w.abs()),
            };
            c.within(what, y, yr, tol);
            c.hash(name!("{what}.y").as_str(), BitHash::of(y));
            c.hash(name!("{what}.x_sum").as_str(), BitHash::of(s));
            c.hash(name!("{what}.rstd").as_str(), BitHash::of(rs));
            // In place: x_sum lands in x1.
            let (mut y2, mut rs2) = ([z; MAX], [0f32; ROWS]);
            let (y2, rs2) = (&mut y2[..len], &mut rs2[..m]);
            let ip = name!("add_rms_norm_in_place.{case}");
            let r = api::add_rms_norm(&cpu, (x1, &dims), x2, g, &opts, y2, rs2, None);
            if called(c, ip.as_str(), r) {
                let ok = same_bits(x1, s) && same_bits(y2, y) && same_bits(rs2, rs);
                c.check(
                    ip.as_str(),
                    ok,
                    format_args!("bits differ from out of place"),
                );
            }
        }

        // RmsNormGrad with dres: dx and dgamma against the reference, in
        // place equal to out of place.
        let what = name!("rms_norm_grad.{case}");
        let what = what.as_str();
        let opts = RmsNormGradOptions::default();
        let a = GradIn {
            dy,
            x,
            dims: &dims,
            rstd: &rstd[..m],
            g,
            dres: Some(dres),
        };
        let (mut dx, mut dxr, mut dx2) = ([z; MAX], [z; MAX], [z; MAX]);
        let (mut dg, mut dgr, mut dg2) = ([0f32; COLS], [0f32; COLS], [0f32; COLS]);
        let gz = G::from_f32(0.0);
        let (mut dc, mut dcr, mut dc2) = ([gz; COLS], [gz; COLS], [gz; COLS]);
        let (dx, dxr, dx2) = (&mut dx[..len], &mut dxr[..len], &mut dx2[..len]);
        let (dg, dgr, dg2) = (&mut dg[..n], &mut dgr[..n], &mut dg2[..n]);
        let (dc, dcr, dc2) = (&mut dc[..n], &mut dcr[..n], &mut dc2[..n]);
        let ok = called(
            c,
            what,
            api::rms_norm_grad(&cpu, &a, &opts, dx, false, dg, dc),
        ) && called(
            c,
            what,
            api::rms_norm_grad(&rf, &a, &opts, dxr, false, dgr, dcr),
        );
        if !ok {
            continue;
        }
        // dx: 1 ulp + 1e-5 x the row's gradient scale; dgamma: 1e-5 x
        // sum_m |dy x rstd| (its condition), + 1 f32 ulp.
        let f = |v: T| v.to_f32() as f64;
        let row_scale = |r: usize| {
            let (mut a, mut d) = (0f64, 0f64);
            for j in 0..n {
                let t = rstd[r] as f64 * f(dy[r * n + j]) * g[j].to_f32() as f64;
                a = a.max(t.abs());
                d = d.max(f(dres[r * n + j]).abs());
            }
            a + d
        };
        let dx_tol = |i: usize, w: f64| ulp(T::DTYPE, w.abs()) + 1e-5 * row_scale(i / n);
        c.within(name!("{what}.dx").as_str(), dx, dxr, dx_tol);
        let dg_tol = |j: usize, w: f64| {
            let cond: f64 = (0..m)
                .map(|r| (f(dy[r * n + j]) * f(x[r * n + j]) * rstd[r] as f64).abs())
                .sum();
            1e-5 * cond + ulp(DType::F32, w.abs())
        };
        c.within(name!("{what}.dgamma").as_str(), dg, dgr, dg_tol);
        c.hash(name!("{what}.dx").as_str(), BitHash::of(dx));
        c.hash(name!("{what}.dgamma").as_str(), BitHash::of(dg));
        c.hash(name!("{what}.dgamma_cast").as_str(), BitHash::of(dc));
        dx2.copy_from_slice(dy);
        let ip = name!("rms_norm_grad_in_place.{case}");
        if called(
            c,
            ip.as_str(),
            api::rms_norm_grad(&cpu, &a, &opts, dx2, true, dg2, dc2),
        ) {
            let ok = same_bits(dx2, dx) && same_bits(dg2, dg) && same_bits(dc2, dc);
            c.check(
                ip.as_str(),
                ok,
                format_args!("bits differ from out of place"),
            );
        }
    }
}
