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

use core::ffi::c_void;

use super::norm::{for_windows, gamma_at, round_to, Rounding, RowOut};
use crate::dtype::Float;
use crate::lanes::{push_groups, rstd_f32, Lanes, RowSum, GROUP};
use crate::runner::Runner;
use crate::tensor::RawTensor;
use crate::tiling::{NormTiling, NORM_FLAG_STREAM};
use crate::workspace::{Dst, Src, Workspace};

/// Produces the f32 row values the norm runs on.
pub(crate) trait FwdSource<T>: Sync {
    /// The values at flat elements `at..at + len` (`len <= 16`, zero-padded
    /// past `len`).
    ///
    /// # Safety
    /// The range lies in one row of the call's tensors.
    unsafe fn at<L: Lanes>(&self, at: usize, len: usize) -> L;
    /// A writer for the side output (x_sum) of the values, if any: each
    /// window is put after `at` read it.
    fn side_out<L: Lanes>(&self, stream: bool) -> Option<RowOut<L, T>>;
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
    runner.parallel_for(c.t.blocks as usize, &|b| {
        // SAFETY: the caller picked L among the ISAs this CPU has.
        unsafe {
            L::enter(
                #[inline(always)]
                || forward_block::<L, T, G, S>(&c, b),
            )
        }
    });
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

/// One block: per row, the sum of squares, rstd, then y.
#[inline(always)]
fn forward_block<L: Lanes, T: Float, G: Float, S: FwdSource<T>>(c: &FwdCtx<T, G, S>, b: usize) {
    let t = &c.t;
    let n = t.cols as usize;
    let stream = t.flags & NORM_FLAG_STREAM != 0;
    let (r0, r1) = t.block_rows(b);
    let off = L::splat(c.off);
    let (full, tail) = (n / GROUP, n % GROUP);
    for r in r0..r1 {
        let row = r * n;
        // Pass 1: groups from the row start, the last one zero-padded.
        let mut s = RowSum::<L>::new();
        push_groups!(s, full, |k| {
            // SAFETY: group k of row r.
            let v = unsafe { c.src.at::<L>(row + k * GROUP, GROUP) };
            v.mul(v)
        });
        if tail > 0 {
            // SAFETY: the row's last elements.
            let v = unsafe { c.src.at::<L>(row + full * GROUP, tail) };
            s.push(v.mul(v));
        }
        let rs = rstd_f32(s.finish(), n, c.eps);
        if let Some(d) = &c.rstd {
            // SAFETY: rstd has one element per row; row r belongs to this block.
            unsafe { d.get(r, 1)[0] = rs };
        }
        // Pass 2: y, in windows aligned for y's streaming stores.
        let vr = L::splat(rs);
        let head = if stream { c.y.stream_head(row, n) } else { 0 };
        let mut y = RowOut::<L, T>::new(c.y, stream);
        let mut side = c.src.side_out::<L>(stream);
        for_windows!(n, head, |j, len| {
            // SAFETY: columns j..j+len of row r, which belongs to this block;
            // x_sum's window is written after it was read.
            unsafe {
                let v = c.src.at::<L>(row + j, len);
                if let Some(o) = side.as_mut() {
                    o.put(v, row + j, len);
                }
                let g = gamma_at::<L, G>(c.gamma, j, len, off);
                y.put(y_of::<L, T>(v, vr, g, c.cast_before), row + j, len);
            }
        });
        // SAFETY: the row's last windows, as above.
        unsafe {
            y.flush();
            if let Some(o) = side.as_mut() {
                o.flush();
            }
        }
    }
    if stream {
        L::stream_fence();
    }
}
