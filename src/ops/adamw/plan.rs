//! Host side of AdamW: validation of the lists and options, the tiling plan
//! (the flat element sequence cut like gradient health's, so the clip's
//! norm is `grad_stats`'s to the bit), the f32 constants, and the launch
//! that lowers the lists into the workspace.

use core::ffi::c_void;
use core::mem::size_of;

use super::formats::{AdamWFormats, AdamWState, ADAMW_SR_MOMENTS, ADAMW_SR_PARAMS, KNOWN_ROUNDING};
use super::{AdamWCall, AdamWOptions, AdamWReport};
use super::{ADAMW_AMSGRAD, ADAMW_CLIP, ADAMW_GRAD_SCALE, ADAMW_L2};
use crate::dtype::DType;
use crate::error::{dtype_err, invalid, invalid_fmt, Error, Result};
use crate::ops::grad_stats::GradTiling;
use crate::ops::{Exec, Op};
use crate::tensor_list::{disjoint, overlaps, ListSeg, ListSource, TensorList};
use crate::tiling::{UbConfig, WORKSPACE_ALIGN};
use crate::workspace::Workspace;

/// The lists of one step, as sources (Rust slices or C descriptors).
pub(crate) struct Lists<'s> {
    pub params: &'s mut dyn ListSource,
    pub grads: &'s mut dyn ListSource,
    pub exp_avgs: &'s mut dyn ListSource,
    pub exp_avg_sqs: &'s mut dyn ListSource,
    pub max_exp_avg_sqs: &'s mut dyn ListSource,
    pub masters: &'s mut dyn ListSource,
    /// 8-bit moments' block scales (empty otherwise).
    pub exp_avg_scales: &'s mut dyn ListSource,
    pub exp_avg_sq_scales: &'s mut dyn ListSource,
    pub max_exp_avg_sq_scales: &'s mut dyn ListSource,
    /// On a refusal about one tensor of the list the error names: its index
    /// (the C ABI's `detail->position`).
    pub bad: Option<usize>,
}

/// Slots of the segment tables in the workspace, in this order.
pub(crate) const LISTS: usize = 6;
/// With 8-bit moments, three more: the scale lists.
pub(crate) const ALL_LISTS: usize = LISTS + 3;

impl Lists<'_> {
    fn all(&mut self) -> [&mut dyn ListSource; ALL_LISTS] {
        [
            &mut *self.params,
            &mut *self.grads,
            &mut *self.exp_avgs,
            &mut *self.exp_avg_sqs,
            &mut *self.max_exp_avg_sqs,
            &mut *self.masters,
            &mut *self.exp_avg_scales,
            &mut *self.exp_avg_sq_scales,
            &mut *self.max_exp_avg_sq_scales,
        ]
    }
}

/// Tiling of one AdamW step (the TilingData an NPU kernel would receive).
///
/// Workspace layout, from the 64-byte aligned start: six segment tables of
/// `tensors` rows each (params, grads, exp_avgs, exp_avg_sqs,
/// max_exp_avg_sqs, masters; an absent list's table is left unwritten),
/// `table_stride` bytes apart (with 8-bit moments nine: then the three
/// scale lists'); then the host's overlap scratch (16 bytes per tensor,
/// plus one for the workspace); then, with `ADAMW_CLIP`, one 64-byte
/// partial per block for the norm; then, with stochastic rounding or 8-bit
/// moments, one `u64` key per row (`AdamWState::keys_offset`) and, with
/// 8-bit moments, after them one `u64` per row: its quantization row length
/// (`Q8Grid::row`, resolved: never 0).
///
/// With 8-bit moments block `b` steps the quantization blocks (256
/// elements from each row's first element, `Q8Grid`) whose first element
/// lies in its flat range `block_range(b)`, so no block cuts one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdamWTiling {
    /// Non-empty tensors per list (rows of each table).
    pub tensors: u64,
    /// Elements per list.
    pub elements: u64,
    /// Blocks the flat element range is cut into (0 when there are none).
    pub blocks: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// Elements per block, a multiple of 16; the last block may have fewer.
    pub elems_per_block: u64,
    /// Offset of the first table from the aligned workspace start.
    pub table_offset: u64,
    /// Bytes from one table to the next.
    pub table_stride: u64,
    /// Offset of the overlap scratch.
    pub scratch_offset: u64,
    /// Offset of the clip's per-block partials (`ADAMW_CLIP` only).
    pub partials_offset: u64,
    /// Total workspace bytes, alignment slack included (0 when there are no
    /// elements).
    pub workspace_bytes: u64,
}

