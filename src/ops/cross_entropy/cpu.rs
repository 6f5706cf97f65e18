//! CrossEntropy on the CPU. Per row: pass 1 (forward, fused) streams the
//! row once for the online log-sum-exp (`OnlineLse`) and, with label
//! smoothing, the weighted logit sum (`RowSum`); pass 2 (backward, fused)
//! re-reads the row (from cache) and writes dlogits, each window read
//! before it is written, so dlogits may be the logits. Everything is f32
//! in `lanes::math`'s functions and fixed orders: the same bits on every
//! ISA, block count and thread count.

use core::mem::MaybeUninit;

use super::*;
use crate::lanes::detect::Available;
use crate::lanes::math::{exp, log, tanh};
use crate::lanes::{dispatch_isa, Lanes, RowSum, GROUP, SEGMENT_GROUPS};
use crate::ops::elementwise::dispatch_t;
use crate::ops::embedding_dense_grad::{dispatch_index, IndexElem};
use crate::ops::norm::{load_at, store_at};
use crate::ops::run_blocks;
use crate::runner::Runner;
use crate::tiling::NORM_FLAG_STREAM;
use crate::workspace::{Dst, Src, Workspace};

/// Groups of 16 columns per step of the online max: the chunk's max is
/// taken first, so the running sum is rescaled once per chunk (1 + 1/8
/// `exp` per element). 8 divides `SEGMENT_GROUPS`: no chunk straddles a
/// segment.
const CHUNK: usize = 8;

/// What a block needs, copied into registers.
#[derive(Clone, Copy)]
struct Kern<T, I> {
    x: Src<T>,
    d: Dst<T>,
    tgt: Src<I>,
    w: Option<Src<f32>>,
    lse_in: Src<f32>,
    grad: Src<f32>,
    /// Per-row losses: the output (`None` reduction, fused) or the workspace.
    loss: Option<Dst<f32>>,
    lse: Option<Dst<f32>>,
    fwd: bool,
    bwd: bool,
    per_row: bool,
    /// The gradient factor of every row when not per row (a mean's
    /// division done).
    g0: f32,
    rows: usize,
    cols: usize,
    rpb: usize,
    ignore: i64,
    ls: f32,
    /// `ls / C`.
    lsc: f32,
    zs: f32,
    cap: f32,
    /// `sum_c w_c` (C without a weight).
    w_sum: f32,
}

/// Runs the call on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &CrossEntropyCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe { dispatch_isa!(isa, L => dispatch_t!(call.logits.dtype, run_t::<L>(call, runner))) }
}

unsafe fn run_t<L: Lanes, T: Float>(call: &CrossEntropyCall, runner: &dyn Runner) {
    // SAFETY: forwarded.
    unsafe { dispatch_index!(call.target.dtype, run::<L, T>(call, runner)) }
}

/// `(x, tanh(z / cap))` with `x` the soft-capped logit (`z` itself, and no
/// tanh, when `cap` is 0).
#[inline(always)]
fn capped<L: Lanes>(z: L, cap: f32) -> (L, L) {
    if cap > 0.0 {
        let c = L::splat(cap);
        let th = tanh(z.div(c));
        (th.mul(c), th)
    } else {
        (z, z)
    }
}

/// Lane 0 of `v`.
#[inline(always)]
fn lane0<L: Lanes>(v: L) -> f32 {
    let mut o = [0f32; GROUP];
    v.store(&mut o);
    o[0]
}

/// `v` with lanes `n..16` set to -Inf (they add `exp(-Inf) = 0`).
#[inline(always)]
fn pad_neg_inf<L: Lanes>(v: L, n: usize) -> L {
    let mut t = [0f32; GROUP];
    v.store(&mut t);
    for x in t.iter_mut().skip(n) {
        *x = f32::NEG_INFINITY;
    }
    L::load(&t)
}

/// `v` at lane `i`, 0 elsewhere.
#[inline(always)]
fn one_hot<L: Lanes>(i: usize, v: f32) -> L {
    let mut t = [0f32; GROUP];
    if let Some(x) = t.get_mut(i) {
        *x = v;
    }
    L::load(&t)
}

/// A fixed-order f32 sum of `n` values given by `f` (16 lanes, `RowSum`).
#[inline(always)]
fn sum_of<L: Lanes>(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let mut s = RowSum::<L>::new();
    let mut i = 0;
    while i < n {
        let g: [f32; GROUP] = core::array::from_fn(|l| if i + l < n { f(i + l) } else { 0.0 });
        s.push(L::load(&g));
        i += GROUP;
    }
    s.finish()
}

