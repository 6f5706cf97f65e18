//! Gradient health over many tensors: `grad_stats` (sum of squares, NaN and
//! Inf counts, min, max, absmax) and `clip_grad_norm` (PyTorch's
//! `torch.nn.utils.clip_grad_norm_` for the L2 norm) — global operations over
//! all of a model's gradients, as AMP's non-finite check and gradient
//! clipping are.
//!
//! # Plan and determinism
//! The tensors (f32 | f16 | bf16, any shapes, any mix) are one flat sequence
//! of elements in list order. `GradTiling` cuts it into equal blocks from the
//! element count and `UbConfig::blocks` alone. A block widens its elements
//! to f32 on the `Lanes` and accumulates their exact f64 squares into a fixed
//! 16-lane pattern (see `cpu`), folds the lanes in a fixed tree, and the blocks' partials
//! are combined in f64 in block order. So the same tensors and `UbConfig`
//! give the same bits with any runner and thread count (and any ISA: no FMA,
//! and zero min/max are reported as +0.0) — in the default floating-point
//! environment: a host that enables flush-to-zero / denormals-are-zero
//! (e.g. `torch.set_flush_denormal(True)`) changes subnormal results.
//!
//! # Precision of the norm
//! Each square is exact in f64 (an f32 times an f32), and the squares are
//! summed in f64 (per lane in element order, a 4-level fold, then the blocks
//! in order): relative error at most about `(elements / 16 + blocks) *
//! 2^-53` on `sum_sq`, ~1e-9 at 10^9 elements in the worst case and far less
//! in practice. No f32 rounding is involved, so a finite gradient never
//! yields an infinite norm, tiny gradients keep their precision, and where
//! the blocks (or the ranks of a sharded model) cut the elements moves the
//! result only in the last f64 bits.
//! Measured against a compensated float64 sum (`tests/grad_stats.rs`,
//! `cargo test --test grad_stats -- --nocapture`): worst 3.0e-14 relative on
//! the norm over random mixed lists, 1.1e-13 over 2^24 + 2^23 elements.
//!
//! # Clipping (`clip_grad_norm`), PyTorch's rule
//! - `total_norm` = L2 norm of all elements: NaN if any element is NaN, +Inf
//!   if any is ±Inf (and none NaN), else `sqrt(sum_sq)` in f64. PyTorch
//!   computes per-tensor norms in each tensor's dtype and then the norm of
//!   those; ours is the f64 value they approximate.
//! - With a NaN/Inf present and `error_if_nonfinite`: `Error::NonFinite`,
//!   and no tensor is touched.
//! - Else `coef = max_norm / (total_norm + 1e-6)` in f64, clamped to at most
//!   1.0 with NaN propagating (`torch.clamp(max=1.0)`), rounded once to f32.
//!   A NaN norm gives a NaN coefficient, an infinite norm gives 0 (or NaN for
//!   an infinite `max_norm`); both are applied, as PyTorch applies them.
//! - Every element becomes `round(f32(x) * coef)`: one f32 product, rounded
//!   once (to nearest even) to the tensor's dtype — what `mul_` by an f32
//!   scalar does to f32/f16/bf16 tensors on CPU.
//! - PyTorch multiplies even when `coef == 1.0`. We skip that pass, and the
//!   result is bitwise the same: `coef == 1.0` implies the norm is finite,
//!   so no element is NaN/Inf, and `x * 1.0 == x` bit for bit for every
//!   finite x (±0 and subnormals included) with no rounding in f32, f16 or
//!   bf16. The reference model does multiply, and the tests compare the two.
//! - `max_norm` must be >= 0 and not NaN (`InvalidParam`): PyTorch accepts a
//!   negative or NaN `max_norm` and silently flips or poisons every gradient.
//!   `+Inf` is accepted (compute the norm, never clip).
//!
//! # Where they run
//! Like every operator: the front end validates, plans and lowers the list
//! into a segment table in the workspace (`npk_list_seg` rows, each with its
//! own dtype), then hands a `GradStatsCall` / `ClipGradNormCall` to the
//! `Exec`'s backend (`Op::GradStats`, `Op::ClipGradNorm`; the foreign
//! entries `grad_stats` and `clip_grad_norm`, ABI 2.7): the CPU kernels,
//! the f64 reference model, or an adapter's NPU launch.
//!
//! # Validation
//! Everything is checked before anything is written: dtypes (i32/i64 are
//! `DtypeUnsupported`), sizes (checked arithmetic, `SizeOverflow`), the
//! workspace (size, and for descriptors: not overlapping a tensor), and for
//! clipping that no two tensors overlap (`InvalidParam`). The workspace
//! holds the segment table and the per-block partials; no allocation.

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
mod minmax;
mod plan;
pub(crate) mod reference;
mod types;

