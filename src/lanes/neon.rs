//! AArch64 lanes: Advanced SIMD (NEON, baseline on every AArch64 CPU), four
//! q registers making the 16 logical lanes, and a second level with
//! FEAT_BF16's `BFCVTN` for the bf16 rounding. The same IEEE operations, no
//! fused multiply-add and the same fold tree as the portable lanes, so every
//! output bit is the same; only the instruction count differs.
//!
//! - f16: `FCVTL` widens exactly; `FCVTN` rounds to nearest even, overflows
//!   to Inf and keeps NaN's sign and upper payload (quiet bit set) — the
//!   bits of `half::f16::from_f32`, proven on all 2^32 inputs below. AArch64
//!   SIMD keeps IEEE subnormals (unlike AArch32 NEON) under the default FPCR.
//! - The FPCR: every result assumes its default modes (round to nearest
//!   even, no flush-to-zero, no default NaN, IEEE half-precision). `enter`
//!   runs the block through `fp_env::with_default_modes`, which clears a
//!   host thread's FZ, FZ16, DN, AHP, RMode or FEAT_AFP's FIZ/AH/NEP for
//!   the block: the bits stay the library's even under a flush-to-zero
//!   host (so do the portable lanes').
//! - bf16: the integer round-to-nearest-even of `dtype::bf16_bits_rne`
//!   (six operations per four lanes); on the BF16 level `BFCVTN`/`BFCVTN2`
//!   do it in two instructions per eight lanes. Without FEAT_EBF16 the BF16
//!   instructions flush subnormal inputs, so a group whose input has a
//!   subnormal lane (rare: one compare and a horizontal max decide) takes
//!   the integer path instead; the exhaustive test below proves the level's
//!   bits equal to the definition on all 2^32 inputs.
//! - Stores are ordinary: AArch64's non-temporal `STNP` is only a hint whose
//!   effect differs per core, while the Cortex-A / Neoverse cores' write
//!   streaming mode already skips the read-for-ownership of whole lines
//!   written in sequence, which is what the kernels' row-ordered output
//!   does. `stream*` therefore store, and `stream_fence` has nothing to
//!   order.
//! - Prefetch: `PRFM PLDL2KEEP`, like x86's `prefetcht1`.
//!
//! The NEON intrinsics are `unsafe` to call outside a `#[target_feature]`
//! function even where NEON is the target's baseline, which it is for every
//! build of this module (`target_feature = "neon"`); the f16 and bf16
//! conversions are `asm!` (Rust's f16/bf16 NEON intrinsics are not stable).

use core::arch::aarch64::*;
use core::arch::asm;

use half::{bf16, f16};

use super::{Isa, Lanes, GROUP};

/// Lanes `4k..4k + 4` in `.0[k]`. `HW_BF16` rounds to bf16 with `BFCVTN`
/// (FEAT_BF16, detected at run time) instead of integer operations; the two
/// levels share every other operation.
#[derive(Clone, Copy, Debug)]
pub struct NeonLanes<const HW_BF16: bool>([float32x4_t; 4]);

/// Advanced SIMD lanes (every AArch64 CPU).
pub type Neon = NeonLanes<false>;
/// Advanced SIMD lanes with FEAT_BF16's `BFCVTN` for the bf16 rounding.
pub type NeonBf16 = NeonLanes<true>;

#[target_feature(enable = "bf16")]
fn in_bf16<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Four f32 to their bf16 bit patterns in the upper 16 bits of each lane,
/// exactly `dtype::bf16_bits_rne`: add 0x7fff plus the kept lsb; NaN keeps
/// its sign and upper payload and becomes quiet.
#[inline(always)]
fn bf16_rne4(v: float32x4_t) -> uint32x4_t {
    // SAFETY: value-only NEON intrinsics; NEON is this module's build condition
    // (`target_feature = "neon"`), so every AArch64 CPU it runs on has them.
    unsafe {
        let x = vreinterpretq_u32_f32(v);
        let lsb = vandq_u32(vshrq_n_u32::<16>(x), vdupq_n_u32(1));
        let rounded = vaddq_u32(x, vaddq_u32(lsb, vdupq_n_u32(0x7fff)));
        let quiet = vorrq_u32(x, vdupq_n_u32(0x0040_0000));
        // NaN is the one value unequal to itself.
        vbslq_u32(vceqq_f32(v, v), rounded, quiet)
    }
}