/// Per lane a running max `m` (never NaN: a NaN logit never wins the
/// compare; it makes the sum NaN instead) and `s = sum exp(x - m)`,
/// rescaled by `exp(m_old - m_new)` when the max grows (exactly 1 when it
/// does not). Segments of `SEGMENT_GROUPS` groups are merged pairwise as
/// `RowSum` merges its partials (a binary counter: the tree depends on the
/// row length alone), then the 16 lanes in a fixed order.
struct OnlineLse<L: Lanes> {
    m: L,
    s: L,
    in_segment: usize,
    segments: u64,
    depth: usize,
    /// Pending partials; slots `..depth` are written.
    stack: [MaybeUninit<(L, L)>; 48],
}

impl<L: Lanes> OnlineLse<L> {
    #[inline(always)]
    fn new() -> Self {
        OnlineLse {
            m: L::splat(-f32::MAX),
            s: L::splat(0.0),
            in_segment: 0,
            segments: 0,
            depth: 0,
            stack: [const { MaybeUninit::uninit() }; 48],
        }
    }

    /// Adds up to `CHUNK` groups (padding lanes -Inf).
    #[inline(always)]
    fn chunk(&mut self, v: &[L]) {
        let mut mn = self.m;
        for x in v {
            mn = mn.select_lt(*x, *x, mn);
        }
        let mut s = self.s.mul(exp(self.m.sub(mn)));
        for x in v {
            s = s.add(exp(x.sub(mn)));
        }
        self.m = mn;
        self.s = s;
        self.in_segment += v.len();
        if self.in_segment >= SEGMENT_GROUPS {
            self.close_segment();
        }
    }

    /// `(m, s)` of the union of two partials.
    #[inline(always)]
    fn merge(a: (L, L), b: (L, L)) -> (L, L) {
        let m = a.0.select_lt(b.0, b.0, a.0);
        let s = a.1.mul(exp(a.0.sub(m))).add(b.1.mul(exp(b.0.sub(m))));
        (m, s)
    }

    #[inline(always)]
    fn close_segment(&mut self) {
        let mut p = (self.m, self.s);
        let mut c = self.segments;
        while c & 1 == 1 && self.depth > 0 {
            p = Self::merge(self.slot(self.depth - 1), p);
            self.depth -= 1;
            c >>= 1;
        }
        if let Some(slot) = self.stack.get_mut(self.depth) {
            *slot = MaybeUninit::new(p);
            self.depth += 1;
        }
        self.segments += 1;
        self.m = L::splat(-f32::MAX);
        self.s = L::splat(0.0);
        self.in_segment = 0;
    }

    /// Pending partial `i` (`i < depth`).
    #[inline(always)]
    fn slot(&self, i: usize) -> (L, L) {
        debug_assert!(i < self.depth);
        // SAFETY: slots below `depth` were written by `close_segment` (the
        // only place `depth` grows, right after writing the slot), and every
        // caller passes `i < depth`.
        unsafe { self.stack[i].assume_init() }
    }

    /// `max + log(sum)`: -Inf for a row of -Inf, NaN when a logit is NaN
    /// or +Inf (as `log_softmax` makes such rows NaN).
    #[inline(always)]
    fn finish(mut self) -> f32 {
        if self.in_segment > 0 || self.segments == 0 {
            self.close_segment();
        }
        if self.depth == 0 {
            return f32::NAN;
        }
        let mut r = self.slot(self.depth - 1);
        for i in (0..self.depth - 1).rev() {
            r = Self::merge(self.slot(i), r);
        }
        let (mut ma, mut sa) = ([0f32; GROUP], [0f32; GROUP]);
        r.0.store(&mut ma);
        r.1.store(&mut sa);
        let mut m = ma[0];
        for &v in &ma[1..] {
            if m < v {
                m = v;
            }
        }
        let s = L::load(&sa).mul(exp(L::load(&ma).sub(L::splat(m)))).fold();
        m + lane0(log(L::splat(s)))
    }
}

