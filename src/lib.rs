//! # npukern
//!
//! `no_std` SIMD training kernels — RmsNorm, AddRmsNorm, RmsNormGrad,
//! EmbeddingDenseGrad, and the gradient-health pass (`grad_stats`,
//! `clip_grad_norm`) — written the way an Ascend NPU operator is written: a
//! host tiling plan (`tiling`: blocks, Unified-Buffer-sized tiles, the
//! workspace layout), a launch over blocks (`runner`), and a backend that
//! runs them (`backend`: the CPU kernels on explicit SIMD lanes, 16 logical
//! f32 lanes per ISA; the f64 reference; or an adapter's NPU launch). All
//! arithmetic is f32 with one rounding per output, and results are bit-identical across thread counts, block counts,
//! UB sizes, batch sizes and ISAs (portable, AVX2, AVX-512, AVX512-BF16,
//! picked at run time). The C ABI (`capi`, header `include/npukern.h`) exposes the same
//! operators as aclnn-style two-phase calls.
//!
//! ```
//! use npukern::*;
//!
//! fn main() -> Result<(), npukern::Error> {
//!     let x: Vec<bf16> = (0..2 * 8).map(|i| bf16::from_f32(i as f32 - 7.5)).collect();
//!     let gamma = vec![bf16::from_f32(1.0); 8];
//!     let x = TensorRef::new(&x, &[2, 8])?;
//!     let gamma = TensorRef::new(&gamma, &[8])?;
//!     let exec = Exec::cpu();
//!     let opts = RmsNormOptions::default();
//!     let mut ws = vec![0u8; rms_norm_workspace_size(&exec, x, gamma, &opts)?];
//!     let (mut y, mut rstd) = (vec![bf16::ZERO; 16], vec![0f32; 2]);
//!     rms_norm(&exec, x, gamma, &opts, &mut y, Some(&mut rstd), &mut ws)?;
//!     let want = -7.5 / (21.25f32 + 1e-6).sqrt(); // row 0 is -7.5, -6.5, ..., -0.5
//!     assert!((y[0].to_f32() - want).abs() < 0.01);
//!     Ok(())
//! }
//! ```
//!
//! Every operator has the same two-phase shape (`<op>_workspace_size`, then
//! `<op>`: inputs as `TensorRef`, outputs as `&mut [T]`), runs on one `Exec`,
//! and either succeeds or returns an `Error` having written nothing.
#![cfg_attr(not(feature = "std"), no_std)]
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod backend;
#[cfg(feature = "capi")]
pub mod capi;
pub mod dtype;
pub mod error;
pub(crate) mod lanes;
pub mod ops;
pub mod runner;
pub mod tensor;
pub mod tensor_list;
pub mod tiling;
mod workspace;

/// The `bytemuck` crate (`Element` types are `bytemuck::Pod`: view them as bytes).
pub use bytemuck;
/// The `half` crate (its `f16` and `bf16` are two of the element types).
pub use half;
pub use half::{bf16, f16};

