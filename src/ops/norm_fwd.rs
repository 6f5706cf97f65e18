//! The forward normalization kernel shared by RmsNorm and AddRmsNorm. The two
//! differ only in CopyIn (x, or round(x1 + x2) with x_sum written out), which
//! a `FwdSource` supplies.

use super::norm::{arena_group, load_gamma, round_to, store_groups};
use crate::lanes::{rstd_f32, LaneElem, Lanes, RowSum, GROUP};
use crate::tiling::NormTiling;
use crate::workspace::{Dst, Src, Workspace};

/// Produces the f32 row values the norm runs on.
pub(crate) trait FwdSource<T>: Sync {
    /// Writes elements `off..off + len` (flat, within one row) as f32 into
    /// `dst[..len]`, zero-padding `dst` to its length (a multiple of 16).
    /// `first` is false only for split-D's second pass over a row.
    fn copy_in<L: Lanes>(&self, off: usize, len: usize, dst: &mut [f32], first: bool);
}

pub(crate) struct FwdCtx<T, G, S> {
    pub src: S,
    pub gamma: Src<G>,
    pub y: Dst<T>,
    pub rstd: Option<Dst<f32>>,
    pub eps: f32,
    pub off: f32,
    pub cast_before: bool,
    pub t: NormTiling,
    pub ws: Workspace,
}

/// `round?(v * rstd) * gamma`: the one place y's arithmetic is defined.
#[inline(always)]
fn y_of<L: Lanes, T: LaneElem>(v: L, rs: L, g: L, cast_before: bool) -> L {
    let mut h = v.mul(rs);
    if cast_before {
        h = round_to::<L, T>(h);
    }
    h.mul(g)
}

#[inline(always)]
fn sum_sq<L: Lanes>(s: &mut RowSum<L>, row: &[f32]) {
    let (groups, _) = row.as_chunks::<GROUP>();
    for g in groups {
        let v = L::load(g);
        s.push(v.mul(v));
    }
}

/// One block: CopyIn rows (merge-N) or column chunks (split-D) to the arena as
/// f32, reduce in the fixed pattern, compute, round and CopyOut.
#[inline(always)]
pub(crate) fn forward_block<L: Lanes, T: LaneElem, G: LaneElem, S: FwdSource<T>>(
    c: &FwdCtx<T, G, S>,
    b: usize,
) {
    let t = &c.t;
    let n = t.cols as usize;
    let chunk = t.chunk_cols as usize;
    let (r0, r1) = t.block_rows(b);
    // SAFETY: block b's arena is its own (disjoint from every other block's)
    // and inside the checked workspace.
    let arena = unsafe {
        c.ws.region(
            t.arena_offset as usize + b * t.arena_bytes as usize,
            t.arena_bytes as usize / 4,
        )
    };
    let (gbuf, tile) = arena.split_at_mut(chunk);
    let write_rstd = |r: usize, rs: f32| {
        if let Some(d) = &c.rstd {
            // SAFETY: rstd has one element per row; row r belongs to this block.
            unsafe { d.get(r, 1)[0] = rs };
        }
    };
    if t.split_d == 0 {
        let rpt = t.rows_per_tile as usize;
        // SAFETY: gamma holds n elements and is never written.
        load_gamma::<L, G>(unsafe { c.gamma.get(0, n) }, gbuf, c.off);
        let gbuf = &*gbuf;
        let mut r = r0;
        while r < r1 {
            let rows = rpt.min(r1 - r);
            for i in 0..rows {
                c.src
                    .copy_in::<L>((r + i) * n, n, &mut tile[i * chunk..(i + 1) * chunk], true);
            }
            for i in 0..rows {
                let row = &tile[i * chunk..(i + 1) * chunk];
                let mut s = RowSum::<L>::new();
                sum_sq(&mut s, row);
                let rs = rstd_f32(s.finish(), n, c.eps);
                write_rstd(r + i, rs);
                let vr = L::splat(rs);
                // SAFETY: row r+i of y belongs to this block alone.
                let dst = unsafe { c.y.get((r + i) * n, n) };
                store_groups::<L, T>(dst, |gi| {
                    y_of::<L, T>(
                        arena_group(row, gi),
                        vr,
                        arena_group(gbuf, gi),
                        c.cast_before,
                    )
                });
            }
            r += rows;
        }
    } else {
        for r in r0..r1 {
            // Pass 1: the row's sum of squares, chunk by chunk (chunk starts
            // are multiples of 16, so the lane pattern is the merge-N one).
            let mut s = RowSum::<L>::new();
            let mut k = 0;
            while k < n {
                let len = chunk.min(n - k);
                let xt = &mut tile[..len.div_ceil(GROUP) * GROUP];
                c.src.copy_in::<L>(r * n + k, len, xt, true);
                sum_sq(&mut s, xt);
                k += len;
            }
            let rs = rstd_f32(s.finish(), n, c.eps);
            write_rstd(r, rs);
            let vr = L::splat(rs);
            // Pass 2: normalize and store.
            let mut k = 0;
            while k < n {
                let len = chunk.min(n - k);
                let padded = len.div_ceil(GROUP) * GROUP;
                // SAFETY: columns k..k+len of gamma.
                load_gamma::<L, G>(unsafe { c.gamma.get(k, len) }, &mut gbuf[..padded], c.off);
                let xt = &mut tile[..padded];
                c.src.copy_in::<L>(r * n + k, len, xt, false);
                // SAFETY: this chunk of y's row r belongs to this block alone.
                let dst = unsafe { c.y.get(r * n + k, len) };
                let (xt, gb) = (&*xt, &*gbuf);
                store_groups::<L, T>(dst, |gi| {
                    y_of::<L, T>(arena_group(xt, gi), vr, arena_group(gb, gi), c.cast_before)
                });
                k += len;
            }
        }
    }
}
