//! Attention on the CPU: the matmul's microkernel on blocks of query rows.
//!
//! Forward, per block (`rows` query rows of one head): the scores against
//! every key the block sees (`q k^T`, B panels of k^T packed once per
//! key/value head and kept while a worker's units share it), each row's
//! max, `p = e^(s - max)` and sum, then `p v` (the probabilities repacked as
//! A panels) and the division. Backward, per key/value head: per query head
//! of its group and block, the scores again (the same bits, so the same
//! `p`), `dP = dout v^T`, `dS`, then `dq = dS k` and the sums
//! `dk += dS^T q`, `dv += P^T dout` carried in the arena across blocks.
//!
//! Causal blocks split each key sum at the block's first row: the keys
//! before it are seen by every row (the microkernel), the diagonal's by
//! some, added row by row in the same ascending order — so a row's chain
//! never reads a key it does not see.

use super::plan::Arena;
use super::*;
use crate::lanes::detect::Available;
use crate::lanes::math::exp_nonpos;
use crate::lanes::{dispatch_isa, enter_apart, Lanes, RowSum, GROUP};
use crate::ops::elementwise::dispatch_t;
use crate::ops::matmul::ukernel::{Micro, Tile};
use crate::ops::run_blocks;
use crate::runner::Runner;
use crate::workspace::Workspace;

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &AttentionCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe { dispatch_isa!(isa, L => dispatch_t!(call.q.dtype, run::<L>(call, runner))) }
}

/// One of the call's `[B, H, S, D]` / `[B, S, H, D]` tensors.
#[derive(Clone, Copy)]
struct Heads<T> {
    p: *mut T,
    heads: usize,
    seq: usize,
    d: usize,
    bsnd: bool,
}

impl<T> Heads<T> {
    fn new(t: &RawTensor, heads: u64, seq: u64, d: u64, bsnd: bool) -> Self {
        Heads {
            p: t.data as *mut T,
            heads: heads as usize,
            seq: seq as usize,
            d: d as usize,
            bsnd,
        }
    }

    /// Row `s` of head `h` of batch `b` (its `d` elements are contiguous).
    ///
    /// # Safety
    /// The indices are inside the tensor.
    #[inline(always)]
    unsafe fn row(&self, b: usize, h: usize, s: usize) -> *mut T {
        let r = if self.bsnd {
            (b * self.seq + s) * self.heads + h
        } else {
            (b * self.heads + h) * self.seq + s
        };
        // SAFETY: the caller's.
        unsafe { self.p.add(r * self.d) }
    }
}

/// What every unit needs, copied into registers.
#[derive(Clone, Copy)]
struct Kern<T> {
    q: Heads<T>,
    k: Heads<T>,
    v: Heads<T>,
    out: Heads<T>,
    dout: Heads<T>,
    dq: Heads<T>,
    dk: Heads<T>,
    dv: Heads<T>,
    mx: *mut f32,
    sm: *mut f32,
    t: AttentionTiling,
    causal: bool,
    scale: f32,
    ws: Workspace,
    a: Arena,
}

// SAFETY: the pointers are the call's tensors and workspace; units write
// disjoint outputs and each worker its own arena.
unsafe impl<T> Sync for Kern<T> {}

unsafe fn run<L: Tile, T: Float>(call: &AttentionCall, runner: &dyn Runner) {
    let t = call.tiling;
    let backward = call.backward != 0;
    let Ok(ws) = Workspace::new(call.workspace, call.workspace_bytes, t.workspace_bytes) else {
        return;
    };
    let bsnd = call.layout == AttentionLayout::Bsnd as u32;
    let (d, sq, skv) = (t.head_dim, t.seq_q, t.seq_kv);
    let qh = |x: &RawTensor| Heads::<T>::new(x, t.heads_q, sq, d, bsnd);
    let kh = |x: &RawTensor| Heads::<T>::new(x, t.heads_kv, skv, d, bsnd);
    let kern = Kern::<T> {
        q: qh(&call.q),
        k: kh(&call.k),
        v: kh(&call.v),
        out: qh(&call.out),
        dout: qh(&call.dout),
        dq: qh(&call.dq),
        dk: kh(&call.dk),
        dv: kh(&call.dv),
        mx: call.softmax_max.data as *mut f32,
        sm: call.softmax_sum.data as *mut f32,
        t,
        causal: call.causal != 0,
        scale: call.scale,
        ws,
        a: t.arena(backward),
    };
    let kp = &kern;
    if backward {
        run_blocks!(plain runner, t.flags, t.blocks, |w| backward_units::<L, T>(kp, w))
    } else {
        run_blocks!(plain runner, t.flags, t.blocks, |w| forward_units::<L, T>(kp, w))
    }
}