impl AdamWTiling {
    /// The gradient-health plan of the same cut, over the grads' table: the
    /// clip's norm runs `grad_stats`'s blocks on it.
    pub fn grad_tiling(&self) -> GradTiling {
        GradTiling {
            tensors: self.tensors,
            elements: self.elements,
            blocks: self.blocks,
            reserved: 0,
            elems_per_block: self.elems_per_block,
            window_elems: GradTiling::WINDOW_ELEMS,
            table_offset: self.table_offset + self.table_stride,
            partials_offset: self.partials_offset,
            workspace_bytes: self.workspace_bytes,
        }
    }

    /// The flat element range `[start, end)` of block `b`.
    pub fn block_range(&self, b: usize) -> (usize, usize) {
        self.grad_tiling().block_range(b)
    }
}

/// The options' f32 constants, formed once in f64 and rounded once.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AdamWConsts {
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bias_correction2_sqrt: f32,
    /// `beta1`.
    pub beta1: f32,
    /// `1 - beta1`.
    pub one_minus_beta1: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `eps`.
    pub eps: f32,
    /// Decoupled: `1 - lr * weight_decay`; L2 mode: 1.
    pub decay: f32,
    /// L2 mode: `weight_decay`; decoupled: 0.
    pub l2: f32,
    /// `grad_scale` with `ADAMW_GRAD_SCALE`, else 1.
    pub grad_scale: f32,
    /// -1 with `ADAMW_MAXIMIZE`, else 1.
    pub sign: f32,
    /// The clip coefficient: the caller's under `ADAMW_CLIP_COEF`; under
    /// `ADAMW_CLIP` 1 until the backend has taken the norm; else 1.
    pub clip_coef: f32,
}

/// `x^n` in f64 by squaring (deterministic on every target; within a few
/// f64 ulp of the exact power for any n <= 2^53).
pub(crate) fn powi(x: f64, mut n: u64) -> f64 {
    let (mut r, mut b) = (1.0f64, x);
    while n > 0 {
        if n & 1 == 1 {
            r *= b;
        }
        b *= b;
        n >>= 1;
    }
    r
}

impl AdamWConsts {
    /// The constants of validated options.
    pub fn new(o: &AdamWOptions) -> AdamWConsts {
        let bc1 = 1.0 - powi(o.beta1, o.step);
        let bc2 = 1.0 - powi(o.beta2, o.step);
        let l2 = o.has(ADAMW_L2);
        AdamWConsts {
            step_size: (o.lr / bc1) as f32,
            bias_correction2_sqrt: crate::lanes::sqrt_f64(bc2) as f32,
            beta1: o.beta1 as f32,
            one_minus_beta1: (1.0 - o.beta1) as f32,
            beta2: o.beta2 as f32,
            one_minus_beta2: (1.0 - o.beta2) as f32,
            eps: o.eps as f32,
            decay: if l2 {
                1.0
            } else {
                (1.0 - o.lr * o.weight_decay) as f32
            },
            l2: if l2 { o.weight_decay as f32 } else { 0.0 },
            grad_scale: if o.has(ADAMW_GRAD_SCALE) {
                o.grad_scale
            } else {
                1.0
            },
            sign: if o.has(super::ADAMW_MAXIMIZE) {
                -1.0
            } else {
                1.0
            },
            clip_coef: if o.has(super::ADAMW_CLIP_COEF) {
                o.clip_coef
            } else {
                1.0
            },
        }
    }
}

fn round_up(n: usize, m: usize) -> Option<usize> {
    n.checked_add(m - 1).map(|v| v / m * m)
}

/// What validation found: the plan, each list's dtype and where the keys go.
struct Checked {
    t: AdamWTiling,
    dtypes: [DType; ALL_LISTS],
    state: AdamWState,
}

