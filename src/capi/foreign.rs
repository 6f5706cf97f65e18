//! The NPU dispatch point: `NPK_BACKEND_FOREIGN` hands the validated, planned
//! `*Call` structs to an adapter's function table. A NULL entry falls back to
//! the CPU backend, as torch_npu's DO_COMPATIBILITY falls back to an older
//! implementation.

#![allow(non_camel_case_types)]

use core::ffi::c_void;

use super::types::RawStatus;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ops::add_rms_norm::AddRmsNormCall;
use crate::ops::embedding_dense_grad::EmbeddingDenseGradCall;
use crate::ops::rms_norm::RmsNormCall;
use crate::ops::rms_norm_grad::RmsNormGradCall;

/// An adapter's operator table (`exec->foreign`). Each entry receives the
/// validated arguments, the tiling plan and the workspace; it returns 0
/// (`NPK_OK`) on success, anything else on failure, which the library reports
/// as `NPK_ERR_BACKEND` with the entry's own code in `npk_error_detail.value`.
/// A NULL entry runs that operator on the CPU backend (with `exec`'s runner and
/// ISA). The table and `call` are only borrowed for the duration of the call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_foreign_backend {
    /// Passed back as every entry's first argument.
    pub ctx: *mut c_void,
    /// RmsNorm.
    pub rms_norm:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const RmsNormCall) -> RawStatus>,
    /// AddRmsNorm.
    pub add_rms_norm:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const AddRmsNormCall) -> RawStatus>,
    /// RmsNormGrad.
    pub rms_norm_grad:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const RmsNormGradCall) -> RawStatus>,
    /// EmbeddingDenseGrad.
    pub embedding_dense_grad: Option<
        unsafe extern "C" fn(ctx: *mut c_void, call: *const EmbeddingDenseGradCall) -> RawStatus,
    >,
}

/// A `Backend` that forwards to an `npk_foreign_backend`, falling back to
/// `fallback` for NULL entries.
pub(crate) struct Foreign<'a> {
    /// A copy of the adapter's table, read once per call.
    pub table: npk_foreign_backend,
    /// Runs the operators whose entry is NULL.
    pub fallback: &'a dyn Backend,
}

// SAFETY: a `Foreign` lives on the stack of one C call and is used only by the
// thread that made it (backends are invoked from the calling thread; only the
// CPU kernels' blocks fan out, and they never touch this table). `Sync` is
// required by the `Backend` trait, not by any sharing.
unsafe impl Sync for Foreign<'_> {}

/// 0 is success; any other code is the adapter's failure.
fn code(status: RawStatus) -> Result<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(Error::Backend { status })
    }
}

// SAFETY: the adapter's entries receive only the call (validated by the front
// end) and write what the C contract lets them write; NULL entries defer to
// `fallback`, itself a `Backend`.
unsafe impl Backend for Foreign<'_> {
    unsafe fn rms_norm(&self, call: &RmsNormCall) -> Result<()> {
        match self.table.rms_norm {
            // SAFETY: the adapter's entry, called as the C contract says.
            Some(f) => code(unsafe { f(self.table.ctx, call) }),
            // SAFETY: forwarded from the trait's contract.
            None => unsafe { self.fallback.rms_norm(call) },
        }
    }

    unsafe fn add_rms_norm(&self, call: &AddRmsNormCall) -> Result<()> {
        match self.table.add_rms_norm {
            // SAFETY: the adapter's entry, called as the C contract says.
            Some(f) => code(unsafe { f(self.table.ctx, call) }),
            // SAFETY: forwarded from the trait's contract.
            None => unsafe { self.fallback.add_rms_norm(call) },
        }
    }

    unsafe fn rms_norm_grad(&self, call: &RmsNormGradCall) -> Result<()> {
        match self.table.rms_norm_grad {
            // SAFETY: the adapter's entry, called as the C contract says.
            Some(f) => code(unsafe { f(self.table.ctx, call) }),
            // SAFETY: forwarded from the trait's contract.
            None => unsafe { self.fallback.rms_norm_grad(call) },
        }
    }

    unsafe fn embedding_dense_grad(&self, call: &EmbeddingDenseGradCall) -> Result<()> {
        match self.table.embedding_dense_grad {
            // SAFETY: the adapter's entry, called as the C contract says.
            Some(f) => code(unsafe { f(self.table.ctx, call) }),
            // SAFETY: forwarded from the trait's contract.
            None => unsafe { self.fallback.embedding_dense_grad(call) },
        }
    }

    fn grad_engine(&self) -> crate::backend::GradEngine<'_> {
        // No foreign entry: the CPU fallback runs them.
        self.fallback.grad_engine()
    }
}
