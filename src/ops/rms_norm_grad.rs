//! RmsNormGrad: with `g = dy * (gamma + offset)`, `xh = x * rstd`,
//! `c = sum_j(g * xh) / N`: `dx = rstd * (g - xh * c) [+ dres]` and
//! `dgamma = sum_m(dy * xh)` (f32). dgamma partials are per block (fixed by the
//! plan, not by threads) and summed in block order: deterministic.

use core::ffi::c_void;

use super::norm::{
    arena_group, first_lanes, for_lines, gamma_at, load_at, load_group, norm_dims, prefetch_pair,
    put_pair, rstd_check, same_shape, store_at, store_tail,
};
use super::{dispatch_isa, dispatch_xg, launch, op_call, workspace_len, Exec};
use crate::dtype::{DType, Float};
use crate::error::{dtype_err, invalid, invalid_fmt, Result};
use crate::lanes::{fused_row, push_groups, Isa, Lanes, RowSum, GROUP};
use crate::runner::{for_plan, Runner};
use crate::tensor::{no_overlap, out_like, Checked, RawTensor, TensorMut, TensorRef};
use crate::tiling::{NormTiling, UbConfig, NORM_FLAG_STREAM};
use crate::workspace::{Dst, Src, Workspace};

/// What happens to an existing dgamma (`accumulate_dgamma` in the C ABI).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DgammaMode {
    /// `dgamma = sum`.
    #[default]
    Overwrite,
    /// `dgamma += sum` (gradient accumulation into an fp32 main grad).
    Accumulate,
}

/// Options of RmsNormGrad (`npk_rms_norm_grad_options`).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct RmsNormGradOptions {
    /// The forward's gamma offset. Default 0.0.
    pub gamma_offset: f32,
    /// Overwrite (default) or accumulate dgamma.
    pub dgamma_mode: DgammaMode,
}

/// The validated arguments of one RmsNormGrad (`npk_rms_norm_grad_call`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RmsNormGradCall {
    /// Upstream gradient, x's shape and dtype.
    pub dy: RawTensor,
    /// Forward input.
    pub x: RawTensor,
    /// Forward rstd, f32, one per row.
    pub rstd: RawTensor,
    /// Weight: the trailing dims of x, x's dtype or f32.
    pub gamma: RawTensor,
    /// Optional residual gradient added to dx (`has_dres`).
    pub dres: RawTensor,
    /// Output, x's shape and dtype; may be dy itself.
    pub dx: RawTensor,
    /// Optional f32 output, gamma's shape (`has_dgamma`).
    pub dgamma: RawTensor,
    /// Optional output in gamma's dtype and shape (`has_dgamma_cast`).
    pub dgamma_cast: RawTensor,
    /// 1 when `dres` is read.
    pub has_dres: u32,
    /// 1 when `dgamma` is written.
    pub has_dgamma: u32,
    /// 1 when `dgamma_cast` is written.
    pub has_dgamma_cast: u32,
    /// 1 when dx is dy (in place).
    pub dx_in_place: u32,
    /// 1: `dgamma += sum`; 0: `dgamma = sum`.
    pub accumulate_dgamma: u32,
    /// The forward's gamma offset.
    pub gamma_offset: f32,
    /// The tiling plan (TilingData); dgamma partials live in the workspace.
    pub tiling: NormTiling,
    /// The caller's workspace.
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

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