unsafe fn run<L: Lanes, T: Float, I: IndexElem>(call: &CrossEntropyCall, runner: &dyn Runner) {
    let t = call.tiling;
    let (rows, cols) = (t.rows as usize, t.cols as usize);
    let reduces = call.reduces();
    // The plan's workspace (the per-row losses of a reduction).
    let ws = match Workspace::new(call.workspace, call.workspace_bytes, t.workspace_bytes) {
        Ok(w) => w,
        Err(_) => return,
    };
    let w = (call.has_weight != 0).then_some(Src(call.weight.data as *const f32));
    let tgt = Src(call.target.data as *const I);
    let ignore = call.ignore_index;
    // sum_{i not ignored} w[t_i], in a fixed order.
    let denominator = || {
        sum_of::<L>(rows, |i| {
            // SAFETY: target holds `rows` elements; weight `cols`, and
            // every target not ignored is in 0..cols (validated).
            let v = unsafe { tgt.get(i, 1)[0].to_i64() };
            match (v == ignore, w) {
                (true, _) => 0.0,
                // SAFETY: as above.
                (false, Some(w)) => unsafe { w.get(v as usize, 1)[0] },
                (false, None) => 1.0,
            }
        })
    };
    let mean = call.reduction == Reduction::Mean;
    let need_den = mean && call.mode != CeMode::Fused;
    let prelude = || {
        let ws = match w {
            // SAFETY: weight holds `cols` f32.
            Some(w) => sum_of::<L>(cols, |c| unsafe { w.get(c, 1)[0] }),
            None => cols as f32,
        };
        (ws, if need_den { denominator() } else { 0.0 })
    };
    // SAFETY: the caller's dispatch_isa! picked L among the ISAs this CPU has.
    let (w_sum, den) = unsafe { L::enter(prelude) };
    let per_row = call.grad_per_row != 0;
    let g0 = if call.mode == CeMode::Forward || per_row || rows == 0 {
        0.0
    } else {
        // SAFETY: grad holds one f32 (validated).
        let g = unsafe { Src(call.grad.data as *const f32).get(0, 1)[0] };
        if mean && call.mode == CeMode::Backward {
            g / den
        } else {
            g
        }
    };
    let row_loss = if reduces {
        // SAFETY: the workspace holds `rows` f32 when reducing (the plan).
        (rows > 0).then(|| Dst(unsafe { ws.region(0, rows) }.as_mut_ptr()))
    } else {
        (call.mode != CeMode::Backward).then_some(Dst(call.loss.data as *mut f32))
    };
    let k = Kern::<T, I> {
        x: Src(call.logits.data as *const T),
        d: Dst(call.dlogits.data as *mut T),
        tgt,
        w,
        lse_in: Src(call.lse_in.data as *const f32),
        grad: Src(call.grad.data as *const f32),
        loss: row_loss,
        lse: (call.has_lse != 0).then_some(Dst(call.lse.data as *mut f32)),
        fwd: call.mode != CeMode::Backward,
        bwd: call.mode != CeMode::Forward,
        per_row,
        g0,
        rows,
        cols,
        rpb: t.rows_per_block as usize,
        ignore,
        ls: call.label_smoothing,
        lsc: call.label_smoothing / cols as f32,
        zs: call.lse_square_scale,
        cap: call.softcap,
        w_sum,
    };
    if rows > 0 {
        // dlogits are usually written in place, over lines in cache:
        // ordinary stores.
        let flags = t.flags & !NORM_FLAG_STREAM;
        run_blocks!(runner, flags, t.blocks, |b| block::<L, T, I>(&k, b));
    }
    if reduces {
        let sum = || match row_loss {
            Some(p) => {
                // SAFETY: the blocks wrote all `rows` workspace rows.
                let v = unsafe { p.get(0, rows) };
                sum_of::<L>(rows, |i| v[i])
            }
            None => 0.0,
        };
        // SAFETY: L is available (above).
        let total = unsafe { L::enter(sum) };
        let l = if mean { total / den } else { total };
        // SAFETY: loss holds one f32.
        unsafe { Dst(call.loss.data as *mut f32).get(0, 1)[0] = l };
    }
}

#[inline(always)]
fn block<L: Lanes, T: Float, I: IndexElem, const STREAM: bool>(k: &Kern<T, I>, b: usize) {
    let k = &{ *k };
    let start = b.saturating_mul(k.rpb).min(k.rows);
    let end = (start + k.rpb).min(k.rows);
    for r in start..end {
        // SAFETY: row r belongs to this block; every tensor was validated.
        unsafe { row::<L, T, I>(k, r) }
    }
}

