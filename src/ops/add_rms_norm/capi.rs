//! `npk_add_rms_norm_workspace_size` / `npk_add_rms_norm`: a skin over
//! `ops::add_rms_norm::{plan, prepare}` (the shared shape is `capi::skin`).

use core::ffi::c_void;

use crate::capi::skin::{self, CapiCall, CapiOp};
use crate::capi::types::{
    npk_exec, npk_rms_norm_options, npk_status, read_norm_options, read_opt_tensor, read_tensor,
};
use crate::error::Result;
use crate::ops::add_rms_norm::{plan, prepare, AddRmsNormCall};
use crate::ops::norm::RmsNormOptions;
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// AddRmsNorm's C skin.
struct Skin;

impl CapiOp for Skin {
    type Args = (
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
        *const npk_rms_norm_options,
    );
    type Inputs = (RawTensor, RawTensor, RawTensor, RmsNormOptions);

    unsafe fn read((x1, x2, gamma, opts): Self::Args) -> Result<Self::Inputs> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            Ok((
                read_tensor(x1, "x1")?,
                read_tensor(x2, "x2")?,
                read_tensor(gamma, "gamma")?,
                read_norm_options(opts)?,
            ))
        }
    }

    fn plan((x1, x2, gamma, opts): &Self::Inputs, ub: &UbConfig) -> Result<u64> {
        Ok(plan(x1, x2, gamma, opts, ub)?.workspace_bytes)
    }
}

impl CapiCall for Skin {
    type Outputs = (*const RawTensor, *const RawTensor, *const RawTensor);
    type Call = AddRmsNormCall;

    unsafe fn prepare(
        (x1, x2, gamma, opts): Self::Inputs,
        (y, rstd, x_sum): Self::Outputs,
        ub: &UbConfig,
    ) -> Result<AddRmsNormCall> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        let (y, rstd, x_sum) = unsafe {
            (
                read_tensor(y, "y")?,
                read_opt_tensor(rstd, "rstd")?,
                read_opt_tensor(x_sum, "x_sum")?,
            )
        };
        let (rstd, x_sum) = (rstd.as_ref(), x_sum.as_ref());
        prepare(&x1, &x2, &gamma, &opts, &y, rstd, x_sum, ub)
    }
}

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
    unsafe { skin::workspace_size::<Skin>((x1, x2, gamma, opts), exec, workspace_bytes) }
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
        skin::launch::<Skin>(
            (x1, x2, gamma, opts),
            (y, rstd, x_sum),
            workspace,
            workspace_bytes,
            exec,
        )
    }
}
