//! The C ABI's plain types: enums, descriptors and options (docs/c-api.md).
//!
//! # Enums and soundness
//! A C caller may store any integer in an enum-typed field. Materializing a
//! Rust enum from an invalid value is undefined behaviour, so no Rust enum is
//! ever read from C memory: every field or parameter the C side fills and the
//! header spells as an enum is declared here as a plain integer alias
//! (`RawIsa`, `RawRounding`, ...), and cbindgen's `[export.rename]` prints
//! that alias under the enum's C name. The `#[repr(C)]` enums below exist
//! only to give the header its `typedef enum { ... } npk_x;` definitions (and
//! as values the library *returns*). `npk_tensor` is the crate's `RawTensor`,
//! whose `dtype` is a Rust enum: `read_tensor` reads it as a `u32` through a
//! raw pointer and converts it with a check.

#![allow(non_camel_case_types)]

use core::ffi::{c_char, c_void};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::norm::{RmsNormOptions, Rounding};
use crate::ops::rms_norm_grad::{DgammaMode, RmsNormGradOptions};
use crate::tensor::RawTensor;

/// Most dimensions a tensor may have (`#define NPK_MAX_DIMS 8` in the header,
/// written by cbindgen.toml).
pub const NPK_MAX_DIMS: usize = 8;

/// `npk_exec.backend` bit (ABI 2.3; `#define NPK_OUTPUTS_FRESH 0x100u` in
/// the header): the outputs were just allocated and never written
/// (`OutputPages::Fresh`).
pub const NPK_OUTPUTS_FRESH: u32 = 0x100;
/// `npk_exec.backend` bit (ABI 2.3; `#define NPK_OUTPUTS_RESIDENT 0x200u`):
/// the outputs were written before, or are on huge pages
/// (`OutputPages::Resident`).
pub const NPK_OUTPUTS_RESIDENT: u32 = 0x200;

/// A tensor's element type (the header's definition of `npk_dtype`; the
/// library's own type is `DType`, with the same values). C has no 16-bit
/// float type: f16 and bf16 elements cross the ABI as `uint16_t` bit
/// patterns.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_dtype {
    /// IEEE binary32 (`float`).
    NPK_F32 = 0,
    /// IEEE binary16, as `uint16_t` bits (C23 `_Float16`, C++23
    /// `std::float16_t`, `__fp16` where available: same bits).
    NPK_F16 = 1,
    /// bfloat16, as `uint16_t` bits: the top 16 bits of the binary32 of the
    /// same value (`float f = bits << 16`; C++23 `std::bfloat16_t`).
    NPK_BF16 = 2,
    /// Signed 32-bit integer (indices).
    NPK_I32 = 3,
    /// Signed 64-bit integer (indices).
    NPK_I64 = 4,
    /// Signed 16-bit integer: the low halves of AdamW's split masters (ABI 2.9).
    NPK_I16 = 5,
    /// Unsigned 8-bit integer: the codes of AdamW's 8-bit moments (ABI 2.9).
    NPK_U8 = 6,
}

/// Status of every call. Numbered like aclnn's return codes, so an adapter
/// can pass them on.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_status {
    /// Success.
    NPK_OK = 0,
    /// A required pointer is NULL.
    NPK_ERR_NULLPTR = 161001,
    /// Rank, shape mismatch, eps, option, overlapping buffers.
    NPK_ERR_PARAM_INVALID = 161002,
    /// A dtype (or dtype pairing) the operator does not take.
    NPK_ERR_DTYPE_UNSUPPORTED = 161003,
    /// An index out of range; the detail gives position and value of the first.
    NPK_ERR_INDEX_OUT_OF_RANGE = 161004,
    /// The workspace is smaller than the size call said (a NULL one is `NPK_ERR_NULLPTR`).
    NPK_ERR_WORKSPACE_TOO_SMALL = 161005,
    /// A size or byte count does not fit.
    NPK_ERR_SIZE_OVERFLOW = 161006,
    /// A forced ISA this CPU (or this build) lacks.
    NPK_ERR_ISA_UNAVAILABLE = 161007,
    /// `npk_clip_grad_norm` met NaN/Inf with `error_if_nonfinite`.
    NPK_ERR_NONFINITE = 161008,
    /// A backend failed while running: a foreign backend's entry returned
    /// non-zero (its own code is in the detail's `value`), or the host
    /// `parallel_for` broke its contract (the detail's `argument` is
    /// "parallel_for").
    NPK_ERR_BACKEND = 361001,
}

