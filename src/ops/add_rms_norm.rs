//! AddRmsNorm: `x_sum = round(x1 + x2)`, then RmsNorm of the rounded `x_sum`,
//! so the fused op is bit-identical to add-then-norm. `x_sum` may overwrite
//! `x1` in place (the residual stream).

use core::ffi::c_void;

use super::norm::{
    load_at, norm_dims, prefetch_pair, round_to, rstd_check, same_shape, RmsNormOptions, Rounding,
};
use super::norm_fwd::{run_forward, FwdOut, FwdSource};
use super::{dispatch_isa, dispatch_xg, launch, op_call, workspace_len, Exec};
use crate::dtype::{DType, Float};
use crate::error::Result;
use crate::lanes::{sqrt_f64, Isa, Lanes};
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

/// Validates the inputs and cuts the plan.
pub(crate) fn plan(
    x1: &RawTensor,
    x2: &RawTensor,
    gamma: &RawTensor,
    opts: &RmsNormOptions,
    ub: &UbConfig,
) -> Result<NormTiling> {
    let c1 = x1.check("x1")?;
    let c2 = x2.check("x2")?;
    let gc = gamma.check("gamma")?;
    let d = norm_dims(x1, &c1, gamma, &gc, "x1")?;
    same_shape(x2, &c2, &c1, x1.dtype, "x2")?;
    opts.eps_f32()?;
    NormTiling::new(d.rows, d.cols, x1.dtype.size_bytes(), 1, false, ub)
}

/// Validates everything and builds the call.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare(
    x1: &RawTensor,
    x2: &RawTensor,
    gamma: &RawTensor,
    opts: &RmsNormOptions,
    y: &RawTensor,
    rstd: Option<&RawTensor>,
    x_sum: Option<&RawTensor>,
    ub: &UbConfig,
) -> Result<AddRmsNormCall> {
    let tiling = plan(x1, x2, gamma, opts, ub)?;
    let c1 = x1.check("x1")?;
    let c2 = x2.check("x2")?;
    let gc = gamma.check("gamma")?;
    let yc = y.check("y")?;
    same_shape(y, &yc, &c1, x1.dtype, "y")?;
    no_overlap(&yc, [&c1, &c2, &gc])?;
    let empty = RawTensor::flat(core::ptr::null_mut(), DType::F32, 0);
    let (mut rstd_t, mut xs_t, mut in_place) = (empty, empty, false);
    let mut outs = [yc; 2];
    let mut n_outs = 1;
    if let Some(s) = x_sum {
        let sc = s.check("x_sum")?;
        same_shape(s, &sc, &c1, x1.dtype, "x_sum")?;
        in_place = sc.same_range(&c1) && sc.bytes > 0;
        if in_place {
            no_overlap(&sc, [&c2, &gc, &yc])?;
        } else {
            no_overlap(&sc, [&c1, &c2, &gc, &yc])?;
        }
        outs[1] = sc;
        n_outs = 2;
        xs_t = *s;
    }
    if let Some(r) = rstd {
        let rc = r.check("rstd")?;
        rstd_check(r, &rc, tiling.rows as usize)?;
        no_overlap(&rc, [&c1, &c2, &gc])?;
        for o in &outs[..n_outs] {
            no_overlap(&rc, [o])?;
        }
        rstd_t = *r;
    }
    Ok(AddRmsNormCall {
        x1: *x1,
        x2: *x2,
        gamma: *gamma,
        y: *y,
        rstd: rstd_t,
        x_sum: xs_t,
        has_rstd: rstd.is_some() as u32,
        has_x_sum: x_sum.is_some() as u32,
        x_sum_in_place: in_place as u32,
        eps: opts.eps_f32()?,
        gamma_offset: opts.gamma_offset,
        rounding: opts.rounding,
        tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
    })
}

