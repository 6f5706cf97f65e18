//! The host's `npk_parallel_for_fn` as a `Runner`, with the contract
//! checked: every block must run exactly once before the callback returns.
//!
//! Each host call covers at most `ROUND` blocks and keeps one flag per block
//! (a bitmap on the stack: the C ABI never allocates). A block number that is
//! out of range or already claimed is refused without running, so a broken
//! runner cannot make two threads write the same rows (nor add a row twice
//! under `accumulate`); a block left unclaimed, or still running when the
//! callback returns, is found when it returns. The first fault becomes the
//! call's error (`Error::Runner`, status `NPK_ERR_BACKEND`).

use core::ffi::c_void;
use core::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};

use super::types::npk_parallel_for_fn;
use crate::error::{Error, Reason};
use crate::runner::Runner;

/// Blocks per host call (a multiple of 64: one flag bit each).
const ROUND: usize = 4096;

/// What a runner did wrong (0: nothing).
const OK: u8 = 0;
const TWICE: u8 = 1;
const OUT_OF_RANGE: u8 = 2;
const SKIPPED: u8 = 3;
const EARLY: u8 = 4;

/// The host's `parallel_for` callback as a `Runner`; NULL runs serially.
pub(crate) struct HostRunner {
    f: npk_parallel_for_fn,
    ctx: *mut c_void,
    /// The first fault's kind, block and block count (kind `OK`: none).
    kind: AtomicU8,
    block: AtomicUsize,
    blocks: AtomicUsize,
}

// SAFETY: `ctx` is only passed back to the host's callback, whose contract
// (docs/c-api.md) allows it to be called from the calling thread; the runner is
// never used after the C call returns.
unsafe impl Sync for HostRunner {}

impl HostRunner {
    /// Adapts the host's callback (NULL: serial on the calling thread).
    pub(crate) fn new(f: npk_parallel_for_fn, ctx: *mut c_void) -> Self {
        HostRunner {
            f,
            ctx,
            kind: AtomicU8::new(OK),
            block: AtomicUsize::new(0),
            blocks: AtomicUsize::new(0),
        }
    }

    /// Records the first fault only.
    fn record(&self, kind: u8, block: usize, blocks: usize) {
        if self
            .kind
            .compare_exchange(OK, kind, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.block.store(block, Ordering::Release);
            self.blocks.store(blocks, Ordering::Release);
        }
    }

    /// The error for the first contract violation seen, if any.
    pub(crate) fn fault(&self) -> Option<Error> {
        let (b, n) = (
            self.block.load(Ordering::Acquire),
            self.blocks.load(Ordering::Acquire),
        );
        let what = match self.kind.load(Ordering::Acquire) {
            TWICE => format_args!("the host runner ran block {b} of {n} twice"),
            OUT_OF_RANGE => format_args!("the host runner passed block {b}, beyond the {n} blocks"),
            SKIPPED => format_args!("the host runner skipped block {b} of {n}"),
            EARLY => format_args!("the host runner returned before all {n} blocks finished"),
            _ => return None,
        };
        Some(Error::Runner {
            reason: Reason::format(what),
        })
    }
}

/// What the trampoline receives as `task_ctx`: one round of blocks.
struct Round<'a> {
    task: &'a (dyn Fn(usize) + Sync),
    runner: &'a HostRunner,
    /// First block of this round and the call's block count.
    base: usize,
    total: usize,
    /// Blocks in this round.
    n: usize,
    claimed: [AtomicU64; ROUND / 64],
    done: AtomicUsize,
}

/// The `npk_task_fn` handed to the host: runs block `base + block` once.
///
/// # Safety
/// `ctx` is the `Round` of a `parallel_for` that has not returned.
unsafe extern "C" fn trampoline(ctx: *mut c_void, block: usize) {
    // SAFETY: the host passes back our `task_ctx`, alive until its
    // `parallel_for` returns (the callback's contract).
    let r = unsafe { &*(ctx as *const Round<'_>) };
    // A block number out of range would address rows beyond the plan: refuse.
    let Some(word) = r.claimed.get(block / 64).filter(|_| block < r.n) else {
        r.runner
            .record(OUT_OF_RANGE, r.base.saturating_add(block), r.total);
        return;
    };
    let bit = 1u64 << (block % 64);
    if word.fetch_or(bit, Ordering::AcqRel) & bit != 0 {
        r.runner.record(TWICE, r.base + block, r.total);
        return;
    }
    (r.task)(r.base + block);
    r.done.fetch_add(1, Ordering::AcqRel);
}

// SAFETY: every block runs at most once (a claimed flag refuses a second
// run), and `parallel_for` returns only after the host's callback has; a
// callback that skips blocks or returns early is reported by `fault`.
unsafe impl Runner for HostRunner {
    fn parallel_for(&self, n_blocks: usize, task: &(dyn Fn(usize) + Sync)) {
        let Some(f) = self.f else {
            for b in 0..n_blocks {
                task(b);
            }
            return;
        };
        let mut base = 0;
        while base < n_blocks {
            let n = ROUND.min(n_blocks - base);
            let r = Round {
                task,
                runner: self,
                base,
                total: n_blocks,
                n,
                claimed: [const { AtomicU64::new(0) }; ROUND / 64],
                done: AtomicUsize::new(0),
            };
            // SAFETY: the host's callback, called as docs/c-api.md says; `r`
            // outlives the call.
            unsafe {
                f(
                    self.ctx,
                    n,
                    Some(trampoline),
                    &r as *const Round<'_> as *mut c_void,
                )
            };
            // The callback's return is the synchronization point; the flags
            // were published by whatever joined the worker threads.
            if let Some(b) =
                (0..n).find(|&b| r.claimed[b / 64].load(Ordering::Acquire) & (1 << (b % 64)) == 0)
            {
                self.record(SKIPPED, base + b, n_blocks);
            } else if r.done.load(Ordering::Acquire) != n {
                self.record(EARLY, base, n_blocks);
            }
            if self.kind.load(Ordering::Acquire) != OK {
                return; // later rounds would only add to the damage
            }
            base += n;
        }
    }
}
