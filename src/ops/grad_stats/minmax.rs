//! Lane-wise running min/max of a window, on the `Lanes` (`Lanes::min`,
//! `Lanes::max`), so the stats kernel's min/max run at each ISA's native
//! width like the rest of it.
//!
//! NaN handling is the ISA's and is irrelevant: a window holding NaN is
//! discarded and re-read by the masked path. Which zero wins is
//! ISA-dependent, which is why the summary reports zeros as +0.0.

use crate::lanes::{Lanes, GROUP};

/// Running min/max of a window's elements.
#[derive(Clone, Copy)]
pub(crate) struct MinMax<L> {
    pub min: L,
    pub max: L,
}

impl<L: Lanes> MinMax<L> {
    #[inline(always)]
    pub fn new() -> Self {
        MinMax {
            min: L::splat(f32::INFINITY),
            max: L::splat(f32::NEG_INFINITY),
        }
    }

    /// Adds one group.
    #[inline(always)]
    pub fn push(&mut self, v: L) {
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    /// Lane-wise merge into a block's running min/max arrays.
    #[inline(always)]
    pub fn merge_into(&self, min: &mut [f32; GROUP], max: &mut [f32; GROUP]) {
        L::load(min).min(self.min).store(min);
        L::load(max).max(self.max).store(max);
    }
}

/// Smallest and largest lane of a block's arrays (NaN-free), in a fixed order.
#[inline(always)]
pub(crate) fn fold(min: &[f32; GROUP], max: &[f32; GROUP]) -> (f32, f32) {
    let mut mn = min[0];
    let mut mx = max[0];
    for i in 1..GROUP {
        mn = if min[i] < mn { min[i] } else { mn };
        mx = if max[i] > mx { max[i] } else { mx };
    }
    (mn, mx)
}
