//! Arm's bf16 pair dot (`MatmulMath::Bf16DotArm`): the sums of `BFDOT` and
//! `BFMMLA` (FEAT_BF16, with FPCR.EBF 0 as Linux leaves it; the Arm ARM's
//! `BFDotAdd`). Per pair of steps `t = odd(a[k] b[k] + a[k+1] b[k+1])`, then
//! `c = odd(c + t)`: each sum rounded to odd, inputs (the bf16 operands and
//! the sum carried in) read as zero when subnormal, a result tiny before
//! rounding (below 2^-126) written as zero of its sign, and one of 2^128 or
//! more as infinity. `BFMMLA` is two such steps on a 2 x 4 by 4 x 2 block,
//! so both instructions give these bits.
//!
//! The pair panels are `pairs.rs`'s (a word per pair, step `2i` in the low
//! half: `BFDOT`'s element order). On the NEON BF16 lanes the microkernel
//! is `BFMMLA` (`bf16_block`, 16 products an instruction); every other ISA
//! runs the scalar model (`model_block`, exact, far slower than the other
//! maths: it is there for the same bits, so a result computed on an Arm
//! server can be checked anywhere).

use super::pack::KC;
use super::ukernel::Micro;
use crate::lanes::GROUP;

/// 2^-126: below it, a result is tiny.
const MIN_NORMAL: f64 = f32::MIN_POSITIVE as f64;
/// 2^128: from it on, a result is infinite.
const OVERFLOW: f64 = 340_282_366_920_938_463_463_374_607_431_768_211_456.0;

