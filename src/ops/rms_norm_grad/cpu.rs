//! RmsNormGrad on the CPU: the row pass per block, then the block-order
//! dgamma reduction.

use super::*;
use crate::lanes::detect::Available;
use crate::ops::run_blocks;

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
pub(crate) unsafe fn cpu(call: &RmsNormGradCall, isa: Available, runner: &dyn Runner) {
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
    run_blocks!(runner, c.t.flags, c.t.blocks, |b| block::<L, T, G>(&c, b));
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
/// the block's dgamma partial; `g` is `gamma + offset` at those columns.
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
    g: L,
) -> L {
    let at = w.row + j;
    // SAFETY: forwarded from the caller.
    unsafe {
        let dy = load_at::<L, T>(c.dy, at, len);
        let xh = load_at::<L, T>(c.x, at, len).mul(w.rs);
        let mut d = dx_of(dy, xh, g, w.rs, w.cc);
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
/// NaN; see `first_lanes`); `g` is `gamma + offset` at those columns.
///
/// # Safety
/// The columns are inside the row; dx's row (possibly dy's) is not written
/// before this read.
#[inline(always)]
unsafe fn dot_term<L: Lanes, T: Float>(
    dy: Src<T>,
    x: Src<T>,
    row: usize,
    j: usize,
    len: usize,
    rs: L,
    g: L,
) -> L {
    // SAFETY: forwarded from the caller.
    let v = unsafe {
        let dy = load_at::<L, T>(dy, row + j, len);
        let x = load_at::<L, T>(x, row + j, len);
        dy.mul(g).mul(x.mul(rs))
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
        unsafe {
            let g = gamma_at::<L, G>(c.gamma, k * GROUP, GROUP, off);
            dot_term::<L, T>(c.dy, c.x, row, k * GROUP, GROUP, rs, g)
        }
    });
    if tail > 0 {
        // SAFETY: the row's last elements, forwarded from the caller.
        s.push(unsafe {
            let g = gamma_at::<L, G>(c.gamma, full * GROUP, tail, off);
            dot_term::<L, T>(c.dy, c.x, row, full * GROUP, tail, rs, g)
        });
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
            // before this row's stores (4K aliasing: see `norm_fwd`). Both
            // rows use the same columns of gamma: widened once.
            unsafe {
                let g0 = gamma_at::<L, G>(c.gamma, p, GROUP, w.off);
                let g1 = gamma_at::<L, G>(c.gamma, p + GROUP, GROUP, w.off);
                let a = dot_term::<L, T>(c.dy, c.x, next, p, GROUP, rs_next, g0);
                let b = dot_term::<L, T>(c.dy, c.x, next, p + GROUP, GROUP, rs_next, g1);
                let d0 = dx_window(c, w, p, GROUP, g0);
                let d1 = dx_window(c, w, p + GROUP, GROUP, g1);
                put_pair::<L, T, STREAM>(c.dx, row + p, d0, d1);
                (a, b)
            }
        },
        |j, len| {
            // SAFETY: the rows' last columns, as above.
            unsafe {
                let g = gamma_at::<L, G>(c.gamma, j, len, w.off);
                let t = dot_term::<L, T>(c.dy, c.x, next, j, len, rs_next, g);
                let d = dx_window(c, w, j, len, g);
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
/// The UB arena is not needed on a CPU (see `norm::forward`); the bits are those
/// of staging the rows in it. dx goes out in streaming stores with `STREAM`;
/// the next row is prefetched while this one's dx is computed from cache,
/// and for 16-bit data its pass 1 runs in the same loop (`fuse_rows`).
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
        if r + 1 < r1 && head == 0 && fuse_rows::<T>() {
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
                let d = unsafe { dx_window(c, &w, j, len, gamma_at(c.gamma, j, len, off)) };
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
                        dx_window(c, &w, p, GROUP, gamma_at(c.gamma, p, GROUP, off)),
                        dx_window(
                            c,
                            &w,
                            p + GROUP,
                            GROUP,
                            gamma_at(c.gamma, p + GROUP, GROUP, off),
                        ),
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