use crate::lanes::detect::Available;
use core::ffi::c_void;

pub use plan::{GradTiling, GRAD_MIN_BLOCK_ELEMS};
pub use types::{ClipGradNormOptions, GradSummary, GradTensor, GradTensorMut};

#[cfg_attr(not(feature = "capi"), allow(unused_imports))] // for the C ABI
pub(crate) use plan::{plan_of, GradSource, ARG};
pub(crate) use plan::{Partial, Seg};
use plan::{RawList, RoList, RwList};

use super::Op;
use super::{dispatch_isa, Exec};
use crate::dtype::DType;
use crate::error::{invalid, Error, Result};
use crate::lanes::Lanes;
use crate::runner::Runner;
use crate::tensor::RawTensor;
use crate::tensor_list::TensorList;
use crate::workspace::{Dst, Workspace};

/// PyTorch's clipping coefficient: `min(1, max_norm / (total_norm + 1e-6))`
/// in f64, NaN propagating through the clamp, rounded once to f32.
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f32 {
    let c = max_norm / (total_norm + 1e-6);
    let c = if c > 1.0 { 1.0 } else { c };
    c as f32
}

/// Workspace bytes `grad_stats` needs for these tensors under `exec.ub`
/// (depends on the number of non-empty tensors and the element count only).
pub fn grad_stats_workspace_size(exec: &Exec<'_>, tensors: &[GradTensor<'_>]) -> Result<usize> {
    bytes_of(plan_of(&mut RoList(tensors, ARG), &exec.ub)?)
}

