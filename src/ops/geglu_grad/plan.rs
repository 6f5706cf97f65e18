//! GeGluGrad's host side: SwiGluGrad's checks (one rule for both), with
//! GeGLU's options.

use super::*;
use crate::ops::swiglu_grad;

/// Validates the inputs and cuts the plan (what `workspace_size` needs).
pub(crate) fn plan(
    dy: &RawTensor,
    a: &RawTensor,
    b: Option<&RawTensor>,
    opts: &GegluOptions,
    ub: &UbConfig,
) -> Result<EltTiling> {
    swiglu_grad::plan(dy, a, b, &opts.operand_rule(), ub)
}

/// Validates everything and builds the call.
pub(crate) fn prepare(
    dy: &RawTensor,
    a: &RawTensor,
    b: Option<&RawTensor>,
    opts: &GegluOptions,
    da: &RawTensor,
    db: Option<&RawTensor>,
    ub: &UbConfig,
) -> Result<GegluGradCall> {
    let c = swiglu_grad::prepare(dy, a, b, &opts.operand_rule(), da, db, ub)?;
    Ok(GegluGradCall {
        dy: c.dy,
        a: c.a,
        b: c.b,
        da: c.da,
        db: c.db,
        split: c.split,
        activate_left: opts.activate_left as u32,
        approximate: opts.approximate,
        rounding: c.rounding,
        tiling: c.tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
    })
}
