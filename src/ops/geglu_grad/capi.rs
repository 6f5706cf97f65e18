//! `npk_geglu_grad_workspace_size` / `npk_geglu_grad`: a skin over
//! `ops::geglu_grad::{plan, prepare}` (the shared shape is `capi::skin`).

use core::ffi::c_void;

use crate::capi::skin::{self, CapiCall, CapiOp};
use crate::capi::types::{npk_exec, npk_status, read_opt_tensor, read_tensor};
use crate::error::Result;
use crate::ops::geglu::capi::{npk_geglu_options, read_geglu_options};
use crate::ops::geglu::GegluOptions;
use crate::ops::geglu_grad::{plan, prepare, GegluGradCall};
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// GeGluGrad's C skin.
struct Skin;

impl CapiOp for Skin {
    type Args = (
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
        *const npk_geglu_options,
    );
    type Inputs = (RawTensor, RawTensor, Option<RawTensor>, GegluOptions);

    unsafe fn read((dy, a, b, opts): Self::Args) -> Result<Self::Inputs> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            Ok((
                read_tensor(dy, "dy")?,
                read_tensor(a, if b.is_null() { "x" } else { "gate" })?,
                read_opt_tensor(b, "up")?,
                read_geglu_options(opts)?,
            ))
        }
    }

    fn plan((dy, a, b, opts): &Self::Inputs, ub: &UbConfig) -> Result<u64> {
        Ok(plan(dy, a, b.as_ref(), opts, ub)?.workspace_bytes)
    }
}

impl CapiCall for Skin {
    type Outputs = (*const RawTensor, *const RawTensor);
    type Call = GegluGradCall;

    unsafe fn prepare(
        (dy, a, b, opts): Self::Inputs,
        (da, db): Self::Outputs,
        ub: &UbConfig,
    ) -> Result<GegluGradCall> {
        // `b` was read as None exactly when it is NULL (the split form).
        let split = b.is_none();
        // SAFETY: every pointer is NULL or valid (this function's contract).
        let (da, db) = unsafe {
            (
                read_tensor(da, if split { "dx" } else { "dgate" })?,
                read_opt_tensor(db, if split { "db" } else { "dup" })?,
            )
        };
        prepare(&dy, &a, b.as_ref(), &opts, &da, db.as_ref(), ub)
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
