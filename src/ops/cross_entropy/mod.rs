//! CrossEntropy, forward and backward: PyTorch's
//! `F.cross_entropy(logits, target, weight, ignore_index=..., reduction=...,
//! label_smoothing=...)` on `[N, C]` logits with class-index targets, plus
//! torch_npu's `npu_cross_entropy_loss` z-loss (`lse_square_scale * lse^2`
//! per row) and Gemma 2's logit soft-capping (`cap * tanh(x / cap)` first).
//!
//! Per row `i` with target `t` (not `ignore_index`), `w` the class weight
//! (ones when absent), `W = sum_c w_c`, `x` the (capped) logits:
//!
//! ```text
//! lse_i  = log sum_c exp(x_c)
//! loss_i = (1 - ls) * w_t * (lse_i - x_t)
//!        + ls / C * sum_c w_c * (lse_i - x_c)     (only when ls > 0)
//!        + scale * lse_i^2                        (only when scale != 0)
//! ```
//!
//! Ignored rows have loss 0 (their lse is still computed). `Sum` adds the
//! rows; `Mean` divides the sum by `sum_{i not ignored} w_{t_i}` (the
//! number of such rows without a weight): torch's weighted mean, whose
//! label-smoothing term is divided by the same weight sum
//! (`cross_entropy_loss_label_smoothing` in ATen), and the z-loss term,
//! added to each row's loss, likewise. N = 0 or every row ignored gives
//! `Mean` 0/0 = NaN and `Sum` 0, as torch. The reduction is defined once
//! (`reduce.rs`): the f32 row losses summed in f64 in row order, over the
//! f64 denominator, rounded once; `cross_entropy_reduce` and
//! `cross_entropy_grad_scale` give it to callers that run the rows in
//! several calls (the fused LM head's chunks).
//!
//! The gradient of row `i` with upstream factor `g_i` and `p = softmax(x)`:
//!
//! ```text
//! dx_c = g_i * ( p_c * ((1 - ls) w_t + ls W / C + 2 scale lse_i)
//!                - (1 - ls) w_t [c == t] - ls w_c / C )
//! dz_c = dx_c * (1 - tanh^2(z_c / cap))           (soft-capping only)
//! ```
//!
//! with `g_i = grad[i]` (`None`), `grad` (`Sum`) or `grad / denominator`
//! (`Mean`); ignored rows get zeros. The fused form computes the loss, lse
//! and this gradient in one call per row (two passes over the row, the
//! later ones from cache) with `g_i` given by the caller (`grad_scale`: per
//! row, or one scalar such as `1 / global denominator` when a mean runs
//! over chunks), the gradient written in place over the logits.
//!
//! Numerics: f32 inside. One pass over memory per row: the row max `m`
//! (exact in any order), then from cache `lse = m + log(s)` with `s = sum_c
//! exp(x_c - m)` added in `RowSum`'s fixed order (groups of 16 columns from
//! the row start, segments of 2048 columns merged pairwise, the 16 lanes in
//! a fixed tree); the gradient's `p_c = exp(x_c - m) * (1 / s)`, so the
//! fused form reuses the forward's exps (one exp per logit) and gives the
//! bits of forward then backward. The backward alone recomputes `m` and `s`
//! (a pass from cache more) and does not read the `lse` it is given: an f32
//! lse has rounded `log s` away once |m| is large (2^24 ln C). The target's
//! own gradient is `(p_t - 1) a_t + p_t (a - a_t)` (`p_t - 1` exact near 1);
//! label smoothing's `sum_c w_c (m - x_c)` has no cancellation. `lanes::math`'s `exp`, `log` and `tanh`:
//! the same bits on every ISA, thread count and tiling. Each output is
//! rounded once.

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
pub(crate) mod plan;
pub(crate) mod reduce;
pub(crate) mod reference;

pub(crate) use plan::{plan, prepare};

use core::ffi::c_void;

