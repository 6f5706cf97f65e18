//! SwiGLU: `y = silu(a) * b`, with `a` and `b` the two halves of one tensor
//! along `dim` (torch_npu's `npu_swiglu(x, dim)`) or two tensors (Hugging
//! Face's `act_fn(gate_proj(x)) * up_proj(x)`, `silu_mul(gate, up)`).

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
pub(crate) mod plan;
pub(crate) mod reference;

pub(crate) use plan::{operand_dims, plan, plan_streams, prepare, shaped, SwigluDims};

use core::ffi::c_void;

use super::elementwise::ElemRounding;
use super::{launch_into, op_call, workspace_len, Exec};
use crate::dtype::Float;
use crate::error::Result;
use crate::tensor::{out_like, RawTensor, Shape, TensorRef};
use crate::tiling::{EltTiling, UbConfig};

/// Options of SwiGLU and its gradient (`npk_swiglu_options`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwigluOptions {
    /// The split dimension of the one-tensor form (negative counts from the
    /// end; torch_npu's default -1). Ignored by the two-tensor form.
    pub dim: i64,
    /// Fused (one rounding) or eager PyTorch's bits.
    pub rounding: ElemRounding,
}

impl Default for SwigluOptions {
    fn default() -> Self {
        SwigluOptions {
            dim: -1,
            rounding: ElemRounding::Fused,
        }
    }
}

/// The validated arguments of one SwiGLU (`npk_swiglu_call`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SwigluCall {
    /// The gate `a`; in the split form, `x` itself.
    pub a: RawTensor,
    /// The up projection `b`; empty in the split form.
    pub b: RawTensor,
    /// Output: `a`'s shape (the split form: `x`'s with `dim` halved).
    pub y: RawTensor,
    /// 1: row `r` of `a` is `x[r * 2L ..][..L]` and of `b` `x[r * 2L + L ..][..L]`
    /// (L = `tiling.cols`); 0: rows of `a` and `b` are `L` apart.
    pub split: u32,
    /// Where y is rounded.
    pub rounding: ElemRounding,
    /// The tiling plan: rows x cols of the output.
    pub tiling: EltTiling,
    /// The caller's workspace (none is needed).
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

op_call!(SwigluCall, |c| c.tiling.units == 0, [a, b, y]);

/// Where row `r` of each operand starts, in elements from `base`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operands {
    /// Elements between the starts of two rows of a (and b).
    pub stride: usize,
    /// Offset of b from its base (L in the split form).
    pub b_offset: usize,
}

/// The operand layout of a call with `split` and row length `cols`.
pub(crate) fn operands(split: u32, cols: usize) -> Operands {
    if split != 0 {
        Operands {
            stride: 2 * cols,
            b_offset: cols,
        }
    } else {
        Operands {
            stride: cols,
            b_offset: 0,
        }
    }
}

/// Workspace bytes `swiglu` needs (always 0; kept for the two-phase pattern).
pub fn swiglu_workspace_size<T: Float>(
    exec: &Exec<'_>,
    x: TensorRef<'_, T>,
    opts: &SwigluOptions,
) -> Result<usize> {
    let t = plan(&x.raw(), None, opts, &exec.ub)?;
    workspace_len(t.workspace_bytes)
}

/// torch_npu's `npu_swiglu(x, dim)`: `y = silu(a) * b` with `a, b =
/// x.chunk(2, dim)`. `y` has x's shape with `dim` halved. On error nothing
/// is written.
pub fn swiglu<T: Float>(
    exec: &Exec<'_>,
    x: TensorRef<'_, T>,
    opts: &SwigluOptions,
    y: &mut [T],
    workspace: &mut [u8],
) -> Result<()> {
    let d = operand_dims(&x.raw(), None, opts)?;
    let ys = Shape::new_named(&d.out_dims[..d.ndim], "y")?;
    let yr = out_like(y, &ys, "y", "x's half")?;
    let call = prepare(&x.raw(), None, opts, &yr, &exec.ub)?;
    launch_into(exec, call, workspace)
}

/// Workspace bytes `silu_mul` needs (always 0).
pub fn silu_mul_workspace_size<T: Float>(
    exec: &Exec<'_>,
    gate: TensorRef<'_, T>,
    up: TensorRef<'_, T>,
    opts: &SwigluOptions,
) -> Result<usize> {
    let t = plan(&gate.raw(), Some(&up.raw()), opts, &exec.ub)?;
    workspace_len(t.workspace_bytes)
}

/// `y = silu(gate) * up` (gate and up of one shape and dtype; y likewise).
/// On error nothing is written.
pub fn silu_mul<T: Float>(
    exec: &Exec<'_>,
    gate: TensorRef<'_, T>,
    up: TensorRef<'_, T>,
    opts: &SwigluOptions,
    y: &mut [T],
    workspace: &mut [u8],
) -> Result<()> {
    let yr = out_like(y, gate.shape(), "y", "gate")?;
    let call = prepare(&gate.raw(), Some(&up.raw()), opts, &yr, &exec.ub)?;
    launch_into(exec, call, workspace)
}
