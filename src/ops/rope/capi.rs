//! `npk_rope_workspace_size` / `npk_rope`: a skin over
//! `ops::rope::{plan, prepare}` (the shared shape is `capi::skin`).

use core::ffi::c_void;

use crate::capi::skin::{self, CapiCall, CapiOp};
use crate::capi::types::{
    elem_rounding, npk_exec, npk_status, read_opt_tensor, read_tensor, RawElemRounding,
};
use crate::error::Result;
use crate::ops::rope::{plan, prepare, RopeCall, RopeOptions};
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// Options of RoPE. NULL options = `{ NPK_ELEM_ROUNDING_FUSED, 0 }`. ABI 2.2.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_rope_options {
    /// Fused, or eager PyTorch's bits (each product rounded, then the sum).
    pub rounding: RawElemRounding,
    /// Nonzero: the backward (q and k are output gradients).
    pub backward: u32,
}

/// Reads optional RoPE options (NULL = defaults).
///
/// # Safety
/// `p` is NULL or points to a readable `npk_rope_options`.
unsafe fn read_rope_options(p: *const npk_rope_options) -> Result<RopeOptions> {
    if p.is_null() {
        return Ok(RopeOptions::default());
    }
    // SAFETY: non-NULL and readable (caller); every field is a plain number.
    let o = unsafe { p.read_unaligned() };
    Ok(RopeOptions {
        rounding: elem_rounding(o.rounding)?,
        backward: o.backward != 0,
    })
}

/// RoPE's C skin.
struct Skin;

impl CapiOp for Skin {
    type Args = (
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
        *const npk_rope_options,
    );
    type Inputs = (
        RawTensor,
        Option<RawTensor>,
        RawTensor,
        RawTensor,
        RopeOptions,
    );

    unsafe fn read((q, k, cos, sin, opts): Self::Args) -> Result<Self::Inputs> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            Ok((
                read_tensor(q, "q")?,
                read_opt_tensor(k, "k")?,
                read_tensor(cos, "cos")?,
                read_tensor(sin, "sin")?,
                read_rope_options(opts)?,
            ))
        }
    }

    fn plan((q, k, cos, sin, opts): &Self::Inputs, ub: &UbConfig) -> Result<u64> {
        Ok(plan(q, k.as_ref(), cos, sin, opts, ub)?.workspace_bytes)
    }
}

impl CapiCall for Skin {
    type Outputs = (*const RawTensor, *const RawTensor);
    type Call = RopeCall;

    unsafe fn prepare(
        (q, k, cos, sin, opts): Self::Inputs,
        (q_out, k_out): Self::Outputs,
        ub: &UbConfig,
    ) -> Result<RopeCall> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        let (q_out, k_out) = unsafe {
            (
                read_tensor(q_out, "q_out")?,
                read_opt_tensor(k_out, "k_out")?,
            )
        };
        let (k, k_out) = (k.as_ref(), k_out.as_ref());
        prepare(&q, k, &cos, &sin, &opts, &q_out, k_out, ub)
    }
}

/// Workspace bytes `npk_rope` needs (0; the same arguments as the run).
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_rope_workspace_size(
    q: *const RawTensor,
    k: *const RawTensor,
    cos: *const RawTensor,
    sin: *const RawTensor,
    opts: *const npk_rope_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::workspace_size::<Skin>((q, k, cos, sin, opts), exec, workspace_bytes) }
}

/// RoPE (rotate-half) of `q` and, if not NULL, `k` (`[..., head_dim]`, one
/// dtype, head_dim even) by `cos` and `sin` (one shape, q's dtype or f32,
/// broadcast to q and k from the right): `q_out` and `k_out` (NULL exactly
/// when `k` is). With `opts->backward`, q and k are gradients. Outputs may
/// not overlap inputs. On error nothing is written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_rope(
    q: *const RawTensor,
    k: *const RawTensor,
    cos: *const RawTensor,
    sin: *const RawTensor,
    opts: *const npk_rope_options,
    q_out: *const RawTensor,
    k_out: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::launch::<Skin>(
            (q, k, cos, sin, opts),
            (q_out, k_out),
            workspace,
            workspace_bytes,
            exec,
        )
    }
}
