//! The f64 golden model: per row, the contributing positions found by a plain
//! scan of the indices, summed in f64 in ascending position order from the
//! first term, divided by the count in f64 when scaling, added to the old
//! value in f64 when accumulating, and rounded once. Independent of the CPU
//! kernel's counting sort and block split; needs no workspace.

use super::{dispatch_go, dispatch_index, EmbeddingDenseGradCall, IndexElem, RowMap};
use crate::dtype::Float;
use crate::workspace::{Dst, Src};

/// Columns summed per pass (f64 accumulators on the stack).
const REF_COLS: usize = 512;

/// Runs the call on the f64 golden model.
///
/// # Safety
/// `call` was built by `prepare` (the workspace is not used).
pub(crate) unsafe fn reference(call: &EmbeddingDenseGradCall) {
    // SAFETY: forwarded from this function's contract.
    unsafe { dispatch_go!(call.grad.dtype, call.out.dtype, by_index(call)) }
}

/// # Safety
/// As for `reference`.
unsafe fn by_index<G: Float, O: Float>(call: &EmbeddingDenseGradCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_index!(call.indices.dtype, reference_t::<G, O>(call)) }
}

/// # Safety
/// As for `reference`.
unsafe fn reference_t<G: Float, O: Float, I: IndexElem>(call: &EmbeddingDenseGradCall) {
    let t = &call.tiling;
    let (n, h, v) = (
        t.positions as usize,
        t.cols as usize,
        t.num_weights as usize,
    );
    if h == 0 || v == 0 {
        return;
    }
    // SAFETY: validated lengths; inputs are never written, and the reference
    // runs alone on one thread.
    let (idx, grad) = unsafe {
        (
            Src(call.indices.data as *const I).get(0, n),
            Src(call.grad.data as *const G).get(0, n * h),
        )
    };
    let out = Dst(call.out.data as *mut O);
    let map = RowMap::of(call);
    let (scale, accumulate) = (call.scale_grad_by_freq != 0, call.accumulate != 0);
    let hits = |r: usize| {
        idx.iter()
            .enumerate()
            .filter(move |(_, x)| map.row(x.to_i64()) == Some(r))
            .map(|(i, _)| i)
    };
    let mut acc = [0f64; REF_COLS];
    for r in 0..v {
        // SAFETY: row r of out, which overlaps no input.
        let row = unsafe { out.get(r * h, h) };
        let count = hits(r).count();
        if count == 0 {
            if !accumulate {
                row.fill(O::from_f64(0.0));
            }
            continue;
        }
        for c0 in (0..h).step_by(REF_COLS) {
            let w = REF_COLS.min(h - c0);
            let a = &mut acc[..w];
            for (k, p) in hits(r).enumerate() {
                let g = &grad[p * h + c0..p * h + c0 + w];
                for (s, x) in a.iter_mut().zip(g) {
                    *s = if k == 0 { x.to_f64() } else { *s + x.to_f64() };
                }
            }
            for (o, &s) in row[c0..c0 + w].iter_mut().zip(a.iter()) {
                let mut s = s;
                if scale {
                    s /= count as f64;
                }
                if accumulate {
                    s += o.to_f64();
                }
                *o = O::from_f64(s);
            }
        }
    }
}