/// Eight f32 (`a` then `b`) to bf16 bits by the integer path.
#[inline(always)]
fn bf16_bits8_int(a: float32x4_t, b: float32x4_t) -> uint16x8_t {
    // SAFETY: value-only NEON intrinsics; NEON is this module's build condition
    // (`target_feature = "neon"`), so every AArch64 CPU it runs on has them.
    unsafe { vshrn_high_n_u32::<16>(vshrn_n_u32::<16>(bf16_rne4(a)), bf16_rne4(b)) }
}

/// All-ones in the lanes of `v` that are subnormal (exponent 0, fraction
/// not 0): `|x| - 1 < 0x007f_ffff` unsigned.
#[inline(always)]
fn subnormal4(v: float32x4_t) -> uint32x4_t {
    // SAFETY: value-only NEON intrinsics; NEON is this module's build condition
    // (`target_feature = "neon"`), so every AArch64 CPU it runs on has them.
    unsafe {
        let abs = vandq_u32(vreinterpretq_u32_f32(v), vdupq_n_u32(0x7fff_ffff));
        vcltq_u32(vsubq_u32(abs, vdupq_n_u32(1)), vdupq_n_u32(0x007f_ffff))
    }
}

/// `bf16_bits8_int`, by `BFCVTN` on the BF16 level.
#[inline(always)]
fn bf16_bits8<const HW_BF16: bool>(a: float32x4_t, b: float32x4_t) -> uint16x8_t {
    // SAFETY: value-only NEON intrinsics (NEON is this module's build condition).
    if !HW_BF16 || unsafe { vmaxvq_u32(vorrq_u32(subnormal4(a), subnormal4(b))) } != 0 {
        return bf16_bits8_int(a, b);
    }
    let r: uint16x8_t;
    // SAFETY: reached only on the BF16 level, whose lanes exist only where
    // FEAT_BF16 was detected (`enter` runs inside `in_bf16`); registers only.
    unsafe {
        asm!(
            ".arch_extension bf16",
            "bfcvtn {r:v}.4h, {a:v}.4s",
            "bfcvtn2 {r:v}.8h, {b:v}.4s",
            r = out(vreg) r,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    r
}

/// Eight bf16 bit patterns widened exactly: shifted into the upper half.
#[inline(always)]
fn bf16_widen8(h: uint16x8_t) -> [float32x4_t; 2] {
    // SAFETY: value-only NEON intrinsics; NEON is this module's build condition
    // (`target_feature = "neon"`), so every AArch64 CPU it runs on has them.
    unsafe {
        [
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h))),
            vreinterpretq_f32_u32(vshll_high_n_u16::<16>(h)),
        ]
    }
}

