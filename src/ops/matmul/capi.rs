//! `npk_matmul_workspace_size` / `npk_matmul`: a skin over
//! `ops::matmul::{plan, prepare}` (the shared shape is `capi::skin`). Like
//! aclnnMatmulGetWorkspaceSize, the size call takes the output's
//! descriptor too: its dtype is part of the plan. `npk_matmul_v2*` (ABI
//! 2.10) take the math option too (`npk_matmul_v2_options`: the options
//! struct could not grow).

#![allow(non_camel_case_types)]

use core::ffi::c_void;

use crate::capi::skin::{self, CapiCall, CapiOp};
use crate::capi::types::{npk_exec, npk_status, read_tensor};
use crate::error::Result;
use crate::ops::matmul::{plan, prepare, MatmulCall, MatmulMath, MatmulOptions};
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// Options of Matmul. NULL options = `{ 0, 0, 0 }`. ABI 2.8.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_matmul_options {
    /// Nonzero: a is stored `[K, M]`.
    pub trans_a: u32,
    /// Nonzero: b is stored `[N, K]` (a Linear layer's weight).
    pub trans_b: u32,
    /// Nonzero: `c += a b` into an f32 c (c's value starts each sum).
    pub accumulate: u32,
}

/// Reads optional Matmul options (NULL = defaults).
///
/// # Safety
/// `p` is NULL or points to a readable `npk_matmul_options`.
unsafe fn read_matmul_options(p: *const npk_matmul_options) -> MatmulOptions {
    if p.is_null() {
        return MatmulOptions::default();
    }
    // SAFETY: non-NULL and readable (caller); every field is a plain number.
    let o = unsafe { p.read_unaligned() };
    MatmulOptions {
        trans_a: o.trans_a != 0,
        trans_b: o.trans_b != 0,
        accumulate: o.accumulate != 0,
        math: MatmulMath::Chain,
    }
}

/// Options of `npk_matmul_v2`: `npk_matmul_options` and how the products
/// are summed. NULL options = `{ 0, 0, 0, NPK_MATMUL_CHAIN }`. ABI 2.10.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_matmul_v2_options {
    /// Nonzero: a is stored `[K, M]`.
    pub trans_a: u32,
    /// Nonzero: b is stored `[N, K]` (a Linear layer's weight).
    pub trans_b: u32,
    /// Nonzero: `c += a b` into an f32 c (c's value starts each sum).
    pub accumulate: u32,
    /// `npk_matmul_math`: `NPK_MATMUL_CHAIN` (0), `NPK_MATMUL_BF16_DOT`
    /// (1) or `NPK_MATMUL_BF16_DOT_ARM` (2, ABI 2.13); another value is
    /// `NPK_ERR_PARAM_INVALID` (argument `math`).
    pub math: u32,
}

/// `npk_matmul_v2_options.math`: how a Matmul sums its products (like
/// aclnnMatmul's `cubeMathType`). ABI 2.10.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_matmul_math {
    /// One f32 FMA per product, k ascending, one rounding: the same bits
    /// on every ISA (`npk_matmul`'s).
    NPK_MATMUL_CHAIN = 0,
    /// bf16 only: VDPBF16PS's pairs (the odd step first, subnormals read
    /// and written as zero); the instruction where the CPU has
    /// AVX512-BF16, the same bits from a flushed FMA chain elsewhere.
    NPK_MATMUL_BF16_DOT = 1,
    /// bf16 only: Arm's BFDOT / BFMMLA sums (pairs, each sum rounded to
    /// odd, subnormals read and written as zero); the instruction on the
    /// NEON BF16 lanes, the same bits from an exact scalar model elsewhere.
    /// ABI 2.13.
    NPK_MATMUL_BF16_DOT_ARM = 2,
}

const _: () = {
    assert!(npk_matmul_math::NPK_MATMUL_CHAIN as u32 == MatmulMath::Chain as u32);
    assert!(npk_matmul_math::NPK_MATMUL_BF16_DOT as u32 == MatmulMath::Bf16Dot as u32);
    assert!(npk_matmul_math::NPK_MATMUL_BF16_DOT_ARM as u32 == MatmulMath::Bf16DotArm as u32);
};

/// Reads optional v2 options (NULL = defaults).
///
/// # Safety
/// `p` is NULL or points to a readable `npk_matmul_v2_options`.
unsafe fn read_matmul_v2_options(p: *const npk_matmul_v2_options) -> Result<MatmulOptions> {
    if p.is_null() {
        return Ok(MatmulOptions::default());
    }
    // SAFETY: non-NULL and readable (caller); every field is a plain number.
    let o = unsafe { p.read_unaligned() };
    let math = match o.math {
        0 => MatmulMath::Chain,
        1 => MatmulMath::Bf16Dot,
        2 => MatmulMath::Bf16DotArm,
        v => {
            return Err(crate::error::invalid_fmt!(
                "math",
                "{v} is not an npk_matmul_math (0 chain, 1 bf16 dot, 2 bf16 dot arm)"
            ))
        }
    };
    Ok(MatmulOptions {
        trans_a: o.trans_a != 0,
        trans_b: o.trans_b != 0,
        accumulate: o.accumulate != 0,
        math,
    })
}