/// The formats' own checks and the list counts they ask for.
fn check_formats(f: &AdamWFormats<'_>, n: usize, masters: usize) -> Result<()> {
    if f.rounding & !KNOWN_ROUNDING != 0 {
        return Err(invalid_fmt!(
            "formats",
            "unknown rounding bits {:#x}",
            f.rounding & !KNOWN_ROUNDING
        ));
    }
    if f.split_masters && masters != n {
        return Err(invalid_fmt!(
            "masters",
            "{masters} tensors for {n} params: split masters want one low half per param"
        ));
    }
    if f.quantized_moments && f.rounding & ADAMW_SR_MOMENTS != 0 {
        return Err(invalid(
            "formats",
            "8-bit moments are not also stochastically rounded bf16 moments (ADAMW_SR_MOMENTS)",
        ));
    }
    if f.rounding & ADAMW_SR_PARAMS != 0 && masters != 0 {
        return Err(invalid(
            "formats",
            "stochastically rounded params have no masters (the masters list must be empty)",
        ));
    }
    if !f.keys.is_empty() && f.keys.len() != n {
        return Err(invalid_fmt!(
            "keys",
            "{} keys for {n} params (want 0 or {n})",
            f.keys.len()
        ));
    }
    if !f.q8_rows.is_empty() && (!f.quantized_moments || f.q8_rows.len() != n) {
        return Err(if f.quantized_moments {
            invalid_fmt!(
                "q8_rows",
                "{} row lengths for {n} params (want 0 or {n})",
                f.q8_rows.len()
            )
        } else {
            invalid("q8_rows", "row lengths without 8-bit moments (want none)")
        });
    }
    Ok(())
}

