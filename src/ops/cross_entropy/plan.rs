//! CrossEntropy's host side: validation of every argument (targets
//! included: they are read here, before anything is written) and the plan.

use super::*;
use crate::dtype::DType;
use crate::error::{dtype_err, invalid, invalid_fmt, Error};
use crate::ops::embedding_dense_grad::{dispatch_index, IndexElem};
use crate::tensor::{no_overlap, Checked};
use crate::tiling::{NORM_FLAG_SERIAL, SERIAL_MAX_BYTES, WORKSPACE_ALIGN};
use crate::workspace::Src;

/// Rows and classes of a call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CeDims {
    pub rows: usize,
    pub cols: usize,
}

/// Most workspace bytes the fused form's exp cache takes (`CACHE_ROWS`
/// rows of C f32 per block; the plan cuts fewer blocks for a wider row).
pub(crate) const CACHE_MAX_BYTES: usize = 16 << 20;

/// Cache rows per block: pass 1 of a row fills one while the previous
/// row's pass 2 reads the other.
pub(crate) const CACHE_ROWS: usize = 2;

/// f32 per cache row of C classes: C rounded up to whole 64-byte lines.
pub(crate) fn cache_stride(cols: usize) -> usize {
    cols.div_ceil(16).saturating_mul(16)
}

/// Checks the options: label smoothing in [0, 1], a finite z-loss scale
/// >= 0, a finite soft cap >= 0.
fn check_options(o: &CrossEntropyOptions) -> Result<()> {
    let ls = o.label_smoothing;
    if !(0.0..=1.0).contains(&ls) {
        return Err(invalid_fmt!("label_smoothing", "{ls} is not in [0, 1]"));
    }
    if !(o.lse_square_scale.is_finite() && o.lse_square_scale >= 0.0) {
        return Err(invalid_fmt!(
            "lse_square_scale",
            "{} is not finite and >= 0",
            o.lse_square_scale
        ));
    }
    if !(o.softcap.is_finite() && o.softcap >= 0.0) {
        return Err(invalid_fmt!(
            "softcap",
            "{} is not finite and >= 0",
            o.softcap
        ));
    }
    Ok(())
}

/// Checks an f32 tensor of `n` elements (any shape).
fn f32_of(t: &RawTensor, name: &'static str, n: usize, what: &str) -> Result<Checked> {
    let c = t.check(name)?;
    if t.dtype != DType::F32 {
        return Err(dtype_err!(name, "dtype {} is not f32", t.dtype));
    }
    if c.numel != n {
        return Err(invalid_fmt!(
            name,
            "{} elements (shape {}) where {what} needs {n}",
            c.numel,
            c.shape
        ));
    }
    Ok(c)
}

/// Checks the target: i32/i64 of shape `[rows]` (`of` names what gives
/// the rows, in the message).
fn check_target(target: &RawTensor, rows: usize, of: core::fmt::Arguments<'_>) -> Result<()> {
    let tc = target.check("target")?;
    if !matches!(target.dtype, DType::I32 | DType::I64) {
        return Err(dtype_err!(
            "target",
            "dtype {} is not i32 or i64",
            target.dtype
        ));
    }
    if tc.shape.dims() != [rows] {
        return Err(invalid_fmt!(
            "target",
            "shape {} is not [{rows}] ({of})",
            tc.shape
        ));
    }
    Ok(())
}

