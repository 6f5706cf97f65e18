//! The CPU kernel: a serial stable counting sort of the positions by row into
//! the workspace, then the plan's blocks write the table row by row, each
//! row exactly once, the rows split over blocks by work.

use crate::lanes::detect::Available;
use core::ffi::c_void;

use super::{dispatch_go, dispatch_index, EmbeddingDenseGradCall, IndexElem, RowMap};
use crate::dtype::Float;
use crate::lanes::stream::{stream_copy, stream_zero};
use crate::lanes::{widen_into, Lanes, GROUP};
use crate::ops::dispatch_isa;
use crate::runner::Runner;
use crate::tiling::NORM_FLAG_STREAM;
use crate::workspace::{ArenaSlots, Dst, Src, Workspace};

/// Runs the call on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &EmbeddingDenseGradCall, isa: Available, runner: &dyn Runner) {
    let t = &call.tiling;
    if t.blocks == 0 {
        return; // H == 0 or num_weights == 0: nothing to write.
    }
    let Ok(ws) = Workspace::new(call.workspace, call.workspace_bytes, t.workspace_bytes) else {
        return;
    };
    let (v, n) = (t.num_weights as usize, t.positions as usize);
    // SAFETY: both regions are inside the checked workspace, disjoint from
    // each other and from the arenas, and used by this call alone.
    let (offs, order) = unsafe {
        (
            ws.region_u32(t.offsets_offset as usize, v + 1),
            ws.region_u32(t.order_offset as usize, n),
        )
    };
    let map = RowMap::of(call);
    // SAFETY: indices holds `n` elements of its validated dtype.
    unsafe {
        dispatch_index!(
            call.indices.dtype,
            counting_sort(call.indices.data, n, map, offs, order)
        )
    };
    let sorted = Sorted {
        offs: &*offs,
        order: &*order,
    };
    // SAFETY: forwarded from this function's contract.
    unsafe {
        dispatch_isa!(isa, L => dispatch_go!(call.grad.dtype, call.out.dtype,
            run::<L>(call, sorted, ws, runner)))
    }
}

/// Stable counting sort: afterwards `offs[r]..offs[r + 1]` are the slots of
/// row `r` in `order`, holding its positions in ascending order. Padding and
/// out-of-range positions are left out.
///
/// # Safety
/// `data` holds `n` readable `I`; `offs` has `num_weights + 1` entries and
/// `order` `n`.
unsafe fn counting_sort<I: IndexElem>(
    data: *mut c_void,
    n: usize,
    map: RowMap,
    offs: &mut [u32],
    order: &mut [u32],
) {
    // SAFETY: guaranteed by the caller.
    let idx = unsafe { Src(data as *const I).get(0, n) };
    offs.fill(0);
    for x in idx {
        if let Some(c) = map.row(x.to_i64()).and_then(|r| offs.get_mut(r + 1)) {
            *c += 1;
        }
    }
    // Exclusive prefix sums, shifted by one: offs[r + 1] = start of row r.
    // The scatter then advances offs[r + 1] to the end of row r = start of
    // row r + 1, which leaves offs[r] = start of row r for every r. Sums stay
    // <= n <= u32::MAX (the plan rejects more positions).
    let mut run = 0u32;
    for o in offs.iter_mut().skip(1) {
        let c = *o;
        *o = run;
        run += c;
    }
    for (i, x) in idx.iter().enumerate() {
        if let Some(c) = map.row(x.to_i64()).and_then(|r| offs.get_mut(r + 1)) {
            if let Some(slot) = order.get_mut(*c as usize) {
                *slot = i as u32;
            }
            *c += 1;
        }
    }
}

/// Columns a split row's slices are a multiple of: each block then reads
/// 4 KiB or more of every gradient row it adds (narrower slices of a hot
/// row's thousands of rows cost more in page walks than they balance).
const SPLIT_COLS: usize = 1024;

