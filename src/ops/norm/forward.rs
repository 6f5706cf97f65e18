//! The forward normalization kernel shared by RmsNorm and AddRmsNorm. The two
//! differ only in CopyIn (x, or round(x1 + x2) with x_sum written out), which
//! a `FwdSource` supplies.
//!
//! The CPU reads each row twice in its own dtype: pass 1 sums the squares
//! (groups from the row start, the fixed `RowSum` pattern), pass 2 re-reads
//! the row, now in L1/L2, and writes y. The plan's UB arena is not needed:
//! a CPU with caches need not stage rows it can read twice (docs/dispatch.md), and
//! the bits are the same as staging them. Large outputs (`NORM_FLAG_STREAM`)
//! are written with streaming stores, their windows shifted so the stores
//! are aligned (y is elementwise, so any window gives the same bits).

use crate::ops::run_blocks;
use core::ffi::c_void;

use super::{
    for_lines, fuse_rows, gamma_at, gamma_line, lines_agree, put_line, put_pair, round_to,
    store_at, Rounding,
};
use crate::dtype::Float;
use crate::lanes::{fused_row, push_groups, rstd_f32, Lanes, RowSum, GROUP};
use crate::runner::Runner;
use crate::tensor::RawTensor;
use crate::tiling::NormTiling;
use crate::workspace::{Dst, Src, Workspace};

/// Produces the f32 row values the norm runs on.
pub(crate) trait FwdSource<T>: Sync + Copy {
    /// The values at flat elements `at..at + len` (`len <= 16`, zero-padded
    /// past `len`).
    ///
    /// # Safety
    /// The range lies in one row of the call's tensors.
    unsafe fn at<L: Lanes>(&self, at: usize, len: usize) -> L;
    /// The values at flat elements `at..at + 32`, in `T`'s line order on
    /// `L` (`LaneElem::load_line`), with the side output (if any) of that
    /// line written (streamed with `STREAM`) after the inputs' were read.
    ///
    /// # Safety
    /// As for `at`; with a side output, the line lies in it too.
    unsafe fn line_out<L: Lanes, const STREAM: bool>(&self, at: usize) -> (L, L);
    /// The side output (x_sum) of the values, if any: each window is
    /// written after `at` read it.
    fn side(&self) -> Option<Dst<T>>;
    /// Whether the side output is the input it was read from (in place):
    /// then it is stored with ordinary stores, the lines being in cache.
    fn side_in_place(&self) -> bool {
        false
    }
    /// Hints that elements `at..at + 32` of the inputs will be read soon (no
    /// effect on results; `at` may be past the end).
    fn prefetch<L: Lanes>(&self, at: usize);
}

/// The forward's outputs and settings, common to RmsNorm and AddRmsNorm calls.
pub(crate) struct FwdOut<'a> {
    pub gamma: &'a RawTensor,
    pub y: &'a RawTensor,
    pub rstd: Option<&'a RawTensor>,
    pub eps: f32,
    pub off: f32,
    pub rounding: Rounding,
    pub tiling: NormTiling,
    pub workspace: *mut c_void,
    pub workspace_bytes: usize,
}

/// The `FwdOut` of an RmsNorm or AddRmsNorm call (both carry these fields
/// under the same names).
macro_rules! fwd_out {
    ($call:expr) => {{
        let c = $call;
        $crate::ops::norm::forward::FwdOut {
            gamma: &c.gamma,
            y: &c.y,
            rstd: (c.has_rstd != 0).then_some(&c.rstd),
            eps: c.eps,
            off: c.gamma_offset,
            rounding: c.rounding,
            tiling: c.tiling,
            workspace: c.workspace,
            workspace_bytes: c.workspace_bytes,
        }
    }};
}
pub(crate) use fwd_out;

#[derive(Clone, Copy)]
struct FwdCtx<T, G, S> {
    src: S,
    gamma: Src<G>,
    y: Dst<T>,
    rstd: Option<Dst<f32>>,
    eps: f32,
    off: f32,
    cast_before: bool,
    t: NormTiling,
}

