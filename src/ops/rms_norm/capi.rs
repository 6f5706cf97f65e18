//! `npk_rms_norm_workspace_size` / `npk_rms_norm`: a skin over
//! `ops::rms_norm::{plan, prepare}` (the shared shape is `capi::skin`).

use core::ffi::c_void;

use crate::capi::skin::{self, CapiCall, CapiOp};
use crate::capi::types::{
    npk_exec, npk_rms_norm_options, npk_status, read_norm_options, read_opt_tensor, read_tensor,
};
use crate::error::Result;
use crate::ops::norm::RmsNormOptions;
use crate::ops::rms_norm::{plan, prepare, RmsNormCall};
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// RmsNorm's C skin.
struct Skin;

impl CapiOp for Skin {
    type Args = (
        *const RawTensor,
        *const RawTensor,
        *const npk_rms_norm_options,
    );
    type Inputs = (RawTensor, RawTensor, RmsNormOptions);

    unsafe fn read((x, gamma, opts): Self::Args) -> Result<Self::Inputs> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            Ok((
                read_tensor(x, "x")?,
                read_tensor(gamma, "gamma")?,
                read_norm_options(opts)?,
            ))
        }
    }

    fn plan((x, gamma, opts): &Self::Inputs, ub: &UbConfig) -> Result<u64> {
        Ok(plan(x, gamma, opts, ub)?.workspace_bytes)
    }
}

impl CapiCall for Skin {
    type Outputs = (*const RawTensor, *const RawTensor);
    type Call = RmsNormCall;

    unsafe fn prepare(
        (x, gamma, opts): Self::Inputs,
        (y, rstd): Self::Outputs,
        ub: &UbConfig,
    ) -> Result<RmsNormCall> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        let (y, rstd) = unsafe { (read_tensor(y, "y")?, read_opt_tensor(rstd, "rstd")?) };
        prepare(&x, &gamma, &opts, &y, rstd.as_ref(), ub)
    }
}

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
    unsafe { skin::workspace_size::<Skin>((x, gamma, opts), exec, workspace_bytes) }
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
        skin::launch::<Skin>(
            (x, gamma, opts),
            (y, rstd),
            workspace,
            workspace_bytes,
            exec,
        )
    }
}
