//! SwiGluGrad on the CPU: one pass over dy, a and b writing da and db.

use super::*;
use crate::lanes::detect::Available;
use crate::lanes::math::{exp_scale, silu_reduce, ExpArg};
use crate::lanes::{dispatch_isa, Lanes};
use crate::ops::elementwise::{dispatch_t, eager_round, for_block_rows, prefetch_ahead};
use crate::ops::norm::{for_lines_piped, load_at, load_line, put_line, store_at};
use crate::ops::run_blocks;
use crate::runner::Runner;
use crate::workspace::{Dst, Src};

/// What a block needs, copied into registers.
#[derive(Clone, Copy)]
struct Kern<T> {
    dy: Src<T>,
    a: Src<T>,
    b: Src<T>,
    da: Dst<T>,
    db: Dst<T>,
    stride: usize,
    eager: bool,
    t: EltTiling,
}

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &SwigluGradCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe { dispatch_isa!(isa, L => dispatch_t!(call.a.dtype, run::<L>(call, runner))) }
}

/// One window's inputs and its `exp(-a)` reduced (`silu_reduce`): the first stage of
/// `grads`, done a pair ahead in the line loop.
#[derive(Clone, Copy)]
struct Staged<L> {
    dy: L,
    a: L,
    b: L,
    e: ExpArg<L>,
}

#[inline(always)]
fn stage<L: Lanes>(dy: L, a: L, b: L) -> Staged<L> {
    let e = silu_reduce(a);
    Staged { dy, a, b, e }
}

/// `stage` of the lines at `iy` in dy, `ia` in a and b, in `T`'s line
/// order on `L` (elementwise: the order changes no bit, and on AVX-512
/// without BF16 it spares a bf16 line two widenings in and two word
/// permutes out; a function, not a closure: closures were not inlined
/// into the ISA's entry).
///
/// # Safety
/// The line is inside every operand.
#[inline(always)]
unsafe fn stage_line<L: Lanes, T: Float>(k: &Kern<T>, iy: usize, ia: usize) -> [Staged<L>; 2] {
    // SAFETY: forwarded.
    let ((dy0, dy1), (a0, a1), (b0, b1)) = unsafe {
        (
            load_line::<L, T>(k.dy, iy),
            load_line::<L, T>(k.a, ia),
            load_line::<L, T>(k.b, ia),
        )
    };
    [stage(dy0, a0, b0), stage(dy1, a1, b1)]
}

/// (da, db) at one window. PyTorch's formulas: `silu = a / (1 + e)`,
/// `s = 1 / (1 + e)` with `e = exp(-a)`; eager rounds `silu` and `dy * b`
/// to T as its saved forward output and its mul backward do.
#[inline(always)]
fn grads<L: Lanes, T: Float>(Staged { dy, a, b, e }: Staged<L>, eager: bool) -> (L, L) {
    let one = L::splat(1.0);
    let den = one.add(exp_scale(e));
    let s = one.div(den);
    let silu = eager_round::<L, T>(a.div(den), eager);
    let g = eager_round::<L, T>(dy.mul(b), eager);
    let da = g.mul(s).mul(one.add(a.mul(one.sub(s))));
    (da, dy.mul(silu))
}

unsafe fn run<L: Lanes, T: Float>(call: &SwigluGradCall, runner: &dyn Runner) {
    let t = call.tiling;
    let o = operands(call.split, t.cols as usize);
    let (a, da) = (call.a.data as *const T, call.da.data as *mut T);
    let (b, db) = if call.split != 0 {
        (a.wrapping_add(o.b_offset), da.wrapping_add(o.b_offset))
    } else {
        (call.b.data as *const T, call.db.data as *mut T)
    };
    let k = Kern {
        dy: Src(call.dy.data as *const T),
        a: Src(a),
        b: Src(b),
        da: Dst(da),
        db: Dst(db),
        stride: o.stride,
        eager: call.rounding == ElemRounding::Eager,
        t,
    };
    run_blocks!(runner, t.flags, t.blocks, |blk| block::<L, T>(&k, blk));
}

#[inline(always)]
fn block<L: Lanes, T: Float, const STREAM: bool>(k: &Kern<T>, blk: usize) {
    let k = &{ *k };
    let cols = k.t.cols as usize;
    for_block_rows!(&k.t, blk, |r, c, n| {
        let (ia, iy) = (r * k.stride + c, r * cols + c);
        let head = if STREAM { k.da.line_head(ia, n) } else { 0 };
        for_lines_piped!(
            n,
            head,
            |j, len| {
                // SAFETY: columns c + j.. of row r, inside every operand
                // (validated shapes); the block owns these output ranges.
                unsafe {
                    let (da, db) = grads::<L, T>(
                        stage(
                            load_at::<L, T>(k.dy, iy + j, len),
                            load_at::<L, T>(k.a, ia + j, len),
                            load_at::<L, T>(k.b, ia + j, len),
                        ),
                        k.eager,
                    );
                    store_at::<L, T>(da, k.da, ia + j, len);
                    store_at::<L, T>(db, k.db, ia + j, len);
                }
            },
            |p| {
                prefetch_ahead::<L, T>(k.dy, iy + p);
                prefetch_ahead::<L, T>(k.a, ia + p);
                prefetch_ahead::<L, T>(k.b, ia + p);
                // SAFETY: as above, 32 columns.
                unsafe { stage_line::<L, T>(k, iy + p, ia + p) }
            },
            |p, s| {
                let [s0, s1] = s;
                let (da0, db0) = grads::<L, T>(s0, k.eager);
                let (da1, db1) = grads::<L, T>(s1, k.eager);
                // SAFETY: as above, 32 columns (in line order, as loaded).
                unsafe {
                    put_line::<L, T, STREAM>(k.da, ia + p, da0, da1);
                    put_line::<L, T, STREAM>(k.db, ia + p, db0, db1);
                }
            }
        );
    });
    if STREAM {
        L::stream_fence();
    }
}