/// Runs the forward plan with CopyIn `src` on `runner`, each block inside
/// `L`'s ISA context.
///
/// # Safety
/// The descriptors were validated by the operator's `prepare`, the workspace
/// by its `launch`, and `L` is available on this CPU.
pub(crate) unsafe fn run_forward<L: Lanes, T: Float, G: Float, S: FwdSource<T>>(
    src: S,
    o: &FwdOut<'_>,
    runner: &dyn Runner,
) {
    if o.tiling.cols == 0 {
        // Rows of length 0: rstd = 1/sqrt(0/0 + eps) = NaN is the only
        // output (one store per row, not a block walk per row).
        if let Some(r) = o.rstd {
            // SAFETY: rstd holds one f32 per row (validated).
            unsafe { Dst(r.data as *mut f32).get(0, o.tiling.rows as usize) }.fill(f32::NAN);
        }
        return;
    }
    // The CPU path stages nothing, but a call must still come with the
    // workspace its plan asks for (an NPU backend would use it).
    if Workspace::new(o.workspace, o.workspace_bytes, o.tiling.workspace_bytes).is_err() {
        return;
    }
    let c = FwdCtx::<T, G, S> {
        src,
        gamma: Src(o.gamma.data as *const G),
        y: Dst(o.y.data as *mut T),
        rstd: o.rstd.map(|r| Dst(r.data as *mut f32)),
        eps: o.eps,
        off: o.off,
        cast_before: o.rounding == Rounding::CastBeforeGamma,
        t: o.tiling,
    };
    run_blocks!(
        runner,
        c.t.flags,
        c.t.blocks,
        |b| forward_block::<L, T, G, S>(&c, b)
    );
}

/// `round?(v * rstd) * gamma`: the one place y's arithmetic is defined.
#[inline(always)]
fn y_of<L: Lanes, T: Float>(v: L, rs: L, g: L, cast_before: bool) -> L {
    let mut h = v.mul(rs);
    if cast_before {
        h = round_to::<L, T>(h);
    }
    h.mul(g)
}

/// The row's sum of squares (pass 1): groups from the row start, the last
/// one zero-padded, in the `RowSum` pattern.
///
/// # Safety
/// Row `row..row + n` is inside the call's tensors.
#[inline(always)]
unsafe fn row_sum_sq<L: Lanes, T: Float, G: Float, S: FwdSource<T>>(
    c: &FwdCtx<T, G, S>,
    row: usize,
    n: usize,
) -> f32 {
    let (full, tail) = (n / GROUP, n % GROUP);
    let mut s = RowSum::<L>::new();
    push_groups!(paired s, full, |k| {
        // SAFETY: group k of the row.
        let v = unsafe { c.src.at::<L>(row + k * GROUP, GROUP) };
        v.mul(v)
    });
    if tail > 0 {
        // SAFETY: the row's last elements.
        let v = unsafe { c.src.at::<L>(row + full * GROUP, tail) };
        s.push(v.mul(v));
    }
    s.finish()
}

/// Pass 2 at columns `j..j + len` (`len <= 16`) of the row at `row`: y and
/// the side output, with ordinary stores, each written after it was read.
///
/// # Safety
/// The columns are inside the row, which belongs to the calling block.
#[inline(always)]
unsafe fn y_window<L: Lanes, T: Float, G: Float, S: FwdSource<T>>(
    c: &FwdCtx<T, G, S>,
    row: usize,
    j: usize,
    len: usize,
    vr: L,
    off: L,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        let v = c.src.at::<L>(row + j, len);
        let g = gamma_at::<L, G>(c.gamma, j, len, off);
        if let Some(o) = c.src.side() {
            store_at::<L, T>(v, o, row + j, len);
        }
        store_at::<L, T>(y_of::<L, T>(v, vr, g, c.cast_before), c.y, row + j, len);
    }
}

/// Pass 2 at columns `p..p + 32` of the row at `row`: two groups, stored as
/// whole lines (streamed with `STREAM`), each written after it was read. In
/// line order when x's and gamma's agree (bf16 on AVX-512: even/odd lanes,
/// no word permutes), else in groups.
///
/// # Safety
/// As for `y_window`.
#[inline(always)]
unsafe fn y_pair<L: Lanes, T: Float, G: Float, S: FwdSource<T>, const STREAM: bool>(
    c: &FwdCtx<T, G, S>,
    row: usize,
    p: usize,
    vr: L,
    off: L,
) {
    let lines = lines_agree::<L, T, G>();
    // SAFETY: forwarded from the caller.
    unsafe {
        // Gamma first: every load of the iteration before its stores.
        let ((g0, g1), (v0, v1)) = if lines {
            (
                gamma_line::<L, G>(c.gamma, p, off),
                c.src.line_out::<L, STREAM>(row + p),
            )
        } else {
            let gv = (
                gamma_at::<L, G>(c.gamma, p, GROUP, off),
                gamma_at::<L, G>(c.gamma, p + GROUP, GROUP, off),
            );
            let (v0, v1) = (
                c.src.at::<L>(row + p, GROUP),
                c.src.at::<L>(row + p + GROUP, GROUP),
            );
            if let Some(o) = c.src.side() {
                if c.src.side_in_place() {
                    put_pair::<L, T, false>(o, row + p, v0, v1);
                } else {
                    put_pair::<L, T, STREAM>(o, row + p, v0, v1);
                }
            }
            (gv, (v0, v1))
        };
        let y0 = y_of::<L, T>(v0, vr, g0, c.cast_before);
        let y1 = y_of::<L, T>(v1, vr, g1, c.cast_before);
        if lines {
            put_line::<L, T, STREAM>(c.y, row + p, y0, y1);
        } else {
            put_pair::<L, T, STREAM>(c.y, row + p, y0, y1);
        }
    }
}

