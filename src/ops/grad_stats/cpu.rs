//! The CPU kernels: one block of the flat element range at a time.
//!
//! # Stats: the fixed 16-lane pattern, exact squares
//! Element `k` of a tensor's piece inside a block goes to lane `k % 16`.
//! Each finite element's square is computed exactly in f64 (an f32 times an
//! f32 is exact in f64) and added, in element order, to its lane's f64 sum;
//! at the end of the block the 16 f64 lanes fold in one fixed tree (lane
//! `i + 8` onto `i`, then `+4`, `+2`, `+1`). The only rounding is f64
//! addition (relative error about `n * 2^-53`), so the sum of squares of a
//! tensor hardly depends on where blocks or shards cut it: a vocab-parallel
//! embedding's per-rank sums, all-reduced, give the single-process norm to
//! about 1e-15 (the f32 windows this replaced were exact to 6.6e-7 only, and
//! their rounding moved with the cut).
//!
//! The piece is read in windows of `WINDOW_GROUPS` = 32 groups of 16 (512
//! elements), their squares added to a copy of the lane sums and their
//! min/max kept at the ISA's width (`MinMax`, on the lanes). A window whose
//! 16 summed lanes come out finite held only finite elements (a NaN or
//! Inf square poisons its lane, and finite squares, at most 2^256 each,
//! cannot overflow an f64 sum), so the copy and the min/max are kept.
//! Else (rare) the window is re-read, masked, while it is in L1: finite
//! elements add the same exact f64 squares, NaN/Inf are counted, min/max
//! see the finite elements only. Either path gives the same bits for a
//! window of finite elements, so the test only decides what is counted.
//! (An f32 sum of squares used to decide it, with a magnitude range that
//! kept it from overflowing: twice the instructions of the f64 test, and
//! the kernel ran at twice its read floor.) The order of
//! every operation is fixed by the plan alone, never by the runner or ISA;
//! no FMA (Rust never contracts `*` and `+`).

use super::minmax::{fold, MinMax};
use super::plan::{GradTiling, Partial, Seg};
use super::{partials_of, stats_table, ClipGradNormCall, GradCall, GradStatsCall, GradSummary};
use crate::dtype::{DType, Float};
use crate::lanes::detect::Available;
use crate::lanes::{Lanes, GROUP};
use crate::ops::dispatch_isa;
use crate::runner::Runner;
use crate::workspace::{Dst, Src};
use half::{bf16, f16};

const INF_BITS: u32 = 0x7f80_0000;
/// Groups of 16 per window.
pub(crate) const WINDOW_GROUPS: usize = 32;

/// One block's running statistics.
struct Acc {
    /// The 16 f64 lane sums of squares.
    sq: [f64; GROUP],
    /// Lane-wise min/max of the f32 windows taken as is.
    mm_min: [f32; GROUP],
    mm_max: [f32; GROUP],
    /// Min/max of the masked windows and tails (finite elements only).
    min: f32,
    max: f32,
    nan: u64,
    inf: u64,
}

impl Acc {
    #[inline(always)]
    fn new() -> Self {
        Acc {
            sq: [0.0; GROUP],
            mm_min: [f32::INFINITY; GROUP],
            mm_max: [f32::NEG_INFINITY; GROUP],
            min: f32::INFINITY,
            max: f32::NEG_INFINITY,
            nan: 0,
            inf: 0,
        }
    }

    #[inline(always)]
    fn finish(self) -> Partial {
        let (mn, mx) = fold(&self.mm_min, &self.mm_max);
        Partial {
            sum_sq: fold16(self.sq),
            nan: self.nan,
            inf: self.inf,
            min: if self.min < mn { self.min } else { mn },
            max: if self.max > mx { self.max } else { mx },
        }
    }
}

/// The fixed lane fold of the sums: `i + 8` onto `i`, then `+4`, `+2`, `+1`.
#[inline(always)]
fn fold16(mut w: [f64; GROUP]) -> f64 {
    let mut step = GROUP / 2;
    while step > 0 {
        for i in 0..step {
            w[i] += w[i + step];
        }
        step /= 2;
    }
    w[0]
}

/// Masked, exact path for up to 16 elements starting at lane 0: finite
/// elements add their f64 square to their lane; NaN/Inf are counted.
#[inline(always)]
fn masked(acc: &mut Acc, v: &[f32]) {
    for (i, &x) in v.iter().enumerate().take(GROUP) {
        let bits = x.to_bits() & 0x7fff_ffff;
        if bits < INF_BITS {
            let d = x as f64;
            // Separate mul and add: Rust never contracts them into an FMA.
            acc.sq[i] += d * d;
            if x < acc.min {
                acc.min = x;
            }
            if x > acc.max {
                acc.max = x;
            }
        } else if bits == INF_BITS {
            acc.inf += 1;
        } else {
            acc.nan += 1;
        }
    }
}

