//! 8-bit blockwise-quantized moments (`AdamWFormats::quantized_moments`,
//! ABI 2.9): one `u8` code per element and one f32 scale per block of
//! [`Q8_BLOCK`] = 256 elements of each moment tensor.
//!
//! # Blocks
//! A tensor is cut into rows of `row` elements (`AdamWFormats::q8_rows`;
//! by default one row, the whole tensor), and each row into blocks of 256
//! from its first element, its last block shorter when 256 does not divide
//! the row ([`Q8Grid`]); the scales run row by row. A block never crosses a
//! row, so a shard made of whole rows (FSDP2's dim-0 shards, with the row
//! a dim-0 slice) passing its offset in the whole as its key quantizes
//! exactly as one process holding the whole tensor does, wherever the cut
//! falls. Rows of a multiple of 256 give the flat grid of one row.
//!
//! # Scale and codes
//! After the step's f32 update, a block's scale is its largest |value| of
//! the new f32 moment, stored exactly (the largest bit pattern with the
//! sign cleared: a NaN if the block holds one). Each element is normalized
//! with two f32 multiplications by the block's factors (`q8_inverse`: the
//! correctly rounded reciprocal of the scale, after an exact power-of-two
//! prescaling when the scale is subnormal), `y = min((|x| pre) rcp, 1)`,
//! and coded as a small float relative to the block's maximum, so entries
//! far below the maximum keep ~12.5% relative precision instead of being
//! flushed to zero (as linear absmax int8 would):
//!
//! ```text
//! exp_avg (signed):     s eeee fff   |x| = 2^(e-15) (1 + f/8), e >= 1;  e = 0: 0
//! exp_avg_sq, its max:  eeeee fff    |x| = 2^(e-31) (1 + f/8), e >= 1;  e = 0: 0
//! ```
//! The largest code used is 1.0 (`e` = 15 resp. 31, `f` = 0); the smallest
//! nonzero is 2^-14 resp. 2^-30 of the scale. Decoding is one f32 multiply,
//! `scale * magnitude` (the magnitude built exactly from the bits), signed
//! for exp_avg. (A multiplication, not the division it replaced in ABI
//! 2.9's first codes: three divider operations an element were the step's
//! bound; codes written either way decode alike.)
//!
//! # Stochastic rounding
//! Codes are rounded stochastically with 16 random bits `r` per element:
//! one 32-bit counter hash of (seed, step, element key) per element
//! (`formats::random`, stream `STREAM_Q8`), exp_avg taking its low 16 bits
//! and exp_avg_sq and its maximum the high 16 (one hash for both, as the
//! bf16 moments do). For `y` at least the smallest normal code, `r << 4` is
//! added to `y`'s f32 bit pattern below the 3 kept mantissa bits and the
//! sum truncated: a carry into the exponent is the correct round-up, and
//! `y <= 1` never carries past 1.0. Below the smallest normal code, an
//! exp_avg rounds to it when `r < y * 2^30` (an exact power-of-two
//! scaling), else to 0. Both are unbiased to 2^-16 of a code step. Integer
//! work on bit patterns and exact or correctly rounded f32 operations
//! only: the same codes on every ISA, thread count and block cut.
//!
//! The one biased rule: a positive exp_avg_sq (or maximum) below the
//! smallest code, 2^-30 of its block's, rounds **up** to it, never to 0.
//! A second moment flushed to 0 under a nonzero first moment makes the
//! next step `m / (0 + eps)`, a jump of `lr * m / eps`: a 500-step run
//! with the unbiased rule there (tests/adamw_q8.rs) ended at 20x f32
//! moments' loss, with params 6 apart. Rounding up only shortens the
//! steps of elements whose gradients are ~2^-15 of their block's largest.
//!
//! # Non-finite values and zeros
//! A block whose maximum is NaN or Inf stores it as its scale and all its
//! codes 0, so every element of the block decodes to NaN (`scale * 0`): a
//! non-finite moment poisons its block, as bitsandbytes' blockwise state
//! does. A block of zeros has scale 0 and codes 0 (no 0 / 0) and decodes
//! to 0.

/// Elements per quantization block (one f32 scale each).
pub const Q8_BLOCK: usize = 256;