/// Pass 2 of the row at `row` fused with pass 1 of the next row (at
/// `row + n`): y is written from cache while the next row's squares are
/// summed, so the sum's latency chain hides under pass 2's loads and stores.
/// Returns the next row's sum, the same bits as `row_sum_sq` (its groups
/// are pushed in order, in the same segments). The row's output must start
/// on a line when streaming (pairs are aligned to the row start).
///
/// # Safety
/// Both rows are inside the call's tensors and belong to the calling block.
#[inline(always)]
unsafe fn y_row_fused<L: Lanes, T: Float, G: Float, S: FwdSource<T>, const STREAM: bool>(
    c: &FwdCtx<T, G, S>,
    row: usize,
    n: usize,
    vr: L,
    off: L,
) -> f32 {
    let next = row + n;
    let mut s = RowSum::<L>::new();
    fused_row!(
        s,
        n,
        |p| {
            // 4 KiB ahead in the next row (and on into the one after).
            c.src
                .prefetch::<L>(next + p + 4096 / core::mem::size_of::<T>());
            // SAFETY: columns p..p+32 of both rows. The next row is read
            // before this row's stores: outputs and inputs often share their
            // offsets within a page, and a load issued after a store to the
            // same offset (4K aliasing) waits for it.
            unsafe {
                let a = c.src.at::<L>(next + p, GROUP);
                let b = c.src.at::<L>(next + p + GROUP, GROUP);
                y_pair::<L, T, G, S, STREAM>(c, row, p, vr, off);
                (a.mul(a), b.mul(b))
            }
        },
        |j, len| {
            // SAFETY: the rows' last columns (the next row's last group is
            // zero-padded, as in `row_sum_sq`).
            unsafe {
                let v = c.src.at::<L>(next + j, len);
                y_window::<L, T, G, S>(c, row, j, len, vr, off);
                v.mul(v)
            }
        }
    );
    s.finish()
}

/// One block: per row, the sum of squares, rstd, then y (with `STREAM`,
/// in streaming stores of whole lines). For 16-bit data a row's pass 2
/// carries the next row's pass 1 when its output starts on a line (any row
/// when not streaming), and prefetches the row after, so neither pass
/// waits on memory alone; for f32 the passes run one after the other, pass
/// 2 prefetching the next row (`fuse_rows`).
#[inline(always)]
fn forward_block<L: Lanes, T: Float, G: Float, S: FwdSource<T>, const STREAM: bool>(
    c: &FwdCtx<T, G, S>,
    b: usize,
) {
    // A local copy: the kernel's stores through raw pointers cannot then
    // alias the context, so its fields stay in registers.
    let c = &{ *c };
    let n = c.t.cols as usize;
    let (r0, r1) = c.t.block_rows(b);
    let off = L::splat(c.off);
    let mut carried: Option<f32> = None;
    for r in r0..r1 {
        let row = r * n;
        // SAFETY: row r belongs to this block.
        let sum = carried
            .take()
            .unwrap_or_else(|| unsafe { row_sum_sq::<L, T, G, S>(c, row, n) });
        let rs = rstd_f32(sum, n, c.eps);
        if let Some(d) = &c.rstd {
            // SAFETY: rstd has one element per row; row r belongs to this block.
            unsafe { d.get(r, 1)[0] = rs };
        }
        let vr = L::splat(rs);
        let head = if STREAM { c.y.line_head(row, n) } else { 0 };
        if r + 1 < r1 && head == 0 && fuse_rows::<T>() {
            // SAFETY: rows r and r + 1 belong to this block.
            carried = Some(unsafe { y_row_fused::<L, T, G, S, STREAM>(c, row, n, vr, off) });
            continue;
        }
        for_lines!(
            n,
            head,
            |j, len| {
                // SAFETY: columns j..j+len of row r, which belongs to this block.
                unsafe { y_window::<L, T, G, S>(c, row, j, len, vr, off) }
            },
            |p| {
                c.src.prefetch::<L>(row + n + p);
                // SAFETY: columns p..p+32 of row r, as above.
                unsafe { y_pair::<L, T, G, S, STREAM>(c, row, p, vr, off) }
            }
        );
    }
    if STREAM {
        L::stream_fence();
    }
}