/// The counting sort's result, shared read-only by the blocks.
#[derive(Clone, Copy)]
struct Sorted<'a> {
    offs: &'a [u32],
    order: &'a [u32],
}

impl Sorted<'_> {
    /// Work before row `r`: its positions plus one per row (a row costs its
    /// count + 1: untouched rows are still written).
    #[inline]
    fn work(&self, r: usize) -> u64 {
        self.offs.get(r).map_or(u64::MAX, |&o| o as u64 + r as u64)
    }

    /// First row `r` with `work(r) >= target` (work is strictly increasing).
    fn first_row_at(&self, target: u64) -> usize {
        let (mut lo, mut hi) = (0, self.offs.len().saturating_sub(1));
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.work(mid) < target {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Where block `b` of `blocks` starts, as (row, column): at work
    /// `floor(b * total / blocks)`. A boundary that falls inside a row's work
    /// splits the row's `h` columns in proportion (rounded down to a multiple
    /// of `SPLIT_COLS`), so a hot row is shared by the blocks its work spans;
    /// each
    /// column's sum is unchanged (positions in order), so the bits are too.
    /// A function of the counts, `blocks` and `h` alone; block `b` covers
    /// `[start(b), start(b + 1))` in (row, column) order.
    fn block_start(&self, blocks: usize, b: usize, h: usize) -> (usize, usize) {
        let total = self.work(self.offs.len().saturating_sub(1)) as u128;
        let at = (total * b as u128 / blocks.max(1) as u128) as u64;
        let r = self.first_row_at(at);
        if r == 0 || self.work(r) == at {
            return (r, 0);
        }
        // `at` is inside row r - 1's work [work(r - 1), work(r)).
        let (w0, w1) = (self.work(r - 1), self.work(r));
        let col = (h as u128 * (at - w0) as u128 / (w1 - w0).max(1) as u128) as usize;
        (r - 1, col / SPLIT_COLS * SPLIT_COLS)
    }
}

struct Ctx<'a, G, O> {
    grad: Src<G>,
    out: Dst<O>,
    sorted: Sorted<'a>,
    cols: usize,
    chunk: usize,
    blocks: usize,
    scale: bool,
    accumulate: bool,
    /// Zero fill and copied rows in streaming stores (`NORM_FLAG_STREAM`).
    stream: bool,
    arena_offset: usize,
    arena_bytes: usize,
    ws: Workspace,
    slots: ArenaSlots,
}

/// # Safety
/// As for `cpu`; `sorted` is the counting sort of this call's indices.
unsafe fn run<L: Lanes, G: Float, O: Float>(
    call: &EmbeddingDenseGradCall,
    sorted: Sorted<'_>,
    ws: Workspace,
    runner: &dyn Runner,
) {
    let t = &call.tiling;
    let c = Ctx::<G, O> {
        grad: Src(call.grad.data as *const G),
        out: Dst(call.out.data as *mut O),
        sorted,
        cols: t.cols as usize,
        chunk: t.chunk_cols as usize,
        blocks: t.blocks as usize,
        scale: call.scale_grad_by_freq != 0,
        accumulate: call.accumulate != 0,
        stream: t.flags & NORM_FLAG_STREAM != 0,
        arena_offset: t.arena_offset as usize,
        arena_bytes: t.arena_bytes as usize,
        ws,
        slots: ArenaSlots::new(t.blocks as usize),
    };
    runner.parallel_for(c.blocks, &|b| {
        // SAFETY: dispatch_isa! picked L among the ISAs this CPU has.
        unsafe {
            L::enter(
                #[inline(always)]
                || block::<L, G, O>(&c, b),
            )
        }
    });
}

