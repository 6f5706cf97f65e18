//! GeGLU: `y = gelu(gate) * up` (the Gemma families' MLP), with gate and up
//! the two halves of one tensor along `dim` (torch_npu's `npu_geglu(x, dim,
//! approximate, activate_left)`, which also returns `gelu(gate)`) or two
//! tensors (Hugging Face's `act_fn(gate_proj(x)) * up_proj(x)`,
//! `gelu_mul(gate, up)`). The kernel is SwiGLU's (`ops::gated`) with GELU
//! as the gate's activation.

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
pub(crate) mod plan;
pub(crate) mod reference;

pub(crate) use plan::{plan, prepare};

use core::ffi::c_void;

use super::elementwise::ElemRounding;
use super::gated::{halves, Halves};
use super::{launch_into, op_call, workspace_len, Exec};
use crate::dtype::Float;
use crate::error::Result;
use crate::tensor::{out_like, RawTensor, Shape, TensorRef};
use crate::tiling::{EltTiling, UbConfig};

/// Which GELU (the C ABI's `npk_gelu_approximate`; torch_npu's
/// `approximate` integer, PyTorch's `approximate` string).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum GeluApproximate {
    /// The exact form, `x/2 (1 + erf(x / sqrt 2))` (`"none"`, torch_npu's 0).
    None = 0,
    /// The tanh form (`"tanh"`, torch_npu's 1 and default, Gemma's
    /// `gelu_pytorch_tanh`).
    #[default]
    Tanh = 1,
}

impl GeluApproximate {
    /// The value from the C ABI's integer.
    #[cfg(feature = "capi")]
    pub(crate) fn from_u32(v: u32) -> Option<GeluApproximate> {
        match v {
            0 => Some(GeluApproximate::None),
            1 => Some(GeluApproximate::Tanh),
            _ => None,
        }
    }
}

/// Options of GeGLU and its gradient (`npk_geglu_options`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GegluOptions {
    /// The split dimension of the one-tensor form (negative counts from the
    /// end; torch_npu's default -1). Ignored by the two-tensor form.
    pub dim: i64,
    /// Fused (one rounding) or eager PyTorch's bits (`gelu(gate)` rounded to
    /// the dtype before the product, as Hugging Face's composite).
    pub rounding: ElemRounding,
    /// Which GELU.
    pub approximate: GeluApproximate,
    /// The one-tensor form: true activates the first half (`gelu(x1) *
    /// x2`), false (torch_npu's default) the second (`x1 * gelu(x2)`).
    /// Ignored by the two-tensor form.
    pub activate_left: bool,
}

impl Default for GegluOptions {
    fn default() -> Self {
        GegluOptions {
            dim: -1,
            rounding: ElemRounding::Fused,
            approximate: GeluApproximate::Tanh,
            activate_left: false,
        }
    }
}

impl GegluOptions {
    /// The options the shared operand rule reads (SwiGLU's).
    pub(crate) fn operand_rule(&self) -> super::swiglu::SwigluOptions {
        super::swiglu::SwigluOptions {
            dim: self.dim,
            rounding: self.rounding,
        }
    }
}

/// The validated arguments of one GeGLU (`npk_geglu_call`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GegluCall {
    /// The gate; in the split form, `x` itself (both halves).
    pub a: RawTensor,
    /// The up projection; empty in the split form.
    pub b: RawTensor,
    /// Output: the gate's shape (the split form: `x`'s with `dim` halved).
    pub y: RawTensor,
    /// Optional output `gelu(gate)`, y's shape; when not asked for, an empty
    /// descriptor with NULL `data`.
    pub gelu: RawTensor,
    /// 1: row `r` of `x` is `x[r * 2L ..][..2L]`, its halves `L` long (L =
    /// `tiling.cols`); 0: gate and up are two tensors, rows `L` apart.
    pub split: u32,
    /// The split form: 1 when the gate is the first half, 0 the second.
    pub activate_left: u32,
    /// Which GELU.
    pub approximate: GeluApproximate,
    /// Where y is rounded.
    pub rounding: ElemRounding,
    /// The tiling plan: rows x cols of the output.
    pub tiling: EltTiling,
    /// The caller's workspace (none is needed).
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

op_call!(GegluCall, |c| c.tiling.units == 0, [a, b, y, gelu]);

/// The operand layout of a call (`split`, `activate_left`, row length).
pub(crate) fn layout(split: u32, activate_left: u32, cols: usize) -> Halves {
    halves(split != 0, activate_left != 0, cols)
}

/// Workspace bytes `geglu` needs (always 0; kept for the two-phase pattern).
pub fn geglu_workspace_size<T: Float>(
    exec: &Exec<'_>,
    x: TensorRef<'_, T>,
    opts: &GegluOptions,
) -> Result<usize> {
    let t = plan(&x.raw(), None, opts, &exec.ub)?;
    workspace_len(t.workspace_bytes)
}

/// torch_npu's `npu_geglu(x, dim, approximate, activate_left)`: `y =
/// gelu(g) * u` with `g` the second half of `x` along `dim` and `u` the
/// first (`activate_left`: the other way round); `gelu`, when given,
/// receives `gelu(g)`. `y` and `gelu` have x's shape with `dim` halved. On
/// error nothing is written.
pub fn geglu<T: Float>(
    exec: &Exec<'_>,
    x: TensorRef<'_, T>,
    opts: &GegluOptions,
    y: &mut [T],
    gelu: Option<&mut [T]>,
    workspace: &mut [u8],
) -> Result<()> {
    let d = super::swiglu::operand_dims(&x.raw(), None, &opts.operand_rule())?;
    let ys = Shape::new_named(&d.out_dims[..d.ndim], "y")?;
    let yr = out_like(y, &ys, "y", "x's half")?;
    let gr = match gelu {
        Some(g) => Some(out_like(g, &ys, "gelu", "x's half")?),
        None => None,
    };
    let call = prepare(&x.raw(), None, opts, &yr, gr.as_ref(), &exec.ub)?;
    launch_into(exec, call, workspace)
}

/// Workspace bytes `gelu_mul` needs (always 0).
pub fn gelu_mul_workspace_size<T: Float>(
    exec: &Exec<'_>,
    gate: TensorRef<'_, T>,
    up: TensorRef<'_, T>,
    opts: &GegluOptions,
) -> Result<usize> {
    let t = plan(&gate.raw(), Some(&up.raw()), opts, &exec.ub)?;
    workspace_len(t.workspace_bytes)
}

/// `y = gelu(gate) * up` (gate and up of one shape and dtype; y likewise).
/// On error nothing is written.
pub fn gelu_mul<T: Float>(
    exec: &Exec<'_>,
    gate: TensorRef<'_, T>,
    up: TensorRef<'_, T>,
    opts: &GegluOptions,
    y: &mut [T],
    workspace: &mut [u8],
) -> Result<()> {
    let yr = out_like(y, gate.shape(), "y", "gate")?;
    let call = prepare(&gate.raw(), Some(&up.raw()), opts, &yr, None, &exec.ub)?;
    launch_into(exec, call, workspace)
}