/// Which SIMD implementation the CPU backend uses.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_isa {
    /// Pick the best one this CPU and build have (what `npk_detected_isa` returns).
    NPK_ISA_AUTO = 0,
    /// `wide` lanes: SSE2 on x86_64, NEON on aarch64 (16-bit conversions
    /// element by element), scalar elsewhere.
    NPK_ISA_PORTABLE = 1,
    /// AVX2 + FMA + F16C.
    NPK_ISA_AVX2 = 2,
    /// AVX-512F/BW.
    NPK_ISA_AVX512 = 3,
    /// AVX-512F/BW with AVX512-BF16 (and DQ, VL): bf16 rounding in hardware,
    /// the same bits.
    NPK_ISA_AVX512_BF16 = 4,
    /// AArch64 Advanced SIMD (every AArch64 CPU). ABI 2.1.
    NPK_ISA_NEON = 5,
    /// AArch64 Advanced SIMD with FEAT_BF16's BFCVTN for the bf16 rounding,
    /// the same bits. ABI 2.1.
    NPK_ISA_NEON_BF16 = 6,
}

impl npk_isa {
    /// Every named value except `NPK_ISA_AUTO`.
    const NAMED: [npk_isa; 6] = [
        npk_isa::NPK_ISA_PORTABLE,
        npk_isa::NPK_ISA_AVX2,
        npk_isa::NPK_ISA_AVX512,
        npk_isa::NPK_ISA_AVX512_BF16,
        npk_isa::NPK_ISA_NEON,
        npk_isa::NPK_ISA_NEON_BF16,
    ];

    /// The C name of `isa` (`NPK_ISA_AUTO` for an ISA the header does not
    /// name yet: callers still pass it by value).
    pub(crate) fn of(isa: crate::lanes::Isa) -> npk_isa {
        npk_isa::NAMED
            .into_iter()
            .find(|&c| c as u32 == isa as u32)
            .unwrap_or(npk_isa::NPK_ISA_AUTO)
    }
}

/// Who runs the validated, planned call.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_backend_kind {
    /// The tiled SIMD kernels on the host.
    NPK_BACKEND_CPU = 0,
    /// The scalar f64 golden model (slow; for producing reference data).
    NPK_BACKEND_REFERENCE = 1,
    /// The adapter's function table `npk_exec.foreign`.
    NPK_BACKEND_FOREIGN = 2,
}

/// Where the forward output is rounded (the header's `npk_rounding`; the
/// library's own type is `Rounding`, with the same values).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_rounding {
    /// `y = round(x * rstd * (gamma + offset))`: one rounding.
    NPK_ROUNDING_FUSED = 0,
    /// `y = round(round(x * rstd) * (gamma + offset))`: Hugging Face's bits.
    NPK_ROUNDING_CAST_BEFORE_GAMMA = 1,
}

/// Where an elementwise operator (SwiGLU, RoPE) rounds (the header's
/// `npk_elem_rounding`; the library's own type is `ElemRounding`). ABI 2.2.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_elem_rounding {
    /// fp32 inside, one rounding of each output.
    NPK_ELEM_ROUNDING_FUSED = 0,
    /// Eager PyTorch's intermediate roundings (Hugging Face's bits).
    NPK_ELEM_ROUNDING_EAGER = 1,
}

/// What EmbeddingDenseGrad does with an index outside its vocab shard.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_index_policy {
    /// Fail with `NPK_ERR_INDEX_OUT_OF_RANGE`, naming the first bad position.
    NPK_INDEX_ERROR = 0,
    /// Skip it (the natural policy for one shard of a vocab-parallel table).
    NPK_INDEX_IGNORE = 1,
}

