//! `npk_cross_entropy*`: a skin over `ops::cross_entropy::{plan, prepare}`
//! — forward, backward and the fused form, which read the same inputs and
//! differ in their own tensors (`Form`); the shared shape is `capi::skin`.

#![allow(non_camel_case_types)]

use core::ffi::c_void;
use core::marker::PhantomData;

use super::{plan, prepare, CeMode, CeTensors, CrossEntropyCall, CrossEntropyOptions, Reduction};
use crate::capi::exec::run;
use crate::capi::skin::{self, CapiCall, CapiOp};
use crate::capi::types::{npk_exec, npk_status, read_opt_tensor, read_tensor};
use crate::dtype::DType;
use crate::error::{dtype_err, invalid_fmt, Error, Result};
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;
use crate::workspace::Src;

/// How CrossEntropy reduces its per-row losses (the header's
/// `npk_reduction`; the library's own type is `Reduction`). ABI 2.3.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_reduction {
    /// One loss per row.
    NPK_REDUCTION_NONE = 0,
    /// Their sum.
    NPK_REDUCTION_SUM = 1,
    /// Their sum over the weight sum of the rows not ignored (torch's mean).
    NPK_REDUCTION_MEAN = 2,
}

/// What an `npk_cross_entropy_call` computes (the header's `npk_ce_mode`;
/// the library's own type is `CeMode`). ABI 2.3.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum npk_ce_mode {
    /// loss and lse.
    NPK_CE_FORWARD = 0,
    /// dlogits from lse and the upstream gradient.
    NPK_CE_BACKWARD = 1,
    /// loss, lse and dlogits in one call.
    NPK_CE_FUSED = 2,
}

const _: () = {
    assert!(npk_reduction::NPK_REDUCTION_NONE as u32 == Reduction::None as u32);
    assert!(npk_reduction::NPK_REDUCTION_SUM as u32 == Reduction::Sum as u32);
    assert!(npk_reduction::NPK_REDUCTION_MEAN as u32 == Reduction::Mean as u32);
    assert!(npk_ce_mode::NPK_CE_FORWARD as u32 == CeMode::Forward as u32);
    assert!(npk_ce_mode::NPK_CE_BACKWARD as u32 == CeMode::Backward as u32);
    assert!(npk_ce_mode::NPK_CE_FUSED as u32 == CeMode::Fused as u32);
    assert!(core::mem::size_of::<Reduction>() == core::mem::size_of::<RawReduction>());
};

/// An `npk_reduction` as the C side may pass it (printed as `npk_reduction`).
pub type RawReduction = u32;

/// Options of CrossEntropy, its gradient and the fused form. NULL options =
/// `{ NPK_REDUCTION_MEAN, -100, 0, 0, 0 }` (PyTorch's defaults). ABI 2.3.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_cross_entropy_options {
    /// The forward's reduction (the backward's `grad` shape); not used by
    /// the fused form.
    pub reduction: RawReduction,
    /// Rows whose target equals it are ignored.
    pub ignore_index: i64,
    /// Label smoothing in [0, 1].
    pub label_smoothing: f32,
    /// z-loss scale: `lse_square_scale * lse^2` added per row (0 = off).
    pub lse_square_scale: f32,
    /// Logit soft-capping `softcap * tanh(x / softcap)` (0 = off).
    pub softcap: f32,
}

/// Reads optional CrossEntropy options (NULL = defaults).
///
/// # Safety
/// `p` is NULL or points to a readable `npk_cross_entropy_options`.
unsafe fn read_options(p: *const npk_cross_entropy_options) -> Result<CrossEntropyOptions> {
    if p.is_null() {
        return Ok(CrossEntropyOptions::default());
    }
    // SAFETY: non-NULL and readable (caller); every field is a plain number.
    let o = unsafe { p.read_unaligned() };
    let reduction = Reduction::from_u32(o.reduction).ok_or_else(|| {
        invalid_fmt!("reduction", "{} is not an npk_reduction value", o.reduction)
    })?;
    Ok(CrossEntropyOptions {
        reduction,
        ignore_index: o.ignore_index,
        label_smoothing: o.label_smoothing,
        lse_square_scale: o.lse_square_scale,
        softcap: o.softcap,
    })
}

/// One form of CrossEntropy: its mode and how it reads its own tensors.
trait Form {
    /// What the form computes.
    const MODE: CeMode;
    /// Its own C arguments as the caller passed them.
    type Tensors;
    /// Reads them into `t`.
    ///
    /// # Safety
    /// Every pointer is NULL or valid for its type.
    unsafe fn read(own: Self::Tensors, t: &mut CeTensors) -> Result<()>;
}

/// The forward: loss, then lse (nullable).
struct Forward;

impl Form for Forward {
    const MODE: CeMode = CeMode::Forward;
    type Tensors = (*const RawTensor, *const RawTensor);

    unsafe fn read((loss, lse): Self::Tensors, t: &mut CeTensors) -> Result<()> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            t.loss = Some(read_tensor(loss, "loss")?);
            t.lse = read_opt_tensor(lse, "lse")?;
        }
        Ok(())
    }
}