/// Validates everything and builds the call.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare(
    dy: &RawTensor,
    x: &RawTensor,
    rstd: &RawTensor,
    gamma: &RawTensor,
    dres: Option<&RawTensor>,
    opts: &RmsNormGradOptions,
    dx: &RawTensor,
    dgamma: Option<&RawTensor>,
    dgamma_cast: Option<&RawTensor>,
    ub: &UbConfig,
) -> Result<RmsNormGradCall> {
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
        if c.shape != gc.shape {
            return Err(invalid_fmt!(
                "dgamma",
                "shape {} differs from gamma's {}",
                c.shape,
                gc.shape
            ));
        }
        no_overlap(&c, ins.iter())?;
        for o in &outs[..n_outs] {
            no_overlap(&c, [o])?;
        }
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
        if c.shape != gc.shape {
            return Err(invalid_fmt!(
                "dgamma_cast",
                "shape {} differs from gamma's {}",
                c.shape,
                gc.shape
            ));
        }
        no_overlap(&c, ins.iter())?;
        for o in &outs[..n_outs] {
            no_overlap(&c, [o])?;
        }
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

// Rows of length 0: dx, dgamma and dgamma_cast are all empty. No rows and
// no dgamma output: dx is empty.
op_call!(
    RmsNormGradCall,
    rms_norm_grad,
    |c| c.tiling.cols == 0 || (c.tiling.rows == 0 && c.has_dgamma == 0 && c.has_dgamma_cast == 0),
    [dy, x, rstd, gamma, dres, dx, dgamma, dgamma_cast]
);

/// Workspace bytes `rms_norm_grad` (and `rms_norm_grad_in_place`) needs
/// for these inputs under `exec.ub`: per-block arenas and dgamma partials.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_grad_workspace_size<T: Float, G: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    x: TensorRef<'_, T>,
    rstd: TensorRef<'_, f32>,
    gamma: TensorRef<'_, G>,
    dres: Option<TensorRef<'_, T>>,
    opts: &RmsNormGradOptions,
) -> Result<usize> {
    if let Some(d) = dres.filter(|d| d.shape() != x.shape()) {
        return Err(invalid_fmt!(
            "dres",
            "shape {} differs from x's {}",
            d.shape(),
            x.shape()
        ));
    }
    let t = plan(
        &dy.raw(),
        &x.raw(),
        &rstd.raw(),
        &gamma.raw(),
        opts,
        &exec.ub,
    )?;
    workspace_len(t.workspace_bytes)
}

/// RmsNormGrad. `rstd` is the forward's (f32, one per row, any shape with
/// that many elements); `dres`, if given, is added to dx. Outputs: `dx`
/// (x's shape), `dgamma` (f32, gamma's shape; with
/// `DgammaMode::Accumulate` its old value is added), `dgamma_cast` (gamma's
/// dtype and shape). `workspace` must hold `rms_norm_grad_workspace_size`
/// bytes. On error nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_grad<T: Float, G: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    x: TensorRef<'_, T>,
    rstd: TensorRef<'_, f32>,
    gamma: TensorRef<'_, G>,
    dres: Option<TensorRef<'_, T>>,
    opts: &RmsNormGradOptions,
    dx: &mut [T],
    dgamma: Option<&mut [f32]>,
    dgamma_cast: Option<&mut [G]>,
    workspace: &mut [u8],
) -> Result<()> {
    let dxr = out_like(dx, x.shape(), "dx", "x")?;
    grad_with(
        exec,
        &dy.raw(),
        dxr,
        x,
        rstd,
        gamma,
        dres,
        opts,
        dgamma,
        dgamma_cast,
        workspace,
    )
}

/// RmsNormGrad writing dx over `dy_dx` (which holds dy on entry); otherwise
/// as `rms_norm_grad`, with the same workspace size.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_grad_in_place<T: Float, G: Float>(
    exec: &Exec<'_>,
    mut dy_dx: TensorMut<'_, T>,
    x: TensorRef<'_, T>,
    rstd: TensorRef<'_, f32>,
    gamma: TensorRef<'_, G>,
    dres: Option<TensorRef<'_, T>>,
    opts: &RmsNormGradOptions,
    dgamma: Option<&mut [f32]>,
    dgamma_cast: Option<&mut [G]>,
    workspace: &mut [u8],
) -> Result<()> {
    let d = dy_dx.raw();
    grad_with(
        exec,
        &d,
        d,
        x,
        rstd,
        gamma,
        dres,
        opts,
        dgamma,
        dgamma_cast,
        workspace,
    )
}

