//! AdamW / Adam over tensor lists: one multi-tensor optimizer step, as
//! torch's `_fused_adamw_` / `_fused_adam_` and aclnn's `ApplyAdamW` take
//! it, with float32 master weights for 16-bit parameters and the gradient
//! clip inside the step.
//!
//! # One pass
//! Parallel lists — params, grads, exp_avgs, exp_avg_sqs, optional
//! max_exp_avg_sqs (amsgrad) and optional f32 masters — are one flat
//! element sequence cut into equal blocks (`AdamWTiling`). Each element is
//! read once and written once: with masters, the master (not the 16-bit
//! param) is the value updated, and the param is written as the new master
//! rounded once to its dtype. Gradients are only read.
//!
//! # Per element (f32, no FMA; the same on every ISA, thread count, block)
//! ```text
//! g = (grad / grad_scale) * clip_coef          (1.0 when absent: exact)
//! g = -g                                        (maximize)
//! p = master, or param widened
//! g = g + p * weight_decay                      (Adam, L2 mode)
//! p = p * (1 - lr * weight_decay)               (AdamW, decoupled mode)
//! m = m * beta1 + g * (1 - beta1)
//! v = v * beta2 + (g * g) * (1 - beta2)
//! vmax = v < vmax ? vmax : v                    (amsgrad; v when v is NaN)
//! p = p - (step_size * m) / (sqrt(v or vmax) / bias_correction2_sqrt + eps)
//! ```
//! torch's CPU fused AdamW's formula and order. The scalars are formed
//! once in f64 — `bias_correction1 = 1 - beta1^step` (exact powers by
//! squaring), `step_size = lr / bias_correction1`,
//! `bias_correction2_sqrt = sqrt(1 - beta2^step)`, `1 - lr * weight_decay`
//! — and rounded once to f32 (`AdamWConsts`, in the call, so a foreign
//! backend uses the same numbers). Every output is rounded once from its
//! f32 value to its dtype, and the param update uses the unrounded f32
//! moments.
//!
//! # The clip inside the step (`ADAMW_CLIP`)
//! Before the pass, the global L2 norm of all gradients (divided by
//! `|grad_scale|` when given) is taken exactly as `grad_stats` takes it
//! (f64 squares, fixed order: the same bits on any runner). A non-finite
//! norm skips the whole update (params, masters and moments unchanged) and
//! is reported; else `clip_coef = min(1, max_grad_norm / (norm + 1e-6))`
//! (torch's `clip_grad_norm_` coefficient) multiplies each gradient inside
//! the pass, so clip + step read each gradient twice and write it never.
//! torch's clip rounds the scaled gradient to its dtype before the step;
//! here it stays f32 (one rounding fewer).
//!
//! With `ADAMW_CLIP_COEF` the caller brings the coefficient instead (its
//! norm over several calls' lists, or all ranks' shards: `grad_stats` and
//! one all-reduce of `sum_sq`), and the pass multiplies by it the same way.
//!
//! # AMP
//! `grad_scale` divides each gradient (torch's `_fused_adamw_` also stores
//! the unscaled gradient back; here gradients are read only); `found_inf`
//! != 0 skips the step, as torch's fused step does.
//!
//! # Compact state (`adamw_with_formats`, ABI 2.9)
//! `AdamWFormats` stores the state in fewer bytes, the f32 arithmetic above
//! unchanged: **split masters** (bf16 params; the masters list holds `i16`
//! low halves: master = param's bits << 16 + low, exact; the param is the
//! master rounded to nearest with ties away from zero), **stochastically
//! rounded bf16 moments** and **stochastically rounded bf16 params**
//! without masters. The random bits come from a hash of (seed, step,
//! element key), so they are the same on every ISA, thread count and
//! block cut (`formats.rs`).
//!
//! # 8-bit moments (`AdamWFormats::quantized_moments`, `adamw_with_scales`)
//! exp_avgs, exp_avg_sqs and max_exp_avg_sqs hold one `u8` code per
//! element, and three scale lists (`AdamWScales`) one f32 per block of 256
//! elements of each tensor (blocks from each tensor's element 0). Each
//! block is dequantized, stepped by the formula above (the param update
//! uses the unrounded f32 moments), and quantized again relative to the
//! block's new largest |value| with a small-float code rounded
//! stochastically by the same hash (`q8.rs` has the code map, the rounding
//! and what a NaN does). The pass's blocks never cut a quantization block:
//! block `b` steps the quantization blocks whose first element lies in its
//! flat range. A shard whose offset in its tensor is a multiple of 256
//! (passing that offset as its key) quantizes exactly as one process.

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
mod cpu_q8;
pub(crate) mod formats;
mod plan;
pub(crate) mod q8;
pub(crate) mod reference;

