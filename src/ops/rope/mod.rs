//! RoPE, rotate-half form: `y = x * cos + rotate_half(x) * sin` with
//! `rotate_half(x) = cat(-x2, x1)` (x1, x2 the halves of the last dim), for
//! q and k in one call (Hugging Face's `apply_rotary_pos_emb`, torch_npu's
//! `npu_rotary_mul(x, r1, r2)`); cos and sin broadcast to x from the right
//! (a dim of 1 or a missing leading dim repeats). The backward is the
//! transposed rotation: `dx1 = dy1 * cos1 + dy2 * sin2`,
//! `dx2 = dy2 * cos2 - dy1 * sin1` (sin negated when both halves of sin are
//! equal, as Hugging Face's are).

#[cfg(feature = "capi")]
pub(crate) mod capi;
pub(crate) mod cpu;
mod plan;
pub(crate) mod reference;

pub(crate) use plan::{plan, prepare};

use core::ffi::c_void;

use super::elementwise::ElemRounding;
use super::{launch_into, op_call, workspace_len, Exec};
use crate::dtype::Float;
use crate::error::Result;
use crate::tensor::{out_like, RawTensor, TensorRef, MAX_DIMS};
use crate::tiling::{EltTiling, UbConfig};

/// Options of RoPE (`npk_rope_options`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RopeOptions {
    /// Fused (one rounding), or eager PyTorch's bits (each product rounded
    /// to the dtype, then the sum).
    pub rounding: ElemRounding,
    /// The backward: x is dy, the outputs are dx.
    pub backward: bool,
}

/// The validated arguments of one RoPE (`npk_rope_call`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RopeCall {
    /// q (or dq's dy), `[..., head_dim]`.
    pub q: RawTensor,
    /// k, the same dtype and head_dim; empty when absent.
    pub k: RawTensor,
    /// cos, broadcast to q and k from the right; q's dtype or f32.
    pub cos: RawTensor,
    /// sin, cos's shape and dtype.
    pub sin: RawTensor,
    /// Output of q's shape and dtype.
    pub q_out: RawTensor,
    /// Output of k's shape and dtype; empty when k is.
    pub k_out: RawTensor,
    /// Rows of q: plan rows `0..q_rows` are q's, the rest k's.
    pub q_rows: u64,
    /// 1: the backward rotation.
    pub backward: u32,
    /// Where outputs are rounded.
    pub rounding: ElemRounding,
    /// The tiling plan: rows of head_dim, never cut.
    pub tiling: EltTiling,
    /// The caller's workspace (none is needed).
    pub workspace: *mut c_void,
    /// Its size in bytes.
    pub workspace_bytes: usize,
}

op_call!(
    RopeCall,
    |c| c.tiling.units == 0,
    [q, k, cos, sin, q_out, k_out]
);

/// The cos row of each x row: an odometer over x's leading dims with cos's
/// row strides (0 where cos broadcasts).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bcast {
    dims: [usize; MAX_DIMS],
    strides: [usize; MAX_DIMS],
    coord: [usize; MAX_DIMS],
    nd: usize,
    /// The current cos row.
    pub row: usize,
}

impl Bcast {
    /// Positioned at x's row `row` (shapes validated by `plan`).
    pub(crate) fn new(x: &RawTensor, c: &RawTensor, row: usize) -> Bcast {
        let nx = (x.ndim as usize).clamp(1, MAX_DIMS);
        let nc = (c.ndim as usize).clamp(1, MAX_DIMS);
        let mut b = Bcast {
            dims: [1; MAX_DIMS],
            strides: [0; MAX_DIMS],
            coord: [0; MAX_DIMS],
            nd: nx - 1,
            row: 0,
        };
        let mut cstride = 1usize;
        for i in (0..nx - 1).rev() {
            b.dims[i] = x.shape[i] as usize;
            let ci = i as isize - (nx as isize - nc as isize);
            let cd = if ci >= 0 {
                c.shape[ci as usize] as usize
            } else {
                1
            };
            b.strides[i] = if cd == 1 { 0 } else { cstride };
            cstride *= cd;
        }
        b.at(row)
    }

    /// The same odometer moved to x's row `row`.
    pub(crate) fn at(mut self, row: usize) -> Bcast {
        self.row = 0;
        let mut rem = row;
        for i in (0..self.nd).rev() {
            let d = self.dims[i].max(1);
            self.coord[i] = rem % d;
            rem /= d;
            self.row += self.coord[i] * self.strides[i];
        }
        self
    }

    /// Moves to the next x row.
    #[inline(always)]
    pub(crate) fn next(&mut self) {
        let mut i = self.nd;
        while i > 0 {
            i -= 1;
            self.coord[i] += 1;
            self.row += self.strides[i];
            if self.coord[i] < self.dims[i] {
                return;
            }
            self.row -= self.strides[i] * self.coord[i];
            self.coord[i] = 0;
        }
    }
}

/// Workspace bytes `rope` needs (always 0).
pub fn rope_workspace_size<T: Float, C: Float>(
    exec: &Exec<'_>,
    q: TensorRef<'_, T>,
    k: Option<TensorRef<'_, T>>,
    cos: TensorRef<'_, C>,
    sin: TensorRef<'_, C>,
    opts: &RopeOptions,
) -> Result<usize> {
    let kr = k.map(|k| k.raw());
    let t = plan(
        &q.raw(),
        kr.as_ref(),
        &cos.raw(),
        &sin.raw(),
        opts,
        &exec.ub,
    )?;
    workspace_len(t.workspace_bytes)
}

/// RoPE of q (and k) by cos and sin (`[..., head_dim]`, q's dtype or f32,
/// broadcast from the right): `q_out` (q's shape) and `k_out` (k's; given
/// exactly when k is). With `opts.backward`, q and k are the output
/// gradients and the outputs their input gradients. On error nothing is
/// written.
#[allow(clippy::too_many_arguments)]
pub fn rope<T: Float, C: Float>(
    exec: &Exec<'_>,
    q: TensorRef<'_, T>,
    k: Option<TensorRef<'_, T>>,
    cos: TensorRef<'_, C>,
    sin: TensorRef<'_, C>,
    opts: &RopeOptions,
    q_out: &mut [T],
    k_out: Option<&mut [T]>,
    workspace: &mut [u8],
) -> Result<()> {
    let qo = out_like(q_out, q.shape(), "q_out", "q")?;
    let ko = match (&k, k_out) {
        (Some(k), Some(o)) => Some(out_like(o, k.shape(), "k_out", "k")?),
        (None, None) => None,
        (Some(_), None) => return Err(crate::error::Error::NullPointer { arg: "k_out" }),
        (None, Some(_)) => {
            return Err(crate::error::invalid("k_out", "given without k"));
        }
    };
    let kr = k.map(|k| k.raw());
    let call = prepare(
        &q.raw(),
        kr.as_ref(),
        &cos.raw(),
        &sin.raw(),
        opts,
        &qo,
        ko.as_ref(),
        &exec.ub,
    )?;
    launch_into(exec, call, workspace)
}
