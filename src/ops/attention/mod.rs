//! Attention (aclnnFlashAttentionScore and its Grad's analog; PyTorch's
//! `scaled_dot_product_attention`): `out = softmax(scale q k^T) v` per head,
//! causal (query i sees keys j <= i, SDPA's `is_causal`) or not, with
//! grouped-query heads (query head h reads key/value head
//! `h / (heads_q / heads_kv)`), and its backward. No dropout, no mask
//! tensor.
//!
//! The forward keeps each row's softmax max and sum (f32, like
//! FlashAttentionScore's `softmax_max` / `softmax_sum`); the backward reads
//! them and recomputes the probabilities bit for bit. Inside, everything is
//! f32: each score one FMA chain over the head dim (ascending), then times
//! `scale`; `p = e^(s - max)`; the sum in the row sums' fixed order
//! (`lanes::RowSum`); `out = (sum_j p_j v_j) / sum`, the chain over keys
//! ascending. The backward: `P = p / sum`, `dP = dout v^T` (chains over the
//! head dim), `D = sum_d dout out` (a chain over the head dim, as dP), `dS = P (dP - D)`,
//! `dq = scale (dS k)`, `dk = scale (dS^T q)`, `dv = P^T dout` — dk and dv
//! summed over the group's query heads, then query rows, ascending. Every
//! element is one fixed chain: the same bits on every ISA, thread count
//! and block cut. Keys a causal row does not see are never read into its
//! sums (a NaN in a later token's value does not leak backwards).
//!
//! The kernel runs the matmul's microkernel (`matmul::ukernel`) on blocks
//! of query rows: a block's scores against all its keys sit in the arena
//! (one row of scores per query row, f32), so the softmax needs no
//! rescaling pass.

mod backward;
#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
mod panels;
mod plan;
pub(crate) mod reference;

pub(crate) use plan::{plan, prepare, AttentionInputs, AttentionOutputs};
pub use plan::{AttentionTiling, ATTENTION_ROWS};

use core::ffi::c_void;

use super::{launch_into, op_call, workspace_len, Exec};
use crate::dtype::Float;
use crate::error::Result;
use crate::tensor::{RawTensor, TensorRef};

/// How q, k, v and their outputs are laid out (FlashAttentionScore's
/// `inputLayout`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionLayout {
    /// `[batch, heads, seq, head_dim]` (SDPA's argument layout).
    #[default]
    Bnsd = 0,
    /// `[batch, seq, heads, head_dim]` (a projection's output viewed per
    /// head: no transpose copy).
    Bsnd = 1,
}

/// Options of Attention (`npk_attention_options`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionOptions {
    /// Query i sees keys `j <= i` (top-left aligned, as SDPA's
    /// `is_causal`).
    pub causal: bool,
    /// The scores' factor (SDPA's default: `1 / sqrt(head_dim)`); finite.
    pub scale: f32,
    /// The tensors' layout.
    pub layout: AttentionLayout,
}

impl Default for AttentionOptions {
    /// Not causal, scale 1, BNSD (set `scale` to `1 / sqrt(head_dim)` for
    /// SDPA's).
    fn default() -> Self {
        AttentionOptions {
            causal: false,
            scale: 1.0,
            layout: AttentionLayout::Bnsd,
        }
    }
}

/// The validated arguments of one Attention, forward or backward
/// (`npk_attention_call`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttentionCall {
    /// Queries: `[B, Hq, Sq, D]` (BNSD) or `[B, Sq, Hq, D]` (BSND).
    pub q: RawTensor,
    /// Keys: `[B, Hkv, Skv, D]` or `[B, Skv, Hkv, D]`, q's dtype.
    pub k: RawTensor,
    /// Values: k's shape and dtype.
    pub v: RawTensor,
    /// The output (forward: written; backward: read), q's shape and dtype.
    pub out: RawTensor,
    /// Each row's softmax max, `[B, Hq, Sq]` f32 (forward: written).
    pub softmax_max: RawTensor,
    /// Each row's softmax sum, `[B, Hq, Sq]` f32 (forward: written).
    pub softmax_sum: RawTensor,
    /// The output's gradient (backward), q's shape and dtype; empty forward.
    pub dout: RawTensor,
    /// q's gradient (backward, written); empty forward.
    pub dq: RawTensor,
    /// k's gradient (backward, written); empty forward.
    pub dk: RawTensor,
    /// v's gradient (backward, written); empty forward.
    pub dv: RawTensor,
    /// 1: the backward.
    pub backward: u32,
    /// 1: causal.
    pub causal: u32,
    /// `AttentionLayout`.
    pub layout: u32,
    /// The scores' factor.
    pub scale: f32,
    /// The plan: units of work, blocks, the per-worker arenas.
    pub tiling: AttentionTiling,
    /// The caller's workspace (the arenas).
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

