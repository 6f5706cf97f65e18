//! `npk_swiglu_grad_workspace_size` / `npk_swiglu_grad`: a skin over
//! `ops::swiglu_grad::{plan, prepare, launch}`.

use core::ffi::c_void;

use crate::capi::exec::{run, run_size};
use crate::capi::types::{npk_exec, npk_status, read_opt_tensor, read_tensor};
use crate::ops::launch;
use crate::ops::swiglu::capi::{npk_swiglu_options, read_swiglu_options};
use crate::ops::swiglu_grad::{plan, prepare};
use crate::tensor::RawTensor;

/// Workspace bytes `npk_swiglu_grad` needs (0; the same arguments as the run).
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_swiglu_grad_workspace_size(
    dy: *const RawTensor,
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_swiglu_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run_size(exec, workspace_bytes, |e| {
            let dy = read_tensor(dy, "dy")?;
            let a = read_tensor(a, if b.is_null() { "x" } else { "gate" })?;
            let b = read_opt_tensor(b, "up")?;
            let opts = read_swiglu_options(opts)?;
            Ok(plan(&dy, &a, b.as_ref(), &opts, &e.ub)?.workspace_bytes)
        })
    }
}

/// SwiGluGrad: with `b` NULL (the split form), `da` is the gradient of `x`
/// (x's shape, both halves) and `db` must be NULL; else `da` and `db` are
/// the gradients of gate and up. `dy` has the forward's `y` shape. Outputs
/// may not overlap inputs or each other. On error nothing is written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_swiglu_grad(
    dy: *const RawTensor,
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_swiglu_options,
    da: *const RawTensor,
    db: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run(exec, |e| {
            let split = b.is_null();
            let dy = read_tensor(dy, "dy")?;
            let a = read_tensor(a, if split { "x" } else { "gate" })?;
            let b = read_opt_tensor(b, "up")?;
            let opts = read_swiglu_options(opts)?;
            let da = read_tensor(da, if split { "dx" } else { "dgate" })?;
            let db = read_opt_tensor(db, if split { "db" } else { "dup" })?;
            let call = prepare(&dy, &a, b.as_ref(), &opts, &da, db.as_ref(), &e.ub)?;
            launch(e, call, workspace, workspace_bytes)
        })
    }
}
