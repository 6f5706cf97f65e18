//! `npk_grad_stats_workspace_size` / `npk_grad_stats` / `npk_clip_grad_norm`:
//! a skin over `ops::grad_stats` (the same validation, plan and kernels as
//! the Rust API).
//!
//! These operators have no entry in the foreign table: `npk_exec` is
//! validated and reported through `exec::run` like every operator, and the
//! backend it builds names the engine (`Backend::grad_engine`): CPU and
//! FOREIGN run the CPU kernels on the host `parallel_for` (with its
//! exactly-once check), REFERENCE the f64 model.
//!
//! The tensor list is read element by element through `types::read_tensor`
//! (an invalid dtype value never becomes a Rust enum); on a list error the
//! detail's `position` is the index of the first bad tensor.

use core::ffi::c_void;
use core::mem::size_of;

use crate::capi::exec::{run, run_size};
use crate::capi::types::{npk_error_detail, npk_exec, npk_status, read_tensor};
use crate::error::{invalid, Error, Result};
use crate::ops::grad_stats::{
    clip_with, first_bad, plan_of, stats_with, ClipGradNormOptions, GradSource, GradSummary,
    OutRange, ARG,
};
use crate::tensor::RawTensor;

/// What `npk_grad_stats` measures over all elements of all tensors.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_grad_summary {
    /// Sum of squares of the finite elements.
    pub sum_sq: f64,
    /// Number of NaN elements.
    pub nan_count: u64,
    /// Number of +Inf and -Inf elements.
    pub inf_count: u64,
    /// Smallest finite element; NaN when there are none (a zero is +0.0).
    pub min: f32,
    /// Largest finite element; NaN when there are none (a zero is +0.0).
    pub max: f32,
    /// Largest finite magnitude; NaN when there are none.
    pub absmax: f32,
}

impl From<GradSummary> for npk_grad_summary {
    fn from(s: GradSummary) -> Self {
        npk_grad_summary {
            sum_sq: s.sum_sq,
            nan_count: s.nan_count,
            inf_count: s.inf_count,
            min: s.min,
            max: s.max,
            absmax: s.absmax,
        }
    }
}

/// The caller's `const npk_tensor* tensors, size_t count`.
struct CList {
    p: *const RawTensor,
    n: usize,
}

impl CList {
    fn new(p: *const RawTensor, n: usize) -> Result<CList> {
        if n == 0 {
            return Ok(CList { p, n });
        }
        if p.is_null() {
            return Err(Error::NullPointer { arg: ARG });
        }
        n.checked_mul(size_of::<RawTensor>())
            .filter(|&b| b <= isize::MAX as usize)
            .and_then(|b| (p as usize).checked_add(b))
            .ok_or(Error::SizeOverflow { arg: ARG })?;
        Ok(CList { p, n })
    }
}

impl GradSource for CList {
    fn count(&self) -> usize {
        self.n
    }
    fn get(&mut self, i: usize) -> Result<(*mut c_void, crate::dtype::DType, usize)> {
        if i >= self.n {
            return Err(invalid(ARG, "index past the list"));
        }
        // SAFETY: `CList::new` checked the array's extent; the caller of the
        // exported function promises `count` readable descriptors.
        let t = unsafe { read_tensor(self.p.add(i), ARG)? };
        let c = t.check(ARG)?;
        if !t.dtype.is_float() {
            return Err(crate::error::dtype_err!(
                ARG,
                "tensor {i} has dtype {}, not f32, f16 or bf16",
                t.dtype
            ));
        }
        Ok((t.data, t.dtype, c.numel))
    }
}

/// After a failed call: when the tensor list is what was wrong, points
/// `detail->position` at the first bad tensor.
///
/// # Safety
/// `exec` is NULL or readable with a NULL or writable `detail`; `list` as
/// for the exported functions.
unsafe fn mark_bad_tensor(exec: *const npk_exec, list: *const RawTensor, count: usize) {
    if exec.is_null() {
        return;
    }
    // SAFETY: readable (caller).
    let detail: *mut npk_error_detail =
        unsafe { core::ptr::addr_of!((*exec).detail).read_unaligned() };
    if detail.is_null() {
        return;
    }
    // SAFETY: readable (caller); plain bytes.
    let arg = unsafe { core::ptr::addr_of!((*detail).argument).read_unaligned() };
    let named = ARG
        .bytes()
        .chain([0])
        .zip(arg)
        .all(|(a, b)| a as core::ffi::c_char == b);
    if !named {
        return;
    }
    let Ok(mut l) = CList::new(list, count) else {
        return;
    };
    if let Some(i) = first_bad(&mut l) {
        // SAFETY: writable (caller); a plain integer field.
        unsafe { core::ptr::addr_of_mut!((*detail).position).write_unaligned(i as i64) };
    }
}

