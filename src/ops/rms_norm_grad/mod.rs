//! RmsNormGrad: with `g = dy * (gamma + offset)`, `xh = x * rstd`,
//! `c = sum_j(g * xh) / N`: `dx = rstd * (g - xh * c) [+ dres]` and
//! `dgamma = sum_m(dy * xh)` (f32). dgamma partials are per block (fixed by the
//! plan, not by threads) and summed in block order: deterministic.

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
mod plan;
pub(crate) mod reference;

pub(crate) use plan::{plan, prepare, GradOutputs, GradTensors};

use core::ffi::c_void;

use super::norm::{
    arena_group, first_lanes, for_lines, fuse_rows, gamma_at, load_at, load_group, norm_dims,
    prefetch_pair, put_pair, rstd_check, same_shape, store_at, store_tail,
};
use super::{dispatch_isa, dispatch_xg, launch_into, op_call, workspace_len, Exec};
use crate::dtype::{DType, Float};
use crate::error::{dtype_err, invalid, invalid_fmt, Result};
use crate::lanes::{fused_row, push_groups, Lanes, RowSum, GROUP};
use crate::runner::Runner;
use crate::tensor::{no_overlap, out_like, Checked, RawTensor, TensorMut, TensorRef};
use crate::tiling::{NormTiling, UbConfig};
use crate::workspace::{Dst, Src, Workspace};

/// What happens to an existing dgamma (`accumulate_dgamma` in the C ABI).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DgammaMode {
    /// `dgamma = sum`.
    #[default]
    Overwrite,
    /// `dgamma += sum` (gradient accumulation into an fp32 main grad).
    Accumulate,
}

/// Options of RmsNormGrad (`npk_rms_norm_grad_options`).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct RmsNormGradOptions {
    /// The forward's gamma offset. Default 0.0.
    pub gamma_offset: f32,
    /// Overwrite (default) or accumulate dgamma.
    pub dgamma_mode: DgammaMode,
}

/// The validated arguments of one RmsNormGrad (`npk_rms_norm_grad_call`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RmsNormGradCall {
    /// Upstream gradient, x's shape and dtype.
    pub dy: RawTensor,
    /// Forward input.
    pub x: RawTensor,
    /// Forward rstd, f32, one per row.
    pub rstd: RawTensor,
    /// Weight: the trailing dims of x, x's dtype or f32.
    pub gamma: RawTensor,
    /// Optional residual gradient added to dx (`has_dres`).
    pub dres: RawTensor,
    /// Output, x's shape and dtype; may be dy itself.
    pub dx: RawTensor,
    /// Optional f32 output, gamma's shape (`has_dgamma`).
    pub dgamma: RawTensor,
    /// Optional output in gamma's dtype and shape (`has_dgamma_cast`).
    pub dgamma_cast: RawTensor,
    /// 1 when `dres` is read.
    pub has_dres: u32,
    /// 1 when `dgamma` is written.
    pub has_dgamma: u32,
    /// 1 when `dgamma_cast` is written.
    pub has_dgamma_cast: u32,
    /// 1 when dx is dy (in place).
    pub dx_in_place: u32,
    /// 1: `dgamma += sum`; 0: `dgamma = sum`.
    pub accumulate_dgamma: u32,
    /// The forward's gamma offset.
    pub gamma_offset: f32,
    /// The tiling plan (TilingData); dgamma partials live in the workspace.
    pub tiling: NormTiling,
    /// The caller's workspace.
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

// Rows of length 0: dx, dgamma and dgamma_cast are all empty. No rows and
// no dgamma output: dx is empty.
op_call!(
    RmsNormGradCall,
    |c| c.tiling.cols == 0 || (c.tiling.rows == 0 && c.has_dgamma == 0 && c.has_dgamma_cast == 0),
    [dy, x, rstd, gamma, dres, dx, dgamma, dgamma_cast]
);

/// The tensors RmsNormGrad reads besides `dy`: the forward's `x`, `rstd`
/// (f32, one per row, any shape with that many elements) and `gamma`, and an
/// optional residual gradient `dres` (x's shape) added to dx.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormGradInputs<'a, T, G> {
    /// The forward's input.
    pub x: TensorRef<'a, T>,
    /// The forward's rstd.
    pub rstd: TensorRef<'a, f32>,
    /// The weight.
    pub gamma: TensorRef<'a, G>,
    /// Added to dx when given.
    pub dres: Option<TensorRef<'a, T>>,
}

