//! `npk_embedding_dense_grad_workspace_size` / `npk_embedding_dense_grad`: a
//! skin over `ops::embedding_dense_grad::{plan, prepare}` (the shared shape
//! is `capi::skin`).

#![allow(non_camel_case_types)]

use core::ffi::c_void;

use crate::capi::skin::{self, CapiCall, CapiOp};
use crate::capi::types::{npk_exec, npk_status, read_tensor, RawIndexPolicy};
use crate::error::{invalid, Result};
use crate::ops::embedding_dense_grad::{
    plan, prepare, EmbeddingDenseGradCall, EmbeddingGradOptions, IndexPolicy,
};
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// Options of EmbeddingDenseGrad. NULL options = `{ -1, 0, 0,
/// NPK_INDEX_ERROR, 0 }`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct npk_embedding_grad_options {
    /// Global id whose positions contribute nothing (that row is zero); < 0: none.
    pub padding_idx: i64,
    /// Nonzero: divide each row's sum by its occurrence count in this call.
    pub scale_grad_by_freq: u8,
    /// Global id of the output's row 0 (this shard's first row), >= 0.
    pub vocab_start: i64,
    /// What to do with an index outside `[vocab_start, vocab_start + num_weights)`.
    pub out_of_range: RawIndexPolicy,
    /// Nonzero: `out += grad` instead of `out = grad`.
    pub accumulate: u8,
}

/// Reads optional options (NULL = defaults), checking the policy value.
///
/// # Safety
/// `p` is NULL or points to a readable `npk_embedding_grad_options`.
unsafe fn read_options(p: *const npk_embedding_grad_options) -> Result<EmbeddingGradOptions> {
    if p.is_null() {
        return Ok(EmbeddingGradOptions::default());
    }
    // SAFETY: non-NULL and readable (caller); every field is a plain number.
    let o = unsafe { p.read_unaligned() };
    Ok(EmbeddingGradOptions {
        padding_idx: o.padding_idx,
        scale_grad_by_freq: o.scale_grad_by_freq != 0,
        vocab_start: o.vocab_start,
        out_of_range: IndexPolicy::from_u32(o.out_of_range)
            .ok_or(invalid("out_of_range", "not an npk_index_policy value"))?,
        accumulate: o.accumulate != 0,
    })
}

/// EmbeddingDenseGrad's C skin.
struct Skin;

impl CapiOp for Skin {
    type Args = (
        *const RawTensor,
        *const RawTensor,
        u64,
        *const npk_embedding_grad_options,
    );
    type Inputs = (RawTensor, RawTensor, u64, EmbeddingGradOptions);

    unsafe fn read((grad, indices, num_weights, opts): Self::Args) -> Result<Self::Inputs> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        unsafe {
            Ok((
                read_tensor(grad, "grad")?,
                read_tensor(indices, "indices")?,
                num_weights,
                read_options(opts)?,
            ))
        }
    }

    fn plan((grad, indices, num_weights, opts): &Self::Inputs, ub: &UbConfig) -> Result<u64> {
        Ok(plan(grad, indices, *num_weights, opts, ub)?.workspace_bytes)
    }
}

impl CapiCall for Skin {
    type Outputs = *const RawTensor;
    type Call = EmbeddingDenseGradCall;

    unsafe fn prepare(
        (grad, indices, num_weights, opts): Self::Inputs,
        out: Self::Outputs,
        ub: &UbConfig,
    ) -> Result<EmbeddingDenseGradCall> {
        // SAFETY: every pointer is NULL or valid (this function's contract).
        let out = unsafe { read_tensor(out, "out")? };
        prepare(&grad, &indices, num_weights, &opts, &out, ub)
    }
}

/// Workspace bytes `npk_embedding_dense_grad` needs (sized from the shapes
/// and options alone; no index is read).
///
/// # Safety
/// Every pointer is NULL or valid for its type.
#[no_mangle]
pub unsafe extern "C" fn npk_embedding_dense_grad_workspace_size(
    grad: *const RawTensor,
    indices: *const RawTensor,
    num_weights: u64,
    opts: *const npk_embedding_grad_options,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    let args = (grad, indices, num_weights, opts);
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::workspace_size::<Skin>(args, exec, workspace_bytes) }
}

/// EmbeddingDenseGrad: `out[v] = scale(v) * sum of grad[i] over the positions
/// i with indices[i] == vocab_start + v`, summed in f32 in ascending position
/// order. `out` is `[num_weights, H]`, grad's dtype or f32. Under
/// `NPK_INDEX_ERROR` an out-of-range index fails with
/// `NPK_ERR_INDEX_OUT_OF_RANGE`, and the detail gives the first bad flat
/// position and its value. On error nothing is written.
///
/// # Safety
/// Every pointer is NULL or valid for its type, and every tensor's `data`
/// points to a buffer of its shape and dtype, live for the call.
#[no_mangle]
pub unsafe extern "C" fn npk_embedding_dense_grad(
    grad: *const RawTensor,
    indices: *const RawTensor,
    num_weights: u64,
    opts: *const npk_embedding_grad_options,
    out: *const RawTensor,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    let args = (grad, indices, num_weights, opts);
    // SAFETY: every pointer is NULL or valid (this function's contract).
    unsafe { skin::launch::<Skin>(args, out, workspace, workspace_bytes, exec) }
}
