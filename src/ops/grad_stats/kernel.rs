//! The CPU kernels: one block of the flat element range at a time.
//!
//! Stats: every element is widened to f32 on the `Lanes` (the crate's
//! load/convert layer) and accumulated into a fixed 16-lane pattern — element
//! `k` of a tensor's piece in the block goes to lane `k % 16`, sequentially —
//! then the lanes are folded in one fixed tree (lane `i + 8` onto `i`, then
//! `+4`, `+2`, `+1`). Squares are exact in f64 (an f32 has a 24-bit
//! significand) and summed in f64: an f32 lane sum of squares would overflow
//! for finite f32/bf16 values above ~1.8e19 and drift on long blocks.
//! `Lanes` has no compare, min/max or f64 widening, so this arithmetic is
//! written as fixed-width `[f64; 16]` / `[f32; 16]` loops, which LLVM
//! vectorizes; the order of every operation is fixed by the plan alone.
//!
//! Non-finite values: the hot loop does not test each element. It keeps
//! ±Inf in min/max and lets NaN/Inf reach the f64 sums; after each window of
//! `chunk_elems` elements it checks the 16 sums (finite squares can never
//! overflow f64), and only a window that did meet NaN/Inf is restored and
//! re-scanned with the masked, counting loop while it is still in cache. On
//! finite data both loops perform the same operations, so the result never
//! depends on which one ran.

use super::plan::{GradTiling, Partial, Seg};
use crate::dtype::DType;
use crate::lanes::{LaneElem, Lanes, GROUP};
use crate::workspace::{Dst, Src};
use half::{bf16, f16};

const INF_BITS: u32 = 0x7f80_0000;

/// The 16 lanes of one block's running statistics.
#[derive(Clone, Copy)]
struct LaneAcc {
    sq: [f64; GROUP],
    min: [f32; GROUP],
    max: [f32; GROUP],
    absmax: [f32; GROUP],
}

struct Acc {
    lanes: LaneAcc,
    nan: u64,
    inf: u64,
}

impl Acc {
    fn new() -> Self {
        Acc {
            lanes: LaneAcc {
                sq: [0.0; GROUP],
                min: [f32::INFINITY; GROUP],
                max: [f32::NEG_INFINITY; GROUP],
                absmax: [0.0; GROUP],
            },
            nan: 0,
            inf: 0,
        }
    }

    fn finish(self) -> Partial {
        let l = self.lanes;
        Partial {
            sum_sq: fold(l.sq, |a, b| a + b),
            nan: self.nan,
            inf: self.inf,
            min: fold(l.min, |a, b| if b < a { b } else { a }),
            max: fold(l.max, |a, b| if b > a { b } else { a }),
            absmax: fold(l.absmax, |a, b| if b > a { b } else { a }),
        }
    }
}

/// The fixed lane fold: `i + 8` onto `i`, then `+4`, `+2`, `+1`.
#[inline(always)]
fn fold<T: Copy>(mut w: [T; GROUP], f: impl Fn(T, T) -> T) -> T {
    let mut step = GROUP / 2;
    while step > 0 {
        for i in 0..step {
            w[i] = f(w[i], w[i + step]);
        }
        step /= 2;
    }
    w[0]
}

#[inline(always)]
fn abs32(x: f32) -> f32 {
    f32::from_bits(x.to_bits() & 0x7fff_ffff)
}

/// The hot loop body: no per-element test; NaN is ignored by the compares,
/// ±Inf is not (the window check catches both).
#[inline(always)]
fn fast(a: &mut LaneAcc, v: &[f32; GROUP]) {
    for i in 0..GROUP {
        let x = v[i];
        let d = x as f64;
        // Separate mul and add: Rust never contracts them into an FMA.
        a.sq[i] += d * d;
        a.min[i] = if x < a.min[i] { x } else { a.min[i] };
        a.max[i] = if x > a.max[i] { x } else { a.max[i] };
        let m = abs32(x);
        a.absmax[i] = if m > a.absmax[i] { m } else { a.absmax[i] };
    }
}