/// Worker `w`'s arena.
///
/// # Safety
/// `w < blocks`.
#[inline(always)]
unsafe fn arena_of<T>(k: &Kern<T>, w: usize) -> *mut f32 {
    let n = k.t.arena_bytes as usize;
    // SAFETY: worker w's arena, inside the checked workspace, used by it
    // alone.
    unsafe { k.ws.region(w * n, n / 4).as_mut_ptr() }
}

/// Worker `w`'s forward units, `w, w + blocks, ...`.
///
/// # Safety
/// Inside `L::enter`; the call's contract.
#[inline(always)]
unsafe fn forward_units<L: Tile, T: Float>(k: &Kern<T>, w: usize) {
    let k = &{ *k };
    // SAFETY: w < blocks.
    let ar = unsafe { arena_of(k, w) };
    let qb = k.t.q_blocks as usize;
    let hq = k.t.heads_q as usize;
    let group = hq / k.t.heads_kv.max(1) as usize;
    // The key/value head whose panels the arena holds.
    let mut packed = None;
    let mut u = w;
    while u < k.t.units as usize {
        let (blk, h, b) = (u % qb, (u / qb) % hq, u / (qb * hq));
        let hkv = h / group;
        // SAFETY: the unit's tensors and this worker's arena.
        unsafe {
            if packed != Some((b, hkv)) {
                enter_apart::<L, _>(
                    #[inline(always)]
                    || pack_kv::<L, T>(k, ar, b, hkv, false),
                );
                packed = Some((b, hkv));
            }
            enter_apart::<L, _>(
                #[inline(always)]
                || forward_block::<L, T>(k, ar, b, h, blk),
            );
        }
        u += k.t.blocks as usize;
    }
}

/// Worker `w`'s backward units (key/value heads).
///
/// # Safety
/// Inside `L::enter`; the call's contract.
#[inline(always)]
unsafe fn backward_units<L: Tile, T: Float>(k: &Kern<T>, w: usize) {
    let k = &{ *k };
    // SAFETY: w < blocks.
    let ar = unsafe { arena_of(k, w) };
    let hkvs = k.t.heads_kv as usize;
    let group = k.t.heads_q as usize / hkvs.max(1);
    let mut u = w;
    while u < k.t.units as usize {
        let (b, hkv) = (u / hkvs, u % hkvs);
        // SAFETY: the unit's tensors and this worker's arena.
        unsafe {
            enter_apart::<L, _>(
                #[inline(always)]
                || pack_kv::<L, T>(k, ar, b, hkv, true),
            );
            for h in hkv * group..(hkv + 1) * group {
                for blk in 0..k.t.q_blocks as usize {
                    enter_apart::<L, _>(
                        #[inline(always)]
                        || backward_block::<L, T>(k, ar, b, h, blk),
                    );
                }
            }
            enter_apart::<L, _>(
                #[inline(always)]
                || backward_finish::<L, T>(k, ar, b, hkv),
            );
        }
        u += k.t.blocks as usize;
    }
}

/// Packs key/value head `hkv` of batch `b`: k^T (and, backward, v^T and k)
/// as B panels, v as B panels forward; backward, zeroes dk's and dv's sums.
///
/// # Safety
/// Inside `L::enter`; `ar` is this worker's arena.
#[inline(always)]
unsafe fn pack_kv<L: Tile, T: Float>(
    k: &Kern<T>,
    ar: *mut f32,
    b: usize,
    hkv: usize,
    backward: bool,
) {
    let (n, d, kp) = (
        k.t.seq_kv as usize,
        k.t.head_dim as usize,
        k.t.kv_pad as usize,
    );
    let a = &k.a;
    // SAFETY: rows j < seq_kv of head hkv; the arena's buffers (plan.rs).
    unsafe {
        let krow = |j| k.k.row(b, hkv, j) as *const T;
        let vrow = |j| k.v.row(b, hkv, j) as *const T;
        pack_bt::<L, T>(krow, n, d, ar.add(a.kt));
        if backward {
            pack_bt::<L, T>(vrow, n, d, ar.add(a.vt));
            pack_b::<L, T>(krow, n, d, kp * L::NR, ar.add(a.kp));
            let dp = k.t.dim_pad as usize;
            for x in core::slice::from_raw_parts_mut(ar.add(a.dk), n * dp) {
                *x = 0.0;
            }
            for x in core::slice::from_raw_parts_mut(ar.add(a.dv), n * dp) {
                *x = 0.0;
            }
        } else {
            pack_b::<L, T>(vrow, n, d, kp * L::NR, ar.add(a.vp));
        }
    }
}

