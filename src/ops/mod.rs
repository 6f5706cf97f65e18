//! The front end: one module per operator, each holding its arguments,
//! validation, CPU kernel and f64 reference. Rust users and the C ABI call the
//! same validation, so both see the same errors.

pub mod add_rms_norm;
pub mod embedding_dense_grad;
pub mod grad_stats;
pub mod norm;
mod norm_fwd;
pub mod rms_norm;
pub mod rms_norm_grad;

use crate::backend::{Backend, CPU_SERIAL};
use crate::tiling::UbConfig;

/// Where and how an operator runs: the tiling machine model and the backend.
#[derive(Clone, Copy)]
pub struct Exec<'a> {
    /// Unified Buffer size and block count the plan is cut for.
    pub ub: UbConfig,
    /// Who runs the plan.
    pub backend: &'a dyn Backend,
}

impl Exec<'static> {
    /// Serial CPU backend, automatic ISA, default tiling.
    pub fn cpu() -> Self {
        Exec {
            ub: UbConfig::default(),
            backend: &CPU_SERIAL,
        }
    }
}

impl Default for Exec<'static> {
    fn default() -> Self {
        Exec::cpu()
    }
}

impl<'a> Exec<'a> {
    /// Default tiling on `backend`.
    pub fn new(backend: &'a dyn Backend) -> Self {
        Exec {
            ub: UbConfig::default(),
            backend,
        }
    }

    /// The same, with another tiling machine model.
    pub fn with_ub(self, ub: UbConfig) -> Self {
        Exec { ub, ..self }
    }
}

impl core::fmt::Debug for Exec<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Exec")
            .field("ub", &self.ub)
            .finish_non_exhaustive()
    }
}

/// Calls `$f::<L, X, G>($args)` for the validated (x, gamma) dtype pair.
macro_rules! dispatch_xg {
    ($xd:expr, $gd:expr, $f:ident :: <$L:ty> ($($a:expr),*)) => {{
        use half::{bf16, f16};
        use $crate::dtype::DType;
        match ($xd, $gd) {
            (DType::F16, DType::F16) => $f::<$L, f16, f16>($($a),*),
            (DType::F16, _) => $f::<$L, f16, f32>($($a),*),
            (DType::BF16, DType::BF16) => $f::<$L, bf16, bf16>($($a),*),
            (DType::BF16, _) => $f::<$L, bf16, f32>($($a),*),
            _ => $f::<$L, f32, f32>($($a),*),
        }
    }};
    ($xd:expr, $gd:expr, $f:ident ($($a:expr),*)) => {{
        use half::{bf16, f16};
        use $crate::dtype::DType;
        match ($xd, $gd) {
            (DType::F16, DType::F16) => $f::<f16, f16>($($a),*),
            (DType::F16, _) => $f::<f16, f32>($($a),*),
            (DType::BF16, DType::BF16) => $f::<bf16, bf16>($($a),*),
            (DType::BF16, _) => $f::<bf16, f32>($($a),*),
            _ => $f::<f32, f32>($($a),*),
        }
    }};
}
pub(crate) use dispatch_xg;

/// Calls `$body` with `$L` bound to the Lanes type of `$isa` (an ISA that
/// `detect::resolve` returned, so available on this CPU). Kernel bodies must
/// run their per-block work inside `L::enter`.
macro_rules! dispatch_isa {
    ($isa:expr, $L:ident => $body:expr) => {{
        match $isa {
            #[cfg(target_arch = "x86_64")]
            $crate::lanes::Isa::Avx512 => {
                type $L = $crate::lanes::Avx512;
                $body
            }
            #[cfg(target_arch = "x86_64")]
            $crate::lanes::Isa::Avx2 => {
                type $L = $crate::lanes::Avx2;
                $body
            }
            _ => {
                type $L = $crate::lanes::Portable;
                $body
            }
        }
    }};
}
pub(crate) use dispatch_isa;