/// Eight f16 widened exactly (`FCVTL`, `FCVTL2`).
#[inline(always)]
fn f16_widen8(h: uint16x8_t) -> [float32x4_t; 2] {
    let (lo, hi): (float32x4_t, float32x4_t);
    // SAFETY: FCVTL/FCVTL2 are baseline AArch64 SIMD; registers only.
    unsafe {
        asm!(
            "fcvtl {lo:v}.4s, {h:v}.4h",
            "fcvtl2 {hi:v}.4s, {h:v}.8h",
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            h = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    [lo, hi]
}

/// Eight f32 (`a` then `b`) rounded to f16 (`FCVTN`, `FCVTN2`).
#[inline(always)]
fn f16_bits8(a: float32x4_t, b: float32x4_t) -> uint16x8_t {
    let r: uint16x8_t;
    // SAFETY: FCVTN/FCVTN2 are baseline AArch64 SIMD; registers only.
    unsafe {
        asm!(
            "fcvtn {r:v}.4h, {a:v}.4s",
            "fcvtn2 {r:v}.8h, {b:v}.4s",
            r = out(vreg) r,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    r
}

impl<const HW_BF16: bool> NeonLanes<HW_BF16> {
    /// Lane-wise `f` over the four registers.
    #[inline(always)]
    fn map(self, o: Self, f: impl Fn(float32x4_t, float32x4_t) -> float32x4_t) -> Self {
        let (a, b) = (self.0, o.0);
        NeonLanes([f(a[0], b[0]), f(a[1], b[1]), f(a[2], b[2]), f(a[3], b[3])])
    }

    /// Sixteen 16-bit patterns (two q registers) through `bits8`.
    #[inline(always)]
    fn pack(self, bits8: impl Fn(float32x4_t, float32x4_t) -> uint16x8_t) -> [uint16x8_t; 2] {
        let r = self.0;
        [bits8(r[0], r[1]), bits8(r[2], r[3])]
    }

    /// The lanes from sixteen 16-bit patterns through `widen8`.
    #[inline(always)]
    fn unpack(h: [uint16x8_t; 2], widen8: impl Fn(uint16x8_t) -> [float32x4_t; 2]) -> Self {
        let ([a, b], [c, d]) = (widen8(h[0]), widen8(h[1]));
        NeonLanes([a, b, c, d])
    }
}

/// Loads sixteen 16-bit patterns.
#[inline(always)]
fn load16(src: &[u16; GROUP]) -> [uint16x8_t; 2] {
    // SAFETY: `src` holds 16 readable u16.
    unsafe { [vld1q_u16(src.as_ptr()), vld1q_u16(src.as_ptr().add(8))] }
}

/// Stores sixteen 16-bit patterns.
#[inline(always)]
fn store16(h: [uint16x8_t; 2], dst: &mut [u16; GROUP]) {
    // SAFETY: `dst` holds 16 writable u16.
    unsafe {
        vst1q_u16(dst.as_mut_ptr(), h[0]);
        vst1q_u16(dst.as_mut_ptr().add(8), h[1]);
    }
}

impl<const HW_BF16: bool> Lanes for NeonLanes<HW_BF16> {
    const ISA: Isa = if HW_BF16 { Isa::NeonBf16 } else { Isa::Neon };

    fn detect() -> bool {
        if !HW_BF16 {
            return true; // Advanced SIMD is baseline on this target
        }
        // FEAT_BF16 is asked of the OS (HWCAP2); without std there is no
        // portable way to ask, so the level is not offered.
        #[cfg(feature = "std")]
        let bf16 = std::arch::is_aarch64_feature_detected!("bf16");
        #[cfg(not(feature = "std"))]
        let bf16 = false;
        bf16
    }

    #[inline(always)]
    unsafe fn enter<R>(f: impl FnOnce() -> R) -> R {
        if HW_BF16 {
            // SAFETY: the caller guarantees FEAT_BF16 (`detect` said yes).
            super::with_default_modes(|| unsafe { in_bf16(f) })
        } else {
            super::with_default_modes(f)
        }
    }

    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: value-only NEON intrinsic (NEON is this module's build condition).
        NeonLanes([unsafe { vdupq_n_f32(x) }; 4])
    }
    #[inline(always)]
    fn load(src: &[f32; GROUP]) -> Self {
        let p = src.as_ptr();
        // SAFETY: `src` holds 16 readable f32.
        unsafe {
            NeonLanes([
                vld1q_f32(p),
                vld1q_f32(p.add(4)),
                vld1q_f32(p.add(8)),
                vld1q_f32(p.add(12)),
            ])
        }
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32; GROUP]) {
        let p = dst.as_mut_ptr();
        // SAFETY: `dst` holds 16 writable f32.
        unsafe {
            vst1q_f32(p, self.0[0]);
            vst1q_f32(p.add(4), self.0[1]);
            vst1q_f32(p.add(8), self.0[2]);
            vst1q_f32(p.add(12), self.0[3]);
        }
    }
    #[inline(always)]
    fn load_bf16(src: &[bf16; GROUP]) -> Self {
        Self::unpack(load16(bytemuck::cast_ref(src)), bf16_widen8)
    }
    #[inline(always)]
    fn store_bf16(self, dst: &mut [bf16; GROUP]) {
        store16(self.pack(bf16_bits8::<HW_BF16>), bytemuck::cast_mut(dst));
    }
    #[inline(always)]
    fn load_f16(src: &[f16; GROUP]) -> Self {
        Self::unpack(load16(bytemuck::cast_ref(src)), f16_widen8)
    }
    #[inline(always)]
    fn store_f16(self, dst: &mut [f16; GROUP]) {
        store16(self.pack(f16_bits8), bytemuck::cast_mut(dst));
    }
    #[inline(always)]
    fn round_bf16(self) -> Self {
        if HW_BF16 {
            Self::unpack(self.pack(bf16_bits8::<true>), bf16_widen8)
        } else {
            // The rounded pattern with its low half cleared: no narrowing.
            // SAFETY: value-only NEON intrinsics (NEON is this module's build condition).
            let r = |v| unsafe {
                vreinterpretq_f32_u32(vandq_u32(bf16_rne4(v), vdupq_n_u32(0xffff_0000)))
            };
            NeonLanes(self.0.map(r))
        }
    }
    #[inline(always)]
    fn round_f16(self) -> Self {
        Self::unpack(self.pack(f16_bits8), f16_widen8)
    }
    #[inline(always)]
    fn stream(self, dst: &mut [f32; GROUP]) {
        self.store(dst)
    }
    #[inline(always)]
    fn prefetch(p: *const u8) {
        // SAFETY: PRFM is a hint: it never faults, whatever `p` is.
        unsafe {
            asm!("prfm pldl2keep, [{}]", in(reg) p, options(nostack, readonly, preserves_flags))
        };
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        // SAFETY: value-only NEON intrinsic (NEON is this module's build condition).
        self.map(o, |a, b| unsafe { vaddq_f32(a, b) })
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        // SAFETY: value-only NEON intrinsic (NEON is this module's build condition).
        self.map(o, |a, b| unsafe { vsubq_f32(a, b) })
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        // SAFETY: value-only NEON intrinsic (NEON is this module's build condition).
        self.map(o, |a, b| unsafe { vmulq_f32(a, b) })
    }
    #[inline(always)]
    fn div(self, o: Self) -> Self {
        // SAFETY: value-only NEON intrinsic (NEON is this module's build condition).
        self.map(o, |a, b| unsafe { vdivq_f32(a, b) })
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        // SAFETY: value-only NEON intrinsic (NEON is this module's build condition).
        NeonLanes(self.0.map(|v| unsafe { vsqrtq_f32(v) }))
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        let (a, b, c) = (self.0, b.0, c.0);
        // SAFETY: value-only NEON intrinsic (NEON is this module's build condition).
        NeonLanes(core::array::from_fn(|i| unsafe {
            vfmaq_f32(c[i], a[i], b[i])
        }))
    }
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        // SAFETY: value-only NEON intrinsic (NEON is this module's build condition).
        self.map(o, |a, b| unsafe { vminq_f32(a, b) })
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        // SAFETY: value-only NEON intrinsic (NEON is this module's build condition).
        self.map(o, |a, b| unsafe { vmaxq_f32(a, b) })
    }
    #[inline(always)]
    fn fold(self) -> f32 {
        // Portable's tree: lanes i + 8 onto i is r0 + r2 and r1 + r3; then
        // i + 4 onto i adds those two; then i + 2, then i + 1.
        let [r0, r1, r2, r3] = self.0;
        // SAFETY: value-only NEON intrinsics (NEON is this module's build condition).
        unsafe {
            let t = vaddq_f32(vaddq_f32(r0, r2), vaddq_f32(r1, r3));
            let u = vadd_f32(vget_low_f32(t), vget_high_f32(t));
            vget_lane_f32::<0>(u) + vget_lane_f32::<1>(u)
        }
    }
    #[inline(always)]
    fn select_lt(self, o: Self, a: Self, b: Self) -> Self {
        let (x, y, t, f) = (self.0, o.0, a.0, b.0);
        // SAFETY: value-only NEON intrinsics (NEON is this module's build condition).
        NeonLanes(core::array::from_fn(|i| unsafe {
            vbslq_f32(vcltq_f32(x[i], y[i]), t[i], f[i])
        }))
    }
    #[inline(always)]
    fn pow2i(self) -> Self {
        // FCVTZS gives 0 for NaN and saturates out of range; the mask keeps
        // the exponent field.
        // SAFETY: value-only NEON intrinsics (NEON is this module's build condition).
        NeonLanes(self.0.map(|v| unsafe {
            let k = vaddq_s32(vcvtq_s32_f32(v), vdupq_n_s32(127));
            vreinterpretq_f32_s32(vshlq_n_s32::<23>(vandq_s32(k, vdupq_n_s32(0xff))))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::bf16_bits_rne;

    /// Both levels' bf16 and f16 rounding (stored and in-register) and the
    /// exact widening back, on every f32 bit pattern, against the library's
    /// definitions (`bf16_bits_rne`, `half::f16::from_f32`). Ignored: 2^32
    /// inputs take minutes under qemu-user (README, "AArch64"):
    /// `scripts/cross.sh aarch64-exhaustive`.
    #[test]
    #[ignore = "2^32 inputs: scripts/cross.sh aarch64-exhaustive"]
    fn neon_conversions_equal_the_definitions_on_all_2_pow_32_inputs() {
        let mut bad = exhaustive::<Neon>();
        eprintln!("neon: checked, {bad} inputs differ");
        if Isa::NeonBf16.is_available() {
            // SAFETY: FEAT_BF16 was detected.
            let b = unsafe { NeonBf16::enter(exhaustive::<NeonBf16>) };
            eprintln!("neonbf16: checked, {b} inputs differ");
            bad += b;
        } else {
            eprintln!("no FEAT_BF16 here: the BFCVTN level was not checked");
        }
        assert_eq!(bad, 0, "inputs whose NEON conversion differs");
    }

    fn exhaustive<L: Lanes>() -> u64 {
        let mut bad = 0u64;
        let (mut b, mut h) = ([bf16::ZERO; GROUP], [f16::ZERO; GROUP]);
        let (mut rb, mut rh) = ([0f32; GROUP], [0f32; GROUP]);
        for base in (0..=u32::MAX).step_by(GROUP) {
            let x: [f32; GROUP] = core::array::from_fn(|i| f32::from_bits(base + i as u32));
            let v = L::load(&x);
            v.store_bf16(&mut b);
            v.store_f16(&mut h);
            v.round_bf16().store(&mut rb);
            v.round_f16().store(&mut rh);
            for i in 0..GROUP {
                let wb = bf16_bits_rne(x[i].to_bits());
                let wh = f16::from_f32(x[i]).to_bits();
                bad += u64::from(b[i].to_bits() != wb)
                    + u64::from(h[i].to_bits() != wh)
                    + u64::from(rb[i].to_bits() != u32::from(wb) << 16)
                    + u64::from(rh[i].to_bits() != f16::from_bits(wh).to_f32().to_bits());
            }
        }
        bad
    }
}