/// Hash stream of the codes' random bits (exp_avg the low 16 of an
/// element's 32, exp_avg_sq and its maximum the high 16).
pub(crate) const STREAM_Q8: u32 = 0x7138_7232;

/// The scale tensor length of a moment tensor of `numel` elements in one
/// row (the default grid).
pub const fn q8_scales_len(numel: usize) -> usize {
    numel.div_ceil(Q8_BLOCK)
}

/// The quantization blocks of one tensor: rows of `row` elements, each cut
/// into blocks of [`Q8_BLOCK`] from its first element (see the module
/// docs), scales row by row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Q8Grid {
    /// Elements per row (the tensor's `numel` for one row; 0 when empty).
    pub row: usize,
    /// Blocks (scales) per row: `ceil(row / 256)`.
    pub per_row: usize,
}

impl Q8Grid {
    /// The grid of a tensor of `numel` elements in rows of `row` (0: one
    /// row). `row` must divide `numel` (`valid`).
    pub const fn new(numel: usize, row: usize) -> Self {
        let row = if row == 0 { numel } else { row };
        Q8Grid {
            row,
            per_row: row.div_ceil(Q8_BLOCK),
        }
    }

    /// Whether rows of `row` (0: one row) cut a tensor of `numel` elements
    /// evenly.
    pub const fn valid(numel: usize, row: usize) -> bool {
        row == 0 || numel.is_multiple_of(row)
    }

    /// Scales of a tensor of `numel` elements on this grid.
    pub const fn scales_len(&self, numel: usize) -> usize {
        match numel.checked_div(self.row) {
            Some(rows) => rows * self.per_row,
            None => 0,
        }
    }

    /// `i`'s row and its offset in it (an empty tensor's grid: 0, 0).
    const fn place(&self, i: usize) -> (usize, usize) {
        match (i.checked_div(self.row), i.checked_rem(self.row)) {
            (Some(r), Some(o)) => (r, o),
            _ => (0, 0),
        }
    }

    /// The scale (block index) of element `i`.
    pub const fn scale_of(&self, i: usize) -> usize {
        let (r, o) = self.place(i);
        r * self.per_row + o / Q8_BLOCK
    }

    /// The first element of the first block that starts at or after `i`.
    pub const fn next_block(&self, i: usize) -> usize {
        let (r, o) = self.place(i);
        let k = o.div_ceil(Q8_BLOCK) * Q8_BLOCK;
        if k >= self.row {
            (r + 1) * self.row
        } else {
            r * self.row + k
        }
    }

    /// The length of the block that starts at element `at` (a block
    /// start).
    pub const fn block_len(&self, at: usize) -> usize {
        let left = self.row - self.place(at).1;
        if left < Q8_BLOCK {
            left
        } else {
            Q8_BLOCK
        }
    }

    /// The blocks whose first element lies in `[lo, hi)`, in order, as
    /// `(first element, length, scale index)`: one division for all of them.
    pub fn blocks(&self, lo: usize, hi: usize) -> Q8Blocks {
        let at = if self.row == 0 {
            hi
        } else {
            self.next_block(lo)
        };
        let (r, o) = self.place(at);
        Q8Blocks {
            grid: *self,
            at,
            hi,
            r,
            o,
        }
    }
}

/// [`Q8Grid::blocks`]' iterator: the position carried from block to block.
#[derive(Clone, Debug)]
pub struct Q8Blocks {
    grid: Q8Grid,
    at: usize,
    hi: usize,
    /// `at`'s row and its offset in it.
    r: usize,
    o: usize,
}

impl Iterator for Q8Blocks {
    type Item = (usize, usize, usize);

    #[inline(always)]
    fn next(&mut self) -> Option<(usize, usize, usize)> {
        if self.at >= self.hi {
            return None;
        }
        let g = self.grid;
        let n = (g.row - self.o).min(Q8_BLOCK);
        let item = (self.at, n, self.r * g.per_row + self.o / Q8_BLOCK);
        self.at += n;
        self.o += n;
        if self.o == g.row {
            (self.r, self.o) = (self.r + 1, 0);
        }
        Some(item)
    }
}

/// The code's f32 exponent offset: code exponent `e` is f32 exponent
/// `e + OFF` (15 - 127 + ... : 112 signed, 96 unsigned).
const fn off(signed: bool) -> u32 {
    if signed {
        112
    } else {
        96
    }
}

