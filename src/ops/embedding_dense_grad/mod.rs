//! EmbeddingDenseGrad: the gradient of an embedding table,
//! `out[v] = scale(v) * sum over positions i with indices[i] == vocab_start + v of grad[i]`.
//!
//! Exact semantics (also in docs/operators.md):
//! - `grad` is `[..., H]` (f32 | f16 | bf16); `indices` (i32 | i64) has as many
//!   elements as grad has leading positions (`numel(grad) / H`; with `H == 0`
//!   the product of grad's leading dims); `out` is `[num_weights, H]`, grad's
//!   dtype or f32. Row `v` of `out` is global id `vocab_start + v`.
//! - Each element is summed in f32 in ascending position order, starting from
//!   the first contributing term (so a row with one occurrence is an exact
//!   copy, `-0.0` included), and rounded to `out`'s dtype once.
//! - `scale_grad_by_freq`: the f32 sum is divided once by `count(v)` (the
//!   number of in-range, non-padding occurrences of the row in this call,
//!   converted to f32): `sum / count`, one IEEE division.
//! - `accumulate`: `out = round(old + sum)` (after the scale), with `old`
//!   widened exactly; rows nothing contributed to are left untouched.
//!   Without it those rows are written +0.0.
//! - `padding_idx` is compared with the raw index value (a global id, as in
//!   PyTorch) before the range check: such positions contribute nothing and
//!   are never out of range. Negative means none (aclnn's convention; a
//!   PyTorch-style negative `padding_idx` must be normalized to
//!   `num_weights + padding_idx` by the caller).
//! - Out-of-range indices (outside `[vocab_start, vocab_start + num_weights)`)
//!   under `IndexPolicy::Error` fail with `IndexOutOfRange` naming the first
//!   bad flat position; under `Ignore` they are skipped.
//!
//! Algorithm: the front end makes one validation pass over the indices; the
//! CPU backend then counting-sorts the positions by row into the workspace
//! (stable, O(N + num_weights), serial), and the blocks write the table row
//! by row exactly once. Rows are split over the plan's blocks by work (a
//! row's cost is its count + 1), from the sorted offsets alone, so the split
//! is a function of the indices and `blocks`, never of the thread count, and
//! a hot row does not drag its neighbours into one block.

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
mod plan;
pub(crate) mod reference;

pub(crate) use plan::{plan, prepare};

use core::ffi::c_void;

use super::{launch_into, op_call, workspace_len, Exec};
use crate::dtype::{DType, Element, Float};
use crate::error::{dtype_err, invalid, invalid_fmt, Error, Result};
use crate::tensor::{no_overlap, RawTensor, Shape, TensorRef};
use crate::tiling::{EmbeddingTiling, UbConfig};
use crate::workspace::Src;

/// What to do with an index outside this call's rows (`npk_index_policy`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum IndexPolicy {
    /// Fail with `IndexOutOfRange` (first bad position) and write nothing.
    #[default]
    Error = 0,
    /// Skip the position (the natural policy for one shard of a
    /// vocab-parallel table).
    Ignore = 1,
}

impl IndexPolicy {
    /// Parses the C ABI's numeric value; `None` for anything else.
    pub const fn from_u32(v: u32) -> Option<IndexPolicy> {
        match v {
            0 => Some(IndexPolicy::Error),
            1 => Some(IndexPolicy::Ignore),
            _ => None,
        }
    }
}

/// Options of EmbeddingDenseGrad (`npk_embedding_grad_options`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EmbeddingGradOptions {
    /// Global id whose positions contribute nothing; negative = none. Default -1.
    pub padding_idx: i64,
    /// Divide each row's sum by its occurrence count. Default false.
    pub scale_grad_by_freq: bool,
    /// Global id of the output's row 0 (>= 0). Default 0.
    pub vocab_start: i64,
    /// Out-of-range policy. Default `Error`.
    pub out_of_range: IndexPolicy,
    /// `out += grad` instead of `out = grad`. Default false.
    pub accumulate: bool,
}

impl Default for EmbeddingGradOptions {
    fn default() -> Self {
        EmbeddingGradOptions {
            padding_idx: -1,
            scale_grad_by_freq: false,
            vocab_start: 0,
            out_of_range: IndexPolicy::Error,
            accumulate: false,
        }
    }
}

/// The validated arguments of one EmbeddingDenseGrad
/// (`npk_embedding_dense_grad_call`): what a backend, or an adapter's NPU
/// launch, receives. Under `IndexPolicy::Error` every index has been checked
/// to be padding or in range.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EmbeddingDenseGradCall {
    /// Upstream gradient `[..., H]`, f32 | f16 | bf16.
    pub grad: RawTensor,
    /// Indices, i32 | i64, `tiling.positions` elements.
    pub indices: RawTensor,
    /// Output `[num_weights, H]`, grad's dtype or f32.
    pub out: RawTensor,
    /// Rows of `out`.
    pub num_weights: u64,
    /// Global id whose positions are skipped; negative = none.
    pub padding_idx: i64,
    /// Global id of `out`'s row 0.
    pub vocab_start: i64,
    /// Out-of-range policy.
    pub out_of_range: IndexPolicy,
    /// 1: divide each row's sum by its count.
    pub scale_grad_by_freq: u32,
    /// 1: `out += sum`; 0: `out = sum` (and untouched rows zeroed).
    pub accumulate: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// The tiling plan (TilingData).
    pub tiling: EmbeddingTiling,
    /// The caller's workspace (unaligned; kernels align inside).
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

