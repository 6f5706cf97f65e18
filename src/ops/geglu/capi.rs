//! `npk_geglu_workspace_size` / `npk_geglu`: a skin over
//! `ops::geglu::{plan, prepare}` (the shared shape is `capi::skin`).

#![allow(non_camel_case_types)]

use core::ffi::c_void;

use crate::capi::skin::{self, CapiCall, CapiOp};
use crate::capi::types::{
    elem_rounding, npk_exec, npk_status, read_opt_tensor, read_tensor, RawElemRounding,
};
use crate::error::{invalid_fmt, Result};
use crate::ops::geglu::{plan, prepare, GegluCall, GegluOptions, GeluApproximate};
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// Which GELU (`GeluApproximate`; torch_npu's `approximate`). ABI 2.5.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_gelu_approximate {
    /// `x/2 (1 + erf(x / sqrt 2))`.
    NPK_GELU_NONE = 0,
    /// The tanh form (Gemma's `gelu_pytorch_tanh`).
    NPK_GELU_TANH = 1,
}

const _: () = {
    assert!(npk_gelu_approximate::NPK_GELU_NONE as u32 == GeluApproximate::None as u32);
    assert!(npk_gelu_approximate::NPK_GELU_TANH as u32 == GeluApproximate::Tanh as u32);
};

/// An `npk_gelu_approximate` as the C side may pass it (printed as `npk_gelu_approximate`).
pub type RawGeluApproximate = u32;

/// Options of GeGLU and GeGluGrad. NULL options = `{ -1,
/// NPK_ELEM_ROUNDING_FUSED, NPK_GELU_TANH, 0 }`. ABI 2.5.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_geglu_options {
    /// The split dimension when `b` is NULL (negative counts from the end).
    pub dim: i64,
    /// Fused, or eager PyTorch's bits (gelu rounded to the dtype, then the product).
    pub rounding: RawElemRounding,
    /// Which GELU.
    pub approximate: RawGeluApproximate,
    /// The split form: 1 activates the first half, 0 (torch_npu's default)
    /// the second; ignored when `b` is given.
    pub activate_left: u32,
}

/// Reads optional GeGLU options (NULL = defaults).
///
/// # Safety
/// `p` is NULL or points to a readable `npk_geglu_options`.
pub(crate) unsafe fn read_geglu_options(p: *const npk_geglu_options) -> Result<GegluOptions> {
    if p.is_null() {
        return Ok(GegluOptions::default());
    }
    // SAFETY: non-NULL and readable (caller); every field is a plain number.
    let o = unsafe { p.read_unaligned() };
    let approximate = GeluApproximate::from_u32(o.approximate).ok_or_else(|| {
        invalid_fmt!(
            "approximate",
            "{} is not an npk_gelu_approximate value (0 none, 1 tanh)",
            o.approximate
        )
    })?;
    let activate_left = match o.activate_left {
        0 => false,
        1 => true,
        v => return Err(invalid_fmt!("activate_left", "{v} is not 0 or 1")),
    };
    Ok(GegluOptions {
        dim: o.dim,
        rounding: elem_rounding(o.rounding)?,
        approximate,
        activate_left,
    })
}

/// GeGLU's C skin.
struct Skin;

impl CapiOp for Skin {
    type Args = (*const RawTensor, *const RawTensor, *const npk_geglu_options);
    type Inputs = (RawTensor, Option<RawTensor>, GegluOptions);

    unsafe fn read((a, b, opts): Self::Args) -> Result<Self::Inputs> {
        // `a` is torch_npu's `x` when `b` is NULL (the split form).
        let nb = if b.is_null() { "x" } else { "gate" };
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            Ok((
                read_tensor(a, nb)?,
                read_opt_tensor(b, "up")?,
                read_geglu_options(opts)?,
            ))
        }
    }

    fn plan((a, b, opts): &Self::Inputs, ub: &UbConfig) -> Result<u64> {
        Ok(plan(a, b.as_ref(), opts, ub)?.workspace_bytes)
    }
}

impl CapiCall for Skin {
    type Outputs = (*const RawTensor, *const RawTensor);
    type Call = GegluCall;

    unsafe fn prepare(
        (a, b, opts): Self::Inputs,
        (y, gelu): Self::Outputs,
        ub: &UbConfig,
    ) -> Result<GegluCall> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        let (y, gelu) = unsafe { (read_tensor(y, "y")?, read_opt_tensor(gelu, "gelu")?) };
        prepare(&a, b.as_ref(), &opts, &y, gelu.as_ref(), ub)
    }
}

/// Workspace bytes `npk_geglu` needs (0; the same arguments as the run).
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_geglu_workspace_size(
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_geglu_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::workspace_size::<Skin>((a, b, opts), exec, workspace_bytes) }
}

/// GeGLU: `y = gelu(gate) * up`. With `b` NULL, `a` is torch_npu's `x`,
/// split in halves along `opts->dim`: the gate is the second half (the
/// first with `activate_left`) and `y` has x's shape with that dim halved;
/// else `a` (gate) and `b` (up) share one shape and dtype, which `y` has.
/// `gelu` (NULL: not written) receives `gelu(gate)`, y's shape. f32, f16 or
/// bf16. On error nothing is written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_geglu(
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_geglu_options,
    y: *const RawTensor,
    gelu: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::launch::<Skin>((a, b, opts), (y, gelu), workspace, workspace_bytes, exec) }
}