// The header's enums and the library's enums must agree value by value.
const _: () = {
    assert!(NPK_MAX_DIMS == crate::tensor::MAX_DIMS);
    assert!(npk_dtype::NPK_F32 as u32 == DType::F32 as u32);
    assert!(npk_dtype::NPK_F16 as u32 == DType::F16 as u32);
    assert!(npk_dtype::NPK_BF16 as u32 == DType::BF16 as u32);
    assert!(npk_dtype::NPK_I32 as u32 == DType::I32 as u32);
    assert!(npk_dtype::NPK_I64 as u32 == DType::I64 as u32);
    assert!(npk_dtype::NPK_I16 as u32 == DType::I16 as u32);
    assert!(npk_dtype::NPK_U8 as u32 == DType::U8 as u32);
    assert!(npk_rounding::NPK_ROUNDING_FUSED as u32 == Rounding::Fused as u32);
    assert!(
        npk_rounding::NPK_ROUNDING_CAST_BEFORE_GAMMA as u32 == Rounding::CastBeforeGamma as u32
    );
    assert!(
        npk_elem_rounding::NPK_ELEM_ROUNDING_EAGER as u32
            == crate::ops::elementwise::ElemRounding::Eager as u32
    );
    // A C enum is int-sized; the raw aliases below must be too.
    assert!(core::mem::size_of::<npk_status>() == core::mem::size_of::<RawStatus>());
    assert!(core::mem::size_of::<DType>() == core::mem::size_of::<RawDtype>());
    assert!(core::mem::size_of::<Rounding>() == core::mem::size_of::<RawRounding>());
};

/// An `npk_status` as the C side may pass it: any `int` (printed as `npk_status`).
pub type RawStatus = i32;
/// An `npk_dtype` as the C side may pass it (printed as `npk_dtype`).
pub type RawDtype = u32;
/// An `npk_isa` as the C side may pass it (printed as `npk_isa`).
pub type RawIsa = u32;
/// An `npk_backend_kind` as the C side may pass it (printed as `npk_backend_kind`).
pub type RawBackendKind = u32;
/// An `npk_rounding` as the C side may pass it (printed as `npk_rounding`).
pub type RawRounding = u32;
/// An `npk_elem_rounding` as the C side may pass it (printed as `npk_elem_rounding`).
pub type RawElemRounding = u32;
/// An `npk_index_policy` as the C side may pass it (printed as `npk_index_policy`).
pub type RawIndexPolicy = u32;

/// What went wrong, filled through `npk_exec.detail`.
///
/// Filled by every call that has an `exec` with a non-NULL `detail`: on
/// error with the status, the offending argument, the index position/value
/// (`-1` for other errors; for `NPK_ERR_BACKEND`, `value` holds the status
/// the foreign backend returned, or -1 when the host `parallel_for` broke
/// its contract, with `argument` "parallel_for") and a message; on success
/// it is reset (`NPK_OK`, empty strings, `-1`).
///
/// Threads: a call writes its detail without synchronization, so calls that
/// may run at the same time must not share one `npk_error_detail` (one
/// `npk_exec` pointing at one detail, used from two threads, can show one
/// thread's error overwritten by the other's success). Give each thread, or
/// each call, its own detail (an `npk_exec` is cheap to copy); the PyTorch
/// adapter makes one per call. Everything else an `npk_exec` points at is
/// only read, and may be shared.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_error_detail {
    /// The call's status.
    pub status: npk_status,
    /// The offending argument's name, NUL-terminated: "x", "gamma", "indices", ...
    pub argument: [c_char; 32],
    /// The first bad index's flat position, else -1.
    pub position: i64,
    /// That index's value (the foreign status for `NPK_ERR_BACKEND`), else -1.
    pub value: i64,
    /// One human sentence, NUL-terminated (truncated to fit).
    pub message: [c_char; 160],
}