/// A Matmul options struct of the C ABI, read as `MatmulOptions`.
trait ReadOptions {
    /// Reads optional options (NULL = defaults).
    ///
    /// # Safety
    /// `p` is NULL or points to a readable `Self`.
    unsafe fn read(p: *const Self) -> Result<MatmulOptions>;
}

impl ReadOptions for npk_matmul_options {
    unsafe fn read(p: *const Self) -> Result<MatmulOptions> {
        // SAFETY: forwarded.
        Ok(unsafe { read_matmul_options(p) })
    }
}

impl ReadOptions for npk_matmul_v2_options {
    unsafe fn read(p: *const Self) -> Result<MatmulOptions> {
        // SAFETY: forwarded.
        unsafe { read_matmul_v2_options(p) }
    }
}

/// Matmul's C skin, for `npk_matmul`'s options (`O`) or v2's.
struct Skin<O>(core::marker::PhantomData<O>);

impl<O: ReadOptions> CapiOp for Skin<O> {
    type Args = (
        *const RawTensor,
        *const RawTensor,
        *const O,
        *const RawTensor,
    );
    type Inputs = (RawTensor, RawTensor, MatmulOptions, RawTensor);

    unsafe fn read((a, b, opts, c): Self::Args) -> Result<Self::Inputs> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            Ok((
                read_tensor(a, "a")?,
                read_tensor(b, "b")?,
                O::read(opts)?,
                read_tensor(c, "c")?,
            ))
        }
    }

    fn plan((a, b, opts, c): &Self::Inputs, ub: &UbConfig) -> Result<u64> {
        Ok(plan(a, b, c.dtype, opts, ub)?.workspace_bytes)
    }
}

impl<O: ReadOptions> CapiCall for Skin<O> {
    type Outputs = ();
    type Call = MatmulCall;

    unsafe fn prepare((a, b, opts, c): Self::Inputs, _: (), ub: &UbConfig) -> Result<MatmulCall> {
        prepare(&a, &b, &opts, &c, ub)
    }
}

/// Workspace bytes `npk_matmul` needs (the same arguments as the run; `c`'s
/// data is not read): one packing arena per worker (`exec`'s `blocks`, at
/// most one per 168 x 512 output tile), about 0.7 MiB each (1.4 MiB with a
/// 16-bit c and K > 256).
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_matmul_workspace_size(
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_matmul_options,
    c: *const RawTensor,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::workspace_size::<Skin<npk_matmul_options>>((a, b, opts, c), exec, workspace_bytes)
    }
}

/// `c = op(a) op(b)` (`c += ...` with `opts->accumulate`, c f32): a `[M, K]`
/// (`[K, M]` with `trans_a`), b `[K, N]` (`[N, K]` with `trans_b`), one
/// dtype of f32, f16, bf16; c `[M, N]`, a's dtype or f32. f32 inside, one
/// FMA per product with k ascending, one rounding: the same bits on every
/// ISA and thread count. c may not overlap a or b. On error nothing is
/// written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_matmul(
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_matmul_options,
    c: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::launch::<Skin<npk_matmul_options>>(
            (a, b, opts, c),
            (),
            workspace,
            workspace_bytes,
            exec,
        )
    }
}

/// `npk_matmul_workspace_size` with v2 options (the math option). ABI 2.10.
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_matmul_v2_workspace_size(
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_matmul_v2_options,
    c: *const RawTensor,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::workspace_size::<Skin<npk_matmul_v2_options>>((a, b, opts, c), exec, workspace_bytes)
    }
}

/// `npk_matmul` with v2 options: `math = NPK_MATMUL_BF16_DOT` sums bf16
/// products as VDPBF16PS does (pairs, the odd step first, subnormal inputs
/// and sums as zero): the same bits on every ISA and thread count, on
/// VDPBF16PS where the CPU has AVX512-BF16 (about twice the chain's rate
/// on AMD Zen 4 and 5), a slower flushed FMA chain elsewhere. A non-bf16
/// a with it is `NPK_ERR_PARAM_INVALID` (argument `math`). ABI 2.10.
/// `math = NPK_MATMUL_BF16_DOT_ARM` (ABI 2.13) sums as Arm's BFDOT does
/// (pairs, each sum rounded to odd): the instruction on the NEON BF16
/// lanes, an exact scalar model (far slower) elsewhere.
///
/// # Safety
/// As `npk_matmul`.
#[no_mangle]
pub unsafe extern "C" fn npk_matmul_v2(
    a: *const RawTensor,
    b: *const RawTensor,
    opts: *const npk_matmul_v2_options,
    c: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::launch::<Skin<npk_matmul_v2_options>>(
            (a, b, opts, c),
            (),
            workspace,
            workspace_bytes,
            exec,
        )
    }
}