/// Workspace bytes `clip_grad_norm` needs: the same as `grad_stats` for the
/// same tensors (`opts` is validated here too).
pub fn clip_grad_norm_workspace_size(
    exec: &Exec<'_>,
    tensors: &[GradTensorMut<'_>],
    opts: &ClipGradNormOptions,
) -> Result<usize> {
    opts.check()?;
    bytes_of(plan_of(&mut ShapeList(tensors), &exec.ub)?)
}

/// `grad_stats_workspace_size` for C-style descriptors (validates them; the
/// data pointers are not dereferenced).
pub fn grad_stats_workspace_size_raw(exec: &Exec<'_>, tensors: &[RawTensor]) -> Result<usize> {
    bytes_of(plan_of(&mut RawList(tensors, ARG), &exec.ub)?)
}

/// Sum of squares, NaN/Inf counts, min, max and absmax over every element of
/// every tensor, in one read of the data. `workspace` must hold
/// `grad_stats_workspace_size` bytes (any alignment).
pub fn grad_stats(
    exec: &Exec<'_>,
    tensors: &[GradTensor<'_>],
    workspace: &mut [u8],
) -> Result<GradSummary> {
    let ws = workspace.as_mut_ptr() as *mut c_void;
    stats_with(exec, &mut RoList(tensors, ARG), ws, workspace.len(), None)
}

/// `torch.nn.utils.clip_grad_norm_` (L2): returns the total norm of all
/// tensors and scales them in place by `min(1, max_norm / (norm + 1e-6))`
/// (see the module docs for NaN/Inf and rounding). With
/// `opts.error_if_nonfinite` and a NaN/Inf present it returns
/// `Error::NonFinite` and changes nothing. `workspace` must hold
/// `clip_grad_norm_workspace_size` bytes.
pub fn clip_grad_norm(
    exec: &Exec<'_>,
    tensors: &mut [GradTensorMut<'_>],
    opts: &ClipGradNormOptions,
    workspace: &mut [u8],
) -> Result<f64> {
    let ws = workspace.as_mut_ptr() as *mut c_void;
    let n = workspace.len();
    clip_with(exec, &mut RwList(tensors, ARG), opts, ws, n, None)
}

/// `grad_stats` over C-style descriptors (what `npk_grad_stats` runs).
///
/// # Safety
/// Every descriptor's `data` must be valid for reads of its shape's elements
/// of its dtype (or may be anything when empty); `workspace` must be valid
/// for writes of `workspace_bytes` bytes (or NULL when the size is 0). The
/// descriptors themselves are validated (rank, dims, dtype, NULL data,
/// alignment, overflow, workspace overlap).
pub unsafe fn grad_stats_raw(
    exec: &Exec<'_>,
    tensors: &[RawTensor],
    workspace: *mut c_void,
    workspace_bytes: usize,
) -> Result<GradSummary> {
    stats_with(
        exec,
        &mut RawList(tensors, ARG),
        workspace,
        workspace_bytes,
        None,
    )
}

/// `clip_grad_norm` over C-style descriptors (what `npk_clip_grad_norm` runs).
///
/// # Safety
/// As for `grad_stats_raw`, and every non-empty tensor must be valid for
/// writes. Overlapping tensors are detected and rejected.
pub unsafe fn clip_grad_norm_raw(
    exec: &Exec<'_>,
    tensors: &[RawTensor],
    opts: &ClipGradNormOptions,
    workspace: *mut c_void,
    workspace_bytes: usize,
) -> Result<f64> {
    let mut l = RawList(tensors, ARG);
    clip_with(exec, &mut l, opts, workspace, workspace_bytes, None)
}

/// Read-only view of a mutable list, for sizing only.
struct ShapeList<'l, 'a>(&'l [GradTensorMut<'a>]);

impl GradSource for ShapeList<'_, '_> {
    fn count(&self) -> usize {
        self.0.len()
    }
    fn get(&mut self, i: usize) -> Result<(*mut c_void, DType, usize)> {
        let t = self.0.get(i).ok_or(invalid(ARG, "index past the list"))?;
        // Never dereferenced: the plan needs lengths only.
        Ok((core::ptr::null_mut(), t.dtype(), t.len()))
    }
}

fn bytes_of(t: GradTiling) -> Result<usize> {
    super::workspace_len(t.workspace_bytes)
}

/// A byte range an output other than the tensors occupies (the C ABI's
/// `out` / `total_norm`), checked against the tensors and the workspace.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OutRange {
    pub name: &'static str,
    pub addr: usize,
    pub bytes: usize,
}

fn overlaps(a: usize, an: usize, b: usize, bn: usize) -> bool {
    an > 0 && bn > 0 && a < b.saturating_add(bn) && b < a.saturating_add(an)
}

/// A validated, planned `grad_stats` call: what a backend receives (the
/// foreign entry `grad_stats`, `npk_grad_stats_call`, ABI 2.7).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GradStatsCall {
    /// The gradients (read only), lowered: each row carries its own dtype
    /// (a list may mix f32, f16 and bf16; `tensors.dtype` is the first's).
    pub tensors: TensorList,
    /// Output: the statistics.
    pub summary: *mut GradSummary,
    /// The tiling plan (its blocks' partials live in the workspace).
    pub tiling: GradTiling,
    /// The caller's workspace (the segment table, the per-block partials).
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

/// What a `clip_grad_norm` call did (`npk_clip_grad_norm_result`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ClipGradNormReport {
    /// The norm before clipping (NaN / +Inf when an element is).
    pub total_norm: f64,
    /// 1 when a NaN or Inf was found under `error_if_nonfinite`: nothing was
    /// scaled (the front end returns `Error::NonFinite`); else 0.
    pub refused: u32,
}

/// A validated, planned `clip_grad_norm` call: what a backend receives (the
/// foreign entry `clip_grad_norm`, `npk_clip_grad_norm_call`, ABI 2.7). The
/// entry takes the norm, then scales every tensor in place by PyTorch's
/// coefficient (module docs), and writes `report`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ClipGradNormCall {
    /// The gradients (read, then scaled in place; pairwise disjoint), as
    /// `GradStatsCall::tensors`.
    pub tensors: TensorList,
    /// The largest norm left unclipped (>= 0, not NaN; +Inf never clips).
    pub max_norm: f64,
    /// Nonzero: a NaN / Inf refuses the call (`report.refused`).
    pub error_if_nonfinite: u32,
    /// Output: the norm, and whether the call was refused.
    pub report: *mut ClipGradNormReport,
    /// The tiling plan (as `grad_stats`').
    pub tiling: GradTiling,
    /// The caller's workspace.
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

impl ClipGradNormCall {
    /// PyTorch's decision from the statistics, shared by the kernels and
    /// the reference: writes `report` and returns the coefficient to apply,
    /// or None when the call is refused (nothing may be scaled).
    ///
    /// # Safety
    /// `report` points at the front end's result (a call it built).
    pub(crate) unsafe fn decide(&self, s: &GradSummary) -> Option<f32> {
        let norm = s.norm();
        let refused = self.error_if_nonfinite != 0 && !s.is_finite();
        // SAFETY: the caller's contract.
        unsafe {
            self.report.write(ClipGradNormReport {
                total_norm: norm,
                refused: refused as u32,
            })
        };
        (!refused).then(|| clip_coefficient(norm, self.max_norm))
    }
}