/// One window of whole groups: exact f64 squares added to a copy of the
/// block's lane sums, kept with the window's min/max when every lane of
/// the copy is finite (every element was).
#[inline(always)]
fn window<L: Lanes, T: Float>(acc: &mut Acc, win: &[[T; GROUP]]) {
    let mut sq = acc.sq;
    let mut w = MinMax::<L>::new();
    for g in win {
        let x = T::load::<L>(g);
        w.push(x);
        x.add_squares_f64(&mut sq);
    }
    // Non-short-circuit, so it vectorizes.
    if sq.iter().fold(true, |ok, s| ok & s.is_finite()) {
        acc.sq = sq;
        w.merge_into(&mut acc.mm_min, &mut acc.mm_max);
    } else {
        // Rare: re-read the window (in L1) exactly, masking NaN/Inf.
        let mut v = [0f32; GROUP];
        for g in win {
            T::load::<L>(g).store(&mut v);
            masked(acc, &v);
        }
    }
}

#[inline(always)]
fn seg_stats<L: Lanes, T: Float>(x: &[T], acc: &mut Acc) {
    let (groups, tail) = x.as_chunks::<GROUP>();
    for win in groups.chunks(WINDOW_GROUPS) {
        window::<L, T>(acc, win);
    }
    if !tail.is_empty() {
        let mut v = [0f32; GROUP];
        for (o, x) in v.iter_mut().zip(tail) {
            *o = x.to_f32();
        }
        masked(acc, &v[..tail.len()]);
    }
}

/// Calls `f(seg, lo, len)` for each piece of a tensor inside block `b`:
/// elements `lo..lo + len` of `seg`.
#[inline(always)]
fn for_pieces(segs: &[Seg], t: &GradTiling, b: usize, mut f: impl FnMut(&Seg, usize, usize)) {
    let (s, e) = t.block_range(b);
    let first = segs.partition_point(|g| g.end() <= s);
    for g in segs.get(first..).unwrap_or(&[]) {
        if g.start >= e {
            break;
        }
        let lo = s.max(g.start) - g.start;
        let hi = e.min(g.end()) - g.start;
        f(g, lo, hi - lo);
    }
}

/// Statistics of block `b`.
///
/// # Safety
/// `segs` is the validated segment table of `t`'s tensors.
#[inline(always)]
pub(crate) unsafe fn block_stats<L: Lanes>(segs: &[Seg], t: &GradTiling, b: usize) -> Partial {
    let mut acc = Acc::new();
    for_pieces(
        segs,
        t,
        b,
        #[inline(always)]
        |g, lo, n| {
            // SAFETY: the table's rows describe validated tensors of `numel`
            // elements of `dtype`; `lo + n <= numel`; stats only read.
            unsafe {
                match g.dtype {
                    DType::F32 => {
                        seg_stats::<L, f32>(Src(g.data as *const f32).get(lo, n), &mut acc)
                    }
                    DType::F16 => {
                        seg_stats::<L, f16>(Src(g.data as *const f16).get(lo, n), &mut acc)
                    }
                    DType::BF16 => {
                        seg_stats::<L, bf16>(Src(g.data as *const bf16).get(lo, n), &mut acc)
                    }
                    DType::I32 | DType::I64 | DType::I16 | DType::U8 => {}
                }
            }
        },
    );
    acc.finish()
}

#[inline(always)]
fn seg_scale<L: Lanes, T: Float>(x: &mut [T], c: f32) {
    let vc = L::splat(c);
    let (groups, tail) = x.as_chunks_mut::<GROUP>();
    for g in groups {
        let v = T::load::<L>(g).mul(vc);
        T::store::<L>(v, g);
    }
    // Same arithmetic as the lanes: one f32 product, one rounding to T.
    for x in tail {
        *x = T::from_f32(x.to_f32() * c);
    }
}

