//! grad_stats and clip_grad_norm over arbitrary lists (empty tensors, mixed
//! dtypes, NaN/Inf, subnormals, huge values, any max_norm,
//! error_if_nonfinite), differentially against a float64 computation made
//! here.
//!
//! Checked:
//! - grad_stats: NaN/Inf counts and min/max/absmax (over finite elements,
//!   zero as +0.0, NaN when none) exact; sum_sq within 6.6e-7 relative (the
//!   documented bound) of the f64 sum of squares of the finite elements;
//!   bit-identical across ISAs and runners for one tiling, and on the
//!   Reference within the same bounds;
//! - clip_grad_norm: a negative or NaN max_norm and (with
//!   error_if_nonfinite) a NaN/Inf element are errors that change nothing;
//!   otherwise the norm is NaN / +Inf / sqrt(sum_sq) (3.3e-7 relative), and
//!   every element is exactly round(f32(x) * coef) with coef =
//!   f32(min(1, max_norm / (norm + 1e-6))); bit-identical across ISAs and
//!   runners.
//!
//! Run: `cargo +nightly fuzz run grad_health`, or the stable recipe in
//! `scripts/fuzz_smoke.sh`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npukern::*;
use npukern_fuzz::{dims, isas, some_values, workspace, Bytes};

/// Most elements in one list.
const CAP: usize = 2048;

