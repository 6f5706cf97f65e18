//! RmsNormGrad's host side: validation and the tiling plan.

use super::*;

/// Validates the inputs and cuts the plan.
pub(crate) fn plan(
    dy: &RawTensor,
    x: &RawTensor,
    rstd: &RawTensor,
    gamma: &RawTensor,
    opts: &RmsNormGradOptions,
    ub: &UbConfig,
) -> Result<NormTiling> {
    let dyc = dy.check("dy")?;
    let xc = x.check("x")?;
    let rc = rstd.check("rstd")?;
    let gc = gamma.check("gamma")?;
    let d = norm_dims(x, &xc, gamma, &gc, "x")?;
    same_shape(dy, &dyc, &xc, x.dtype, "dy")?;
    rstd_check(rstd, &rc, d.rows)?;
    if !opts.gamma_offset.is_finite() {
        return Err(invalid_fmt!(
            "gamma_offset",
            "{} is not finite",
            opts.gamma_offset
        ));
    }
    NormTiling::new(d.rows, d.cols, x.dtype.size_bytes(), 2, true, ub)
}

/// RmsNormGrad's input descriptors (the front ends' common form).
pub(crate) struct GradTensors {
    pub dy: RawTensor,
    pub x: RawTensor,
    pub rstd: RawTensor,
    pub gamma: RawTensor,
    pub dres: Option<RawTensor>,
}

/// RmsNormGrad's output descriptors.
pub(crate) struct GradOutputs {
    pub dx: RawTensor,
    pub dgamma: Option<RawTensor>,
    pub dgamma_cast: Option<RawTensor>,
}

/// A dgamma-like output `c`: gamma's shape, and disjoint from `others` (the
/// inputs, then the earlier outputs, checked in that order).
fn gamma_shaped_out<'a>(
    c: &Checked,
    gamma: &Checked,
    others: impl IntoIterator<Item = &'a Checked>,
) -> Result<()> {
    if c.shape != gamma.shape {
        return Err(invalid_fmt!(
            c.name,
            "shape {} differs from gamma's {}",
            c.shape,
            gamma.shape
        ));
    }
    no_overlap(c, others)
}

/// Validates everything and builds the call.
pub(crate) fn prepare(
    ins: &GradTensors,
    opts: &RmsNormGradOptions,
    outs: &GradOutputs,
    ub: &UbConfig,
) -> Result<RmsNormGradCall> {
    let (dy, x, rstd, gamma, dres) = (&ins.dy, &ins.x, &ins.rstd, &ins.gamma, ins.dres.as_ref());
    let (dx, dgamma, dgamma_cast) = (&outs.dx, outs.dgamma.as_ref(), outs.dgamma_cast.as_ref());
    let tiling = plan(dy, x, rstd, gamma, opts, ub)?;
    let dyc = dy.check("dy")?;
    let xc = x.check("x")?;
    let rc = rstd.check("rstd")?;
    let gc = gamma.check("gamma")?;
    let empty = RawTensor::flat(core::ptr::null_mut(), DType::F32, 0);
    let mut ins: [Checked; 5] = [dyc, xc, rc, gc, gc];
    let mut n_ins = 4;
    let mut dres_t = empty;
    if let Some(d) = dres {
        let dc = d.check("dres")?;
        same_shape(d, &dc, &xc, x.dtype, "dres")?;
        ins[4] = dc;
        n_ins = 5;
        dres_t = *d;
    }
    let ins = &ins[..n_ins];
    let dxc = dx.check("dx")?;
    same_shape(dx, &dxc, &xc, x.dtype, "dx")?;
    let in_place = dxc.same_range(&dyc) && dxc.bytes > 0;
    // In place, dx may be dy exactly; it must still not touch x, rstd, gamma, dres.
    let skip = usize::from(in_place);
    for i in &ins[skip..] {
        no_overlap(&dxc, [i])?;
    }
    let mut outs: [Checked; 3] = [dxc, dxc, dxc];
    let mut n_outs = 1;
    let mut dg_t = empty;
    if let Some(g) = dgamma {
        let c = g.check("dgamma")?;
        if g.dtype != DType::F32 {
            return Err(dtype_err!("dgamma", "dtype {} is not f32", g.dtype));
        }
        gamma_shaped_out(&c, &gc, ins.iter().chain(&outs[..n_outs]))?;
        outs[n_outs] = c;
        n_outs += 1;
        dg_t = *g;
    }
    let mut dgc_t = empty;
    if let Some(g) = dgamma_cast {
        let c = g.check("dgamma_cast")?;
        if g.dtype != gamma.dtype {
            return Err(dtype_err!(
                "dgamma_cast",
                "dtype {} differs from gamma's {}",
                g.dtype,
                gamma.dtype
            ));
        }
        gamma_shaped_out(&c, &gc, ins.iter().chain(&outs[..n_outs]))?;
        dgc_t = *g;
    }
    if opts.dgamma_mode == DgammaMode::Accumulate && dgamma.is_none() {
        return Err(invalid(
            "dgamma",
            "accumulate needs a dgamma to accumulate into",
        ));
    }
    Ok(RmsNormGradCall {
        dy: *dy,
        x: *x,
        rstd: *rstd,
        gamma: *gamma,
        dres: dres_t,
        dx: *dx,
        dgamma: dg_t,
        dgamma_cast: dgc_t,
        has_dres: dres.is_some() as u32,
        has_dgamma: dgamma.is_some() as u32,
        has_dgamma_cast: dgamma_cast.is_some() as u32,
        dx_in_place: in_place as u32,
        accumulate_dgamma: (opts.dgamma_mode == DgammaMode::Accumulate) as u32,
        gamma_offset: opts.gamma_offset,
        tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
    })
}