/// Checks logits (`[N, C]`, float), target (`[N]`, i32/i64), weight
/// (`[C]` f32) and the options.
fn dims(t: &CeTensors, opts: &CrossEntropyOptions) -> Result<CeDims> {
    check_options(opts)?;
    let lc = t.logits.check("logits")?;
    if !t.logits.dtype.is_float() {
        return Err(dtype_err!(
            "logits",
            "dtype {} is not f32, f16 or bf16",
            t.logits.dtype
        ));
    }
    let d = lc.shape.dims();
    if d.len() != 2 {
        return Err(invalid_fmt!("logits", "shape {} is not [N, C]", lc.shape));
    }
    let (rows, cols) = (d[0], d[1]);
    if cols == 0 && rows > 0 {
        return Err(invalid("logits", "has rows but no classes (C = 0)"));
    }
    check_target(&t.target, rows, format_args!("logits {}", lc.shape))?;
    if let Some(w) = &t.weight {
        let wc = w.check("weight")?;
        if w.dtype != DType::F32 {
            return Err(dtype_err!("weight", "dtype {} is not f32", w.dtype));
        }
        if wc.shape.dims() != [cols] {
            return Err(invalid_fmt!("weight", "shape {} is not [{cols}]", wc.shape));
        }
    }
    Ok(CeDims { rows, cols })
}

/// Validates the inputs and cuts the plan (what `workspace_size` needs).
pub(crate) fn plan(
    mode: CeMode,
    t: &CeTensors,
    opts: &CrossEntropyOptions,
    ub: &UbConfig,
) -> Result<(CeDims, CrossEntropyTiling)> {
    ub.validate()?;
    let d = dims(t, opts)?;
    let ovf = Error::SizeOverflow { arg: "workspace" };
    let mut tl = CrossEntropyTiling {
        rows: d.rows as u64,
        cols: d.cols as u64,
        // Two f32 tiles in the UB (the logits in, dlogits out), whole chunks
        // of 8 groups of 16.
        ub_cols: (ub.ub_bytes / 8 / 128 * 128).max(128) as u64,
        ..Default::default()
    };
    let bytes = d
        .rows
        .saturating_mul(d.cols)
        .saturating_mul(t.logits.dtype.size_bytes());
    if bytes < SERIAL_MAX_BYTES {
        tl.flags |= NORM_FLAG_SERIAL;
    }
    if d.rows > 0 {
        let blocks0 = (ub.blocks as usize).clamp(1, d.rows);
        let rpb = d.rows.div_ceil(blocks0);
        tl.rows_per_block = rpb as u64;
        tl.blocks = d.rows.div_ceil(rpb) as u32;
    }
    if mode == CeMode::Fused && d.rows > 0 {
        // Two cache rows of pass 1's exps per block for pass 2: one exp
        // per logit instead of two, and row r's pass 2 runs inside row r +
        // 1's pass 1 (one row's exps written while the other's are read).
        // Within CACHE_MAX_BYTES a wide vocabulary gets fewer, longer
        // blocks; past it (C over 2 Mi) no cache, and pass 2 recomputes the
        // exps (the same bits).
        let stride = cache_stride(d.cols).saturating_mul(4 * CACHE_ROWS);
        if stride <= CACHE_MAX_BYTES {
            let blocks = (CACHE_MAX_BYTES / stride).min(tl.blocks as usize).max(1);
            let rpb = d.rows.div_ceil(blocks);
            tl.rows_per_block = rpb as u64;
            tl.blocks = d.rows.div_ceil(rpb) as u32;
            tl.workspace_bytes = (tl.blocks as usize * stride + WORKSPACE_ALIGN) as u64;
        }
    }
    if mode == CeMode::Forward && opts.reduction != Reduction::None && d.rows > 0 {
        let b = d
            .rows
            .checked_mul(4)
            .and_then(|b| b.checked_add(WORKSPACE_ALIGN))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(ovf)?;
        tl.workspace_bytes = b as u64;
    }
    Ok((d, tl))
}

/// The first row whose target is neither `ignore` nor in `0..cols`.
///
/// # Safety
/// `data` holds `n` readable `I`.
unsafe fn first_bad_target<I: IndexElem>(
    data: *mut c_void,
    n: usize,
    cols: usize,
    ignore: i64,
) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let idx = unsafe { Src(data as *const I).get(0, n) };
    let bad = |v: i64| v != ignore && (v < 0 || v as u64 >= cols as u64);
    match idx.iter().position(|v| bad(v.to_i64())) {
        None => Ok(()),
        Some(p) => Err(Error::IndexOutOfRange {
            arg: "target",
            position: p as u64,
            value: idx.get(p).map_or(0, |v| v.to_i64()),
            start: 0,
            end: i64::try_from(cols).unwrap_or(i64::MAX),
        }),
    }
}