#[inline(always)]
fn block<L: Lanes, G: Float, O: Float>(c: &Ctx<'_, G, O>, b: usize) {
    let h = c.cols;
    let (s_row, s_col) = c.sorted.block_start(c.blocks, b, h);
    let (e_row, e_col) = c.sorted.block_start(c.blocks, b + 1, h);
    let r_end = if e_col > 0 { e_row + 1 } else { e_row };
    let claim = c.slots.claim(b);
    // SAFETY: the claimed arena lies inside the workspace and is this block's
    // until `claim` drops.
    let tile = unsafe {
        c.ws.region(c.arena_offset + claim.index * c.arena_bytes, c.chunk)
    };
    // Zeros over `len` elements from `at` (whole untouched rows, or the
    // columns of one this block shares).
    let zero = |at: usize, len: usize| {
        if !c.accumulate && len > 0 {
            // SAFETY: the elements are inside `out`, which overlaps no input,
            // and belong to this block alone.
            let dst = unsafe { c.out.get(at, len) };
            if c.stream {
                stream_zero(bytemuck::cast_slice_mut(dst));
            } else {
                dst.fill(O::zeroed());
            }
        }
    };
    // Same dtype in and out, nothing to scale or add: a single occurrence is
    // the gradient row itself (widening and rounding it back is the identity).
    let copy_single = !c.scale && !c.accumulate && G::DTYPE == O::DTYPE;
    // A run of whole untouched rows is contiguous in the table: one large
    // fill streams faster than many row-sized ones.
    let mut run: Option<usize> = None;
    for r in s_row..r_end {
        let cb = if r == s_row { s_col } else { 0 };
        let ce = if r == e_row { e_col } else { h };
        if cb >= ce {
            continue;
        }
        let (s, e) = (c.sorted.offs[r] as usize, c.sorted.offs[r + 1] as usize);
        let positions = c.sorted.order.get(s..e).unwrap_or(&[]);
        if positions.is_empty() && cb == 0 && ce == h {
            run.get_or_insert(r);
            continue;
        }
        if let Some(f) = run.take() {
            zero(f * h, (r - f) * h);
        }
        let Some((&p0, rest)) = positions.split_first() else {
            zero(r * h + cb, ce - cb);
            continue;
        };
        // SAFETY: row r < num_weights is inside `out`, which overlaps no
        // input; columns cb..ce of it belong to this block alone.
        let row = unsafe { c.out.get(r * h + cb, ce - cb) };
        // SAFETY: positions are < N, so the range is inside grad's row p0;
        // grad is never written.
        let g0 = unsafe { c.grad.get(p0 as usize * h + cb, ce - cb) };
        if rest.is_empty() && copy_single {
            if let Ok(g0) = bytemuck::try_cast_slice::<G, O>(g0) {
                if c.stream {
                    stream_copy(bytemuck::cast_slice_mut(row), bytemuck::cast_slice(g0));
                } else {
                    row.copy_from_slice(g0);
                }
                continue;
            }
        }
        let count = e - s;
        let mut c0 = 0;
        while c0 < ce - cb {
            let w = c.chunk.min(ce - cb - c0);
            let Some(t) = tile.get_mut(..w.next_multiple_of(GROUP)) else {
                return;
            };
            widen_into::<L, G>(&g0[c0..c0 + w], t);
            for batch in rest.chunks(BATCH) {
                let mut srcs: [&[G]; BATCH] = [&[]; BATCH];
                for (d, &p) in srcs.iter_mut().zip(batch) {
                    // SAFETY: as for g0, for row p.
                    *d = unsafe { c.grad.get(p as usize * h + cb + c0, w) };
                }
                add_rows::<L, G>(&srcs[..batch.len()], t);
            }
            finish::<L, O>(t, &mut row[c0..c0 + w], count, c.scale, c.accumulate);
            c0 += w;
        }
    }
    if let Some(f) = run {
        zero(f * h, (r_end - f) * h);
    }
    if c.stream {
        L::stream_fence();
    }
}

/// Positions added per pass over a tile chunk: the running sums of a group
/// stay in registers across the batch, in position order.
const BATCH: usize = 8;

