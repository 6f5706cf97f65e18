//! `npk_attention*`: a skin over `ops::attention::{plan, prepare}` (the
//! shared shape is `capi::skin`). Like aclnnFlashAttentionScore and
//! aclnnFlashAttentionScoreGrad, the forward and the backward are two
//! operators' worth of entry points over one call struct. ABI 2.11.

#![allow(non_camel_case_types)]

use core::ffi::c_void;

use crate::capi::skin::{self, CapiCall, CapiOp};
use crate::capi::types::{npk_exec, npk_status, read_tensor};
use crate::error::{invalid_fmt, Result};
use crate::ops::attention::{
    plan, prepare, AttentionCall, AttentionInputs, AttentionLayout, AttentionOptions,
    AttentionOutputs,
};
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// Options of Attention. NULL options = not causal, BNSD, scale
/// `1 / sqrt(head_dim)` (SDPA's defaults). ABI 2.11.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_attention_options {
    /// Nonzero: query i sees keys `j <= i` (SDPA's `is_causal`).
    pub causal: u32,
    /// `npk_attention_layout`; another value is `NPK_ERR_PARAM_INVALID`
    /// (argument `layout`).
    pub layout: u32,
    /// The scores' factor; finite.
    pub scale: f32,
    /// Must be 0.
    pub reserved: u32,
}

/// `npk_attention_options.layout`: q, k, v and their outputs'. ABI 2.11.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_attention_layout {
    /// `[batch, heads, seq, head_dim]`.
    NPK_ATTENTION_BNSD = 0,
    /// `[batch, seq, heads, head_dim]`.
    NPK_ATTENTION_BSND = 1,
}

const _: () = {
    assert!(npk_attention_layout::NPK_ATTENTION_BNSD as u32 == AttentionLayout::Bnsd as u32);
    assert!(npk_attention_layout::NPK_ATTENTION_BSND as u32 == AttentionLayout::Bsnd as u32);
};

/// Reads optional options; NULL's scale is `1 / sqrt(q's last dim)`.
///
/// # Safety
/// `p` is NULL or points to a readable `npk_attention_options`.
unsafe fn read_options(p: *const npk_attention_options, q: &RawTensor) -> Result<AttentionOptions> {
    if p.is_null() {
        let n = q.ndim.clamp(1, crate::tensor::MAX_DIMS as u32) as usize;
        let d = q.shape[n - 1].max(1) as f64;
        return Ok(AttentionOptions {
            causal: false,
            scale: (1.0 / crate::lanes::sqrt_f64(d)) as f32,
            layout: AttentionLayout::Bnsd,
        });
    }
    // SAFETY: non-NULL and readable (caller); every field is a plain number.
    let o = unsafe { p.read_unaligned() };
    let layout = match o.layout {
        0 => AttentionLayout::Bnsd,
        1 => AttentionLayout::Bsnd,
        v => {
            return Err(invalid_fmt!(
                "layout",
                "{v} is not an npk_attention_layout (0 BNSD, 1 BSND)"
            ))
        }
    };
    if o.reserved != 0 {
        return Err(invalid_fmt!("reserved", "{} is not 0", o.reserved));
    }
    Ok(AttentionOptions {
        causal: o.causal != 0,
        scale: o.scale,
        layout,
    })
}

/// Attention's C skin, forward (`BACKWARD` false) or backward.
struct Skin<const BACKWARD: bool>;

impl<const BACKWARD: bool> CapiOp for Skin<BACKWARD> {
    type Args = (
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
        *const npk_attention_options,
    );
    type Inputs = AttentionInputs;

    unsafe fn read((q, k, v, opts): Self::Args) -> Result<AttentionInputs> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            let q = read_tensor(q, "q")?;
            let k = read_tensor(k, "k")?;
            let v = read_tensor(v, "v")?;
            let o = read_options(opts, &q)?;
            Ok(AttentionInputs::new(q, k, v, &o, BACKWARD))
        }
    }

    fn plan(inp: &AttentionInputs, ub: &UbConfig) -> Result<u64> {
        Ok(plan(inp, ub)?.workspace_bytes)
    }
}