pub use formats::{AdamWFormats, AdamWState, ADAMW_SR_MOMENTS, ADAMW_SR_PARAMS};
pub(crate) use plan::{plan_lists, Lists};
pub use plan::{AdamWConsts, AdamWTiling};
pub use q8::{
    q8_decode, q8_encode, q8_magnitude, q8_scale, q8_scales_len, Q8Blocks, Q8Grid, Q8_BLOCK,
};

use core::ffi::c_void;

use super::grad_stats::{GradTensor, GradTensorMut};
use super::Exec;
use crate::error::{invalid_fmt, Result};
use crate::tensor_list::{RoList, RwList, TensorList};

/// `AdamWOptions::flags`: keep the running max of `exp_avg_sq` (amsgrad;
/// the max_exp_avg_sqs list is then required).
pub const ADAMW_AMSGRAD: u32 = 1;
/// `AdamWOptions::flags`: step along the gradient (maximize the objective).
pub const ADAMW_MAXIMIZE: u32 = 2;
/// `AdamWOptions::flags`: Adam's L2 weight decay (`g += weight_decay * p`)
/// instead of AdamW's decoupled decay (`p *= 1 - lr * weight_decay`).
pub const ADAMW_L2: u32 = 4;
/// `AdamWOptions::flags`: clip by the global gradient norm first
/// (`max_grad_norm`; see the module docs).
pub const ADAMW_CLIP: u32 = 8;
/// `AdamWOptions::flags`: divide each gradient by `grad_scale` (AMP).
pub const ADAMW_GRAD_SCALE: u32 = 16;
/// `AdamWOptions::flags`: skip the step when `found_inf` != 0 (AMP).
pub const ADAMW_FOUND_INF: u32 = 32;
/// `AdamWOptions::flags`: multiply each gradient by the caller's
/// `clip_coef` (a norm the caller took over more than this call's lists:
/// several param groups, or the shards of all ranks). Not with
/// `ADAMW_CLIP`.
pub const ADAMW_CLIP_COEF: u32 = 64;
const KNOWN_FLAGS: u32 = 127;

/// The scalar arguments of one step (`npk_adamw_options`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWOptions {
    /// Learning rate, >= 0.
    pub lr: f64,
    /// First-moment decay, in [0, 1).
    pub beta1: f64,
    /// Second-moment decay, in [0, 1).
    pub beta2: f64,
    /// Added to the denominator, >= 0.
    pub eps: f64,
    /// Weight decay, >= 0 (decoupled unless `ADAMW_L2`).
    pub weight_decay: f64,
    /// The step number after this step's increment (torch's `state["step"]`
    /// as the update sees it): 1 on the first step, at most 2^53.
    pub step: u64,
    /// With `ADAMW_CLIP`: the largest global gradient norm left unscaled,
    /// >= 0 and not NaN (+Inf: measure the norm, never clip).
    pub max_grad_norm: f64,
    /// With `ADAMW_GRAD_SCALE`: each gradient is divided by it.
    pub grad_scale: f32,
    /// With `ADAMW_FOUND_INF`: a nonzero value skips the step.
    pub found_inf: f32,
    /// `ADAMW_*` bits.
    pub flags: u32,
    /// With `ADAMW_CLIP_COEF`: each gradient is multiplied by it (finite,
    /// in [0, 1]; `clip_coefficient(norm, max_norm)` of the caller's norm).
    pub clip_coef: f32,
}

impl AdamWOptions {
    /// torch.optim.AdamW's defaults (betas 0.9 / 0.999, eps 1e-8, weight
    /// decay 0.01) at learning rate `lr`, step 1, no flags.
    pub const fn new(lr: f64) -> Self {
        AdamWOptions {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            step: 1,
            max_grad_norm: f64::INFINITY,
            grad_scale: 1.0,
            found_inf: 0.0,
            flags: 0,
            clip_coef: 1.0,
        }
    }

    /// Whether `flag` (an `ADAMW_*` bit) is set.
    pub const fn has(&self, flag: u32) -> bool {
        self.flags & flag != 0
    }