/// B panels of `x^T` for `n` rows of `d` (`x` row `j` at `row(j)`): panel
/// `c` (columns `c NR ..`) holds `d` steps of NR, rows past `n` zero.
///
/// # Safety
/// The rows hold `d` elements; `dst` holds `d * round_up(n, NR)`.
#[inline(always)]
unsafe fn pack_bt<L: Tile, T: Float>(
    row: impl Fn(usize) -> *const T,
    n: usize,
    d: usize,
    dst: *mut f32,
) {
    let nr = L::NR;
    for c0 in (0..n).step_by(nr) {
        // SAFETY: panel c0 / nr of dst.
        let p = unsafe { dst.add(c0 * d) };
        for cc in 0..nr {
            let j = c0 + cc;
            for dd in 0..d {
                // SAFETY: row j < n holds d elements; the panel d x nr.
                unsafe {
                    *p.add(dd * nr + cc) = if j < n {
                        (*row(j).add(dd)).to_f32()
                    } else {
                        0.0
                    }
                };
            }
        }
    }
}

/// B panels of `x` (steps: its `n` rows; columns: its `d`): panel `c`
/// (columns `c NR ..`, zero past `d`) at `c * pstride`.
///
/// # Safety
/// The rows hold `d` elements; `dst` holds `round_up(d, NR) / NR` panels of
/// `pstride >= n NR`.
#[inline(always)]
unsafe fn pack_b<L: Tile, T: Float>(
    row: impl Fn(usize) -> *const T,
    n: usize,
    d: usize,
    pstride: usize,
    dst: *mut f32,
) {
    let nr = L::NR;
    for j in 0..n {
        let r = row(j);
        for c0 in (0..d).step_by(nr) {
            // SAFETY: step j of panel c0 / nr.
            let p = unsafe { dst.add((c0 / nr) * pstride + j * nr) };
            for cc in 0..nr {
                let dd = c0 + cc;
                // SAFETY: dd < d inside the row; p holds nr.
                unsafe { *p.add(cc) = if dd < d { (*r.add(dd)).to_f32() } else { 0.0 } };
            }
        }
    }
}

/// A panels of `rows` rows of `d` (steps: d): group `g` (rows `g MR ..`,
/// zero past `rows`) at `g * d * MR`.
///
/// # Safety
/// The rows hold `d` elements; `dst` holds `round_up(rows, MR) * d`.
#[inline(always)]
unsafe fn pack_a<L: Tile, T: Float>(
    row: impl Fn(usize) -> *const T,
    rows: usize,
    d: usize,
    dst: *mut f32,
) {
    let mr = L::MR;
    for g0 in (0..rows).step_by(mr) {
        // SAFETY: group g0 / mr.
        let p = unsafe { dst.add(g0 * d) };
        for r in 0..mr {
            let i = g0 + r;
            for dd in 0..d {
                // SAFETY: as the contract.
                unsafe {
                    *p.add(dd * mr + r) = if i < rows {
                        (*row(i).add(dd)).to_f32()
                    } else {
                        0.0
                    }
                };
            }
        }
    }
}

/// A panels (rows: the block's `rows`, steps: columns `0..steps`) of the f32
/// block `s` (row stride `ld`): group `g` at `g * steps * MR`, holding its
/// `group_steps` (`diag`). Sixteen steps
/// at a time through a 16 x 16 transpose, each step's 16 lanes stored whole
/// (the lanes past MR spill into the next step, written next, or past the
/// group: into the next group or the buffer's 16 f32 of slack).
///
/// # Safety
/// Inside `L::enter`; `s` holds the rows' steps (rows readable 16 past
/// `steps`); `dst` holds `round_up(rows, MR) * steps + 16`.
#[inline(always)]
unsafe fn pack_a_f32<L: Tile>(
    s: *const f32,
    ld: usize,
    rows: usize,
    steps: usize,
    diag: Diag,
    dst: *mut f32,
) {
    let mr = L::MR;
    for g0 in (0..rows).step_by(mr) {
        // SAFETY: group g0 / mr (its stride: `steps`, whatever it holds).
        let p = unsafe { dst.add(g0 * steps) };
        let steps = group_steps(diag, steps, g0);
        let full = steps / GROUP * GROUP;
        let n = mr.min(rows - g0);
        for j0 in (0..full).step_by(GROUP) {
            let m: [L; GROUP] = core::array::from_fn(|r| {
                if r < n {
                    // SAFETY: row g0 + r < rows, columns j0..j0 + 16 < steps.
                    L::load(unsafe { &*(s.add((g0 + r) * ld + j0) as *const [f32; GROUP]) })
                } else {
                    L::splat(0.0)
                }
            });
            for (t, v) in L::transpose16(&m).iter().enumerate() {
                // SAFETY: step j0 + t of the group, spilling at most 16 - MR
                // f32 into what is written next (or the slack).
                v.store(unsafe { &mut *(p.add((j0 + t) * mr) as *mut [f32; GROUP]) });
            }
        }
        for j in full..steps {
            for r in 0..mr {
                // SAFETY: as the contract.
                unsafe {
                    *p.add(j * mr + r) = if r < n {
                        *s.add((g0 + r) * ld + j)
                    } else {
                        0.0
                    }
                };
            }
        }
    }
}