/// The run's tensors beside q, k, v, in the C argument order:
/// `out, dout, softmax_max, softmax_sum, dq, dk, dv` (forward: `dout`,
/// `dq`, `dk`, `dv` NULL).
type Tensors = [*const RawTensor; 7];

impl<const BACKWARD: bool> CapiCall for Skin<BACKWARD> {
    type Outputs = Tensors;
    type Call = AttentionCall;

    unsafe fn prepare(inp: AttentionInputs, t: Tensors, ub: &UbConfig) -> Result<AttentionCall> {
        // SAFETY: every pointer is NULL or valid (the caller's).
        let outs = unsafe {
            let out = read_tensor(t[0], "out")?;
            let mx = read_tensor(t[2], "softmax_max")?;
            let sm = read_tensor(t[3], "softmax_sum")?;
            if BACKWARD {
                AttentionOutputs {
                    out,
                    dout: read_tensor(t[1], "dout")?,
                    softmax_max: mx,
                    softmax_sum: sm,
                    dq: read_tensor(t[4], "dq")?,
                    dk: read_tensor(t[5], "dk")?,
                    dv: read_tensor(t[6], "dv")?,
                }
            } else {
                AttentionOutputs::forward(out, mx, sm)
            }
        };
        prepare(&inp, &outs, ub)
    }
}

/// Workspace bytes `npk_attention` needs (the same q, k, v and options as
/// the run): one arena per worker, about `4 (3 kv_pad + 84) head_dim +
/// 2 * 336 kv_pad` bytes (kv_pad: the keys plus 16, up to 32).
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_attention_workspace_size(
    q: *const RawTensor,
    k: *const RawTensor,
    v: *const RawTensor,
    opts: *const npk_attention_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::workspace_size::<Skin<false>>((q, k, v, opts), exec, workspace_bytes) }
}

/// The forward: `out = softmax(scale q k^T) v` per head (causal: query i
/// sees keys `j <= i`), q `[B, Hq, Sq, D]` (BSND: `[B, Sq, Hq, D]`), k and
/// v `[B, Hkv, Skv, D]` with Hkv dividing Hq, one dtype of f32, f16, bf16;
/// `out` q's shape and dtype; `softmax_max`, `softmax_sum` `[B, Hq, Sq]`
/// f32 (what the backward reads). f32 inside, each sum in one fixed order:
/// the same bits on every ISA and thread count. On error nothing is
/// written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_attention(
    q: *const RawTensor,
    k: *const RawTensor,
    v: *const RawTensor,
    opts: *const npk_attention_options,
    out: *const RawTensor,
    softmax_max: *const RawTensor,
    softmax_sum: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    let null = core::ptr::null();
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::launch::<Skin<false>>(
            (q, k, v, opts),
            [out, null, softmax_max, softmax_sum, null, null, null],
            workspace,
            workspace_bytes,
            exec,
        )
    }
}

/// Workspace bytes `npk_attention_backward` needs.
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_attention_backward_workspace_size(
    q: *const RawTensor,
    k: *const RawTensor,
    v: *const RawTensor,
    opts: *const npk_attention_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::workspace_size::<Skin<true>>((q, k, v, opts), exec, workspace_bytes) }
}

/// The backward: `dq` (q's shape), `dk`, `dv` (k's) from q, k, v, the
/// forward's `out`, `softmax_max`, `softmax_sum` and the output's gradient
/// `dout` (out's shape), with the forward's options. dk and dv sum over the
/// query heads sharing a key/value head and over rows, in one fixed order.
/// On error nothing is written.
///
/// # Safety
/// As `npk_attention`.
#[no_mangle]
pub unsafe extern "C" fn npk_attention_backward(
    q: *const RawTensor,
    k: *const RawTensor,
    v: *const RawTensor,
    out: *const RawTensor,
    dout: *const RawTensor,
    softmax_max: *const RawTensor,
    softmax_sum: *const RawTensor,
    opts: *const npk_attention_options,
    dq: *const RawTensor,
    dk: *const RawTensor,
    dv: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::launch::<Skin<true>>(
            (q, k, v, opts),
            [out, dout, softmax_max, softmax_sum, dq, dk, dv],
            workspace,
            workspace_bytes,
            exec,
        )
    }
}
