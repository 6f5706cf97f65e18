//! The bf16 pair dot in hardware (`MatmulMath::Bf16Dot` on AVX512-BF16
//! lanes): operands packed as pairs of bf16 steps, one 32-bit word per pair
//! (step `2i` in the low half, as VDPBF16PS reads it; an odd slice's last
//! pair completed by a zero), never widened; the microkernel is
//! `pack.rs`'s FMA block with one VDPBF16PS where two FMAs were. Where the
//! instruction runs at twice the FMA's rate (AMD Zen 4 and 5) this doubles
//! a bf16 matmul's; on other lanes the same bits come from the FMA chain
//! on `DOT` panels (`pack.rs`).
//!
//! The panels keep the f32 panels' shapes with a pair in each f32 slot:
//! panel `q`, pair `p`, row `r` at `(q * kp + p) * w + r` (`kp = ceil(ks /
//! 2)`), A panels packed by rows at `r * KC + p`.

use super::pack::{group_store_fits, Mat, AHEAD, KC};
use crate::dtype::Float;
use crate::lanes::{Lanes, GROUP};

/// Pairs of a slice of `ks` steps.
#[inline(always)]
pub(crate) const fn pairs(ks: usize) -> usize {
    ks.div_ceil(2)
}

/// The bf16 bits of element `(i, j)` of x (T is bf16).
///
/// # Safety
/// `(i, j)` is inside x.
#[inline(always)]
unsafe fn bits<T: Float>(x: Mat<T>, i: usize, j: usize) -> u16 {
    // SAFETY: the caller's; T is a 2-byte float.
    unsafe { *(x.p as *const u16).add(i * x.ld + j) }
}

