//! AddRmsNorm's host side: validation and the tiling plan.

use super::*;

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
