//! CrossEntropy on the CPU. Per row: the max pass streams the row from
//! memory (the max `m` and, with label smoothing, the weighted logit sum;
//! in the forward a plain row other than its block's first has none: the
//! previous row's pass 1 found its max, from cache);
//! pass 1 (forward, fused) re-reads it from cache for `sum exp(x - m)`
//! (`RowSum`'s order) and, fused, keeps those exps in the block's cache row;
//! pass 2 (backward, fused) writes dlogits from them (or, backward alone,
//! after its own max pass, from the same exps recomputed), each window read
//! before it is written, so dlogits may be the logits. One exp per logit
//! fused (the online form took 2 1/8), and the fused call's bits are those
//! of forward then backward. Everything is f32 in `lanes::math`'s functions
//! and fixed orders: the same bits on every ISA, block count and thread
//! count. The next row (two ahead when pass 1 takes the next row's max, a
//! few KiB ahead of that read when rows are wide) is prefetched while a
//! row's exps are computed.

use super::plan::{cache_stride, CACHE_ROWS};
use super::reduce;
use super::*;
use crate::dtype::DType;
use crate::lanes::detect::Available;
use crate::lanes::math::{exp_nonpos, exp_nonpos_reduce, exp_scale, log, tanh, ExpArg};
use crate::lanes::{dispatch_isa, enter_apart, Lanes, RowSum, GROUP};
use crate::ops::elementwise::dispatch_t;
use crate::ops::norm::{for_lines, load_at, put_pair, store_at};
use crate::ops::run_blocks;
use crate::runner::Runner;
use crate::tiling::NORM_FLAG_STREAM;
use crate::workspace::{Dst, Src, Workspace};

/// Rows longer than this many bytes are wide: with the next row's max taken
/// in pass 1, they prefetch `WIDE_PREFETCH_AHEAD` elements ahead in the
/// next row instead of the whole row after it.
const WIDE_ROW_BYTES: usize = 128 * 1024;
/// Elements ahead of the next row's read that a wide row prefetches.
const WIDE_PREFETCH_AHEAD: usize = 2048;

/// What a block needs, copied into registers.
#[derive(Clone, Copy)]
struct Kern<T> {
    x: Src<T>,
    d: Dst<T>,
    tgt: Targets,
    w: Option<Src<f32>>,
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
    /// Fused: the first of `blocks` rows of `cache_stride` f32 in the
    /// workspace, one per block, holding pass 1's exps for pass 2.
    cache: Option<Dst<f32>>,
    cache_stride: usize,
}

/// Runs the call on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &CrossEntropyCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe { dispatch_isa!(isa, L => dispatch_t!(call.logits.dtype, run::<L>(call, runner))) }
}

/// The class indices, i32 or i64: read once per row, so a runtime match
/// rather than a type parameter (which doubled the kernel's instances).
#[derive(Clone, Copy)]
enum Targets {
    I32(Src<i32>),
    I64(Src<i64>),
}

impl Targets {
    /// Row `r`'s target.
    ///
    /// # Safety
    /// `r` is below the validated row count.
    #[inline(always)]
    unsafe fn get(self, r: usize) -> i64 {
        // SAFETY: forwarded.
        unsafe {
            match self {
                Targets::I32(s) => i64::from(s.get(r, 1)[0]),
                Targets::I64(s) => s.get(r, 1)[0],
            }
        }
    }
}