/// Validates the options and every tensor of every list (counts, dtypes,
/// element counts), then cuts the plan.
fn check(
    l: &mut Lists<'_>,
    o: &AdamWOptions,
    f: &AdamWFormats<'_>,
    ub: &UbConfig,
) -> Result<Checked> {
    o.check()?;
    let ams = o.has(ADAMW_AMSGRAD);
    let n = l.params.count();
    let masters = l.masters.count();
    check_formats(f, n, masters)?;
    if masters != 0 && masters != n {
        return Err(invalid_fmt!(
            "masters",
            "{masters} tensors for {n} params (want 0 or {n})"
        ));
    }
    let q = f.quantized_moments;
    let nq = if q { n } else { 0 };
    let want = [
        n,
        n,
        n,
        n,
        if ams { n } else { 0 },
        masters,
        nq,
        nq,
        if ams { nq } else { 0 },
    ];
    let mut dtypes = [DType::F32; ALL_LISTS];
    for (k, s) in l.all().into_iter().enumerate() {
        if s.count() != want[k] {
            return Err(if k >= LISTS && !q {
                invalid_fmt!(
                    s.name(),
                    "{} tensors without 8-bit moments (want none)",
                    s.count()
                )
            } else if (k == 4 || k == 8) && !ams {
                invalid_fmt!(
                    s.name(),
                    "{} tensors without amsgrad (want none)",
                    s.count()
                )
            } else {
                invalid_fmt!(s.name(), "{} tensors for {n} params", s.count())
            });
        }
    }
    let (mut rows, mut total) = (0usize, 0usize);
    // A refusal about tensor `i` of one list, recorded after the loop (the
    // sources borrow `l` inside it).
    let mut refused = None;
    'tensors: for i in 0..n {
        let mut numel = 0;
        // 8-bit moments' row length (0: the whole tensor); a length past
        // the address space cannot divide a real tensor.
        let row = f
            .q8_rows
            .get(i)
            .map_or(0, |&r| usize::try_from(r).unwrap_or(usize::MAX));
        for (k, s) in l.all().into_iter().enumerate() {
            if want[k] == 0 {
                continue;
            }
            let (_, dt, e) = s.get(i)?;
            // Only the masters list may hold i16 (split masters' low halves),
            // only the moments u8 (8-bit moments' codes).
            let codes = q && (2..5).contains(&k) && dt == DType::U8;
            if k < 5 && !dt.is_float() && !codes {
                refused = Some((
                    i,
                    dtype_err!(s.name(), "tensor {i} has dtype {dt}, not f32, f16 or bf16"),
                ));
                break 'tensors;
            }
            if k >= LISTS {
                if dt != DType::F32 {
                    refused = Some((
                        i,
                        dtype_err!(s.name(), "tensor {i} has dtype {dt}: block scales are f32"),
                    ));
                    break 'tensors;
                }
                let want = super::q8::Q8Grid::new(numel, row).scales_len(numel);
                if e != want {
                    refused = Some((
                        i,
                        invalid_fmt!(
                            s.name(),
                            "tensor {i} has {e} elements, want {want} (one per {} of \
                             each row of {} of params[{i}]'s {numel})",
                            super::q8::Q8_BLOCK,
                            if row == 0 { numel } else { row }
                        ),
                    ));
                    break 'tensors;
                }
            } else if k == 0 {
                numel = e;
                if !super::q8::Q8Grid::valid(numel, row) {
                    refused = Some((
                        i,
                        invalid_fmt!(
                            "q8_rows",
                            "row length {row} of tensor {i} does not divide its {numel} elements"
                        ),
                    ));
                    break 'tensors;
                }
            } else if e != numel {
                refused = Some((
                    i,
                    invalid_fmt!(s.name(), "tensor {i} has {e} elements, params[{i}] {numel}"),
                ));
                break 'tensors;
            }
            if i == 0 {
                dtypes[k] = dt;
            } else if dt != dtypes[k] {
                refused = Some((
                    i,
                    dtype_err!(
                        s.name(),
                        "tensor {i} has dtype {dt}, tensor 0 {}",
                        dtypes[k]
                    ),
                ));
                break 'tensors;
            }
        }
        // Every key of the tensor must be a u64: keys[i] + numel.
        if let Some(&k) = f.keys.get(i) {
            if k.checked_add(numel as u64).is_none() {
                refused = Some((
                    i,
                    invalid_fmt!(
                        "keys",
                        "key {k} of tensor {i} + its {numel} elements passes 2^64"
                    ),
                ));
                break 'tensors;
            }
        }
        if numel > 0 {
            rows += 1;
            total = total
                .checked_add(numel)
                .filter(|&t| t <= i64::MAX as usize)
                .ok_or(Error::SizeOverflow { arg: "params" })?;
        }
    }
    if let Some((i, e)) = refused {
        l.bad = Some(i);
        return Err(e);
    }
    if n > 0 {
        // Every tensor of a list has its tensor 0's dtype: a wrong list
        // dtype is tensor 0's.
        l.bad = Some(0);
        let (p, m) = (dtypes[0], dtypes[2]);
        let sr_moments = f.rounding & ADAMW_SR_MOMENTS != 0;
        if q && m != DType::U8 {
            return Err(dtype_err!(
                "exp_avgs",
                "dtype {m}: 8-bit moments are u8 codes"
            ));
        }
        if sr_moments && m != DType::BF16 {
            return Err(dtype_err!(
                "exp_avgs",
                "dtype {m}: stochastically rounded moments are bf16"
            ));
        }
        if !sr_moments && !q && m != DType::F32 && m != p {
            return Err(dtype_err!(
                "exp_avgs",
                "dtype {m}: want f32 or the params' {p}"
            ));
        }
        if (f.split_masters || f.rounding & ADAMW_SR_PARAMS != 0) && p != DType::BF16 {
            let what = if f.split_masters {
                "split masters"
            } else {
                "stochastically rounded params"
            };
            return Err(dtype_err!("params", "dtype {p}: {what} are bf16 params"));
        }
        if dtypes[3] != m {
            return Err(dtype_err!(
                "exp_avg_sqs",
                "dtype {}: want exp_avgs' {m}",
                dtypes[3]
            ));
        }
        if ams && dtypes[4] != m {
            return Err(dtype_err!(
                "max_exp_avg_sqs",
                "dtype {}: want exp_avgs' {m}",
                dtypes[4]
            ));
        }
        let want = if f.split_masters {
            DType::I16
        } else {
            DType::F32
        };
        if masters != 0 && dtypes[5] != want {
            return Err(dtype_err!(
                "masters",
                "dtype {}: want {want}{}",
                dtypes[5],
                if f.split_masters {
                    " (split masters' low halves)"
                } else {
                    ""
                }
            ));
        }
    }
    l.bad = None;
    let lists = if q { ALL_LISTS } else { LISTS };
    let mut t = tiling(rows, total, o.has(ADAMW_CLIP), lists, ub)?;
    let mut state = AdamWState {
        split_masters: f.split_masters as u32,
        rounding: f.rounding,
        seed: f.seed,
        keys_offset: 0,
        quantized_moments: q as u32,
        reserved: 0,
    };
    if state.stochastic() && t.workspace_bytes != 0 {
        // The keys after the partials: the layout without them is unchanged.
        let at = t.workspace_bytes as usize - WORKSPACE_ALIGN;
        // With 8-bit moments the rows' lengths follow the keys.
        let end = rows
            .checked_mul(size_of::<u64>() * (1 + q as usize))
            .and_then(|b| b.checked_add(at))
            .and_then(|b| round_up(b, WORKSPACE_ALIGN))
            .and_then(|b| b.checked_add(WORKSPACE_ALIGN))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(Error::SizeOverflow { arg: "workspace" })?;
        state.keys_offset = at as u64;
        t.workspace_bytes = end as u64;
    }
    Ok(Checked { t, dtypes, state })
}