/// Packs `op(x)[r0 .. r0 + rows, p0 .. p0 + ks]` of a bf16 x as panels of
/// `w` rows of pairs (`pack::pack`'s shapes, a pair per step).
///
/// # Safety
/// Inside `L::enter`; T is bf16; the block lies inside x; `dst` holds
/// `ceil(rows / w) * w * pairs(ks)` words.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pack_pairs<L: Lanes, T: Float>(
    x: Mat<T>,
    trans: bool,
    r0: usize,
    rows: usize,
    p0: usize,
    ks: usize,
    w: usize,
    dst: *mut f32,
) {
    let panels = rows.div_ceil(w);
    let kp = pairs(ks);
    let dst = dst as *mut u32;
    if trans {
        // Stored [k][rows]: steps 2p and 2p + 1 are two rows of x, read in
        // order and interleaved into words.
        for p in 0..kp {
            let k = p0 + 2 * p;
            // The two rows AHEAD pairs on, as `pack::pack` does: each row's
            // piece is a stream of its own, too short for the hardware
            // prefetchers (an address past x is never dereferenced).
            for r in [k + 2 * AHEAD, k + 2 * AHEAD + 1] {
                let next = x.p.wrapping_add(r * x.ld + r0) as *const u8;
                for off in (0..rows * 2).step_by(64) {
                    L::prefetch(next.wrapping_add(off));
                }
            }
            // SAFETY: rows k and k + 1 (when inside the slice), columns r0 ..
            // r0 + rows are inside x.
            let lo = unsafe {
                core::slice::from_raw_parts((x.p as *const u16).add(k * x.ld + r0), rows)
            };
            let hi = if 2 * p + 1 < ks {
                // SAFETY: as above.
                Some(unsafe {
                    core::slice::from_raw_parts((x.p as *const u16).add((k + 1) * x.ld + r0), rows)
                })
            } else {
                None
            };
            // Panels narrower than a group (A's MR = 14): a whole group
            // interleaved and stored, the words past w spilling into the
            // panel's next pairs, which this loop writes next (a pair whose
            // group would pass the panel's end, and a panel without 16
            // rows left, exactly). 14-wide loops do not fill the lanes; a
            // whole row interleaved first, then copied in pieces, moved the
            // words twice.
            for q in 0..panels {
                let base = q * w;
                if group_store_fits(p, w, kp, base, rows) {
                    let words =
                        group_pairs(&lo[base..base + GROUP], hi.map(|h| &h[base..base + GROUP]));
                    // SAFETY: the group's words are inside panel q
                    // (group_store_fits).
                    unsafe {
                        dst.add((q * kp + p) * w)
                            .cast::<[u32; GROUP]>()
                            .write_unaligned(words)
                    };
                    continue;
                }
                let n = w.min(rows - base);
                // SAFETY: pair p of panel q is inside dst.
                let o = unsafe { core::slice::from_raw_parts_mut(dst.add((q * kp + p) * w), w) };
                interleave(o, &lo[base..base + n], hi.map(|h| &h[base..base + n]));
                o[n..].fill(0);
            }
        }
        return;
    }
    // Stored [rows][k] (b of `x W^T`): a row's pairs are consecutive words;
    // 16 rows x 16 pairs at a time turned by `Lanes::transpose16` (moves of
    // bits: no arithmetic touches them), the last pairs as moves.
    let full = if w.is_multiple_of(GROUP) {
        ks / 2 / GROUP * GROUP
    } else {
        0
    };
    for q in 0..panels {
        let base = q * w;
        let n = w.min(rows - base);
        // SAFETY: the panel is inside dst.
        let out = unsafe { core::slice::from_raw_parts_mut(dst.add(q * kp * w), kp * w) };
        for g in (0..w).step_by(GROUP) {
            let valid = n.saturating_sub(g).min(GROUP);
            for p in (0..full).step_by(GROUP) {
                let v: [L; GROUP] = core::array::from_fn(|r| {
                    if r < valid {
                        // SAFETY: row r0 + base + g + r, steps p0 + 2p ..
                        // p0 + 2p + 32 are inside x; read unaligned.
                        let words = unsafe {
                            ((x.p as *const u16).add((r0 + base + g + r) * x.ld + p0 + 2 * p)
                                as *const [f32; GROUP])
                                .read_unaligned()
                        };
                        L::load(&words)
                    } else {
                        L::splat(0.0)
                    }
                });
                for (pp, t) in L::transpose16(&v).into_iter().enumerate() {
                    let o = (p + pp) * w + g;
                    // SAFETY: 16 words at o are inside the panel.
                    t.store(unsafe { &mut *(out.as_mut_ptr().add(o) as *mut [f32; GROUP]) });
                }
            }
        }
        // SAFETY: as above; pairs full.. of the panel.
        unsafe { pair_rows(x, r0 + base, n, p0, full, ks, w, out) };
    }
}

/// Pairs `p1 .. pairs(ks)` of a panel of `n <= w` rows stored `[rows][k]`,
/// as moves (never inlined into an ISA's context: see `pack::pack_rows`).
///
/// # Safety
/// Rows `r0 .. r0 + n`, columns `p0 .. p0 + ks` are inside x.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
unsafe fn pair_rows<T: Float>(
    x: Mat<T>,
    r0: usize,
    n: usize,
    p0: usize,
    p1: usize,
    ks: usize,
    w: usize,
    out: &mut [u32],
) {
    for r in 0..w {
        for p in p1..pairs(ks) {
            out[p * w + r] = if r < n {
                let k = 2 * p;
                // SAFETY: inside x (the odd step only when inside the slice).
                unsafe {
                    let lo = bits(x, r0 + r, p0 + k);
                    let hi = if k + 1 < ks {
                        bits(x, r0 + r, p0 + k + 1)
                    } else {
                        0
                    };
                    u32::from(lo) | u32::from(hi) << 16
                }
            } else {
                0
            };
        }
    }
}

/// `interleave` of one group: 16 `lo` and (when present) `hi`.
#[inline(always)]
fn group_pairs(lo: &[u16], hi: Option<&[u16]>) -> [u32; GROUP] {
    let mut o = [0u32; GROUP];
    interleave(&mut o, lo, hi);
    o
}

