//! GeGLU's host side: SwiGLU's operand rule and plan, the optional `gelu`
//! output.

use super::*;
use crate::ops::swiglu::plan::{empty, inputs};
use crate::ops::swiglu::{plan_streams, shaped};
use crate::tensor::no_overlap;

/// Validates the inputs and cuts the plan (what `workspace_size` needs).
pub(crate) fn plan(
    a: &RawTensor,
    b: Option<&RawTensor>,
    opts: &GegluOptions,
    ub: &UbConfig,
) -> Result<EltTiling> {
    Ok(plan_streams(a, b, &opts.operand_rule(), 3, ub)?.1)
}

/// Validates everything and builds the call.
pub(crate) fn prepare(
    a: &RawTensor,
    b: Option<&RawTensor>,
    opts: &GegluOptions,
    y: &RawTensor,
    gelu: Option<&RawTensor>,
    ub: &UbConfig,
) -> Result<GegluCall> {
    // With the gelu output a unit streams 4 tiles, not 3.
    let streams = if gelu.is_some() { 4 } else { 3 };
    let (d, tiling) = plan_streams(a, b, &opts.operand_rule(), streams, ub)?;
    let out = &d.out_dims[..d.ndim];
    let yc = shaped(y, "y", out, d.dtype)?;
    let ins = inputs(a, b)?;
    no_overlap(&yc, ins.iter().flatten())?;
    let g = match gelu {
        Some(g) => {
            let gc = shaped(g, "gelu", out, d.dtype)?;
            no_overlap(&gc, ins.iter().flatten().chain([&yc]))?;
            *g
        }
        None => empty(d.dtype),
    };
    Ok(GegluCall {
        a: *a,
        b: b.copied().unwrap_or(empty(d.dtype)),
        y: *y,
        gelu: g,
        split: d.split as u32,
        activate_left: opts.activate_left as u32,
        approximate: opts.approximate,
        rounding: opts.rounding,
        tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
    })
}
