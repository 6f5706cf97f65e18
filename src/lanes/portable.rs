//! Portable lanes on `wide::f32x8` (SSE2 on x86_64, NEON on aarch64, scalar
//! elsewhere): two 8-lane vectors make the 16 logical lanes.

use half::{bf16, f16};
use wide::{f32x8, i16x8, i32x8, u16x8};

use super::{Isa, Lanes, GROUP};

/// Lanes 0..8 in `.0`, lanes 8..16 in `.1`.
#[derive(Clone, Copy, Debug)]
pub struct Portable(f32x8, f32x8);

#[inline(always)]
fn half8(a: &[f32; GROUP], hi: bool) -> f32x8 {
    let (l, h) = a.split_at(8);
    let s = if hi { h } else { l };
    f32x8::from(s)
}

/// Eight bf16 bit patterns to f32: zero-extend and shift into the high half.
#[inline(always)]
fn widen8(bits: &[u16]) -> f32x8 {
    let v = i32x8::from_u16x8(u16x8::from(bits));
    bytemuck::cast(v << 16u32)
}

/// Eight f32 to bf16 bits, exactly `dtype::bf16_bits_rne` lane-wise: round to
/// nearest even by adding 0x7fff plus the kept lsb; NaN keeps its sign and
/// becomes quiet.
#[inline(always)]
fn narrow8(v: f32x8) -> [u16; 8] {
    let x: i32x8 = bytemuck::cast(v);
    let abs = x & i32x8::splat(0x7fff_ffff);
    let nan = abs.simd_gt(i32x8::splat(0x7f80_0000));
    let rounded = (x + i32x8::splat(0x7fff) + ((x >> 16u32) & i32x8::splat(1))) >> 16u32;
    let quiet = (x >> 16u32) | i32x8::splat(0x0040);
    let r = (nan & quiet) | (!nan & rounded);
    // Only the low 16 bits of each lane matter; the arithmetic shifts above
    // leave them equal to the logical ones.
    bytemuck::cast(i16x8::from_i32x8_truncate(r))
}

impl Lanes for Portable {
    const ISA: Isa = Isa::Portable;
    const PIPELINED: bool = false;
    const OUTLINED: bool = true;

    fn detect() -> bool {
        true
    }

    #[inline(always)]
    unsafe fn enter<R>(f: impl FnOnce() -> R) -> R {
        super::with_default_modes(f)
    }

    #[inline(always)]
    fn splat(x: f32) -> Self {
        Portable(f32x8::splat(x), f32x8::splat(x))
    }
    #[inline(always)]
    fn load(src: &[f32; GROUP]) -> Self {
        Portable(half8(src, false), half8(src, true))
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32; GROUP]) {
        let (l, h) = dst.split_at_mut(8);
        l.copy_from_slice(self.0.as_array());
        h.copy_from_slice(self.1.as_array());
    }
    #[inline(always)]
    fn load_bf16(src: &[bf16; GROUP]) -> Self {
        let bits: &[u16; GROUP] = bytemuck::cast_ref(src);
        let (l, h) = bits.split_at(8);
        Portable(widen8(l), widen8(h))
    }
    // Called, not inlined: see `Lanes::OUTLINED`.
    #[inline(never)]
    fn store_bf16(self, dst: &mut [bf16; GROUP]) {
        let out: &mut [u16; GROUP] = bytemuck::cast_mut(dst);
        let (l, h) = out.split_at_mut(8);
        l.copy_from_slice(&narrow8(self.0));
        h.copy_from_slice(&narrow8(self.1));
    }
    // Called, not inlined: see `Lanes::OUTLINED`.
    #[inline(never)]
    fn load_f16(src: &[f16; GROUP]) -> Self {
        let mut a = [0f32; GROUP];
        for (o, v) in a.iter_mut().zip(src.iter()) {
            *o = v.to_f32();
        }
        Self::load(&a)
    }
    // Called, not inlined: see `Lanes::OUTLINED`.
    #[inline(never)]
    fn store_f16(self, dst: &mut [f16; GROUP]) {
        let mut a = [0f32; GROUP];
        self.store(&mut a);
        for (o, v) in dst.iter_mut().zip(a.iter()) {
            *o = f16::from_f32(*v);
        }
    }
    #[inline(always)]
    fn stream(self, dst: &mut [f32; GROUP]) {
        self.store(dst)
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        Portable(self.0 + o.0, self.1 + o.1)
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        Portable(self.0 - o.0, self.1 - o.1)
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        Portable(self.0 * o.0, self.1 * o.1)
    }
    #[inline(always)]
    fn div(self, o: Self) -> Self {
        Portable(self.0 / o.0, self.1 / o.1)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        Portable(self.0.sqrt(), self.1.sqrt())
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        // wide's mul_add is a multiply then an add without FMA hardware:
        // two roundings. The exact software form keeps one; where every CPU
        // of the build has FMA (aarch64: NEON is its baseline), the
        // instruction, the same one rounding (and a tenth of the work under
        // qemu-user, where the portable matmul was most of the tests' time).
        #[cfg(not(all(target_arch = "aarch64", target_feature = "neon")))]
        let f = |x: f32x8, y: f32x8, z: f32x8| {
            let (x, y, z) = (x.to_array(), y.to_array(), z.to_array());
            f32x8::from(core::array::from_fn::<f32, 8, _>(|i| {
                super::math::fma_f32(x[i], y[i], z[i])
            }))
        };
        #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
        let f = |x: f32x8, y: f32x8, z: f32x8| {
            use core::arch::aarch64::{vfmaq_f32, vld1q_f32, vst1q_f32};
            let (x, y, z) = (x.to_array(), y.to_array(), z.to_array());
            let mut r = [0f32; 8];
            for h in [0, 4] {
                // SAFETY: value-only NEON intrinsics (NEON is this build's
                // condition) on four f32 of 8-element arrays from `h` <= 4.
                unsafe {
                    let v = vfmaq_f32(
                        vld1q_f32(z.as_ptr().add(h)),
                        vld1q_f32(x.as_ptr().add(h)),
                        vld1q_f32(y.as_ptr().add(h)),
                    );
                    vst1q_f32(r.as_mut_ptr().add(h), v);
                }
            }
            f32x8::from(r)
        };
        Portable(f(self.0, b.0, c.0), f(self.1, b.1, c.1))
    }
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        Portable(self.0.fast_min(o.0), self.1.fast_min(o.1))
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        Portable(self.0.fast_max(o.0), self.1.fast_max(o.1))
    }
    #[inline(always)]
    fn fold(self) -> f32 {
        let s = (self.0 + self.1).to_array();
        let t = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
        let u = [t[0] + t[2], t[1] + t[3]];
        u[0] + u[1]
    }
    #[inline(always)]
    fn select_lt(self, o: Self, a: Self, b: Self) -> Self {
        Portable(
            self.0.simd_lt(o.0).select(a.0, b.0),
            self.1.simd_lt(o.1).select(a.1, b.1),
        )
    }
    #[inline(always)]
    fn pow2i(self) -> Self {
        // trunc_int maps NaN to 0; the mask keeps the exponent field.
        let e = |v: f32x8| -> f32x8 {
            bytemuck::cast(((v.trunc_int() + i32x8::splat(127)) & i32x8::splat(0xff)) << 23u32)
        };
        Portable(e(self.0), e(self.1))
    }
}