/// A panels of `s^T` (rows: columns `0..keys` of `s`, steps: its `rows`
/// rows): group `g` (keys `g MR ..`, zero past `keys`) at `g * rows * MR`.
/// A step is MR consecutive f32 of a row of `s`: stored 16 at a time, the
/// lanes past MR spilling as in `pack_a_f32`.
///
/// # Safety
/// Inside `L::enter`; `s` holds the rows' keys (readable 16 past `keys`);
/// `dst` holds `round_up(keys, MR) * rows + 16`.
#[inline(always)]
unsafe fn pack_at_f32<L: Tile>(s: *const f32, ld: usize, rows: usize, keys: usize, dst: *mut f32) {
    let mr = L::MR;
    for g0 in (0..keys).step_by(mr) {
        // SAFETY: group g0 / mr.
        let p = unsafe { dst.add(g0 * rows) };
        let n = mr.min(keys - g0);
        for i in 0..rows {
            if n == mr {
                // SAFETY: 16 f32 of row i from key g0 (inside the row's
                // slack); step i of the group, spilling into step i + 1.
                unsafe {
                    L::load(&*(s.add(i * ld + g0) as *const [f32; GROUP]))
                        .store(&mut *(p.add(i * mr) as *mut [f32; GROUP]))
                };
                continue;
            }
            for jj in 0..mr {
                // SAFETY: as the contract.
                unsafe {
                    *p.add(i * mr + jj) = if jj < n {
                        *s.add(i * ld + g0 + jj)
                    } else {
                        0.0
                    }
                };
            }
        }
    }
}

/// How a causal block's row groups limit a product over its keys (`i0`:
/// the block's first row, so row `i0 + r` sees keys `..= i0 + r`).
#[derive(Clone, Copy)]
enum Diag {
    /// Every row group takes all of it.
    No,
    /// Columns are keys: a row group's stop after its last row's keys.
    Cols(usize),
    /// Steps are keys: a row group's stop before its first row (the keys
    /// all its rows see; each row's diagonal is added after).
    Steps(usize),
}

/// The keys every row of the group at block row `g0` sees: `..min(steps,
/// i0 + g0)` under `Diag::Steps`, else `steps`.
#[inline(always)]
fn group_steps(diag: Diag, steps: usize, g0: usize) -> usize {
    match diag {
        Diag::Steps(i0) => steps.min(i0 + g0),
        _ => steps,
    }
}

/// `c = [c +] A B` over the microkernel: A panels of `rows` rows and `steps`
/// steps (`pack_a*`), B panels of `cols` columns, panel stride `pstride`;
/// c f32 with row stride `ldc`. `init`: c's value starts each sum. `diag`
/// cuts each row group's columns or steps (a causal block).
///
/// # Safety
/// Inside `L::enter`; the panels and c hold what they say.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn gemm<L: Tile>(
    a: *const f32,
    rows: usize,
    steps: usize,
    b: *const f32,
    pstride: usize,
    cols: usize,
    c: *mut f32,
    ldc: usize,
    init: bool,
    diag: Diag,
) {
    let (mr, nr) = (L::MR, L::NR);
    for i0 in (0..rows).step_by(mr) {
        let cols = match diag {
            Diag::Cols(d0) => cols.min(d0 + i0 + mr),
            _ => cols,
        };
        let kc = group_steps(diag, steps, i0);
        for j0 in (0..cols).step_by(nr) {
            // SAFETY: the contract's panels and c's block (i0, j0).
            unsafe {
                let dst = c.add(i0 * ldc + j0);
                let u = Micro::<f32> {
                    kc,
                    a: a.add(i0 * steps),
                    b: b.add((j0 / nr) * pstride),
                    init: if init { dst } else { core::ptr::null() },
                    ldi: ldc,
                    dst,
                    ldd: ldc,
                    rows: mr.min(rows - i0),
                    cols: nr.min(cols - j0),
                };
                L::micro::<f32, false, false, false>(&u);
            }
        }
    }
}