#[allow(clippy::too_many_arguments)]
fn grad_with<T: Float, G: Float>(
    exec: &Exec<'_>,
    dy: &RawTensor,
    dx: RawTensor,
    x: TensorRef<'_, T>,
    rstd: TensorRef<'_, f32>,
    gamma: TensorRef<'_, G>,
    dres: Option<TensorRef<'_, T>>,
    opts: &RmsNormGradOptions,
    dgamma: Option<&mut [f32]>,
    dgamma_cast: Option<&mut [G]>,
    workspace: &mut [u8],
) -> Result<()> {
    let dg = match dgamma {
        Some(s) => Some(out_like(s, gamma.shape(), "dgamma", "gamma")?),
        None => None,
    };
    let dgc = match dgamma_cast {
        Some(s) => Some(out_like(s, gamma.shape(), "dgamma_cast", "gamma")?),
        None => None,
    };
    let call = prepare(
        dy,
        &x.raw(),
        &rstd.raw(),
        &gamma.raw(),
        dres.map(|v| v.raw()).as_ref(),
        opts,
        &dx,
        dg.as_ref(),
        dgc.as_ref(),
        &exec.ub,
    )?;
    launch(
        exec,
        call,
        workspace.as_mut_ptr() as *mut c_void,
        workspace.len(),
    )
}

#[derive(Clone, Copy)]
struct Ctx<T, G> {
    dy: Src<T>,
    x: Src<T>,
    rstd: Src<f32>,
    gamma: Src<G>,
    dres: Option<Src<T>>,
    dx: Dst<T>,
    off: f32,
    t: NormTiling,
    ws: Workspace,
}

/// Runs the plan on the CPU: the row pass per block, then the deterministic
/// block-order reduction of the dgamma partials, column-parallel.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &RmsNormGradCall, isa: Isa, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        dispatch_isa!(isa, L => dispatch_xg!(call.x.dtype, call.gamma.dtype, run::<L>(call, runner)))
    }
}

/// Columns per task of the final dgamma reduction (a multiple of 16).
const REDUCE_COLS: usize = 1024;

unsafe fn run<L: Lanes, T: Float, G: Float>(call: &RmsNormGradCall, runner: &dyn Runner) {
    let Ok(ws) = Workspace::new(
        call.workspace,
        call.workspace_bytes,
        call.tiling.workspace_bytes,
    ) else {
        return;
    };
    let c = Ctx::<T, G> {
        dy: Src(call.dy.data as *const T),
        x: Src(call.x.data as *const T),
        rstd: Src(call.rstd.data as *const f32),
        gamma: Src(call.gamma.data as *const G),
        dres: (call.has_dres != 0).then_some(Src(call.dres.data as *const T)),
        dx: Dst(call.dx.data as *mut T),
        off: call.gamma_offset,
        t: call.tiling,
        ws,
    };
    let stream = c.t.flags & NORM_FLAG_STREAM != 0;
    let runner = for_plan(runner, c.t.flags);
    runner.parallel_for(c.t.blocks as usize, &|b| {
        // SAFETY: dispatch_isa! picked L among the ISAs this CPU has.
        unsafe {
            L::enter(
                #[inline(always)]
                || {
                    if stream {
                        block::<L, T, G, true>(&c, b)
                    } else {
                        block::<L, T, G, false>(&c, b)
                    }
                },
            )
        }
    });
    if call.has_dgamma == 0 && call.has_dgamma_cast == 0 {
        return;
    }
    let n = c.t.cols as usize;
    let dg = (call.has_dgamma != 0).then_some(Dst(call.dgamma.data as *mut f32));
    let dgc = (call.has_dgamma_cast != 0).then_some(Dst(call.dgamma_cast.data as *mut G));
    let acc = call.accumulate_dgamma != 0;
    let t = c.t;
    runner.parallel_for(n.div_ceil(REDUCE_COLS), &|task| {
        // SAFETY: dispatch_isa! picked L among the ISAs this CPU has.
        unsafe {
            L::enter(
                #[inline(always)]
                || reduce_dgamma::<L, G>(&t, &ws, task, dg, dgc, acc),
            )
        }
    });
}

