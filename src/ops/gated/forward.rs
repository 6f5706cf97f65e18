//! The gated forward on the CPU, one pass: `y = act(a) * b` per window (and
//! `act(a)` itself when asked), over any `Gate`, in the ISA's lanes.

use super::Gate;
use crate::dtype::Float;
use crate::lanes::Lanes;
use crate::ops::elementwise::{eager_round, for_block_rows, prefetch_ahead};
use crate::ops::norm::{for_lines_piped, load_at, load_line, put_line, store_at};
use crate::ops::run_blocks;
use crate::runner::Runner;
use crate::tiling::EltTiling;
use crate::workspace::{Dst, Src};

/// What a block needs, copied into registers.
#[derive(Clone, Copy)]
pub(crate) struct Kern<T> {
    /// The gate, at its row's start (`stride` apart).
    pub a: Src<T>,
    /// The other operand, likewise.
    pub b: Src<T>,
    /// The output, `t.cols` a row.
    pub y: Dst<T>,
    /// `act(a)`, laid out as y; only written with `WithAct`.
    pub act: Dst<T>,
    /// Elements between the starts of two input rows.
    pub stride: usize,
    /// Round `act(a)` to T before the product (eager PyTorch's bits).
    pub eager: bool,
    /// The plan.
    pub t: EltTiling,
}

/// Whether the kernel also stores `act(a)` (torch_npu's `npu_geglu`
/// returns it): a type, so the loop without it has no test.
pub(crate) trait ActOut {
    /// Stores `act(a)`.
    const STORE: bool;
}

/// Only y.
pub(crate) struct NoAct;
impl ActOut for NoAct {
    const STORE: bool = false;
}

/// y and `act(a)`.
pub(crate) struct WithAct;
impl ActOut for WithAct {
    const STORE: bool = true;
}

/// Runs the plan on `runner`.
///
/// # Safety
/// `k` comes from a validated call (its operator's `prepare`), `L` is
/// available on this CPU, and with `WithAct`, `k.act` is y's shape.
pub(crate) unsafe fn run<L: Lanes, T: Float, A: Gate, O: ActOut>(k: &Kern<T>, runner: &dyn Runner) {
    run_blocks!(runner, k.t.flags, k.t.blocks, |blk| block::<L, T, A, O>(
        k, blk
    ));
}

/// `(act(a), y)` at one window from `a`'s `reduce` (done a pair ahead in the
/// line loop); `act` rounded to T first when eager.
#[inline(always)]
fn y_of<L: Lanes, T: Float, A: Gate>((a, b, e): (L, L, A::Arg<L>), eager: bool) -> (L, L) {
    let act = eager_round::<L, T>(A::value(a, e), eager);
    (act, act.mul(b))
}

/// The line at `i` of a and b, in `T`'s line order on `L` (elementwise:
/// the order changes no bit, and on AVX-512 without BF16 it spares a bf16
/// line two widenings in and two word permutes out), and `a`'s `reduce`
/// (a function, not a closure: closures were not inlined into the ISA's
/// entry).
///
/// # Safety
/// The line is inside a and b.
#[inline(always)]
unsafe fn stage_line<L: Lanes, T: Float, A: Gate>(k: &Kern<T>, i: usize) -> [(L, L, A::Arg<L>); 2] {
    // SAFETY: forwarded.
    let ((a0, a1), (b0, b1)) = unsafe { (load_line::<L, T>(k.a, i), load_line::<L, T>(k.b, i)) };
    [(a0, b0, A::reduce(a0)), (a1, b1, A::reduce(a1))]
}

#[inline(always)]
fn block<L: Lanes, T: Float, A: Gate, O: ActOut, const STREAM: bool>(k: &Kern<T>, blk: usize) {
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
                    let (act, v) = y_of::<L, T, A>((a, b, A::reduce(a)), k.eager);
                    store_at::<L, T>(v, k.y, iy + j, len);
                    if O::STORE {
                        store_at::<L, T>(act, k.act, iy + j, len);
                    }
                }
            },
            |p| {
                prefetch_ahead::<L, T>(k.a, ia + p);
                prefetch_ahead::<L, T>(k.b, ia + p);
                // SAFETY: as above, 32 columns.
                unsafe { stage_line::<L, T, A>(k, ia + p) }
            },
            |p, s| {
                let [s0, s1] = s;
                let ((g0, y0), (g1, y1)) =
                    (y_of::<L, T, A>(s0, k.eager), y_of::<L, T, A>(s1, k.eager));
                // SAFETY: as above, 32 columns (in line order, as loaded).
                unsafe {
                    put_line::<L, T, STREAM>(k.y, iy + p, y0, y1);
                    if O::STORE {
                        put_line::<L, T, STREAM>(k.act, iy + p, g0, g1);
                    }
                }
            }
        );
    });
    if STREAM {
        L::stream_fence();
    }
}