/// Group `g` (columns `16 g ..`) of step `j` of B panels of stride `pstride`.
///
/// # Safety
/// Inside the panels.
#[inline(always)]
unsafe fn panel_group<L: Tile>(p: *const f32, pstride: usize, j: usize, g: usize) -> L {
    let (nr, c) = (L::NR, g * GROUP);
    // SAFETY: the caller's.
    L::load(unsafe { &*(p.add((c / nr) * pstride + j * nr + c % nr) as *const [f32; GROUP]) })
}

/// `acc[.. d] += x * B step j` over the row's groups (`acc` f32).
///
/// # Safety
/// `acc` holds `dim_pad`; B as `panel_group`.
#[inline(always)]
unsafe fn axpy_step<L: Tile>(
    acc: *mut f32,
    x: f32,
    p: *const f32,
    pstride: usize,
    j: usize,
    groups: usize,
) {
    let xv = L::splat(x);
    for g in 0..groups {
        // SAFETY: the caller's.
        unsafe {
            let o = &mut *(acc.add(g * GROUP) as *mut [f32; GROUP]);
            let bv = panel_group::<L>(p, pstride, j, g);
            xv.mul_add(bv, L::load(o)).store(o);
        }
    }
}

/// Stores `n <= 16` lanes of `v` (rounded once to T) at `dst`.
///
/// # Safety
/// `dst` holds `n`.
#[inline(always)]
unsafe fn put<L: Lanes, T: Float>(v: L, dst: *mut T, n: usize) {
    if n == GROUP {
        // SAFETY: 16 elements.
        T::store::<L>(v, unsafe { &mut *(dst as *mut [T; GROUP]) });
        return;
    }
    let mut t = [0f32; GROUP];
    v.store(&mut t);
    for (i, x) in t.iter().take(n).enumerate() {
        // SAFETY: i < n.
        unsafe { *dst.add(i) = T::from_f32(*x) };
    }
}

/// A group of the block's scores at `p` times `scale`, lanes past `n`
/// -Inf (after the product: -Inf times a scale of 0 would be NaN).
///
/// # Safety
/// `p` holds 16 readable f32.
#[inline(always)]
unsafe fn scaled<L: Lanes>(p: *const f32, n: usize, scale: L) -> L {
    // SAFETY: the caller's.
    let v = L::load(unsafe { &*(p as *const [f32; GROUP]) }).mul(scale);
    if n >= GROUP {
        return v;
    }
    let mut t = [0f32; GROUP];
    v.store(&mut t);
    for x in t.iter_mut().skip(n) {
        *x = f32::NEG_INFINITY;
    }
    L::load(&t)
}

/// The largest lane of `v` not below `m` (a NaN lane never wins).
#[inline(always)]
fn fold_max<L: Lanes>(m: f32, v: L) -> f32 {
    let mut o = [0f32; GROUP];
    v.store(&mut o);
    o.into_iter().fold(m, |m, v| if m < v { v } else { m })
}

/// A block's rows and keys.
#[derive(Clone, Copy)]
struct Block {
    /// Its first row.
    i0: usize,
    /// Its rows.
    rows: usize,
    /// Keys every row sees.
    kfull: usize,
    /// Keys any row sees.
    kend: usize,
    /// Keys every row of its last row group sees (A panels' step stride).
    kmax: usize,
    /// The limits of a product whose columns are keys.
    cols: Diag,
    /// The limits of a product whose steps are keys.
    steps: Diag,
}

/// Block `blk`'s rows and keys for microkernel rows `mr`.
#[inline(always)]
fn block_keys<T>(k: &Kern<T>, blk: usize, mr: usize) -> Block {
    let (sq, skv, r) = (k.t.seq_q as usize, k.t.seq_kv as usize, k.t.rows as usize);
    let i0 = blk * r;
    let i1 = (i0 + r).min(sq);
    let rows = i1 - i0;
    if !k.causal {
        let (cols, steps) = (Diag::No, Diag::No);
        return Block {
            i0,
            rows,
            kfull: skv,
            kend: skv,
            kmax: skv,
            cols,
            steps,
        };
    }
    let kend = i1.min(skv);
    Block {
        i0,
        rows,
        kfull: i0.min(skv),
        kend,
        kmax: kend.min(i0 + (rows - 1) / mr * mr),
        cols: Diag::Cols(i0),
        steps: Diag::Steps(i0),
    }
}