/// dgamma for columns of one task: block partials summed in block order.
#[inline(always)]
fn reduce_dgamma<L: Lanes, G: Float>(
    t: &NormTiling,
    ws: &Workspace,
    task: usize,
    dg: Option<Dst<f32>>,
    dgc: Option<Dst<G>>,
    acc: bool,
) {
    let n = t.cols as usize;
    let np = t.cols_padded as usize;
    let c0 = task * REDUCE_COLS;
    let c1 = (c0 + REDUCE_COLS).min(n);
    let mut gi = c0 / GROUP;
    while gi * GROUP < c1 {
        let start = gi * GROUP;
        let len = GROUP.min(c1 - start);
        let mut sum = L::splat(0.0);
        for b in 0..t.blocks as usize {
            // SAFETY: partials of block b, read-only now that every block ran.
            let p =
                unsafe { ws.region(t.partials_offset as usize + b * np * 4 + start * 4, GROUP) };
            sum = sum.add(arena_group::<L>(p, 0));
        }
        let mut v = [0f32; GROUP];
        if let Some(d) = &dg {
            if acc {
                // SAFETY: this task's columns of dgamma; read before written.
                let old = unsafe { Src(d.0 as *const f32).get(start, len) };
                sum = load_group::<L, f32>(old, 0).add(sum);
            }
            sum.store(&mut v);
            // SAFETY: this task's columns of dgamma belong to it alone.
            unsafe { d.get(start, len) }.copy_from_slice(&v[..len]);
        }
        if let Some(d) = &dgc {
            // SAFETY: this task's columns of dgamma_cast belong to it alone.
            store_tail::<L, G>(unsafe { d.get(start, len) }, sum);
        }
        gi += 1;
    }
}

/// `rstd * (dy * g - (x * rstd) * c)`: dx's arithmetic (before dres).
#[inline(always)]
fn dx_of<L: Lanes>(dy: L, xh: L, g: L, rs: L, cc: L) -> L {
    rs.mul(dy.mul(g).sub(xh.mul(cc)))
}

/// What pass 2 of one row needs besides the call's tensors.
struct RowCtx<L> {
    row: usize,
    rs: L,
    cc: L,
    off: L,
    /// The block's dgamma partial row (read and written through the two).
    pr: Src<f32>,
    pp: Dst<f32>,
}

/// dx at columns `j..j + len` of the row, with the row's `dy * xh` added to
/// the block's dgamma partial.
///
/// # Safety
/// The columns are inside the row, which belongs to the calling block; dy's
/// window (dx may be dy) is read here, before the caller writes dx's.
#[inline(always)]
unsafe fn dx_window<L: Lanes, T: Float, G: Float>(
    c: &Ctx<T, G>,
    w: &RowCtx<L>,
    j: usize,
    len: usize,
) -> L {
    let at = w.row + j;
    // SAFETY: forwarded from the caller.
    unsafe {
        let dy = load_at::<L, T>(c.dy, at, len);
        let xh = load_at::<L, T>(c.x, at, len).mul(w.rs);
        let mut d = dx_of(dy, xh, gamma_at::<L, G>(c.gamma, j, len, w.off), w.rs, w.cc);
        if let Some(dres) = c.dres {
            d = d.add(load_at::<L, T>(dres, at, len));
        }
        let p = load_at::<L, f32>(w.pr, j, len);
        store_at::<L, f32>(p.add(dy.mul(xh)), w.pp, j, len);
        d
    }
}

/// The pass-1 term of columns `j..j + len` (`len <= 16`) of the row at
/// `row`: `(dy * g) * (x * rstd)`, padding lanes masked (0 * Inf would be
/// NaN; see `first_lanes`).
///
/// # Safety
/// The columns are inside the row; dx's row (possibly dy's) is not written
/// before this read.
#[inline(always)]
unsafe fn dot_term<L: Lanes, T: Float, G: Float>(
    c: &Ctx<T, G>,
    row: usize,
    j: usize,
    len: usize,
    rs: L,
    off: L,
) -> L {
    // SAFETY: forwarded from the caller.
    let v = unsafe {
        let dy = load_at::<L, T>(c.dy, row + j, len);
        let x = load_at::<L, T>(c.x, row + j, len);
        dy.mul(gamma_at::<L, G>(c.gamma, j, len, off))
            .mul(x.mul(rs))
    };
    if len < GROUP {
        first_lanes(v, len)
    } else {
        v
    }
}