fn tiling(
    rows: usize,
    elements: usize,
    clip: bool,
    lists: usize,
    ub: &UbConfig,
) -> Result<AdamWTiling> {
    let g = GradTiling::new(rows, elements, ub)?;
    let mut t = AdamWTiling {
        tensors: rows as u64,
        elements: elements as u64,
        blocks: g.blocks,
        elems_per_block: g.elems_per_block,
        ..Default::default()
    };
    if elements == 0 {
        return Ok(t);
    }
    let ovf = Error::SizeOverflow { arg: "workspace" };
    let stride = rows
        .checked_mul(size_of::<ListSeg>())
        .and_then(|b| round_up(b, WORKSPACE_ALIGN))
        .ok_or(ovf)?;
    let scratch = stride.checked_mul(lists).ok_or(ovf)?;
    let scratch_bytes = rows
        .checked_mul(lists)
        .and_then(|r| r.checked_add(1))
        .and_then(|r| r.checked_mul(16))
        .and_then(|b| round_up(b, WORKSPACE_ALIGN))
        .ok_or(ovf)?;
    let partials = scratch.checked_add(scratch_bytes).ok_or(ovf)?;
    let partial_bytes = if clip { g.blocks as usize * 64 } else { 0 };
    let total = partials
        .checked_add(partial_bytes)
        .and_then(|b| b.checked_add(WORKSPACE_ALIGN))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or(ovf)?;
    t.table_offset = 0;
    t.table_stride = stride as u64;
    t.scratch_offset = scratch as u64;
    t.partials_offset = partials as u64;
    t.workspace_bytes = total as u64;
    Ok(t)
}

/// Validates and plans (what the size calls run).
pub(crate) fn plan_lists(
    l: &mut Lists<'_>,
    o: &AdamWOptions,
    f: &AdamWFormats<'_>,
    ub: &UbConfig,
) -> Result<AdamWTiling> {
    Ok(check(l, o, f, ub)?.t)
}

