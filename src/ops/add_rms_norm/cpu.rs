//! AddRmsNorm on the CPU: the shared forward pass over round(x1 + x2).

use super::*;
use crate::lanes::detect::Available;

/// AddRmsNorm's CopyIn: round(x1 + x2), written to x_sum by pass 2 (x_sum
/// may be x1: each window of x1 is read before x_sum's is written).
#[derive(Clone, Copy)]
struct AddSource<T> {
    x1: Src<T>,
    x2: Src<T>,
    x_sum: Option<Dst<T>>,
    /// x_sum is x1 (`FwdSource::side_in_place`).
    in_place: bool,
}

impl<T: Float> FwdSource<T> for AddSource<T> {
    #[inline(always)]
    unsafe fn at<L: Lanes>(&self, at: usize, len: usize) -> L {
        // SAFETY: forwarded; the range of x1 is not written before this read.
        let (a, b) = unsafe {
            (
                load_at::<L, T>(self.x1, at, len),
                load_at::<L, T>(self.x2, at, len),
            )
        };
        round_to::<L, T>(a.add(b))
    }
    #[inline(always)]
    unsafe fn line_out<L: Lanes, const STREAM: bool>(&self, at: usize) -> (L, L) {
        // SAFETY: forwarded; x1 and x2 are read before x_sum (possibly x1)
        // is written, and the line lies in x_sum when there is one.
        unsafe {
            let ((a0, a1), (b0, b1)) = (
                load_line::<L, T>(self.x1, at),
                load_line::<L, T>(self.x2, at),
            );
            // One rounding serves x_sum's store and the values y uses.
            let dst = self.x_sum.map(|d| d.pair(at));
            if self.side_in_place() {
                T::round_line::<L, false>(a0.add(b0), a1.add(b1), dst)
            } else {
                T::round_line::<L, STREAM>(a0.add(b0), a1.add(b1), dst)
            }
        }
    }
    #[inline(always)]
    fn side(&self) -> Option<Dst<T>> {
        self.x_sum
    }
    #[inline(always)]
    fn side_in_place(&self) -> bool {
        self.in_place
    }
    #[inline(always)]
    fn prefetch<L: Lanes>(&self, at: usize) {
        prefetch_pair::<L, T>(self.x1, at);
        prefetch_pair::<L, T>(self.x2, at);
    }
}

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &AddRmsNormCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        dispatch_isa!(isa, L => dispatch_xg!(call.x1.dtype, call.gamma.dtype, run::<L>(call, runner)))
    }
}

unsafe fn run<L: Lanes, T: Float, G: Float>(call: &AddRmsNormCall, runner: &dyn Runner) {
    let o = fwd_out!(call);
    // SAFETY: forwarded from this function's contract.
    unsafe {
        run_forward::<L, T, G, _>(
            AddSource {
                x1: Src(call.x1.data as *const T),
                x2: Src(call.x2.data as *const T),
                x_sum: (call.has_x_sum != 0).then_some(Dst(call.x_sum.data as *mut T)),
                in_place: call.x_sum_in_place != 0,
            },
            &o,
            runner,
        )
    }
}
