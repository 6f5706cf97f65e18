//! RmsNorm: `rstd = 1/sqrt(mean(x^2) + eps)`, `y = x * rstd * (gamma + offset)`.

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
mod plan;
pub(crate) mod reference;

pub(crate) use plan::{plan, prepare};

use core::ffi::c_void;

use super::norm::forward::{fwd_out, run_forward, FwdSource};
use super::norm::{
    load_at, load_line, norm_dims, prefetch_pair, rstd_check, same_shape, RmsNormOptions, Rounding,
};
use super::{dispatch_isa, dispatch_xg, launch_into, op_call, workspace_len, Exec};
use crate::dtype::{DType, Float};
use crate::error::Result;
use crate::lanes::{sqrt_f64, Lanes};
use crate::runner::Runner;
use crate::tensor::{no_overlap, out_like, RawTensor, TensorRef};
use crate::tiling::{NormTiling, UbConfig};
use crate::workspace::{Dst, Src};

/// The validated arguments of one RmsNorm (`npk_rms_norm_call`): what a
/// backend, or an adapter's NPU launch, receives.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RmsNormCall {
    /// Input, f32 | f16 | bf16.
    pub x: RawTensor,
    /// Weight: x's trailing dims, x's dtype or f32.
    pub gamma: RawTensor,
    /// Output, x's shape and dtype.
    pub y: RawTensor,
    /// Optional f32 output of `rows` elements (`has_rstd`).
    pub rstd: RawTensor,
    /// 1 when `rstd` is written.
    pub has_rstd: u32,
    /// eps as the f32 added to the mean square.
    pub eps: f32,
    /// Added to gamma.
    pub gamma_offset: f32,
    /// Where y is rounded.
    pub rounding: Rounding,
    /// The tiling plan (TilingData).
    pub tiling: NormTiling,
    /// The caller's workspace (unaligned; kernels align inside).
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

// Rows of length 0 write only their rstd (NaN).
op_call!(
    RmsNormCall,
    |c| c.tiling.rows == 0 || (c.tiling.cols == 0 && c.has_rstd == 0),
    [x, gamma, y, rstd]
);

/// Workspace bytes `rms_norm` needs for these inputs under `exec.ub`.
pub fn rms_norm_workspace_size<T: Float, G: Float>(
    exec: &Exec<'_>,
    x: TensorRef<'_, T>,
    gamma: TensorRef<'_, G>,
    opts: &RmsNormOptions,
) -> Result<usize> {
    let t = plan(&x.raw(), &gamma.raw(), opts, &exec.ub)?;
    workspace_len(t.workspace_bytes)
}

/// RmsNorm over the trailing dims of `x` that `gamma` covers (gamma: x's
/// dtype or f32).
///
/// Outputs: `y` (x's shape and dtype), `rstd` if given (f32, one per row).
/// `workspace` must hold `rms_norm_workspace_size` bytes. On error nothing
/// is written.
pub fn rms_norm<T: Float, G: Float>(
    exec: &Exec<'_>,
    x: TensorRef<'_, T>,
    gamma: TensorRef<'_, G>,
    opts: &RmsNormOptions,
    y: &mut [T],
    rstd: Option<&mut [f32]>,
    workspace: &mut [u8],
) -> Result<()> {
    let yr = out_like(y, x.shape(), "y", "x")?;
    let rr = rstd.map(|r| RawTensor::flat(r.as_mut_ptr() as *mut c_void, DType::F32, r.len()));
    let call = prepare(&x.raw(), &gamma.raw(), opts, &yr, rr.as_ref(), &exec.ub)?;
    launch_into(exec, call, workspace)
}
