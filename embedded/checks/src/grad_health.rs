//! grad_stats and clip_grad_norm over a mixed-dtype list: the summary
//! against the f64 reference model and against sums computed here, the
//! clipped tensors bit for bit against `round(x * coef)`, NaN/Inf counted,
//! error_if_nonfinite refusing without writing; every result hashed.

use npukern::{bf16, f16};
use npukern::{Error, GradSummary, GradTensor, GradTensorMut};

use crate::api;
use crate::data::{same_bits, Rng};
use crate::hash::BitHash;
use crate::Checker;

const A: usize = 1000;
const B: usize = 333;
const C: usize = 77;

fn summary_hash(s: &GradSummary) -> u64 {
    let mut h = BitHash::new();
    h.u64(s.sum_sq.to_bits()).u64(s.nan_count).u64(s.inf_count);
    h.floats(&[s.min, s.max, s.absmax]).0
}

/// Sum of squares, min, max, absmax of the finite elements, in f64.
fn direct(lists: (&[f32], &[bf16], &[f16])) -> (f64, f32, f32, f32, u64, u64) {
    let (mut ss, mut mn, mut mx, mut am, mut nan, mut inf) =
        (0f64, f32::INFINITY, f32::NEG_INFINITY, 0f32, 0u64, 0u64);
    let all = lists
        .0
        .iter()
        .copied()
        .chain(lists.1.iter().map(|v| v.to_f32()))
        .chain(lists.2.iter().map(|v| v.to_f32()));
    for v in all {
        if v.is_nan() {
            nan += 1;
        } else if v.is_infinite() {
            inf += 1;
        } else {
            ss += v as f64 * v as f64;
            mn = mn.min(v);
            mx = mx.max(v);
            am = am.max(v.abs());
        }
    }
    (ss, mn, mx, am, nan, inf)
}

/// Runs the gradient-health checks.
pub fn run(c: &mut Checker<'_>) {
    let mut rng = Rng(77);
    let (mut a, mut b, mut cc) = ([0f32; A], [bf16::ZERO; B], [f16::ZERO; C]);
    rng.fill(&mut a);
    rng.fill(&mut b);
    rng.fill(&mut cc);
    // A zero somewhere: reported as +0.0 whatever its sign.
    a[10] = -0.0;

    let list = [
        GradTensor::F32(&a),
        GradTensor::BF16(&b),
        GradTensor::F16(&cc),
    ];
    let (ss, mn, mx, am, _, _) = direct((&a, &b, &cc));
    match (api::grad_stats(false, &list), api::grad_stats(true, &list)) {
        (Ok(s), Ok(r)) => {
            let rel = (s.sum_sq - ss).abs() / ss;
            let ok = rel <= 1e-6
                && (s.sum_sq - r.sum_sq).abs() <= 1e-6 * ss
                && (s.min, s.max, s.absmax) == (mn, mx, am)
                && (r.min, r.max, r.absmax) == (mn, mx, am)
                && s.nan_count + s.inf_count == 0;
            c.check(
                "grad_stats.finite",
                ok,
                format_args!("{s:?} vs f64 sum_sq {ss:e} min {mn:e} max {mx:e} absmax {am:e}"),
            );
            c.hash("grad_stats.finite", summary_hash(&s));
        }
        (s, r) => {
            c.check("grad_stats.finite", false, format_args!("{s:?} / {r:?}"));
        }
    }

    // clip_grad_norm to 1.0: norm as grad_stats says, coef = min(1,
    // max_norm / (norm + 1e-6)) rounded to f32, every element round(x * coef).
    let (mut a2, mut b2, mut c2) = (a, b, cc);
    let mut lm = [
        GradTensorMut::F32(&mut a2),
        GradTensorMut::BF16(&mut b2),
        GradTensorMut::F16(&mut c2),
    ];
    match (api::clip(&mut lm, 1.0, true), api::grad_stats(false, &list)) {
        (Ok(norm), Ok(s)) => {
            let coef = {
                let q = 1.0 / (norm + 1e-6);
                (if q < 1.0 { q } else { 1.0 }) as f32
            };
            let scaled = |v: &[f32], w: &[f32]| {
                v.iter()
                    .zip(w)
                    .all(|(x, y)| (*x * coef).to_bits() == y.to_bits())
            };
            let mut ok = norm.to_bits() == s.norm().to_bits() && coef < 1.0;
            ok &= scaled(&a, &a2);
            ok &= b
                .iter()
                .zip(&b2)
                .all(|(x, y)| same_bits(&[bf16::from_f32(x.to_f32() * coef)], &[*y]));
            ok &= cc
                .iter()
                .zip(&c2)
                .all(|(x, y)| same_bits(&[f16::from_f32(x.to_f32() * coef)], &[*y]));
            c.check(
                "clip_grad_norm",
                ok,
                format_args!("norm {norm:e} (grad_stats: {:e}), coef {coef:e}", s.norm()),
            );
            let mut h = BitHash::new();
            h.u64(norm.to_bits()).floats(&a2).floats(&b2).floats(&c2);
            c.hash("clip_grad_norm", h.0);
        }
        (n, s) => {
            c.check("clip_grad_norm", false, format_args!("{n:?} / {s:?}"));
        }
    }

    // NaN and Inf: counted; error_if_nonfinite refuses and writes nothing.
    b[3] = bf16::NAN;
    cc[0] = f16::INFINITY;
    cc[C - 1] = f16::NEG_INFINITY;
    let list = [
        GradTensor::F32(&a),
        GradTensor::BF16(&b),
        GradTensor::F16(&cc),
    ];
    let (ss, mn, mx, am, nan, inf) = direct((&a, &b, &cc));
    match api::grad_stats(false, &list) {
        Ok(s) => {
            let ok = (s.nan_count, s.inf_count) == (nan, inf)
                && (s.sum_sq - ss).abs() <= 1e-6 * ss
                && (s.min, s.max, s.absmax) == (mn, mx, am)
                && s.norm().is_nan();
            c.check("grad_stats.nonfinite", ok, format_args!("{s:?}"));
            c.hash("grad_stats.nonfinite", summary_hash(&s));
        }
        Err(e) => {
            c.check("grad_stats.nonfinite", false, format_args!("{e:?}"));
        }
    }
    let (mut a2, mut b2, mut c2) = (a, b, cc);
    let mut lm = [
        GradTensorMut::F32(&mut a2),
        GradTensorMut::BF16(&mut b2),
        GradTensorMut::F16(&mut c2),
    ];
    let r = api::clip(&mut lm, 1.0, true);
    let untouched = same_bits(&a2, &a) && same_bits(&b2, &b) && same_bits(&c2, &cc);
    let refused = matches!(r, Err(Error::NonFinite));
    c.check(
        "clip_grad_norm.error_if_nonfinite",
        refused && untouched,
        format_args!("{r:?}, tensors untouched: {untouched}"),
    );
}
