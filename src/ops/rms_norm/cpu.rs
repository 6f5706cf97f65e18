//! RmsNorm on the CPU: the shared forward pass over x itself.

use super::*;
use crate::lanes::detect::Available;

/// RmsNorm's CopyIn: x itself.
#[derive(Clone, Copy)]
struct XSource<T>(Src<T>);

impl<T: Float> FwdSource<T> for XSource<T> {
    #[inline(always)]
    unsafe fn at<L: Lanes>(&self, at: usize, len: usize) -> L {
        // SAFETY: forwarded; x is never written.
        unsafe { load_at::<L, T>(self.0, at, len) }
    }
    #[inline(always)]
    unsafe fn line_out<L: Lanes, const STREAM: bool>(&self, at: usize) -> (L, L) {
        // SAFETY: forwarded; x is never written (RmsNorm has no side output).
        unsafe { load_line::<L, T>(self.0, at) }
    }
    #[inline(always)]
    fn side(&self) -> Option<Dst<T>> {
        None
    }
    #[inline(always)]
    fn prefetch<L: Lanes>(&self, at: usize) {
        prefetch_pair::<L, T>(self.0, at);
    }
}

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &RmsNormCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        dispatch_isa!(isa, L => dispatch_xg!(call.x.dtype, call.gamma.dtype, run::<L>(call, runner)))
    }
}

unsafe fn run<L: Lanes, T: Float, G: Float>(call: &RmsNormCall, runner: &dyn Runner) {
    let o = fwd_out!(call);
    // SAFETY: forwarded from this function's contract.
    unsafe { run_forward::<L, T, G, _>(XSource(Src(call.x.data as *const T)), &o, runner) }
}
