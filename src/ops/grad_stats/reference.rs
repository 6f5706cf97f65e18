//! The f64 golden model: a plain sequential pass in list order, every square
//! and sum in f64; scaling by the literal PyTorch rule (multiply every element
//! unconditionally, one f32 product rounded once to the tensor's dtype).

use super::plan::GradSource;
use super::{ClipGradNormCall, GradCall, GradStatsCall, GradSummary};
use crate::dtype::{DType, Float};
use crate::tensor_list::TableList;
use crate::workspace::{Dst, Src};
use half::{bf16, f16};

struct RefAcc {
    s: GradSummary,
    finite: u64,
}

fn visit<T: Float>(x: &[T], r: &mut RefAcc) {
    for v in x {
        let f = v.to_f64();
        if f.is_nan() {
            r.s.nan_count += 1;
        } else if f.is_infinite() {
            r.s.inf_count += 1;
        } else {
            r.finite += 1;
            r.s.sum_sq += f * f;
            let x = v.to_f32();
            if x < r.s.min {
                r.s.min = x;
            }
            if x > r.s.max {
                r.s.max = x;
            }
        }
    }
}

/// The summary of all tensors.
///
/// # Safety
/// Every tensor of `src` was validated by the front end.
pub(crate) unsafe fn stats<S: GradSource>(src: &mut S) -> GradSummary {
    let mut r = RefAcc {
        s: GradSummary {
            sum_sq: 0.0,
            nan_count: 0,
            inf_count: 0,
            min: f32::INFINITY,
            max: f32::NEG_INFINITY,
            absmax: 0.0,
        },
        finite: 0,
    };
    for i in 0..src.count() {
        let Ok((p, dt, n)) = src.get(i) else { continue };
        // SAFETY: validated descriptor of `n` elements of `dt`; only read.
        unsafe {
            match dt {
                DType::F32 => visit(Src(p as *const f32).get(0, n), &mut r),
                DType::F16 => visit(Src(p as *const f16).get(0, n), &mut r),
                DType::BF16 => visit(Src(p as *const bf16).get(0, n), &mut r),
                DType::I32 | DType::I64 | DType::I16 | DType::U8 => {}
            }
        }
    }
    let total = r.finite + r.s.nan_count + r.s.inf_count;
    super::cpu::finish_summary(r.s, total)
}

fn scale_t<T: Float>(x: &mut [T], c: f32) {
    for v in x {
        *v = T::from_f32(v.to_f32() * c);
    }
}

/// Multiplies every element by `c`, unconditionally (as `torch.mul_`).
///
/// # Safety
/// Every tensor of `src` was validated by the front end as writable and
/// pairwise disjoint.
pub(crate) unsafe fn scale<S: GradSource>(src: &mut S, c: f32) {
    for i in 0..src.count() {
        let Ok((p, dt, n)) = src.get(i) else { continue };
        // SAFETY: validated, writable, disjoint from every other tensor.
        unsafe {
            match dt {
                DType::F32 => scale_t(Dst(p as *mut f32).get(0, n), c),
                DType::F16 => scale_t(Dst(p as *mut f16).get(0, n), c),
                DType::BF16 => scale_t(Dst(p as *mut bf16).get(0, n), c),
                DType::I32 | DType::I64 | DType::I16 | DType::U8 => {}
            }
        }
    }
}

/// Runs a registry call (`GradStats`, `ClipGradNorm`) on the f64 model.
///
/// # Safety
/// The call comes from the front end.
pub(crate) unsafe fn reference<C: GradCall>(c: &C) {
    // SAFETY: forwarded.
    unsafe { c.reference() }
}

/// `grad_stats` on the f64 model.
///
/// # Safety
/// As for `reference`.
pub(crate) unsafe fn stats_call(c: &GradStatsCall) {
    // SAFETY: the front end lowered the list and points `summary` at its
    // own result.
    unsafe { c.summary.write(stats(&mut TableList(c.tensors.rows()))) }
}

/// `clip_grad_norm` on the f64 model: it multiplies even by 1.0, as
/// `torch.mul_` does (the kernels skip that pass: the same bits).
///
/// # Safety
/// As for `reference`; the tensors are writable and pairwise disjoint.
pub(crate) unsafe fn clip_call(c: &ClipGradNormCall) {
    // SAFETY: the front end lowered the list.
    let rows = unsafe { c.tensors.rows() };
    // SAFETY: validated tensors.
    let s = unsafe { stats(&mut TableList(rows)) };
    // SAFETY: the call comes from the front end.
    if let Some(coef) = unsafe { c.decide(&s) } {
        // SAFETY: validated, writable, pairwise disjoint.
        unsafe { scale(&mut TableList(rows), coef) };
    }
}