use super::{launch_into, op_call, workspace_len, Exec};
use crate::dtype::{Element, Float};
use crate::error::Result;
use crate::tensor::{RawTensor, TensorMut, TensorRef};
use crate::tiling::UbConfig;

/// How the per-row losses are reduced (the C ABI's `npk_reduction`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Reduction {
    /// One loss per row, `[N]`.
    None = 0,
    /// Their sum, one f32.
    Sum = 1,
    /// Their sum over the weight sum of the rows not ignored (torch's
    /// weighted mean), one f32. PyTorch's default.
    #[default]
    Mean = 2,
}

impl Reduction {
    /// The value from the C ABI's integer.
    #[cfg(feature = "capi")]
    pub(crate) fn from_u32(v: u32) -> Option<Reduction> {
        match v {
            0 => Some(Reduction::None),
            1 => Some(Reduction::Sum),
            2 => Some(Reduction::Mean),
            _ => None,
        }
    }
}

/// Options of CrossEntropy (`npk_cross_entropy_options`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOptions {
    /// How the forward reduces, and what shape the backward's upstream
    /// gradient has (`[N]` for `None`, one f32 otherwise). The fused form
    /// ignores it: its loss is per row and `grad_scale` carries the
    /// reduction. Default `Mean`.
    pub reduction: Reduction,
    /// Rows whose target equals it are ignored (loss 0, gradient 0).
    /// Default -100.
    pub ignore_index: i64,
    /// Label smoothing in [0, 1]. Default 0.
    pub label_smoothing: f32,
    /// z-loss: `lse_square_scale * lse^2` added to each row's loss
    /// (torch_npu's `lse_square_scale_for_zloss`); finite, 0 = off.
    pub lse_square_scale: f32,
    /// Logit soft-capping: logits become `softcap * tanh(x / softcap)`
    /// before everything (Gemma 2); finite and >= 0, 0 = off.
    pub softcap: f32,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        CrossEntropyOptions {
            reduction: Reduction::Mean,
            ignore_index: -100,
            label_smoothing: 0.0,
            lse_square_scale: 0.0,
            softcap: 0.0,
        }
    }
}

/// What one CrossEntropy call computes (`CrossEntropyCall::mode`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CeMode {
    /// loss (and lse) from logits.
    Forward = 0,
    /// dlogits from logits, lse and the upstream gradient.
    Backward = 1,
    /// loss, lse and dlogits in one call, with the gradient factor given.
    Fused = 2,
}

/// The plan of one CrossEntropy: rows over blocks, whole rows per block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CrossEntropyTiling {
    /// Rows N.
    pub rows: u64,
    /// Classes C.
    pub cols: u64,
    /// Rows per block (`ceil(rows / blocks)`); the last block may have fewer.
    pub rows_per_block: u64,
    /// Columns per UB tile of the row passes (a multiple of 128; an NPU
    /// kernel streams a longer row through the UB in such tiles, the CPU
    /// streams it through its caches).
    pub ub_cols: u64,
    /// Blocks (0 when there are no rows).
    pub blocks: u32,
    /// `NORM_FLAG_SERIAL` when small: a hint that never changes a bit.
    pub flags: u32,
    /// Total workspace bytes (+ 64 bytes of alignment slack): N f32 row
    /// losses for a reducing forward; for the fused form two cache rows per
    /// block of C f32 (C rounded up to 16; the exps pass 2 reuses), at most
    /// 16 MiB (fewer blocks for a wider row; none past C = 2 Mi); else 0.
    pub workspace_bytes: u64,
}