/// A block task: `task(task_ctx, block)`.
pub type npk_task_fn = Option<unsafe extern "C" fn(task_ctx: *mut c_void, block: usize)>;

/// A host runner. Must call `task(task_ctx, b)` exactly once for every `b` in
/// `[0, n_blocks)`, on any threads, and return after all ran. `task` never
/// unwinds; the runner must not throw through it. A runner caught breaking
/// this (a block number out of range, or a call count other than `n_blocks`)
/// makes the operator return `NPK_ERR_BACKEND` with `detail.argument`
/// "parallel_for" (and `detail.value` -1); the outputs may then be partly
/// written.
pub type npk_parallel_for_fn = Option<
    unsafe extern "C" fn(
        runner_ctx: *mut c_void,
        n_blocks: usize,
        task: npk_task_fn,
        task_ctx: *mut c_void,
    ),
>;

/// Where and how a call runs. `exec` may be NULL: CPU backend, serial, ISA
/// auto, default tiling.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_exec {
    /// Unified Buffer bytes per block; 0 = 196608 (192 KiB); at least 1024.
    pub ub_bytes: u64,
    /// Blocks the plan is cut for; 0 = 64. The plan uses `min(blocks, rows)`.
    pub blocks: u32,
    /// ISA of the CPU backend. A forced ISA this CPU or build lacks (or above
    /// the `NPK_MAX_CPU_ISA` environment ceiling) is `NPK_ERR_ISA_UNAVAILABLE`,
    /// whichever backend runs.
    pub isa: RawIsa,
    /// CPU, reference or foreign, ORed (ABI 2.3) with at most one of
    /// `NPK_OUTPUTS_FRESH` / `NPK_OUTPUTS_RESIDENT`: what the caller knows
    /// about its output buffers' pages (neither: unknown). The hint decides
    /// only how large outputs are stored, never a bit of them.
    pub backend: RawBackendKind,
    /// NULL = run blocks serially on the calling thread.
    pub parallel_for: npk_parallel_for_fn,
    /// Passed to `parallel_for`.
    pub runner_ctx: *mut c_void,
    /// Required when `backend == NPK_BACKEND_FOREIGN`.
    pub foreign: *const super::foreign::npk_foreign_backend,
    /// Optional: filled on error (and reset on success).
    pub detail: *mut npk_error_detail,
}

/// Options of RmsNorm and AddRmsNorm. NULL options = `{ 1e-6, 0.0f,
/// NPK_ROUNDING_FUSED }`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_rms_norm_options {
    /// Added to the mean square; finite and >= 0.
    pub eps: f64,
    /// Added to gamma (1.0 for Gemma's zero-centred weights).
    pub gamma_offset: f32,
    /// Where y is rounded.
    pub rounding: RawRounding,
}

/// Options of RmsNormGrad. NULL options = `{ 0.0f, 0 }`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_rms_norm_grad_options {
    /// The forward's gamma offset.
    pub gamma_offset: f32,
    /// Nonzero: `dgamma += sum` (needs a dgamma); 0: `dgamma = sum`.
    pub accumulate_dgamma: u8,
}

/// Reads an `npk_tensor` the caller passed, checking its dtype value.
///
/// # Safety
/// `p` is NULL or points to readable memory of `npk_tensor`'s size.
pub(crate) unsafe fn read_tensor(p: *const RawTensor, arg: &'static str) -> Result<RawTensor> {
    if p.is_null() {
        return Err(Error::NullPointer { arg });
    }
    // SAFETY: `p` is non-NULL and readable (caller). Every field is read
    // through a raw pointer; `dtype` as a u32, so no invalid `DType` is
    // ever materialized.
    let (data, dtype, ndim, shape) = unsafe {
        (
            core::ptr::addr_of!((*p).data).read_unaligned(),
            core::ptr::addr_of!((*p).dtype)
                .cast::<RawDtype>()
                .read_unaligned(),
            core::ptr::addr_of!((*p).ndim).read_unaligned(),
            core::ptr::addr_of!((*p).shape).read_unaligned(),
        )
    };
    // ok_or_else: the reason is formatted only on the error path (ok_or
    // formatted it on every tensor of every call).
    let dtype = DType::from_u32(dtype).ok_or_else(|| {
        crate::error::dtype_err!(arg, "dtype code {dtype} is not an npk_dtype value")
    })?;
    Ok(RawTensor {
        data,
        dtype,
        ndim,
        shape,
    })
}