/// Keys row `i` sees.
#[inline(always)]
fn seen<T>(k: &Kern<T>, i: usize) -> usize {
    let skv = k.t.seq_kv as usize;
    if k.causal {
        (i + 1).min(skv)
    } else {
        skv
    }
}

/// The block's scores `q k^T` (unscaled) into `s`, keys `..kend`.
///
/// # Safety
/// Inside `L::enter`; q's block is packed at `a.qa`, k^T at `a.kt`.
#[inline(always)]
unsafe fn scores<L: Tile, T>(
    k: &Kern<T>,
    ar: *mut f32,
    rows: usize,
    kend: usize,
    at: usize,
    panels: usize,
    diag: Diag,
) {
    let (d, kp) = (k.t.head_dim as usize, k.t.kv_pad as usize);
    // SAFETY: the arena's buffers.
    unsafe {
        gemm::<L>(
            ar.add(at),
            rows,
            d,
            ar.add(panels),
            d * L::NR,
            kend,
            ar.add(k.a.s),
            kp,
            false,
            diag,
        )
    };
}

/// One forward block: rows `blk * rows ..` of head `h`.
///
/// # Safety
/// Inside `L::enter`; k^T and v of the head's key/value head are packed.
#[inline(always)]
unsafe fn forward_block<L: Tile, T: Float>(
    k: &Kern<T>,
    ar: *mut f32,
    b: usize,
    h: usize,
    blk: usize,
) {
    let (d, kp, dp) = (
        k.t.head_dim as usize,
        k.t.kv_pad as usize,
        k.t.dim_pad as usize,
    );
    let a = &k.a;
    let bk = block_keys(k, blk, L::MR);
    let (i0, rows) = (bk.i0, bk.rows);
    let groups = d.div_ceil(GROUP);
    // SAFETY: the block's rows of head h, the arena's buffers (plan.rs).
    unsafe {
        pack_a::<L, T>(|r| k.q.row(b, h, i0 + r) as *const T, rows, d, ar.add(a.qa));
        scores::<L, T>(k, ar, rows, bk.kend, a.qa, a.kt, bk.cols);
        let scale = L::splat(k.scale);
        let s = ar.add(a.s);
        let stat = (b * k.t.heads_q as usize + h) * k.t.seq_q as usize + i0;
        for r in 0..rows {
            let n = seen(k, i0 + r);
            let row = s.add(r * kp);
            let mut m = L::splat(-f32::MAX);
            for j in (0..n).step_by(GROUP) {
                let x = scaled::<L>(row.add(j), n - j, scale);
                x.store(&mut *(row.add(j) as *mut [f32; GROUP]));
                m = m.at_least(x);
            }
            let mf = fold_max(-f32::MAX, m);
            let mv = L::splat(mf);
            let mut sum = RowSum::<L>::new();
            for j in (0..n).step_by(GROUP) {
                let g = &mut *(row.add(j) as *mut [f32; GROUP]);
                // Lanes past n hold -Inf: e^-Inf = 0 adds nothing.
                let p = exp_nonpos(L::load(g).sub(mv));
                p.store(g);
                sum.push(p);
            }
            *k.mx.add(stat + r) = mf;
            *k.sm.add(stat + r) = sum.finish();
        }
        // p v over the keys every row of a group sees, then each row's
        // diagonal.
        pack_a_f32::<L>(s, kp, rows, bk.kmax, bk.steps, ar.add(a.pa));
        let acc = ar.add(a.acc);
        let vp = ar.add(a.vp);
        let vstride = kp * L::NR;
        gemm::<L>(
            ar.add(a.pa),
            rows,
            bk.kmax,
            vp,
            vstride,
            d,
            acc,
            dp,
            false,
            bk.steps,
        );
        for r in 0..rows {
            let orow = acc.add(r * dp);
            let kf = group_steps(bk.steps, bk.kmax, r / L::MR * L::MR);
            for j in kf..seen(k, i0 + r) {
                axpy_step::<L>(orow, *s.add(r * kp + j), vp, vstride, j, groups);
            }
            let l = L::splat(*k.sm.add(stat + r));
            let dst = k.out.row(b, h, i0 + r);
            for g in 0..groups {
                let o = L::load(&*(orow.add(g * GROUP) as *const [f32; GROUP])).div(l);
                put::<L, T>(o, dst.add(g * GROUP), (d - g * GROUP).min(GROUP));
            }
        }
    }
}

