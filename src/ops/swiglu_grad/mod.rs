//! SwiGluGrad: both input gradients of `y = silu(a) * b` in one pass:
//! `da = dy * b * s * (1 + a * (1 - s))` with `s = sigmoid(a)`, and
//! `db = dy * silu(a)`; for the split form (torch_npu's `npu_swiglu`) they
//! are the two halves of `dx`.

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
mod plan;
pub(crate) mod reference;

pub(crate) use plan::{plan, prepare};

use core::ffi::c_void;

use super::elementwise::ElemRounding;
use super::gated::grad_api;
use super::swiglu::{operands, SwigluOptions};
use super::{op_call, Exec};
use crate::dtype::Float;
use crate::error::Result;
use crate::tensor::{RawTensor, TensorRef};
use crate::tiling::{EltTiling, UbConfig};

/// The validated arguments of one SwiGluGrad (`npk_swiglu_grad_call`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SwigluGradCall {
    /// The output gradient: the forward's `y` shape.
    pub dy: RawTensor,
    /// The forward's `a` (the split form: `x`).
    pub a: RawTensor,
    /// The forward's `b`; empty in the split form.
    pub b: RawTensor,
    /// Gradient of `a` (the split form: of `x`, both halves).
    pub da: RawTensor,
    /// Gradient of `b`; empty in the split form.
    pub db: RawTensor,
    /// As `SwigluCall::split` (for the inputs and the outputs alike).
    pub split: u32,
    /// Fused, or eager PyTorch's bits.
    pub rounding: ElemRounding,
    /// The tiling plan: rows x cols of `dy`.
    pub tiling: EltTiling,
    /// The caller's workspace (none is needed).
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

op_call!(SwigluGradCall, |c| c.tiling.units == 0, [dy, a, b, da, db]);

grad_api::grad_op!(SwigluOptions, SwigluGradCall);

/// Workspace bytes `swiglu_grad` needs (always 0).
pub fn swiglu_grad_workspace_size<T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    x: TensorRef<'_, T>,
    opts: &SwigluOptions,
) -> Result<usize> {
    grad_api::split_size::<Op, T>(exec, dy, x, opts)
}

/// The gradient of `swiglu`: `dx` (x's shape) from `dy` (y's shape) and x.
/// On error nothing is written.
pub fn swiglu_grad<T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    x: TensorRef<'_, T>,
    opts: &SwigluOptions,
    dx: &mut [T],
    workspace: &mut [u8],
) -> Result<()> {
    grad_api::split::<Op, T>(exec, dy, x, opts, dx, workspace)
}

/// Workspace bytes `silu_mul_grad` needs (always 0).
pub fn silu_mul_grad_workspace_size<T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    gate: TensorRef<'_, T>,
    up: TensorRef<'_, T>,
    opts: &SwigluOptions,
) -> Result<usize> {
    grad_api::pair_size::<Op, T>(exec, dy, gate, up, opts)
}

/// The gradients of `silu_mul`: `dgate` and `dup` (gate's shape). On error
/// nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn silu_mul_grad<T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    gate: TensorRef<'_, T>,
    up: TensorRef<'_, T>,
    opts: &SwigluOptions,
    dgate: &mut [T],
    dup: &mut [T],
    workspace: &mut [u8],
) -> Result<()> {
    grad_api::pair::<Op, T>(exec, dy, gate, up, opts, dgate, dup, workspace)
}
