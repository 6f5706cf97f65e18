//! SwiGLU's host side (shared with SwiGluGrad): the operand rule and the plan.

use super::*;
use crate::dtype::DType;
use crate::error::{dtype_err, invalid_fmt};
use crate::tensor::{no_overlap, Checked, MAX_DIMS};

/// The shapes of one SwiGLU: rows x cols of the output, and its dims.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SwigluDims {
    pub rows: usize,
    pub cols: usize,
    /// The output's (and b's, a's in the two-tensor form) dims.
    pub out_dims: [usize; MAX_DIMS],
    pub ndim: usize,
    pub split: bool,
    pub dtype: DType,
}

/// Checks `a` (and `b`, or the split of `a` along `opts.dim`).
pub(crate) fn operand_dims(
    a: &RawTensor,
    b: Option<&RawTensor>,
    opts: &SwigluOptions,
) -> Result<SwigluDims> {
    let name = if b.is_some() { "gate" } else { "x" };
    let ac = a.check(name)?;
    if !a.dtype.is_float() {
        return Err(dtype_err!(
            name,
            "dtype {} is not f32, f16 or bf16",
            a.dtype
        ));
    }
    let dims = ac.shape.dims();
    let nd = dims.len();
    let mut out = [0usize; MAX_DIMS];
    out[..nd].copy_from_slice(dims);
    if let Some(b) = b {
        let bc = b.check("up")?;
        super::super::norm::same_shape(b, &bc, &ac, a.dtype, "up")?;
        let cols = dims[nd - 1];
        let rows = ac.numel.checked_div(cols).unwrap_or(0);
        return Ok(SwigluDims {
            rows,
            cols,
            out_dims: out,
            ndim: nd,
            split: false,
            dtype: a.dtype,
        });
    }
    let d = if opts.dim < 0 {
        opts.dim + nd as i64
    } else {
        opts.dim
    };
    if d < 0 || d >= nd as i64 {
        return Err(invalid_fmt!(
            "dim",
            "{} is out of range for x of rank {nd}",
            opts.dim
        ));
    }
    let d = d as usize;
    if dims[d] % 2 != 0 {
        return Err(invalid_fmt!(
            "x",
            "shape {} has an odd size along dim {} (it is split in halves)",
            ac.shape,
            opts.dim
        ));
    }
    out[d] = dims[d] / 2;
    let rows: usize = dims[..d].iter().product();
    let cols: usize = out[d..nd].iter().product();
    Ok(SwigluDims {
        rows,
        cols,
        out_dims: out,
        ndim: nd,
        split: true,
        dtype: a.dtype,
    })
}

/// Checks that `t` (named `name`) has the given dims and dtype.
pub(crate) fn shaped(
    t: &RawTensor,
    name: &'static str,
    dims: &[usize],
    dtype: DType,
) -> Result<Checked> {
    let tc = t.check(name)?;
    if t.dtype != dtype {
        return Err(dtype_err!(name, "dtype {} is not {dtype}", t.dtype));
    }
    if tc.shape.dims() != dims {
        let want = Shape::new(dims)?;
        return Err(invalid_fmt!(name, "shape {} is not {want}", tc.shape));
    }
    Ok(tc)
}

/// Validates the inputs and cuts the plan; `streams` is the f32 tiles a
/// unit needs (3 forward, 5 backward).
pub(crate) fn plan_streams(
    a: &RawTensor,
    b: Option<&RawTensor>,
    opts: &SwigluOptions,
    streams: usize,
    ub: &UbConfig,
) -> Result<(SwigluDims, EltTiling)> {
    let d = operand_dims(a, b, opts)?;
    let bytes = d
        .rows
        .saturating_mul(d.cols)
        .saturating_mul(d.dtype.size_bytes());
    let t = EltTiling::new(d.rows, d.cols, streams, false, bytes, bytes, ub)?;
    Ok((d, t))
}

/// Validates the inputs and cuts the plan (what `workspace_size` needs).
pub(crate) fn plan(
    a: &RawTensor,
    b: Option<&RawTensor>,
    opts: &SwigluOptions,
    ub: &UbConfig,
) -> Result<EltTiling> {
    Ok(plan_streams(a, b, opts, 3, ub)?.1)
}

/// The inputs as checked descriptors, for overlap checks.
pub(crate) fn inputs(a: &RawTensor, b: Option<&RawTensor>) -> Result<[Option<Checked>; 2]> {
    let an = if b.is_some() { "gate" } else { "x" };
    Ok([Some(a.check(an)?), b.map(|b| b.check("up")).transpose()?])
}

/// An empty descriptor (the split form's `b`, an absent output).
pub(crate) fn empty(dtype: DType) -> RawTensor {
    RawTensor::flat(core::ptr::null_mut(), dtype, 0)
}

/// Validates everything and builds the call.
pub(crate) fn prepare(
    a: &RawTensor,
    b: Option<&RawTensor>,
    opts: &SwigluOptions,
    y: &RawTensor,
    ub: &UbConfig,
) -> Result<SwigluCall> {
    let (d, tiling) = plan_streams(a, b, opts, 3, ub)?;
    let yc = shaped(y, "y", &d.out_dims[..d.ndim], d.dtype)?;
    no_overlap(&yc, inputs(a, b)?.iter().flatten())?;
    Ok(SwigluCall {
        a: *a,
        b: b.copied().unwrap_or(empty(d.dtype)),
        y: *y,
        split: d.split as u32,
        rounding: opts.rounding,
        tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
    })
}
