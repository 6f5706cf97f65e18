//! The forward normalization kernel shared by RmsNorm and AddRmsNorm. The two
//! differ only in CopyIn (x, or round(x1 + x2) with x_sum written out), which
//! a `FwdSource` supplies.

use super::norm::{arena_group, load_gamma, round_to, store_tail, MAX_TILE_ROWS};
use crate::dtype::Float;
use crate::lanes::{rstd_f32, Lanes, RowSum, GROUP};
use core::ffi::c_void;

use super::norm::Rounding;
use crate::runner::Runner;
use crate::tensor::RawTensor;
use crate::tiling::NormTiling;

use crate::workspace::{ArenaSlots, Dst, Src, Workspace};

/// Produces the f32 row values the norm runs on.
pub(crate) trait FwdSource<T>: Sync {
    /// Writes elements `off..off + len` (flat, within one row) as f32 into
    /// `dst[..len]`, zero-padding `dst` to its length (a multiple of 16), and
    /// pushes each group's squares into `sum` when given (CopyIn and the
    /// reduction share one pass over the data). `first` is false only for
    /// split-D's second pass over a row.
    fn copy_in<L: Lanes>(
        &self,
        off: usize,
        len: usize,
        dst: &mut [f32],
        first: bool,
        sum: Option<&mut RowSum<L>>,
    );
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
    pub slots: ArenaSlots,
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
    let Ok(ws) = Workspace::new(o.workspace, o.workspace_bytes, o.tiling.workspace_bytes) else {
        return;
    };
    let c = FwdCtx::<T, G, S> {
        src,
        gamma: Src(o.gamma.data as *const G),
        y: Dst(o.y.data as *mut T),
        rstd: o.rstd.map(|r| Dst(r.data as *mut f32)),
        eps: o.eps,
        off: o.off,
        cast_before: o.rounding == Rounding::CastBeforeGamma,
        t: o.tiling,
        ws,
        slots: ArenaSlots::new(o.tiling.blocks as usize),
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

/// y for one row (or chunk): `x` and `g` are f32 arena groups, `dst` the
/// output; the last partial group goes through a temporary.
#[inline(always)]
fn write_y<L: Lanes, T: Float>(x: &[f32], g: &[f32], rs: f32, cast_before: bool, dst: &mut [T]) {
    let vr = L::splat(rs);
    let (xg, _) = x.as_chunks::<GROUP>();
    let (gg, _) = g.as_chunks::<GROUP>();
    let (dg, dt) = dst.as_chunks_mut::<GROUP>();
    for ((d, xv), gv) in dg.iter_mut().zip(xg).zip(gg) {
        T::store(y_of::<L, T>(L::load(xv), vr, L::load(gv), cast_before), d);
    }
    if !dt.is_empty() {
        let i = dg.len();
        let v = y_of::<L, T>(arena_group(x, i), vr, arena_group(g, i), cast_before);
        store_tail::<L, T>(dt, v);
    }
}

/// One block: CopyIn rows (merge-N) or column chunks (split-D) to the arena as
/// f32, reduce in the fixed pattern, compute, round and CopyOut.
#[inline(always)]
pub(crate) fn forward_block<L: Lanes, T: Float, G: Float, S: FwdSource<T>>(
    c: &FwdCtx<T, G, S>,
    b: usize,
) {
    let t = &c.t;
    let n = t.cols as usize;
    let chunk = t.chunk_cols as usize;
    let (r0, r1) = t.block_rows(b);
    let claim = c.slots.claim(b);
    // SAFETY: the claimed arena is this block's until `claim` drops (no other
    // running block holds it) and lies inside the checked workspace.
    let arena = unsafe {
        c.ws.region(
            t.arena_offset as usize + claim.index * t.arena_bytes as usize,
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
            let rows = rpt.min(r1 - r).min(MAX_TILE_ROWS);
            // CopyIn (with each row's sum of squares) for the whole tile...
            let mut rstds = [0f32; MAX_TILE_ROWS];
            for (i, rs) in rstds.iter_mut().enumerate().take(rows) {
                let mut s = RowSum::<L>::new();
                let dst = &mut tile[i * chunk..(i + 1) * chunk];
                c.src.copy_in::<L>((r + i) * n, n, dst, true, Some(&mut s));
                *rs = rstd_f32(s.finish(), n, c.eps);
            }
            // ...then Compute + CopyOut.
            for (i, &rs) in rstds.iter().enumerate().take(rows) {
                write_rstd(r + i, rs);
                // SAFETY: row r+i of y belongs to this block alone.
                let dst = unsafe { c.y.get((r + i) * n, n) };
                write_y::<L, T>(
                    &tile[i * chunk..(i + 1) * chunk],
                    gbuf,
                    rs,
                    c.cast_before,
                    dst,
                );
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
                c.src.copy_in::<L>(r * n + k, len, xt, true, Some(&mut s));
                k += len;
            }
            let rs = rstd_f32(s.finish(), n, c.eps);
            write_rstd(r, rs);
            // Pass 2: normalize and store.
            let mut k = 0;
            while k < n {
                let len = chunk.min(n - k);
                let padded = len.div_ceil(GROUP) * GROUP;
                // SAFETY: columns k..k+len of gamma.
                load_gamma::<L, G>(unsafe { c.gamma.get(k, len) }, &mut gbuf[..padded], c.off);
                let xt = &mut tile[..padded];
                c.src.copy_in::<L>(r * n + k, len, xt, false, None);
                // SAFETY: this chunk of y's row r belongs to this block alone.
                let dst = unsafe { c.y.get(r * n + k, len) };
                write_y::<L, T>(xt, &gbuf[..padded], rs, c.cast_before, dst);
                k += len;
            }
        }
    }
}
