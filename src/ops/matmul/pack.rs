//! Packing: a slice of a or b widened to f32 into the microkernel's panel
//! order, zero-padded to whole panels. Widening is exact, so packing sets
//! no bit; the zero padding only feeds rows and columns that are never
//! stored.
//!
//! `DOT` packs for the bf16 pair dot (`MatmulMath::Bf16Dot`) on lanes
//! without VDPBF16PS: the steps of each pair swapped (the odd one first, as
//! the instruction sums them), subnormal inputs flushed to zero (its DAZ),
//! and an odd slice's last pair completed by a zero step, so the FMA chain
//! over the panel is the instruction's, bit for bit (`dot` on the chain's
//! sums flushes them too). The panel then has `dot_steps(kc)` steps.

use super::plan::MATMUL_KC;
use crate::dtype::Float;
use crate::lanes::{Lanes, GROUP};

/// Row stride of A panels packed by rows (`pack_a_rows`).
pub(crate) const KC: usize = MATMUL_KC as usize;

/// f32 of the widened row a narrow-panel pack keeps (A's `MATMUL_MC`
/// rows, rounded up to a group).
pub(crate) const ROW_BUF: usize = (super::plan::MATMUL_MC as usize).div_ceil(GROUP) * GROUP;

/// Steps ahead a transposed pack prefetches its rows (pairs ahead, in
/// `pairs.rs`).
pub(crate) const AHEAD: usize = 8;

/// The steps of a panel packed for `ks` steps of K: an even number under
/// `DOT` (the last pair completed by a zero step).
#[inline(always)]
pub(crate) const fn panel_steps<const DOT: bool>(ks: usize) -> usize {
    if DOT {
        ks + (ks & 1)
    } else {
        ks
    }
}

/// Where source step `k` goes in a panel: its pair partner's place under
/// `DOT`.
#[inline(always)]
const fn at<const DOT: bool>(k: usize) -> usize {
    if DOT {
        k ^ 1
    } else {
        k
    }
}

/// Whether step `k` of a transposed pack's `w`-wide panel (`w < 16`) may
/// be stored as a whole group of 16 from source row offset `base`: the
/// group's words past `w` spill into the panel's next steps, which the
/// pack writes after this one, so they must stay inside the panel (`kp`
/// steps) and the group inside the source row (`rows`).
#[inline(always)]
pub(crate) const fn group_store_fits(
    k: usize,
    w: usize,
    kp: usize,
    base: usize,
    rows: usize,
) -> bool {
    w < GROUP && k * w + GROUP <= kp * w && base + GROUP <= rows
}

/// x, or a zero of its sign when x is subnormal (VDPBF16PS's DAZ and FTZ).
#[inline(always)]
pub(crate) fn flush(x: f32) -> f32 {
    if x.is_subnormal() {
        0f32.copysign(x)
    } else {
        x
    }
}

/// A bf16 row's `DOT` panel row (`pack_a_rows`): steps `2j` and `2j + 1`
/// swapped, widened, `flush`ed, on the bits (each pair one word, split in
/// two; a loop LLVM turns into vector code, where the element loop was
/// scalar: a quarter of a pair-dot matmul's time on AVX2); an odd row's
/// missing step zero. `out` holds `panel_steps::<true>(bits.len())`.
#[inline(always)]
fn dot_row_bf16(bits: &[u16], out: &mut [f32]) {
    let ftz = |b: u32| {
        if b & 0x7f80_0000 == 0 {
            b & 0x8000_0000
        } else {
            b
        }
    };
    let pairs = bits.len() / 2;
    for (o, w) in out
        .chunks_exact_mut(2)
        .zip(bits.chunks_exact(2))
        .take(pairs)
    {
        o[0] = f32::from_bits(ftz(u32::from(w[1]) << 16));
        o[1] = f32::from_bits(ftz(u32::from(w[0]) << 16));
    }
    if let Some(&last) = bits.get(2 * pairs) {
        out[2 * pairs] = 0.0;
        out[2 * pairs + 1] = f32::from_bits(ftz(u32::from(last) << 16));
    }
}

/// `flush` on lanes: `|x| < 2^-126` (`max(x, -x)`, NaN compares false)
/// takes `x * 0`, a zero of x's sign.
#[inline(always)]
pub(crate) fn flush_lanes<L: Lanes>(x: L) -> L {
    let mag = x.max(L::splat(0.0).sub(x));
    mag.select_lt(L::splat(f32::MIN_POSITIVE), x.mul(L::splat(0.0)), x)
}