impl<'a, T, G> RmsNormGradInputs<'a, T, G> {
    /// `x`, `rstd`, `gamma`, no `dres`.
    pub fn new(x: TensorRef<'a, T>, rstd: TensorRef<'a, f32>, gamma: TensorRef<'a, G>) -> Self {
        RmsNormGradInputs {
            x,
            rstd,
            gamma,
            dres: None,
        }
    }

    /// The same with `dres` added to dx.
    pub fn with_dres(self, dres: TensorRef<'a, T>) -> Self {
        RmsNormGradInputs {
            dres: Some(dres),
            ..self
        }
    }
}

/// RmsNormGrad's parameter-gradient outputs, both optional (`Default`:
/// neither): `dgamma` (f32, gamma's shape; with `DgammaMode::Accumulate`
/// its old value is added) and `dgamma_cast` (gamma's dtype and shape).
#[derive(Debug)]
pub struct DgammaOut<'a, G> {
    /// The f32 dgamma.
    pub dgamma: Option<&'a mut [f32]>,
    /// dgamma rounded to gamma's dtype.
    pub dgamma_cast: Option<&'a mut [G]>,
}

impl<G> Default for DgammaOut<'_, G> {
    fn default() -> Self {
        DgammaOut {
            dgamma: None,
            dgamma_cast: None,
        }
    }
}

/// Workspace bytes `rms_norm_grad` (and `rms_norm_grad_in_place`) needs
/// for these inputs under `exec.ub`: per-block arenas and dgamma partials.
pub fn rms_norm_grad_workspace_size<T: Float, G: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    inputs: &RmsNormGradInputs<'_, T, G>,
    opts: &RmsNormGradOptions,
) -> Result<usize> {
    let x = inputs.x;
    if let Some(d) = inputs.dres.filter(|d| d.shape() != x.shape()) {
        return Err(invalid_fmt!(
            "dres",
            "shape {} differs from x's {}",
            d.shape(),
            x.shape()
        ));
    }
    let t = plan(
        &dy.raw(),
        &x.raw(),
        &inputs.rstd.raw(),
        &inputs.gamma.raw(),
        opts,
        &exec.ub,
    )?;
    workspace_len(t.workspace_bytes)
}

/// RmsNormGrad: `dx` (x's shape and dtype) and the optional `dgamma` outputs
/// from `dy` and `inputs`. `workspace` must hold
/// `rms_norm_grad_workspace_size` bytes. On error nothing is written.
pub fn rms_norm_grad<T: Float, G: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    inputs: &RmsNormGradInputs<'_, T, G>,
    opts: &RmsNormGradOptions,
    dx: &mut [T],
    dgamma: DgammaOut<'_, G>,
    workspace: &mut [u8],
) -> Result<()> {
    let dxr = out_like(dx, inputs.x.shape(), "dx", "x")?;
    grad_with(exec, &dy.raw(), dxr, inputs, opts, dgamma, workspace)
}

/// RmsNormGrad writing dx over `dy_dx` (which holds dy on entry); otherwise
/// as `rms_norm_grad`, with the same workspace size.
pub fn rms_norm_grad_in_place<T: Float, G: Float>(
    exec: &Exec<'_>,
    mut dy_dx: TensorMut<'_, T>,
    inputs: &RmsNormGradInputs<'_, T, G>,
    opts: &RmsNormGradOptions,
    dgamma: DgammaOut<'_, G>,
    workspace: &mut [u8],
) -> Result<()> {
    let d = dy_dx.raw();
    grad_with(exec, &d, d, inputs, opts, dgamma, workspace)
}

fn grad_with<T: Float, G: Float>(
    exec: &Exec<'_>,
    dy: &RawTensor,
    dx: RawTensor,
    inputs: &RmsNormGradInputs<'_, T, G>,
    opts: &RmsNormGradOptions,
    out: DgammaOut<'_, G>,
    workspace: &mut [u8],
) -> Result<()> {
    let gamma = inputs.gamma;
    let dg = match out.dgamma {
        Some(s) => Some(out_like(s, gamma.shape(), "dgamma", "gamma")?),
        None => None,
    };
    let dgc = match out.dgamma_cast {
        Some(s) => Some(out_like(s, gamma.shape(), "dgamma_cast", "gamma")?),
        None => None,
    };
    let call = prepare(
        &GradTensors {
            dy: *dy,
            x: inputs.x.raw(),
            rstd: inputs.rstd.raw(),
            gamma: gamma.raw(),
            dres: inputs.dres.map(|v| v.raw()),
        },
        opts,
        &GradOutputs {
            dx,
            dgamma: dg,
            dgamma_cast: dgc,
        },
        &exec.ub,
    )?;
    launch_into(exec, call, workspace)
}