/// An index element type (i32 or i64).
pub(crate) trait IndexElem: Element {
    fn to_i64(self) -> i64;
}

impl IndexElem for i32 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self as i64
    }
}

impl IndexElem for i64 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self
    }
}

/// Where a position's gradient goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Row of the output.
    Row(usize),
    /// The padding index: contributes nothing, never an error.
    Padding,
    /// Outside this call's rows.
    OutOfRange,
}

/// Maps raw index values to output rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowMap {
    padding_idx: i64,
    vocab_start: i64,
    rows: u64,
}

impl RowMap {
    /// The first id of the shard.
    pub(crate) fn start(&self) -> i64 {
        self.vocab_start
    }

    /// One past the shard's last id.
    pub(crate) fn end(&self) -> i64 {
        self.vocab_start
            .saturating_add(i64::try_from(self.rows).unwrap_or(i64::MAX))
    }

    pub(crate) fn of(call: &EmbeddingDenseGradCall) -> RowMap {
        RowMap {
            padding_idx: call.padding_idx,
            vocab_start: call.vocab_start,
            rows: call.num_weights,
        }
    }

    #[inline(always)]
    pub(crate) fn slot(&self, v: i64) -> Slot {
        if self.padding_idx >= 0 && v == self.padding_idx {
            return Slot::Padding;
        }
        match v.checked_sub(self.vocab_start) {
            Some(r) if r >= 0 && (r as u64) < self.rows => Slot::Row(r as usize),
            _ => Slot::OutOfRange,
        }
    }

    /// The row of `v`, or None for padding and out-of-range values (which a
    /// kernel skips: under `Error` the front end has already rejected them).
    #[inline(always)]
    pub(crate) fn row(&self, v: i64) -> Option<usize> {
        match self.slot(v) {
            Slot::Row(r) => Some(r),
            _ => None,
        }
    }
}

/// Calls `$f::<[$p,]* I>($args)` for the index dtype (already validated).
/// (Two arms, so both call forms survive rustfmt.)
macro_rules! dispatch_index {
    ($d:expr, $f:ident ($($a:expr),*)) => {
        $crate::ops::embedding_dense_grad::dispatch_index!($d, $f::<>($($a),*))
    };
    ($d:expr, $f:ident :: <$($p:ty),*> ($($a:expr),*)) => {{
        match $d {
            $crate::dtype::DType::I32 => $f::<$($p,)* i32>($($a),*),
            _ => $f::<$($p,)* i64>($($a),*),
        }
    }};
}
pub(crate) use dispatch_index;

/// Calls `$f::<[$p,]* G, O>($args)` for the validated (grad, out) dtype pair.
macro_rules! dispatch_go {
    ($gd:expr, $od:expr, $f:ident ($($a:expr),*)) => {
        $crate::ops::embedding_dense_grad::dispatch_go!($gd, $od, $f::<>($($a),*))
    };
    ($gd:expr, $od:expr, $f:ident :: <$($p:ty),*> ($($a:expr),*)) => {{
        use half::{bf16, f16};
        use $crate::dtype::DType;
        match ($gd, $od) {
            (DType::F16, DType::F16) => $f::<$($p,)* f16, f16>($($a),*),
            (DType::F16, _) => $f::<$($p,)* f16, f32>($($a),*),
            (DType::BF16, DType::BF16) => $f::<$($p,)* bf16, bf16>($($a),*),
            (DType::BF16, _) => $f::<$($p,)* bf16, f32>($($a),*),
            _ => $f::<$($p,)* f32, f32>($($a),*),
        }
    }};
}
pub(crate) use dispatch_go;

// An empty table (H == 0 or no rows) has nothing to write. Its zero fill
// and row copies stream into fresh pages too: 10-13% faster than ordinary
// stores there (docs/performance.md, "Store policy").
op_call!(
    EmbeddingDenseGradCall,
    |c| c.tiling.cols == 0 || c.num_weights == 0,
    [grad, indices, out],
    fresh_streams = true
);

/// Workspace bytes `embedding_dense_grad` needs for these inputs under
/// `exec.ub` (sized for the worst case; no index value is read).
pub fn embedding_dense_grad_workspace_size<G: Float, I: Element>(
    exec: &Exec<'_>,
    grad: TensorRef<'_, G>,
    indices: TensorRef<'_, I>,
    num_weights: usize,
    opts: &EmbeddingGradOptions,
) -> Result<usize> {
    let t = plan(
        &grad.raw(),
        &indices.raw(),
        num_weights as u64,
        opts,
        &exec.ub,
    )?;
    workspace_len(t.workspace_bytes)
}

