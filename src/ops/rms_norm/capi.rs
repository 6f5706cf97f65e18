//! `npk_rms_norm_workspace_size` / `npk_rms_norm`: a skin over
//! `ops::rms_norm::{plan, prepare, launch}`.

use core::ffi::c_void;

use crate::capi::exec::{run, run_size};
use crate::capi::types::{
    npk_exec, npk_rms_norm_options, npk_status, read_norm_options, read_opt_tensor, read_tensor,
};
use crate::ops::launch;
use crate::ops::rms_norm::{plan, prepare};
use crate::tensor::RawTensor;

/// Workspace bytes `npk_rms_norm` needs for these arguments (the same `exec`
/// must be passed to both calls: the plan depends on its tiling fields).
///
/// # Safety
/// Every pointer is NULL or valid for its type; `x` and `gamma` describe
/// buffers the caller owns (they are not read here).
#[no_mangle]
pub unsafe extern "C" fn npk_rms_norm_workspace_size(
    x: *const RawTensor,
    gamma: *const RawTensor,
    opts: *const npk_rms_norm_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run_size(exec, workspace_bytes, |e| {
            let x = read_tensor(x, "x")?;
            let gamma = read_tensor(gamma, "gamma")?;
            let opts = read_norm_options(opts)?;
            let t = plan(&x, &gamma, &opts, &e.ub)?;
            Ok(t.workspace_bytes)
        })
    }
}

/// RmsNorm: `rstd = 1/sqrt(mean(x^2) + eps)` per row, `y = x * rstd *
/// (gamma + gamma_offset)`, over the trailing dims of `x` that `gamma`
/// covers. `rstd` is nullable; `workspace` holds the bytes the size call
/// returned (NULL only when that was 0). On error nothing is written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_rms_norm(
    x: *const RawTensor,
    gamma: *const RawTensor,
    opts: *const npk_rms_norm_options,
    y: *const RawTensor,
    rstd: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run(exec, |e| {
            let x = read_tensor(x, "x")?;
            let gamma = read_tensor(gamma, "gamma")?;
            let opts = read_norm_options(opts)?;
            let y = read_tensor(y, "y")?;
            let rstd = read_opt_tensor(rstd, "rstd")?;
            let call = prepare(&x, &gamma, &opts, &y, rstd.as_ref(), &e.ub)?;
            launch(e, call, workspace, workspace_bytes)
        })
    }
}