/// The masked loop: finite elements exactly as `fast`, NaN/Inf only counted.
/// `v` holds up to 16 lanes starting at lane 0.
#[inline(always)]
fn masked(acc: &mut Acc, v: &[f32]) {
    let a = &mut acc.lanes;
    for (i, &x) in v.iter().enumerate().take(GROUP) {
        let bits = x.to_bits() & 0x7fff_ffff;
        if bits < INF_BITS {
            let d = x as f64;
            a.sq[i] += d * d;
            a.min[i] = if x < a.min[i] { x } else { a.min[i] };
            a.max[i] = if x > a.max[i] { x } else { a.max[i] };
            let m = abs32(x);
            a.absmax[i] = if m > a.absmax[i] { m } else { a.absmax[i] };
        } else if bits == INF_BITS {
            acc.inf += 1;
        } else {
            acc.nan += 1;
        }
    }
}

#[inline(always)]
fn widen<L: Lanes, T: LaneElem>(g: &[T; GROUP]) -> [f32; GROUP] {
    let mut v = [0f32; GROUP];
    T::load::<L>(g).store(&mut v);
    v
}

#[inline(always)]
fn seg_stats<L: Lanes, T: LaneElem>(x: &[T], acc: &mut Acc, chunk_groups: usize) {
    let (groups, tail) = x.as_chunks::<GROUP>();
    for win in groups.chunks(chunk_groups.max(1)) {
        let saved = acc.lanes;
        for g in win {
            fast(&mut acc.lanes, &widen::<L, T>(g));
        }
        if !acc.lanes.sq.iter().all(|s| s.is_finite()) {
            // The window met NaN/Inf: redo it masked (it is still in cache).
            acc.lanes = saved;
            for g in win {
                masked(acc, &widen::<L, T>(g));
            }
        }
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
pub(crate) unsafe fn block_stats<L: Lanes>(segs: &[Seg], t: &GradTiling, b: usize) -> Partial {
    let mut acc = Acc::new();
    let cg = (t.chunk_elems as usize) / GROUP;
    for_pieces(segs, t, b, |g, lo, n| {
        // SAFETY: the table's rows describe validated tensors of `numel`
        // elements of `dtype`; `lo + n <= numel`; stats only read.
        unsafe {
            match g.dtype {
                DType::F32 => {
                    seg_stats::<L, f32>(Src(g.data as *const f32).get(lo, n), &mut acc, cg)
                }
                DType::F16 => {
                    seg_stats::<L, f16>(Src(g.data as *const f16).get(lo, n), &mut acc, cg)
                }
                DType::BF16 => {
                    seg_stats::<L, bf16>(Src(g.data as *const bf16).get(lo, n), &mut acc, cg)
                }
                DType::I32 | DType::I64 => {}
            }
        }
    });
    acc.finish()
}

#[inline(always)]
fn seg_scale<L: Lanes, T: LaneElem>(x: &mut [T], c: f32) {
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
pub(crate) unsafe fn block_scale<L: Lanes>(segs: &[Seg], t: &GradTiling, b: usize, c: f32) {
    for_pieces(segs, t, b, |g, lo, n| {
        // SAFETY: as for `block_stats`; blocks cover disjoint flat ranges and
        // the tensors do not overlap, so this range is this block's alone.
        unsafe {
            match g.dtype {
                DType::F32 => seg_scale::<L, f32>(Dst(g.data as *mut f32).get(lo, n), c),
                DType::F16 => seg_scale::<L, f16>(Dst(g.data as *mut f16).get(lo, n), c),
                DType::BF16 => seg_scale::<L, bf16>(Dst(g.data as *mut bf16).get(lo, n), c),
                DType::I32 | DType::I64 => {}
            }
        }
    });
}

/// Combines the blocks' partials in block order (f64 sum, exact counts).
pub(crate) fn combine(parts: &[Partial], elements: u64) -> super::GradSummary {
    let mut s = super::GradSummary {
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
        s.absmax = if p.absmax > s.absmax {
            p.absmax
        } else {
            s.absmax
        };
    }
    if s.nan_count + s.inf_count >= elements {
        s.min = f32::NAN;
        s.max = f32::NAN;
        s.absmax = f32::NAN;
    }
    s
}