/// `2^24`: the scale `ftz_fma` redoes a sum at.
pub(crate) const FTZ_SCALE: f32 = 16_777_216.0;

/// One FMA of VDPBF16PS, `a b + c` with its FTZ, given `a_big = a 2^24`
/// (c flushed). x86 detects tininess after rounding to 24 bits with an
/// unbounded exponent: a sum IEEE rounds up to `2^-126` from `[2^-126 -
/// 2^-150, 2^-126 - 2^-151)` is flushed too (Zen 5's VDPBF16PS gives 0 for
/// `2^-126 - 2^-150`), which `flush_lanes` of the IEEE sum would keep. So
/// the sum is also done at `2^24` times the scale, where it is normal and
/// rounds as if the exponent were unbounded; it is tiny exactly when that
/// one is below `2^-102`. Where a scaled operand overflows, the sum is not
/// tiny (a sum near `2^-126` needs `|c| < 2^-97` and `|a| < 2^27`, since c
/// is a multiple of `ulp(c)` and `a b` of `2^-15 |a b|`, and `|b| >=
/// 2^-126`), and the scaled sum is Inf or NaN, which compares false.
#[inline(always)]
pub(crate) fn ftz_fma<L: Lanes>(a: L, a_big: L, b: L, c: L) -> L {
    let r = a.mul_add(b, c);
    let big = a_big.mul_add(b, c.mul(L::splat(FTZ_SCALE)));
    let mag = big.max(L::splat(0.0).sub(big));
    mag.select_lt(
        L::splat(f32::MIN_POSITIVE * FTZ_SCALE),
        r.mul(L::splat(0.0)),
        r,
    )
}

/// A row-major matrix in memory: element `(i, j)` at `i * ld + j`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<T> {
    pub p: *const T,
    pub ld: usize,
}

impl<T: Float> Mat<T> {
    /// Element `(i, j)` widened.
    ///
    /// # Safety
    /// `(i, j)` is inside the matrix.
    #[inline(always)]
    unsafe fn at(&self, i: usize, j: usize) -> f32 {
        // SAFETY: the caller's.
        unsafe { (*self.p.add(i * self.ld + j)).to_f32() }
    }
}

