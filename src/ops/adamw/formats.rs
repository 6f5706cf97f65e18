//! AdamW's compact state (ABI 2.9): **split masters**, where a bf16 param
//! and 16 low bits hold its f32 master exactly (2 bytes of state instead
//! of 4), and **stochastic rounding** to bf16 from a counter-based hash of
//! (seed, step, element key), for the moments and for params stepped
//! without a master. Integer arithmetic on bit patterns only: the same
//! bits on every ISA, thread count and block cut.

/// `AdamWFormats::rounding`: both moments (and amsgrad's maxima) are bf16,
/// rounded stochastically.
pub const ADAMW_SR_MOMENTS: u32 = 1;
/// `AdamWFormats::rounding`: bf16 params without masters, rounded
/// stochastically (the update is added in f32, then rounded).
pub const ADAMW_SR_PARAMS: u32 = 2;
pub(crate) const KNOWN_ROUNDING: u32 = 3;

/// How the optimizer's state is stored (`npk_adamw_formats`): the default
/// (all zero) is `adamw`'s, f32 masters and moments rounded to nearest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdamWFormats<'k> {
    /// The masters list holds the low halves (`i16`) of split masters of
    /// bf16 params: master = bits(param) << 16 + low (see `split`).
    pub split_masters: bool,
    /// `ADAMW_SR_*` bits.
    pub rounding: u32,
    /// 8-bit moments (`q8`): exp_avgs, exp_avg_sqs and max_exp_avg_sqs
    /// hold `u8` codes, and `AdamWScales` one f32 scale per block of 256
    /// elements of each (not with `ADAMW_SR_MOMENTS`).
    pub quantized_moments: bool,
    /// The hash's seed.
    pub seed: u64,
    /// The key of element 0 of each tensor (one per param, empty tensors
    /// included); element `i` has key `keys[t] + i`. Empty: the element's
    /// flat index in the lists. A caller that cuts one tensor into shards
    /// (FSDP) passes each shard's offset in the whole, so every cut rounds
    /// alike.
    pub keys: &'k [u64],
    /// 8-bit moments' rows: the row length of each tensor (one per param,
    /// empty tensors included; 0: the whole tensor), which must divide its
    /// elements; no quantization block crosses a row (`Q8Grid`). Empty:
    /// every tensor one row. A caller whose shards are whole rows (FSDP2's
    /// dim-0 shards: the row a dim-0 slice) gets one process's blocks
    /// wherever the cut falls.
    pub q8_rows: &'k [u64],
}

/// The formats as the call carries them (`npk_adamw_call`'s tail).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdamWState {
    /// 1: the masters list holds split masters' low halves.
    pub split_masters: u32,
    /// `ADAMW_SR_*` bits.
    pub rounding: u32,
    /// The hash's seed.
    pub seed: u64,
    /// Offset of the per-row keys (one `u64` per non-empty tensor, in the
    /// tables' row order) from the aligned workspace start; 0 without
    /// stochastic rounding.
    pub keys_offset: u64,
    /// 1: 8-bit moments (u8 codes in the moment lists, f32 scales in the
    /// call's scale lists; see `q8`).
    pub quantized_moments: u32,
    /// Reserved, zero.
    pub reserved: u32,
}

impl AdamWState {
    /// Whether any element is rounded stochastically (8-bit moments are).
    pub const fn stochastic(&self) -> bool {
        self.rounding != 0 || self.quantized_moments != 0
    }
}

/// The split of an f32 master: its bf16 rounded to nearest with ties away
/// from zero, and the low half that recovers it (`join`). Ties away (not
/// to even) keep the low half in [-2^15, 2^15): under ties-to-even a
/// master halfway between two bf16 values would need 2^15 as well. NaN:
/// a quiet NaN and 0 (its payload's low bits are not kept).
#[inline(always)]
pub fn split(master: f32) -> (u16, i16) {
    let b = master.to_bits();
    if master.is_nan() {
        return (((b >> 16) as u16) | 0x0040, 0);
    }
    // On the magnitude bits: no carry reaches the sign of a non-NaN.
    let hi = (b.wrapping_add(0x8000) >> 16) as u16;
    (hi, b.wrapping_sub((hi as u32) << 16) as i16)
}

/// The master of a split pair (exact for every pair `split` makes).
#[inline(always)]
pub fn join(hi: u16, lo: i16) -> f32 {
    f32::from_bits(((hi as u32) << 16).wrapping_add(lo as i32 as u32))
}

pub(crate) use crate::lanes::random::mix32;

/// Hash streams: one per rounded quantity.
pub(crate) const STREAM_MOMENTS: u32 = 0x6d6f_6d31;
pub(crate) const STREAM_PARAMS: u32 = 0x7061_7231;

/// The call's salt of one stream, from the seed and the step.
pub const fn salt(seed: u64, step: u64, stream: u32) -> u32 {
    let mut x = mix32(seed as u32 ^ 0x9e37_79b9);
    x = mix32(x ^ (seed >> 32) as u32);
    x = mix32(x ^ step as u32);
    x = mix32(x ^ (step >> 32) as u32);
    mix32(x ^ stream)
}

/// 32 random bits of element `key` under `salt`: the moments take the low
/// 16 (exp_avg) and the high 16 (exp_avg_sq and its maximum), a param its
/// stream's high 16.
#[inline(always)]
pub fn random(salt: u32, key: u64) -> u32 {
    // (The CPU kernel's `randoms` computes the same on 32-bit lanes.)
    mix32((key as u32) ^ ((key >> 32) as u32).wrapping_mul(0x9e37_79b9) ^ salt)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lanes::random::round_bf16_sr as round_bf16;

    #[test]
    fn split_recovers_every_master_and_rounds_to_nearest() {
        let mut x = 0x1234_5678u32;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let m = f32::from_bits(x);
            if m.is_nan() {
                continue;
            }
            let (hi, lo) = split(m);
            assert_eq!(join(hi, lo).to_bits(), m.to_bits());
            // Nearest: the bf16 differs from round-to-nearest-even only at ties.
            let rne = half::bf16::from_f32(m).to_bits();
            if x & 0xffff != 0x8000 {
                assert_eq!(hi, rne, "{m:e}");
            }
        }
        for b in [
            0x3f80_8000u32,
            0x3f81_8000,
            0xbf80_8000,
            0x7f7f_ffff,
            0x0000_8000,
            0x8000_0001,
        ] {
            let (hi, lo) = split(f32::from_bits(b));
            assert_eq!(join(hi, lo).to_bits(), b);
        }
        assert_eq!(split(f32::INFINITY), (0x7f80, 0));
        assert!(join(split(f32::NAN).0, 0).is_nan());
    }

    #[test]
    fn stochastic_rounding_is_unbiased_and_exact_values_stay() {
        let v = 1.0f32 + 0.3 / 128.0; // 0.3 of a bf16 step (2^-7) above 1
        let salt = salt(7, 1, STREAM_MOMENTS);
        let up = (0..100_000u64)
            .filter(|&k| round_bf16(v, random(salt, k) & 0xffff) != 0x3f80)
            .count();
        assert!((29_000..31_000).contains(&up), "{up}");
        for r in [0, 1, 0xffff] {
            assert_eq!(round_bf16(1.5, r), 0x3fc0);
            assert_eq!(round_bf16(f32::INFINITY, r), 0x7f80);
            assert_eq!(round_bf16(-2.0, r), 0xc000);
        }
        assert_eq!(round_bf16(f32::NAN, 0xffff) & 0x7fc0, 0x7fc0);
    }
}