/// Scales block `b` in place by `c`: `x = round(f32(x) * c)`.
///
/// # Safety
/// `segs` is the validated segment table of `t`'s tensors, which are
/// writable and pairwise disjoint; no one else touches block `b`'s range.
#[inline(always)]
pub(crate) unsafe fn block_scale<L: Lanes>(segs: &[Seg], t: &GradTiling, b: usize, c: f32) {
    for_pieces(
        segs,
        t,
        b,
        #[inline(always)]
        |g, lo, n| {
            // SAFETY: as for `block_stats`; blocks cover disjoint flat ranges and
            // the tensors do not overlap, so this range is this block's alone.
            unsafe {
                match g.dtype {
                    DType::F32 => seg_scale::<L, f32>(Dst(g.data as *mut f32).get(lo, n), c),
                    DType::F16 => seg_scale::<L, f16>(Dst(g.data as *mut f16).get(lo, n), c),
                    DType::BF16 => seg_scale::<L, bf16>(Dst(g.data as *mut bf16).get(lo, n), c),
                    DType::I32 | DType::I64 | DType::I16 | DType::U8 => {}
                }
            }
        },
    );
}

/// Combines the blocks' partials in block order (f64 sum, exact counts).
pub(crate) fn combine(parts: &[Partial], elements: u64) -> GradSummary {
    let mut s = GradSummary {
        sum_sq: 0.0,
        nan_count: 0,
        inf_count: 0,
        min: f32::INFINITY,
        max: f32::NEG_INFINITY,
        absmax: 0.0,
    };
    for p in parts {
        s.sum_sq += p.sum_sq;
        s.nan_count += p.nan;
        s.inf_count += p.inf;
        s.min = if p.min < s.min { p.min } else { s.min };
        s.max = if p.max > s.max { p.max } else { s.max };
    }
    finish_summary(s, elements)
}

/// Shared by kernels and reference: absmax from min and max, zeros reported
/// as +0.0 (SIMD min/max differ across ISAs in which zero they keep), NaN
/// min/max/absmax when no element is finite.
pub(crate) fn finish_summary(mut s: GradSummary, elements: u64) -> GradSummary {
    if s.nan_count.saturating_add(s.inf_count) >= elements {
        s.min = f32::NAN;
        s.max = f32::NAN;
        s.absmax = f32::NAN;
        return s;
    }
    if s.min == 0.0 {
        s.min = 0.0;
    }
    if s.max == 0.0 {
        s.max = 0.0;
    }
    let (a, b) = (-s.min, s.max);
    s.absmax = if a > b { a } else { b };
    s
}

/// Runs a registry call (`GradStats`, `ClipGradNorm`) on the CPU kernels.
///
/// # Safety
/// The call comes from the front end; `isa` is available.
pub(crate) unsafe fn cpu<C: GradCall>(c: &C, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded.
    unsafe { c.cpu(isa, runner) }
}

/// `grad_stats`: the blocks' partials, combined in block order.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn stats_call(c: &GradStatsCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: the front end lowered the list (at least one block) into the
    // checked workspace and points `summary` at its own result.
    unsafe {
        let parts = partials_of(c.workspace, &c.tiling);
        let s = stats_table(c.tensors.rows(), &c.tiling, parts, isa, runner);
        c.summary.write(s);
    }
}

/// `clip_grad_norm`: the statistics, then (unless refused) every element
/// times the coefficient, rounded once.
///
/// # Safety
/// As for `cpu`; the tensors are writable and pairwise disjoint.
pub(crate) unsafe fn clip_call(c: &ClipGradNormCall, isa: Available, runner: &dyn Runner) {
    let t = c.tiling;
    // SAFETY: as for `stats_call`.
    let (segs, s) = unsafe {
        let segs = c.tensors.rows();
        let parts = partials_of(c.workspace, &t);
        (segs, stats_table(segs, &t, parts, isa, runner))
    };
    // SAFETY: the call comes from the front end.
    match unsafe { c.decide(&s) } {
        // Multiplying by exactly 1.0 changes no bit here (see module docs).
        Some(coef) if coef != 1.0 => {
            // SAFETY: validated, writable, disjoint tensors; `isa` available.
            unsafe { dispatch_isa!(isa, L => scale_blocks::<L>(segs, &t, runner, coef)) }
        }
        _ => {}
    }
}

unsafe fn scale_blocks<L: Lanes>(segs: &[Seg], t: &GradTiling, runner: &dyn Runner, c: f32) {
    let nb = t.blocks as usize;
    runner.parallel_for(nb, &|b| {
        if b < nb {
            // SAFETY: validated, writable, disjoint tensors; block b's range
            // is touched by this task only; `L`'s ISA is available.
            unsafe {
                L::enter(
                    #[inline(always)]
                    || block_scale::<L>(segs, t, b, c),
                )
            };
        }
    });
}
