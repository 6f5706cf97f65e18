//! The typed Rust views of the gradient-health operators: tensor lists, the
//! summary they produce and the execution settings.

use half::{bf16, f16};

use crate::dtype::DType;
use crate::lanes::{sqrt_f64, Isa};
use crate::runner::{Runner, Serial};
use crate::tensor::TensorRef;
use crate::tiling::UbConfig;

/// One read-only gradient tensor. Its shape does not matter to these
/// operators (every element counts once), so a flat slice is all they need.
#[derive(Clone, Copy, Debug)]
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

/// Which implementation runs a gradient-health call.
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GradEngine {
    /// The blocked SIMD kernels over `GradExec::runner`.
    #[default]
    Cpu = 0,
    /// The scalar f64 golden model (serial; ignores the runner and ISA).
    Reference = 1,
}

static SERIAL: Serial = Serial;

/// Where and how the gradient-health operators run.
///
/// These operators are not NPU-dispatch operators (c-api.md's foreign table
/// has no entry for them), so they do not go through `Backend`: they run the
/// CPU kernels directly on a `Runner`, or the f64 reference. The plan (block
/// split) depends only on the tensors and `ub`, never on the runner, so every
/// runner gives the same bits.
#[derive(Clone, Copy)]
pub struct GradExec<'a> {
    /// Tiling machine model: `blocks` cuts the flat element range.
    /// `ub_bytes` is validated but unused: these kernels stream through
    /// registers and need no UB arena.
    pub ub: UbConfig,
    /// Runs the blocks.
    pub runner: &'a dyn Runner,
    /// Forced ISA, or None for automatic selection.
    pub isa: Option<Isa>,
    /// Kernels or reference model.
    pub engine: GradEngine,
}

impl GradExec<'static> {
    /// Serial CPU kernels, automatic ISA, default tiling.
    pub fn cpu() -> Self {
        GradExec::new(&SERIAL)
    }
}

impl Default for GradExec<'static> {
    fn default() -> Self {
        GradExec::cpu()
    }
}

impl<'a> GradExec<'a> {
    /// CPU kernels on `runner` (e.g. `&Threads::new(4)`), default tiling.
    pub fn new(runner: &'a dyn Runner) -> Self {
        GradExec {
            ub: UbConfig::default(),
            runner,
            isa: None,
            engine: GradEngine::Cpu,
        }
    }

    /// The same, with another tiling machine model.
    pub fn with_ub(self, ub: UbConfig) -> Self {
        GradExec { ub, ..self }
    }

    /// The same, with `isa` forced (an unavailable ISA makes every CPU call
    /// fail with `IsaUnavailable`).
    pub fn with_isa(self, isa: Isa) -> Self {
        GradExec {
            isa: Some(isa),
            ..self
        }
    }

    /// The same, on the f64 reference model.
    pub fn reference(self) -> Self {
        GradExec {
            engine: GradEngine::Reference,
            ..self
        }
    }
}

impl core::fmt::Debug for GradExec<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("GradExec")
            .field("ub", &self.ub)
            .field("isa", &self.isa)
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}
