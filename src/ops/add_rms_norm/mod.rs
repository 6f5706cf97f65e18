//! AddRmsNorm: `x_sum = round(x1 + x2)`, then RmsNorm of the rounded `x_sum`,
//! so the fused op is bit-identical to add-then-norm. `x_sum` may overwrite
//! `x1` in place (the residual stream).

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
mod plan;
pub(crate) mod reference;

pub(crate) use plan::{plan, prepare};

use core::ffi::c_void;

use super::norm::forward::{fwd_out, run_forward, FwdSource};
use super::norm::{
    load_at, load_line, norm_dims, prefetch_pair, round_to, rstd_check, same_shape, RmsNormOptions,
    Rounding,
};
use super::{dispatch_isa, dispatch_xg, launch_into, op_call, workspace_len, Exec};
use crate::dtype::{DType, Float};
use crate::error::Result;
use crate::lanes::{sqrt_f64, Lanes};
use crate::runner::Runner;
use crate::tensor::{no_overlap, out_like, RawTensor, TensorMut, TensorRef};
use crate::tiling::{NormTiling, UbConfig};
use crate::workspace::{Dst, Src};

/// The validated arguments of one AddRmsNorm (`npk_add_rms_norm_call`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AddRmsNormCall {
    /// First addend, f32 | f16 | bf16.
    pub x1: RawTensor,
    /// Second addend, x1's shape and dtype.
    pub x2: RawTensor,
    /// Weight: the trailing dims, x's dtype or f32.
    pub gamma: RawTensor,
    /// Output, x's shape and dtype.
    pub y: RawTensor,
    /// Optional f32 output, one per row (`has_rstd`).
    pub rstd: RawTensor,
    /// Optional `round(x1 + x2)` (`has_x_sum`); may be `x1` itself.
    pub x_sum: RawTensor,
    /// 1 when `rstd` is written.
    pub has_rstd: u32,
    /// 1 when `x_sum` is written.
    pub has_x_sum: u32,
    /// 1 when `x_sum` is `x1` (in place).
    pub x_sum_in_place: u32,
    /// eps as the f32 added to the mean square.
    pub eps: f32,
    /// Added to gamma.
    pub gamma_offset: f32,
    /// Where y is rounded.
    pub rounding: Rounding,
    /// The tiling plan (TilingData).
    pub tiling: NormTiling,
    /// The caller's workspace.
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

// Rows of length 0 write only their rstd (NaN); x_sum and y are empty.
op_call!(
    AddRmsNormCall,
    |c| c.tiling.rows == 0 || (c.tiling.cols == 0 && c.has_rstd == 0),
    [x1, x2, gamma, y, rstd, x_sum]
);

/// Workspace bytes `add_rms_norm` (and `add_rms_norm_in_place`) needs for
/// these inputs under `exec.ub`.
pub fn add_rms_norm_workspace_size<T: Float, G: Float>(
    exec: &Exec<'_>,
    x1: TensorRef<'_, T>,
    x2: TensorRef<'_, T>,
    gamma: TensorRef<'_, G>,
    opts: &RmsNormOptions,
) -> Result<usize> {
    let t = plan(&x1.raw(), &x2.raw(), &gamma.raw(), opts, &exec.ub)?;
    workspace_len(t.workspace_bytes)
}

/// AddRmsNorm: `x_sum = round(x1 + x2)`, then RmsNorm of `x_sum`. Outputs:
/// `y` (x1's shape and dtype), `rstd` if given (f32, one per row), `x_sum`
/// if given (x1's shape and dtype). `workspace` must hold
/// `add_rms_norm_workspace_size` bytes. On error nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm<T: Float, G: Float>(
    exec: &Exec<'_>,
    x1: TensorRef<'_, T>,
    x2: TensorRef<'_, T>,
    gamma: TensorRef<'_, G>,
    opts: &RmsNormOptions,
    y: &mut [T],
    rstd: Option<&mut [f32]>,
    x_sum: Option<&mut [T]>,
    workspace: &mut [u8],
) -> Result<()> {
    let yr = out_like(y, x1.shape(), "y", "x1")?;
    let sr = match x_sum {
        Some(s) => Some(out_like(s, x1.shape(), "x_sum", "x1")?),
        None => None,
    };
    let rr = rstd.map(|r| RawTensor::flat(r.as_mut_ptr() as *mut c_void, DType::F32, r.len()));
    let call = prepare(
        &x1.raw(),
        &x2.raw(),
        &gamma.raw(),
        opts,
        &yr,
        rr.as_ref(),
        sr.as_ref(),
        &exec.ub,
    )?;
    launch_into(exec, call, workspace)
}

/// AddRmsNorm writing `x_sum` over `x1` (the residual stream update);
/// otherwise as `add_rms_norm`, with the same workspace size.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_in_place<T: Float, G: Float>(
    exec: &Exec<'_>,
    mut x1: TensorMut<'_, T>,
    x2: TensorRef<'_, T>,
    gamma: TensorRef<'_, G>,
    opts: &RmsNormOptions,
    y: &mut [T],
    rstd: Option<&mut [f32]>,
    workspace: &mut [u8],
) -> Result<()> {
    let x1r = x1.raw();
    let yr = out_like(y, x1.shape(), "y", "x1")?;
    let rr = rstd.map(|r| RawTensor::flat(r.as_mut_ptr() as *mut c_void, DType::F32, r.len()));
    let call = prepare(
        &x1r,
        &x2.raw(),
        &gamma.raw(),
        opts,
        &yr,
        rr.as_ref(),
        Some(&x1r),
        &exec.ub,
    )?;
    launch_into(exec, call, workspace)
}
