//! Host-side tiling of the gradient-health operators. All tensors are seen as
//! one flat sequence of elements (list order, then row-major order); the plan
//! cuts that sequence into equal blocks from the element count and
//! `UbConfig::blocks` alone, so the same tensors always give the same blocks
//! (and the same bits), whatever runs them.

use core::mem::size_of;

use crate::error::{Error, Result};
use crate::lanes::GROUP;
use crate::tiling::{UbConfig, WORKSPACE_ALIGN};

pub(crate) use crate::tensor_list::{
    ListSeg as Seg, ListSource as GradSource, RawList, RoList, RwList, ARG,
};

/// Smallest block the plan cuts (elements): below it, a block's bookkeeping
/// would cost more than its data.
pub const GRAD_MIN_BLOCK_ELEMS: usize = 4096;

/// Tiling of `grad_stats` / `clip_grad_norm` (the TilingData an NPU kernel
/// would receive).
///
/// Workspace layout, from the 64-byte aligned start: the segment table (one
/// 64-bit-aligned record per non-empty tensor: address, flat start, length,
/// dtype — the address list an NPU kernel's TensorList argument carries),
/// then one 64-byte partial-result record per block. Both operators need the
/// same bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GradTiling {
    /// Non-empty tensors (rows of the segment table).
    pub tensors: u64,
    /// Elements over all tensors.
    pub elements: u64,
    /// Blocks the flat element range is cut into (0 when there are no elements).
    pub blocks: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// Elements per block, a multiple of 16; the last block may have fewer.
    pub elems_per_block: u64,
    /// Elements per window of the stats kernel (512: 16 lanes x 32 terms
    /// summed in f32; see `grad_stats` docs).
    pub window_elems: u64,
    /// Offset of the segment table from the aligned workspace start.
    pub table_offset: u64,
    /// Offset of the per-block partials from the aligned workspace start.
    pub partials_offset: u64,
    /// Total workspace bytes, alignment slack included (0 when there are no
    /// elements).
    pub workspace_bytes: u64,
}

fn round_up(n: usize, m: usize) -> Option<usize> {
    n.checked_add(m - 1).map(|v| v / m * m)
}

impl GradTiling {
    /// Elements per window of the stats kernel (`window_elems`).
    pub const WINDOW_ELEMS: u64 = (super::cpu::WINDOW_GROUPS * GROUP) as u64;

    /// Plans `elements` elements held by `tensors` non-empty tensors.
    pub fn new(tensors: usize, elements: usize, cfg: &UbConfig) -> Result<GradTiling> {
        cfg.validate()?;
        let ovf = Error::SizeOverflow { arg: "workspace" };
        let mut t = GradTiling {
            tensors: tensors as u64,
            elements: elements as u64,
            window_elems: Self::WINDOW_ELEMS,
            ..Default::default()
        };
        if elements == 0 {
            return Ok(t);
        }
        let want = elements
            .div_ceil(GRAD_MIN_BLOCK_ELEMS)
            .min(cfg.blocks as usize)
            .max(1);
        let epb = round_up(elements.div_ceil(want), GROUP).ok_or(ovf)?;
        let blocks = elements.div_ceil(epb);
        t.blocks = blocks as u32; // <= cfg.blocks
        t.elems_per_block = epb as u64;
        let table = tensors
            .checked_mul(size_of::<Seg>())
            .and_then(|b| round_up(b, WORKSPACE_ALIGN))
            .ok_or(ovf)?;
        let partials = blocks.checked_mul(size_of::<Partial>()).ok_or(ovf)?;
        let total = table
            .checked_add(partials)
            .and_then(|b| b.checked_add(WORKSPACE_ALIGN))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(ovf)?;
        t.table_offset = 0;
        t.partials_offset = table as u64;
        t.workspace_bytes = total as u64;
        Ok(t)
    }

    /// The flat element range `[start, end)` of block `b`.
    pub fn block_range(&self, b: usize) -> (usize, usize) {
        let e = self.elements as usize;
        let start = b.saturating_mul(self.elems_per_block as usize).min(e);
        let end = start.saturating_add(self.elems_per_block as usize).min(e);
        (start, end)
    }
}

/// One block's result, on its own cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Partial {
    pub sum_sq: f64,
    pub nan: u64,
    pub inf: u64,
    /// +Inf when the block has no finite element.
    pub min: f32,
    /// -Inf when the block has no finite element.
    pub max: f32,
}

/// Validates every tensor and cuts the plan.
pub(crate) fn plan_of<S: GradSource>(src: &mut S, ub: &UbConfig) -> Result<GradTiling> {
    let (mut segs, mut total) = (0usize, 0usize);
    for i in 0..src.count() {
        let (_, dt, n) = src.get(i)?;
        if !dt.is_float() {
            return Err(crate::error::dtype_err!(
                ARG,
                "tensor {i} has dtype {dt}, not f32, f16 or bf16"
            ));
        }
        if n > 0 {
            segs += 1;
            total = total
                .checked_add(n)
                .filter(|&t| t <= i64::MAX as usize)
                .ok_or(Error::SizeOverflow { arg: ARG })?;
        }
    }
    GradTiling::new(segs, total, ub)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_elements() {
        let cfg = UbConfig::default();
        for &e in &[1usize, 15, 16, 4095, 4096, 4097, 1 << 20, 1_000_003] {
            let t = GradTiling::new(3, e, &cfg).unwrap();
            assert!(t.blocks >= 1 && t.blocks <= cfg.blocks);
            assert_eq!(t.elems_per_block % 16, 0);
            let mut next = 0;
            for b in 0..t.blocks as usize {
                let (s, end) = t.block_range(b);
                assert_eq!(s, next);
                assert!(end > s);
                next = end;
            }
            assert_eq!(next, e);
        }
        assert_eq!(GradTiling::new(0, 0, &cfg).unwrap().workspace_bytes, 0);
    }

    #[test]
    fn overflow_is_an_error() {
        let cfg = UbConfig::default();
        assert!(GradTiling::new(usize::MAX / 8, 1 << 30, &cfg).is_err());
    }
}
