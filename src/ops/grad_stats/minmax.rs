//! Lane-wise running min/max at each ISA's native width, for the stats
//! kernel: the `Lanes` trait has no min/max, and `wide`'s 8-lane vectors
//! compile to SSE even inside an AVX-512 block, which made min/max the
//! bottleneck on 16-bit inputs.
//!
//! The accumulators are 16-lane arrays (promoted to registers once inlined).
//! NaN handling is the hardware's (`minps`-style: the second operand wins
//! when one is NaN) and is irrelevant: a window holding NaN is discarded and
//! re-read by the masked path. Which zero wins is ISA-dependent, which is why
//! the summary reports zeros as +0.0. The portable path folds lanes `i + 8`
//! onto `i` first and keeps lanes 8..16 at their initial values.

use wide::f32x8;

#[cfg(target_arch = "x86_64")]
use crate::lanes::Isa;
use crate::lanes::{Lanes, GROUP};

/// Running min/max of the window's elements.
#[derive(Clone, Copy)]
pub(crate) struct MinMax {
    pub min: [f32; GROUP],
    pub max: [f32; GROUP],
}

impl MinMax {
    #[inline(always)]
    pub fn new() -> Self {
        MinMax {
            min: [f32::INFINITY; GROUP],
            max: [f32::NEG_INFINITY; GROUP],
        }
    }

    /// Adds one group (already widened to f32 in `v`).
    #[inline(always)]
    pub fn push<L: Lanes>(&mut self, v: &[f32; GROUP]) {
        match L::ISA {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `L` is the AVX-512 lanes, which exist only on CPUs
            // with AVX-512F (the kernel runs inside `L::enter`).
            Isa::Avx512 | Isa::Avx512Bf16 => unsafe { x86::push512(self, v) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for AVX2.
            Isa::Avx2 => unsafe { x86::push256(self, v) },
            _ => self.push_portable(v),
        }
    }

    #[inline(always)]
    fn push_portable(&mut self, v: &[f32; GROUP]) {
        let (a, b) = v.split_at(8);
        let (a, b) = (f32x8::from(a), f32x8::from(b));
        let (lo, hi) = (a.fast_min(b), a.fast_max(b));
        let mn = f32x8::from(&self.min[..8]).fast_min(lo);
        let mx = f32x8::from(&self.max[..8]).fast_max(hi);
        self.min[..8].copy_from_slice(mn.as_array());
        self.max[..8].copy_from_slice(mx.as_array());
    }

    /// Whether a window may keep its f32 sums `sums`: every sum finite (no
    /// NaN/Inf met) and the window's largest magnitude `m` at most `BIG` and
    /// either at least `SMALL` or 0. Written lane-wise with non-short-circuit
    /// `&`/`|` so it vectorizes; equal to the test on the window's overall
    /// `m` whatever the lane layout (untouched lanes hold -Inf magnitudes).
    #[inline(always)]
    pub fn window_ok(&self, sums: &[f32; GROUP]) -> bool {
        use super::cpu::{BIG, SMALL};
        let (mut finite, mut le_big, mut any_big_enough, mut all_zero) = (true, true, false, true);
        for ((&mn, &mx), &s) in self.min.iter().zip(&self.max).zip(sums) {
            let (a, b) = (-mn, mx);
            let m = if a > b { a } else { b };
            finite &= s.is_finite();
            le_big &= m <= BIG;
            any_big_enough |= m >= SMALL;
            all_zero &= m <= 0.0;
        }
        finite & le_big & (any_big_enough | all_zero)
    }

    /// Smallest and largest lane (NaN-free inputs), in a fixed order.
    #[inline(always)]
    pub fn fold(&self) -> (f32, f32) {
        let mut mn = self.min[0];
        let mut mx = self.max[0];
        for i in 1..GROUP {
            mn = if self.min[i] < mn { self.min[i] } else { mn };
            mx = if self.max[i] > mx { self.max[i] } else { mx };
        }
        (mn, mx)
    }

    /// Lane-wise merge of another window's min/max.
    #[inline(always)]
    pub fn merge(&mut self, o: &MinMax) {
        for i in 0..GROUP {
            self.min[i] = if o.min[i] < self.min[i] {
                o.min[i]
            } else {
                self.min[i]
            };
            self.max[i] = if o.max[i] > self.max[i] {
                o.max[i]
            } else {
                self.max[i]
            };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::MinMax;
    use crate::lanes::GROUP;
    use core::arch::x86_64::*;

    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    pub unsafe fn push512(m: &mut MinMax, v: &[f32; GROUP]) {
        // SAFETY: 16 f32 in each array; AVX-512F present (caller).
        unsafe {
            let x = _mm512_loadu_ps(v.as_ptr());
            let mn = _mm512_min_ps(_mm512_loadu_ps(m.min.as_ptr()), x);
            let mx = _mm512_max_ps(_mm512_loadu_ps(m.max.as_ptr()), x);
            _mm512_storeu_ps(m.min.as_mut_ptr(), mn);
            _mm512_storeu_ps(m.max.as_mut_ptr(), mx);
        }
    }

    /// # Safety
    /// The CPU has AVX.
    #[inline(always)]
    pub unsafe fn push256(m: &mut MinMax, v: &[f32; GROUP]) {
        // SAFETY: 16 f32 in each array (two halves of 8); AVX present (caller).
        unsafe {
            for h in [0usize, 8] {
                let x = _mm256_loadu_ps(v.as_ptr().add(h));
                let mn = _mm256_min_ps(_mm256_loadu_ps(m.min.as_ptr().add(h)), x);
                let mx = _mm256_max_ps(_mm256_loadu_ps(m.max.as_ptr().add(h)), x);
                _mm256_storeu_ps(m.min.as_mut_ptr().add(h), mn);
                _mm256_storeu_ps(m.max.as_mut_ptr().add(h), mx);
            }
        }
    }
}
