//! The NPU dispatch point. The front end validates, plans and checks the
//! workspace, then hands one `*Call` (validated arguments + tiling plan +
//! workspace) to a `Backend`: `Cpu` runs the plan on SIMD lanes over a
//! `Runner`, `Reference` is the scalar f64 golden model, and the C ABI's
//! foreign backend forwards the same structs to an adapter's NPU launch.
//! The gradient-health operators have no NPU dispatch entry; a backend says
//! where they run instead (`Backend::grad_engine`).

use crate::error::Result;
use crate::lanes::{detect, Isa};
use crate::ops::add_rms_norm::AddRmsNormCall;
use crate::ops::embedding_dense_grad::EmbeddingDenseGradCall;
use crate::ops::rms_norm::RmsNormCall;
use crate::ops::rms_norm_grad::RmsNormGradCall;
use crate::runner::{Runner, Serial};

/// One method per operator.
///
/// # Safety
/// Implementations may assume the call was produced by this crate's front end:
/// every pointer is valid for its tensor's shape and dtype, outputs do not
/// overlap inputs except for the documented in-place pairs, and the workspace
/// holds `tiling.workspace_bytes`. They must write nothing but the outputs and
/// the workspace.
pub unsafe trait Backend: Sync {
    /// RmsNorm.
    ///
    /// # Safety
    /// `call` comes from the front end (see the trait).
    unsafe fn rms_norm(&self, call: &RmsNormCall) -> Result<()>;
    /// AddRmsNorm.
    ///
    /// # Safety
    /// `call` comes from the front end (see the trait).
    unsafe fn add_rms_norm(&self, call: &AddRmsNormCall) -> Result<()>;
    /// RmsNormGrad.
    ///
    /// # Safety
    /// `call` comes from the front end (see the trait).
    unsafe fn rms_norm_grad(&self, call: &RmsNormGradCall) -> Result<()>;
    /// EmbeddingDenseGrad.
    ///
    /// # Safety
    /// `call` comes from the front end (see the trait).
    unsafe fn embedding_dense_grad(&self, call: &EmbeddingDenseGradCall) -> Result<()>;
    /// Where `grad_stats` and `clip_grad_norm` run with this backend (they
    /// have no dispatch entry of their own). Default: the serial CPU
    /// kernels, automatic ISA.
    fn grad_engine(&self) -> GradEngine<'_> {
        GradEngine::Cpu {
            runner: &Serial,
            isa: None,
        }
    }
}

/// How the gradient-health operators run (`Backend::grad_engine`).
#[derive(Clone, Copy)]
pub enum GradEngine<'a> {
    /// The blocked SIMD kernels on `runner`, with the ISA forced or (None)
    /// detected.
    Cpu {
        /// Runs the blocks.
        runner: &'a dyn Runner,
        /// Forced ISA, or None for automatic selection.
        isa: Option<Isa>,
    },
    /// The scalar f64 golden model (serial).
    Reference,
}

impl core::fmt::Debug for GradEngine<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            GradEngine::Cpu { isa, .. } => f
                .debug_struct("Cpu")
                .field("isa", isa)
                .finish_non_exhaustive(),
            GradEngine::Reference => f.write_str("Reference"),
        }
    }
}

/// The CPU backend: runs the tiling plan's blocks on `runner`, with the ISA
/// forced or (None) detected.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu<R: Runner = Serial> {
    /// Runs the blocks.
    pub runner: R,
    /// Forced ISA, or None for automatic selection.
    pub isa: Option<Isa>,
}

impl<R: Runner> Cpu<R> {
    /// A CPU backend with automatic ISA selection.
    pub const fn new(runner: R) -> Self {
        Cpu { runner, isa: None }
    }

    /// The same backend with `isa` forced (an unavailable ISA makes every
    /// call fail with `IsaUnavailable`).
    pub fn with_isa(self, isa: Isa) -> Self {
        Cpu {
            runner: self.runner,
            isa: Some(isa),
        }
    }

    pub(crate) fn isa(&self) -> Result<Isa> {
        detect::resolve(self.isa)
    }
}

/// The serial CPU backend with automatic ISA selection.
pub static CPU_SERIAL: Cpu<Serial> = Cpu::new(Serial);

// SAFETY: the kernels write only the call's outputs and workspace, within the
// validated bounds.
unsafe impl<R: Runner> Backend for Cpu<R> {
    unsafe fn rms_norm(&self, call: &RmsNormCall) -> Result<()> {
        let isa = self.isa()?;
        // SAFETY: forwarded from the trait's contract.
        unsafe { crate::ops::rms_norm::cpu(call, isa, &self.runner) };
        Ok(())
    }
    unsafe fn add_rms_norm(&self, call: &AddRmsNormCall) -> Result<()> {
        let isa = self.isa()?;
        // SAFETY: forwarded from the trait's contract.
        unsafe { crate::ops::add_rms_norm::cpu(call, isa, &self.runner) };
        Ok(())
    }
    unsafe fn rms_norm_grad(&self, call: &RmsNormGradCall) -> Result<()> {
        let isa = self.isa()?;
        // SAFETY: forwarded from the trait's contract.
        unsafe { crate::ops::rms_norm_grad::cpu(call, isa, &self.runner) };
        Ok(())
    }
    unsafe fn embedding_dense_grad(&self, call: &EmbeddingDenseGradCall) -> Result<()> {
        let isa = self.isa()?;
        // SAFETY: forwarded from the trait's contract.
        unsafe { crate::ops::embedding_dense_grad::cpu(call, isa, &self.runner) };
        Ok(())
    }
    fn grad_engine(&self) -> GradEngine<'_> {
        GradEngine::Cpu {
            runner: &self.runner,
            isa: self.isa,
        }
    }
}

/// The scalar f64 golden model: exact math, one rounding to each output's
/// dtype. Slow; for tests and for adapters producing golden data.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reference;

// SAFETY: the reference writes only the call's outputs, within validated bounds.
unsafe impl Backend for Reference {
    unsafe fn rms_norm(&self, call: &RmsNormCall) -> Result<()> {
        // SAFETY: forwarded from the trait's contract.
        unsafe { crate::ops::rms_norm::reference(call) };
        Ok(())
    }
    unsafe fn add_rms_norm(&self, call: &AddRmsNormCall) -> Result<()> {
        // SAFETY: forwarded from the trait's contract.
        unsafe { crate::ops::add_rms_norm::reference(call) };
        Ok(())
    }
    unsafe fn rms_norm_grad(&self, call: &RmsNormGradCall) -> Result<()> {
        // SAFETY: forwarded from the trait's contract.
        unsafe { crate::ops::rms_norm_grad::reference(call) };
        Ok(())
    }
    unsafe fn embedding_dense_grad(&self, call: &EmbeddingDenseGradCall) -> Result<()> {
        // SAFETY: forwarded from the trait's contract.
        unsafe { crate::ops::embedding_dense_grad::reference(call) };
        Ok(())
    }
    fn grad_engine(&self) -> GradEngine<'_> {
        GradEngine::Reference
    }
}
