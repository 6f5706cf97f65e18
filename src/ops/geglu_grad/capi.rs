//! `npk_geglu_grad_workspace_size` / `npk_geglu_grad`: a skin over
//! `ops::geglu_grad::{plan, prepare}` (the shared shape is `capi::skin`).

use core::ffi::c_void;

use crate::capi::skin;
use crate::capi::types::{npk_exec, npk_status};
use crate::error::Result;
use crate::ops::gated::grad_capi::{GradCapi, GradSkin};
use crate::ops::geglu::capi::{npk_geglu_options, read_geglu_options};
use crate::ops::geglu::GegluOptions;
use crate::ops::geglu_grad::Op;
use crate::tensor::RawTensor;

/// GeGluGrad's C skin: the gated family's (`ops::gated::grad_capi`).
type Skin = GradSkin<Op>;

impl GradCapi for Op {
    type COpts = npk_geglu_options;
    unsafe fn read_options(p: *const npk_geglu_options) -> Result<GegluOptions> {
        // SAFETY: NULL or valid (the trait's contract).
        unsafe { read_geglu_options(p) }
    }
}

/// Workspace bytes `npk_geglu_grad` needs (0; the same arguments as the run).
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_geglu_grad_workspace_size(
    dy: *const RawTensor,
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_geglu_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::workspace_size::<Skin>((dy, a, b, opts), exec, workspace_bytes) }
}

/// GeGluGrad: with `b` NULL (the split form), `da` is the gradient of `x`
/// (x's shape, both halves) and `db` must be NULL; else `da` and `db` are
/// the gradients of gate and up. `dy` has the forward's `y` shape. Outputs
/// may not overlap inputs or each other. On error nothing is written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_geglu_grad(
    dy: *const RawTensor,
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_geglu_options,
    da: *const RawTensor,
    db: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::launch::<Skin>((dy, a, b, opts), (da, db), workspace, workspace_bytes, exec) }
}
