//! x86_64 lanes: AVX2 (two ymm, with FMA and F16C enabled in the context but
//! no FMA used) and AVX-512F/BW (one zmm), the latter also with hardware
//! bf16 rounding (AVX512-BF16, `x86_bf16.rs`). Same logical 16 lanes, same
//! IEEE operations and the same fold tree as the portable lanes, so every
//! output bit is the same; only the speed differs.
//!
//! These types are only instantiated by `dispatch_isa!` after run-time
//! detection, and kernels enter a `#[target_feature]` context through
//! `Lanes::enter` so the intrinsics inline.

use core::arch::x86_64::*;

use half::{bf16, f16};

use super::x86_bf16 as hw;
use super::{Isa, Lanes, GROUP};

/// `levels` bits.
const AVX2: u8 = 1;
const AVX512: u8 = 2;
const AVX512BF16: u8 = 4;

/// The x86 levels this CPU and OS support (uncached; `detect` caches).
pub(crate) fn levels() -> u8 {
    use core::arch::x86_64::{__cpuid, __cpuid_count, _xgetbv};
    let (max, l1) = (__cpuid(0).eax, __cpuid(1));
    let osxsave = l1.ecx & (1 << 27) != 0;
    if max < 7 || !osxsave {
        return 0;
    }
    // SAFETY: OSXSAVE is set, so xgetbv is enabled by the OS.
    let xcr0 = unsafe { _xgetbv(0) };
    let ymm_saved = xcr0 & 0b110 == 0b110;
    let zmm_saved = ymm_saved && xcr0 & 0xe0 == 0xe0;
    let (fma, avx, f16c) = (
        l1.ecx & (1 << 12) != 0,
        l1.ecx & (1 << 28) != 0,
        l1.ecx & (1 << 29) != 0,
    );
    let l7 = __cpuid_count(7, 0); // leaf 7 exists: max >= 7
    let (avx2, avx512f, avx512bw) = (
        l7.ebx & (1 << 5) != 0,
        l7.ebx & (1 << 16) != 0,
        l7.ebx & (1 << 30) != 0,
    );
    let (avx512dq, avx512vl) = (l7.ebx & (1 << 17) != 0, l7.ebx & (1 << 31) != 0);
    // AVX512_BF16 is leaf 7, sub-leaf 1, EAX bit 5 (when that sub-leaf exists).
    let avx512bf16 = l7.eax >= 1 && __cpuid_count(7, 1).eax & (1 << 5) != 0;
    let mut f = 0;
    if ymm_saved && avx && fma && f16c && avx2 {
        f |= AVX2;
        if zmm_saved && avx512f && avx512bw {
            f |= AVX512;
            if avx512dq && avx512vl && avx512bf16 {
                f |= AVX512BF16;
            }
        }
    }
    f
}

/// Lanes 0..8 in `.0`, lanes 8..16 in `.1`.
#[derive(Clone, Copy, Debug)]
pub struct Avx2(__m256, __m256);

/// All 16 lanes in one zmm; `HW_BF16` rounds to bf16 with AVX512-BF16's
/// `vcvtne(2)ps2bf16` (with the subnormal fix-up) instead of integer ops.
/// The two levels share every other operation.
#[derive(Clone, Copy, Debug)]
pub struct Avx512Lanes<const HW_BF16: bool>(__m512);

/// AVX-512F/BW lanes.
pub type Avx512 = Avx512Lanes<false>;
/// AVX-512F/BW lanes with AVX512-BF16 (and DQ, VL) for the bf16 rounding.
pub type Avx512Bf16 = Avx512Lanes<true>;

#[target_feature(enable = "avx2,fma,f16c")]
fn in_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
fn in_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// `bf16_bits16`, by hardware on the BF16 level.
#[inline(always)]
unsafe fn bits16<const HW_BF16: bool>(v: __m512) -> __m256i {
    // SAFETY: called only inside the level's context (see `Lanes::enter`).
    unsafe {
        if HW_BF16 {
            hw::bits16(v)
        } else {
            bf16_bits16(v)
        }
    }
}

/// `vpermw` indices interleaving words `[a0..a16, b0..b16]` into
/// `[a0, b0, a1, b1, ..]`: the even/odd line order back to memory order.
const INTERLEAVE_WORDS: [u16; 32] = {
    let mut w = [0u16; 32];
    let mut i = 0;
    while i < 16 {
        w[2 * i] = i as u16;
        w[2 * i + 1] = 16 + i as u16;
        i += 1;
    }
    w
};

/// The fold tree of `Portable::fold`, on the sum of the two 8-lane halves.
#[inline(always)]
fn fold8(s: [f32; 8]) -> f32 {
    let t = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
    let u = [t[0] + t[2], t[1] + t[3]];
    u[0] + u[1]
}

/// Whether `p` is aligned to `a` bytes (what a streaming store needs).
#[inline(always)]
fn aligned<T>(p: &T, a: usize) -> bool {
    (p as *const T as usize).is_multiple_of(a)
}

/// `lo`, `hi` (even and odd elements of a line) rounded to bf16, as the
/// line's 32 words in memory order.
#[inline(always)]
unsafe fn line_bits<const HW_BF16: bool>(lo: __m512, hi: __m512) -> __m512i {
    // SAFETY: called inside an AVX-512F/BW context (BF16 too when HW_BF16).
    unsafe {
        if HW_BF16 {
            // Words [even 0..16, odd 0..16] interleaved by one permute.
            let idx: __m512i = core::mem::transmute(INTERLEAVE_WORDS);
            _mm512_permutexvar_epi16(idx, hw::bits32(lo, hi))
        } else {
            // Each rounded value is the upper half of its lane: the even
            // ones shift down, the odd ones are kept in place.
            let even = _mm512_srli_epi32::<16>(bf16_round16(lo));
            _mm512_mask_blend_epi16(0xAAAA_AAAA, even, bf16_round16(hi))
        }
    }
}