/// `dst[i] = lo[i] | hi[i] << 16` (hi zero when absent: an odd slice's
/// last pair), over the shorter of `dst` and `lo`.
#[inline(always)]
fn interleave(dst: &mut [u32], lo: &[u16], hi: Option<&[u16]>) {
    match hi {
        Some(hi) => {
            for ((o, &l), &h) in dst.iter_mut().zip(lo).zip(hi) {
                *o = u32::from(l) | u32::from(h) << 16;
            }
        }
        None => {
            for (o, &l) in dst.iter_mut().zip(lo) {
                *o = u32::from(l);
            }
        }
    }
}

/// Packs `a[r0 .. r0 + rows, p0 .. p0 + ks]` of a row-major bf16 a as panels
/// of `w` rows of pairs, row `r` at `r * KC`: each row's bits copied as they
/// are (its pairs are consecutive words), an odd slice's last word
/// completed by a zero.
///
/// # Safety
/// T is bf16; the block lies inside a; `dst` holds `ceil(rows / w) * w *
/// KC` words; `ks <= KC`.
#[inline(always)]
pub(crate) unsafe fn pack_pairs_a_rows<T: Float>(
    a: Mat<T>,
    r0: usize,
    rows: usize,
    p0: usize,
    ks: usize,
    w: usize,
    dst: *mut f32,
) {
    let kp = pairs(ks);
    for i in 0..rows.div_ceil(w) * w {
        // SAFETY: row i's words are inside dst.
        let out =
            unsafe { core::slice::from_raw_parts_mut((dst as *mut u16).add(2 * i * KC), 2 * kp) };
        if i >= rows {
            out.fill(0);
            continue;
        }
        // SAFETY: row r0 + i, columns p0 .. p0 + ks are inside a.
        let src = unsafe {
            core::slice::from_raw_parts((a.p as *const u16).add((r0 + i) * a.ld + p0), ks)
        };
        out[..ks].copy_from_slice(src);
        out[ks..].fill(0);
    }
}

/// A full block of VDPBF16PS on pair panels: `pack.rs`'s FMA block with
/// one instruction per pair where the chain has two FMAs (the same bits:
/// the odd step first, DAZ and FTZ).
///
/// # Safety
/// Inside AVX512-BF16 lanes' context; as `ukernel::block`, with `kc` pairs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn dpbf16_block<const AR: bool, const MR: usize, const NG: usize>(
    u: &super::ukernel::Micro<f32>,
) {
    use core::arch::x86_64::*;
    use core::mem::transmute;
    let nr = NG * GROUP;
    // SAFETY: AVX512-BF16 (the caller's context); every pointer as
    // `ukernel::block`'s, a pair per f32 slot.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NG]; MR];
        if !u.init.is_null() {
            for (r, row) in acc.iter_mut().enumerate() {
                for (g, v) in row.iter_mut().enumerate() {
                    *v = _mm512_loadu_ps(u.init.add(r * u.ldi + g * GROUP));
                }
            }
        }
        let (mut a, mut b) = (u.a as *const i32, u.b);
        // Pairs two at a time, then the odd one (as the FMA block).
        for (iters, unroll) in [(u.kc / 2, 2), (u.kc % 2, 1)] {
            for _ in 0..iters {
                for _ in 0..unroll {
                    let bv: [__m512bh; NG] = core::array::from_fn(|g| {
                        transmute::<__m512, __m512bh>(_mm512_loadu_ps(b.add(g * GROUP)))
                    });
                    for (r, row) in acc.iter_mut().enumerate() {
                        let w = *a.add(if AR { r * KC } else { r });
                        let av = transmute::<__m512i, __m512bh>(_mm512_set1_epi32(w));
                        for (v, bg) in row.iter_mut().zip(&bv) {
                            *v = _mm512_dpbf16_ps(*v, av, *bg);
                        }
                    }
                    a = a.add(if AR { 1 } else { MR });
                    b = b.add(nr);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (g, v) in row.iter().enumerate() {
                _mm512_storeu_ps(u.dst.add(r * u.ldd + g * GROUP), *v);
            }
        }
    }
}
