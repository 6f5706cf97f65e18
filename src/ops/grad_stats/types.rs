//! The typed Rust views of the gradient-health operators: tensor lists, the
//! summary they produce and the execution settings.

use crate::lanes::sqrt_f64;

/// A read-only gradient: the list element of `crate::tensor_list`
/// (its name here since the gradient-health operators came first).
pub use crate::tensor_list::FlatTensor as GradTensor;
/// A writable gradient: `crate::tensor_list::FlatTensorMut`.
pub use crate::tensor_list::FlatTensorMut as GradTensorMut;

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