/// The magnitude (signed for exp_avg) a code stands for, relative to the
/// block's scale: exact.
#[inline(always)]
pub fn q8_magnitude<const SIGNED: bool>(c: u8) -> f32 {
    // Written for the lanes: the code shifted once puts `eee(e)fff` where
    // an f32's exponent and mantissa end; adding the offset to the exponent
    // never carries into the sign. (Both moments' decoding took 16 vector
    // operations a group where the field-by-field form took 20.) The
    // sign-extended code's high bits are its sign.
    let x = if SIGNED {
        c as i8 as i32 as u32
    } else {
        c as u32
    };
    let (e_mask, bits) = if SIGNED { (0x78, 0x7f) } else { (0xf8, 0xff) };
    let mag = if x & e_mask != 0 {
        ((x & bits) << 20) + (off(SIGNED) << 23)
    } else {
        0
    };
    f32::from_bits(mag | (x & 0x8000_0000))
}

/// The value of code `c` in a block of scale `scale`.
#[inline(always)]
pub fn q8_decode<const SIGNED: bool>(scale: f32, c: u8) -> f32 {
    scale * q8_magnitude::<SIGNED>(c)
}

/// The block scale of `x`: the largest |value|, as bits (a NaN if any).
#[inline(always)]
pub fn q8_scale(x: &[f32]) -> f32 {
    let mut m = 0u32;
    for v in x {
        m = m.max(v.to_bits() & 0x7fff_ffff);
    }
    f32::from_bits(m)
}

/// The code of `x` in a block of scale `scale` (`q8_scale` of the block),
/// rounded stochastically with the 16 random bits `r & 0xffff`.
#[inline(always)]
pub fn q8_encode<const SIGNED: bool>(x: f32, scale: f32, r: u32) -> u8 {
    let live = live(scale);
    let (pre, rcp) = q8_inverse(scale);
    let y = f32::from_bits(x.to_bits() & 0x7fff_ffff) * pre * rcp;
    q8_code::<SIGNED>(y, x.to_bits(), r, live)
}

/// A block's normalization factors `(pre, rcp)`: `y = (|x| pre) rcp`, both
/// products exact or correctly rounded. `rcp` is `1 / (scale pre)`
/// rounded once; `pre` is 1, or 2^64 for a subnormal scale (whose
/// reciprocal would overflow; the prescaling is exact there). A block
/// without codes (`live` false) gets `(1, 1)`.
#[inline(always)]
pub(crate) fn q8_inverse(scale: f32) -> (f32, f32) {
    if !live(scale) {
        return (1.0, 1.0);
    }
    let pre = if scale.to_bits() < 0x0080_0000 {
        f32::from_bits((127 + 64) << 23)
    } else {
        1.0
    };
    (pre, 1.0 / (scale * pre))
}

/// Whether a block of this scale has codes (not zero, not NaN or Inf);
/// else its codes are all 0 (0 / 0 avoided; a non-finite block decodes to
/// NaN).
#[inline(always)]
pub(crate) fn live(scale: f32) -> bool {
    let sb = scale.to_bits();
    sb != 0 && sb < 0x7f80_0000
}