/// Validates, checks the workspace and every overlap, lowers the lists into
/// the workspace and runs the step on `exec`'s backend.
pub(crate) fn launch(
    exec: &Exec<'_>,
    l: &mut Lists<'_>,
    o: &AdamWOptions,
    f: &AdamWFormats<'_>,
    ws: *mut c_void,
    bytes: usize,
    out: Option<(usize, usize)>,
) -> Result<AdamWReport> {
    let Checked { t, dtypes, state } = check(l, o, f, &exec.ub)?;
    let w = Workspace::new(ws, bytes, t.workspace_bytes)?;
    let used = bytes.min(crate::ops::workspace_len(t.workspace_bytes)?);
    if let Some((a, n)) = out {
        if overlaps(a, n, ws as usize, used) {
            return Err(invalid("result", "overlaps the workspace"));
        }
    }
    let mut report = AdamWReport {
        grad_norm: f64::NAN,
        stepped: 1,
    };
    // Nothing may be written before every check: the workspace against each
    // tensor first (the tables are written into it).
    for s in l.all() {
        for i in 0..s.count() {
            let (p, dt, e) = s.get(i)?;
            if overlaps(p as usize, e * dt.size_bytes(), ws as usize, used) {
                return Err(invalid_fmt!("workspace", "overlaps {}[{i}]", s.name()));
            }
        }
    }
    if t.blocks == 0 {
        if o.has(ADAMW_CLIP) {
            report.grad_norm = 0.0;
        }
        if o.has(super::ADAMW_FOUND_INF) && o.found_inf != 0.0 {
            report.stepped = 0;
        }
        return Ok(report);
    }
    let rows = t.tensors as usize;
    let mut lists = [TensorList::NONE; ALL_LISTS];
    // The plan's regions lie inside the checked workspace, which overlaps
    // no tensor; nothing else uses it during the call.
    let scratch_ptr = unsafe_region(
        &w,
        t.scratch_offset as usize,
        (t.partials_offset - t.scratch_offset) as usize,
    );
    let mut ranges = 0usize;
    for (k, s) in l.all().into_iter().enumerate() {
        if s.count() == 0 {
            continue;
        }
        let table = unsafe_region(
            &w,
            (t.table_offset + k as u64 * t.table_stride) as usize,
            t.table_stride as usize,
        )
        .cast::<ListSeg>();
        let (mut row, mut start) = (0usize, 0usize);
        for i in 0..s.count() {
            let (data, dtype, numel) = s.get(i)?;
            if numel == 0 {
                continue;
            }
            if row >= rows {
                return Err(invalid(s.name(), "the list changed while it was read"));
            }
            // SAFETY: row < rows fit in this table's region (aligned).
            unsafe {
                table.add(row).write(ListSeg {
                    data,
                    start,
                    numel,
                    dtype,
                })
            };
            // SAFETY: ranges < rows * lists + 1 pairs fit in the scratch
            // (lists: 6, or 9 with 8-bit moments, whose scale lists are
            // then the only non-empty extra ones).
            unsafe {
                scratch_ptr
                    .cast::<(usize, usize)>()
                    .add(ranges)
                    .write((data as usize, numel * dtype.size_bytes()))
            };
            ranges += 1;
            row += 1;
            start += numel;
        }
        if row != rows {
            return Err(invalid(s.name(), "the list changed while it was read"));
        }
        if k == 0 && state.stochastic() {
            // The rows' keys (the params' rows: every list has the same).
            let words = rows * (1 + state.quantized_moments as usize);
            let keys = unsafe_region(&w, state.keys_offset as usize, words * size_of::<u64>())
                .cast::<u64>();
            let (mut row, mut start) = (0usize, 0u64);
            for i in 0..s.count() {
                let (_, _, numel) = s.get(i)?;
                if numel == 0 {
                    continue;
                }
                let key = f.keys.get(i).copied().unwrap_or(start);
                // SAFETY: row < rows u64s fit in the keys region (aligned).
                unsafe { keys.add(row).write(key) };
                if state.quantized_moments != 0 {
                    // The row length, resolved (0: the whole tensor).
                    let len = f.q8_rows.get(i).copied().filter(|&r| r != 0);
                    // SAFETY: with 8-bit moments the region holds 2 rows u64s.
                    unsafe { keys.add(rows + row).write(len.unwrap_or(numel as u64)) };
                }
                row += 1;
                start += numel as u64;
            }
        }
        lists[k] = TensorList {
            segs: table,
            count: rows,
            dtype: dtypes[k],
        };
    }
    if let Some(r) = out {
        // SAFETY: the scratch holds rows * lists + 1 pairs.
        unsafe { scratch_ptr.cast::<(usize, usize)>().add(ranges).write(r) };
        ranges += 1;
    }
    // SAFETY: `ranges` pairs were just written.
    let pairs =
        unsafe { core::slice::from_raw_parts_mut(scratch_ptr.cast::<(usize, usize)>(), ranges) };
    if !disjoint(pairs) {
        return Err(invalid(
            "params",
            "two tensors of the lists (or the result) overlap",
        ));
    }
    let call = AdamWCall {
        params: lists[0],
        grads: lists[1],
        exp_avgs: lists[2],
        exp_avg_sqs: lists[3],
        max_exp_avg_sqs: lists[4],
        masters: lists[5],
        options: *o,
        consts: AdamWConsts::new(o),
        report: &mut report as *mut AdamWReport,
        tiling: t,
        workspace: ws,
        workspace_bytes: bytes,
        state,
        exp_avg_scales: lists[6],
        exp_avg_sq_scales: lists[7],
        max_exp_avg_sq_scales: lists[8],
    };
    // SAFETY: every list was validated and lowered, the tensors are pairwise
    // disjoint and apart from the workspace, which holds the plan.
    unsafe { exec.backend.launch(Op::AdamW(&call))? };
    Ok(report)
}

/// The raw address of `bytes` bytes at `offset` of a checked workspace.
fn unsafe_region(w: &Workspace, offset: usize, bytes: usize) -> *mut u8 {
    // SAFETY: callers pass regions of the plan, inside the checked workspace.
    unsafe { w.region(offset, bytes / 4).as_mut_ptr().cast::<u8>() }
}
