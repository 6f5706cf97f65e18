//! The gated backward on the CPU, one pass over dy, a and b writing da and
//! db, over any `Gate`: `da = act'(a) * (dy * b)`, `db = dy * act(a)`.

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
    /// The output gradient, `t.cols` a row.
    pub dy: Src<T>,
    /// The gate, at its row's start (`stride` apart).
    pub a: Src<T>,
    /// The other operand, likewise.
    pub b: Src<T>,
    /// The gate's gradient, laid out as a.
    pub da: Dst<T>,
    /// The other operand's gradient, laid out as b.
    pub db: Dst<T>,
    /// Elements between the starts of two input rows.
    pub stride: usize,
    /// Eager PyTorch's bits: `act(a)` and `dy * b` rounded to T.
    pub eager: bool,
    /// The plan.
    pub t: EltTiling,
}

/// Runs the plan on `runner`.
///
/// # Safety
/// `k` comes from a validated call (its operator's `prepare`) and `L` is
/// available on this CPU.
pub(crate) unsafe fn run<L: Lanes, T: Float, A: Gate>(k: &Kern<T>, runner: &dyn Runner) {
    run_blocks!(runner, k.t.flags, k.t.blocks, |blk| block::<L, T, A>(
        k, blk
    ));
}

/// One window's inputs and `reduce(a)`: the first stage of `grads`, done a
/// pair ahead in the line loop.
struct Staged<L: Lanes, A: Gate> {
    dy: L,
    a: L,
    b: L,
    e: A::Arg<L>,
}

impl<L: Lanes, A: Gate> Clone for Staged<L, A> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<L: Lanes, A: Gate> Copy for Staged<L, A> {}

#[inline(always)]
fn stage<L: Lanes, A: Gate>(dy: L, a: L, b: L) -> Staged<L, A> {
    let e = A::reduce(a);
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
unsafe fn stage_line<L: Lanes, T: Float, A: Gate>(
    k: &Kern<T>,
    iy: usize,
    ia: usize,
) -> [Staged<L, A>; 2] {
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

/// (da, db) at one window; eager rounds `dy * b` to T as eager PyTorch's
/// mul backward does (and `act(a)`, see `Gate::grad`).
#[inline(always)]
fn grads<L: Lanes, T: Float, A: Gate>(Staged { dy, a, b, e }: Staged<L, A>, eager: bool) -> (L, L) {
    let g = eager_round::<L, T>(dy.mul(b), eager);
    let (da, act) = A::grad::<L, T>(a, e, g, eager);
    (da, dy.mul(act))
}

#[inline(always)]
fn block<L: Lanes, T: Float, A: Gate, const STREAM: bool>(k: &Kern<T>, blk: usize) {
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
                    let (da, db) = grads::<L, T, A>(
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
                unsafe { stage_line::<L, T, A>(k, iy + p, ia + p) }
            },
            |p, s| {
                let [s0, s1] = s;
                let (da0, db0) = grads::<L, T, A>(s0, k.eager);
                let (da1, db1) = grads::<L, T, A>(s1, k.eager);
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