/// One row: pass 1 and the loss (forward, fused), pass 2 (backward, fused).
///
/// # Safety
/// Row `r` is inside the call's tensors and belongs to the calling block.
#[inline(always)]
unsafe fn row<L: Lanes, T: Float, I: IndexElem>(k: &Kern<T, I>, r: usize) {
    let base = r * k.cols;
    // SAFETY: target holds `rows` elements.
    let t = unsafe { k.tgt.get(r, 1)[0].to_i64() };
    let ignored = t == k.ignore;
    // Not ignored: in 0..cols (validated).
    let tu = t as usize;
    let wt = match (ignored, k.w) {
        (true, _) => 0.0,
        // SAFETY: tu < cols.
        (false, Some(w)) => unsafe { w.get(tu, 1)[0] },
        (false, None) => 1.0,
    };
    let lse = if k.fwd {
        // SAFETY: forwarded.
        let (lse, sx) = unsafe { pass1::<L, T, I>(k, base) };
        if let Some(o) = k.lse {
            // SAFETY: lse holds `rows` f32; row r is this block's.
            unsafe { o.get(r, 1)[0] = lse };
        }
        if let Some(o) = k.loss {
            let l = if ignored {
                0.0
            } else {
                // SAFETY: tu < cols: inside the row.
                let z = unsafe { k.x.get(base + tu, 1)[0].to_f32() };
                let xt = lane0(capped(L::splat(z), k.cap).0);
                let nll = wt * (lse - xt);
                let mut l = if k.ls > 0.0 {
                    (1.0 - k.ls) * nll + k.lsc * (k.w_sum * lse - sx)
                } else {
                    nll
                };
                if k.zs != 0.0 {
                    l += k.zs * (lse * lse);
                }
                l
            };
            // SAFETY: the per-row loss holds `rows` f32; row r is this block's.
            unsafe { o.get(r, 1)[0] = l };
        }
        lse
    } else if ignored {
        0.0
    } else {
        // SAFETY: lse holds `rows` f32.
        unsafe { k.lse_in.get(r, 1)[0] }
    };
    if k.bwd {
        if ignored {
            // SAFETY: dlogits row r (no reference to the logits is live).
            unsafe { k.d.get(base, k.cols) }.fill(T::from_f32(0.0));
        } else {
            let g = if k.per_row {
                // SAFETY: grad holds `rows` f32.
                unsafe { k.grad.get(r, 1)[0] }
            } else {
                k.g0
            };
            // SAFETY: forwarded.
            unsafe { pass2::<L, T, I>(k, base, tu, wt, lse, g) };
        }
    }
}

/// Pass 1 over the row at `base`: its lse and, with label smoothing,
/// `sum_c w_c x_c` (0 otherwise).
///
/// # Safety
/// The row is inside the logits.
#[inline(always)]
unsafe fn pass1<L: Lanes, T: Float, I: IndexElem>(k: &Kern<T, I>, base: usize) -> (f32, f32) {
    let n = k.cols;
    let smooth = k.ls > 0.0;
    let mut acc = OnlineLse::<L>::new();
    let mut sx = RowSum::<L>::new();
    let groups = n.div_ceil(GROUP);
    let mut g = 0;
    while g < groups {
        let take = CHUNK.min(groups - g);
        let mut v = [L::splat(0.0); CHUNK];
        for (i, vi) in v.iter_mut().enumerate().take(take) {
            let j = (g + i) * GROUP;
            let len = (n - j).min(GROUP);
            // SAFETY: columns j..j + len of the row.
            let (x, _) = capped(unsafe { load_at::<L, T>(k.x, base + j, len) }, k.cap);
            if smooth {
                sx.push(match k.w {
                    // SAFETY: columns j..j + len of weight.
                    Some(w) => unsafe { load_at::<L, f32>(w, j, len) }.mul(x),
                    None => x,
                });
            }
            *vi = if len < GROUP { pad_neg_inf(x, len) } else { x };
        }
        acc.chunk(&v[..take]);
        g += take;
    }
    (acc.finish(), if smooth { sx.finish() } else { 0.0 })
}

/// Pass 2 over the row at `base` with target `t`: dlogits, each window
/// read before it is written.
///
/// # Safety
/// The row is inside logits and dlogits (which are the same buffer or
/// apart) and belongs to the calling block.
#[inline(always)]
unsafe fn pass2<L: Lanes, T: Float, I: IndexElem>(
    k: &Kern<T, I>,
    base: usize,
    t: usize,
    wt: f32,
    lse: f32,
    g: f32,
) {
    let n = k.cols;
    let on = (1.0 - k.ls) * wt;
    let mut a = on;
    if k.ls > 0.0 {
        a += k.lsc * k.w_sum;
    }
    if k.zs != 0.0 {
        a += (2.0 * k.zs) * lse;
    }
    let (av, lv, gv, lsc) = (L::splat(a), L::splat(lse), L::splat(g), L::splat(k.lsc));
    let one = L::splat(1.0);
    let mut j = 0;
    while j < n {
        let len = (n - j).min(GROUP);
        // SAFETY: columns j..j + len of the row.
        let (x, th) = capped(unsafe { load_at::<L, T>(k.x, base + j, len) }, k.cap);
        let mut d = exp(x.sub(lv)).mul(av);
        if k.ls > 0.0 {
            d = d.sub(match k.w {
                // SAFETY: columns j..j + len of weight.
                Some(w) => unsafe { load_at::<L, f32>(w, j, len) }.mul(lsc),
                None => lsc,
            });
        }
        if t >= j && t < j + len {
            d = d.sub(one_hot::<L>(t - j, on));
        }
        if k.cap > 0.0 {
            d = d.mul(one.sub(th.mul(th)));
        }
        // SAFETY: as above; the window was read before this store.
        unsafe { store_at::<L, T>(d.mul(gv), k.d, base + j, len) };
        j += len;
    }
}
