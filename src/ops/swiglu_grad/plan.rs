//! SwiGluGrad's host side: the forward's operand rule, dy and the outputs.

use super::*;
use crate::error::invalid;
use crate::ops::swiglu::plan::{empty, inputs};
use crate::ops::swiglu::{plan_streams, shaped, SwigluDims};
use crate::tensor::no_overlap;

/// Validates the inputs and cuts the plan (what `workspace_size` needs).
pub(crate) fn plan(
    dy: &RawTensor,
    a: &RawTensor,
    b: Option<&RawTensor>,
    opts: &SwigluOptions,
    ub: &UbConfig,
) -> Result<EltTiling> {
    Ok(checked(dy, a, b, opts, ub)?.1)
}

fn checked(
    dy: &RawTensor,
    a: &RawTensor,
    b: Option<&RawTensor>,
    opts: &SwigluOptions,
    ub: &UbConfig,
) -> Result<(SwigluDims, EltTiling)> {
    let (d, t) = plan_streams(a, b, opts, 5, ub)?;
    shaped(dy, "dy", &d.out_dims[..d.ndim], d.dtype)?;
    Ok((d, t))
}

/// Validates everything and builds the call.
pub(crate) fn prepare(
    dy: &RawTensor,
    a: &RawTensor,
    b: Option<&RawTensor>,
    opts: &SwigluOptions,
    da: &RawTensor,
    db: Option<&RawTensor>,
    ub: &UbConfig,
) -> Result<SwigluGradCall> {
    let (d, tiling) = checked(dy, a, b, opts, ub)?;
    let dyc = dy.check("dy")?;
    let ins = inputs(a, b)?;
    let (an, bn) = if b.is_some() {
        ("dgate", "dup")
    } else {
        ("dx", "db")
    };
    let ac = a.check(if b.is_some() { "gate" } else { "x" })?;
    let dac = shaped(da, an, ac.shape.dims(), d.dtype)?;
    no_overlap(&dac, ins.iter().flatten().chain([&dyc]))?;
    let dbt = match (b, db) {
        (Some(_), Some(db)) => {
            let dbc = shaped(db, bn, ac.shape.dims(), d.dtype)?;
            no_overlap(&dbc, ins.iter().flatten().chain([&dyc, &dac]))?;
            *db
        }
        (None, None) => empty(d.dtype),
        (Some(_), None) => return Err(crate::error::Error::NullPointer { arg: "dup" }),
        (None, Some(_)) => {
            return Err(invalid(
                "db",
                "must be NULL in the split form (dx holds both halves)",
            ))
        }
    };
    Ok(SwigluGradCall {
        dy: *dy,
        a: *a,
        b: b.copied().unwrap_or(empty(d.dtype)),
        da: *da,
        db: dbt,
        split: d.split as u32,
        rounding: opts.rounding,
        tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
    })
}
