//! EmbeddingDenseGrad's host side: validation (with the index pass) and the
//! tiling plan.

use super::*;

/// Validates the inputs, the options and the sizes, and cuts the plan: all
/// that `workspace_size` needs (shapes and options; no index data is read).
pub(crate) fn plan(
    grad: &RawTensor,
    indices: &RawTensor,
    num_weights: u64,
    opts: &EmbeddingGradOptions,
    ub: &UbConfig,
) -> Result<EmbeddingTiling> {
    let gc = grad.check("grad")?;
    let ic = indices.check("indices")?;
    if !grad.dtype.is_float() {
        return Err(dtype_err!(
            "grad",
            "dtype {} is not f32, f16 or bf16",
            grad.dtype
        ));
    }
    if !matches!(indices.dtype, DType::I32 | DType::I64) {
        return Err(dtype_err!(
            "indices",
            "dtype {} is not i32 or i64",
            indices.dtype
        ));
    }
    let dims = gc.shape.dims();
    let (&h, lead) = dims
        .split_last()
        .ok_or(invalid("grad", "rank must be 1..=8"))?;
    // Shape::new checked that the full product fits, so this one does too.
    let positions: usize = lead.iter().product();
    if ic.numel != positions {
        return Err(invalid_fmt!(
            "indices",
            "{} elements, but grad {} has {positions} rows of H = {h}",
            ic.numel,
            gc.shape
        ));
    }
    let v = usize::try_from(num_weights)
        .ok()
        .filter(|&v| v <= i64::MAX as usize)
        .ok_or(Error::SizeOverflow { arg: "num_weights" })?;
    // The table must be addressable even as f32.
    v.checked_mul(h)
        .and_then(|n| n.checked_mul(4))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or(Error::SizeOverflow { arg: "out" })?;
    if opts.vocab_start < 0 {
        return Err(invalid_fmt!(
            "vocab_start",
            "{} is negative",
            opts.vocab_start
        ));
    }
    if opts.vocab_start.checked_add(v as i64).is_none() {
        return Err(invalid(
            "vocab_start",
            "vocab_start + num_weights exceeds i64",
        ));
    }
    EmbeddingTiling::new(positions, h, v, grad.dtype.size_bytes(), ub)
}

/// Validates everything (outputs, overlaps, and under `IndexPolicy::Error`
/// every index value) and builds the call (workspace not yet attached).
///
/// The descriptors must point at readable memory of their shapes, as every
/// front end guarantees (Rust slices; the C ABI's contract): the index pass
/// reads `indices`.
pub(crate) fn prepare(
    grad: &RawTensor,
    indices: &RawTensor,
    num_weights: u64,
    opts: &EmbeddingGradOptions,
    out: &RawTensor,
    ub: &UbConfig,
) -> Result<EmbeddingDenseGradCall> {
    let tiling = plan(grad, indices, num_weights, opts, ub)?;
    let gc = grad.check("grad")?;
    let ic = indices.check("indices")?;
    let oc = out.check("out")?;
    if !(out.dtype == grad.dtype || out.dtype == DType::F32) {
        return Err(dtype_err!(
            "out",
            "dtype {} is neither grad's ({}) nor f32",
            out.dtype,
            grad.dtype
        ));
    }
    if oc.shape.dims() != [tiling.num_weights as usize, tiling.cols as usize] {
        return Err(invalid_fmt!(
            "out",
            "shape {} is not [num_weights, H] = [{}, {}]",
            oc.shape,
            tiling.num_weights,
            tiling.cols
        ));
    }
    no_overlap(&oc, [&gc, &ic])?;
    let call = EmbeddingDenseGradCall {
        grad: *grad,
        indices: *indices,
        out: *out,
        num_weights: tiling.num_weights,
        padding_idx: opts.padding_idx,
        vocab_start: opts.vocab_start,
        out_of_range: opts.out_of_range,
        scale_grad_by_freq: opts.scale_grad_by_freq as u32,
        accumulate: opts.accumulate as u32,
        reserved: 0,
        tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
    };
    if call.out_of_range == IndexPolicy::Error {
        let n = tiling.positions as usize;
        let map = RowMap::of(&call);
        // SAFETY: indices was checked to hold `n` elements of its dtype at a
        // readable, aligned address (see above); it is only read.
        unsafe { dispatch_index!(indices.dtype, first_out_of_range(indices.data, n, map)) }?;
    }
    Ok(call)
}

/// The validation pass: the first position whose index is neither padding
/// nor in range.
///
/// # Safety
/// `data` holds `n` readable `I`.
unsafe fn first_out_of_range<I: IndexElem>(data: *mut c_void, n: usize, map: RowMap) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let idx = unsafe { Src(data as *const I).get(0, n) };
    match idx
        .iter()
        .position(|v| map.slot(v.to_i64()) == Slot::OutOfRange)
    {
        None => Ok(()),
        Some(p) => Err(Error::IndexOutOfRange {
            arg: "indices",
            position: p as u64,
            value: idx.get(p).map_or(0, |v| v.to_i64()),
            start: map.start(),
            end: map.end(),
        }),
    }
}