/// `D_i = sum_d dout_i out_i` for the block's rows: an FMA chain over the
/// head dim, as `dP`'s, so that a row whose output is one key's value
/// (a causal first row) gets `dP - D = 0` exactly. Sixteen rows a vector.
///
/// # Safety
/// Inside `L::enter`; the rows are inside dout and out.
#[inline(always)]
unsafe fn row_dots<L: Lanes, T: Float>(
    k: &Kern<T>,
    b: usize,
    h: usize,
    i0: usize,
    rows: usize,
) -> [f32; ROWS_PAD] {
    let mut dots = [0f32; ROWS_PAD];
    let d = k.t.head_dim as usize;
    for g0 in (0..rows).step_by(GROUP) {
        let w = (rows - g0).min(GROUP);
        // SAFETY: rows i0 + g0 + r < seq_q of head h.
        let ptr =
            |t: &Heads<T>, r: usize| unsafe { t.row(b, h, i0 + g0 + r.min(w - 1)) as *const T };
        let dr: [*const T; GROUP] = core::array::from_fn(|r| ptr(&k.dout, r));
        let or: [*const T; GROUP] = core::array::from_fn(|r| ptr(&k.out, r));
        let mut acc = L::splat(0.0);
        for x in 0..d {
            // SAFETY: x < d inside each row.
            let a: [f32; GROUP] = core::array::from_fn(|r| unsafe { (*dr[r].add(x)).to_f32() });
            // SAFETY: as above.
            let o: [f32; GROUP] = core::array::from_fn(|r| unsafe { (*or[r].add(x)).to_f32() });
            acc = L::load(&a).mul_add(L::load(&o), acc);
        }
        let mut t = [0f32; GROUP];
        acc.store(&mut t);
        dots[g0..g0 + w].copy_from_slice(&t[..w]);
    }
    dots
}

/// `ATTENTION_ROWS` rounded up to 16.
const ROWS_PAD: usize = (ATTENTION_ROWS as usize).next_multiple_of(GROUP);

