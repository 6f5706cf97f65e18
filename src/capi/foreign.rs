//! The NPU dispatch point: `NPK_BACKEND_FOREIGN` hands the validated, planned
//! `*Call` structs to an adapter's function table. A missing entry — NULL, or
//! beyond the table's `struct_size` (a backend compiled against an older
//! header) — falls back to the CPU backend, as torch_npu's DO_COMPATIBILITY
//! falls back to an older implementation. The library never reads past
//! `struct_size` bytes of the table.

#![allow(non_camel_case_types)]

use core::ffi::c_void;
use core::mem::{offset_of, size_of};

use super::types::RawStatus;
use crate::backend::Backend;
use crate::error::{invalid_fmt, Error, Result};
use crate::ops::adamw::AdamWCall;
use crate::ops::add_rms_norm::AddRmsNormCall;
use crate::ops::attention::AttentionCall;
use crate::ops::cross_entropy::CrossEntropyCall;
use crate::ops::embedding_dense_grad::EmbeddingDenseGradCall;
use crate::ops::geglu::GegluCall;
use crate::ops::geglu_grad::GegluGradCall;
use crate::ops::grad_stats::{ClipGradNormCall, GradStatsCall};
use crate::ops::matmul::MatmulCall;
use crate::ops::rms_norm::RmsNormCall;
use crate::ops::rms_norm_grad::RmsNormGradCall;
use crate::ops::rope::RopeCall;
use crate::ops::swiglu::SwigluCall;
use crate::ops::swiglu_grad::SwigluGradCall;
use crate::ops::Op;

/// An adapter's operator table (`exec->foreign`). Set `struct_size` to
/// `sizeof(npk_foreign_backend)` as your header declares it; entries are only
/// ever appended (in operator-id order), so a backend built against an older
/// header keeps working: the entries it lacks run on the CPU. Each entry
/// receives the validated arguments, the tiling plan and the workspace; it
/// returns 0 (`NPK_OK`) on success, anything else on failure, which the
/// library reports as `NPK_ERR_BACKEND` with the entry's own code in
/// `npk_error_detail.value`. A NULL entry runs that operator on the CPU
/// backend (with `exec`'s runner and ISA). The table and `call` are only
/// borrowed for the duration of the call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_foreign_backend {
    /// `sizeof(npk_foreign_backend)` in the header the backend was compiled
    /// with (at least `NPK_FOREIGN_BACKEND_MIN_SIZE`, which holds
    /// `struct_size` and `ctx`). The library reads no byte of the table
    /// beyond it.
    pub struct_size: usize,
    /// Passed back as every entry's first argument.
    pub ctx: *mut c_void,
    /// RmsNorm (ABI 2.0).
    pub rms_norm:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const RmsNormCall) -> RawStatus>,
    /// AddRmsNorm (ABI 2.0).
    pub add_rms_norm:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const AddRmsNormCall) -> RawStatus>,
    /// RmsNormGrad (ABI 2.0).
    pub rms_norm_grad:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const RmsNormGradCall) -> RawStatus>,
    /// EmbeddingDenseGrad (ABI 2.0).
    pub embedding_dense_grad: Option<
        unsafe extern "C" fn(ctx: *mut c_void, call: *const EmbeddingDenseGradCall) -> RawStatus,
    >,
    /// SwiGLU (ABI 2.2).
    pub swiglu:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const SwigluCall) -> RawStatus>,
    /// SwiGluGrad (ABI 2.2).
    pub swiglu_grad:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const SwigluGradCall) -> RawStatus>,
    /// RoPE, forward and backward (ABI 2.2).
    pub rope: Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const RopeCall) -> RawStatus>,
    /// CrossEntropy: forward, backward and fused, by `call->mode` (ABI 2.3).
    pub cross_entropy:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const CrossEntropyCall) -> RawStatus>,
    /// GeGLU (ABI 2.5).
    pub geglu: Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const GegluCall) -> RawStatus>,
    /// GeGluGrad (ABI 2.5).
    pub geglu_grad:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const GegluGradCall) -> RawStatus>,
    /// AdamW / Adam over tensor lists (ABI 2.6). The entry runs the whole
    /// step: under `ADAMW_CLIP` it takes the grads' norm, and it writes
    /// `call->report`.
    pub adamw: Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const AdamWCall) -> RawStatus>,
    /// Gradient statistics over a tensor list (ABI 2.7): the entry writes
    /// `*call->summary`.
    pub grad_stats:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const GradStatsCall) -> RawStatus>,
    /// `clip_grad_norm_` over a tensor list (ABI 2.7): the entry takes the
    /// norm, scales the tensors in place unless it refuses (a NaN / Inf
    /// under `error_if_nonfinite`: nothing scaled) and writes `*call->report`.
    pub clip_grad_norm:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const ClipGradNormCall) -> RawStatus>,
    /// Matmul (ABI 2.8).
    pub matmul:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const MatmulCall) -> RawStatus>,
    /// Attention, forward and backward (ABI 2.11).
    pub attention:
        Option<unsafe extern "C" fn(ctx: *mut c_void, call: *const AttentionCall) -> RawStatus>,
}

/// The smallest valid `npk_foreign_backend.struct_size`: `struct_size` and
/// `ctx` (a table with no entries runs everything on the CPU).
pub const NPK_FOREIGN_BACKEND_MIN_SIZE: usize = 2 * size_of::<usize>();