/// An empty descriptor (an absent tensor).
fn empty(dtype: DType) -> RawTensor {
    RawTensor::flat(core::ptr::null_mut(), dtype, 0)
}

/// Validates everything (outputs, overlaps, every target) and builds the call.
pub(crate) fn prepare(
    mode: CeMode,
    t: &CeTensors,
    opts: &CrossEntropyOptions,
    ub: &UbConfig,
) -> Result<CrossEntropyCall> {
    let (d, tiling) = plan(mode, t, opts, ub)?;
    let n = d.rows;
    let lc = t.logits.check("logits")?;
    let tc = t.target.check("target")?;
    let wc = t.weight.map(|w| w.check("weight")).transpose()?;
    let mut ins: [Option<Checked>; 5] = [Some(lc), Some(tc), wc, None, None];
    let reduced = mode == CeMode::Forward && opts.reduction != Reduction::None;
    let need = |o: Option<RawTensor>, name: &'static str| o.ok_or(Error::NullPointer { arg: name });
    let (mut lse_in, mut grad, mut loss, mut lse, mut dl) = (None, None, None, None, None);
    let mut grad_per_row = false;
    if mode == CeMode::Backward {
        let l = need(t.lse_in, "lse")?;
        ins[3] = Some(f32_of(&l, "lse", n, "one per row")?);
        lse_in = Some(l);
    }
    if mode != CeMode::Forward {
        let g = need(
            t.grad,
            if mode == CeMode::Fused {
                "grad_scale"
            } else {
                "grad"
            },
        )?;
        let name = if mode == CeMode::Fused {
            "grad_scale"
        } else {
            "grad"
        };
        let gc = g.check(name)?;
        let per_row_ok = mode == CeMode::Fused || opts.reduction == Reduction::None;
        let scalar_ok = mode == CeMode::Fused || opts.reduction != Reduction::None;
        if g.dtype != DType::F32 {
            return Err(dtype_err!(name, "dtype {} is not f32", g.dtype));
        }
        grad_per_row = if gc.numel == n && per_row_ok && !(gc.numel == 1 && scalar_ok) {
            true
        } else if gc.numel == 1 && scalar_ok {
            false
        } else {
            let want = if per_row_ok && scalar_ok {
                "1 or one per row"
            } else if per_row_ok {
                "one per row (reduction none)"
            } else {
                "1 (reduction sum or mean)"
            };
            return Err(invalid_fmt!(
                name,
                "{} elements (shape {}) where {n} rows need {want}",
                gc.numel,
                gc.shape
            ));
        };
        ins[4] = Some(gc);
        grad = Some(g);
    }
    let mut outs: [Option<Checked>; 2] = [None, None];
    if mode != CeMode::Backward {
        let l = need(t.loss, "loss")?;
        let (k, what) = if reduced {
            (1, "a reduced loss")
        } else {
            (n, "one per row")
        };
        let c = f32_of(&l, "loss", k, what)?;
        no_overlap(&c, ins.iter().flatten())?;
        outs[0] = Some(c);
        loss = Some(l);
        if let Some(s) = t.lse {
            let c = f32_of(&s, "lse", n, "one per row")?;
            no_overlap(&c, ins.iter().flatten().chain(outs.iter().flatten()))?;
            outs[1] = Some(c);
            lse = Some(s);
        }
    }
    if mode != CeMode::Forward {
        let o = need(t.dlogits, "dlogits")?;
        let c = o.check("dlogits")?;
        if o.dtype != t.logits.dtype {
            return Err(dtype_err!(
                "dlogits",
                "dtype {} is not logits' {}",
                o.dtype,
                t.logits.dtype
            ));
        }
        if c.numel != lc.numel {
            return Err(invalid_fmt!(
                "dlogits",
                "{} elements (shape {}) for logits {}",
                c.numel,
                c.shape,
                lc.shape
            ));
        }
        // In place (exactly the logits' bytes) or apart from every tensor.
        let others = ins.iter().flatten().chain(outs.iter().flatten());
        if c.same_range(&lc) && c.bytes > 0 {
            no_overlap(&c, others.filter(|o| o.name != "logits"))?;
        } else {
            no_overlap(&c, others)?;
        }
        dl = Some(o);
    }
    // Every target, before anything is written.
    // SAFETY: target was checked to hold `n` elements of its dtype at a
    // readable, aligned address; it is only read.
    unsafe {
        dispatch_index!(
            t.target.dtype,
            first_bad_target(t.target.data, n, d.cols, opts.ignore_index)
        )
    }?;
    let f32e = || empty(DType::F32);
    Ok(CrossEntropyCall {
        logits: t.logits,
        target: t.target,
        weight: t.weight.unwrap_or_else(f32e),
        lse_in: lse_in.unwrap_or_else(f32e),
        grad: grad.unwrap_or_else(f32e),
        loss: loss.unwrap_or_else(f32e),
        lse: lse.unwrap_or_else(f32e),
        dlogits: dl.unwrap_or_else(|| empty(t.logits.dtype)),
        mode,
        reduction: opts.reduction,
        ignore_index: opts.ignore_index,
        label_smoothing: opts.label_smoothing,
        lse_square_scale: opts.lse_square_scale,
        softcap: opts.softcap,
        has_weight: t.weight.is_some() as u32,
        has_lse: lse.is_some() as u32,
        grad_per_row: grad_per_row as u32,
        tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
    })
}

