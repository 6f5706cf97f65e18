//! Attention on the CPU: the matmul's microkernel on blocks of query rows.
//!
//! Forward, per block (`rows` query rows of one head): the scores against
//! every key the block sees (`q k^T`, B panels of k^T packed once per
//! key/value head and kept while a worker's units share it), each row's
//! max, `p = e^(s - max)` and sum, then `p v` (the probabilities repacked as
//! A panels) and the division. The backward's units are key/value heads
//! (`backward.rs`); the panels and products are `panels.rs`'s.
//!
//! Causal blocks split each key sum at a microkernel row group's first
//! row: the keys before it are seen by every row of the group (the
//! microkernel), the diagonal's by some, added row by row in the same
//! ascending order — so a row's chain never reads a key it does not see.

use super::backward::{backward_block, backward_finish, Wants};
use super::panels::{causal_rows_times, gemm, pack_a, pack_b, pack_bt, Diag};
use super::plan::Arena;
use super::*;
use crate::lanes::detect::Available;
use crate::lanes::math::exp_nonpos;
use crate::lanes::{dispatch_isa, enter_apart, Lanes, RowSum, GROUP};
use crate::ops::elementwise::dispatch_t;
use crate::ops::matmul::ukernel::Tile;
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
pub(super) struct Heads<T> {
    pub(super) p: *mut T,
    pub(super) heads: usize,
    pub(super) seq: usize,
    pub(super) d: usize,
    pub(super) bsnd: bool,
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
    pub(super) unsafe fn row(&self, b: usize, h: usize, s: usize) -> *mut T {
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
pub(super) struct Kern<T> {
    pub(super) q: Heads<T>,
    pub(super) k: Heads<T>,
    pub(super) v: Heads<T>,
    pub(super) out: Heads<T>,
    pub(super) dout: Heads<T>,
    pub(super) dq: Heads<T>,
    pub(super) dk: Heads<T>,
    pub(super) dv: Heads<T>,
    pub(super) mx: *mut f32,
    pub(super) sm: *mut f32,
    pub(super) t: AttentionTiling,
    pub(super) causal: bool,
    pub(super) scale: f32,
    pub(super) ws: Workspace,
    pub(super) a: Arena,
}

// SAFETY: the pointers are the call's tensors and workspace; units write
// disjoint outputs and each worker its own arena.
unsafe impl<T> Sync for Kern<T> {}

/// A head's sizes as the blocks index with them.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    /// The head dim.
    pub(super) d: usize,
    /// Keys rounded for the packed panels (`AttentionTiling::kv_pad`).
    pub(super) kp: usize,
    /// The head dim rounded up to 32 (`AttentionTiling::dim_pad`).
    pub(super) dp: usize,
}

impl<T> Kern<T> {
    /// The tiling's head sizes.
    #[inline(always)]
    pub(super) fn dims(&self) -> Dims {
        Dims {
            d: self.t.head_dim as usize,
            kp: self.t.kv_pad as usize,
            dp: self.t.dim_pad as usize,
        }
    }
}

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
    if backward && t.split != 0 {
        run_blocks!(plain runner, t.flags, t.blocks, |w| backward_dkv::<L, T>(kp, w));
        run_blocks!(plain runner, t.flags, t.blocks, |w| backward_dq::<L, T>(kp, w))
    } else if backward {
        run_blocks!(plain runner, t.flags, t.blocks, |w| backward_all::<L, T>(kp, w))
    } else {
        run_blocks!(plain runner, t.flags, t.blocks, |w| forward_units::<L, T>(kp, w))
    }
}

/// `backward_units` in one pass.
///
/// # Safety
/// As `backward_units`.
#[inline(always)]
unsafe fn backward_all<L: Tile, T: Float>(k: &Kern<T>, w: usize) {
    // SAFETY: forwarded.
    unsafe { backward_units::<L, T, PHASE_ALL>(k, w) }
}

