//! RoPE's host side: the broadcast rule and the plan.

use super::*;
use crate::dtype::{gamma_dtype_ok, DType};
use crate::error::{dtype_err, invalid, invalid_fmt};
use crate::ops::swiglu::plan::empty;
use crate::ops::swiglu::shaped;
use crate::tensor::{no_overlap, Checked};

/// Rows (of head_dim) of x, after checking x against cos.
fn rows_of(
    x: &RawTensor,
    xc: &Checked,
    cc: &Checked,
    dtype: DType,
    name: &'static str,
) -> Result<usize> {
    if x.dtype != dtype {
        return Err(dtype_err!(name, "dtype {} is not q's {dtype}", x.dtype));
    }
    let (xd, cd) = (xc.shape.dims(), cc.shape.dims());
    let fits = cd.len() <= xd.len()
        && cd
            .iter()
            .rev()
            .zip(xd.iter().rev())
            .enumerate()
            .all(|(i, (c, d))| c == d || (i > 0 && *c == 1));
    if !fits {
        return Err(invalid_fmt!(
            name,
            "shape {} does not take cos/sin of shape {} (right-aligned: the last dims equal, the others equal or 1)",
            xc.shape,
            cc.shape
        ));
    }
    let d = xd[xd.len() - 1];
    Ok(xc.numel.checked_div(d).unwrap_or(0))
}

/// Checks everything the plan depends on; returns (q rows, k rows, plan).
fn checked(
    q: &RawTensor,
    k: Option<&RawTensor>,
    cos: &RawTensor,
    sin: &RawTensor,
    ub: &UbConfig,
) -> Result<(usize, EltTiling)> {
    let qc = q.check("q")?;
    if !q.dtype.is_float() {
        return Err(dtype_err!("q", "dtype {} is not f32, f16 or bf16", q.dtype));
    }
    let cc = cos.check("cos")?;
    if !gamma_dtype_ok(q.dtype, cos.dtype) {
        return Err(dtype_err!(
            "cos",
            "dtype {} is neither q's ({}) nor f32",
            cos.dtype,
            q.dtype
        ));
    }
    shaped(sin, "sin", cc.shape.dims(), cos.dtype)?;
    let d = *qc.shape.dims().last().unwrap_or(&0);
    if d % 2 != 0 {
        return Err(invalid_fmt!(
            "q",
            "head_dim {d} is odd (rotate-half pairs its two halves)"
        ));
    }
    let qr = rows_of(q, &qc, &cc, q.dtype, "q")?;
    let kr = match k {
        Some(k) => {
            let kc = k.check("k")?;
            rows_of(k, &kc, &cc, q.dtype, "k")?
        }
        None => 0,
    };
    let rows = qr
        .checked_add(kr)
        .ok_or(crate::error::Error::SizeOverflow { arg: "k" })?;
    let bytes = rows.saturating_mul(d).saturating_mul(q.dtype.size_bytes());
    let t = EltTiling::new(rows, d, 4, true, bytes, bytes, ub)?;
    Ok((qr, t))
}

/// Validates the inputs and cuts the plan (what `workspace_size` needs).
pub(crate) fn plan(
    q: &RawTensor,
    k: Option<&RawTensor>,
    cos: &RawTensor,
    sin: &RawTensor,
    _opts: &RopeOptions,
    ub: &UbConfig,
) -> Result<EltTiling> {
    Ok(checked(q, k, cos, sin, ub)?.1)
}

/// Validates everything and builds the call.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare(
    q: &RawTensor,
    k: Option<&RawTensor>,
    cos: &RawTensor,
    sin: &RawTensor,
    opts: &RopeOptions,
    q_out: &RawTensor,
    k_out: Option<&RawTensor>,
    ub: &UbConfig,
) -> Result<RopeCall> {
    let (q_rows, tiling) = checked(q, k, cos, sin, ub)?;
    let qc = q.check("q")?;
    let kc = k.map(|k| k.check("k")).transpose()?;
    let ins = [
        Some(qc),
        kc,
        Some(cos.check("cos")?),
        Some(sin.check("sin")?),
    ];
    let qo = shaped(q_out, "q_out", qc.shape.dims(), q.dtype)?;
    no_overlap(&qo, ins.iter().flatten())?;
    let ko = match (kc, k_out) {
        (Some(kc), Some(o)) => {
            let oc = shaped(o, "k_out", kc.shape.dims(), q.dtype)?;
            no_overlap(&oc, ins.iter().flatten().chain([&qo]))?;
            *o
        }
        (None, None) => empty(q.dtype),
        (Some(_), None) => return Err(crate::error::Error::NullPointer { arg: "k_out" }),
        (None, Some(_)) => return Err(invalid("k_out", "given without k")),
    };
    Ok(RopeCall {
        q: *q,
        k: k.copied().unwrap_or(empty(q.dtype)),
        cos: *cos,
        sin: *sin,
        q_out: *q_out,
        k_out: ko,
        q_rows: q_rows as u64,
        backward: opts.backward as u32,
        rounding: opts.rounding,
        tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
    })
}
