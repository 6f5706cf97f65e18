//! `Threads`: the Rust face of the library's one persistent pool
//! (`pool`), which the C ABI's `npk_threads_parallel_for` also uses.

use super::{pool, Runner};

/// Runs blocks on up to `threads` threads of the library's persistent pool
/// (the calling thread is one of them); blocks are handed out one at a time
/// from a shared counter. Workers are created on first use and kept; a
/// launch wakes them instead of spawning. Only one launch uses the pool at a
/// time: a launch made while it is busy (from another thread, or nested in a
/// block) runs its blocks on its own thread — the same blocks, so the same
/// bits.
#[derive(Clone, Copy, Debug)]
pub struct Threads {
    threads: usize,
}

impl Threads {
    /// A runner with `threads` workers (at least 1; at most `pool::MAX_THREADS`).
    pub fn new(threads: usize) -> Self {
        Threads {
            threads: threads.clamp(1, pool::MAX_THREADS),
        }
    }

    /// One worker per available core.
    pub fn per_core() -> Self {
        Self::new(pool::cores())
    }

    /// The worker count.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

// SAFETY: `pool::run` calls `task(b)` once for every block and returns after
// all returned.
unsafe impl Runner for Threads {
    fn parallel_for(&self, n_blocks: usize, task: &(dyn Fn(usize) + Sync)) {
        pool::run(self.threads, n_blocks, task)
    }
    /// A launch wakes pool workers (a few microseconds; `quick --overhead`):
    /// calls the plan marks small are still faster on the calling thread.
    fn runs_small_calls_inline(&self) -> bool {
        true
    }
}