/// The backward: the forward's lse, the upstream gradient, dlogits.
struct Backward;

impl Form for Backward {
    const MODE: CeMode = CeMode::Backward;
    type Tensors = (*const RawTensor, *const RawTensor, *const RawTensor);

    unsafe fn read((lse, grad, dlogits): Self::Tensors, t: &mut CeTensors) -> Result<()> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            t.lse_in = Some(read_tensor(lse, "lse")?);
            t.grad = Some(read_tensor(grad, "grad")?);
            t.dlogits = Some(read_tensor(dlogits, "dlogits")?);
        }
        Ok(())
    }
}

/// The fused form: grad_scale, loss, lse (nullable), dlogits.
struct Fused;

impl Form for Fused {
    const MODE: CeMode = CeMode::Fused;
    type Tensors = (
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
    );

    unsafe fn read(
        (grad_scale, loss, lse, dlogits): Self::Tensors,
        t: &mut CeTensors,
    ) -> Result<()> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            t.grad = Some(read_tensor(grad_scale, "grad_scale")?);
            t.loss = Some(read_tensor(loss, "loss")?);
            t.lse = read_opt_tensor(lse, "lse")?;
            t.dlogits = Some(read_tensor(dlogits, "dlogits")?);
        }
        Ok(())
    }
}

/// CrossEntropy's C skin in form `F`: every form reads logits, target,
/// weight and the options, and plans from them.
struct Skin<F>(PhantomData<F>);

impl<F: Form> CapiOp for Skin<F> {
    type Args = (
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
        *const npk_cross_entropy_options,
    );
    type Inputs = (CeTensors, CrossEntropyOptions);

    unsafe fn read((logits, target, weight, opts): Self::Args) -> Result<Self::Inputs> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            let t = CeTensors::inputs(
                read_tensor(logits, "logits")?,
                (
                    read_tensor(target, "target")?,
                    read_opt_tensor(weight, "weight")?,
                ),
            );
            Ok((t, read_options(opts)?))
        }
    }

    fn plan((t, o): &Self::Inputs, ub: &UbConfig) -> Result<u64> {
        Ok(plan(F::MODE, t, o, ub)?.1.workspace_bytes)
    }
}

impl<F: Form> CapiCall for Skin<F> {
    type Outputs = F::Tensors;
    type Call = CrossEntropyCall;

    unsafe fn prepare(
        (mut t, o): Self::Inputs,
        own: F::Tensors,
        ub: &UbConfig,
    ) -> Result<CrossEntropyCall> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe { F::read(own, &mut t)? };
        prepare(F::MODE, &t, &o, ub)
    }
}

/// Workspace bytes `npk_cross_entropy` needs (N f32 and 64 bytes for a sum
/// or mean, else 0; the same arguments as the run).
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_cross_entropy_workspace_size(
    logits: *const RawTensor,
    target: *const RawTensor,
    weight: *const RawTensor,
    opts: *const npk_cross_entropy_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::workspace_size::<Skin<Forward>>((logits, target, weight, opts), exec, workspace_bytes)
    }
}

/// CrossEntropy forward: `logits` `[N, C]` (f32, f16, bf16), `target` `[N]`
/// (i32, i64), `weight` `[C]` f32 or NULL; writes `loss` (f32: N elements
/// for `NPK_REDUCTION_NONE`, else 1) and `lse` (N f32) unless NULL. An
/// out-of-range target fails with `NPK_ERR_INDEX_OUT_OF_RANGE` (the detail
/// names the row and value). On error nothing is written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_cross_entropy(
    logits: *const RawTensor,
    target: *const RawTensor,
    weight: *const RawTensor,
    opts: *const npk_cross_entropy_options,
    loss: *const RawTensor,
    lse: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    let args = (logits, target, weight, opts);
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::launch::<Skin<Forward>>(args, (loss, lse), workspace, workspace_bytes, exec) }
}

/// Workspace bytes `npk_cross_entropy_grad` needs (0).
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_cross_entropy_grad_workspace_size(
    logits: *const RawTensor,
    target: *const RawTensor,
    weight: *const RawTensor,
    opts: *const npk_cross_entropy_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::workspace_size::<Skin<Backward>>(
            (logits, target, weight, opts),
            exec,
            workspace_bytes,
        )
    }
}

/// CrossEntropy backward: `dlogits` (logits' dtype and element count; may
/// be `logits`' own buffer, in place) from the logits, target, weight, the
/// forward's `lse` (N f32) and `grad`, the upstream gradient of the loss
/// (f32: N for `NPK_REDUCTION_NONE`, else 1; a mean's division is done
/// here). Ignored rows get zeros. On error nothing is written.
///
/// # Safety
/// As for `npk_cross_entropy`.
#[no_mangle]
pub unsafe extern "C" fn npk_cross_entropy_grad(
    logits: *const RawTensor,
    target: *const RawTensor,
    weight: *const RawTensor,
    lse: *const RawTensor,
    grad: *const RawTensor,
    opts: *const npk_cross_entropy_options,
    dlogits: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    let args = (logits, target, weight, opts);
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::launch::<Skin<Backward>>(args, (lse, grad, dlogits), workspace, workspace_bytes, exec)
    }
}

