//! GeGluGrad: both input gradients of `y = gelu(a) * b` in one pass:
//! `da = dy * b * gelu'(a)` and `db = dy * gelu(a)`; for the split form
//! (torch_npu's `npu_geglu`) they are the two halves of `dx`. The kernel is
//! SwiGluGrad's (`ops::gated`) with GELU as the gate's activation.

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
mod plan;
pub(crate) mod reference;

pub(crate) use plan::{plan, prepare};

use core::ffi::c_void;

use super::elementwise::ElemRounding;
use super::gated::grad_api;
use super::geglu::{layout, GegluOptions, GeluApproximate};
use super::{op_call, Exec};
use crate::dtype::Float;
use crate::error::Result;
use crate::tensor::{RawTensor, TensorRef};
use crate::tiling::{EltTiling, UbConfig};

/// The validated arguments of one GeGluGrad (`npk_geglu_grad_call`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GegluGradCall {
    /// The output gradient: the forward's `y` shape.
    pub dy: RawTensor,
    /// The forward's gate (the split form: `x`).
    pub a: RawTensor,
    /// The forward's up; empty in the split form.
    pub b: RawTensor,
    /// Gradient of the gate (the split form: of `x`, both halves).
    pub da: RawTensor,
    /// Gradient of up; empty in the split form.
    pub db: RawTensor,
    /// As `GegluCall::split` (for the inputs and the outputs alike).
    pub split: u32,
    /// As `GegluCall::activate_left`.
    pub activate_left: u32,
    /// Which GELU.
    pub approximate: GeluApproximate,
    /// Fused, or eager PyTorch's bits.
    pub rounding: ElemRounding,
    /// The tiling plan: rows x cols of `dy`.
    pub tiling: EltTiling,
    /// The caller's workspace (none is needed).
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

op_call!(GegluGradCall, |c| c.tiling.units == 0, [dy, a, b, da, db]);

grad_api::grad_op!(GegluOptions, GegluGradCall);

/// Workspace bytes `geglu_grad` needs (always 0).
pub fn geglu_grad_workspace_size<T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    x: TensorRef<'_, T>,
    opts: &GegluOptions,
) -> Result<usize> {
    grad_api::split_size::<Op, T>(exec, dy, x, opts)
}

/// The gradient of `geglu`: `dx` (x's shape) from `dy` (y's shape) and x.
/// On error nothing is written.
pub fn geglu_grad<T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    x: TensorRef<'_, T>,
    opts: &GegluOptions,
    dx: &mut [T],
    workspace: &mut [u8],
) -> Result<()> {
    grad_api::split::<Op, T>(exec, dy, x, opts, dx, workspace)
}

/// Workspace bytes `gelu_mul_grad` needs (always 0).
pub fn gelu_mul_grad_workspace_size<T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    gate: TensorRef<'_, T>,
    up: TensorRef<'_, T>,
    opts: &GegluOptions,
) -> Result<usize> {
    grad_api::pair_size::<Op, T>(exec, dy, gate, up, opts)
}

/// The gradients of `gelu_mul`: `dgate` and `dup` (gate's shape). On error
/// nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn gelu_mul_grad<T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    gate: TensorRef<'_, T>,
    up: TensorRef<'_, T>,
    opts: &GegluOptions,
    dgate: &mut [T],
    dup: &mut [T],
    workspace: &mut [u8],
) -> Result<()> {
    grad_api::pair::<Op, T>(exec, dy, gate, up, opts, dgate, dup, workspace)
}