/// `tile[j] = (((tile[j] + srcs[0][j]) + srcs[1][j]) + ...)`, lane-wise for
/// whole groups and in scalar f32 for the tail (the same IEEE additions in
/// the same order, so the same bits). Every `srcs[k]` has the same length.
#[inline(always)]
fn add_rows<L: Lanes, T: Float>(srcs: &[&[T]], tile: &mut [f32]) {
    let Some(len) = srcs.first().map(|s| s.len()) else {
        return;
    };
    let full = len / GROUP;
    let (tg, _) = tile.as_chunks_mut::<GROUP>();
    for (gi, t) in tg.iter_mut().enumerate().take(full) {
        let mut acc = L::load(t);
        for s in srcs {
            let (sg, _) = s.as_chunks::<GROUP>();
            if let Some(g) = sg.get(gi) {
                acc = acc.add(T::load::<L>(g));
            }
        }
        acc.store(t);
    }
    if let Some(t) = tg.get_mut(full) {
        for s in srcs {
            for (o, v) in t.iter_mut().zip(s.get(full * GROUP..).unwrap_or(&[])) {
                *o += v.to_f32();
            }
        }
    }
}

/// Applies the scale (`sum / count`) and the accumulation (`sum + old`) and
/// rounds once into `out`.
#[inline(always)]
fn finish<L: Lanes, O: Float>(
    tile: &[f32],
    out: &mut [O],
    count: usize,
    scale: bool,
    accumulate: bool,
) {
    let cnt = count as f32;
    let (tg, _) = tile.as_chunks::<GROUP>();
    let (og, ot) = out.as_chunks_mut::<GROUP>();
    for (t, o) in tg.iter().zip(og.iter_mut()) {
        let mut s = L::load(t);
        if scale {
            s = s.div(L::splat(cnt));
        }
        if accumulate {
            s = s.add(O::load::<L>(o));
        }
        O::store(s, o);
    }
    let done = og.len() * GROUP;
    for (o, &t) in ot.iter_mut().zip(tile.get(done..).unwrap_or(&[])) {
        let mut s = t;
        if scale {
            s /= cnt;
        }
        if accumulate {
            s += o.to_f32(); // sum first, as in the lanes (NaN payloads)
        }
        *o = O::from_f32(s);
    }
}

#[cfg(test)]
mod tests {
    use super::{Sorted, SPLIT_COLS};

    #[test]
    fn blocks_partition_the_table_and_share_a_hot_row() {
        // Row 5 holds 100 000 positions; 999 other rows hold one each.
        let v = 1000usize;
        let h = 4096usize;
        let mut offs = [0u32; 1001];
        let mut run = 0u32;
        for (r, o) in offs.iter_mut().enumerate().take(v) {
            *o = run;
            run += if r == 5 { 100_000 } else { 1 };
        }
        offs[v] = run;
        let order = [0u32; 0];
        let s = Sorted {
            offs: &offs,
            order: &order,
        };
        for blocks in [1usize, 2, 3, 4, 64] {
            let starts: Vec<(usize, usize)> =
                (0..=blocks).map(|b| s.block_start(blocks, b, h)).collect();
            assert_eq!(starts[0], (0, 0));
            assert_eq!(starts[blocks], (v, 0));
            for w in starts.windows(2) {
                assert!(w[0] <= w[1], "{blocks}: starts in order: {starts:?}");
                assert!(w[1].1 < h && w[1].1 % SPLIT_COLS == 0);
            }
            // The hot row (about 91% of the work) is split in as many
            // slices as its width allows.
            let mut cuts: Vec<_> = starts
                .iter()
                .filter(|&&(r, col)| r == 5 && col > 0)
                .collect();
            cuts.dedup();
            let slices = cuts.len();
            if blocks >= 4 {
                assert_eq!(slices, h / SPLIT_COLS - 1, "{blocks}: {starts:?}");
            }
        }
    }
}