/// The validated arguments of one CrossEntropy (`npk_cross_entropy_call`).
/// Absent tensors are empty descriptors.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyCall {
    /// Logits `[N, C]`, f32, f16 or bf16.
    pub logits: RawTensor,
    /// Class indices `[N]`, i32 or i64.
    pub target: RawTensor,
    /// Class weights `[C]` f32 (`has_weight`).
    pub weight: RawTensor,
    /// Backward: the forward's lse, N f32.
    pub lse_in: RawTensor,
    /// Backward: the upstream gradient of the loss (N f32 for `None`, else
    /// one); fused: the gradient factor per row (N f32, `grad_per_row`) or
    /// one for every row.
    pub grad: RawTensor,
    /// Forward and fused: the loss (N f32, or one for `Sum` / `Mean`).
    pub loss: RawTensor,
    /// Forward and fused: lse, N f32 (`has_lse`).
    pub lse: RawTensor,
    /// Backward and fused: dlogits, logits' shape and dtype; may be the
    /// logits buffer itself (in place).
    pub dlogits: RawTensor,
    /// What the call computes.
    pub mode: CeMode,
    /// The forward's reduction (the backward's `grad` shape).
    pub reduction: Reduction,
    /// Rows with this target are ignored.
    pub ignore_index: i64,
    /// Label smoothing in [0, 1].
    pub label_smoothing: f32,
    /// z-loss scale (0 = off).
    pub lse_square_scale: f32,
    /// Soft-capping (0 = off).
    pub softcap: f32,
    /// 1 when `weight` is given.
    pub has_weight: u32,
    /// 1 when `lse` is written.
    pub has_lse: u32,
    /// 1 when `grad` holds one value per row.
    pub grad_per_row: u32,
    /// The tiling plan.
    pub tiling: CrossEntropyTiling,
    /// The caller's workspace.
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

impl CrossEntropyCall {
    /// Whether the call writes a reduced (one-element) loss.
    pub(crate) fn reduces(&self) -> bool {
        self.mode == CeMode::Forward && self.reduction != Reduction::None
    }
}

op_call!(
    CrossEntropyCall,
    |c| c.tiling.rows == 0 && !c.reduces(),
    [logits, target, weight, lse_in, grad, loss, lse, dlogits],
    // The fused form's workspace is its exp cache, a speed-up only: with
    // less (ABI 2.3 callers passed none) pass 2 recomputes the exps.
    fit = |c, given| {
        if c.mode == CeMode::Fused && (given as u64) < c.tiling.workspace_bytes {
            c.tiling.workspace_bytes = 0;
        }
    }
);

/// The class-index targets and optional class weights of a call.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyTargets<'a, I> {
    /// Class indices `[N]`, i32 or i64 (`ignore_index` or in `0..C`).
    pub target: TensorRef<'a, I>,
    /// Class weights `[C]`, or `None` for ones.
    pub weight: Option<TensorRef<'a, f32>>,
}

impl<'a, I: Element> CrossEntropyTargets<'a, I> {
    /// Targets without class weights.
    pub fn new(target: TensorRef<'a, I>) -> Self {
        CrossEntropyTargets {
            target,
            weight: None,
        }
    }

    /// The same, with class weights.
    pub fn with_weight(self, weight: TensorRef<'a, f32>) -> Self {
        CrossEntropyTargets {
            weight: Some(weight),
            ..self
        }
    }

    fn raw(&self) -> (RawTensor, Option<RawTensor>) {
        (self.target.raw(), self.weight.map(|w| w.raw()))
    }
}

/// The tensors of one call, as descriptors (what `prepare` takes).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CeTensors {
    pub logits: RawTensor,
    pub target: RawTensor,
    pub weight: Option<RawTensor>,
    pub lse_in: Option<RawTensor>,
    pub grad: Option<RawTensor>,
    pub loss: Option<RawTensor>,
    pub lse: Option<RawTensor>,
    pub dlogits: Option<RawTensor>,
}

impl CeTensors {
    fn inputs(logits: RawTensor, targets: (RawTensor, Option<RawTensor>)) -> CeTensors {
        CeTensors {
            logits,
            target: targets.0,
            weight: targets.1,
            lse_in: None,
            grad: None,
            loss: None,
            lse: None,
            dlogits: None,
        }
    }
}

/// A flat f32 output descriptor over `s`.
fn out_f32(s: &mut [f32]) -> RawTensor {
    RawTensor::flat(
        s.as_mut_ptr() as *mut c_void,
        crate::dtype::DType::F32,
        s.len(),
    )
}

