//! `npk_rms_norm_grad_workspace_size` / `npk_rms_norm_grad`: a skin over
//! `ops::rms_norm_grad::{plan, prepare}` (the shared shape is `capi::skin`).

use core::ffi::c_void;

use crate::capi::skin::{self, CapiCall, CapiOp};
use crate::capi::types::{
    npk_exec, npk_rms_norm_grad_options, npk_status, read_grad_options, read_opt_tensor,
    read_tensor,
};
use crate::error::Result;
use crate::ops::rms_norm_grad::{
    plan, prepare, GradOutputs, GradTensors, RmsNormGradCall, RmsNormGradOptions,
};
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// RmsNormGrad's C skin.
struct Skin;

impl CapiOp for Skin {
    /// dy, x, rstd, gamma, dres (read before the options, as the run always
    /// has; the size call has none: NULL), options.
    type Args = (
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
        *const npk_rms_norm_grad_options,
    );
    type Inputs = (GradTensors, RmsNormGradOptions);

    unsafe fn read((dy, x, rstd, gamma, dres, opts): Self::Args) -> Result<Self::Inputs> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            let t = GradTensors {
                dy: read_tensor(dy, "dy")?,
                x: read_tensor(x, "x")?,
                rstd: read_tensor(rstd, "rstd")?,
                gamma: read_tensor(gamma, "gamma")?,
                dres: read_opt_tensor(dres, "dres")?,
            };
            Ok((t, read_grad_options(opts)?))
        }
    }

    fn plan((t, opts): &Self::Inputs, ub: &UbConfig) -> Result<u64> {
        Ok(plan(&t.dy, &t.x, &t.rstd, &t.gamma, opts, ub)?.workspace_bytes)
    }
}

impl CapiCall for Skin {
    type Outputs = (*const RawTensor, *const RawTensor, *const RawTensor);
    type Call = RmsNormGradCall;

    unsafe fn prepare(
        (t, opts): Self::Inputs,
        (dx, dgamma, dgamma_cast): Self::Outputs,
        ub: &UbConfig,
    ) -> Result<RmsNormGradCall> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        let outs = unsafe {
            GradOutputs {
                dx: read_tensor(dx, "dx")?,
                dgamma: read_opt_tensor(dgamma, "dgamma")?,
                dgamma_cast: read_opt_tensor(dgamma_cast, "dgamma_cast")?,
            }
        };
        prepare(&t, &opts, &outs, ub)
    }
}

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
    let dres = core::ptr::null();
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::workspace_size::<Skin>((dy, x, rstd, gamma, dres, opts), exec, workspace_bytes) }
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
        skin::launch::<Skin>(
            (dy, x, rstd, gamma, dres, opts),
            (dx, dgamma, dgamma_cast),
            workspace,
            workspace_bytes,
            exec,
        )
    }
}