op_call!(
    AttentionCall,
    |c| c.tiling.units == 0,
    [q, k, v, out, softmax_max, softmax_sum, dout, dq, dk, dv]
);

/// Workspace bytes `attention` (`backward` false) or `attention_backward`
/// (true) needs: one arena per worker, holding a key/value head's packed
/// keys and values and a block of query rows' scores.
pub fn attention_workspace_size<T: Float>(
    exec: &Exec<'_>,
    q: TensorRef<'_, T>,
    k: TensorRef<'_, T>,
    v: TensorRef<'_, T>,
    opts: &AttentionOptions,
    backward: bool,
) -> Result<usize> {
    let inp = AttentionInputs::new(q.raw(), k.raw(), v.raw(), opts, backward);
    let t = plan(&inp, &exec.ub)?;
    workspace_len(t.workspace_bytes)
}

/// The forward: `out` (q's shape) and each row's softmax max and sum
/// (`[B, Hq, Sq]` f32, what `attention_backward` reads). On error nothing
/// is written.
#[allow(clippy::too_many_arguments)]
pub fn attention<T: Float>(
    exec: &Exec<'_>,
    q: TensorRef<'_, T>,
    k: TensorRef<'_, T>,
    v: TensorRef<'_, T>,
    opts: &AttentionOptions,
    out: &mut [T],
    softmax_max: &mut [f32],
    softmax_sum: &mut [f32],
    workspace: &mut [u8],
) -> Result<()> {
    let inp = AttentionInputs::new(q.raw(), k.raw(), v.raw(), opts, false);
    let t = plan(&inp, &exec.ub)?;
    let stats = t.stats_shape()?;
    let o = crate::tensor::out_like(out, q.shape(), "out", "q")?;
    let mx = crate::tensor::out_like(softmax_max, &stats, "softmax_max", "[B, Hq, Sq]")?;
    let sm = crate::tensor::out_like(softmax_sum, &stats, "softmax_sum", "[B, Hq, Sq]")?;
    let outs = AttentionOutputs::forward(o, mx, sm);
    let call = prepare(&inp, &outs, &exec.ub)?;
    launch_into(exec, call, workspace)
}

/// The tensors `attention_backward` reads beside q, k and v: the forward's
/// outputs and the output's gradient.
#[derive(Clone, Copy, Debug)]
pub struct AttentionSaved<'a, T> {
    /// The forward's output.
    pub out: TensorRef<'a, T>,
    /// The output's gradient (out's shape).
    pub dout: TensorRef<'a, T>,
    /// The forward's softmax max, `[B, Hq, Sq]`.
    pub softmax_max: TensorRef<'a, f32>,
    /// The forward's softmax sum, `[B, Hq, Sq]`.
    pub softmax_sum: TensorRef<'a, f32>,
}

/// The backward: `dq` (q's shape), `dk` and `dv` (k's) from the forward's
/// saved tensors. On error nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Float>(
    exec: &Exec<'_>,
    q: TensorRef<'_, T>,
    k: TensorRef<'_, T>,
    v: TensorRef<'_, T>,
    saved: &AttentionSaved<'_, T>,
    opts: &AttentionOptions,
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    workspace: &mut [u8],
) -> Result<()> {
    let inp = AttentionInputs::new(q.raw(), k.raw(), v.raw(), opts, true);
    let dqr = crate::tensor::out_like(dq, q.shape(), "dq", "q")?;
    let dkr = crate::tensor::out_like(dk, k.shape(), "dk", "k")?;
    let dvr = crate::tensor::out_like(dv, v.shape(), "dv", "v")?;
    let outs = AttentionOutputs {
        out: saved.out.raw(),
        softmax_max: saved.softmax_max.raw(),
        softmax_sum: saved.softmax_sum.raw(),
        dout: saved.dout.raw(),
        dq: dqr,
        dk: dkr,
        dv: dvr,
    };
    let call = prepare(&inp, &outs, &exec.ub)?;
    launch_into(exec, call, workspace)
}