/// Validates `cross_entropy_reduce` / `cross_entropy_grad_scale`'s
/// arguments (a `Sum` or `Mean` reduction, `rows` targets of i32/i64, an
/// optional `[C]` f32 weight, targets in `0..C` or `ignore_index`; without
/// a weight C is unknown, so only negative ids are refused) and returns the
/// mean's denominator (0 for a sum).
pub(crate) fn check_reduce(
    rows: usize,
    (target, weight): &(RawTensor, Option<RawTensor>),
    opts: &CrossEntropyOptions,
) -> Result<f64> {
    check_options(opts)?;
    if opts.reduction == Reduction::None {
        return Err(invalid(
            "reduction",
            "none has nothing to reduce (sum or mean)",
        ));
    }
    check_target(target, rows, format_args!("one per row loss"))?;
    let mut cols = usize::MAX;
    if let Some(w) = weight {
        let wc = w.check("weight")?;
        if w.dtype != DType::F32 || wc.shape.dims().len() != 1 {
            return Err(dtype_err!(
                "weight",
                "must be [C] f32, got {} {}",
                w.dtype,
                wc.shape
            ));
        }
        cols = wc.numel;
    }
    let ignore = opts.ignore_index;
    // SAFETY: target was checked to hold `rows` elements of its dtype at a
    // readable, aligned address; it is only read.
    unsafe {
        dispatch_index!(
            target.dtype,
            first_bad_target(target.data, rows, cols, ignore)
        )
    }?;
    if opts.reduction != Reduction::Mean {
        return Ok(0.0);
    }
    // SAFETY: weight (when given) holds `cols` f32, checked above.
    let w = weight.map(|w| unsafe { Src(w.data as *const f32).get(0, cols) });
    // SAFETY: as above.
    Ok(unsafe { dispatch_index!(target.dtype, denominator_of(target.data, rows, w, ignore)) })
}

/// `reduce::denominator` of `n` targets of type `I` at `data`.
///
/// # Safety
/// `data` holds `n` readable `I`.
unsafe fn denominator_of<I: IndexElem>(
    data: *mut c_void,
    n: usize,
    weight: Option<&[f32]>,
    ignore: i64,
) -> f64 {
    // SAFETY: guaranteed by the caller.
    let idx = unsafe { Src(data as *const I).get(0, n) };
    super::reduce::denominator(n, |i| idx[i].to_i64(), weight, ignore)
}