/// One backward block: rows `blk * rows ..` of head `h`, into dq and the
/// arena's dk and dv sums.
///
/// # Safety
/// Inside `L::enter`; the head's key/value head is packed.
#[inline(always)]
unsafe fn backward_block<L: Tile, T: Float>(
    k: &Kern<T>,
    ar: *mut f32,
    b: usize,
    h: usize,
    blk: usize,
) {
    let (d, kp, dp) = (
        k.t.head_dim as usize,
        k.t.kv_pad as usize,
        k.t.dim_pad as usize,
    );
    let a = &k.a;
    let bk = block_keys(k, blk, L::MR);
    let (i0, rows, kfull, kend) = (bk.i0, bk.rows, bk.kfull, bk.kend);
    let groups = d.div_ceil(GROUP);
    let bstride = k.t.rows as usize * L::NR;
    // SAFETY: the block's rows of head h, the arena's buffers (plan.rs).
    unsafe {
        let qrow = |r| k.q.row(b, h, i0 + r) as *const T;
        let dorow = |r| k.dout.row(b, h, i0 + r) as *const T;
        pack_a::<L, T>(qrow, rows, d, ar.add(a.qa));
        pack_a::<L, T>(dorow, rows, d, ar.add(a.doa));
        pack_b::<L, T>(qrow, rows, d, bstride, ar.add(a.qb));
        pack_b::<L, T>(dorow, rows, d, bstride, ar.add(a.dob));
        scores::<L, T>(k, ar, rows, kend, a.qa, a.kt, bk.cols);
        // dP = dout v^T.
        gemm::<L>(
            ar.add(a.doa),
            rows,
            d,
            ar.add(a.vt),
            d * L::NR,
            kend,
            ar.add(a.dp),
            kp,
            false,
            bk.cols,
        );
        let scale = L::splat(k.scale);
        let (s, dps) = (ar.add(a.s), ar.add(a.dp));
        let stat = (b * k.t.heads_q as usize + h) * k.t.seq_q as usize + i0;
        let dsums = row_dots::<L, T>(k, b, h, i0, rows);
        for (r, dsum) in dsums.iter().enumerate().take(rows) {
            let i = i0 + r;
            let n = seen(k, i);
            let dd = L::splat(*dsum);
            let (mv, lv) = (L::splat(*k.mx.add(stat + r)), L::splat(*k.sm.add(stat + r)));
            let (row, drow) = (s.add(r * kp), dps.add(r * kp));
            for j in (0..n).step_by(GROUP) {
                let g = &mut *(row.add(j) as *mut [f32; GROUP]);
                let x = scaled::<L>(row.add(j), n - j, scale);
                let p = exp_nonpos(x.sub(mv)).div(lv);
                p.store(g);
                let dg = &mut *(drow.add(j) as *mut [f32; GROUP]);
                p.mul(L::load(dg).sub(dd)).store(dg);
            }
        }
        // dq = scale (dS k): the keys every row of a group sees, then the
        // diagonal.
        let acc = ar.add(a.acc);
        let kpan = ar.add(a.kp);
        let kstride = kp * L::NR;
        pack_a_f32::<L>(dps, kp, rows, bk.kmax, bk.steps, ar.add(a.pa));
        gemm::<L>(
            ar.add(a.pa),
            rows,
            bk.kmax,
            kpan,
            kstride,
            d,
            acc,
            dp,
            false,
            bk.steps,
        );
        for r in 0..rows {
            let orow = acc.add(r * dp);
            let kf = group_steps(bk.steps, bk.kmax, r / L::MR * L::MR);
            for j in kf..seen(k, i0 + r) {
                axpy_step::<L>(orow, *dps.add(r * kp + j), kpan, kstride, j, groups);
            }
            let dst = k.dq.row(b, h, i0 + r);
            for g in 0..groups {
                let o = L::load(&*(orow.add(g * GROUP) as *const [f32; GROUP])).mul(scale);
                put::<L, T>(o, dst.add(g * GROUP), (d - g * GROUP).min(GROUP));
            }
        }
        // dv += P^T dout and dk += dS^T q, each key's sum over the rows in
        // order: keys every row sees in one microkernel pass; a diagonal
        // group of keys (kfull, a multiple of 84, starts one) from the
        // first row that sees each key, row by row up to the first that
        // sees them all, then the microkernel from there.
        let (mr, nr) = (L::MR, L::NR);
        for (src, bp, sums) in [(s, a.dob, a.dv), (dps, a.qb, a.dk)] {
            let (bp, sums, pa) = (ar.add(bp), ar.add(sums), ar.add(a.pa));
            pack_at_f32::<L>(src, kp, rows, kend, pa);
            gemm::<L>(pa, kfull, rows, bp, bstride, d, sums, dp, true, Diag::No);
            for jg in (kfull..kend).step_by(mr) {
                let nk = mr.min(kend - jg);
                let r_all = jg + nk - 1 - i0;
                for j in jg..jg + nk {
                    let srow = sums.add(j * dp);
                    for r in j - i0..r_all.min(rows) {
                        axpy_step::<L>(srow, *src.add(r * kp + j), bp, bstride, r, groups);
                    }
                }
                if r_all >= rows {
                    continue;
                }
                for c0 in (0..d).step_by(nr) {
                    let dst = sums.add(jg * dp + c0);
                    let u = Micro::<f32> {
                        kc: rows - r_all,
                        a: pa.add(jg * rows + r_all * mr),
                        b: bp.add((c0 / nr) * bstride + r_all * nr),
                        init: dst,
                        ldi: dp,
                        dst,
                        ldd: dp,
                        rows: nk,
                        cols: nr.min(d - c0),
                    };
                    L::micro::<f32, false, false, false>(&u);
                }
            }
        }
    }
}

/// Rounds the key/value head's dk (times scale) and dv sums into dk, dv.
///
/// # Safety
/// Inside `L::enter`; the sums are complete.
#[inline(always)]
unsafe fn backward_finish<L: Tile, T: Float>(k: &Kern<T>, ar: *mut f32, b: usize, hkv: usize) {
    let (d, dp, n) = (
        k.t.head_dim as usize,
        k.t.dim_pad as usize,
        k.t.seq_kv as usize,
    );
    let groups = d.div_ceil(GROUP);
    let scale = L::splat(k.scale);
    // SAFETY: the sums' rows j < seq_kv; dk, dv rows of head hkv.
    unsafe {
        for j in 0..n {
            let (sk, sv) = (ar.add(k.a.dk + j * dp), ar.add(k.a.dv + j * dp));
            let (ok, ov) = (k.dk.row(b, hkv, j), k.dv.row(b, hkv, j));
            for g in 0..groups {
                let w = (d - g * GROUP).min(GROUP);
                let x = L::load(&*(sk.add(g * GROUP) as *const [f32; GROUP])).mul(scale);
                put::<L, T>(x, ok.add(g * GROUP), w);
                let y = L::load(&*(sv.add(g * GROUP) as *const [f32; GROUP]));
                put::<L, T>(y, ov.add(g * GROUP), w);
            }
        }
    }
}
