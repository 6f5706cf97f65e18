//! Counter-based random bits and stochastic rounding to bf16, element by
//! element: integer arithmetic on bit patterns, so every ISA gives the same
//! bits (the `Lanes` methods `hash16` / `store_bf16_sr` run these on
//! registers where an ISA overrides them).

/// lowbias32 (Wellons): a bijective 32-bit mix with good avalanche.
#[inline(always)]
pub const fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// `v` rounded to bf16 stochastically with 16 random bits `r` (< 2^16):
/// up in magnitude with probability (the part below bf16's step) / step,
/// so the rounding is unbiased; NaN a quiet NaN, infinities kept.
#[inline(always)]
pub fn round_bf16_sr(v: f32, r: u32) -> u16 {
    let b = v.to_bits();
    // The magnitude's low 16 bits plus r carry into bf16's last bit
    // exactly when r >= 2^16 - low; an infinity's low bits are zero.
    let rounded = b.wrapping_add(r & 0xffff) >> 16;
    let nan = ((b & 0x7fff_ffff) > 0x7f80_0000) as u32;
    let keep = nan.wrapping_neg();
    ((rounded & !keep) | (((b >> 16) | 0x0040) & keep)) as u16
}