/// The two calls' runs, so that one operator folder serves both registry
/// entries (`cpu::cpu` and `reference::reference` are generic over it).
pub(crate) trait GradCall {
    /// Runs the call on the CPU kernels of `isa` over `runner`.
    ///
    /// # Safety
    /// The call comes from the front end; `isa` is available.
    unsafe fn cpu(&self, isa: Available, runner: &dyn Runner);
    /// Runs the call on the f64 golden model.
    ///
    /// # Safety
    /// The call comes from the front end.
    unsafe fn reference(&self);
}

/// The partials region of a call's checked workspace.
///
/// # Safety
/// `ws` is the workspace the front end checked against `t`.
pub(crate) unsafe fn partials_of(ws: *mut c_void, t: &GradTiling) -> *mut Partial {
    let base = ws as *mut u8;
    // SAFETY: the plan's partials region lies inside the checked workspace.
    unsafe {
        base.add(crate::tiling::align_offset(base))
            .add(t.partials_offset as usize)
            .cast::<Partial>()
    }
}

/// Validates everything, then writes the segment table into the workspace;
/// returns the plan and the lowered list (empty when there is no element).
/// `writes`: the tensors are outputs too (clip), so they must not overlap.
fn prepare<S: GradSource>(
    exec: &Exec<'_>,
    src: &mut S,
    ws: *mut c_void,
    bytes: usize,
    writes: bool,
    out: Option<OutRange>,
) -> Result<(GradTiling, TensorList)> {
    let t = plan_of(src, &exec.ub)?;
    let needed = bytes_of(t)?;
    let w = Workspace::new(ws, bytes, t.workspace_bytes)?;
    let used = bytes.min(needed);
    if let Some(o) = out {
        if overlaps(o.addr, o.bytes, ws as usize, used) {
            return Err(invalid(o.name, "output buffer overlaps the workspace"));
        }
    }
    for i in 0..src.count() {
        let (p, dt, n) = src.get(i)?;
        let tb = n * dt.size_bytes(); // validated not to overflow
        if overlaps(p as usize, tb, ws as usize, used) {
            return Err(invalid("workspace", "workspace overlaps a tensor"));
        }
        if let Some(o) = out {
            if overlaps(o.addr, o.bytes, p as usize, tb) {
                return Err(invalid(o.name, "output buffer overlaps a tensor"));
            }
        }
    }
    if t.blocks == 0 {
        return Ok((t, TensorList::NONE));
    }
    let nseg = t.tensors as usize;
    // SAFETY: the plan's table region lies inside the checked workspace,
    // which overlaps no tensor; nothing else uses it during the call.
    let table = unsafe {
        w.region(
            t.table_offset as usize,
            (t.partials_offset - t.table_offset) as usize / 4,
        )
        .as_mut_ptr() as *mut Seg
    };
    let mut k = 0usize;
    let mut start = 0usize;
    let mut first = DType::F32;
    for i in 0..src.count() {
        let (data, dtype, numel) = src.get(i)?;
        if numel == 0 {
            continue;
        }
        if k >= nseg {
            return Err(invalid(ARG, "the list changed while it was read"));
        }
        if k == 0 {
            first = dtype;
        }
        let seg = Seg {
            data,
            start,
            numel,
            dtype,
        };
        // SAFETY: k < nseg rows fit in the table region (64-byte aligned).
        unsafe { table.add(k).write(seg) };
        k += 1;
        start += numel;
    }
    if k != nseg {
        return Err(invalid(ARG, "the list changed while it was read"));
    }
    // SAFETY: the first `nseg` rows were just written.
    let rows = unsafe { core::slice::from_raw_parts_mut(table, nseg) };
    if writes {
        // Overlap check without allocating: sort the table by address, look
        // at neighbours, sort it back (flat starts are distinct).
        rows.sort_unstable_by_key(|s| s.data as usize);
        let clash = rows.windows(2).any(|w| {
            let a = w[0].data as usize + w[0].numel * w[0].dtype.size_bytes();
            a > w[1].data as usize
        });
        rows.sort_unstable_by_key(|s| s.start);
        if clash {
            return Err(invalid(ARG, "two tensors overlap"));
        }
    }
    Ok((
        t,
        TensorList {
            segs: table,
            count: nseg,
            dtype: first,
        },
    ))
}

