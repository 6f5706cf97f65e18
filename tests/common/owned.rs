//! Owned test tensors of the three float dtypes, for the list operators'
//! tests (grad_stats, adamw): views, values, bits.

use half::{bf16, f16};
use npukern::*;

use super::ulp_at;

/// An owned f32 / f16 / bf16 tensor (flat).
#[derive(Clone, Debug)]
pub enum Owned {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

/// Bitwise equality (NaN equals NaN).
impl PartialEq for Owned {
    fn eq(&self, o: &Owned) -> bool {
        self.dtype() == o.dtype() && self.bits() == o.bits()
    }
}

impl Owned {
    /// `v` rounded once to `dt` (f32 for any other dtype).
    pub fn from_f64(dt: DType, v: &[f64]) -> Owned {
        match dt {
            // The crate's correctly rounded conversions (half's own f64 ones
            // misround some near-ties).
            DType::F16 => Owned::F16(v.iter().map(|&x| <f16 as Float>::from_f64(x)).collect()),
            DType::BF16 => Owned::BF16(v.iter().map(|&x| <bf16 as Float>::from_f64(x)).collect()),
            _ => Owned::F32(v.iter().map(|&x| x as f32).collect()),
        }
    }
    pub fn f64s(&self) -> Vec<f64> {
        match self {
            Owned::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Owned::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Owned::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        }
    }
    pub fn values(&self) -> Vec<f32> {
        match self {
            Owned::F32(v) => v.clone(),
            Owned::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Owned::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
    pub fn dtype(&self) -> DType {
        match self {
            Owned::F32(_) => DType::F32,
            Owned::F16(_) => DType::F16,
            Owned::BF16(_) => DType::BF16,
        }
    }
    pub fn view(&self) -> GradTensor<'_> {
        match self {
            Owned::F32(v) => GradTensor::F32(v),
            Owned::F16(v) => GradTensor::F16(v),
            Owned::BF16(v) => GradTensor::BF16(v),
        }
    }
    pub fn view_mut(&mut self) -> GradTensorMut<'_> {
        match self {
            Owned::F32(v) => GradTensorMut::F32(v),
            Owned::F16(v) => GradTensorMut::F16(v),
            Owned::BF16(v) => GradTensorMut::BF16(v),
        }
    }
    pub fn bits(&self) -> Vec<u32> {
        match self {
            Owned::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            Owned::F16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
            Owned::BF16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
        }
    }
    /// One ulp of this dtype at |x|.
    pub fn ulp(&self, x: f64) -> f64 {
        match self.dtype() {
            DType::F16 => ulp_at::<f16>(x),
            DType::BF16 => ulp_at::<bf16>(x),
            _ => ulp_at::<f32>(x),
        }
    }
}
