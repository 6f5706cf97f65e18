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

    /// Whether a window may keep its f32 sums `sums`: every sum finite (no
    /// NaN/Inf met) and the window's largest magnitude `m` at most `BIG` and
    /// either at least `SMALL` or 0. Written lane-wise with non-short-circuit
    /// `&`/`|` so it vectorizes; equal to the test on the window's overall
    /// `m` (untouched lanes hold -Inf magnitudes).
    #[inline(always)]
    pub fn window_ok(&self, sums: &[f32; GROUP]) -> bool {
        use super::cpu::{BIG, SMALL};
        let (mut mins, mut maxs) = ([0f32; GROUP], [0f32; GROUP]);
        self.min.store(&mut mins);
        self.max.store(&mut maxs);
        let (mut finite, mut le_big, mut any_big_enough, mut all_zero) = (true, true, false, true);
        for ((&mn, &mx), &s) in mins.iter().zip(&maxs).zip(sums) {
            let (a, b) = (-mn, mx);
            let m = if a > b { a } else { b };
            finite &= s.is_finite();
            le_big &= m <= BIG;
            any_big_enough |= m >= SMALL;
            all_zero &= m <= 0.0;
        }
        finite & le_big & (any_big_enough | all_zero)
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