/// Workspace bytes `npk_grad_stats` and `npk_clip_grad_norm` need for these
/// tensors (the same `exec` must be passed to both calls: the plan depends
/// on its `blocks`).
///
/// # Safety
/// `tensors` is NULL (only with `count == 0`) or points to `count` readable
/// `npk_tensor`s; the other pointers are NULL or valid. Data is not read.
#[no_mangle]
pub unsafe extern "C" fn npk_grad_stats_workspace_size(
    tensors: *const RawTensor,
    count: usize,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    let s = unsafe {
        run_size(exec, workspace_bytes, |e| {
            let t = plan_of(&mut CList::new(tensors, count)?, &e.ub)?;
            Ok(t.workspace_bytes)
        })
    };
    if s != npk_status::NPK_OK {
        // SAFETY: as above.
        unsafe { mark_bad_tensor(exec, tensors, count) };
    }
    s
}

/// Sum of squares, NaN/Inf counts, min, max and absmax over every element of
/// every tensor (f32 | f16 | bf16, any shapes), in one read of the data;
/// written to `*out`. `workspace` holds the bytes the size call returned
/// (NULL only when that was 0). On error `*out` is not written.
///
/// # Safety
/// As for the size call, and every tensor's `data` points to a readable
/// buffer of its shape and dtype, live for the call; `out` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn npk_grad_stats(
    tensors: *const RawTensor,
    count: usize,
    out: *mut npk_grad_summary,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    let s = unsafe {
        run(exec, |e| {
            if out.is_null() {
                return Err(Error::NullPointer { arg: "out" });
            }
            let mut l = CList::new(tensors, count)?;
            let o = OutRange {
                name: "out",
                addr: out as usize,
                bytes: size_of::<npk_grad_summary>(),
            };
            let sum = stats_with(e, &mut l, workspace, workspace_bytes, Some(o))?;
            out.write_unaligned(sum.into());
            Ok(())
        })
    };
    if s != npk_status::NPK_OK {
        // SAFETY: as above.
        unsafe { mark_bad_tensor(exec, tensors, count) };
    }
    s
}

/// `torch.nn.utils.clip_grad_norm_` (L2) over all tensors: writes the total
/// norm to `*total_norm` and scales every tensor in place by
/// `min(1, max_norm / (total_norm + 1e-6))` (each element
/// `round(f32(x) * coef)`). With a NaN/Inf present and `error_if_nonfinite
/// != 0`: `NPK_ERR_NONFINITE`, nothing changed; otherwise the coefficient is
/// applied even when it is NaN or 0, as PyTorch does. `max_norm` must not
/// be negative or NaN. Tensors must not overlap each other. Same workspace
/// size as `npk_grad_stats`.
///
/// # Safety
/// As for `npk_grad_stats`, and every tensor's buffer is writable;
/// `total_norm` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn npk_clip_grad_norm(
    tensors: *const RawTensor,
    count: usize,
    max_norm: f64,
    error_if_nonfinite: u8,
    total_norm: *mut f64,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    let s = unsafe {
        run(exec, |e| {
            if total_norm.is_null() {
                return Err(Error::NullPointer { arg: "total_norm" });
            }
            let mut l = CList::new(tensors, count)?;
            let o = OutRange {
                name: "total_norm",
                addr: total_norm as usize,
                bytes: size_of::<f64>(),
            };
            let opts = ClipGradNormOptions {
                max_norm,
                error_if_nonfinite: error_if_nonfinite != 0,
            };
            let n = clip_with(e, &mut l, &opts, workspace, workspace_bytes, Some(o))?;
            total_norm.write_unaligned(n);
            Ok(())
        })
    };
    if s != npk_status::NPK_OK {
        // SAFETY: as above.
        unsafe { mark_bad_tensor(exec, tensors, count) };
    }
    s
}
