//! The typed Rust views of the gradient-health operators: tensor lists, the
//! summary they produce and the execution settings.

use half::{bf16, f16};

use crate::dtype::DType;
use crate::lanes::sqrt_f64;
use crate::tensor::TensorRef;

/// One read-only gradient tensor. Its shape does not matter to these
/// operators (every element counts once), so a flat slice is all they need.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum GradTensor<'a> {
    /// IEEE binary32 elements.
    F32(&'a [f32]),
    /// IEEE binary16 elements.
    F16(&'a [f16]),
    /// bfloat16 elements.
    BF16(&'a [bf16]),
}

/// One writable gradient tensor (for `clip_grad_norm`, which scales in place).
#[derive(Debug)]
#[non_exhaustive]
pub enum GradTensorMut<'a> {
    /// IEEE binary32 elements.
    F32(&'a mut [f32]),
    /// IEEE binary16 elements.
    F16(&'a mut [f16]),
    /// bfloat16 elements.
    BF16(&'a mut [bf16]),
}

impl GradTensor<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            GradTensor::F32(_) => DType::F32,
            GradTensor::F16(_) => DType::F16,
            GradTensor::BF16(_) => DType::BF16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            GradTensor::F32(s) => s.len(),
            GradTensor::F16(s) => s.len(),
            GradTensor::BF16(s) => s.len(),
        }
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl GradTensorMut<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            GradTensorMut::F32(_) => DType::F32,
            GradTensorMut::F16(_) => DType::F16,
            GradTensorMut::BF16(_) => DType::BF16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            GradTensorMut::F32(s) => s.len(),
            GradTensorMut::F16(s) => s.len(),
            GradTensorMut::BF16(s) => s.len(),
        }
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A read-only view of the same elements.
    pub fn as_ref(&self) -> GradTensor<'_> {
        match self {
            GradTensorMut::F32(s) => GradTensor::F32(s),
            GradTensorMut::F16(s) => GradTensor::F16(s),
            GradTensorMut::BF16(s) => GradTensor::BF16(s),
        }
    }
}

macro_rules! grad_from {
    ($t:ty, $v:ident) => {
        impl<'a> From<&'a [$t]> for GradTensor<'a> {
            fn from(s: &'a [$t]) -> Self {
                GradTensor::$v(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for GradTensorMut<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                GradTensorMut::$v(s)
            }
        }
        impl<'a> From<TensorRef<'a, $t>> for GradTensor<'a> {
            fn from(t: TensorRef<'a, $t>) -> Self {
                GradTensor::$v(t.data())
            }
        }
    };
}
grad_from!(f32, F32);
grad_from!(f16, F16);
grad_from!(bf16, BF16);

/// What `grad_stats` measures over all elements of all tensors
/// (`npk_grad_summary`).
///
/// `sum_sq` is the sum of squares of the finite elements (relative error
/// below 1e-6, see the module docs); `min`, `max` and `absmax` are taken
/// over the finite elements, exactly, and are NaN when there are none. A
/// zero `min`/`max` is reported as +0.0 (SIMD min/max keep different zeros
/// on different ISAs); `absmax` is `max(-min, max)`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GradSummary {
    /// Sum of squares of the finite elements.
    pub sum_sq: f64,
    /// Number of NaN elements.
    pub nan_count: u64,
    /// Number of +Inf and -Inf elements.
    pub inf_count: u64,
    /// Smallest finite element (NaN when there is none).
    pub min: f32,
    /// Largest finite element (NaN when there is none).
    pub max: f32,
    /// Largest finite magnitude (NaN when there is none).
    pub absmax: f32,
}

impl GradSummary {
    /// True when no element is NaN or infinite.
    pub fn is_finite(&self) -> bool {
        self.nan_count == 0 && self.inf_count == 0
    }

    /// The L2 norm of all elements as PyTorch's `clip_grad_norm_` sees it:
    /// NaN when any element is NaN, +Inf when any is infinite (and none is
    /// NaN), else `sqrt(sum_sq)` (correctly rounded f64 square root).
    pub fn norm(&self) -> f64 {
        if self.nan_count > 0 {
            f64::NAN
        } else if self.inf_count > 0 {
            f64::INFINITY
        } else {
            sqrt_f64(self.sum_sq)
        }
    }

    /// Bitwise equality of every field (NaN equals NaN; -0.0 differs from
    /// +0.0): what the reproducibility promise is about.
    pub fn same_bits(&self, o: &GradSummary) -> bool {
        self.sum_sq.to_bits() == o.sum_sq.to_bits()
            && self.nan_count == o.nan_count
            && self.inf_count == o.inf_count
            && self.min.to_bits() == o.min.to_bits()
            && self.max.to_bits() == o.max.to_bits()
            && self.absmax.to_bits() == o.absmax.to_bits()
    }
}

/// Options of `clip_grad_norm` (`npk_clip_grad_norm`'s scalar arguments).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClipGradNormOptions {
    /// The largest total L2 norm left unscaled; >= 0 and not NaN (`+Inf`:
    /// compute the norm, never clip).
    pub max_norm: f64,
    /// Fail with `Error::NonFinite` (changing nothing) when an element is
    /// NaN or Inf, instead of applying the NaN / zero coefficient.
    pub error_if_nonfinite: bool,
}

impl ClipGradNormOptions {
    /// `max_norm`, with `error_if_nonfinite` false (PyTorch's default).
    pub const fn new(max_norm: f64) -> Self {
        ClipGradNormOptions {
            max_norm,
            error_if_nonfinite: false,
        }
    }

    pub(crate) fn check(&self) -> crate::error::Result<()> {
        if self.max_norm.is_nan() || self.max_norm < 0.0 {
            return Err(crate::error::invalid_fmt!(
                "max_norm",
                "{} is negative or NaN",
                self.max_norm
            ));
        }
        Ok(())
    }
}
