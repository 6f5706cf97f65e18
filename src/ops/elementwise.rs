//! What the elementwise operators (SwiGLU, RoPE) share: the numerics option,
//! the dtype dispatch and the walk over a block's rows.

use crate::dtype::Float;
use crate::lanes::Lanes;
use crate::ops::norm::prefetch_pair;
use crate::workspace::Src;

/// How far ahead of the 32 columns being computed the elementwise loops
/// prefetch their inputs, in bytes. These loops spend 20-40 cycles per line
/// on arithmetic (SiLU's exp and division), a pace at which the hardware
/// streamers fell behind on the Xeon measured: without the hint SwiGLU bf16
/// ran at 3.1x a copy, with it 1.4x (README, "SwiGLU and RoPE").
const PREFETCH_BYTES: usize = 2048;

/// Prefetches `src` a fixed distance past element `at` (a hint: never
/// faults, changes no result; `at` may run past the tensor).
#[inline(always)]
pub(crate) fn prefetch_ahead<L: Lanes, T>(src: Src<T>, at: usize) {
    prefetch_pair::<L, T>(src, at + PREFETCH_BYTES / core::mem::size_of::<T>());
}

/// Where an elementwise operator rounds (the C ABI's `npk_elem_rounding`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ElemRounding {
    /// fp32 inside, one rounding of each output (CANN's fused kernels).
    #[default]
    Fused = 0,
    /// Every intermediate eager PyTorch rounds to the dtype is rounded to it
    /// (Hugging Face's composite: for SwiGLU `silu(a)` then the product; for
    /// RoPE each product, then the sum; their backwards likewise).
    Eager = 1,
}

impl ElemRounding {
    /// The value from the C ABI's integer.
    #[cfg(feature = "capi")]
    pub(crate) fn from_u32(v: u32) -> Option<ElemRounding> {
        match v {
            0 => Some(ElemRounding::Fused),
            1 => Some(ElemRounding::Eager),
            _ => None,
        }
    }
}

/// `v` rounded to `T` and widened back when `eager` (identity otherwise).
#[inline(always)]
pub(crate) fn eager_round<L: Lanes, T: Float>(v: L, eager: bool) -> L {
    if eager {
        T::round(v)
    } else {
        v
    }
}

/// Calls `$f::<$L, T>($args)` for the dtype `$d` (f32, f16 or bf16).
macro_rules! dispatch_t {
    ($d:expr, $f:ident :: <$L:ty> ($($a:expr),*)) => {{
        use half::{bf16, f16};
        use $crate::dtype::DType;
        match $d {
            DType::F16 => $f::<$L, f16>($($a),*),
            DType::BF16 => $f::<$L, bf16>($($a),*),
            _ => $f::<$L, f32>($($a),*),
        }
    }};
    ($d:expr, $f:ident ($($a:expr),*)) => {{
        use half::{bf16, f16};
        use $crate::dtype::DType;
        match $d {
            DType::F16 => $f::<f16>($($a),*),
            DType::BF16 => $f::<bf16>($($a),*),
            _ => $f::<f32>($($a),*),
        }
    }};
}
pub(crate) use dispatch_t;

/// For every row segment of block `$blk` of the `EltTiling` `$t`, binds
/// `$r` (row), `$c` (first column), `$n` (columns) and runs `$body`. A
/// macro so the body inlines into the ISA context.
macro_rules! for_block_rows {
    ($t:expr, $blk:expr, |$r:ident, $c:ident, $n:ident| $body:expr) => {{
        let t: &$crate::tiling::EltTiling = $t;
        let (u0, u1) = t.block_units($blk);
        for u in u0..u1 {
            let unit = t.unit(u);
            for $r in unit.row..unit.row + unit.rows {
                let ($c, $n) = (unit.col, unit.cols);
                $body;
            }
        }
    }};
}
pub(crate) use for_block_rows;