/// Pass 1 of the row at `row`: `sum_j (dy * g) * (x * rstd)`, groups from
/// the row start in the `RowSum` pattern.
///
/// # Safety
/// As for `dot_term`, for the whole row.
#[inline(always)]
unsafe fn row_dot<L: Lanes, T: Float, G: Float>(
    c: &Ctx<T, G>,
    row: usize,
    n: usize,
    rs: L,
    off: L,
) -> f32 {
    let (full, tail) = (n / GROUP, n % GROUP);
    let mut s = RowSum::<L>::new();
    push_groups!(s, full, |k| {
        // SAFETY: group k of the row, forwarded from the caller.
        unsafe { dot_term::<L, T, G>(c, row, k * GROUP, GROUP, rs, off) }
    });
    if tail > 0 {
        // SAFETY: the row's last elements, forwarded from the caller.
        s.push(unsafe { dot_term::<L, T, G>(c, row, full * GROUP, tail, rs, off) });
    }
    s.finish()
}

/// Pass 2 of the row `w.row` fused with pass 1 of the next row (rstd
/// `rs_next`): dx is written from cache while the next row's sum runs, so
/// the sum's latency chain hides under pass 2. Returns the next row's sum,
/// the same bits as `row_dot` (same groups, same order, same segments). The
/// row's dx must start on a line when streaming.
///
/// # Safety
/// Both rows are inside the call's tensors and belong to the calling block.
#[inline(always)]
unsafe fn dx_row_fused<L: Lanes, T: Float, G: Float, const STREAM: bool>(
    c: &Ctx<T, G>,
    w: &RowCtx<L>,
    n: usize,
    rs_next: L,
) -> f32 {
    let (row, next) = (w.row, w.row + n);
    let mut s = RowSum::<L>::new();
    fused_row!(
        s,
        n,
        |p| {
            // 4 KiB ahead in the next row (and on into the one after).
            let ahead = next + p + 4096 / core::mem::size_of::<T>();
            prefetch_pair::<L, T>(c.dy, ahead);
            prefetch_pair::<L, T>(c.x, ahead);
            if let Some(dres) = c.dres {
                prefetch_pair::<L, T>(dres, next + p);
            }
            // SAFETY: columns p..p+32 of both rows. The next row is read
            // before this row's stores (4K aliasing: see `norm_fwd`).
            unsafe {
                let a = dot_term::<L, T, G>(c, next, p, GROUP, rs_next, w.off);
                let b = dot_term::<L, T, G>(c, next, p + GROUP, GROUP, rs_next, w.off);
                let d0 = dx_window(c, w, p, GROUP);
                let d1 = dx_window(c, w, p + GROUP, GROUP);
                put_pair::<L, T, STREAM>(c.dx, row + p, d0, d1);
                (a, b)
            }
        },
        |j, len| {
            // SAFETY: the rows' last columns, as above.
            unsafe {
                let t = dot_term::<L, T, G>(c, next, j, len, rs_next, w.off);
                let d = dx_window(c, w, j, len);
                store_at::<L, T>(d, c.dx, row + j, len);
                t
            }
        }
    );
    s.finish()
}

