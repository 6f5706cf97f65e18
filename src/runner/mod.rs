//! Runners execute a plan's blocks: `parallel_for(n, task)` must call
//! `task(b)` exactly once for every `b < n` and return after all ran. Kernels
//! never let a result depend on which runner ran them.

/// Runs `n_blocks` independent block tasks.
///
/// # Safety
/// Blocks write disjoint parts of the outputs and workspace through shared
/// pointers, so an implementation must call `task(b)` exactly once for
/// every `b` in `0..n_blocks` (never twice: two runs of a block race) and
/// return only after every call has returned.
pub unsafe trait Runner: Sync {
    /// Calls `task(b)` once for every `b` in `0..n_blocks`, possibly in parallel.
    fn parallel_for(&self, n_blocks: usize, task: &(dyn Fn(usize) + Sync));

    /// Whether a backend may run a call its plan marks small
    /// (`NORM_FLAG_SERIAL`) on the calling thread instead of through this
    /// runner: the same blocks, so the same bits. True for `Threads`, whose
    /// launch costs more than such a call; runners that must see every
    /// launch (schedulers, counters, foreign pools) keep the default, false.
    fn runs_small_calls_inline(&self) -> bool {
        false
    }
}

/// Runs the blocks one after another on the calling thread (no_std default).
#[derive(Clone, Copy, Debug, Default)]
pub struct Serial;

// SAFETY: each block once, in order, on the calling thread.
unsafe impl Runner for Serial {
    fn parallel_for(&self, n_blocks: usize, task: &(dyn Fn(usize) + Sync)) {
        for b in 0..n_blocks {
            task(b);
        }
    }
}

// SAFETY: forwards to a `Runner`.
unsafe impl<R: Runner + ?Sized> Runner for &R {
    fn parallel_for(&self, n_blocks: usize, task: &(dyn Fn(usize) + Sync)) {
        (**self).parallel_for(n_blocks, task)
    }
    fn runs_small_calls_inline(&self) -> bool {
        (**self).runs_small_calls_inline()
    }
}

/// The runner a backend uses for a plan with `flags`: the calling thread for
/// a small call (`NORM_FLAG_SERIAL`) when `runner` allows it, else `runner`.
pub(crate) fn for_plan(runner: &dyn Runner, flags: u32) -> &dyn Runner {
    if flags & crate::tiling::NORM_FLAG_SERIAL != 0 && runner.runs_small_calls_inline() {
        &Serial
    } else {
        runner
    }
}

#[cfg(feature = "std")]
pub(crate) mod pool;
#[cfg(feature = "std")]
mod threads;
#[cfg(feature = "std")]
pub use threads::Threads;
