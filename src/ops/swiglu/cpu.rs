//! SwiGLU on the CPU: one pass, `y = silu(a) * b` per window, in the ISA's
//! lanes (`lanes::math::silu`: the same bits on every ISA).

use super::*;
use crate::lanes::detect::Available;
use crate::lanes::math::{silu_finish, silu_reduce, ExpArg};
use crate::lanes::{dispatch_isa, Lanes};
use crate::ops::elementwise::{dispatch_t, eager_round, for_block_rows, prefetch_ahead};
use crate::ops::norm::{for_lines_piped, load_at, load_line, put_line, store_at};
use crate::ops::run_blocks;
use crate::runner::Runner;
use crate::workspace::{Dst, Src};

/// What a block needs, copied into registers.
#[derive(Clone, Copy)]
struct Kern<T> {
    a: Src<T>,
    b: Src<T>,
    y: Dst<T>,
    stride: usize,
    eager: bool,
    t: EltTiling,
}

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &SwigluCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe { dispatch_isa!(isa, L => dispatch_t!(call.a.dtype, run::<L>(call, runner))) }
}

/// y at one window: silu(a) (rounded to T when eager) times b, from `a`'s
/// `silu_reduce` (done a pair ahead in the line loop).
#[inline(always)]
fn y_of<L: Lanes, T: Float>((a, b, e): (L, L, ExpArg<L>), eager: bool) -> L {
    eager_round::<L, T>(silu_finish(a, e), eager).mul(b)
}

/// The line at `i` of a and b, in `T`'s line order on `L` (elementwise:
/// the order changes no bit, and on AVX-512 without BF16 it spares a bf16
/// line two widenings in and two word permutes out), and `a`'s
/// `silu_reduce` (a function, not a closure: closures were not inlined
/// into the ISA's entry).
///
/// # Safety
/// The line is inside a and b.
#[inline(always)]
unsafe fn stage_line<L: Lanes, T: Float>(k: &Kern<T>, i: usize) -> [(L, L, ExpArg<L>); 2] {
    // SAFETY: forwarded.
    let ((a0, a1), (b0, b1)) = unsafe { (load_line::<L, T>(k.a, i), load_line::<L, T>(k.b, i)) };
    [(a0, b0, silu_reduce(a0)), (a1, b1, silu_reduce(a1))]
}

unsafe fn run<L: Lanes, T: Float>(call: &SwigluCall, runner: &dyn Runner) {
    let t = call.tiling;
    let o = operands(call.split, t.cols as usize);
    let a = call.a.data as *const T;
    let b = if call.split != 0 {
        a.wrapping_add(o.b_offset)
    } else {
        call.b.data as *const T
    };
    let k = Kern {
        a: Src(a),
        b: Src(b),
        y: Dst(call.y.data as *mut T),
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
        let head = if STREAM { k.y.line_head(iy, n) } else { 0 };
        for_lines_piped!(
            n,
            head,
            |j, len| {
                // SAFETY: columns c + j.. of row r, inside every operand
                // (validated shapes); the block owns this output row range.
                unsafe {
                    let a = load_at::<L, T>(k.a, ia + j, len);
                    let b = load_at::<L, T>(k.b, ia + j, len);
                    let v = y_of::<L, T>((a, b, silu_reduce(a)), k.eager);
                    store_at::<L, T>(v, k.y, iy + j, len)
                }
            },
            |p| {
                prefetch_ahead::<L, T>(k.a, ia + p);
                prefetch_ahead::<L, T>(k.b, ia + p);
                // SAFETY: as above, 32 columns.
                unsafe { stage_line::<L, T>(k, ia + p) }
            },
            |p, s| {
                let [s0, s1] = s;
                let (y0, y1) = (y_of::<L, T>(s0, k.eager), y_of::<L, T>(s1, k.eager));
                // SAFETY: as above, 32 columns (in line order, as loaded).
                unsafe { put_line::<L, T, STREAM>(k.y, iy + p, y0, y1) }
            }
        );
    });
    if STREAM {
        L::stream_fence();
    }
}