/// One block: per row, `c = sum_j (dy * g) * (x * rstd) / N` (pass 1, groups
/// from the row start), then dx and the row's `dy * xh` added into the
/// block's dgamma partial (pass 2, rows in order, dy and x again from L1/L2).
/// The UB arena is not needed on a CPU (see `norm_fwd`); the bits are those
/// of staging the rows in it. dx goes out in streaming stores with `STREAM`;
/// the next row is prefetched while this one's dx is computed from cache.
#[inline(always)]
fn block<L: Lanes, T: Float, G: Float, const STREAM: bool>(c: &Ctx<T, G>, b: usize) {
    // A local copy: the kernel's stores through raw pointers cannot then
    // alias the context, so its fields stay in registers.
    let c = &{ *c };
    let t = &c.t;
    let n = t.cols as usize;
    let np = t.cols_padded as usize;
    let (r0, r1) = t.block_rows(b);
    // SAFETY: the partials are block b's alone, inside the checked workspace.
    let part = unsafe { c.ws.region(t.partials_offset as usize + b * np * 4, np) };
    part.fill(0.0);
    let off = L::splat(c.off);
    let mut carried: Option<f32> = None;
    for r in r0..r1 {
        let row = r * n;
        // SAFETY: rstd has one element per row.
        let rs = L::splat(unsafe { c.rstd.get(r, 1)[0] });
        // SAFETY: row r belongs to this block.
        let dot = carried
            .take()
            .unwrap_or_else(|| unsafe { row_dot::<L, T, G>(c, row, n, rs, off) });
        let cc = L::splat(dot / n as f32);
        let head = if STREAM { c.dx.line_head(row, n) } else { 0 };
        let pp = Dst(part.as_mut_ptr());
        let w = RowCtx {
            row,
            rs,
            cc,
            off,
            pr: Src(part.as_ptr()),
            pp,
        };
        if r + 1 < r1 && head == 0 {
            // SAFETY: rstd has one element per row; rows r and r + 1 belong
            // to this block.
            carried = Some(unsafe {
                let rs_next = L::splat(c.rstd.get(r + 1, 1)[0]);
                dx_row_fused::<L, T, G, STREAM>(c, &w, n, rs_next)
            });
            continue;
        }
        for_lines!(
            n,
            head,
            |j, len| {
                // SAFETY: columns j..j+len of row r, which belongs to this block.
                let d = unsafe { dx_window(c, &w, j, len) };
                // SAFETY: as above.
                unsafe { store_at::<L, T>(d, c.dx, row + j, len) };
            },
            |p| {
                prefetch_pair::<L, T>(c.dy, row + n + p);
                prefetch_pair::<L, T>(c.x, row + n + p);
                if let Some(dres) = c.dres {
                    prefetch_pair::<L, T>(dres, row + n + p);
                }
                // SAFETY: columns p..p+32 of row r, as above.
                let (d0, d1) = unsafe {
                    (
                        dx_window(c, &w, p, GROUP),
                        dx_window(c, &w, p + GROUP, GROUP),
                    )
                };
                // SAFETY: as above.
                unsafe { put_pair::<L, T, STREAM>(c.dx, row + p, d0, d1) };
            }
        );
    }
    if STREAM {
        L::stream_fence();
    }
}

/// The f64 golden model: dgamma column by column (before dx, which may
/// overwrite dy), then dx row by row.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &RmsNormGradCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_xg!(call.x.dtype, call.gamma.dtype, reference_t(call)) }
}

unsafe fn reference_t<T: Float, G: Float>(call: &RmsNormGradCall) {
    let (m, n) = (call.tiling.rows as usize, call.tiling.cols as usize);
    let (dy, x) = (call.dy.data as *const T, call.x.data as *const T);
    let rstd = call.rstd.data as *const f32;
    let g = call.gamma.data as *const G;
    let off = call.gamma_offset as f64;
    // SAFETY: all reads and writes below use indices within the validated
    // lengths; raw accesses because dx may alias dy.
    unsafe {
        if call.has_dgamma != 0 || call.has_dgamma_cast != 0 {
            for j in 0..n {
                let mut s = 0.0f64;
                for r in 0..m {
                    let xh = x.add(r * n + j).read().to_f64() * rstd.add(r).read() as f64;
                    s += dy.add(r * n + j).read().to_f64() * xh;
                }
                if call.accumulate_dgamma != 0 {
                    s += (call.dgamma.data as *const f32).add(j).read() as f64;
                }
                if call.has_dgamma != 0 {
                    (call.dgamma.data as *mut f32).add(j).write(s as f32);
                }
                if call.has_dgamma_cast != 0 {
                    (call.dgamma_cast.data as *mut G)
                        .add(j)
                        .write(G::from_f64(s));
                }
            }
        }
        for r in 0..m {
            let rs = rstd.add(r).read() as f64;
            let at = |j: usize| {
                let gg = dy.add(r * n + j).read().to_f64() * (g.add(j).read().to_f64() + off);
                let xh = x.add(r * n + j).read().to_f64() * rs;
                (gg, xh)
            };
            let cc = (0..n)
                .map(|j| {
                    let (gg, xh) = at(j);
                    gg * xh
                })
                .sum::<f64>()
                / n as f64;
            for j in 0..n {
                let (gg, xh) = at(j);
                let mut d = rs * (gg - xh * cc);
                if call.has_dres != 0 {
                    d += (call.dres.data as *const T).add(r * n + j).read().to_f64();
                }
                (call.dx.data as *mut T)
                    .add(r * n + j)
                    .write(T::from_f64(d));
            }
        }
    }
}