#[derive(Clone, Debug)]
enum Owned {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Owned {
    fn values(&self) -> Vec<f32> {
        match self {
            Owned::F32(v) => v.clone(),
            Owned::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Owned::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
    fn as_ref(&self) -> GradTensor<'_> {
        match self {
            Owned::F32(v) => GradTensor::F32(v),
            Owned::F16(v) => GradTensor::F16(v),
            Owned::BF16(v) => GradTensor::BF16(v),
        }
    }
    fn as_mut(&mut self) -> GradTensorMut<'_> {
        match self {
            Owned::F32(v) => GradTensorMut::F32(v),
            Owned::F16(v) => GradTensorMut::F16(v),
            Owned::BF16(v) => GradTensorMut::BF16(v),
        }
    }
    /// round(f32(x) * coef) in this tensor's dtype.
    fn scaled(&self, coef: f32) -> Owned {
        match self {
            Owned::F32(v) => Owned::F32(v.iter().map(|&x| x * coef).collect()),
            Owned::F16(v) => {
                Owned::F16(v.iter().map(|x| f16::from_f32(x.to_f32() * coef)).collect())
            }
            Owned::BF16(v) => Owned::BF16(
                v.iter()
                    .map(|x| bf16::from_f32(x.to_f32() * coef))
                    .collect(),
            ),
        }
    }
    /// Bit-identical, any NaN matching any NaN.
    fn same(&self, o: &Owned) -> bool {
        let (a, b) = (self.values(), o.values());
        core::mem::discriminant(self) == core::mem::discriminant(o)
            && a.len() == b.len()
            && a.iter()
                .zip(&b)
                .all(|(x, y)| x.is_nan() && y.is_nan() || x.to_bits() == y.to_bits())
        // f32 -> value -> f32 is exact, so comparing widened values is
        // comparing bits for f16/bf16 too (NaN aside).
    }
}

/// The float64 model of grad_stats.
struct Model {
    sum_sq: f64,
    nan: u64,
    inf: u64,
    min: f32,
    max: f32,
    absmax: f32,
}

fn model(list: &[Owned]) -> Model {
    let mut m = Model {
        sum_sq: 0.0,
        nan: 0,
        inf: 0,
        min: f32::NAN,
        max: f32::NAN,
        absmax: f32::NAN,
    };
    for v in list.iter().flat_map(|t| t.values()) {
        if v.is_nan() {
            m.nan += 1;
        } else if v.is_infinite() {
            m.inf += 1;
        } else {
            m.sum_sq += (v as f64) * (v as f64);
            m.min = if m.min.is_nan() || v < m.min {
                v
            } else {
                m.min
            };
            m.max = if m.max.is_nan() || v > m.max {
                v
            } else {
                m.max
            };
            m.absmax = if m.absmax.is_nan() || v.abs() > m.absmax {
                v.abs()
            } else {
                m.absmax
            };
        }
    }
    // Zero is reported as +0.0.
    let pos = |x: f32| if x == 0.0 { 0.0 } else { x };
    m.min = pos(m.min);
    m.max = pos(m.max);
    m.absmax = pos(m.absmax);
    m
}

fn same_f32(a: f32, b: f32) -> bool {
    a.is_nan() && b.is_nan() || a.to_bits() == b.to_bits()
}

fn rel_ok(got: f64, want: f64, tol: f64) -> bool {
    got == want || (got - want).abs() <= tol * want.abs()
}

fn check_summary(s: &GradSummary, m: &Model, what: &str) {
    assert_eq!(
        (s.nan_count, s.inf_count),
        (m.nan, m.inf),
        "{what}: NaN/Inf counts"
    );
    assert!(
        same_f32(s.min, m.min),
        "{what}: min {:e} vs {:e}",
        s.min,
        m.min
    );
    assert!(
        same_f32(s.max, m.max),
        "{what}: max {:e} vs {:e}",
        s.max,
        m.max
    );
    assert!(
        same_f32(s.absmax, m.absmax),
        "{what}: absmax {:e} vs {:e}",
        s.absmax,
        m.absmax
    );
    assert!(
        rel_ok(s.sum_sq, m.sum_sq, 6.6e-7),
        "{what}: sum_sq {:e} vs f64 {:e}",
        s.sum_sq,
        m.sum_sq
    );
}

fn list_of(b: &mut Bytes<'_>) -> Vec<Owned> {
    let n = b.below(7);
    let tame = b.bool();
    let mut left = CAP;
    (0..n)
        .map(|_| {
            let rank = 1 + b.below(2);
            let d = dims(b, rank, left);
            let len: usize = d.iter().product();
            left -= len.min(left);
            match b.u8() % 3 {
                0 => Owned::F32(some_values(b, len, tame)),
                1 => Owned::F16(some_values(b, len, tame)),
                _ => Owned::BF16(some_values(b, len, tame)),
            }
        })
        .collect()
}

fn ub_of(b: &mut Bytes<'_>) -> UbConfig {
    UbConfig {
        ub_bytes: [1024, 4096, 1 << 16, 1 << 20][b.below(4)],
        blocks: match b.u8() % 3 {
            0 => 1,
            1 => 1 + b.below(70) as u32,
            _ => 64,
        },
    }
}

fn stats(exec: &Exec<'_>, list: &[Owned]) -> Result<GradSummary> {
    let refs: Vec<GradTensor<'_>> = list.iter().map(Owned::as_ref).collect();
    let mut ws = workspace(grad_stats_workspace_size(exec, &refs)?);
    grad_stats(exec, &refs, &mut ws)
}

fn clip(exec: &Exec<'_>, list: &mut [Owned], opts: &ClipGradNormOptions) -> Result<f64> {
    let mut muts: Vec<GradTensorMut<'_>> = list.iter_mut().map(Owned::as_mut).collect();
    let mut ws = workspace(clip_grad_norm_workspace_size(exec, &muts, opts)?);
    clip_grad_norm(exec, &mut muts, opts, &mut ws)
}

fn run(b: &mut Bytes<'_>) {
    let list = list_of(b);
    let m = model(&list);
    let ub = ub_of(b);
    let cpus: Vec<Cpu> = isas()
        .into_iter()
        .map(|i| Cpu::new(Serial).with_isa(i))
        .collect();
    let threads = Cpu::new(Threads::new(2));
    let use_threads = b.one_in(3);

    // grad_stats.
    let mut first: Option<GradSummary> = None;
    for cpu in &cpus {
        let s = stats(&Exec::new(cpu).with_ub(ub), &list).expect("grad_stats on a valid list");
        check_summary(&s, &m, "cpu");
        match &first {
            None => first = Some(s),
            Some(f) => assert!(s.same_bits(f), "ISAs disagree: {s:?} vs {f:?}"),
        }
    }
    let first = first.expect("portable is always available");
    if use_threads {
        let s = stats(&Exec::new(&threads).with_ub(ub), &list).expect("grad_stats");
        assert!(s.same_bits(&first), "threads vs serial: {s:?} vs {first:?}");
    }
    check_summary(
        &stats(&Exec::reference(), &list).expect("reference"),
        &m,
        "reference",
    );

    // clip_grad_norm.
    let opts = ClipGradNormOptions {
        max_norm: match b.u8() % 8 {
            0 => f64::from(b.f32()),
            1 => f64::INFINITY,
            2 => 0.0,
            _ => (b.u16() as f64 + 1.0) / 256.0,
        },
        error_if_nonfinite: b.bool(),
    };
    let nonfinite = m.nan + m.inf > 0;
    let want_norm = if m.nan > 0 {
        f64::NAN
    } else if m.inf > 0 {
        f64::INFINITY
    } else {
        m.sum_sq.sqrt()
    };
    let mut done: Option<(f64, Vec<Owned>)> = None;
    let execs: Vec<Exec<'_>> = cpus
        .iter()
        .map(|c| Exec::new(c).with_ub(ub))
        .chain(use_threads.then(|| Exec::new(&threads).with_ub(ub)))
        .collect();
    for exec in &execs {
        let mut l = list.clone();
        let r = clip(exec, &mut l, &opts);
        if opts.max_norm.is_nan() || opts.max_norm < 0.0 {
            assert!(
                matches!(r, Err(Error::InvalidParam { .. })),
                "max_norm {}: {r:?}",
                opts.max_norm
            );
            assert!(
                l.iter().zip(&list).all(|(a, b)| a.same(b)),
                "a tensor changed on error"
            );
            continue;
        }
        if nonfinite && opts.error_if_nonfinite {
            assert!(
                matches!(r, Err(Error::NonFinite)),
                "NaN/Inf with error_if_nonfinite: {r:?}"
            );
            assert!(
                l.iter().zip(&list).all(|(a, b)| a.same(b)),
                "a tensor changed on error"
            );
            continue;
        }
        let norm = r.expect("clip_grad_norm");
        assert!(
            norm.is_nan() && want_norm.is_nan() || rel_ok(norm, want_norm, 3.3e-7),
            "norm {norm:e} vs f64 {want_norm:e}"
        );
        let c = opts.max_norm / (norm + 1e-6);
        let coef = (if c > 1.0 { 1.0 } else { c }) as f32;
        for (i, (got, orig)) in l.iter().zip(&list).enumerate() {
            assert!(
                got.same(&orig.scaled(coef)),
                "tensor {i}: not round(x * {coef:e})"
            );
        }
        match &done {
            None => done = Some((norm, l)),
            Some((n, d)) => {
                assert_eq!(
                    norm.to_bits(),
                    n.to_bits(),
                    "norm differs across ISAs/runners"
                );
                assert!(
                    l.iter().zip(d).all(|(a, b)| a.same(b)),
                    "clipped tensors differ across ISAs/runners"
                );
            }
        }
    }
}

fuzz_target!(|data: &[u8]| run(&mut Bytes(data)));