/// Packs `op(x)[r0 .. r0 + rows, p0 .. p0 + kc]` (op: the transpose when
/// `trans`, x stored transposed) as panels of `w` rows: panel `q`, step `k`,
/// row `r` at `(q * kp + at(k)) * w + r` (`kp = panel_steps(kc)`). This is A's packing (`w = MR`) and,
/// with op(b)^T's rows (b's columns), B's (`w = NR`).
///
/// # Safety
/// Inside `L::enter`; the block lies inside x; `dst` holds
/// `ceil(rows / w) * w * panel_steps(kc)` f32.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pack<L: Lanes, T: Float, const DOT: bool>(
    x: Mat<T>,
    trans: bool,
    r0: usize,
    rows: usize,
    p0: usize,
    kc: usize,
    w: usize,
    dst: *mut f32,
) {
    let panels = rows.div_ceil(w);
    let kp = panel_steps::<DOT>(kc);
    if trans {
        // Stored [k][rows]: each step's row of x is read once, in order
        // (panel by panel it was strided: a TLB miss a step), and its w-wide
        // pieces go to the panels.
        // Panels narrower than a group (A's MR: 14, 6, 4): a whole group
        // widened and stored, the words past w spilling into the panel's
        // next steps, which this loop writes next (a step whose group
        // would pass the panel's end, and a panel without 16 rows left,
        // exactly). The pair dot's panels hold steps swapped in pairs (the
        // next one written is not the next in memory): the row widened
        // whole on the lanes first, then its pieces as copies (a 14-wide
        // piece has no whole group: it went element by element).
        let mut wide = [0f32; ROW_BUF];
        let whole_row = !w.is_multiple_of(GROUP) && rows <= ROW_BUF;
        for k in 0..kc {
            // SAFETY: row p0 + k, columns r0 .. r0 + rows are inside x.
            let src = unsafe { core::slice::from_raw_parts(x.p.add((p0 + k) * x.ld + r0), rows) };
            // The same columns of the row AHEAD steps on: each step's row is
            // a stream (and page) of its own, too short for the hardware
            // prefetchers (an address past x is never dereferenced).
            let next = x.p.wrapping_add((p0 + k + AHEAD) * x.ld + r0) as *const u8;
            for off in (0..rows * core::mem::size_of::<T>()).step_by(64) {
                L::prefetch(next.wrapping_add(off));
            }
            if !DOT && w < GROUP {
                for q in 0..panels {
                    let base = q * w;
                    // SAFETY: step k of panel q is inside dst.
                    let o = unsafe { dst.add((q * kp + k) * w) };
                    if group_store_fits(k, w, kp, base, rows) {
                        // SAFETY: 16 elements at base in src; the group's
                        // words are inside panel q (group_store_fits).
                        unsafe {
                            T::load::<L>(&*(src.as_ptr().add(base) as *const [T; GROUP]))
                                .store(&mut *(o as *mut [f32; GROUP]))
                        };
                        continue;
                    }
                    let n = w.min(rows - base);
                    // SAFETY: step k of panel q is inside dst.
                    let o = unsafe { core::slice::from_raw_parts_mut(o, w) };
                    for (j, d) in o.iter_mut().enumerate() {
                        *d = if j < n { src[base + j].to_f32() } else { 0.0 };
                    }
                }
                continue;
            }
            if whole_row {
                // (widen_into fills whole groups: the tail group zero-padded.)
                crate::lanes::widen_into::<L, T>(src, &mut wide[..rows.div_ceil(GROUP) * GROUP]);
                if DOT {
                    wide[..rows].iter_mut().for_each(|v| *v = flush(*v));
                }
                for q in 0..panels {
                    let base = q * w;
                    let n = w.min(rows - base);
                    // SAFETY: step k of panel q is inside dst.
                    let o = unsafe {
                        core::slice::from_raw_parts_mut(dst.add((q * kp + at::<DOT>(k)) * w), w)
                    };
                    o[..n].copy_from_slice(&wide[base..base + n]);
                    o[n..].fill(0.0);
                }
                continue;
            }
            for q in 0..panels {
                let base = q * w;
                let n = w.min(rows - base);
                // SAFETY: step k of panel q is inside dst.
                let o = unsafe {
                    core::slice::from_raw_parts_mut(dst.add((q * kp + at::<DOT>(k)) * w), w)
                };
                let mut r = 0;
                while r + GROUP <= n {
                    // SAFETY: 16 elements at base + r in src, r in o.
                    let mut v: L =
                        T::load(unsafe { &*(src.as_ptr().add(base + r) as *const [T; GROUP]) });
                    if DOT {
                        v = flush_lanes(v);
                    }
                    // SAFETY: r + 16 <= n <= w.
                    v.store(unsafe { &mut *(o.as_mut_ptr().add(r) as *mut [f32; GROUP]) });
                    r += GROUP;
                }
                for (rr, v) in o.iter_mut().enumerate().skip(r) {
                    *v = if rr < n {
                        flush_if::<DOT>(src[base + rr].to_f32())
                    } else {
                        0.0
                    };
                }
            }
        }
    } else {
        // Stored [rows][k] (b of `x W^T`): 16 rows x 16 steps at a time,
        // read along k and turned by `Lanes::transpose16` into 16 steps of
        // 16 rows (whole vector stores); the last `kc % 16` steps as moves.
        // (Whole groups of rows: w is B's NR, a multiple of 16; any other
        // width takes the moves alone.)
        let kv = if w.is_multiple_of(GROUP) {
            kc / GROUP * GROUP
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
                for k0 in (0..kv).step_by(GROUP) {
                    let v: [L; GROUP] = core::array::from_fn(|r| {
                        if r < valid {
                            // SAFETY: row r0 + base + g + r, steps p0 + k0 ..
                            // p0 + k0 + 16 are inside x.
                            T::load(unsafe {
                                &*(x.p.add((r0 + base + g + r) * x.ld + p0 + k0)
                                    as *const [T; GROUP])
                            })
                        } else {
                            L::splat(0.0)
                        }
                    });
                    for (kk, mut t) in L::transpose16(&v).into_iter().enumerate() {
                        if DOT {
                            t = flush_lanes(t);
                        }
                        let o = at::<DOT>(k0 + kk) * w + g;
                        // SAFETY: 16 f32 at o are inside the panel (g + 16 <= w).
                        t.store(unsafe { &mut *(out.as_mut_ptr().add(o) as *mut [f32; GROUP]) });
                    }
                }
            }
            if kv < kc {
                // SAFETY: as above; steps kv.. of the panel.
                unsafe { pack_rows::<T, DOT>(x, r0 + base, n, p0, kv, kc, w, out) };
            }
        }
    }
    if DOT && kc % 2 == 1 {
        // The last pair's missing odd step, summed first: zero.
        for q in 0..panels {
            // SAFETY: step kc - 1 (the place of step kc) of panel q is in dst.
            unsafe { core::slice::from_raw_parts_mut(dst.add((q * kp + kc - 1) * w), w) }.fill(0.0);
        }
    }
}