/// x, or a zero of its sign when subnormal (how the instruction reads an
/// input).
#[inline(always)]
pub(crate) fn flush_in(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

/// The exact value `s + e` rounded as the instruction rounds: to odd (the
/// value truncated to 24 bits, its last bit set when anything was cut), a
/// tiny one to a zero of its sign, 2^128 or more to infinity. `e` is the
/// error of `s` (TwoSum's, or 0); a tiny exact value is a multiple of
/// 2^-149 below 2^-126, so f64 holds it exactly and `e` is 0 then.
#[inline(always)]
fn round_odd(s: f64, e: f64) -> f32 {
    if s.is_nan() {
        return f32::NAN;
    }
    let sign = ((s.to_bits() >> 32) as u32) & 0x8000_0000;
    let a = f64::from_bits(s.to_bits() & !(1 << 63));
    if a < MIN_NORMAL {
        return f32::from_bits(sign);
    }
    // e beyond |s| (away from zero) or inside it.
    let beyond = e != 0.0 && (e > 0.0) == (s > 0.0);
    let inside = e != 0.0 && !beyond;
    if a > OVERFLOW || (a == OVERFLOW && !inside) {
        return f32::from_bits(sign | 0x7f80_0000);
    }
    if a == OVERFLOW {
        // Just below 2^128: truncated to the largest finite (odd) value.
        return f32::from_bits(sign | 0x7f7f_ffff);
    }
    // 2^-126 <= a < 2^128: a's exponent and top 23 fraction bits are the
    // f32 truncation of a.
    let bits = a.to_bits();
    let exp = (bits >> 52) as u32 + 127 - 1023;
    let frac = bits & ((1 << 52) - 1);
    let t = exp << 23 | (frac >> 29) as u32;
    let cut = frac & ((1 << 29) - 1) != 0;
    let t = if cut {
        // a lies strictly between two f32 values, and so does s + e.
        t | 1
    } else if beyond {
        t | 1
    } else if inside {
        // Just below the f32 value a: its predecessor, made odd (a itself
        // when a is odd).
        (t - 1) | 1
    } else {
        t
    };
    f32::from_bits(sign | t)
}

/// `x + y` rounded as the instruction rounds (TwoSum's error decides the
/// direction; f64 does not overflow on these operands).
#[inline(always)]
fn add_odd(x: f64, y: f64) -> f32 {
    let s = x + y;
    let e = if s.is_finite() {
        let b = s - x;
        (x - (s - b)) + (y - b)
    } else {
        0.0
    };
    round_odd(s, e)
}

/// One `BFDotAdd`: `c + (a0 b0 + a1 b1)` with the instruction's roundings
/// (the operands bf16 values widened to f32).
#[inline(always)]
pub(crate) fn dot_add(c: f32, a0: f32, a1: f32, b0: f32, b1: f32) -> f32 {
    let p = |x: f32, y: f32| round_odd(f64::from(flush_in(x)) * f64::from(flush_in(y)), 0.0);
    let t = add_odd(f64::from(p(a0, b0)), f64::from(p(a1, b1)));
    add_odd(f64::from(flush_in(c)), f64::from(t))
}

/// The two bf16 of a pair word, widened: step `2i` (low half), `2i + 1`.
#[inline(always)]
pub(crate) fn halves(w: u32) -> (f32, f32) {
    (f32::from_bits(w << 16), f32::from_bits(w & 0xffff_0000))
}

/// Most f32 of a block this model runs (any lanes type's `MR x NR`).
const MAX_BLOCK: usize = 14 * 32;

/// A full `mr x nr` block of the pair dot by the scalar model, on pair
/// panels (`kc` pairs).
///
/// # Safety
/// As `ukernel::block`'s, on pair panels; `mr * nr <= 448`.
#[inline(never)]
pub(crate) unsafe fn model_block<const AR: bool>(u: &Micro<f32>, mr: usize, nr: usize) {
    debug_assert!(mr * nr <= MAX_BLOCK && nr.is_multiple_of(GROUP));
    let mut acc = [0f32; MAX_BLOCK];
    if !u.init.is_null() {
        for r in 0..mr {
            for c in 0..nr {
                // SAFETY: init holds mr x nr.
                acc[r * nr + c] = unsafe { *u.init.add(r * u.ldi + c) };
            }
        }
    }
    let (a, b) = (u.a as *const u32, u.b as *const u32);
    for p in 0..u.kc {
        for r in 0..mr {
            // SAFETY: the panels hold kc pairs of mr rows (row r of an AR
            // panel at r * KC) and of nr columns.
            let (a0, a1) = halves(unsafe { *a.add(if AR { r * KC + p } else { p * mr + r }) });
            for c in 0..nr {
                // SAFETY: as above.
                let (b0, b1) = halves(unsafe { *b.add(p * nr + c) });
                let s = &mut acc[r * nr + c];
                *s = dot_add(*s, a0, a1, b0, b1);
            }
        }
    }
    for r in 0..mr {
        for c in 0..nr {
            // SAFETY: dst holds mr x nr.
            unsafe { *u.dst.add(r * u.ldd + c) = acc[r * nr + c] };
        }
    }
}

/// A full `6 x 16` block on pair panels: `BFMMLA` on each two pairs (a 2 x
/// 4 block of a's rows by a 4 x 2 block of b's columns into a 2 x 2 block
/// of c: 3 x 8 accumulators), `BFDOT` on an odd last pair. The operands are
/// the pair panels' words zipped two pairs at a time (row r's pair p, then
/// p + 1: `BFMMLA`'s four steps of a row), so no packing of its own.
///
/// # Safety
/// Inside the NEON BF16 lanes' context (FEAT_BF16); as `model_block` with
/// `mr = 6` and `nr = 16`.
#[cfg(target_arch = "aarch64")]
#[inline(always)]
pub(crate) unsafe fn bf16_block<const AR: bool, const MR: usize>(u: &Micro<f32>) {
    use core::arch::aarch64::*;
    const { assert!(MR == 6) };
    let words = |p: *const f32| p as *const u32;
    // SAFETY: NEON and FEAT_BF16 (the caller's context); every pointer as
    // `model_block`'s with mr = 6 and nr = 16: a's pair p of row r at
    // `p * 6 + r` (or `r * KC + p` with AR), b's of column c at `p * 16 + c`.
    unsafe {
        // acc[rp][cp]: c at rows 2rp, 2rp + 1 by columns 2cp, 2cp + 1.
        let mut acc = [[vdupq_n_f32(0.0); 8]; 3];
        if !u.init.is_null() {
            for (rp, row) in acc.iter_mut().enumerate() {
                for (cp, v) in row.iter_mut().enumerate() {
                    let at = |r: usize| u.init.add((2 * rp + r) * u.ldi + 2 * cp);
                    *v = vcombine_f32(vld1_f32(at(0)), vld1_f32(at(1)));
                }
            }
        }
        let (a, b) = (words(u.a), words(u.b));
        // a's three row pairs at pairs p and p + 1 (or p twice: BFDOT's).
        let a_rows = |p: usize, q: usize| -> [uint32x4_t; 3] {
            if AR {
                let w = |r: usize, p: usize| *a.add(r * KC + p);
                core::array::from_fn(|rp| {
                    let (r0, r1) = (2 * rp, 2 * rp + 1);
                    let lo = vset_lane_u32::<1>(w(r0, q), vdup_n_u32(w(r0, p)));
                    let hi = vset_lane_u32::<1>(w(r1, q), vdup_n_u32(w(r1, p)));
                    vcombine_u32(lo, hi)
                })
            } else {
                let (x, y) = (vld1q_u32(a.add(p * MR)), vld1q_u32(a.add(q * MR)));
                let (x2, y2) = (vld1_u32(a.add(p * MR + 4)), vld1_u32(a.add(q * MR + 4)));
                [
                    vzip1q_u32(x, y),
                    vzip2q_u32(x, y),
                    vzip1q_u32(vcombine_u32(x2, x2), vcombine_u32(y2, y2)),
                ]
            }
        };
        let pairs = u.kc;
        for p in (0..pairs / 2 * 2).step_by(2) {
            let ar = a_rows(p, p + 1);
            for g in 0..4 {
                let x = vld1q_u32(b.add(p * GROUP + 4 * g));
                let y = vld1q_u32(b.add((p + 1) * GROUP + 4 * g));
                let bc = [vzip1q_u32(x, y), vzip2q_u32(x, y)];
                for (rp, row) in acc.iter_mut().enumerate() {
                    for (h, bv) in bc.iter().enumerate() {
                        mmla(&mut row[2 * g + h], ar[rp], *bv);
                    }
                }
            }
        }
        if pairs % 2 == 1 {
            // The last pair alone: BFDOT on the 2 x 2 layout, a's rows
            // [r, r, r + 1, r + 1] against b's columns [c, c + 1, c, c + 1]
            // (BFMMLA with a zero pair after would turn a -0 into +0).
            let p = pairs - 1;
            let ar = a_rows(p, p);
            for g in 0..4 {
                let x = vld1q_u32(b.add(p * GROUP + 4 * g));
                let bc = [
                    vcombine_u32(vget_low_u32(x), vget_low_u32(x)),
                    vcombine_u32(vget_high_u32(x), vget_high_u32(x)),
                ];
                for (rp, row) in acc.iter_mut().enumerate() {
                    // a_rows(p, p) zipped each row's word with itself.
                    for (h, bv) in bc.iter().enumerate() {
                        dot(&mut row[2 * g + h], ar[rp], *bv);
                    }
                }
            }
        }
        for (rp, row) in acc.iter().enumerate() {
            for (cp, v) in row.iter().enumerate() {
                let at = |r: usize| u.dst.add((2 * rp + r) * u.ldd + 2 * cp);
                vst1_f32(at(0), vget_low_f32(*v));
                vst1_f32(at(1), vget_high_f32(*v));
            }
        }
    }
}

/// `$name(acc, a, b)`: `acc` updated by the FEAT_BF16 instruction `$insn`
/// on a and b (bf16 pairs in 32-bit lanes).
macro_rules! bf16_insn {
    ($(#[$doc:meta])* $name:ident, $insn:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// FEAT_BF16.
        #[cfg(target_arch = "aarch64")]
        #[inline(always)]
        unsafe fn $name(
            acc: &mut core::arch::aarch64::float32x4_t,
            a: core::arch::aarch64::uint32x4_t,
            b: core::arch::aarch64::uint32x4_t,
        ) {
            // SAFETY: FEAT_BF16 (the caller's); registers only.
            unsafe {
                core::arch::asm!(
                    ".arch_extension bf16",
                    concat!($insn, " {c:v}.4s, {x:v}.8h, {y:v}.8h"),
                    c = inout(vreg) *acc,
                    x = in(vreg) a,
                    y = in(vreg) b,
                    options(pure, nomem, nostack, preserves_flags)
                )
            };
        }
    };
}

bf16_insn!(
    /// `acc += a b` by `BFMMLA`: a 2 x 4 bf16 block (`a`: row 0's four
    /// steps, then row 1's) by a 4 x 2 one (`b`: column 0's, then column
    /// 1's).
    mmla,
    "bfmmla"
);
bf16_insn!(
    /// `acc[i] += a[i] . b[i]` by `BFDOT`, each lane a pair of steps.
    dot,
    "bfdot"
);

#[cfg(test)]
mod tests {
    use super::*;

    fn bf(x: f32) -> f32 {
        f32::from_bits(x.to_bits() & 0xffff_0000)
    }

    #[test]
    fn round_odd_sets_the_last_bit_of_inexact_sums() {
        // 1 + 2^-30: truncated to 1, inexact: 1 + 2^-23 (odd).
        let r = dot_add(0.0, 1.0, 2f32.powi(-15), 1.0, 2f32.powi(-15));
        assert_eq!(r.to_bits(), 1f32.to_bits() | 1);
        // Exact sums stay exact.
        assert_eq!(dot_add(1.5, 2.0, 3.0, 0.5, 0.25), 1.5 + 1.0 + 0.75);
        // 1 - 2^-30: just below 1: 1 - 2^-24 (the predecessor, odd).
        let r = dot_add(1.0, 2f32.powi(-15), 0.0, -(2f32.powi(-15)), 0.0);
        assert_eq!(r.to_bits(), 1f32.to_bits() - 1);
        // 3 - 2^-30: 3.0's last bit is 0, so its predecessor (odd).
        let r = dot_add(3.0, 2f32.powi(-15), 0.0, -(2f32.powi(-15)), 0.0);
        assert_eq!(r.to_bits(), 3f32.to_bits() - 1);
        // (1 + 2^-23) - 2^-30: the predecessor 1 is even, so 1 + 2^-23.
        let c = f32::from_bits(1f32.to_bits() | 1);
        let r = dot_add(c, 2f32.powi(-15), 0.0, -(2f32.powi(-15)), 0.0);
        assert_eq!(r, c);
    }

    #[test]
    fn tiny_and_huge_results_and_inputs() {
        let tiny = f32::MIN_POSITIVE;
        // A tiny product is a zero of its sign.
        assert_eq!(dot_add(0.0, bf(tiny), 0.0, -0.5, 0.0).to_bits(), 0);
        assert_eq!(
            dot_add(-0.0, bf(tiny), 0.0, -0.5, 0.0).to_bits(),
            0,
            "-0 + (-0 product) then + +0 of the zero pair"
        );
        // Subnormal inputs read as zero.
        assert_eq!(
            dot_add(0.0, f32::from_bits(0x0001_0000), 0.0, 2.0, 0.0),
            0.0
        );
        assert_eq!(dot_add(f32::from_bits(1), 1.0, 0.0, 1.0, 0.0), 1.0);
        // 2^127 * 2 = 2^128: infinity; MAX + 2^103 (below 2^128, where
        // nearest-even rounding overflows) truncates to MAX.
        let big = 2f32.powi(127);
        assert_eq!(dot_add(0.0, big, 0.0, 2.0, 0.0), f32::INFINITY);
        assert_eq!(dot_add(f32::MAX, 2f32.powi(103), 0.0, 1.0, 0.0), f32::MAX);
        assert_eq!(
            dot_add(f32::MAX, 2f32.powi(104), 0.0, 1.0, 0.0),
            f32::INFINITY
        );
        assert!(dot_add(f32::INFINITY, 1.0, 0.0, -1.0, 0.0).is_infinite());
        assert!(dot_add(f32::INFINITY, big, 0.0, -big, 0.0).is_nan());
        assert!(dot_add(0.0, f32::INFINITY, 0.0, 0.0, 0.0).is_nan());
    }
}