fn size_of_plan(
    mode: CeMode,
    t: &CeTensors,
    opts: &CrossEntropyOptions,
    ub: &UbConfig,
) -> Result<usize> {
    workspace_len(plan(mode, t, opts, ub)?.1.workspace_bytes)
}

/// Workspace bytes `cross_entropy` needs (N f32 for `Sum` / `Mean`, else 0).
pub fn cross_entropy_workspace_size<T: Float, I: Element>(
    exec: &Exec<'_>,
    logits: TensorRef<'_, T>,
    targets: CrossEntropyTargets<'_, I>,
    opts: &CrossEntropyOptions,
) -> Result<usize> {
    let t = CeTensors::inputs(logits.raw(), targets.raw());
    size_of_plan(CeMode::Forward, &t, opts, &exec.ub)
}

/// The forward: `loss` (N f32 for `Reduction::None`, else 1) and, when
/// given, `lse` (N f32). Out-of-range targets fail with `IndexOutOfRange`
/// naming the first bad row and its value; on any error nothing is written.
pub fn cross_entropy<T: Float, I: Element>(
    exec: &Exec<'_>,
    logits: TensorRef<'_, T>,
    targets: CrossEntropyTargets<'_, I>,
    opts: &CrossEntropyOptions,
    loss: &mut [f32],
    lse: Option<&mut [f32]>,
    workspace: &mut [u8],
) -> Result<()> {
    let mut t = CeTensors::inputs(logits.raw(), targets.raw());
    t.loss = Some(out_f32(loss));
    t.lse = lse.map(out_f32);
    let call = prepare(CeMode::Forward, &t, opts, &exec.ub)?;
    launch_into(exec, call, workspace)
}

/// Workspace bytes `cross_entropy_grad` (and `_in_place`) need (always 0).
pub fn cross_entropy_grad_workspace_size<T: Float, I: Element>(
    exec: &Exec<'_>,
    logits: TensorRef<'_, T>,
    targets: CrossEntropyTargets<'_, I>,
    opts: &CrossEntropyOptions,
) -> Result<usize> {
    let t = CeTensors::inputs(logits.raw(), targets.raw());
    size_of_plan(CeMode::Backward, &t, opts, &exec.ub)
}

/// The backward: `dlogits` (logits' shape) from the logits, the forward's
/// `lse` (N f32) and `grad`, the upstream gradient of the loss (N f32 for
/// `Reduction::None`, else 1). On error nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_grad<T: Float, I: Element>(
    exec: &Exec<'_>,
    logits: TensorRef<'_, T>,
    targets: CrossEntropyTargets<'_, I>,
    lse: &[f32],
    grad: &[f32],
    opts: &CrossEntropyOptions,
    dlogits: &mut [T],
    workspace: &mut [u8],
) -> Result<()> {
    let mut t = CeTensors::inputs(logits.raw(), targets.raw());
    t.lse_in = Some(in_f32(lse));
    t.grad = Some(in_f32(grad));
    t.dlogits = Some(RawTensor::flat(
        dlogits.as_mut_ptr() as *mut c_void,
        T::DTYPE,
        dlogits.len(),
    ));
    let call = prepare(CeMode::Backward, &t, opts, &exec.ub)?;
    launch_into(exec, call, workspace)
}

/// `cross_entropy_grad` writing dlogits over the logits.
pub fn cross_entropy_grad_in_place<T: Float, I: Element>(
    exec: &Exec<'_>,
    mut logits: TensorMut<'_, T>,
    targets: CrossEntropyTargets<'_, I>,
    lse: &[f32],
    grad: &[f32],
    opts: &CrossEntropyOptions,
    workspace: &mut [u8],
) -> Result<()> {
    let x = logits.raw();
    let mut t = CeTensors::inputs(x, targets.raw());
    t.lse_in = Some(in_f32(lse));
    t.grad = Some(in_f32(grad));
    t.dlogits = Some(x);
    let call = prepare(CeMode::Backward, &t, opts, &exec.ub)?;
    launch_into(exec, call, workspace)
}

