//! Matmul (aclnnMatmul's analog): `c = op(a) op(b)` with `op` the identity
//! or the transpose, a and b f32, f16 or bf16 (one dtype), c a's dtype or
//! f32. Inside, every product is accumulated in f32 by one fused
//! multiply-add, `k` ascending from 0 (or from c's value, `accumulate`),
//! and the result is rounded once to c's dtype. That order is fixed by K
//! alone, and the FMA is exact on every ISA (`Lanes::mul_add`), so c has the
//! same bits on every ISA, thread count and plan.
//!
//! `MatmulMath::Bf16Dot` (bf16 only) sums as VDPBF16PS does instead: pairs
//! of steps, the odd one first, subnormals flushed. The instruction runs it
//! on AVX512-BF16 lanes (`pairs.rs`: panels of bf16 pairs, about twice the
//! chain's rate on AMD Zen 4 and 5), the FMA chain on swapped, flushed
//! panels with each sum flushed everywhere else (`pack.rs`'s `DOT`): the
//! same bits on every ISA too.
//! `MatmulMath::Bf16DotArm` (bf16 only) sums as Arm's BFDOT and BFMMLA do
//! (pairs, round to odd): BFMMLA on the NEON BF16 lanes, an exact scalar
//! model elsewhere (`arm_dot.rs`), on the same pair panels.
//!
//! The kernel is BLIS's: cache blocks from `plan.rs` (output tiles over the
//! workers, K in `kc` slices, `mc`-row A blocks), operands widened to f32
//! while packing (`pack.rs`), and one register-blocked microkernel per lanes
//! type (`ukernel.rs`), the only ISA-specific part.

mod arm_dot;
#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
mod pack;
mod pairs;
mod plan;
pub(crate) mod reference;
pub(crate) mod ukernel;

pub(crate) use plan::{plan, prepare};
pub use plan::{MatmulTiling, MATMUL_KC, MATMUL_MC, MATMUL_NC};

use core::ffi::c_void;

use super::{launch_into, op_call, workspace_len, Exec};
use crate::dtype::Float;
use crate::error::Result;
use crate::tensor::{RawTensor, TensorRef};

/// How a Matmul sums its products (aclnnMatmul's `cubeMathType`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulMath {
    /// One f32 FMA per product, k ascending, one rounding: the same bits on
    /// every ISA (the default).
    #[default]
    Chain = 0,
    /// bf16 a and b only: the products summed as VDPBF16PS sums them, a
    /// pair of steps at a time (`c + a[k+1] b[k+1]`, then `+ a[k] b[k]`,
    /// each one FMA; an odd K's last step alone after a zero one), with
    /// subnormal inputs read as zero (its DAZ) and tiny sums written as
    /// zero (its FTZ, tininess after rounding to 24 bits as x86 detects
    /// it: a sum IEEE rounds up to `2^-126` from below `2^-126 - 2^-151` is
    /// zero too). VDPBF16PS runs it where the CPU has AVX512-BF16: about twice
    /// the FMA chain's rate on AMD Zen 4 and 5, where that instruction runs
    /// at twice the FMA's, (about half of it on Intel's). Every other ISA
    /// gets the same bits from an FMA chain with the flushes, several times
    /// slower than `Chain`.
    Bf16Dot = 1,
    /// bf16 a and b only: the products summed as Arm's `BFDOT` and
    /// `BFMMLA` sum them (FEAT_BF16, FPCR.EBF 0), a pair of steps at a
    /// time: `t = a[k] b[k] + a[k+1] b[k+1]`, then `c + t`, each sum
    /// rounded to odd (truncated, its last bit set when inexact), subnormal
    /// inputs and starting sums read as zero, a result below 2^-126 before
    /// rounding written as zero, one of 2^128 or more as infinity; an odd
    /// K's last step with a zero one (`arm_dot.rs`). `BFMMLA` (and `BFDOT`)
    /// runs it on the NEON BF16 lanes (Neoverse V1 and later, Graviton 3
    /// and 4); every
    /// other ISA gets the same bits from an exact scalar model, many times
    /// slower than `Chain` (for checking an Arm result anywhere). ABI 2.13.
    Bf16DotArm = 2,
}

/// Options of Matmul (`npk_matmul_options`; `math`: `npk_matmul_v2_options`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MatmulOptions {
    /// a is stored `[K, M]` (`op(a) = a^T`).
    pub trans_a: bool,
    /// b is stored `[N, K]` (`op(b) = b^T`: torch's `Linear.weight`).
    pub trans_b: bool,
    /// `c += a b` into an f32 c: c's value starts each element's sum (a
    /// weight gradient accumulated over micro-batches).
    pub accumulate: bool,
    /// How the products are summed.
    pub math: MatmulMath,
}

/// The validated arguments of one Matmul (`npk_matmul_call`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MatmulCall {
    /// `[M, K]`, or `[K, M]` with `trans_a`.
    pub a: RawTensor,
    /// `[K, N]`, or `[N, K]` with `trans_b`; a's dtype.
    pub b: RawTensor,
    /// `[M, N]`, a's dtype or f32 (f32 with `accumulate`).
    pub c: RawTensor,
    /// 1: a is transposed.
    pub trans_a: u32,
    /// 1: b is transposed.
    pub trans_b: u32,
    /// 1: c's value starts the sum.
    pub accumulate: u32,
    /// The plan: output tiles, cache blocks, per-worker packing arenas.
    pub tiling: MatmulTiling,
    /// The caller's workspace (the packing arenas).
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
    /// `MatmulMath`: 0 the FMA chain, 1 the bf16 pair dot (ABI 2.10; a
    /// backend built before reads a 2.9 call without it), 2 Arm's (ABI
    /// 2.13).
    pub math: u32,
    /// Padding (0).
    pub reserved: u32,
}

op_call!(
    MatmulCall,
    |c| c.tiling.m == 0 || c.tiling.n == 0,
    [a, b, c]
);

/// Workspace bytes `matmul` needs: one packing arena per worker (`blocks`
/// of `exec.ub`, at most one per output tile).
pub fn matmul_workspace_size<T: Float>(
    exec: &Exec<'_>,
    a: TensorRef<'_, T>,
    b: TensorRef<'_, T>,
    out_dtype: crate::dtype::DType,
    opts: &MatmulOptions,
) -> Result<usize> {
    let t = plan(&a.raw(), &b.raw(), out_dtype, opts, &exec.ub)?;
    workspace_len(t.workspace_bytes)
}

/// `c = op(a) op(b)` (or `c += ...` with `opts.accumulate`): a `[M, K]` (or
/// `[K, M]`), b `[K, N]` (or `[N, K]`), c `[M, N]` row-major, c's element
/// type a's or f32. On error nothing is written.
pub fn matmul<T: Float, O: Float>(
    exec: &Exec<'_>,
    a: TensorRef<'_, T>,
    b: TensorRef<'_, T>,
    opts: &MatmulOptions,
    c: &mut [O],
    workspace: &mut [u8],
) -> Result<()> {
    let (ar, br) = (a.raw(), b.raw());
    let (m, n) = plan::out_dims(&ar, &br, opts)?;
    let shape = crate::tensor::Shape::new_named(&[m, n], "c")?;
    let cr = crate::tensor::out_like(c, &shape, "c", "op(a) op(b)")?;
    let call = prepare(&ar, &br, opts, &cr, &exec.ub)?;
    launch_into(exec, call, workspace)
}
