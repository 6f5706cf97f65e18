//! `npk_grad_stats_workspace_size` / `npk_grad_stats` / `npk_clip_grad_norm`:
//! a skin over `ops::grad_stats` (the same validation, plan and kernels as
//! the Rust API).
//!
//! `npk_exec` is validated and reported through `exec::run` like every
//! operator; the calls reach its backend as `npk_grad_stats_call` /
//! `npk_clip_grad_norm_call` (the foreign entries `grad_stats` and
//! `clip_grad_norm`, ABI 2.7; a missing one runs on the CPU).
//!
//! The tensor list is read element by element through `types::read_tensor`
//! (an invalid dtype value never becomes a Rust enum); on a list error the
//! detail's `position` is the index of the first bad tensor.

use core::ffi::c_void;
use core::mem::size_of;

use crate::capi::exec::run;
use crate::capi::list::{mark_first_bad, CList};
use crate::capi::skin::{self, CapiOp};
use crate::capi::types::{npk_exec, npk_status};
use crate::error::{Error, Result};
use crate::ops::grad_stats::{
    clip_with, plan_of, stats_with, ClipGradNormOptions, GradSummary, OutRange, ARG,
};
use crate::ops::Exec;
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// The size call's skin: the list is all it reads (the runs lower the list
/// themselves, `stats_with` / `clip_with`).
impl CapiOp for CList {
    type Args = (*const RawTensor, usize);
    type Inputs = CList;

    unsafe fn read((p, n): Self::Args) -> Result<CList> {
        CList::new(p, n, ARG)
    }

    fn plan(list: &CList, ub: &UbConfig) -> Result<u64> {
        Ok(plan_of(&mut { *list }, ub)?.workspace_bytes)
    }
}

/// Returns `s`; when it is a failure, first points `detail->position` at
/// the first bad tensor (see `mark_bad_tensor`).
///
/// # Safety
/// As for `mark_bad_tensor`.
unsafe fn marked(
    s: npk_status,
    exec: *const npk_exec,
    list: *const RawTensor,
    count: usize,
) -> npk_status {
    if s != npk_status::NPK_OK {
        // SAFETY: forwarded from the caller.
        unsafe { mark_bad_tensor(exec, list, count) };
    }
    s
}

/// The body of `npk_grad_stats` and `npk_clip_grad_norm`: checks the
/// result pointer `out` (argument `name`), reads the list, runs `f` on it
/// with `out`'s bytes as a range no tensor may overlap, writes its answer
/// to `*out`; on failure marks the first bad tensor.
///
/// # Safety
/// As for those functions: the list as for the size call, `out` NULL or
/// writable.
unsafe fn run_list<R>(
    (tensors, count): (*const RawTensor, usize),
    (out, name): (*mut R, &'static str),
    exec: *const npk_exec,
    f: impl FnOnce(&Exec<'_>, &mut CList, OutRange) -> Result<R>,
) -> npk_status {
    // SAFETY: forwarded from the caller.
    let s = unsafe {
        run(exec, |e| {
            if out.is_null() {
                return Err(Error::NullPointer { arg: name });
            }
            let mut l = CList::new(tensors, count, ARG)?;
            let o = OutRange {
                name,
                addr: out as usize,
                bytes: size_of::<R>(),
            };
            let r = f(e, &mut l, o)?;
            // SAFETY: non-NULL (checked) and writable (caller).
            out.write_unaligned(r);
            Ok(())
        })
    };
    // SAFETY: forwarded from the caller.
    unsafe { marked(s, exec, tensors, count) }
}

/// After a failed call: when the tensor list is what was wrong, points
/// `detail->position` at the first bad tensor.
///
/// # Safety
/// `exec` is NULL or readable with a NULL or writable `detail`; `list` as
/// for the exported functions.
unsafe fn mark_bad_tensor(exec: *const npk_exec, list: *const RawTensor, count: usize) {
    if let Ok(l) = CList::new(list, count, ARG) {
        // SAFETY: forwarded from the caller.
        unsafe { mark_first_bad(exec, &mut [l]) }
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
    unsafe {
        let s = skin::workspace_size::<CList>((tensors, count), exec, workspace_bytes);
        marked(s, exec, tensors, count)
    }
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
    out: *mut GradSummary,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run_list((tensors, count), (out, "out"), exec, |e, l, o| {
            stats_with(e, l, workspace, workspace_bytes, Some(o))
        })
    }
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
    let opts = ClipGradNormOptions {
        max_norm,
        error_if_nonfinite: error_if_nonfinite != 0,
    };
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run_list(
            (tensors, count),
            (total_norm, "total_norm"),
            exec,
            |e, l, o| clip_with(e, l, &opts, workspace, workspace_bytes, Some(o)),
        )
    }
}