    pub(crate) fn check(&self) -> Result<()> {
        let bad = |x: f64| x.is_nan() || x < 0.0 || x == f64::INFINITY;
        if bad(self.lr) {
            return Err(invalid_fmt!(
                "lr",
                "{} is not a finite number >= 0",
                self.lr
            ));
        }
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(invalid_fmt!(name, "{b} is not in [0, 1)"));
            }
        }
        if bad(self.eps) {
            return Err(invalid_fmt!(
                "eps",
                "{} is not a finite number >= 0",
                self.eps
            ));
        }
        if bad(self.weight_decay) {
            return Err(invalid_fmt!(
                "weight_decay",
                "{} is not a finite number >= 0",
                self.weight_decay
            ));
        }
        if self.step == 0 || self.step > 1 << 53 {
            return Err(invalid_fmt!("step", "{} is not in 1..=2^53", self.step));
        }
        if self.has(ADAMW_CLIP) && (self.max_grad_norm.is_nan() || self.max_grad_norm < 0.0) {
            return Err(invalid_fmt!(
                "max_grad_norm",
                "{} is negative or NaN",
                self.max_grad_norm
            ));
        }
        if self.has(ADAMW_CLIP_COEF) {
            if self.has(ADAMW_CLIP) {
                return Err(invalid_fmt!(
                    "flags",
                    "ADAMW_CLIP and ADAMW_CLIP_COEF together"
                ));
            }
            if !(0.0..=1.0).contains(&self.clip_coef) {
                return Err(invalid_fmt!(
                    "clip_coef",
                    "{} is not in [0, 1]",
                    self.clip_coef
                ));
            }
        }
        // A zero, negative, infinite or NaN scale would step every param to
        // NaN or uphill with a success status (issue 58): AMP's scale is a
        // finite positive number.
        if self.has(ADAMW_GRAD_SCALE) && !(self.grad_scale.is_finite() && self.grad_scale > 0.0) {
            return Err(invalid_fmt!(
                "grad_scale",
                "{} is not a finite number > 0",
                self.grad_scale
            ));
        }
        if self.flags & !KNOWN_FLAGS != 0 {
            return Err(invalid_fmt!(
                "flags",
                "unknown bits {:#x}",
                self.flags & !KNOWN_FLAGS
            ));
        }
        Ok(())
    }
}

impl Default for AdamWOptions {
    fn default() -> Self {
        AdamWOptions::new(1e-3)
    }
}

/// What a step did (`npk_adamw_result`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWReport {
    /// With `ADAMW_CLIP`: the global gradient norm before clipping (after
    /// unscaling); NaN otherwise.
    pub grad_norm: f64,
    /// 1 when params and moments were updated; 0 when the step was skipped
    /// (`found_inf`, or a non-finite norm under `ADAMW_CLIP`).
    pub stepped: u32,
}

/// The tensors of one step: parallel lists, tensor `i` of each having the
/// same element count. Params, grads: f32 | f16 | bf16, one dtype per list.
/// exp_avgs, exp_avg_sqs (and max_exp_avg_sqs): f32 or the params' dtype,
/// the same for all three (bf16 with `ADAMW_SR_MOMENTS`, u8 codes with
/// `AdamWFormats::quantized_moments`). max_exp_avg_sqs: one per param with
/// `ADAMW_AMSGRAD`, else empty. masters: empty, or one f32 tensor per param
/// (the value updated; the param receives it rounded). No two tensors may
/// overlap.
#[derive(Debug)]
pub struct AdamWTensors<'l, 'a> {
    /// Parameters, updated in place (written from masters when given).
    pub params: &'l mut [GradTensorMut<'a>],
    /// Gradients, read only.
    pub grads: &'l [GradTensor<'a>],
    /// First moments, updated in place.
    pub exp_avgs: &'l mut [GradTensorMut<'a>],
    /// Second moments, updated in place.
    pub exp_avg_sqs: &'l mut [GradTensorMut<'a>],
    /// amsgrad's running maxima of the second moments, updated in place.
    pub max_exp_avg_sqs: &'l mut [GradTensorMut<'a>],
    /// f32 master weights, updated in place (or empty).
    pub masters: &'l mut [GradTensorMut<'a>],
}

/// The scales of 8-bit moments (`AdamWFormats::quantized_moments`): one
/// f32 tensor per param in each list, of `Q8Grid::scales_len` elements
/// (one per block of 256 of each row, `q8_scales_len(numel)` for one row;
/// see `q8`). Empty lists without 8-bit moments;
/// `max_exp_avg_sqs` is empty without `ADAMW_AMSGRAD`.
#[derive(Debug)]
pub struct AdamWScales<'l, 'a> {
    /// exp_avgs' block scales, updated in place.
    pub exp_avgs: &'l mut [GradTensorMut<'a>],
    /// exp_avg_sqs' block scales, updated in place.
    pub exp_avg_sqs: &'l mut [GradTensorMut<'a>],
    /// max_exp_avg_sqs' block scales, updated in place.
    pub max_exp_avg_sqs: &'l mut [GradTensorMut<'a>],
}

