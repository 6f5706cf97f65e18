//! RoPE on the CPU: per row of head_dim, the two halves rotated together
//! (columns j and j + d/2), cos/sin rows found by a broadcast odometer.

use super::*;
use crate::lanes::detect::Available;
use crate::lanes::GROUP as G;
use crate::lanes::{dispatch_isa, Lanes};
use crate::ops::dispatch_xg;
use crate::ops::elementwise::{eager_round, prefetch_ahead};
use crate::ops::norm::{load_at, put_pair, store_at};
use crate::runner::{for_plan, Runner};
use crate::tiling::NORM_FLAG_STREAM;
use crate::workspace::{Dst, Src};

/// What a block needs, copied into registers.
#[derive(Clone, Copy)]
struct Kern<C> {
    cos: Src<C>,
    sin: Src<C>,
    d: usize,
    eager: bool,
    backward: bool,
}

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &RopeCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        dispatch_isa!(isa, L => dispatch_xg!(call.q.dtype, call.cos.dtype, run::<L>(call, runner)))
    }
}

/// The rotation of one window: forward `(x1 c1 - x2 s1, x2 c2 + x1 s2)`,
/// backward `(x1 c1 + x2 s2, x2 c2 - x1 s1)`; eager rounds each product.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn rot<L: Lanes, T: Float>(
    x1: L,
    x2: L,
    c1: L,
    c2: L,
    s1: L,
    s2: L,
    eager: bool,
    bwd: bool,
) -> (L, L) {
    let r = |v: L| eager_round::<L, T>(v, eager);
    let (p1, p2) = (r(x1.mul(c1)), r(x2.mul(c2)));
    if bwd {
        (p1.add(r(x2.mul(s2))), p2.sub(r(x1.mul(s1))))
    } else {
        (p1.sub(r(x2.mul(s1))), p2.add(r(x1.mul(s2))))
    }
}

unsafe fn run<L: Lanes, T: Float, C: Float>(call: &RopeCall, runner: &dyn Runner) {
    let t = call.tiling;
    let k = Kern::<C> {
        cos: Src(call.cos.data as *const C),
        sin: Src(call.sin.data as *const C),
        d: t.cols as usize,
        eager: call.rounding == ElemRounding::Eager,
        backward: call.backward != 0,
    };
    let stream = t.flags & NORM_FLAG_STREAM != 0;
    let qr = call.q_rows as usize;
    // The row segments of q, then of k: (x, y, first plan row, Bcast origin).
    let segs = [
        (
            Src(call.q.data as *const T),
            Dst(call.q_out.data as *mut T),
            0,
            Bcast::new(&call.q, &call.cos, 0),
        ),
        (
            Src(call.k.data as *const T),
            Dst(call.k_out.data as *mut T),
            qr,
            Bcast::new(&call.k, &call.cos, 0),
        ),
    ];
    for_plan(runner, t.flags).parallel_for(t.blocks as usize, &|blk| {
        let (u0, u1) = t.block_units(blk);
        if u0 >= u1 {
            return;
        }
        let (first, last) = (t.unit(u0), t.unit(u1 - 1));
        let (r0, r1) = (first.row, last.row + last.rows);
        for (i, (xs, ys, base, origin)) in segs.iter().copied().enumerate() {
            let (lo, hi) = if i == 0 { (0, qr) } else { (qr, usize::MAX) };
            let (a, b) = (r0.clamp(lo, hi) - base, r1.clamp(lo, hi) - base);
            if a >= b {
                continue;
            }
            let bc = origin.at(a);
            // SAFETY: the caller picked L among the ISAs this CPU has; rows
            // a..b belong to this block.
            unsafe {
                L::enter(
                    #[inline(always)]
                    || crate::ops::store_form!(stream, rows::<L, T, C>(&k, xs, ys, bc, a, b)),
                )
            }
        }
    });
}

/// Rows `a..b` of x into y.
///
/// # Safety
/// The rows are inside x and y, which the calling block owns; `bc` is at row `a`.
#[inline(always)]
unsafe fn rows<L: Lanes, T: Float, C: Float, const STREAM: bool>(
    k: &Kern<C>,
    x: Src<T>,
    y: Dst<T>,
    mut bc: Bcast,
    a: usize,
    b: usize,
) {
    let k = &{ *k };
    let (d, h) = (k.d, k.d / 2);
    for r in a..b {
        let (xo, co) = (r * d, bc.row * d);
        // SAFETY: columns of row r of x/y and of cos/sin row bc.row (validated).
        unsafe {
            if h % (2 * G) == 0 {
                let mut p = 0;
                while p < h {
                    prefetch_ahead::<L, T>(x, xo + p);
                    prefetch_ahead::<L, T>(x, xo + h + p);
                    let mut out = [[L::splat(0.0); 2]; 2];
                    for (i, o) in [0, G].into_iter().enumerate() {
                        let j = p + o;
                        let (y1, y2) = rot::<L, T>(
                            load_at::<L, T>(x, xo + j, G),
                            load_at::<L, T>(x, xo + h + j, G),
                            load_at::<L, C>(k.cos, co + j, G),
                            load_at::<L, C>(k.cos, co + h + j, G),
                            load_at::<L, C>(k.sin, co + j, G),
                            load_at::<L, C>(k.sin, co + h + j, G),
                            k.eager,
                            k.backward,
                        );
                        out[0][i] = y1;
                        out[1][i] = y2;
                    }
                    put_pair::<L, T, STREAM>(y, xo + p, out[0][0], out[0][1]);
                    put_pair::<L, T, STREAM>(y, xo + h + p, out[1][0], out[1][1]);
                    p += 2 * G;
                }
            } else {
                let mut j = 0;
                while j < h {
                    let len = (h - j).min(G);
                    let (y1, y2) = rot::<L, T>(
                        load_at::<L, T>(x, xo + j, len),
                        load_at::<L, T>(x, xo + h + j, len),
                        load_at::<L, C>(k.cos, co + j, len),
                        load_at::<L, C>(k.cos, co + h + j, len),
                        load_at::<L, C>(k.sin, co + j, len),
                        load_at::<L, C>(k.sin, co + h + j, len),
                        k.eager,
                        k.backward,
                    );
                    store_at::<L, T>(y1, y, xo + j, len);
                    store_at::<L, T>(y2, y, xo + h + j, len);
                    j += len;
                }
            }
        }
        bc.next();
    }
    if STREAM {
        L::stream_fence();
    }
}