/// `(x, tanh(z / cap))` with `x` the soft-capped logit; without `CAP`
/// (cap 0) `z` itself and no tanh. A const parameter so that the loops
/// without soft-capping carry no tanh and no branch.
#[inline(always)]
fn capped<L: Lanes, const CAP: bool>(z: L, cap: f32) -> (L, L) {
    if CAP {
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
    fill_past(v, n, f32::NEG_INFINITY)
}

/// `v` with lanes `n..16` set to `fill`.
#[inline(always)]
fn fill_past<L: Lanes>(v: L, n: usize, fill: f32) -> L {
    let mut t = [0f32; GROUP];
    v.store(&mut t);
    for x in t.iter_mut().skip(n) {
        *x = fill;
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

unsafe fn run<L: Lanes, T: Float>(call: &CrossEntropyCall, runner: &dyn Runner) {
    let t = call.tiling;
    let (rows, cols) = (t.rows as usize, t.cols as usize);
    let reduces = call.reduces();
    // The plan's workspace (the per-row losses of a reduction).
    let ws = match Workspace::new(call.workspace, call.workspace_bytes, t.workspace_bytes) {
        Ok(w) => w,
        Err(_) => return,
    };
    let w = (call.has_weight != 0).then_some(Src(call.weight.data as *const f32));
    let tgt = if call.target.dtype == DType::I32 {
        Targets::I32(Src(call.target.data as *const i32))
    } else {
        Targets::I64(Src(call.target.data as *const i64))
    };
    let ignore = call.ignore_index;
    let mean = call.reduction == Reduction::Mean;
    let w_sum = match w {
        Some(w) => {
            // SAFETY: weight holds `cols` f32.
            let sum = || sum_of::<L>(cols, |c| unsafe { w.get(c, 1)[0] });
            // SAFETY: the caller's dispatch_isa! picked L among the ISAs this CPU has.
            unsafe { L::enter(sum) }
        }
        None => cols as f32,
    };
    // The mean's denominator (reduce.rs: the one definition).
    let den = if mean && call.mode != CeMode::Fused {
        // SAFETY: target holds `rows` elements; weight `cols`.
        let wv = w.map(|w| unsafe { w.get(0, cols) });
        // SAFETY: as above.
        reduce::denominator(rows, |i| unsafe { tgt.get(i) }, wv, ignore)
    } else {
        0.0
    };
    let per_row = call.grad_per_row != 0;
    let g0 = if call.mode == CeMode::Forward || per_row || rows == 0 {
        0.0
    } else {
        // SAFETY: grad holds one f32 (validated).
        let g = unsafe { Src(call.grad.data as *const f32).get(0, 1)[0] };
        if call.mode == CeMode::Backward {
            reduce::grad_factor(g, call.reduction, den)
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
    // Fused with a workspace: one cache row of pass 1's exps per block.
    let cache_stride = cache_stride(cols);
    let cache = (call.mode == CeMode::Fused && t.workspace_bytes > 0 && rows > 0).then(|| {
        // SAFETY: the plan sized the workspace for `blocks` such rows; each
        // block uses its own.
        Dst(unsafe { ws.region(0, t.blocks as usize * cache_stride) }.as_mut_ptr())
    });
    let k = Kern::<T> {
        x: Src(call.logits.data as *const T),
        d: Dst(call.dlogits.data as *mut T),
        tgt,
        w,
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
        cache,
        cache_stride,
    };
    if rows > 0 {
        // dlogits are usually written in place, over lines in cache:
        // ordinary stores.
        let flags = t.flags & !NORM_FLAG_STREAM;
        run_blocks!(plain runner, flags, t.blocks, |b| block::<L, T>(&k, b));
    }
    if reduces {
        let total = match row_loss {
            Some(p) => {
                // SAFETY: the blocks wrote all `rows` workspace rows.
                let v = unsafe { p.get(0, rows) };
                reduce::total(rows, |i| v[i])
            }
            None => 0.0,
        };
        // SAFETY: loss holds one f32.
        unsafe {
            Dst(call.loss.data as *mut f32).get(0, 1)[0] =
                reduce::reduced(total, call.reduction, den)
        };
    }
}

#[inline(always)]
fn block<L: Lanes, T: Float>(k: &Kern<T>, b: usize) {
    let k = &{ *k };
    let start = b.saturating_mul(k.rpb).min(k.rows);
    let end = (start + k.rpb).min(k.rows);
    // This block's cache rows (blocks never share one).
    let cache = k
        .cache
        .map(|c| Dst(c.0.wrapping_add(b * CACHE_ROWS * k.cache_stride)));
    // Row r's max when row r - 1's pass 1 found it (plain rows, forward).
    let mut known = None;
    // Row r - 1's pass 2 when row r's pass 1 is to write it.
    let mut pending = None;
    for r in start..end {
        let next = (r + 1 < end).then(|| (r + 1) * k.cols);
        // Rows alternate between the two cache rows.
        let slot = cache.map(|c| Dst(c.0.wrapping_add((r - start) % 2 * k.cache_stride)));
        // SAFETY: row r belongs to this block; every tensor was validated.
        known = unsafe {
            if k.cap > 0.0 {
                row::<L, T, true>(k, r, slot, None, None, &mut pending)
            } else {
                row::<L, T, false>(k, r, slot, known, next, &mut pending)
            }
        };
    }
    if let Some(p) = pending {
        // SAFETY: the block's last row, its exps in its cache row.
        unsafe { pass2_cols::<L, T, false>(k, &p, 0) };
    }
}

/// One row: pass 1 and the loss (forward, fused), pass 2 (backward, fused).
/// `known` is the row's max when the previous row's pass 1 found it; with
/// `next` (the next row's start in the same block) pass 1 finds the next
/// row's max too where it can (plain rows), returned. `pending` is the
/// previous row's pass 2 (fused, cached, not soft-capped): this row's pass
/// 1 writes it when it caches its own exps (the dlogits' stores then
/// overlap the exps' arithmetic), else it is done first; this row's own
/// pass 2 is left in `pending` when it qualifies.
///
/// # Safety
/// Row `r` is inside the call's tensors and belongs to the calling block;
/// `cache`, when given, holds `cols` f32 used by this block alone (not the
/// cache row `pending` reads); so does row `next`, and `known` is row `r`'s
/// max; `pending` is row `r - 1`'s.
#[inline(always)]
unsafe fn row<L: Lanes, T: Float, const CAP: bool>(
    k: &Kern<T>,
    r: usize,
    cache: Option<Dst<f32>>,
    known: Option<f32>,
    next: Option<usize>,
    pending: &mut Option<Pending<L>>,
) -> Option<f32> {
    let base = r * k.cols;
    // SAFETY: target holds `rows` elements.
    let t = unsafe { k.tgt.get(r) };
    let ignored = t == k.ignore;
    // Not ignored: in 0..cols (validated).
    let tu = t as usize;
    let wt = match (ignored, k.w) {
        (true, _) => 0.0,
        // SAFETY: tu < cols.
        (false, Some(w)) => unsafe { w.get(tu, 1)[0] },
        (false, None) => 1.0,
    };
    // The exps are cached only when pass 2 follows (not for ignored rows).
    let cache = cache.filter(|_| k.bwd && !ignored);
    // Whether this row's pass 1 carries a pass 2: only when it caches its
    // exps, never with a soft cap (whose pass 2 reads the logits), and
    // only where the ISA takes pipelined forms. Such a row writes the
    // previous row's pass 2 inside its pass 1 and leaves its own to the
    // next row (which runs it first if it carries none).
    let carries = !CAP && L::PIPELINED && k.fwd && cache.is_some();
    let prev = pending.take();
    let prev = match prev {
        Some(p) if !carries => {
            // SAFETY: row r - 1's pass 2 (the caller's contract).
            unsafe { pass2_cols::<L, T, false>(k, &p, 0) };
            None
        }
        p => p,
    };
    let mut next_max = None;
    // The row's max and `s = sum_c exp(x_c - m)`: the backward recomputes
    // them rather than trusting an f32 lse, which has rounded `log s` away
    // once |m| is large (8 equal logits at 1e6 gave p = 0.1271).
    let (m, sum) = if k.fwd || !ignored {
        // SAFETY: forwarded (the backward alone has no cache and no
        // pending pass 2).
        let (m, sum, nm) =
            unsafe { pass1::<L, T, CAP>(k, base, cache, known, next, prev.as_ref()) };
        next_max = nm;
        (m, sum)
    } else {
        (0.0, 1.0)
    };
    let ln_s = lane0(log(L::splat(sum)));
    let lse = m + ln_s;
    if k.fwd {
        if let Some(o) = k.lse {
            // SAFETY: lse holds `rows` f32; row r is this block's.
            unsafe { o.get(r, 1)[0] = lse };
        }
        if let Some(o) = k.loss {
            let l = if ignored {
                0.0
            } else {
                // SAFETY: tu < cols: inside the row (not yet overwritten:
                // pass 2 comes later).
                let z = unsafe { k.x.get(base + tu, 1)[0].to_f32() };
                let xt = lane0(capped::<L, CAP>(L::splat(z), k.cap).0);
                // From `m - x_t` and `log s`, as torch's log_softmax
                // (`(x - m) - log s`), never `lse - x_t`: `lse` rounded at the
                // scale of `m` keeps nothing of `log s` once |m| is large
                // (all logits -1e10: lse == m, the loss 0).
                let nll = wt * ((m - xt) + ln_s);
                let mut l = if k.ls > 0.0 {
                    // SAFETY: the row, still unwritten (pass 2 comes later).
                    let below = unsafe { below_sum::<L, T, CAP>(k, base, m) };
                    (1.0 - k.ls) * nll + k.lsc * (k.w_sum * ln_s + below)
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
    }
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
            let p = Pending {
                f: pass2_consts::<L, T>(k, tu, wt, (m, sum, lse), g, cache),
                base,
            };
            if carries {
                *pending = Some(p);
            } else {
                // SAFETY: forwarded.
                unsafe { pass2_cols::<L, T, CAP>(k, &p, 0) };
            }
        }
    }
    next_max
}

/// The max of the (capped) row at `base` (`m.at_least(x)` lane-wise: one
/// `max` on x86, and a NaN `x` never wins the compare; -f32::MAX for a row
/// of -Inf). Four max chains for throughput: the max is exact, so the
/// order changes no bit.
///
/// # Safety
/// The row is inside the logits.
#[inline(always)]
unsafe fn row_max_body<L: Lanes, T: Float, const CAP: bool>(k: &Kern<T>, base: usize) -> f32 {
    let n = k.cols;
    // Four chains in registers (an array here stays on the stack).
    let lo = L::splat(-f32::MAX);
    let (mut m0, mut m1, mut m2, mut m3) = (lo, lo, lo, lo);
    let mut j = 0;
    // Soft-capped rows are bound by their tanh: one chain is enough there,
    // and the smaller loop keeps the build time down (each dtype and ISA
    // has a soft-capped and a plain instance).
    while !CAP && j + 4 * GROUP <= n {
        // SAFETY: forwarded; columns j..j + 64 are in the row.
        let (x0, x1, x2, x3) = unsafe {
            (
                max_group::<L, T, CAP>(k, base + j, GROUP),
                max_group::<L, T, CAP>(k, base + j + 16, GROUP),
                max_group::<L, T, CAP>(k, base + j + 32, GROUP),
                max_group::<L, T, CAP>(k, base + j + 48, GROUP),
            )
        };
        m0 = m0.at_least(x0);
        m1 = m1.at_least(x1);
        m2 = m2.at_least(x2);
        m3 = m3.at_least(x3);
        j += 4 * GROUP;
    }
    while j < n {
        // SAFETY: forwarded.
        let x = unsafe { max_group::<L, T, CAP>(k, base + j, (n - j).min(GROUP)) };
        m0 = m0.at_least(x);
        j += GROUP;
    }
    // Nested calls, not an array's fold: LLVM kept that fold out of line on
    // AVX2, its stores calls outside the AVX context.
    fold_max(fold_max(fold_max(fold_max(-f32::MAX, m0), m1), m2), m3)
}

/// `row_max_body` as a function of its own per form (`enter_apart`: the
/// build time), entered for `L`.
///
/// # Safety
/// As `row_max_body`, inside `L`'s context.
#[inline(always)]
unsafe fn row_max<L: Lanes, T: Float, const CAP: bool>(k: &Kern<T>, base: usize) -> f32 {
    // Arguments copied to locals (see `enter_apart`).
    // SAFETY: forwarded; L is entered (the caller's contract).
    unsafe {
        enter_apart::<L, _>(
            #[inline(always)]
            || row_max_body::<L, T, CAP>(&{ *k }, base),
        )
    }
}

/// Label smoothing's `sum_c w_c (m - x_c)` over the (capped) row at `base`
/// with max `m`, in `RowSum`'s order: every term is >= 0 and finite for a
/// finite row, where `W m - sum_c w_c x_c` overflowed to Inf - Inf (a row
/// of 3e38) and cancelled (a row far from 0). A pass of its own, from
/// cache, for smoothed forward rows only.
///
/// # Safety
/// The row is inside the logits.
#[inline(always)]
unsafe fn below_sum_body<L: Lanes, T: Float, const CAP: bool>(
    k: &Kern<T>,
    base: usize,
    m: f32,
) -> f32 {
    let n = k.cols;
    let mv = L::splat(m);
    let mut s = RowSum::<L>::new();
    let mut j = 0;
    while j < n {
        let len = (n - j).min(GROUP);
        // SAFETY: columns j..j + len of the row.
        let (x, _) = capped::<L, CAP>(unsafe { load_at::<L, T>(k.x, base + j, len) }, k.cap);
        let mut d = mv.sub(x);
        if let Some(w) = k.w {
            // SAFETY: columns j..j + len of weight.
            d = unsafe { load_at::<L, f32>(w, j, len) }.mul(d);
        }
        if len < GROUP {
            d = fill_past(d, len, 0.0);
        }
        s.push(d);
        j += GROUP;
    }
    s.finish()
}

/// `below_sum_body` as a function of its own (`enter_apart`), entered for `L`.
///
/// # Safety
/// As `below_sum_body`, inside `L`'s context.
#[inline(always)]
unsafe fn below_sum<L: Lanes, T: Float, const CAP: bool>(k: &Kern<T>, base: usize, m: f32) -> f32 {
    // SAFETY: forwarded; L is entered (the caller's contract).
    unsafe {
        enter_apart::<L, _>(
            #[inline(always)]
            || below_sum_body::<L, T, CAP>(&{ *k }, base, m),
        )
    }
}

/// `m` raised to the largest lane of `v`, lanes in order (a NaN never wins).
#[inline(always)]
fn fold_max<L: Lanes>(m: f32, v: L) -> f32 {
    let mut o = [0f32; GROUP];
    v.store(&mut o);
    o.into_iter().fold(m, |m, v| if m < v { v } else { m })
}

/// The (capped) logits at `at..at + len` (`len <= 16`) of the logits,
/// lanes past `len` -Inf.
///
/// # Safety
/// The columns are inside the row.
#[inline(always)]
unsafe fn max_group<L: Lanes, T: Float, const CAP: bool>(k: &Kern<T>, at: usize, len: usize) -> L {
    // SAFETY: columns at..at + len of the row.
    let (x, _) = capped::<L, CAP>(unsafe { load_at::<L, T>(k.x, at, len) }, k.cap);
    if len < GROUP {
        pad_neg_inf(x, len)
    } else {
        x
    }
}

/// Pass 1 over the row at `base`: the row max `m` (`known`, or a max pass
/// of its own) and `s = sum_c exp(x_c - m)` (in `RowSum`'s order; `lse`
/// is `m + log s`). The exps go to `cache` when given. Plain rows (no cap, no smoothing) with a
/// `next` row also take its max meanwhile, from cache (prefetched a row
/// earlier): a separate max pass was a memory-bound loop, about a tenth of
/// the fused call; the max is exact, so its order changes no bit.
///
/// # Safety
/// The row is inside the logits; `cache` holds `cols` f32; so is row
/// `next`; `known` is this row's max.
#[inline(always)]
unsafe fn pass1<L: Lanes, T: Float, const CAP: bool>(
    k: &Kern<T>,
    base: usize,
    cache: Option<Dst<f32>>,
    known: Option<f32>,
    next: Option<usize>,
    prev: Option<&Pending<L>>,
) -> (f32, f32, Option<f32>) {
    let n = k.cols;
    let smooth = k.ls > 0.0;
    // Rows whose max needs nothing beside it: the ones whose max the
    // previous row can find.
    let plain = !CAP && !smooth;
    // The next row's max and the previous row's pass 2 ride in this loop
    // only where the ISA takes pipelined forms (`Lanes::PIPELINED`).
    let plain_next = plain && L::PIPELINED;
    // SAFETY: forwarded.
    let m = match known {
        Some(m) if plain => m,
        // SAFETY: forwarded.
        _ => unsafe { row_max::<L, T, CAP>(k, base) },
    };
    let next = next.filter(|_| plain_next);
    let mv = L::splat(m);
    let mut s = RowSum::<L>::new();
    // Whole groups two at a time (two independent exps in flight, no
    // length checks), then the last partial group; the sum is RowSum's
    // order either way: the same bits as group by group.
    let full = n / GROUP * GROUP;
    let null = Dst(core::ptr::null_mut());
    let at = |next, cache, prev| Groups {
        base,
        next,
        full,
        mv,
        cache,
        prev,
    };
    // `row` passes `prev` only where it carries (see there); its static
    // part restated here keeps the EMIT instances out of the soft-capped
    // and non-pipelined builds (code size).
    // SAFETY: forwarded (columns ..full are whole groups of the row).
    let (mut nm, emitted) = unsafe {
        match (cache, next, prev.filter(|_| !CAP && L::PIPELINED)) {
            (Some(c), Some(nx), Some(p)) => {
                pass1_groups::<L, T, CAP, true, true, true>(k, at(nx, c, Some(p)), &mut s)
            }
            (Some(c), None, Some(p)) => {
                pass1_groups::<L, T, CAP, true, false, true>(k, at(0, c, Some(p)), &mut s)
            }
            (Some(c), Some(nx), None) => {
                pass1_groups::<L, T, CAP, true, true, false>(k, at(nx, c, None), &mut s)
            }
            (Some(c), None, None) => {
                pass1_groups::<L, T, CAP, true, false, false>(k, at(0, c, None), &mut s)
            }
            (None, Some(nx), _) => {
                pass1_groups::<L, T, CAP, false, true, false>(k, at(nx, null, None), &mut s)
            }
            (None, None, _) => {
                pass1_groups::<L, T, CAP, false, false, false>(k, at(0, null, None), &mut s)
            }
        }
    };
    if let Some(p) = prev {
        // The previous row's columns past the loop's pairs.
        // SAFETY: forwarded (the caller's contract).
        unsafe { pass2_cols::<L, T, false>(k, p, emitted) };
    }
    if full < n {
        let len = n - full;
        // SAFETY: the row's last columns (now in cache).
        let (x, _) = capped::<L, CAP>(unsafe { load_at::<L, T>(k.x, base + full, len) }, k.cap);
        // Lanes past the row add exp(-Inf) = 0.
        let e = exp_nonpos(pad_neg_inf(x, len).sub(mv));
        if let Some(c) = cache {
            // SAFETY: the last columns of this block's cache row.
            unsafe { store_at::<L, f32>(e, c, full, len) };
        }
        s.push(e);
        if let Some(nx) = next {
            // SAFETY: the next row's last columns.
            let y = pad_neg_inf(unsafe { load_at::<L, T>(k.x, nx + full, len) }, len);
            nm = nm.at_least(y);
        }
    }
    let next_max = next.map(|_| fold_max(-f32::MAX, nm));
    (m, s.finish(), next_max)
}

/// Pass 1's whole groups, columns `0..full` of the row at `base`: `exp(x -
/// m)` pushed to `s` in column order and, with `CACHE`, stored to `cache`.
/// Two groups an iteration. With `NEXT`, the lane-wise max of the same
/// columns of the row at `next` is returned (-f32::MAX without) and the
/// row after it prefetched; else the next row, a line at a time.
///
/// # Safety
/// The columns are inside the row (and, with `NEXT`, the row at `next`);
/// with `CACHE`, `cache` holds them.
#[inline(always)]
unsafe fn pass1_groups_body<
    L: Lanes,
    T: Float,
    const CAP: bool,
    const CACHE: bool,
    const NEXT: bool,
    const EMIT: bool,
>(
    k: &Kern<T>,
    g: Groups<'_, L>,
    s: &mut RowSum<L>,
) -> (L, usize) {
    let (base, next, full, mv, cache, prev) = (g.base, g.next, g.full, g.mv, g.cache, g.prev);
    let prev = if EMIT { prev } else { None };
    let n = k.cols;
    // How far ahead to prefetch. Without NEXT: the next row. With NEXT
    // (which reads the next row itself): the row after it, unless rows are
    // wide; then a few KiB ahead in the next row, since three rows in
    // flight beside two cache rows overflow a 1 MiB L2 (measured on
    // Cascade Lake: docs/architecture.md, "Wide rows' prefetch").
    let wide = n * core::mem::size_of::<T>() > WIDE_ROW_BYTES;
    let ahead = match (NEXT, wide) {
        (true, false) => 2 * n,
        (true, true) => n + WIDE_PREFETCH_AHEAD,
        (false, _) => n,
    };
    let lo = L::splat(-f32::MAX);
    let (mut m0, mut m1) = (lo, lo);
    let pairs = full / (2 * GROUP) * (2 * GROUP);
    let mut j = 0;
    if pairs > 0 {
        // Software pipelined: the reduction of the next pair's exps runs
        // beside this pair's polynomial, so the out-of-order window holds
        // independent work instead of one pair's long chains (the same
        // operations on the same values: the same bits).
        // SAFETY: columns 0..32 of the row.
        let mut st = unsafe { reduce_pair::<L, T, CAP>(k, base, mv) };
        while j < pairs {
            // The segment's running sum in a register (RowSum's own order;
            // `s` is fresh, so its segments end on whole pairs).
            let (mut acc, room) = (s.acc(), s.room());
            let end = (j + room * GROUP).min(pairs);
            let start = j;
            while j < end {
                // One prefetch per line, into cache while this loop computes.
                L::prefetch(k.x.addr(base + ahead + j));
                if core::mem::size_of::<T>() == 4 {
                    L::prefetch(k.x.addr(base + ahead + j + GROUP));
                }
                let after = j + 2 * GROUP;
                let next_st = if after < pairs {
                    // SAFETY: columns after..after + 32 of the row.
                    unsafe { reduce_pair::<L, T, CAP>(k, base + after, mv) }
                } else {
                    st
                };
                let (e0, e1) = (exp_scale(st.0), exp_scale(st.1));
                st = next_st;
                if NEXT {
                    // SAFETY: columns j..j + 32 of the row at `next`. A NaN
                    // never wins the compare.
                    let (y0, y1) = unsafe {
                        (
                            T::load::<L>(k.x.group(next + j)),
                            T::load::<L>(k.x.group(next + j + GROUP)),
                        )
                    };
                    m0 = m0.at_least(y0);
                    m1 = m1.at_least(y1);
                }
                if CACHE {
                    // SAFETY: columns j..j + 32 of this block's cache row.
                    unsafe {
                        e0.store(cache.group(j));
                        e1.store(cache.group(j + GROUP));
                    }
                }
                acc = acc.add(e0).add(e1);
                if let Some(p) = prev {
                    // SAFETY: columns j..j + 32 of the previous row (its
                    // dlogits and its cache row, which is not `cache`).
                    unsafe {
                        let (d0, d1) = (
                            grad_group::<L, T, false>(k, &p.f, p.base, j, GROUP),
                            grad_group::<L, T, false>(k, &p.f, p.base, j + GROUP, GROUP),
                        );
                        put_pair::<L, T, false>(k.d, p.base + j, d0, d1);
                    }
                }
                j = after;
            }
            s.commit(acc, (j - start) / GROUP);
        }
    }
    if j < full {
        L::prefetch(k.x.addr(base + ahead + j));
        // SAFETY: columns j..j + 16 of the row.
        let e = exp_scale(unsafe { reduce_group::<L, T, CAP>(k, base + j, mv) });
        if NEXT {
            // SAFETY: columns j..j + 16 of the row at `next`.
            let y = T::load::<L>(unsafe { k.x.group(next + j) });
            m0 = m0.at_least(y);
        }
        if CACHE {
            // SAFETY: columns j..j + 16 of this block's cache row.
            unsafe { e.store(cache.group(j)) };
        }
        s.push(e);
    }
    (m0.at_least(m1), if prev.is_some() { pairs } else { 0 })
}

/// `pass1_groups_body` as a function of its own per form (`enter_apart`: the
/// build time), entered for `L`.
///
/// # Safety
/// As `pass1_groups_body`, inside `L`'s context.
#[inline(always)]
unsafe fn pass1_groups<
    L: Lanes,
    T: Float,
    const CAP: bool,
    const CACHE: bool,
    const NEXT: bool,
    const EMIT: bool,
>(
    k: &Kern<T>,
    g: Groups<'_, L>,
    s: &mut RowSum<L>,
) -> (L, usize) {
    // Arguments copied to locals (see `enter_apart`).
    // SAFETY: forwarded; L is entered (the caller's contract).
    unsafe {
        enter_apart::<L, _>(
            #[inline(always)]
            || {
                let prev = g.prev.copied();
                let g = Groups {
                    prev: prev.as_ref(),
                    ..g
                };
                pass1_groups_body::<L, T, CAP, CACHE, NEXT, EMIT>(&{ *k }, g, s)
            },
        )
    }
}

/// Where pass 1's whole groups run: the row at `base`, columns `0..full`,
/// its max `mv`; the row at `next` (its max taken meanwhile), the cache
/// row, the previous row's pass 2 (as the loop form uses them).
#[derive(Clone, Copy)]
struct Groups<'a, L> {
    base: usize,
    next: usize,
    full: usize,
    mv: L,
    cache: Dst<f32>,
    prev: Option<&'a Pending<L>>,
}

/// `reduce_group` of the 32 logits at `at..at + 32`.
///
/// # Safety
/// The 32 logits are inside the row.
#[inline(always)]
unsafe fn reduce_pair<L: Lanes, T: Float, const CAP: bool>(
    k: &Kern<T>,
    at: usize,
    mv: L,
) -> (ExpArg<L>, ExpArg<L>) {
    // SAFETY: forwarded.
    unsafe {
        (
            reduce_group::<L, T, CAP>(k, at, mv),
            reduce_group::<L, T, CAP>(k, at + GROUP, mv),
        )
    }
}

/// `exp(x - m)`'s reduction (`exp_nonpos_reduce`) of the (capped) logits at
/// `at..at + 16`; `exp_scale` finishes it (functions, not closures:
/// closures here are not inlined into the ISA's entry).
///
/// # Safety
/// The 16 logits are inside the row.
#[inline(always)]
unsafe fn reduce_group<L: Lanes, T: Float, const CAP: bool>(
    k: &Kern<T>,
    at: usize,
    mv: L,
) -> ExpArg<L> {
    // SAFETY: forwarded.
    let (x, _) = capped::<L, CAP>(T::load::<L>(unsafe { k.x.group(at) }), k.cap);
    exp_nonpos_reduce(x.sub(mv))
}

/// Pass 2's constants for a row with target `t`, row max `m`, `s = sum_c
/// exp(x_c - m)` and `lse`: dlogits from `p_c = exp(x_c - m) / s` (the
/// first factor from `cache` when pass 1 left it there: the same bits).
#[inline(always)]
fn pass2_consts<L: Lanes, T: Float>(
    k: &Kern<T>,
    t: usize,
    wt: f32,
    (m, s, lse): (f32, f32, f32),
    g: f32,
    cache: Option<Dst<f32>>,
) -> Pass2<L> {
    let on = (1.0 - k.ls) * wt;
    // What every class's p_c is multiplied by beside `on`.
    let mut extra = 0.0;
    if k.ls > 0.0 {
        extra += k.lsc * k.w_sum;
    }
    if k.zs != 0.0 {
        extra += (2.0 * k.zs) * lse;
    }
    let q = 1.0 / s;
    // p_c * a = e_c * (q * a): one multiply per element.
    Pass2 {
        qa: L::splat(q * (on + extra)),
        mv: L::splat(m),
        gv: L::splat(g),
        lsc: L::splat(k.lsc),
        q,
        on,
        extra,
        t,
        cached: cache.map(|c| Src(c.0 as *const f32)),
    }
}

/// A row's pass 2, waiting: its constants and where the row starts.
#[derive(Clone, Copy)]
struct Pending<L> {
    f: Pass2<L>,
    base: usize,
}

/// Pass 2 of the row `p`, columns `from..`, each window read before it is
/// written.
///
/// # Safety
/// The row is inside logits and dlogits (which are the same buffer or
/// apart) and belongs to the calling block; its cache row, when given,
/// holds the row's exps.
#[inline(always)]
unsafe fn pass2_cols_body<L: Lanes, T: Float, const CAP: bool>(
    k: &Kern<T>,
    p: &Pending<L>,
    from: usize,
) {
    let (f, base) = (&p.f, p.base);
    // Whole lines where the row has them: one conversion and one 64-byte
    // store per two groups (the same bits as group by group).
    for_lines!(
        k.cols - from,
        0,
        |j, len| {
            // SAFETY: columns from + j.. of the row; the window is read
            // before it is written.
            unsafe {
                let d = grad_group::<L, T, CAP>(k, f, base, from + j, len);
                store_at::<L, T>(d, k.d, base + from + j, len);
            }
        },
        |q| {
            // SAFETY: columns from + q.. (32) of the row; both windows are
            // read before the line is written.
            unsafe {
                let (d0, d1) = (
                    grad_group::<L, T, CAP>(k, f, base, from + q, GROUP),
                    grad_group::<L, T, CAP>(k, f, base, from + q + GROUP, GROUP),
                );
                put_pair::<L, T, false>(k.d, base + from + q, d0, d1);
            }
        }
    );
}

/// `pass2_cols_body` as a function of its own per form (`enter_apart`: the
/// build time), entered for `L`.
///
/// # Safety
/// As `pass2_cols_body`, inside `L`'s context.
#[inline(always)]
unsafe fn pass2_cols<L: Lanes, T: Float, const CAP: bool>(
    k: &Kern<T>,
    p: &Pending<L>,
    from: usize,
) {
    // Arguments copied to locals (see `enter_apart`).
    // SAFETY: forwarded; L is entered (the caller's contract).
    unsafe {
        enter_apart::<L, _>(
            #[inline(always)]
            || pass2_cols_body::<L, T, CAP>(&{ *k }, &{ *p }, from),
        )
    }
}

/// Pass 2's row constants.
#[derive(Clone, Copy)]
struct Pass2<L> {
    /// `exp(m - lse) * a`.
    qa: L,
    /// The row max.
    mv: L,
    /// The gradient factor.
    gv: L,
    /// `ls / C`.
    lsc: L,
    /// `1 / s`, with `s = sum_c exp(x_c - m)`.
    q: f32,
    /// `(1 - ls) * w_t`, taken at the target.
    on: f32,
    /// `ls W / C + 2 scale lse`: `a = on + extra`.
    extra: f32,
    /// The target column.
    t: usize,
    /// Pass 1's exps of the row, when it left them.
    cached: Option<Src<f32>>,
}

/// dlogits at columns `j..j + len` (`len <= 16`) of the row at `base`,
/// computed from the logits there (or pass 1's exps), not yet stored.
///
/// # Safety
/// The columns are inside the row; the cache row, when given, holds them.
#[inline(always)]
unsafe fn grad_group<L: Lanes, T: Float, const CAP: bool>(
    k: &Kern<T>,
    f: &Pass2<L>,
    base: usize,
    j: usize,
    len: usize,
) -> L {
    let n = k.cols;
    let one = L::splat(1.0);
    let (e, th) = match f.cached {
        // SAFETY: columns j..j + len of this block's cache row.
        Some(c) if !CAP => (unsafe { load_at::<L, f32>(c, j, len) }, one),
        _ => {
            // SAFETY: columns j..j + len of the row.
            let (x, th) = capped::<L, CAP>(unsafe { load_at::<L, T>(k.x, base + j, len) }, k.cap);
            let e = match f.cached {
                // SAFETY: as above.
                Some(c) => unsafe { load_at::<L, f32>(c, j, len) },
                None => {
                    // As in pass 1: the next row into cache meanwhile.
                    L::prefetch(k.x.addr(base + n + j));
                    exp_nonpos(x.sub(f.mv))
                }
            };
            (e, th)
        }
    };
    let mut d = e.mul(f.qa);
    if k.ls > 0.0 {
        d = d.sub(match k.w {
            // SAFETY: columns j..j + len of weight.
            Some(w) => unsafe { load_at::<L, f32>(w, j, len) }.mul(f.lsc),
            None => f.lsc,
        });
    }
    if f.t >= j && f.t < j + len {
        // The target's own form: `(p_t - 1) on + p_t extra`, where `p_t - 1`
        // is exact near 1 (a single class with z-loss gave `p a - on`'s
        // cancellation, 1e-4 off). One group per row.
        let i = f.t - j;
        let mut lanes = [0f32; GROUP];
        e.store(&mut lanes);
        let p = lanes[i] * f.q;
        let mut dt = (p - 1.0) * f.on + p * f.extra;
        if k.ls > 0.0 {
            let wt = match k.w {
                // SAFETY: the target column of weight.
                Some(w) => unsafe { w.get(f.t, 1)[0] },
                None => 1.0,
            };
            dt -= lane0(f.lsc) * wt;
        }
        d.store(&mut lanes);
        lanes[i] = dt;
        d = L::load(&lanes);
    }
    if CAP {
        d = d.mul(one.sub(th.mul(th)));
    }
    d.mul(f.gv)
}