impl AdamWScales<'_, '_> {
    /// No scale lists (every format but 8-bit moments).
    pub fn none() -> AdamWScales<'static, 'static> {
        AdamWScales {
            exp_avgs: &mut [],
            exp_avg_sqs: &mut [],
            max_exp_avg_sqs: &mut [],
        }
    }
}

/// The validated arguments of one step (`npk_adamw_call`): the lowered
/// lists, the options and their f32 constants, the plan and the workspace.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AdamWCall {
    /// Parameters (written; read too unless `masters` is given).
    pub params: TensorList,
    /// Gradients (read only).
    pub grads: TensorList,
    /// First moments (read and written).
    pub exp_avgs: TensorList,
    /// Second moments (read and written).
    pub exp_avg_sqs: TensorList,
    /// amsgrad's maxima (read and written), or empty.
    pub max_exp_avg_sqs: TensorList,
    /// f32 masters (read and written), or empty.
    pub masters: TensorList,
    /// The caller's options.
    pub options: AdamWOptions,
    /// The options' f32 constants every backend uses.
    pub consts: AdamWConsts,
    /// Output: what the step did.
    pub report: *mut AdamWReport,
    /// The tiling plan.
    pub tiling: AdamWTiling,
    /// The caller's workspace (the segment tables, the clip's partials).
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
    /// The state's formats (ABI 2.9; all zero: f32 masters, moments
    /// rounded to nearest).
    pub state: AdamWState,
    /// 8-bit moments' exp_avg block scales (f32, one row per params row),
    /// or empty (ABI 2.9).
    pub exp_avg_scales: TensorList,
    /// 8-bit moments' exp_avg_sq block scales, or empty.
    pub exp_avg_sq_scales: TensorList,
    /// 8-bit moments' max_exp_avg_sq block scales, or empty.
    pub max_exp_avg_sq_scales: TensorList,
}

impl AdamWCall {
    /// The per-row element keys (stochastic rounding only; else empty).
    ///
    /// # Safety
    /// The call comes from the front end (its keys are written and live).
    pub(crate) unsafe fn keys<'a>(&self) -> &'a [u64] {
        if !self.state.stochastic() || self.tiling.tensors == 0 {
            return &[];
        }
        // SAFETY: the front end wrote one key per row at `keys_offset` of the
        // aligned workspace (the caller's contract).
        unsafe {
            let base = self.workspace as *const u8;
            core::slice::from_raw_parts(
                base.add(crate::tiling::align_offset(base))
                    .add(self.state.keys_offset as usize)
                    .cast::<u64>(),
                self.tiling.tensors as usize,
            )
        }
    }

    /// The rows' quantization grids (8-bit moments; else empty), from the
    /// row lengths the front end wrote after the keys.
    ///
    /// # Safety
    /// As for `keys`.
    pub(crate) unsafe fn q8_rows<'a>(&self) -> &'a [u64] {
        if self.state.quantized_moments == 0 || self.tiling.tensors == 0 {
            return &[];
        }
        // SAFETY: with 8-bit moments the front end wrote one length per row
        // after the keys (the caller's contract).
        unsafe {
            let keys = self.keys();
            core::slice::from_raw_parts(keys.as_ptr().add(keys.len()), keys.len())
        }
    }

    /// The six lowered tables (params, grads, exp_avgs, exp_avg_sqs,
    /// max_exp_avg_sqs, masters); absent lists are empty.
    ///
    /// # Safety
    /// The call comes from the front end (its tables are written and live).
    pub(crate) unsafe fn tables<'a>(&self) -> [&'a [crate::tensor_list::ListSeg]; 6] {
        // SAFETY: the caller's contract.
        unsafe {
            [
                self.params.rows(),
                self.grads.rows(),
                self.exp_avgs.rows(),
                self.exp_avg_sqs.rows(),
                self.max_exp_avg_sqs.rows(),
                self.masters.rows(),
            ]
        }
    }

    /// The three scale tables (exp_avgs', exp_avg_sqs', max_exp_avg_sqs');
    /// absent lists are empty.
    ///
    /// # Safety
    /// As for `tables`.
    pub(crate) unsafe fn scale_tables<'a>(&self) -> [&'a [crate::tensor_list::ListSeg]; 3] {
        // SAFETY: the caller's contract.
        unsafe {
            [
                self.exp_avg_scales.rows(),
                self.exp_avg_sq_scales.rows(),
                self.max_exp_avg_sq_scales.rows(),
            ]
        }
    }
}