pub use backend::{Backend, Cpu, Reference, CPU_SERIAL};
pub use dtype::{DType, Element, Float};
pub use error::{Error, Reason, Result};
pub use lanes::Isa;
pub use ops::adamw::{
    adamw, adamw_with_formats, adamw_with_formats_workspace_size, adamw_with_scales,
    adamw_with_scales_workspace_size, adamw_workspace_size, q8_decode, q8_encode, q8_magnitude,
    q8_scale, q8_scales_len, AdamWCall, AdamWConsts, AdamWFormats, AdamWOptions, AdamWReport,
    AdamWScales, AdamWState, AdamWTensors, AdamWTiling, Q8Blocks, Q8Grid, ADAMW_AMSGRAD,
    ADAMW_CLIP, ADAMW_CLIP_COEF, ADAMW_FOUND_INF, ADAMW_GRAD_SCALE, ADAMW_L2, ADAMW_MAXIMIZE,
    ADAMW_SR_MOMENTS, ADAMW_SR_PARAMS, Q8_BLOCK,
};
pub use ops::add_rms_norm::{
    add_rms_norm, add_rms_norm_in_place, add_rms_norm_workspace_size, AddRmsNormCall,
};
pub use ops::attention::{
    attention, attention_backward, attention_workspace_size, AttentionCall, AttentionLayout,
    AttentionOptions, AttentionSaved, AttentionTiling, ATTENTION_ROWS,
};
pub use ops::cross_entropy::{
    cross_entropy, cross_entropy_fused, cross_entropy_fused_workspace_size, cross_entropy_grad,
    cross_entropy_grad_in_place, cross_entropy_grad_scale, cross_entropy_grad_workspace_size,
    cross_entropy_reduce, cross_entropy_workspace_size, CeMode, CrossEntropyCall,
    CrossEntropyOptions, CrossEntropyTargets, CrossEntropyTiling, Reduction,
};
pub use ops::elementwise::ElemRounding;
pub use ops::embedding_dense_grad::{
    embedding_dense_grad, embedding_dense_grad_workspace_size, EmbeddingDenseGradCall,
    EmbeddingGradOptions, IndexPolicy,
};
pub use ops::geglu::{
    geglu, geglu_workspace_size, gelu_mul, gelu_mul_workspace_size, GegluCall, GegluOptions,
    GeluApproximate,
};
pub use ops::geglu_grad::{
    geglu_grad, geglu_grad_workspace_size, gelu_mul_grad, gelu_mul_grad_workspace_size,
    GegluGradCall,
};
pub use ops::grad_stats::{
    clip_coefficient, clip_grad_norm, clip_grad_norm_raw, clip_grad_norm_workspace_size,
    grad_stats, grad_stats_raw, grad_stats_workspace_size, grad_stats_workspace_size_raw,
    ClipGradNormOptions, GradSummary, GradTensor, GradTensorMut, GradTiling,
};
pub use ops::matmul::{
    matmul, matmul_workspace_size, MatmulCall, MatmulMath, MatmulOptions, MatmulTiling, MATMUL_KC,
    MATMUL_MC, MATMUL_NC,
};
pub use ops::norm::{RmsNormOptions, Rounding};
pub use ops::rms_norm::{rms_norm, rms_norm_workspace_size, RmsNormCall};
pub use ops::rms_norm_grad::{
    rms_norm_grad, rms_norm_grad_in_place, rms_norm_grad_workspace_size, DgammaMode, DgammaOut,
    RmsNormGradCall, RmsNormGradInputs, RmsNormGradOptions,
};
pub use ops::rope::{rope, rope_workspace_size, RopeCall, RopeOptions};
pub use ops::swiglu::{
    silu_mul, silu_mul_workspace_size, swiglu, swiglu_workspace_size, SwigluCall, SwigluOptions,
};
pub use ops::swiglu_grad::{
    silu_mul_grad, silu_mul_grad_workspace_size, swiglu_grad, swiglu_grad_workspace_size,
    SwigluGradCall,
};
pub use ops::{Exec, Op, OpId};
#[cfg(feature = "std")]
pub use runner::Threads;
pub use runner::{Runner, Serial};
pub use tensor::{RawTensor, Shape, TensorMut, TensorRef, MAX_DIMS};
pub use tensor_list::{FlatTensor, FlatTensorMut};
pub use tiling::{
    EltTiling, EltUnit, EmbeddingTiling, NormTiling, OutputPages, UbConfig, NORM_FLAG_SERIAL,
    NORM_FLAG_STREAM, SERIAL_MAX_BYTES, STREAM_MIN_BYTES,
};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

#[doc = include_str!("../docs/rust.md")]
#[cfg(doctest)]
pub struct RustDocDoctests;

/// The crate version, "MAJOR.MINOR.PATCH".
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