/// Workspace bytes `npk_cross_entropy_fused` uses: its exp cache (two rows
/// of C f32 per block, at most 16 MiB). A smaller workspace, or none (the
/// first ABI 2.3 builds reported 0, later ones one row per block), is
/// accepted: the call then recomputes the exps, with the same bits, about
/// 1.5x slower.
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_cross_entropy_fused_workspace_size(
    logits: *const RawTensor,
    target: *const RawTensor,
    weight: *const RawTensor,
    opts: *const npk_cross_entropy_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::workspace_size::<Skin<Fused>>((logits, target, weight, opts), exec, workspace_bytes)
    }
}

/// CrossEntropy forward and backward in one call (the fused linear
/// cross-entropy's per-chunk step): per row `loss` (N f32, never reduced)
/// and `lse` (N f32, unless NULL), and `dlogits = grad_scale_i * d loss_i /
/// d logits` with `grad_scale` f32 of N elements or 1 (e.g. `1 / global
/// denominator` for a mean over chunks). `dlogits` may be `logits`' own
/// buffer (in place). `opts->reduction` is not used. On error nothing is
/// written.
///
/// # Safety
/// As for `npk_cross_entropy`.
#[no_mangle]
pub unsafe extern "C" fn npk_cross_entropy_fused(
    logits: *const RawTensor,
    target: *const RawTensor,
    weight: *const RawTensor,
    grad_scale: *const RawTensor,
    opts: *const npk_cross_entropy_options,
    loss: *const RawTensor,
    lse: *const RawTensor,
    dlogits: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    let args = (logits, target, weight, opts);
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        skin::launch::<Skin<Fused>>(
            args,
            (grad_scale, loss, lse, dlogits),
            workspace,
            workspace_bytes,
            exec,
        )
    }
}

/// The reduced loss of per-row losses, exactly as `npk_cross_entropy`
/// reduces them (the one definition: the f32 rows summed in f64 in row
/// order; for `NPK_REDUCTION_MEAN` over the f64 sum of the class weights of
/// the rows not ignored (their count without a weight); rounded to f32
/// once): for a caller that ran the rows in several calls (the fused form
/// per chunk). `loss_rows` is N f32, `target` `[N]` i32/i64, `weight` `[C]`
/// f32 or NULL (then only negative targets other than `ignore_index` are
/// refused: C is unknown); `opts->reduction` is SUM or MEAN. Writes
/// `*loss`. ABI 2.4.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype; `loss` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn npk_cross_entropy_reduce(
    loss_rows: *const RawTensor,
    target: *const RawTensor,
    weight: *const RawTensor,
    opts: *const npk_cross_entropy_options,
    loss: *mut f32,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run(exec, |_| {
            if loss.is_null() {
                return Err(Error::NullPointer { arg: "loss" });
            }
            let rows = read_tensor(loss_rows, "loss_rows")?;
            let rc = rows.check("loss_rows")?;
            if rows.dtype != DType::F32 {
                return Err(dtype_err!("loss_rows", "dtype {} is not f32", rows.dtype));
            }
            let t = read_tensor(target, "target")?;
            let w = read_opt_tensor(weight, "weight")?;
            let o = read_options(opts)?;
            let den = super::plan::check_reduce(rc.numel, &(t, w), &o)?;
            let v = Src(rows.data as *const f32).get(0, rc.numel);
            let total = super::reduce::total(rc.numel, |i| v[i]);
            loss.write_unaligned(super::reduce::reduced(total, o.reduction, den));
            Ok(())
        })
    }
}

/// The factor every row's dlogits get from an upstream gradient `grad` of
/// the reduced loss: `grad` for SUM, `grad / denominator` rounded once for
/// MEAN (the denominator as `npk_cross_entropy_reduce`'s). Passed as the
/// fused form's `grad_scale` it gives `npk_cross_entropy_grad`'s bits.
/// Arguments as `npk_cross_entropy_reduce`'s; writes `*grad_scale`. ABI 2.4.
///
/// # Safety
/// As for `npk_cross_entropy_reduce`; `grad_scale` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn npk_cross_entropy_grad_scale(
    target: *const RawTensor,
    weight: *const RawTensor,
    opts: *const npk_cross_entropy_options,
    grad: f32,
    grad_scale: *mut f32,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe {
        run(exec, |_| {
            if grad_scale.is_null() {
                return Err(Error::NullPointer { arg: "grad_scale" });
            }
            let t = read_tensor(target, "target")?;
            let n = t.check("target")?.numel;
            let w = read_opt_tensor(weight, "weight")?;
            let o = read_options(opts)?;
            let den = super::plan::check_reduce(n, &(t, w), &o)?;
            grad_scale.write_unaligned(super::reduce::grad_factor(grad, o.reduction, den));
            Ok(())
        })
    }
}