/// `flush(x)` under `DOT`.
#[inline(always)]
fn flush_if<const DOT: bool>(x: f32) -> f32 {
    if DOT {
        flush(x)
    } else {
        x
    }
}

/// Steps `k1 .. kc` of the panel of `n <= w` rows stored `[rows][k]`:
/// each row read along k, written with stride `w` (the rest zero). Never
/// inlined into an ISA's context: there LLVM turns the strided stores into
/// gathers and scatters (measured 3.5 ns an element on Zen 4); at the
/// baseline they are plain scalar moves, about one a cycle.
///
/// # Safety
/// Rows `r0 .. r0 + n`, columns `p0 .. p0 + kc` are inside x.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_rows<T: Float, const DOT: bool>(
    x: Mat<T>,
    r0: usize,
    n: usize,
    p0: usize,
    k1: usize,
    kc: usize,
    w: usize,
    out: &mut [f32],
) {
    for r in 0..w {
        for k in k1..kc {
            out[at::<DOT>(k) * w + r] = if r < n {
                // SAFETY: inside x.
                flush_if::<DOT>(unsafe { x.at(r0 + r, p0 + k) })
            } else {
                0.0
            };
        }
    }
}

/// Packs `a[r0 .. r0 + rows, p0 .. p0 + ks]` of a row-major a (not
/// transposed) as panels of `w` rows each kept a row: panel `q`, row `r`,
/// step `k` at `q * w * KC + r * KC + k`. A straight widening copy (no
/// transpose): the microkernel broadcasts each row's value from its own
/// row, at constant offsets `r * KC`.
///
/// # Safety
/// Inside `L::enter`; the block lies inside a; `dst` holds
/// `ceil(rows / w) * w * KC` f32; `ks <= KC`.
#[inline(always)]
pub(crate) unsafe fn pack_a_rows<L: Lanes, T: Float, const DOT: bool>(
    a: Mat<T>,
    r0: usize,
    rows: usize,
    p0: usize,
    ks: usize,
    w: usize,
    dst: *mut f32,
) {
    let panels = rows.div_ceil(w);
    let kp = panel_steps::<DOT>(ks);
    for i in 0..panels * w {
        // SAFETY: row i of the panels is inside dst (kp <= KC).
        let out = unsafe { core::slice::from_raw_parts_mut(dst.add(i * KC), kp) };
        if i >= rows {
            out.fill(0.0);
            continue;
        }
        // SAFETY: row r0 + i, columns p0 .. p0 + ks are inside a.
        let src = unsafe { core::slice::from_raw_parts(a.p.add((r0 + i) * a.ld + p0), ks) };
        if DOT && T::DTYPE == crate::dtype::DType::BF16 {
            // SAFETY: T is bf16 (2 bytes); `src` holds ks of them.
            let bits = unsafe { core::slice::from_raw_parts(src.as_ptr() as *const u16, ks) };
            dot_row_bf16(bits, out);
            continue;
        }
        if DOT {
            // Pairs swapped, flushed; the odd slice's missing step zero.
            out.fill(0.0);
            for (k, x) in src.iter().enumerate() {
                out[at::<DOT>(k)] = flush(x.to_f32());
            }
            continue;
        }
        let mut k = 0;
        while k + GROUP <= ks {
            // SAFETY: 16 elements at k in both.
            let v: L = T::load(unsafe { &*(src.as_ptr().add(k) as *const [T; GROUP]) });
            // SAFETY: k + 16 <= ks.
            v.store(unsafe { &mut *(out.as_mut_ptr().add(k) as *mut [f32; GROUP]) });
            k += GROUP;
        }
        for (o, x) in out[k..].iter_mut().zip(&src[k..]) {
            *o = x.to_f32();
        }
    }
}
