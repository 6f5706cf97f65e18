//! The AVX512-BF16 level's bf16 rounding: `vcvtneps2bf16` / `vcvtne2ps2bf16`
//! round sixteen (thirty-two) f32 lanes to nearest even in one instruction,
//! where the integer path of `x86.rs` takes five operations and a word
//! permute. The hardware treats subnormal inputs as zero, so lanes whose
//! input is subnormal are found with one `vfpclassps` and, in the rare
//! vector that has any, blended from the integer path: every output bit
//! equals `dtype::bf16_bits_rne`, proven on all 2^32 inputs below (with the
//! fix-up off, the subnormal inputs that round to a non-zero bf16 differ and
//! the test fails).

use core::arch::x86_64::*;
use core::mem::transmute;

use super::x86::bf16_bits16;

/// The `vfpclassps` category that takes the integer path: denormal (0x20).
/// NaN needs none: the hardware keeps the sign and the upper payload and sets
/// the quiet bit, as `bf16_bits_rne` does (the exhaustive test checks both).
const FIX_UP: i32 = 0x20;

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")]
pub(super) fn in_avx512bf16<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Sixteen lanes rounded to bf16, packed.
#[inline(always)]
pub(super) unsafe fn bits16(v: __m512) -> __m256i {
    // SAFETY: called only inside `in_avx512bf16` (see `Lanes::enter`).
    unsafe {
        let h: __m256i = transmute(_mm512_cvtneps_pbh(v));
        let fix = _mm512_fpclass_ps_mask::<FIX_UP>(v);
        if fix == 0 {
            h
        } else {
            _mm256_mask_blend_epi16(fix, h, bf16_bits16(v))
        }
    }
}

/// `lo` then `hi` rounded to bf16: one 64-byte line.
#[inline(always)]
pub(super) unsafe fn bits32(lo: __m512, hi: __m512) -> __m512i {
    // SAFETY: called only inside `in_avx512bf16` (see `Lanes::enter`).
    unsafe {
        let h: __m512i = transmute(_mm512_cvtne2ps_pbh(hi, lo));
        let (fl, fh) = (
            _mm512_fpclass_ps_mask::<FIX_UP>(lo),
            _mm512_fpclass_ps_mask::<FIX_UP>(hi),
        );
        // One `kortestw` tests both masks; the rare fix-up joins them.
        if _kortestz_mask16_u8(fl, fh) != 0 {
            h
        } else {
            let fix = fl as u32 | (fh as u32) << 16;
            let soft =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(bf16_bits16(lo)), bf16_bits16(hi));
            _mm512_mask_blend_epi16(fix, h, soft)
        }
    }
}

/// Sixteen lanes rounded to bf16 and widened back to f32.
#[inline(always)]
pub(super) unsafe fn round16(v: __m512) -> __m512 {
    // SAFETY: called only inside `in_avx512bf16` (see `Lanes::enter`).
    unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits16(v)))) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::bf16_bits_rne;
    use crate::lanes::Isa;

    /// Every f32 bit pattern: the hardware path (packed, line and widened
    /// forms) equals the library's definition, NaN payloads included.
    /// About 2^28 vectors: seconds in release; skipped in debug builds.
    #[test]
    #[cfg_attr(debug_assertions, ignore = "2^32 inputs: run with --release")]
    fn hardware_bf16_equals_the_definition_on_all_2_pow_32_inputs() {
        if !Isa::Avx512Bf16.is_available() {
            eprintln!("no AVX512-BF16 on this CPU: the exhaustive check did not run");
            return;
        }
        // SAFETY: the level is available.
        let bad = unsafe { exhaustive() };
        assert_eq!(
            bad, 0,
            "inputs whose hardware bf16 differs from bf16_bits_rne"
        );
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
    fn exhaustive() -> u64 {
        let mut bad = 0u64;
        let mut want = [0u16; 32];
        let mut got16 = [0u16; 16];
        let mut got32 = [0u16; 32];
        let mut wide = [0u32; 16];
        for base in (0..=u32::MAX).step_by(32) {
            let lo: [u32; 16] = core::array::from_fn(|i| base + i as u32);
            let hi: [u32; 16] = core::array::from_fn(|i| base + 16 + i as u32);
            for i in 0..16 {
                want[i] = bf16_bits_rne(lo[i]);
                want[16 + i] = bf16_bits_rne(hi[i]);
            }
            // SAFETY: inside in_avx512bf16; the arrays are 64 bytes.
            unsafe {
                let (l, h) = (
                    transmute::<[u32; 16], __m512>(lo),
                    transmute::<[u32; 16], __m512>(hi),
                );
                _mm256_storeu_si256(got16.as_mut_ptr() as *mut __m256i, bits16(l));
                _mm512_storeu_si512(got32.as_mut_ptr() as *mut __m512i, bits32(l, h));
                _mm512_storeu_ps(wide.as_mut_ptr() as *mut f32, round16(l));
            }
            for i in 0..16 {
                bad += u64::from(got16[i] != want[i])
                    + u64::from((wide[i] >> 16) as u16 != want[i])
                    + u64::from(wide[i] & 0xffff != 0);
            }
            bad += got32.iter().zip(&want).filter(|(g, w)| g != w).count() as u64;
        }
        bad
    }
}
