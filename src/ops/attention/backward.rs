//! Attention's backward on the CPU, per key/value head (see `cpu.rs`):
//! per query head of its group and block of rows, the scores again (the
//! forward's bits), `dP = dout v^T`, `dS`, `dq = scale (dS k)`, and the
//! sums `dk += dS^T q`, `dv += P^T dout` carried in the arena, rounded at
//! the end.

use super::cpu::{block_keys, put, scaled, scores, seen, Block, Dims, Heads, Kern, Keys};
use super::panels::{axpy_step, causal_rows_times, gemm, pack_a, pack_at_f32, pack_b, Diag};
use super::*;
use crate::lanes::math::exp_nonpos;
use crate::lanes::{Lanes, GROUP};
use crate::ops::matmul::ukernel::{Micro, Tile};

/// `D_i = sum_d dout_i out_i` for the block's rows: an FMA chain over the
/// head dim, as `dP`'s, so that a row whose output is one key's value
/// (a causal first row) gets `dP - D = 0` exactly. Sixteen rows a vector.
///
/// # Safety
/// Inside `L::enter`; the rows are inside dout and out.
#[inline(always)]
pub(super) unsafe fn row_dots<L: Lanes, T: Float>(
    k: &Kern<T>,
    b: usize,
    h: usize,
    i0: usize,
    rows: usize,
) -> [f32; ROWS_PAD] {
    let mut dots = [0f32; ROWS_PAD];
    let d = k.dims().d;
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
pub(super) const ROWS_PAD: usize = (ATTENTION_ROWS as usize).next_multiple_of(GROUP);

/// What a backward block computes: dq (its rows against every key) and /
/// or the dk and dv sums (of the packed keys).
#[derive(Clone, Copy)]
pub(super) struct Wants {
    /// dq's rows.
    pub(super) dq: bool,
    /// The dk and dv sums.
    pub(super) dkv: bool,
}

/// One backward block: rows `blk * rows ..` of head `h` against `keys`
/// (packed in the arena), into dq and / or the arena's dk and dv sums.
///
/// # Safety
/// Inside `L::enter`; `keys` of the head's key/value head are packed (all
/// of them when dq is wanted).
#[inline(always)]
pub(super) unsafe fn backward_block<L: Tile, T: Float>(
    k: &Kern<T>,
    ar: *mut f32,
    b: usize,
    h: usize,
    blk: usize,
    keys: Keys,
    wants: Wants,
) {
    let Dims { d, kp, dp } = k.dims();
    let a = &k.a;
    // None: no row of the block sees these keys.
    let Some(bk) = block_keys(k, blk, L::MR, keys) else {
        return;
    };
    // q0: the block's first row; i0: its diagonal offset among the keys.
    let (q0, i0, rows, kfull, kend) = (bk.q0, bk.i0, bk.rows, bk.kfull, bk.kend);
    let groups = d.div_ceil(GROUP);
    let bstride = k.t.rows as usize * L::NR;
    // SAFETY: the block's rows of head h, the arena's buffers (plan.rs).
    unsafe {
        let qrow = |r| k.q.row(b, h, q0 + r) as *const T;
        let dorow = |r| k.dout.row(b, h, q0 + r) as *const T;
        pack_a::<L, T>(qrow, rows, d, ar.add(a.qa));
        pack_a::<L, T>(dorow, rows, d, ar.add(a.doa));
        if wants.dkv {
            pack_b::<L, T>(qrow, rows, d, bstride, ar.add(a.qb));
            pack_b::<L, T>(dorow, rows, d, bstride, ar.add(a.dob));
        }
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
        let stat = (b * k.t.heads_q as usize + h) * k.t.seq_q as usize + q0;
        let dsums = row_dots::<L, T>(k, b, h, q0, rows);
        for (r, dsum) in dsums.iter().enumerate().take(rows) {
            let n = seen(k, q0 + r, keys);
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
        if wants.dq {
            dq_rows::<L, T>(k, ar, b, h, &bk, keys);
        }
        if !wants.dkv {
            return;
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
                    L::micro::<f32, false, false, { crate::ops::matmul::ukernel::NO_PAIRS }>(&u);
                }
            }
        }
    }
}

/// dq's rows of the block: `scale (dS k)`, the keys every row of a group
/// sees by the microkernel, then each row's diagonal; dS is in the arena.
///
/// # Safety
/// Inside `L::enter`; every key is packed, the block's dS computed.
#[inline(always)]
unsafe fn dq_rows<L: Tile, T: Float>(
    k: &Kern<T>,
    ar: *mut f32,
    b: usize,
    h: usize,
    bk: &Block,
    keys: Keys,
) {
    let Dims { d, kp, dp } = k.dims();
    let (a, rows, q0) = (&k.a, bk.rows, bk.q0);
    let groups = d.div_ceil(GROUP);
    let scale = L::splat(k.scale);
    // SAFETY: the arena's buffers (plan.rs); dq's rows of the block.
    unsafe {
        let acc = ar.add(a.acc);
        causal_rows_times::<L>(
            ar.add(a.dp),
            kp,
            rows,
            bk.kmax,
            bk.steps,
            |r| seen(k, q0 + r, keys),
            ar.add(a.kp),
            kp * L::NR,
            d,
            ar.add(a.pa),
            acc,
            dp,
        );
        for r in 0..rows {
            let orow = acc.add(r * dp);
            let dst = k.dq.row(b, h, q0 + r);
            for g in 0..groups {
                let o = L::load(&*(orow.add(g * GROUP) as *const [f32; GROUP])).mul(scale);
                put::<L, T>(o, dst.add(g * GROUP), (d - g * GROUP).min(GROUP));
            }
        }
    }
}

/// Rounds the sums of `keys` of the key/value head into dk (times scale)
/// and dv.
///
/// # Safety
/// Inside `L::enter`; the sums are complete.
#[inline(always)]
pub(super) unsafe fn backward_finish<L: Tile, T: Float>(
    k: &Kern<T>,
    ar: *mut f32,
    b: usize,
    hkv: usize,
    keys: Keys,
) {
    let (Dims { d, dp, .. }, n) = (k.dims(), keys.n);
    let groups = d.div_ceil(GROUP);
    let scale = L::splat(k.scale);
    // SAFETY: the sums' rows j < seq_kv; dk, dv rows of head hkv.
    unsafe {
        for j in 0..n {
            let (sk, sv) = (ar.add(k.a.dk + j * dp), ar.add(k.a.dv + j * dp));
            let (ok, ov) = (k.dk.row(b, hkv, keys.j0 + j), k.dv.row(b, hkv, keys.j0 + j));
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
