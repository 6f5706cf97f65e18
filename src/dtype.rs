//! Element types: the run-time tag (`DType`, the C ABI's `npk_dtype`) and the
//! compile-time traits that tie a Rust type to its tag: `Element` (any of the
//! five) and `Float` (f32, f16, bf16: what the kernels compute on). Both are
//! sealed: only this crate implements them.

use half::{bf16, f16};

/// A tensor's element type. The numeric values are the C ABI's `npk_dtype`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// IEEE binary32.
    F32 = 0,
    /// IEEE binary16.
    F16 = 1,
    /// bfloat16 (the upper 16 bits of a binary32).
    BF16 = 2,
    /// Signed 32-bit integer (indices).
    I32 = 3,
    /// Signed 64-bit integer (indices).
    I64 = 4,
    /// Signed 16-bit integer (the low halves of AdamW's split masters; ABI 2.9).
    I16 = 5,
    /// Unsigned 8-bit integer (the codes of AdamW's 8-bit moments; ABI 2.9).
    U8 = 6,
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    /// True for the three floating-point types the kernels compute on.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Parses the C ABI's numeric value; `None` for anything else.
    pub const fn from_u32(v: u32) -> Option<DType> {
        match v {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            2 => Some(DType::BF16),
            3 => Some(DType::I32),
            4 => Some(DType::I64),
            5 => Some(DType::I16),
            6 => Some(DType::U8),
            _ => None,
        }
    }

    /// Lower-case name, as in error messages.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::I16 => "i16",
            DType::U8 => "u8",
        }
    }
}

impl core::fmt::Display for DType {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
    impl Sealed for i16 {}
    impl Sealed for u8 {}
}

/// A Rust type that is one of the C ABI's dtypes (`f32`, `f16`, `bf16`,
/// `i32`, `i64`, `i16`, `u8`). Sealed.
pub trait Element: sealed::Sealed + Copy + Send + Sync + bytemuck::Pod + 'static {
    /// The run-time tag of this type.
    const DTYPE: DType;
}

/// A floating-point element (`f32`, `f16`, `bf16`): the kernels widen it to
/// f32 exactly and round results back once, to nearest even. Sealed; its
/// SIMD load/store machinery is internal.
pub trait Float: Element + crate::lanes::LaneElem {
    /// Exact widening to f32.
    fn to_f32(self) -> f32;
    /// Round-to-nearest-even narrowing from f32; NaN stays NaN, overflow becomes ±Inf.
    fn from_f32(v: f32) -> Self;
    /// Exact widening to f64 (for the reference model).
    fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
    /// Correctly rounded narrowing from f64 (for the reference model).
    fn from_f64(v: f64) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i16 {
    const DTYPE: DType = DType::I16;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}

impl Float for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Float for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn from_f64(v: f64) -> Self {
        // half's own f64 -> f16 misrounds some near-ties; round to odd first.
        f16::from_f32(f64_to_f32_odd(v))
    }
}

impl Float for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_bits(bf16_bits_rne(v.to_bits()))
    }
    fn from_f64(v: f64) -> Self {
        <bf16 as Float>::from_f32(f64_to_f32_odd(v))
    }
}

/// f64 to f32 with round-to-odd: truncate, then set the last bit if inexact.
/// A second rounding of the result to any format of at most 22 bits of
/// precision (f16, bf16) is then the correct rounding of `v`.
pub(crate) fn f64_to_f32_odd(v: f64) -> f32 {
    if v.is_nan() {
        return v as f32;
    }
    let mut t = v as f32;
    if (t as f64).abs() > v.abs() {
        // Rounded away from zero: step back toward zero (also turns an
        // overflowed Inf into f32::MAX, which then rounds on as it should).
        t = f32::from_bits(t.to_bits() - 1);
    }
    if t as f64 != v {
        t = f32::from_bits(t.to_bits() | 1);
    }
    t
}

/// f32 bits to bf16 bits, round to nearest even, NaN kept quiet and signed.
/// The SIMD lanes implement exactly this function.
#[inline(always)]
pub(crate) const fn bf16_bits_rne(x: u32) -> u16 {
    if x & 0x7fff_ffff > 0x7f80_0000 {
        ((x >> 16) | 0x0040) as u16
    } else {
        let round = 0x7fff + ((x >> 16) & 1);
        ((x.wrapping_add(round)) >> 16) as u16
    }
}

/// Which floating-point types may be paired as (x dtype, gamma dtype): gamma is
/// x's dtype or f32.
pub(crate) fn gamma_dtype_ok(x: DType, gamma: DType) -> bool {
    x.is_float() && (gamma == x || gamma == DType::F32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f64_narrowing_is_correctly_rounded() {
        // f32 addition of two f16/bf16 values followed by RNE is correctly
        // rounded (24 >= 2 * 11 + 2), so it must agree with from_f64.
        for a in (0..=0x7bffu16).step_by(7) {
            for b in (0..=0xfbffu16).step_by(89) {
                let (x, y) = (f16::from_bits(a), f16::from_bits(b));
                let s32 = f16::from_f32(x.to_f32() + y.to_f32());
                let s64 = <f16 as Float>::from_f64(x.to_f64() + y.to_f64());
                assert_eq!(s32.to_bits(), s64.to_bits(), "{x} + {y}");
                let (x, y) = (bf16::from_bits(a), bf16::from_bits(b));
                let s32 = <bf16 as Float>::from_f32(x.to_f32() + y.to_f32());
                let s64 = <bf16 as Float>::from_f64(x.to_f64() + y.to_f64());
                assert_eq!(s32.to_bits(), s64.to_bits(), "{x} + {y}");
            }
        }
        assert!(<f16 as Float>::from_f64(1e300).is_infinite());
        assert!(<bf16 as Float>::from_f64(-1e300).is_infinite());
        assert_eq!(<f16 as Float>::from_f64(65519.99).to_f32(), 65504.0);
        assert!(<f16 as Float>::from_f64(65520.0).is_infinite());
    }

    #[test]
    fn bf16_rounding_matches_half() {
        let mut s = 0x1234_5678u32;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let v = f32::from_bits(s);
            let ours = <bf16 as Float>::from_f32(v);
            let theirs = bf16::from_f32(v);
            if v.is_nan() {
                assert!(ours.is_nan());
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{v:e}");
            }
        }
    }
}