/// Workspace bytes `adamw` needs for these tensors and options under
/// `exec.ub` (the options are validated too).
pub fn adamw_workspace_size(
    exec: &Exec<'_>,
    tensors: &mut AdamWTensors<'_, '_>,
    options: &AdamWOptions,
) -> Result<usize> {
    adamw_with_formats_workspace_size(exec, tensors, options, &AdamWFormats::default())
}

/// Workspace bytes `adamw_with_formats` needs.
pub fn adamw_with_formats_workspace_size(
    exec: &Exec<'_>,
    tensors: &mut AdamWTensors<'_, '_>,
    options: &AdamWOptions,
    formats: &AdamWFormats<'_>,
) -> Result<usize> {
    adamw_with_scales_workspace_size(exec, tensors, &mut AdamWScales::none(), options, formats)
}

/// Workspace bytes `adamw_with_scales` needs.
pub fn adamw_with_scales_workspace_size(
    exec: &Exec<'_>,
    tensors: &mut AdamWTensors<'_, '_>,
    scales: &mut AdamWScales<'_, '_>,
    options: &AdamWOptions,
    formats: &AdamWFormats<'_>,
) -> Result<usize> {
    with_lists(tensors, scales, |l| {
        super::workspace_len(plan_lists(l, options, formats, &exec.ub)?.workspace_bytes)
    })
}

/// One AdamW / Adam step over the lists (see the module docs). `workspace`
/// must hold `adamw_workspace_size` bytes (any alignment). On error nothing
/// is written.
pub fn adamw(
    exec: &Exec<'_>,
    tensors: &mut AdamWTensors<'_, '_>,
    options: &AdamWOptions,
    workspace: &mut [u8],
) -> Result<AdamWReport> {
    adamw_with_formats(exec, tensors, options, &AdamWFormats::default(), workspace)
}

/// One step with the state in `formats` (see the module docs: split
/// masters, stochastically rounded moments or params). The lists' dtypes
/// follow the formats: split masters' list is `i16`, stochastically rounded
/// moments are bf16. 8-bit moments need their scales: `adamw_with_scales`.
/// On error nothing is written.
pub fn adamw_with_formats(
    exec: &Exec<'_>,
    tensors: &mut AdamWTensors<'_, '_>,
    options: &AdamWOptions,
    formats: &AdamWFormats<'_>,
    workspace: &mut [u8],
) -> Result<AdamWReport> {
    adamw_with_scales(
        exec,
        tensors,
        &mut AdamWScales::none(),
        options,
        formats,
        workspace,
    )
}

/// One step with the state in `formats` and, for 8-bit moments
/// (`AdamWFormats::quantized_moments`: u8 moment lists), their block
/// scales in `scales` (see the module docs). On error nothing is written.
pub fn adamw_with_scales(
    exec: &Exec<'_>,
    tensors: &mut AdamWTensors<'_, '_>,
    scales: &mut AdamWScales<'_, '_>,
    options: &AdamWOptions,
    formats: &AdamWFormats<'_>,
    workspace: &mut [u8],
) -> Result<AdamWReport> {
    let (ws, n) = (workspace.as_mut_ptr() as *mut c_void, workspace.len());
    with_lists(tensors, scales, |l| {
        plan::launch(exec, l, options, formats, ws, n, None)
    })
}

/// The Rust lists as `ListSource`s, named as the C ABI names them.
fn with_lists<R>(
    t: &mut AdamWTensors<'_, '_>,
    s: &mut AdamWScales<'_, '_>,
    f: impl FnOnce(&mut Lists<'_>) -> R,
) -> R {
    let mut p = RwList(t.params, "params");
    let mut g = RoList(t.grads, "grads");
    let mut m = RwList(t.exp_avgs, "exp_avgs");
    let mut v = RwList(t.exp_avg_sqs, "exp_avg_sqs");
    let mut x = RwList(t.max_exp_avg_sqs, "max_exp_avg_sqs");
    let mut w = RwList(t.masters, "masters");
    let mut sm = RwList(s.exp_avgs, "exp_avg_scales");
    let mut sv = RwList(s.exp_avg_sqs, "exp_avg_sq_scales");
    let mut sx = RwList(s.max_exp_avg_sqs, "max_exp_avg_sq_scales");
    f(&mut Lists {
        params: &mut p,
        grads: &mut g,
        exp_avgs: &mut m,
        exp_avg_sqs: &mut v,
        max_exp_avg_sqs: &mut x,
        masters: &mut w,
        exp_avg_scales: &mut sm,
        exp_avg_sq_scales: &mut sv,
        max_exp_avg_sq_scales: &mut sx,
        bad: None,
    })
}
