//! RmsNorm's host side: validation and the tiling plan.

use super::*;

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