/// Workspace bytes `cross_entropy_fused` uses: its exp cache (two rows of
/// C f32 per block, at most 16 MiB), which makes it about 1.5x faster. A
/// smaller workspace (even empty) is accepted: the call then recomputes
/// the exps, with the same bits.
pub fn cross_entropy_fused_workspace_size<T: Float, I: Element>(
    exec: &Exec<'_>,
    logits: TensorRef<'_, T>,
    targets: CrossEntropyTargets<'_, I>,
    opts: &CrossEntropyOptions,
) -> Result<usize> {
    let t = CeTensors::inputs(logits.raw(), targets.raw());
    size_of_plan(CeMode::Fused, &t, opts, &exec.ub)
}

/// Forward and backward in one call, the gradient written in place over
/// the logits: per row the loss (`loss`, N f32, never reduced) and lse
/// (when given), then `dlogits = grad_scale_i * d loss_i / d logits`, with
/// `grad_scale` N f32 (per row) or 1 (every row): for a mean over chunks
/// pass `1 / global denominator`. `opts.reduction` is not used. On error
/// nothing is written (the logits included).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_fused<T: Float, I: Element>(
    exec: &Exec<'_>,
    mut logits: TensorMut<'_, T>,
    targets: CrossEntropyTargets<'_, I>,
    grad_scale: &[f32],
    opts: &CrossEntropyOptions,
    loss: &mut [f32],
    lse: Option<&mut [f32]>,
    workspace: &mut [u8],
) -> Result<()> {
    let x = logits.raw();
    let mut t = CeTensors::inputs(x, targets.raw());
    t.grad = Some(in_f32(grad_scale));
    t.loss = Some(out_f32(loss));
    t.lse = lse.map(out_f32);
    t.dlogits = Some(x);
    let call = prepare(CeMode::Fused, &t, opts, &exec.ub)?;
    launch_into(exec, call, workspace)
}

/// A flat f32 input descriptor over `s` (only read).
fn in_f32(s: &[f32]) -> RawTensor {
    RawTensor::flat(s.as_ptr() as *mut c_void, crate::dtype::DType::F32, s.len())
}

/// The reduced loss of per-row losses `loss` (`N` f32, as the fused form or
/// `Reduction::None` writes them), exactly as `cross_entropy` reduces
/// (`opts.reduction` `Sum` or `Mean`; `ignore_index` and the class weight
/// give the mean's denominator): for callers that compute the rows in
/// several calls. Targets are checked as `cross_entropy` checks them when a
/// weight gives the class count (else only their count).
pub fn cross_entropy_reduce<I: Element>(
    loss: &[f32],
    targets: CrossEntropyTargets<'_, I>,
    opts: &CrossEntropyOptions,
) -> Result<f32> {
    let den = reduce_checked(loss.len(), targets, opts)?;
    Ok(reduce::reduced(
        reduce::total(loss.len(), |i| loss[i]),
        opts.reduction,
        den,
    ))
}

/// The gradient factor of every row for an upstream gradient `grad` of the
/// reduced loss: `grad` for `Sum`, `grad / denominator` (rounded once) for
/// `Mean` -- what the backward applies, and what the fused form's
/// `grad_scale` takes to give the backward's bits. Arguments as
/// `cross_entropy_reduce`'s.
pub fn cross_entropy_grad_scale<I: Element>(
    targets: CrossEntropyTargets<'_, I>,
    grad: f32,
    opts: &CrossEntropyOptions,
) -> Result<f32> {
    let n = targets.target.shape().numel();
    let den = reduce_checked(n, targets, opts)?;
    Ok(reduce::grad_factor(grad, opts.reduction, den))
}

/// Validates a reduction's arguments; the mean's denominator (0 for `Sum`).
fn reduce_checked<I: Element>(
    rows: usize,
    targets: CrossEntropyTargets<'_, I>,
    opts: &CrossEntropyOptions,
) -> Result<f64> {
    plan::check_reduce(rows, &targets.raw(), opts)
}