const _: () = assert!(offset_of!(npk_foreign_backend, rms_norm) == NPK_FOREIGN_BACKEND_MIN_SIZE);

impl npk_foreign_backend {
    /// Copies the caller's table: its first `struct_size` bytes, the rest
    /// (entries this backend was compiled without) NULL.
    ///
    /// # Safety
    /// `p` is non-NULL and points to a readable table whose first
    /// `size_of::<usize>()` bytes are its `struct_size`, and which is
    /// readable for `struct_size` bytes.
    pub(crate) unsafe fn read(p: *const npk_foreign_backend) -> Result<npk_foreign_backend> {
        // SAFETY: the first field is readable (caller).
        let size = unsafe { p.cast::<usize>().read_unaligned() };
        if size < NPK_FOREIGN_BACKEND_MIN_SIZE {
            return Err(invalid_fmt!(
                "foreign",
                "struct_size {size} is smaller than struct_size and ctx ({NPK_FOREIGN_BACKEND_MIN_SIZE} bytes)"
            ));
        }
        if !(size - NPK_FOREIGN_BACKEND_MIN_SIZE).is_multiple_of(size_of::<usize>()) {
            return Err(invalid_fmt!(
                "foreign",
                "struct_size {size} is not a whole number of entries"
            ));
        }
        let mut t = npk_foreign_backend {
            struct_size: size,
            ctx: core::ptr::null_mut(),
            rms_norm: None,
            add_rms_norm: None,
            rms_norm_grad: None,
            embedding_dense_grad: None,
            swiglu: None,
            swiglu_grad: None,
            rope: None,
            cross_entropy: None,
            geglu: None,
            geglu_grad: None,
            adamw: None,
            grad_stats: None,
            clip_grad_norm: None,
            matmul: None,
            attention: None,
        };
        let n = size.min(size_of::<npk_foreign_backend>());
        // SAFETY: `n` bytes are readable at `p` (caller) and fit in `t`; every
        // field is an integer, a pointer or an `Option<fn>`, for which any C
        // value (NULL or a function address) is valid; `n` covers whole
        // entries only (checked above).
        unsafe {
            core::ptr::copy_nonoverlapping(p.cast::<u8>(), (&mut t as *mut Self).cast::<u8>(), n)
        };
        Ok(t)
    }

    /// Calls the table's entry for `op`, if it has one.
    ///
    /// # Safety
    /// `op` comes from the front end; the entry honours the C contract.
    unsafe fn call(&self, op: Op<'_>) -> Option<RawStatus> {
        let ctx = self.ctx;
        // SAFETY: every arm calls the adapter's entry as the C contract says.
        unsafe {
            match op {
                Op::RmsNorm(c) => self.rms_norm.map(|f| f(ctx, c)),
                Op::AddRmsNorm(c) => self.add_rms_norm.map(|f| f(ctx, c)),
                Op::RmsNormGrad(c) => self.rms_norm_grad.map(|f| f(ctx, c)),
                Op::EmbeddingDenseGrad(c) => self.embedding_dense_grad.map(|f| f(ctx, c)),
                Op::Swiglu(c) => self.swiglu.map(|f| f(ctx, c)),
                Op::SwigluGrad(c) => self.swiglu_grad.map(|f| f(ctx, c)),
                Op::Rope(c) => self.rope.map(|f| f(ctx, c)),
                Op::CrossEntropy(c) => self.cross_entropy.map(|f| f(ctx, c)),
                Op::Geglu(c) => self.geglu.map(|f| f(ctx, c)),
                Op::GegluGrad(c) => self.geglu_grad.map(|f| f(ctx, c)),
                Op::AdamW(c) => self.adamw.map(|f| f(ctx, c)),
                Op::GradStats(c) => self.grad_stats.map(|f| f(ctx, c)),
                Op::ClipGradNorm(c) => self.clip_grad_norm.map(|f| f(ctx, c)),
                Op::Matmul(c) => self.matmul.map(|f| f(ctx, c)),
                Op::Attention(c) => self.attention.map(|f| f(ctx, c)),
            }
        }
    }
}

/// A `Backend` that forwards to an `npk_foreign_backend`, falling back to
/// `fallback` for missing entries.
pub(crate) struct Foreign<'a> {
    /// A copy of the adapter's table (`npk_foreign_backend::read`).
    pub table: npk_foreign_backend,
    /// Runs the operators whose entry is missing.
    pub fallback: &'a dyn Backend,
}

// SAFETY: a `Foreign` lives on the stack of one C call and is used only by the
// thread that made it (backends are invoked from the calling thread; only the
// CPU kernels' blocks fan out, and they never touch this table). `Sync` is
// required by the `Backend` trait, not by any sharing.
unsafe impl Sync for Foreign<'_> {}

// SAFETY: the adapter's entries receive only the call (validated by the front
// end) and write what the C contract lets them write; missing entries defer to
// `fallback`, itself a `Backend`.
unsafe impl Backend for Foreign<'_> {
    unsafe fn launch(&self, op: Op<'_>) -> Result<()> {
        // SAFETY: forwarded from the trait's contract.
        match unsafe { self.table.call(op) } {
            Some(0) => Ok(()),
            Some(status) => Err(Error::Backend { status }),
            // SAFETY: forwarded from the trait's contract.
            None => unsafe { self.fallback.launch(op) },
        }
    }
}