/// A line of 32 bf16 in memory order widened exactly into AVX-512's line
/// order: a bf16 is the upper half of its f32, so the even elements shift
/// up and the odd ones are masked.
#[inline(always)]
unsafe fn widen_line<const HW_BF16: bool>(
    v: __m512i,
) -> (Avx512Lanes<HW_BF16>, Avx512Lanes<HW_BF16>) {
    // SAFETY: called inside an AVX-512F context.
    unsafe {
        (
            Avx512Lanes(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))),
            Avx512Lanes(_mm512_castsi512_ps(_mm512_and_si512(
                v,
                _mm512_set1_epi32(-0x1_0000),
            ))),
        )
    }
}

/// Stores `lo` then `hi` (one 64-byte line) at `p`, streaming with `STREAM`
/// when aligned.
#[inline(always)]
unsafe fn put_line<const STREAM: bool>(p: *mut __m512i, lo: __m256i, hi: __m256i) {
    // SAFETY: called inside an AVX-512F context with 64 writable bytes at p.
    unsafe { put_zmm::<STREAM>(p, _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)) }
}

/// Stores one 64-byte line at `p`, streaming with `STREAM` when aligned.
#[inline(always)]
unsafe fn put_zmm<const STREAM: bool>(p: *mut __m512i, v: __m512i) {
    // SAFETY: called inside an AVX-512F context with 64 writable bytes at p.
    unsafe {
        if STREAM && (p as usize).is_multiple_of(64) {
            _mm512_stream_si512(p, v);
        } else {
            _mm512_storeu_si512(p, v);
        }
    }
}

/// Stores four 16-byte parts (one 64-byte line) at `p`, streaming with
/// `STREAM` when the line is aligned.
#[inline(always)]
unsafe fn put_line4<const STREAM: bool>(p: *mut __m128i, v: [__m128i; 4]) {
    // SAFETY: called with 64 writable bytes at p; SSE2 is baseline.
    unsafe {
        let stream = STREAM && (p as usize).is_multiple_of(64);
        for (i, w) in v.into_iter().enumerate() {
            if stream {
                _mm_stream_si128(p.add(i), w);
            } else {
                _mm_storeu_si128(p.add(i), w);
            }
        }
    }
}

/// bf16 round-to-nearest-even of sixteen lanes, as `dtype::bf16_bits_rne`,
/// in the upper half of each 32-bit lane (the lower half is left over).
#[inline(always)]
unsafe fn bf16_round16(v: __m512) -> __m512i {
    // SAFETY: called only inside an AVX-512F/BW context (see `Lanes::enter`).
    unsafe {
        let x = _mm512_castps_si512(v);
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        // Ties to even: add 0x7fff, plus 1 when the kept part is odd.
        let odd = _mm512_test_epi32_mask(x, _mm512_set1_epi32(0x1_0000));
        let t = _mm512_add_epi32(x, _mm512_set1_epi32(0x7fff));
        let rounded = _mm512_mask_add_epi32(t, odd, t, _mm512_set1_epi32(1));
        // NaN keeps its sign and payload, made quiet.
        _mm512_mask_or_epi32(rounded, nan, x, _mm512_set1_epi32(0x0040_0000))
    }
}

/// `bf16_round16`'s sixteen results packed in the low 256 bits.
#[inline(always)]
pub(super) unsafe fn bf16_bits16(v: __m512) -> __m256i {
    // SAFETY: called only inside an AVX-512F/BW context (see `Lanes::enter`).
    unsafe {
        // One word permute gathers the upper halves (a narrowing store,
        // vpmovdw to memory, is slow on some cores).
        let odd = _mm512_set_epi16(
            31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 31, 29, 27, 25, 23, 21, 19,
            17, 15, 13, 11, 9, 7, 5, 3, 1,
        );
        _mm512_castsi512_si256(_mm512_permutexvar_epi16(odd, bf16_round16(v)))
    }
}

/// bf16 round-to-nearest-even of eight lanes, as `dtype::bf16_bits_rne`, in
/// the upper half of each 32-bit lane (the lower half is left over).
#[inline(always)]
unsafe fn bf16_round8(v: __m256) -> __m256i {
    // SAFETY: called only inside an AVX2 context (see `Lanes::enter`).
    unsafe {
        let x = _mm256_castps_si256(v);
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        // Ties to even: add 0x7fff, plus 1 when the kept part is odd.
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
        let rounded = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
        // NaN keeps its sign and payload, made quiet.
        let quiet = _mm256_or_si256(x, _mm256_set1_epi32(0x0040_0000));
        _mm256_blendv_epi8(rounded, quiet, nan)
    }
}

/// `bf16_round8` of `a` then `b`: sixteen bf16 in order, in one register
/// (one pack and one lane permute for the sixteen, not two of each per eight).
#[inline(always)]
unsafe fn bf16_bits8x2(a: __m256, b: __m256) -> __m256i {
    // SAFETY: called only inside an AVX2 context (see `Lanes::enter`).
    unsafe {
        let (ra, rb) = (
            _mm256_srli_epi32::<16>(bf16_round8(a)),
            _mm256_srli_epi32::<16>(bf16_round8(b)),
        );
        // packus interleaves the two by 128-bit lane: a0 b0 a1 b1 -> a0 a1 b0 b1.
        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(ra, rb))
    }
}