/// `read_tensor` for a nullable tensor argument: NULL is `None`.
///
/// # Safety
/// As for `read_tensor`.
pub(crate) unsafe fn read_opt_tensor(
    p: *const RawTensor,
    arg: &'static str,
) -> Result<Option<RawTensor>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded from the caller.
    unsafe { read_tensor(p, arg) }.map(Some)
}

/// The C ABI's `double eps` as the f32 the kernels add: finite and >= 0, and
/// still finite as an f32.
fn eps_from_f64(eps: f64) -> Result<f32> {
    let e = eps as f32;
    if !(eps.is_finite() && eps >= 0.0 && e.is_finite()) {
        return Err(crate::error::invalid_fmt!(
            "eps",
            "{eps} is not finite and >= 0 as an f32"
        ));
    }
    Ok(e)
}

/// Reads optional RmsNorm options (NULL = defaults).
///
/// # Safety
/// `p` is NULL or points to a readable `npk_rms_norm_options`.
pub(crate) unsafe fn read_norm_options(p: *const npk_rms_norm_options) -> Result<RmsNormOptions> {
    if p.is_null() {
        return Ok(RmsNormOptions::default());
    }
    // SAFETY: non-NULL and readable (caller); every field is a plain number.
    let o = unsafe { p.read_unaligned() };
    let rounding = match o.rounding {
        0 => Rounding::Fused,
        1 => Rounding::CastBeforeGamma,
        _ => {
            return Err(crate::error::invalid_fmt!(
                "rounding",
                "{} is not an npk_rounding value",
                o.rounding
            ))
        }
    };
    Ok(RmsNormOptions {
        eps: eps_from_f64(o.eps)?,
        gamma_offset: o.gamma_offset,
        rounding,
    })
}

/// An `npk_elem_rounding` value read from C.
pub(crate) fn elem_rounding(v: RawElemRounding) -> Result<crate::ops::elementwise::ElemRounding> {
    crate::ops::elementwise::ElemRounding::from_u32(v).ok_or_else(|| {
        crate::error::invalid_fmt!("rounding", "{v} is not an npk_elem_rounding value")
    })
}

/// Reads optional RmsNormGrad options (NULL = defaults).
///
/// # Safety
/// `p` is NULL or points to a readable `npk_rms_norm_grad_options`.
pub(crate) unsafe fn read_grad_options(
    p: *const npk_rms_norm_grad_options,
) -> Result<RmsNormGradOptions> {
    if p.is_null() {
        return Ok(RmsNormGradOptions::default());
    }
    // SAFETY: non-NULL and readable (caller); every field is a plain number.
    let o = unsafe { p.read_unaligned() };
    Ok(RmsNormGradOptions {
        gamma_offset: o.gamma_offset,
        // C's boolean convention: any nonzero value means yes.
        dgamma_mode: if o.accumulate_dgamma != 0 {
            DgammaMode::Accumulate
        } else {
            DgammaMode::Overwrite
        },
    })
}

#[cfg(test)]
mod tests {
    use super::npk_isa;
    use crate::lanes::Isa;

    /// The header names every ISA of the list, with the list's value and name.
    #[test]
    fn the_header_names_every_isa() {
        for isa in Isa::ALL {
            let c = npk_isa::of(isa);
            assert_ne!(c, npk_isa::NPK_ISA_AUTO, "{isa} has no npk_isa name");
            assert_eq!(c as u32, isa as u32);
        }
        assert_eq!(npk_isa::NAMED.len(), Isa::ALL.len());
    }
}