// Rows of length 0 write only their rstd (NaN); x_sum and y are empty.
op_call!(
    AddRmsNormCall,
    add_rms_norm,
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
    launch(
        exec,
        call,
        workspace.as_mut_ptr() as *mut c_void,
        workspace.len(),
    )
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
    launch(
        exec,
        call,
        workspace.as_mut_ptr() as *mut c_void,
        workspace.len(),
    )
}

/// AddRmsNorm's CopyIn: round(x1 + x2), written to x_sum by pass 2 (x_sum
/// may be x1: each window of x1 is read before x_sum's is written).
#[derive(Clone, Copy)]
struct AddSource<T> {
    x1: Src<T>,
    x2: Src<T>,
    x_sum: Option<Dst<T>>,
}

impl<T: Float> FwdSource<T> for AddSource<T> {
    #[inline(always)]
    unsafe fn at<L: Lanes>(&self, at: usize, len: usize) -> L {
        // SAFETY: forwarded; the range of x1 is not written before this read.
        let (a, b) = unsafe {
            (
                load_at::<L, T>(self.x1, at, len),
                load_at::<L, T>(self.x2, at, len),
            )
        };
        round_to::<L, T>(a.add(b))
    }
    #[inline(always)]
    fn side(&self) -> Option<Dst<T>> {
        self.x_sum
    }
    #[inline(always)]
    fn prefetch<L: Lanes>(&self, at: usize) {
        prefetch_pair::<L, T>(self.x1, at);
        prefetch_pair::<L, T>(self.x2, at);
    }
}

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &AddRmsNormCall, isa: Isa, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        dispatch_isa!(isa, L => dispatch_xg!(call.x1.dtype, call.gamma.dtype, run::<L>(call, runner)))
    }
}

unsafe fn run<L: Lanes, T: Float, G: Float>(call: &AddRmsNormCall, runner: &dyn Runner) {
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
    unsafe {
        run_forward::<L, T, G, _>(
            AddSource {
                x1: Src(call.x1.data as *const T),
                x2: Src(call.x2.data as *const T),
                x_sum: (call.has_x_sum != 0).then_some(Dst(call.x_sum.data as *mut T)),
            },
            &o,
            runner,
        )
    }
}

/// The f64 golden model (x_sum rounded to x's dtype, then the exact norm).
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &AddRmsNormCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_xg!(call.x1.dtype, call.gamma.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float, G: Float>(call: &AddRmsNormCall) {
    let (m, n) = (call.tiling.rows as usize, call.tiling.cols as usize);
    let (x1, x2) = (call.x1.data as *const T, call.x2.data as *const T);
    let g = call.gamma.data as *const G;
    let off = call.gamma_offset as f64;
    // Raw element reads/writes: x_sum may alias x1, so no slices are formed.
    // SAFETY: i < m*n, inside x1 and x2 (validated lengths).
    let sum = |i: usize| unsafe {
        T::from_f64(x1.add(i).read().to_f64() + x2.add(i).read().to_f64()).to_f64()
    };
    for r in 0..m {
        let ss: f64 = (0..n).map(|j| sum(r * n + j) * sum(r * n + j)).sum();
        let rstd = 1.0 / sqrt_f64(ss / n as f64 + call.eps as f64);
        if call.has_rstd != 0 {
            // SAFETY: rstd has m elements.
            unsafe { (call.rstd.data as *mut f32).add(r).write(rstd as f32) };
        }
        for j in 0..n {
            let i = r * n + j;
            let s = sum(i);
            let h = s * rstd;
            let h = match call.rounding {
                Rounding::Fused => h,
                Rounding::CastBeforeGamma => T::from_f64(h).to_f64(),
            };
            // SAFETY: as above.
            unsafe {
                let gj = g.add(j).read().to_f64() + off;
                (call.y.data as *mut T).add(i).write(T::from_f64(h * gj));
                if call.has_x_sum != 0 {
                    (call.x_sum.data as *mut T).add(i).write(T::from_f64(s));
                }
            }
        }
    }
}