/// Stores `lo` then `hi` (one 64-byte line) at `p`, streaming with `STREAM`
/// when aligned.
#[inline(always)]
unsafe fn put_line2<const STREAM: bool>(p: *mut __m256i, lo: __m256i, hi: __m256i) {
    // SAFETY: called with 64 writable bytes at p; AVX present.
    unsafe {
        if STREAM && (p as usize).is_multiple_of(64) {
            _mm256_stream_si256(p, lo);
            _mm256_stream_si256(p.add(1), hi);
        } else {
            _mm256_storeu_si256(p, lo);
            _mm256_storeu_si256(p.add(1), hi);
        }
    }
}

/// `Lanes::pow2i` on eight lanes: cvtt gives 0x80000000 for NaN and out of
/// range; the mask keeps the exponent field.
///
/// # Safety
/// AVX2 present.
#[inline(always)]
unsafe fn pow2i8(v: __m256) -> __m256 {
    // SAFETY: AVX2 present (this function's contract).
    unsafe {
        let k = _mm256_add_epi32(_mm256_cvttps_epi32(v), _mm256_set1_epi32(127));
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_and_si256(
            k,
            _mm256_set1_epi32(0xff),
        )))
    }
}

impl Lanes for Avx2 {
    const ISA: Isa = Isa::Avx2;
    const STREAMS: bool = true;

    fn detect() -> bool {
        levels() & AVX2 != 0
    }