/// The code of the normalized `y = (|x| pre) rcp` (`xb`: x's bits, for its
/// sign; `r`: random bits, the low 16 taken; `live`: `live(scale)`),
/// clamped to 1 (the product may pass it by a rounding), branch-free so
/// that the lanes' loops over a group vectorize.
#[inline(always)]
pub(crate) fn q8_code<const SIGNED: bool>(y: f32, xb: u32, r: u32, live: bool) -> u8 {
    // y >= 0 (live blocks hold finite values): the bits order as the values.
    let yb = y.to_bits().min(0x3f80_0000);
    let r = r & 0xffff;
    let o = off(SIGNED);
    let smallest = (o + 1) << 23;
    // y <= 1: the sum stays <= 1.0's bits + 2^20 - 16, never past 1.0.
    let normal = (yb.wrapping_add(r << 4) >> 20).wrapping_sub(o << 3);
    let below = if SIGNED {
        // 2^(16 - smallest's exponent): an exact scaling; r < 2^16 converts
        // exactly (as an i32: AVX2 has no u32 conversion).
        let z = f32::from_bits(yb) * f32::from_bits((127 + 16 + 127 - (o + 1)) << 23);
        (((r as i32) as f32) < z) as u32 * 8
    } else {
        // A positive second moment never becomes 0 (see the module docs).
        (yb != 0) as u32 * 8
    };
    let mag = if yb >= smallest { normal } else { below };
    let sign = if SIGNED { (xb >> 31) << 7 } else { 0 };
    ((mag | sign) * live as u32) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::adamw::reference::{q8_decode_f64, q8_encode_f64};

    fn xorshift(s: &mut u32) -> u32 {
        *s ^= *s << 13;
        *s ^= *s >> 17;
        *s ^= *s << 5;
        *s
    }

    #[test]
    fn codes_are_the_f64_models_bit_for_bit() {
        let mut s = 0x2545_f491u32;
        for i in 0..400_000 {
            let scale = match i % 5 {
                0 => 1.0,
                1 => f32::from_bits(xorshift(&mut s) & 0x7fff_ffff).min(f32::MAX),
                _ => f32::from_bits((xorshift(&mut s) & 0x0fff_ffff) + 0x3000_0000),
            };
            // Values up to the scale, many far below it.
            let q = f32::from_bits((xorshift(&mut s) & 0x3fff_ffff) % 0x3f80_0001);
            let x = if i % 2 == 0 { scale * q } else { -(scale * q) };
            let x = if x.abs() > scale { scale } else { x };
            let r = xorshift(&mut s);
            assert_eq!(
                q8_encode::<true>(x, scale, r),
                q8_encode_f64(x, scale, r, true),
                "{x:e} {scale:e} {r:#x}"
            );
            assert_eq!(
                q8_encode::<false>(x.abs(), scale, r),
                q8_encode_f64(x.abs(), scale, r, false),
                "{x:e} {scale:e} {r:#x}"
            );
        }
        // Edges: zero and non-finite scales, the extremes.
        for (x, sc) in [
            (0.0f32, 0.0f32),
            (1.0, f32::INFINITY),
            (f32::NAN, f32::NAN),
            (1e-30, 1e30),
            (-1e30, 1e30),
            (1.0, 1.0),
        ] {
            for r in [0, 1, 0x8000, u32::MAX] {
                assert_eq!(q8_encode::<true>(x, sc, r), q8_encode_f64(x, sc, r, true));
                assert_eq!(
                    q8_encode::<false>(x.abs(), sc, r),
                    q8_encode_f64(x.abs(), sc, r, false)
                );
            }
        }
    }

    #[test]
    fn every_code_decodes_as_the_f64_model() {
        let mut s = 0x5eed_u32;
        let mut scales = vec![
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::from_bits(0x0012_3456),
            f32::INFINITY,
            f32::NAN,
        ];
        scales.extend((0..200).map(|_| f32::from_bits(xorshift(&mut s) & 0x7fff_ffff)));
        for sc in scales {
            for c in 0..=255u8 {
                for (got, signed) in [
                    (q8_decode::<true>(sc, c), true),
                    (q8_decode::<false>(sc, c), false),
                ] {
                    let want = q8_decode_f64(sc, c, signed);
                    assert!(
                        got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan(),
                        "{c:#x} {sc:e} {signed}: {got:e} against {want:e}"
                    );
                }
            }
        }
    }

    #[test]
    fn magnitudes_and_extremes() {
        assert_eq!(q8_magnitude::<true>(0x78), 1.0);
        assert_eq!(q8_magnitude::<true>(0xf8), -1.0);
        assert_eq!(q8_magnitude::<true>(0x08), 2f32.powi(-14));
        assert_eq!(q8_magnitude::<true>(0x0f), 2f32.powi(-14) * 1.875);
        assert_eq!(q8_magnitude::<false>(0xf8), 1.0);
        assert_eq!(q8_magnitude::<false>(0x08), 2f32.powi(-30));
        assert_eq!(q8_magnitude::<false>(0x07), 0.0);
        // 1.0 stays 1.0 whatever the random bits; just below rounds to it
        // or to the code below.
        for r in [0, 0x8000, 0xffff] {
            assert_eq!(q8_encode::<true>(2.5, 2.5, r), 0x78);
            assert_eq!(q8_encode::<false>(2.5, 2.5, r), 0xf8);
            assert_eq!(q8_encode::<true>(-2.5, 2.5, r), 0xf8);
            let c = q8_encode::<false>(f32::from_bits(0x3f7f_ffff), 1.0, r);
            assert!(c == 0xf8 || c == 0xf7, "{c:#x}");
            assert_eq!(q8_encode::<false>(0.0, 0.0, r), 0);
            assert_eq!(q8_encode::<true>(3.0, f32::INFINITY, r), 0);
            assert!(q8_decode::<true>(f32::INFINITY, 0).is_nan());
            assert!(q8_decode::<false>(f32::NAN, 0).is_nan());
        }
        assert_eq!(q8_scale(&[1.0, -3.0, 2.0]), 3.0);
        assert!(q8_scale(&[1.0, f32::NAN, f32::INFINITY]).is_nan());
        assert_eq!(q8_scale(&[]), 0.0);
        assert_eq!(q8_scales_len(0), 0);
        assert_eq!(q8_scales_len(257), 2);
    }

    #[test]
    fn grids_cut_rows_into_blocks_of_256() {
        // Every element in exactly one block, blocks inside rows, scales
        // counted row by row; `blocks` from any cut point.
        for (numel, row) in [
            (0, 0),
            (1000, 0),
            (4128, 32),
            (3000, 300),
            (1026, 513),
            (7, 1),
            (1024, 256),
        ] {
            let g = Q8Grid::new(numel, row);
            assert!(Q8Grid::valid(numel, row));
            let all: Vec<_> = g.blocks(0, numel).collect();
            assert_eq!(all.len(), g.scales_len(numel), "{numel} {row}");
            let mut next = 0;
            for (k, &(at, n, q)) in all.iter().enumerate() {
                assert_eq!((at, q), (next, k));
                assert!((1..=Q8_BLOCK).contains(&n) && at / g.row == (at + n - 1) / g.row);
                assert_eq!(n, g.block_len(at));
                assert!((at..at + n).all(|i| g.scale_of(i) == q));
                next += n;
            }
            assert_eq!(next, numel);
            for lo in (0..numel).step_by(97) {
                let hi = (lo + 500).min(numel);
                let want: Vec<_> = all
                    .iter()
                    .copied()
                    .filter(|b| b.0 >= lo && b.0 < hi)
                    .collect();
                assert_eq!(g.blocks(lo, hi).collect::<Vec<_>>(), want);
            }
        }
        assert!(!Q8Grid::valid(300, 120));
        assert_eq!(Q8Grid::new(300, 150).scales_len(300), 2);
    }

    #[test]
    fn a_positive_second_moment_never_rounds_to_zero() {
        for y in [5e-10f32, 1e-20, f32::from_bits(1)] {
            for r in [0, 0x8000, 0xffff] {
                assert_eq!(q8_encode::<false>(y, 1.0, r), 8);
            }
        }
        assert_eq!(q8_encode::<false>(0.0, 1.0, u32::MAX), 0);
    }

    #[test]
    fn rounding_is_unbiased() {
        // Values between codes, normal and below the smallest normal.
        for (y, signed) in [
            (0.3f32, true),
            (0.3, false),
            (1.1e-5, true),
            (3e-5, true),
            (0.999, false),
        ] {
            let n = 200_000u32;
            let mut s = 99u32;
            let sum: f64 = (0..n)
                .map(|_| {
                    let r = xorshift(&mut s);
                    if signed {
                        q8_magnitude::<true>(q8_encode::<true>(y, 1.0, r)) as f64
                    } else {
                        q8_magnitude::<false>(q8_encode::<false>(y, 1.0, r)) as f64
                    }
                })
                .sum();
            let mean = sum / n as f64;
            // The code step around y bounds the spread: a few standard errors.
            let step = (y as f64) / 4.0
                + if signed {
                    2f64.powi(-14)
                } else {
                    2f64.powi(-30)
                };
            let se = step / (n as f64).sqrt();
            assert!((mean - y as f64).abs() < 5.0 * se, "{y}: mean {mean}");
        }
    }
}