/// `backward_units`' key blocks.
///
/// # Safety
/// As `backward_units`.
#[inline(always)]
unsafe fn backward_dkv<L: Tile, T: Float>(k: &Kern<T>, w: usize) {
    // SAFETY: forwarded.
    unsafe { backward_units::<L, T, PHASE_DKV>(k, w) }
}

/// `backward_units`' query blocks.
///
/// # Safety
/// As `backward_units`.
#[inline(always)]
unsafe fn backward_dq<L: Tile, T: Float>(k: &Kern<T>, w: usize) {
    // SAFETY: forwarded.
    unsafe { backward_units::<L, T, PHASE_DQ>(k, w) }
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
                    || pack_kv::<L, T>(k, ar, b, hkv, Keys::all(k), None),
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

/// Worker `w`'s backward units: key/value heads (dq, dk and dv of each
/// in one pass over its group's rows), or, split (`AttentionTiling::split`:
/// fewer heads than workers), key blocks of a head (`DKV`: their dk and
/// dv over the group's rows that see them) then blocks of query rows (dq
/// against every key). Each element is the same chain either way: the
/// same bits.
///
/// # Safety
/// Inside `L::enter`; the call's contract.
#[inline(always)]
unsafe fn backward_units<L: Tile, T: Float, const PHASE: u8>(k: &Kern<T>, w: usize) {
    let k = &{ *k };
    // SAFETY: w < blocks.
    let ar = unsafe { arena_of(k, w) };
    let hkvs = k.t.heads_kv as usize;
    let hq = k.t.heads_q as usize;
    let group = hq / hkvs.max(1);
    let (qb, kb) = (k.t.q_blocks as usize, k.t.kv_blocks as usize);
    let r = k.t.rows as usize;
    let units = match PHASE {
        PHASE_DQ => k.t.dq_units as usize,
        _ => k.t.units as usize,
    };
    let mut packed = None;
    let mut u = w;
    while u < units {
        // SAFETY: the unit's tensors and this worker's arena.
        unsafe {
            match PHASE {
                PHASE_DQ => {
                    let (blk, h, b) = (u % qb, (u / qb) % hq, u / (qb * hq));
                    let hkv = h / group;
                    let (keys, wants) = (
                        Keys::all(k),
                        Wants {
                            dq: true,
                            dkv: false,
                        },
                    );
                    if packed != Some((b, hkv)) {
                        enter_apart::<L, _>(
                            #[inline(always)]
                            || pack_kv::<L, T>(k, ar, b, hkv, keys, Some(wants)),
                        );
                        packed = Some((b, hkv));
                    }
                    enter_apart::<L, _>(
                        #[inline(always)]
                        || backward_block::<L, T>(k, ar, b, h, blk, keys, wants),
                    );
                }
                _ => {
                    let (b, hkv, keys, wants) = if PHASE == PHASE_DKV {
                        let (j, hkv, b) = (u % kb, (u / kb) % hkvs, u / (kb * hkvs));
                        let j0 = j * r;
                        let keys = Keys {
                            j0,
                            n: r.min(k.t.seq_kv as usize - j0),
                        };
                        (
                            b,
                            hkv,
                            keys,
                            Wants {
                                dq: false,
                                dkv: true,
                            },
                        )
                    } else {
                        (
                            u / hkvs,
                            u % hkvs,
                            Keys::all(k),
                            Wants {
                                dq: true,
                                dkv: true,
                            },
                        )
                    };
                    enter_apart::<L, _>(
                        #[inline(always)]
                        || pack_kv::<L, T>(k, ar, b, hkv, keys, Some(wants)),
                    );
                    for h in hkv * group..(hkv + 1) * group {
                        for blk in 0..qb {
                            enter_apart::<L, _>(
                                #[inline(always)]
                                || backward_block::<L, T>(k, ar, b, h, blk, keys, wants),
                            );
                        }
                    }
                    enter_apart::<L, _>(
                        #[inline(always)]
                        || backward_finish::<L, T>(k, ar, b, hkv, keys),
                    );
                }
            }
        }
        u += k.t.blocks as usize;
    }
}

/// `backward_units`' phases: one pass, key blocks' dk and dv, query
/// blocks' dq.
const PHASE_ALL: u8 = 0;
/// See `PHASE_ALL`.
const PHASE_DKV: u8 = 1;
/// See `PHASE_ALL`.
const PHASE_DQ: u8 = 2;

/// Packs `keys` of key/value head `hkv` of batch `b`: k^T as B panels; v
/// as B panels forward (`wants` None); backward, v^T, and k for dq, and
/// zeroes the dk and dv sums for them.
///
/// # Safety
/// Inside `L::enter`; `ar` is this worker's arena.
#[inline(always)]
unsafe fn pack_kv<L: Tile, T: Float>(
    k: &Kern<T>,
    ar: *mut f32,
    b: usize,
    hkv: usize,
    keys: Keys,
    wants: Option<Wants>,
) {
    let (n, Dims { d, kp, dp }) = (keys.n, k.dims());
    let a = &k.a;
    // SAFETY: rows keys.j0 + j < seq_kv of head hkv; the arena's buffers
    // (plan.rs).
    unsafe {
        let krow = |j| k.k.row(b, hkv, keys.j0 + j) as *const T;
        let vrow = |j| k.v.row(b, hkv, keys.j0 + j) as *const T;
        pack_bt::<L, T>(krow, n, d, ar.add(a.kt));
        let Some(wants) = wants else {
            pack_b::<L, T>(vrow, n, d, kp * L::NR, ar.add(a.vp));
            return;
        };
        pack_bt::<L, T>(vrow, n, d, ar.add(a.vt));
        if wants.dq {
            pack_b::<L, T>(krow, n, d, kp * L::NR, ar.add(a.kp));
        }
        if wants.dkv {
            for x in core::slice::from_raw_parts_mut(ar.add(a.dk), n * dp) {
                *x = 0.0;
            }
            for x in core::slice::from_raw_parts_mut(ar.add(a.dv), n * dp) {
                *x = 0.0;
            }
        }
    }
}

/// Stores `n <= 16` lanes of `v` (rounded once to T) at `dst`.
///
/// # Safety
/// `dst` holds `n`.
#[inline(always)]
pub(super) unsafe fn put<L: Lanes, T: Float>(v: L, dst: *mut T, n: usize) {
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
pub(super) unsafe fn scaled<L: Lanes>(p: *const f32, n: usize, scale: L) -> L {
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

/// A range of a key/value head's keys, `j0..j0 + n`: all of them, or one
/// block of them (the split backward's dk / dv units). Keys are numbered
/// from `j0` inside the arena's panels and sums.
#[derive(Clone, Copy)]
pub(super) struct Keys {
    /// The first key.
    pub(super) j0: usize,
    /// How many.
    pub(super) n: usize,
}

impl Keys {
    /// Every key of the call.
    pub(super) fn all<T>(k: &Kern<T>) -> Keys {
        Keys {
            j0: 0,
            n: k.t.seq_kv as usize,
        }
    }
}

/// A block's rows and keys (keys counted from its `Keys`' first).
#[derive(Clone, Copy)]
pub(super) struct Block {
    /// Its first row (of the query head).
    pub(super) q0: usize,
    /// Its first row less the keys' first: the diagonal's offset.
    pub(super) i0: usize,
    /// Its rows.
    pub(super) rows: usize,
    /// Keys every row sees.
    pub(super) kfull: usize,
    /// Keys any row sees.
    pub(super) kend: usize,
    /// Keys every row of its last row group sees (A panels' step stride).
    pub(super) kmax: usize,
    /// The limits of a product whose columns are keys.
    pub(super) cols: Diag,
    /// The limits of a product whose steps are keys.
    pub(super) steps: Diag,
}

/// Block `blk`'s rows and its keys among `keys`, for microkernel rows `mr`;
/// None when no row of it sees any of them (causal). Blocks of rows and
/// of keys both start at multiples of `rows`: a block that sees a key
/// block's first key starts at or after it.
#[inline(always)]
pub(super) fn block_keys<T>(k: &Kern<T>, blk: usize, mr: usize, keys: Keys) -> Option<Block> {
    let (sq, r) = (k.t.seq_q as usize, k.t.rows as usize);
    let q0 = blk * r;
    let rows = (q0 + r).min(sq) - q0;
    let n = keys.n;
    if !k.causal {
        let (cols, steps) = (Diag::No, Diag::No);
        return Some(Block {
            q0,
            i0: 0,
            rows,
            kfull: n,
            kend: n,
            kmax: n,
            cols,
            steps,
        });
    }
    if q0 + rows <= keys.j0 {
        return None;
    }
    debug_assert!(q0 >= keys.j0, "row and key blocks are aligned");
    let i0 = q0 - keys.j0;
    let kend = (i0 + rows).min(n);
    Some(Block {
        q0,
        i0,
        rows,
        kfull: i0.min(n),
        kend,
        kmax: kend.min(i0 + (rows - 1) / mr * mr),
        cols: Diag::Cols(i0),
        steps: Diag::Steps(i0),
    })
}

/// Keys of `keys` row `i` of the query head sees (`i >= keys.j0` when
/// causal).
#[inline(always)]
pub(super) fn seen<T>(k: &Kern<T>, i: usize, keys: Keys) -> usize {
    if k.causal {
        (i + 1 - keys.j0).min(keys.n)
    } else {
        keys.n
    }
}

/// The block's scores `q k^T` (unscaled) into `s`, keys `..kend`.
///
/// # Safety
/// Inside `L::enter`; q's block is packed at `a.qa`, k^T at `a.kt`.
#[inline(always)]
pub(super) unsafe fn scores<L: Tile, T>(
    k: &Kern<T>,
    ar: *mut f32,
    rows: usize,
    kend: usize,
    at: usize,
    panels: usize,
    diag: Diag,
) {
    let Dims { d, kp, .. } = k.dims();
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
    let Dims { d, kp, dp } = k.dims();
    let a = &k.a;
    let keys = Keys::all(k);
    // Some: every block of rows sees the first key.
    let Some(bk) = block_keys(k, blk, L::MR, keys) else {
        return;
    };
    let (i0, rows) = (bk.q0, bk.rows);
    let groups = d.div_ceil(GROUP);
    // SAFETY: the block's rows of head h, the arena's buffers (plan.rs).
    unsafe {
        pack_a::<L, T>(|r| k.q.row(b, h, i0 + r) as *const T, rows, d, ar.add(a.qa));
        scores::<L, T>(k, ar, rows, bk.kend, a.qa, a.kt, bk.cols);
        let scale = L::splat(k.scale);
        let s = ar.add(a.s);
        let stat = (b * k.t.heads_q as usize + h) * k.t.seq_q as usize + i0;
        for r in 0..rows {
            let n = seen(k, i0 + r, keys);
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
        let acc = ar.add(a.acc);
        causal_rows_times::<L>(
            s,
            kp,
            rows,
            bk.kmax,
            bk.steps,
            |r| seen(k, i0 + r, keys),
            ar.add(a.vp),
            kp * L::NR,
            d,
            ar.add(a.pa),
            acc,
            dp,
        );
        for r in 0..rows {
            let orow = acc.add(r * dp);
            let l = L::splat(*k.sm.add(stat + r));
            let dst = k.out.row(b, h, i0 + r);
            for g in 0..groups {
                let o = L::load(&*(orow.add(g * GROUP) as *const [f32; GROUP])).div(l);
                put::<L, T>(o, dst.add(g * GROUP), (d - g * GROUP).min(GROUP));
            }
        }
    }
}