    #[inline(always)]
    unsafe fn enter<R>(f: impl FnOnce() -> R) -> R {
        // SAFETY: the caller guarantees the CPU has AVX2, FMA and F16C.
        super::with_default_modes(|| unsafe { in_avx2(f) })
    }
    const FLUSHING_FMA: bool = true;
    #[inline(always)]
    unsafe fn enter_flushing<R>(f: impl FnOnce() -> R) -> R {
        // SAFETY: as `enter`.
        super::with_flush_to_zero(|| unsafe { in_avx2(f) })
    }
    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: Avx2 values exist only on CPUs with AVX2 (dispatch_isa!).
        unsafe { Avx2(_mm256_set1_ps(x), _mm256_set1_ps(x)) }
    }
    #[inline(always)]
    fn load(src: &[f32; GROUP]) -> Self {
        // SAFETY: 16 readable f32; AVX2 present (see splat).
        unsafe {
            Avx2(
                _mm256_loadu_ps(src.as_ptr()),
                _mm256_loadu_ps(src.as_ptr().add(8)),
            )
        }
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32; GROUP]) {
        // SAFETY: 16 writable f32; AVX2 present.
        unsafe {
            _mm256_storeu_ps(dst.as_mut_ptr(), self.0);
            _mm256_storeu_ps(dst.as_mut_ptr().add(8), self.1);
        }
    }
    #[inline(always)]
    fn load_bf16(src: &[bf16; GROUP]) -> Self {
        // SAFETY: 32 readable bytes; AVX2 present.
        unsafe {
            let p = src.as_ptr() as *const __m128i;
            let w =
                |h: __m128i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)));
            Avx2(w(_mm_loadu_si128(p)), w(_mm_loadu_si128(p.add(1))))
        }
    }
    #[inline(always)]
    fn store_bf16(self, dst: &mut [bf16; GROUP]) {
        // SAFETY: 32 writable bytes; AVX2 present.
        unsafe {
            _mm256_storeu_si256(
                dst.as_mut_ptr() as *mut __m256i,
                bf16_bits8x2(self.0, self.1),
            );
        }
    }
    #[inline(always)]
    fn hash16(lo: u32, k: u32) -> [u32; GROUP] {
        // SAFETY: AVX2 present; 64 writable bytes.
        unsafe {
            // Inline fns, not closures: LLVM kept a closure called twice
            // out of line, outside the AVX2 context (a call per intrinsic).
            #[inline(always)]
            unsafe fn mix(mut x: __m256i) -> __m256i {
                // SAFETY: AVX2 present (the caller's); register arithmetic.
                unsafe {
                    x = _mm256_xor_si256(x, _mm256_srli_epi32::<16>(x));
                    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb_352d));
                    x = _mm256_xor_si256(x, _mm256_srli_epi32::<15>(x));
                    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x846c_a68bu32 as i32));
                    _mm256_xor_si256(x, _mm256_srli_epi32::<16>(x))
                }
            }
            let base = _mm256_add_epi32(
                _mm256_set1_epi32(lo as i32),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            );
            let kv = _mm256_set1_epi32(k as i32);
            let a = mix(_mm256_xor_si256(base, kv));
            let b = mix(_mm256_xor_si256(
                _mm256_add_epi32(base, _mm256_set1_epi32(8)),
                kv,
            ));
            let mut r = [0u32; GROUP];
            _mm256_storeu_si256(r.as_mut_ptr() as *mut __m256i, a);
            _mm256_storeu_si256(r.as_mut_ptr().add(8) as *mut __m256i, b);
            r
        }
    }
    #[inline(always)]
    fn store_bf16_sr<const SHIFT: u32>(self, dst: &mut [bf16; GROUP], r: &[u32; GROUP]) {
        // SAFETY: 64 readable and 32 writable bytes; AVX2 present.
        unsafe {
            // An inline fn, not a closure (see `hash16`).
            #[inline(always)]
            unsafe fn half(v: __m256, rp: *const u32, shift: u32) -> __m256i {
                // SAFETY: AVX2 present (the caller's); 32 readable bytes at rp.
                unsafe {
                    let b = _mm256_castps_si256(v);
                    let rv = _mm256_loadu_si256(rp as *const __m256i);
                    let rv = _mm256_and_si256(
                        _mm256_srl_epi32(rv, _mm_cvtsi32_si128(shift as i32)),
                        _mm256_set1_epi32(0xffff),
                    );
                    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, rv));
                    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
                    let quiet =
                        _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
                    _mm256_blendv_epi8(rounded, quiet, nan)
                }
            }
            let (a, b) = (
                half(self.0, r.as_ptr(), SHIFT),
                half(self.1, r.as_ptr().add(8), SHIFT),
            );
            // Both halves hold values < 2^16: packus keeps them; it packs per
            // 128-bit lane, so the quadwords go back in order.
            let packed = _mm256_permute4x64_epi64::<0xd8>(_mm256_packus_epi32(a, b));
            _mm256_storeu_si256(dst.as_mut_ptr() as *mut __m256i, packed);
        }
    }
    #[inline(always)]
    fn transpose16(rows: &[Self; GROUP]) -> [Self; GROUP] {
        // Four 8 x 8 transposes: out[j]'s low half is column j of the
        // rows 0..8 block, its high half of rows 8..16 (j < 8: the rows'
        // low halves; else their high halves).
        // SAFETY: AVX2 present; shuffles only.
        unsafe {
            // An inline(always) fn, not a closure: LLVM kept the closure
            // out of line, outside the AVX context, and every shuffle
            // became a call (the x W^T pack was 40% of a matmul on Zen 5).
            #[inline(always)]
            unsafe fn t8(r: [__m256; 8]) -> [__m256; 8] {
                // SAFETY: AVX present (the caller's); shuffles only.
                unsafe {
                    let t: [__m256; 8] = core::array::from_fn(|i| {
                        let (a, b) = (r[i & !1], r[i | 1]);
                        if i % 2 == 0 {
                            _mm256_unpacklo_ps(a, b)
                        } else {
                            _mm256_unpackhi_ps(a, b)
                        }
                    });
                    // u[4h + c]: per 128-bit lane q, rows 4h..4h+4 of column 4q + c.
                    let u: [__m256; 8] = core::array::from_fn(|i| {
                        let (h, c) = (i / 4, i % 4);
                        let (a, b) = (
                            _mm256_castps_pd(t[4 * h + (c >> 1)]),
                            _mm256_castps_pd(t[4 * h + 2 + (c >> 1)]),
                        );
                        _mm256_castpd_ps(if c % 2 == 0 {
                            _mm256_unpacklo_pd(a, b)
                        } else {
                            _mm256_unpackhi_pd(a, b)
                        })
                    });
                    core::array::from_fn(|j| {
                        let (q, c) = (j / 4, j % 4);
                        if q == 0 {
                            _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c])
                        } else {
                            _mm256_permute2f128_ps::<0x31>(u[c], u[4 + c])
                        }
                    })
                }
            }
            let lo_top = t8(core::array::from_fn(|i| rows[i].0));
            let lo_bot = t8(core::array::from_fn(|i| rows[8 + i].0));
            let hi_top = t8(core::array::from_fn(|i| rows[i].1));
            let hi_bot = t8(core::array::from_fn(|i| rows[8 + i].1));
            core::array::from_fn(|j| {
                if j < 8 {
                    Avx2(lo_top[j], lo_bot[j])
                } else {
                    Avx2(hi_top[j - 8], hi_bot[j - 8])
                }
            })
        }
    }
    #[inline(always)]
    fn stream(self, dst: &mut [f32; GROUP]) {
        if !aligned(dst, 32) {
            return self.store(dst);
        }
        // SAFETY: 16 writable f32, 32-byte aligned; AVX present.
        unsafe {
            _mm256_stream_ps(dst.as_mut_ptr(), self.0);
            _mm256_stream_ps(dst.as_mut_ptr().add(8), self.1);
        }
    }
    #[inline(always)]
    fn put2_bf16<const STREAM: bool>(self, hi: Self, dst: &mut [bf16; 2 * GROUP]) {
        // SAFETY: 64 writable bytes; streamed only when 64-byte aligned; AVX2 present.
        unsafe {
            put_line2::<STREAM>(
                dst.as_mut_ptr() as *mut __m256i,
                bf16_bits8x2(self.0, self.1),
                bf16_bits8x2(hi.0, hi.1),
            );
        }
    }
    #[inline(always)]
    fn load_f16(src: &[f16; GROUP]) -> Self {
        // SAFETY: 32 readable bytes; F16C present.
        unsafe {
            let p = src.as_ptr() as *const __m128i;
            Avx2(
                _mm256_cvtph_ps(_mm_loadu_si128(p)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
            )
        }
    }
    #[inline(always)]
    fn round_bf16(self) -> Self {
        // SAFETY: AVX2 present.
        unsafe {
            let w = |h: __m256| {
                _mm256_castsi256_ps(_mm256_and_si256(
                    bf16_round8(h),
                    _mm256_set1_epi32(-0x1_0000),
                ))
            };
            Avx2(w(self.0), w(self.1))
        }
    }
    #[inline(always)]
    fn round_f16(self) -> Self {
        // SAFETY: F16C present. Round to nearest even.
        unsafe {
            let w = |h: __m256| _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(h));
            Avx2(w(self.0), w(self.1))
        }
    }
    #[inline(always)]
    fn store_f16(self, dst: &mut [f16; GROUP]) {
        // SAFETY: 32 writable bytes; F16C present. Round to nearest even.
        unsafe {
            let p = dst.as_mut_ptr() as *mut __m128i;
            _mm_storeu_si128(p, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.0));
            _mm_storeu_si128(
                p.add(1),
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.1),
            );
        }
    }
    #[inline(always)]
    fn put2_f16<const STREAM: bool>(self, hi: Self, dst: &mut [f16; 2 * GROUP]) {
        // SAFETY: 64 writable bytes; streamed only when 64-byte aligned; F16C present.
        unsafe {
            let p = dst.as_mut_ptr() as *mut __m128i;
            let v = [
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.0),
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.1),
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(hi.0),
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(hi.1),
            ];
            put_line4::<STREAM>(p, v);
        }
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        // SAFETY: AVX present.
        unsafe { Avx2(_mm256_add_ps(self.0, o.0), _mm256_add_ps(self.1, o.1)) }
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        // SAFETY: AVX present.
        unsafe { Avx2(_mm256_sub_ps(self.0, o.0), _mm256_sub_ps(self.1, o.1)) }
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        // SAFETY: AVX present.
        unsafe { Avx2(_mm256_mul_ps(self.0, o.0), _mm256_mul_ps(self.1, o.1)) }
    }
    #[inline(always)]
    fn div(self, o: Self) -> Self {
        // SAFETY: AVX present.
        unsafe { Avx2(_mm256_div_ps(self.0, o.0), _mm256_div_ps(self.1, o.1)) }
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        // SAFETY: AVX present.
        unsafe { Avx2(_mm256_sqrt_ps(self.0), _mm256_sqrt_ps(self.1)) }
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        // SAFETY: FMA present (this level's context enables it).
        unsafe {
            Avx2(
                _mm256_fmadd_ps(self.0, b.0, c.0),
                _mm256_fmadd_ps(self.1, b.1, c.1),
            )
        }
    }
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        // SAFETY: AVX present.
        unsafe { Avx2(_mm256_min_ps(self.0, o.0), _mm256_min_ps(self.1, o.1)) }
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        // SAFETY: AVX present.
        unsafe { Avx2(_mm256_max_ps(self.0, o.0), _mm256_max_ps(self.1, o.1)) }
    }
    #[inline(always)]
    fn fold(self) -> f32 {
        let mut s = [0f32; 8];
        // SAFETY: 8 writable f32; AVX present.
        unsafe { _mm256_storeu_ps(s.as_mut_ptr(), _mm256_add_ps(self.0, self.1)) };
        fold8(s)
    }
    #[inline(always)]
    fn add_squares_f64(self, sums: &mut [f64; GROUP]) {
        // SAFETY: 16 readable and writable f64; AVX present. Separate
        // multiply and add, as the trait's form.
        unsafe {
            let halves = [
                _mm256_castps256_ps128(self.0),
                _mm256_extractf128_ps::<1>(self.0),
                _mm256_castps256_ps128(self.1),
                _mm256_extractf128_ps::<1>(self.1),
            ];
            for (q, h) in halves.into_iter().enumerate() {
                let d = _mm256_cvtps_pd(h);
                let at = sums.as_mut_ptr().add(4 * q);
                _mm256_storeu_pd(at, _mm256_add_pd(_mm256_loadu_pd(at), _mm256_mul_pd(d, d)));
            }
        }
    }
    #[inline(always)]
    fn select_lt(self, o: Self, a: Self, b: Self) -> Self {
        // SAFETY: AVX present.
        unsafe {
            let m0 = _mm256_cmp_ps::<_CMP_LT_OQ>(self.0, o.0);
            let m1 = _mm256_cmp_ps::<_CMP_LT_OQ>(self.1, o.1);
            Avx2(
                _mm256_blendv_ps(b.0, a.0, m0),
                _mm256_blendv_ps(b.1, a.1, m1),
            )
        }
    }
    #[inline(always)]
    fn pow2i(self) -> Self {
        // SAFETY: AVX2 present.
        unsafe { Avx2(pow2i8(self.0), pow2i8(self.1)) }
    }
    #[inline(always)]
    fn clamp(self, lo: Self, hi: Self) -> Self {
        // max(lo, v) is `lo > v ? lo : v` and min(hi, v) is `hi < v ? hi :
        // v`: a NaN v falls through both, as in the trait's selects.
        // SAFETY: AVX present.
        unsafe {
            let c = |v, l, h| _mm256_min_ps(h, _mm256_max_ps(l, v));
            Avx2(c(self.0, lo.0, hi.0), c(self.1, lo.1, hi.1))
        }
    }
    #[inline(always)]
    fn at_least(self, lo: Self) -> Self {
        // As `clamp`: max's second operand is what a NaN lane yields.
        // SAFETY: AVX present.
        unsafe { Avx2(_mm256_max_ps(lo.0, self.0), _mm256_max_ps(lo.1, self.1)) }
    }
}

