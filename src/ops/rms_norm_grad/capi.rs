//! `npk_rms_norm_grad_workspace_size` / `npk_rms_norm_grad`: a skin over
//! `ops::rms_norm_grad::{plan, prepare, launch}`.

use core::ffi::c_void;

use crate::capi::exec::{run, run_size};
use crate::capi::types::{
    npk_exec, npk_rms_norm_grad_options, npk_status, read_grad_options, read_opt_tensor,
    read_tensor,
};
use crate::ops::launch;
use crate::ops::rms_norm_grad::{plan, prepare, GradOutputs, GradTensors};
use crate::tensor::RawTensor;

/// Workspace bytes `npk_rms_norm_grad` needs (per-block arenas and the dgamma
/// partials).
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_rms_norm_grad_workspace_size(
    dy: *const RawTensor,
    x: *const RawTensor,
    rstd: *const RawTensor,
    gamma: *const RawTensor,
    opts: *const npk_rms_norm_grad_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run_size(exec, workspace_bytes, |e| {
            let dy = read_tensor(dy, "dy")?;
            let x = read_tensor(x, "x")?;
            let rstd = read_tensor(rstd, "rstd")?;
            let gamma = read_tensor(gamma, "gamma")?;
            let opts = read_grad_options(opts)?;
            let t = plan(&dy, &x, &rstd, &gamma, &opts, &e.ub)?;
            Ok(t.workspace_bytes)
        })
    }
}

/// RmsNormGrad: `dx = rstd * (g - xh * mean(g * xh)) [+ dres]` with
/// `g = dy * (gamma + gamma_offset)`, `xh = x * rstd`, and the f32
/// `dgamma = sum over rows of dy * xh` (overwritten, or accumulated with
/// `accumulate_dgamma`), optionally also cast to gamma's dtype in
/// `dgamma_cast`. `dres`, `dgamma`, `dgamma_cast` are nullable; `dx`'s data
/// may equal `dy`'s (in place). dgamma is deterministic for a given
/// `exec->blocks`. On error nothing is written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_rms_norm_grad(
    dy: *const RawTensor,
    x: *const RawTensor,
    rstd: *const RawTensor,
    gamma: *const RawTensor,
    dres: *const RawTensor,
    opts: *const npk_rms_norm_grad_options,
    dx: *const RawTensor,
    dgamma: *const RawTensor,
    dgamma_cast: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run(exec, |e| {
            let dy = read_tensor(dy, "dy")?;
            let x = read_tensor(x, "x")?;
            let rstd = read_tensor(rstd, "rstd")?;
            let gamma = read_tensor(gamma, "gamma")?;
            let dres = read_opt_tensor(dres, "dres")?;
            let opts = read_grad_options(opts)?;
            let dx = read_tensor(dx, "dx")?;
            let dgamma = read_opt_tensor(dgamma, "dgamma")?;
            let dgamma_cast = read_opt_tensor(dgamma_cast, "dgamma_cast")?;
            let call = prepare(
                &GradTensors {
                    dy,
                    x,
                    rstd,
                    gamma,
                    dres,
                },
                &opts,
                &GradOutputs {
                    dx,
                    dgamma,
                    dgamma_cast,
                },
                &e.ub,
            )?;
            launch(e, call, workspace, workspace_bytes)
        })
    }
}
