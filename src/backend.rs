//! The NPU dispatch point. The front end validates, plans and checks the
//! workspace, then hands one `Op` (a `*Call`: validated arguments + tiling
//! plan + workspace) to a `Backend`: `Cpu` runs the plan on SIMD lanes over a
//! `Runner`, `Reference` is the scalar f64 golden model, and the C ABI's
//! foreign backend forwards the same structs to an adapter's NPU launch.

use crate::error::Result;
use crate::lanes::{detect, Isa};
use crate::ops::Op;
use crate::runner::{Runner, Serial};

/// Runs validated, planned operator calls.
///
/// # Safety
/// Implementations may assume the call was produced by this crate's front end:
/// every pointer is valid for its tensor's shape and dtype, outputs do not
/// overlap inputs except for the documented in-place pairs, and the workspace
/// holds `tiling.workspace_bytes`. They must write nothing but the outputs and
/// the workspace.
pub unsafe trait Backend: Sync {
    /// Runs one call. `Op` grows with the library (`#[non_exhaustive]`): an
    /// implementation that does not know an operator should hand it to
    /// `CPU_SERIAL.launch(op)` (or its own `Cpu`), as the C foreign backend
    /// does for entries it lacks.
    ///
    /// # Safety
    /// `op` comes from the front end (see the trait).
    unsafe fn launch(&self, op: Op<'_>) -> Result<()>;
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

    pub(crate) fn isa(&self) -> Result<detect::Available> {
        detect::resolve(self.isa)
    }
}

/// The serial CPU backend with automatic ISA selection.
pub static CPU_SERIAL: Cpu<Serial> = Cpu::new(Serial);

// SAFETY: the kernels write only the call's outputs and workspace, within the
// validated bounds.
unsafe impl<R: Runner> Backend for Cpu<R> {
    unsafe fn launch(&self, op: Op<'_>) -> Result<()> {
        let isa = self.isa()?;
        // SAFETY: forwarded from the trait's contract; `isa` was resolved
        // as available.
        unsafe { op.cpu(isa, &self.runner) };
        Ok(())
    }
}

/// The scalar f64 golden model: exact math, one rounding to each output's
/// dtype. Slow; for tests and for adapters producing golden data.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reference;

// SAFETY: the reference writes only the call's outputs, within validated bounds.
unsafe impl Backend for Reference {
    unsafe fn launch(&self, op: Op<'_>) -> Result<()> {
        // SAFETY: forwarded from the trait's contract.
        unsafe { op.reference() };
        Ok(())
    }
}