/// EmbeddingDenseGrad: writes (or, with `opts.accumulate`, adds) the
/// gradient of a `[num_weights, H]` embedding table into `out`
/// (`num_weights * H` elements, row-major).
///
/// `grad` is `[..., H]` (f32 | f16 | bf16), `indices` i32 | i64 with one
/// element per gradient row, `out` of grad's dtype or f32; other index
/// types fail with `DtypeUnsupported`. `workspace` must hold
/// `embedding_dense_grad_workspace_size` bytes. On error nothing is written.
/// See the module docs for the exact arithmetic.
///
/// ```
/// use npukern::*;
///
/// fn main() -> Result<(), npukern::Error> {
///     let grad: Vec<bf16> = (0..4 * 2).map(|i| bf16::from_f32(i as f32)).collect();
///     let indices = [2i64, 0, 2, 0];
///     let g = TensorRef::new(&grad, &[4, 2])?;
///     let ix = TensorRef::new(&indices, &[4])?;
///     let exec = Exec::cpu();
///     let opts = EmbeddingGradOptions::default();
///     let mut ws = vec![0u8; embedding_dense_grad_workspace_size(&exec, g, ix, 3, &opts)?];
///     let mut table = vec![0f32; 3 * 2];
///     embedding_dense_grad(&exec, g, ix, 3, &opts, &mut table, &mut ws)?;
///     assert_eq!(table, [2.0 + 6.0, 3.0 + 7.0, 0.0, 0.0, 0.0 + 4.0, 1.0 + 5.0]);
///     Ok(())
/// }
/// ```
pub fn embedding_dense_grad<G: Float, I: Element, O: Float>(
    exec: &Exec<'_>,
    grad: TensorRef<'_, G>,
    indices: TensorRef<'_, I>,
    num_weights: usize,
    opts: &EmbeddingGradOptions,
    out: &mut [O],
    workspace: &mut [u8],
) -> Result<()> {
    // A slice of the wrong length is described as 1-D, so the validation
    // (inputs first) reports it as a shape that is not [num_weights, H].
    let h = grad.shape().dims().last().copied().unwrap_or(0);
    let o = match num_weights.checked_mul(h) {
        Some(n) if n == out.len() => {
            let shape = Shape::new_named(&[num_weights, h], "out")?;
            RawTensor::from_parts(out.as_mut_ptr() as *mut c_void, O::DTYPE, &shape)
        }
        _ => RawTensor::flat(out.as_mut_ptr() as *mut c_void, O::DTYPE, out.len()),
    };
    let call = prepare(
        &grad.raw(),
        &indices.raw(),
        num_weights as u64,
        opts,
        &o,
        &exec.ub,
    )?;
    launch_into(exec, call, workspace)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Shape;

    fn raw(dtype: DType, dims: &[usize]) -> RawTensor {
        // Never dereferenced: plan() reads shapes only.
        let p = 4096usize as *mut c_void;
        RawTensor::from_parts(p, dtype, &Shape::new(dims).unwrap())
    }

    #[test]
    fn more_than_u32_max_positions_is_an_overflow() {
        let ub = UbConfig::default();
        let opts = EmbeddingGradOptions::default();
        let n = u32::MAX as usize + 1;
        let g = raw(DType::BF16, &[n, 2]);
        let i = raw(DType::I64, &[n]);
        assert_eq!(
            plan(&g, &i, 10, &opts, &ub),
            Err(Error::SizeOverflow { arg: "indices" })
        );
        // Nothing to write: nothing to sort, so no limit.
        let g = raw(DType::BF16, &[n, 0]);
        assert_eq!(plan(&g, &i, 10, &opts, &ub).unwrap().workspace_bytes, 0);
    }

    #[test]
    fn sizes_follow_shapes() {
        let ub = UbConfig::default();
        let opts = EmbeddingGradOptions::default();
        let g = raw(DType::F32, &[4, 5, 100]);
        let i = raw(DType::I32, &[20]);
        let t = plan(&g, &i, 7, &opts, &ub).unwrap();
        assert_eq!(
            (t.positions, t.cols, t.num_weights, t.blocks),
            (20, 100, 7, 7)
        );
        assert_eq!(t.chunk_cols, 112);
        assert_eq!(t.order_offset, 64);
        assert_eq!(t.arena_offset, 192);
        assert_eq!(t.workspace_bytes, 192 + 7 * 448 + 64);
        let t = plan(
            &raw(DType::F32, &[2, 100_000]),
            &raw(DType::I32, &[2]),
            3,
            &opts,
            &ub,
        )
        .unwrap();
        assert_eq!(t.chunk_cols as usize * 4, ub.ub_bytes);
    }
}
