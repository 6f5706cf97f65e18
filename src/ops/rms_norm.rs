//! RmsNorm: `rstd = 1/sqrt(mean(x^2) + eps)`, `y = x * rstd * (gamma + offset)`.

use core::ffi::c_void;

use super::norm::{
    load_at, norm_dims, prefetch_pair, rstd_check, same_shape, RmsNormOptions, Rounding,
};
use super::norm_fwd::{run_forward, FwdOut, FwdSource};
use super::{dispatch_isa, dispatch_xg, launch, op_call, workspace_len, Exec};
use crate::dtype::{DType, Float};
use crate::error::Result;
use crate::lanes::{sqrt_f64, Isa, Lanes};
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

/// Validates the inputs and cuts the plan (what `workspace_size` needs).
pub(crate) fn plan(
    x: &RawTensor,
    gamma: &RawTensor,
    opts: &RmsNormOptions,
    ub: &UbConfig,
) -> Result<NormTiling> {
    let xc = x.check("x")?;
    let gc = gamma.check("gamma")?;
    let d = norm_dims(x, &xc, gamma, &gc, "x")?;
    opts.eps_f32()?;
    NormTiling::new(d.rows, d.cols, x.dtype.size_bytes(), 1, false, ub)
}

/// Validates everything and builds the call (workspace not yet attached).
pub(crate) fn prepare(
    x: &RawTensor,
    gamma: &RawTensor,
    opts: &RmsNormOptions,
    y: &RawTensor,
    rstd: Option<&RawTensor>,
    ub: &UbConfig,
) -> Result<RmsNormCall> {
    let tiling = plan(x, gamma, opts, ub)?;
    let xc = x.check("x")?;
    let gc = gamma.check("gamma")?;
    let yc = y.check("y")?;
    same_shape(y, &yc, &xc, x.dtype, "y")?;
    no_overlap(&yc, [&xc, &gc])?;
    let mut rstd_t = RawTensor::flat(core::ptr::null_mut(), DType::F32, 0);
    if let Some(r) = rstd {
        let rc = r.check("rstd")?;
        rstd_check(r, &rc, tiling.rows as usize)?;
        no_overlap(&rc, [&xc, &gc, &yc])?;
        rstd_t = *r;
    }
    Ok(RmsNormCall {
        x: *x,
        gamma: *gamma,
        y: *y,
        rstd: rstd_t,
        has_rstd: rstd.is_some() as u32,
        eps: opts.eps_f32()?,
        gamma_offset: opts.gamma_offset,
        rounding: opts.rounding,
        tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
    })
}

// Rows of length 0 write only their rstd (NaN).
op_call!(
    RmsNormCall,
    rms_norm,
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
    launch(
        exec,
        call,
        workspace.as_mut_ptr() as *mut c_void,
        workspace.len(),
    )
}

/// RmsNorm's CopyIn: x itself.
#[derive(Clone, Copy)]
struct XSource<T>(Src<T>);

impl<T: Float> FwdSource<T> for XSource<T> {
    #[inline(always)]
    unsafe fn at<L: Lanes>(&self, at: usize, len: usize) -> L {
        // SAFETY: forwarded; x is never written.
        unsafe { load_at::<L, T>(self.0, at, len) }
    }
    #[inline(always)]
    fn side(&self) -> Option<Dst<T>> {
        None
    }
    #[inline(always)]
    fn prefetch<L: Lanes>(&self, at: usize) {
        prefetch_pair::<L, T>(self.0, at);
    }
}

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &RmsNormCall, isa: Isa, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        dispatch_isa!(isa, L => dispatch_xg!(call.x.dtype, call.gamma.dtype, run::<L>(call, runner)))
    }
}

unsafe fn run<L: Lanes, T: Float, G: Float>(call: &RmsNormCall, runner: &dyn Runner) {
    let o = FwdOut {
        gamma: &call.gamma,
        y: &call.y,
        rstd: (call.has_rstd != 0).then_some(&call.rstd),
        eps: call.eps,
        off: call.gamma_offset,
        rounding: call.rounding,
        tiling: call.tiling,
        workspace: call.workspace,
        workspace_bytes: call.workspace_bytes,
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { run_forward::<L, T, G, _>(XSource(Src(call.x.data as *const T)), &o, runner) }
}

/// The f64 golden model.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &RmsNormCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_xg!(call.x.dtype, call.gamma.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float, G: Float>(call: &RmsNormCall) {
    let (m, n) = (call.tiling.rows as usize, call.tiling.cols as usize);
    // SAFETY: validated lengths; the reference runs alone on one thread.
    let (x, g) = unsafe {
        (
            Src(call.x.data as *const T).get(0, m * n),
            Src(call.gamma.data as *const G).get(0, n),
        )
    };
    let y = Dst(call.y.data as *mut T);
    let off = call.gamma_offset as f64;
    for r in 0..m {
        let xr = &x[r * n..(r + 1) * n];
        let ss: f64 = xr.iter().map(|v| v.to_f64() * v.to_f64()).sum();
        let rstd = 1.0 / sqrt_f64(ss / n as f64 + call.eps as f64);
        if call.has_rstd != 0 {
            // SAFETY: rstd has m elements.
            unsafe { Dst(call.rstd.data as *mut f32).get(r, 1)[0] = rstd as f32 };
        }
        // SAFETY: row r of y; validated not to overlap the inputs.
        let yr = unsafe { y.get(r * n, n) };
        for j in 0..n {
            let h = xr[j].to_f64() * rstd;
            let h = match call.rounding {
                Rounding::Fused => h,
                Rounding::CastBeforeGamma => T::from_f64(h).to_f64(),
            };
            yr[j] = T::from_f64(h * (g[j].to_f64() + off));
        }
    }
}
