//! `npk_swiglu_workspace_size` / `npk_swiglu`: a skin over
//! `ops::swiglu::{plan, prepare}` (the shared shape is `capi::skin`).

use core::ffi::c_void;

use crate::capi::skin::{self, CapiCall, CapiOp};
use crate::capi::types::{
    elem_rounding, npk_exec, npk_status, read_opt_tensor, read_tensor, RawElemRounding,
};
use crate::error::Result;
use crate::ops::swiglu::{plan, prepare, SwigluCall, SwigluOptions};
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// Options of SwiGLU and SwiGluGrad. NULL options = `{ -1,
/// NPK_ELEM_ROUNDING_FUSED }`. ABI 2.2.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_swiglu_options {
    /// The split dimension when `b` is NULL (negative counts from the end).
    pub dim: i64,
    /// Fused, or eager PyTorch's bits (silu rounded to the dtype, then the product).
    pub rounding: RawElemRounding,
}

/// Reads optional SwiGLU options (NULL = defaults).
///
/// # Safety
/// `p` is NULL or points to a readable `npk_swiglu_options`.
pub(crate) unsafe fn read_swiglu_options(p: *const npk_swiglu_options) -> Result<SwigluOptions> {
    if p.is_null() {
        return Ok(SwigluOptions::default());
    }
    // SAFETY: non-NULL and readable (caller); every field is a plain number.
    let o = unsafe { p.read_unaligned() };
    Ok(SwigluOptions {
        dim: o.dim,
        rounding: elem_rounding(o.rounding)?,
    })
}

/// SwiGLU's C skin.
struct Skin;

impl CapiOp for Skin {
    type Args = (
        *const RawTensor,
        *const RawTensor,
        *const npk_swiglu_options,
    );
    type Inputs = (RawTensor, Option<RawTensor>, SwigluOptions);

    unsafe fn read((a, b, opts): Self::Args) -> Result<Self::Inputs> {
        // `a` is torch_npu's `x` when `b` is NULL (the split form).
        let nb = if b.is_null() { "x" } else { "gate" };
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            Ok((
                read_tensor(a, nb)?,
                read_opt_tensor(b, "up")?,
                read_swiglu_options(opts)?,
            ))
        }
    }

    fn plan((a, b, opts): &Self::Inputs, ub: &UbConfig) -> Result<u64> {
        Ok(plan(a, b.as_ref(), opts, ub)?.workspace_bytes)
    }
}

impl CapiCall for Skin {
    type Outputs = *const RawTensor;
    type Call = SwigluCall;

    unsafe fn prepare(
        (a, b, opts): Self::Inputs,
        y: Self::Outputs,
        ub: &UbConfig,
    ) -> Result<SwigluCall> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        let y = unsafe { read_tensor(y, "y")? };
        prepare(&a, b.as_ref(), &opts, &y, ub)
    }
}

/// Workspace bytes `npk_swiglu` needs (0; the same arguments as the run).
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_swiglu_workspace_size(
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_swiglu_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::workspace_size::<Skin>((a, b, opts), exec, workspace_bytes) }
}

/// SwiGLU: `y = silu(a) * b`. With `b` NULL, `a` is torch_npu's `x`, split
/// in halves along `opts->dim` (`a` the first) and `y` has x's shape with
/// that dim halved; else `a` (gate) and `b` (up) share one shape and dtype,
/// which `y` has. f32, f16 or bf16. On error nothing is written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_swiglu(
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_swiglu_options,
    y: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::launch::<Skin>((a, b, opts), y, workspace, workspace_bytes, exec) }
}
