//! `npk_add_rms_norm_workspace_size` / `npk_add_rms_norm`: a skin over
//! `ops::add_rms_norm::{plan, prepare, launch}`.

use core::ffi::c_void;

use crate::capi::exec::{run, run_size};
use crate::capi::types::{
    npk_exec, npk_rms_norm_options, npk_status, read_norm_options, read_opt_tensor, read_tensor,
};
use crate::ops::add_rms_norm::{plan, prepare};
use crate::ops::launch;
use crate::tensor::RawTensor;

/// Workspace bytes `npk_add_rms_norm` needs for these arguments.
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_add_rms_norm_workspace_size(
    x1: *const RawTensor,
    x2: *const RawTensor,
    gamma: *const RawTensor,
    opts: *const npk_rms_norm_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run_size(exec, workspace_bytes, |e| {
            let x1 = read_tensor(x1, "x1")?;
            let x2 = read_tensor(x2, "x2")?;
            let gamma = read_tensor(gamma, "gamma")?;
            let opts = read_norm_options(opts)?;
            let t = plan(&x1, &x2, &gamma, &opts, &e.ub)?;
            Ok(t.workspace_bytes)
        })
    }
}

/// AddRmsNorm: `x_sum = round(x1 + x2)`, then RmsNorm of the rounded `x_sum`
/// (bit-identical to add-then-norm). `rstd` and `x_sum` are nullable;
/// `x_sum`'s data may equal `x1`'s (in place, the residual stream). On error
/// nothing is written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_add_rms_norm(
    x1: *const RawTensor,
    x2: *const RawTensor,
    gamma: *const RawTensor,
    opts: *const npk_rms_norm_options,
    y: *const RawTensor,
    rstd: *const RawTensor,
    x_sum: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run(exec, |e| {
            let x1 = read_tensor(x1, "x1")?;
            let x2 = read_tensor(x2, "x2")?;
            let gamma = read_tensor(gamma, "gamma")?;
            let opts = read_norm_options(opts)?;
            let y = read_tensor(y, "y")?;
            let rstd = read_opt_tensor(rstd, "rstd")?;
            let x_sum = read_opt_tensor(x_sum, "x_sum")?;
            let call = prepare(
                &x1,
                &x2,
                &gamma,
                &opts,
                &y,
                rstd.as_ref(),
                x_sum.as_ref(),
                &e.ub,
            )?;
            launch(e, call, workspace, workspace_bytes)
        })
    }
}