pub(crate) fn stats_with<S: GradSource>(
    exec: &Exec<'_>,
    src: &mut S,
    ws: *mut c_void,
    bytes: usize,
    out: Option<OutRange>,
) -> Result<GradSummary> {
    let (t, tensors) = prepare(exec, src, ws, bytes, false, out)?;
    let mut summary = cpu::combine(&[], 0);
    if t.blocks == 0 {
        return Ok(summary);
    }
    let call = GradStatsCall {
        tensors,
        summary: &mut summary,
        tiling: t,
        workspace: ws,
        workspace_bytes: bytes,
    };
    // SAFETY: the list was validated and lowered into the checked workspace.
    unsafe { exec.backend.launch(Op::GradStats(&call))? };
    Ok(summary)
}

pub(crate) fn clip_with<S: GradSource>(
    exec: &Exec<'_>,
    src: &mut S,
    opts: &ClipGradNormOptions,
    ws: *mut c_void,
    bytes: usize,
    out: Option<OutRange>,
) -> Result<f64> {
    opts.check()?;
    let (t, tensors) = prepare(exec, src, ws, bytes, true, out)?;
    if t.blocks == 0 {
        return Ok(cpu::combine(&[], 0).norm());
    }
    let mut report = ClipGradNormReport::default();
    let call = ClipGradNormCall {
        tensors,
        max_norm: opts.max_norm,
        error_if_nonfinite: opts.error_if_nonfinite as u32,
        report: &mut report,
        tiling: t,
        workspace: ws,
        workspace_bytes: bytes,
    };
    // SAFETY: the list was validated (writable, pairwise disjoint) and
    // lowered into the checked workspace.
    unsafe { exec.backend.launch(Op::ClipGradNorm(&call))? };
    if report.refused != 0 {
        return Err(Error::NonFinite);
    }
    Ok(report.total_norm)
}

/// The statistics of the tensors of a segment table cut by `t` (at least
/// one block), with the blocks' partials in `parts`: what `grad_stats` runs,
/// and AdamW's clip on its grads' table.
///
/// # Safety
/// `segs` is the validated table of `t`'s tensors; `parts` is writable for
/// `t.blocks` partials that nothing else uses; `isa` is available.
pub(crate) unsafe fn stats_table(
    segs: &[Seg],
    t: &GradTiling,
    parts: *mut Partial,
    isa: Available,
    runner: &dyn Runner,
) -> GradSummary {
    // SAFETY: forwarded.
    unsafe { dispatch_isa!(isa, L => stats_blocks::<L>(segs, t, parts, runner)) }
}

unsafe fn stats_blocks<L: Lanes>(
    segs: &[Seg],
    t: &GradTiling,
    parts: *mut Partial,
    runner: &dyn Runner,
) -> GradSummary {
    let nb = t.blocks as usize;
    let dst = Dst(parts);
    runner.parallel_for(nb, &|b| {
        if b < nb {
            // SAFETY: the table describes validated tensors; `isa` was
            // resolved as available, so `L::enter` may use its features.
            let r = unsafe {
                L::enter(
                    #[inline(always)]
                    || cpu::block_stats::<L>(segs, t, b),
                )
            };
            // SAFETY: partial b is block b's alone; b < blocks.
            unsafe { dst.get(b, 1)[0] = r };
        }
    });
    // SAFETY: every block wrote its partial (the runner contract) and the
    // runner has returned.
    let parts = unsafe { core::slice::from_raw_parts(parts, nb) };
    cpu::combine(parts, t.elements)
}

impl GradCall for GradStatsCall {
    unsafe fn cpu(&self, isa: Available, runner: &dyn Runner) {
        // SAFETY: forwarded.
        unsafe { cpu::stats_call(self, isa, runner) }
    }
    unsafe fn reference(&self) {
        // SAFETY: forwarded.
        unsafe { reference::stats_call(self) }
    }
}

impl GradCall for ClipGradNormCall {
    unsafe fn cpu(&self, isa: Available, runner: &dyn Runner) {
        // SAFETY: forwarded.
        unsafe { cpu::clip_call(self, isa, runner) }
    }
    unsafe fn reference(&self) {
        // SAFETY: forwarded.
        unsafe { reference::clip_call(self) }
    }
}