impl<const HW_BF16: bool> Avx512Lanes<HW_BF16> {
    /// `f` inside this level's `#[target_feature]` function.
    ///
    /// # Safety
    /// The CPU has the level's features (`Lanes::enter`'s contract).
    #[inline(always)]
    unsafe fn context<R>(f: impl FnOnce() -> R) -> R {
        // SAFETY: the caller's.
        unsafe {
            if HW_BF16 {
                hw::in_avx512bf16(f)
            } else {
                in_avx512(f)
            }
        }
    }
}

impl<const HW_BF16: bool> Lanes for Avx512Lanes<HW_BF16> {
    const ISA: Isa = if HW_BF16 {
        Isa::Avx512Bf16
    } else {
        Isa::Avx512
    };
    const STREAMS: bool = true;

    fn detect() -> bool {
        levels() & if HW_BF16 { AVX512BF16 } else { AVX512 } != 0
    }

    #[inline(always)]
    unsafe fn enter<R>(f: impl FnOnce() -> R) -> R {
        // SAFETY: the caller guarantees the CPU has AVX-512F/BW, AVX2, FMA,
        // F16C (and AVX512-BF16, DQ, VL for the BF16 level).
        super::with_default_modes(|| unsafe { Self::context(f) })
    }
    const FLUSHING_FMA: bool = true;
    #[inline(always)]
    unsafe fn enter_flushing<R>(f: impl FnOnce() -> R) -> R {
        // SAFETY: as `enter`.
        super::with_flush_to_zero(|| unsafe { Self::context(f) })
    }
    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: Avx512Lanes values exist only on CPUs with AVX-512F (dispatch_isa!).
        unsafe { Self(_mm512_set1_ps(x)) }
    }
    #[inline(always)]
    fn load(src: &[f32; GROUP]) -> Self {
        // SAFETY: 16 readable f32; AVX-512F present.
        unsafe { Self(_mm512_loadu_ps(src.as_ptr())) }
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32; GROUP]) {
        // SAFETY: 16 writable f32; AVX-512F present.
        unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), self.0) }
    }
    #[inline(always)]
    fn load_bf16(src: &[bf16; GROUP]) -> Self {
        // SAFETY: 32 readable bytes; AVX-512F present.
        unsafe {
            let h = _mm256_loadu_si256(src.as_ptr() as *const __m256i);
            Self(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                _mm512_cvtepu16_epi32(h),
            )))
        }
    }
    #[inline(always)]
    fn store_bf16(self, dst: &mut [bf16; GROUP]) {
        // SAFETY: 32 writable bytes; AVX-512F/BW present.
        unsafe { _mm256_storeu_si256(dst.as_mut_ptr() as *mut __m256i, bits16::<HW_BF16>(self.0)) }
    }
    #[inline(always)]
    fn hash16(lo: u32, k: u32) -> [u32; GROUP] {
        // SAFETY: AVX-512F present; 64 writable bytes.
        unsafe {
            let j = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let mut x = _mm512_xor_si512(
                _mm512_add_epi32(_mm512_set1_epi32(lo as i32), j),
                _mm512_set1_epi32(k as i32),
            );
            x = _mm512_xor_si512(x, _mm512_srli_epi32::<16>(x));
            x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb_352d));
            x = _mm512_xor_si512(x, _mm512_srli_epi32::<15>(x));
            x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x846c_a68bu32 as i32));
            x = _mm512_xor_si512(x, _mm512_srli_epi32::<16>(x));
            let mut r = [0u32; GROUP];
            _mm512_storeu_si512(r.as_mut_ptr() as *mut __m512i, x);
            r
        }
    }
    #[inline(always)]
    fn store_bf16_sr<const SHIFT: u32>(self, dst: &mut [bf16; GROUP], r: &[u32; GROUP]) {
        // SAFETY: 64 readable and 32 writable bytes; AVX-512F/BW present.
        unsafe {
            let b = _mm512_castps_si512(self.0);
            let rv = _mm512_loadu_si512(r.as_ptr() as *const __m512i);
            let rv = _mm512_and_si512(_mm512_srli_epi32::<SHIFT>(rv), _mm512_set1_epi32(0xffff));
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, rv));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(self.0, self.0);
            let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
            let out = _mm512_mask_mov_epi32(rounded, nan, quiet);
            _mm256_storeu_si256(dst.as_mut_ptr() as *mut __m256i, _mm512_cvtepi32_epi16(out));
        }
    }
    #[inline(always)]
    fn transpose16(rows: &[Self; GROUP]) -> [Self; GROUP] {
        // SAFETY: AVX-512F present; shuffles only.
        unsafe {
            let r: [__m512; GROUP] = core::array::from_fn(|i| rows[i].0);
            // t[2i], t[2i + 1]: rows 2i, 2i + 1 interleaved (columns 4q, 4q + 1
            // and 4q + 2, 4q + 3 of each 128-bit lane q).
            let t: [__m512; GROUP] = core::array::from_fn(|i| {
                let (a, b) = (r[i & !1], r[i | 1]);
                if i % 2 == 0 {
                    _mm512_unpacklo_ps(a, b)
                } else {
                    _mm512_unpackhi_ps(a, b)
                }
            });
            // u[4h + c]: per 128-bit lane q, rows 4h..4h+4 of column 4q + c.
            let u: [__m512d; GROUP] = core::array::from_fn(|i| {
                let (h, c) = (i / 4, i % 4);
                let (a, b) = (
                    _mm512_castps_pd(t[4 * h + (c >> 1)]),
                    _mm512_castps_pd(t[4 * h + 2 + (c >> 1)]),
                );
                if c % 2 == 0 {
                    _mm512_unpacklo_pd(a, b)
                } else {
                    _mm512_unpackhi_pd(a, b)
                }
            });
            let u: [__m512; GROUP] = core::array::from_fn(|i| _mm512_castpd_ps(u[i]));
            // out[4q + c] = lane q of u[c], u[4 + c], u[8 + c], u[12 + c].
            let mut out = [Self(_mm512_setzero_ps()); GROUP];
            for c in 0..4 {
                let v0 = _mm512_shuffle_f32x4::<0x44>(u[c], u[4 + c]);
                let v1 = _mm512_shuffle_f32x4::<0xee>(u[c], u[4 + c]);
                let v2 = _mm512_shuffle_f32x4::<0x44>(u[8 + c], u[12 + c]);
                let v3 = _mm512_shuffle_f32x4::<0xee>(u[8 + c], u[12 + c]);
                out[c] = Self(_mm512_shuffle_f32x4::<0x88>(v0, v2));
                out[4 + c] = Self(_mm512_shuffle_f32x4::<0xdd>(v0, v2));
                out[8 + c] = Self(_mm512_shuffle_f32x4::<0x88>(v1, v3));
                out[12 + c] = Self(_mm512_shuffle_f32x4::<0xdd>(v1, v3));
            }
            out
        }
    }
    #[inline(always)]
    fn put2_bf16<const STREAM: bool>(self, hi: Self, dst: &mut [bf16; 2 * GROUP]) {
        // SAFETY: 64 writable bytes; AVX-512F/BW present.
        unsafe {
            let p = dst.as_mut_ptr() as *mut __m512i;
            if HW_BF16 {
                put_zmm::<STREAM>(p, hw::bits32(self.0, hi.0))
            } else {
                put_line::<STREAM>(p, bf16_bits16(self.0), bf16_bits16(hi.0))
            }
        }
    }
    #[inline(always)]
    fn stream(self, dst: &mut [f32; GROUP]) {
        if !aligned(dst, 64) {
            return self.store(dst);
        }
        // SAFETY: 16 writable f32, 64-byte aligned; AVX-512F present.
        unsafe { _mm512_stream_ps(dst.as_mut_ptr(), self.0) }
    }
    const BF16_LINE_IN_ORDER: bool = false;
    #[inline(always)]
    fn load_line_bf16(src: &[bf16; 2 * GROUP]) -> (Self, Self) {
        // SAFETY: 64 readable bytes; AVX-512F present.
        unsafe { widen_line(_mm512_loadu_si512(src.as_ptr() as *const __m512i)) }
    }
    #[inline(always)]
    fn put_line_bf16<const STREAM: bool>(lo: Self, hi: Self, dst: &mut [bf16; 2 * GROUP]) {
        // SAFETY: 64 writable bytes; AVX-512F/BW (and BF16 on its level) present.
        unsafe {
            put_zmm::<STREAM>(
                dst.as_mut_ptr() as *mut __m512i,
                line_bits::<HW_BF16>(lo.0, hi.0),
            )
        }
    }
    #[inline(always)]
    fn round_line_bf16<const STREAM: bool>(
        lo: Self,
        hi: Self,
        dst: Option<&mut [bf16; 2 * GROUP]>,
    ) -> (Self, Self) {
        // SAFETY: AVX-512F/BW (and BF16 on its level) present; 64 writable
        // bytes at dst. The line's words are the rounded values in memory
        // order, widened as `load_line_bf16` widens a loaded line.
        unsafe {
            let v = line_bits::<HW_BF16>(lo.0, hi.0);
            if let Some(d) = dst {
                put_zmm::<STREAM>(d.as_mut_ptr() as *mut __m512i, v);
            }
            widen_line(v)
        }
    }
    #[inline(always)]
    fn load_f16(src: &[f16; GROUP]) -> Self {
        // SAFETY: 32 readable bytes; AVX-512F present.
        unsafe {
            Self(_mm512_cvtph_ps(_mm256_loadu_si256(
                src.as_ptr() as *const __m256i
            )))
        }
    }
    #[inline(always)]
    fn round_bf16(self) -> Self {
        // SAFETY: AVX-512F/BW present.
        unsafe {
            if HW_BF16 {
                return Self(hw::round16(self.0));
            }
            let r = _mm512_and_si512(bf16_round16(self.0), _mm512_set1_epi32(-0x1_0000));
            Self(_mm512_castsi512_ps(r))
        }
    }
    #[inline(always)]
    fn round_f16(self) -> Self {
        // SAFETY: AVX-512F present. Round to nearest even.
        unsafe {
            Self(_mm512_cvtph_ps(
                _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.0),
            ))
        }
    }
    #[inline(always)]
    fn store_f16(self, dst: &mut [f16; GROUP]) {
        // SAFETY: 32 writable bytes; AVX-512F present. Round to nearest even.
        unsafe {
            let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.0);
            _mm256_storeu_si256(dst.as_mut_ptr() as *mut __m256i, h)
        }
    }
    #[inline(always)]
    fn put2_f16<const STREAM: bool>(self, hi: Self, dst: &mut [f16; 2 * GROUP]) {
        // SAFETY: 64 writable bytes; AVX-512F present. Round to nearest even.
        unsafe {
            let lo = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.0);
            let hi = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(hi.0);
            put_line::<STREAM>(dst.as_mut_ptr() as *mut __m512i, lo, hi)
        }
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        // SAFETY: AVX-512F present.
        unsafe { Self(_mm512_add_ps(self.0, o.0)) }
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        // SAFETY: AVX-512F present.
        unsafe { Self(_mm512_sub_ps(self.0, o.0)) }
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        // SAFETY: AVX-512F present.
        unsafe { Self(_mm512_mul_ps(self.0, o.0)) }
    }
    #[inline(always)]
    fn div(self, o: Self) -> Self {
        // SAFETY: AVX-512F present.
        unsafe { Self(_mm512_div_ps(self.0, o.0)) }
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        // SAFETY: AVX-512F present.
        unsafe { Self(_mm512_sqrt_ps(self.0)) }
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        // SAFETY: AVX-512F present.
        unsafe { Self(_mm512_fmadd_ps(self.0, b.0, c.0)) }
    }
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        // SAFETY: AVX-512F present.
        unsafe { Self(_mm512_min_ps(self.0, o.0)) }
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        // SAFETY: AVX-512F present.
        unsafe { Self(_mm512_max_ps(self.0, o.0)) }
    }
    #[inline(always)]
    fn fold(self) -> f32 {
        let mut s = [0f32; 8];
        // SAFETY: 8 writable f32; AVX-512F present.
        unsafe {
            let lo = _mm512_castps512_ps256(self.0);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0)));
            _mm256_storeu_ps(s.as_mut_ptr(), _mm256_add_ps(lo, hi));
        }
        fold8(s)
    }
    #[inline(always)]
    fn add_squares_f64(self, sums: &mut [f64; GROUP]) {
        // SAFETY: 16 readable and writable f64; AVX-512F present. Separate
        // multiply and add, as the trait's form.
        unsafe {
            let halves = [
                _mm512_castps512_ps256(self.0),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0))),
            ];
            for (q, h) in halves.into_iter().enumerate() {
                let d = _mm512_cvtps_pd(h);
                let at = sums.as_mut_ptr().add(8 * q);
                _mm512_storeu_pd(at, _mm512_add_pd(_mm512_loadu_pd(at), _mm512_mul_pd(d, d)));
            }
        }
    }
    #[inline(always)]
    fn select_lt(self, o: Self, a: Self, b: Self) -> Self {
        // SAFETY: AVX-512F present.
        unsafe {
            let m = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(self.0, o.0);
            Self(_mm512_mask_blend_ps(m, b.0, a.0))
        }
    }
    #[inline(always)]
    fn pow2i(self) -> Self {
        // SAFETY: AVX-512F present. cvtt gives 0x80000000 for NaN and out of
        // range; the mask keeps the exponent field.
        unsafe {
            let k = _mm512_add_epi32(_mm512_cvttps_epi32(self.0), _mm512_set1_epi32(127));
            Self(_mm512_castsi512_ps(_mm512_slli_epi32::<23>(
                _mm512_and_si512(k, _mm512_set1_epi32(0xff)),
            )))
        }
    }
    #[inline(always)]
    fn clamp(self, lo: Self, hi: Self) -> Self {
        // As Avx2's: the NaN rule of max/min (the second operand) keeps NaN.
        // SAFETY: AVX-512F present.
        unsafe { Self(_mm512_min_ps(hi.0, _mm512_max_ps(lo.0, self.0))) }
    }
    #[inline(always)]
    fn at_least(self, lo: Self) -> Self {
        // As `clamp`: max's second operand is what a NaN lane yields.
        // SAFETY: AVX-512F present.
        unsafe { Self(_mm512_max_ps(lo.0, self.0)) }
    }
    #[inline(always)]
    fn round_even(self) -> Self {
        // SAFETY: AVX-512F present. Nearest-even, exceptions suppressed.
        unsafe {
            Self(_mm512_roundscale_ps::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(self.0))
        }
    }
    #[inline(always)]
    fn ldexp(self, n: Self) -> Self {
        // SAFETY: AVX-512F present. self * 2^floor(n), rounded once under
        // the thread's MXCSR, as every other lane operation is (the host's
        // flush-to-zero, if set, changes subnormal results alike).
        unsafe { Self(_mm512_scalef_ps(self.0, n.0)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::bf16_bits_rne;
    use crate::lanes::tests::line_perm;

    /// Both AVX-512 levels' even/odd `put_line_bf16` on every f32 bit
    /// pattern, against `bf16_bits_rne` (the streaming store and
    /// `load_line_bf16`, pure data movement, are checked on specials and
    /// random lines in `lanes::tests`). About 2^27 lines: seconds in release;
    /// skipped in debug builds.
    #[test]
    #[cfg_attr(debug_assertions, ignore = "2^32 inputs: run with --release")]
    fn avx512_line_store_equals_the_definition_on_all_2_pow_32_inputs() {
        // Inlined into `enter`'s target features: out of line, every lane
        // operation was a call (27 s of the unit tests; now about 2).
        #[inline(always)]
        fn all<L: Lanes>() -> u64 {
            let perm = line_perm::<L>();
            let mut out = [bf16::ZERO; 2 * GROUP];
            let mut bad = 0u64;
            for base in (0..=u32::MAX).step_by(2 * GROUP) {
                let lane = |k: usize| f32::from_bits(base + perm[k] as u32);
                let lo: [f32; GROUP] = core::array::from_fn(lane);
                let hi: [f32; GROUP] = core::array::from_fn(|k| lane(GROUP + k));
                L::put_line_bf16::<false>(L::load(&lo), L::load(&hi), &mut out);
                for (i, o) in out.iter().enumerate() {
                    bad += u64::from(o.to_bits() != bf16_bits_rne(base + i as u32));
                }
            }
            bad
        }
        for isa in [Isa::Avx512, Isa::Avx512Bf16] {
            if !isa.is_available() {
                eprintln!("no {isa:?} on this CPU: its line store was not checked");
                continue;
            }
            // SAFETY: the level is available.
            let bad = unsafe {
                match isa {
                    Isa::Avx512 => Avx512::enter(all::<Avx512>),
                    _ => Avx512Bf16::enter(all::<Avx512Bf16>),
                }
            };
            eprintln!("{isa:?}: all 2^32 inputs checked, {bad} differ");
            assert_eq!(bad, 0, "{isa:?}: elements differing from bf16_bits_rne");
        }
    }
}
