//! `npk_threads_parallel_for`: a ready `npk_parallel_for_fn` backed by the
//! library's persistent thread pool (`runner::pool`, the one `Threads` uses).

use core::ffi::c_void;

use super::types::npk_task_fn;
use crate::runner::pool;

/// The C task and its context as one `Sync` closure body.
struct CTask {
    task: unsafe extern "C" fn(*mut c_void, usize),
    ctx: *mut c_void,
}

// SAFETY: the C contract lets `task` be called with `ctx` from any thread.
unsafe impl Sync for CTask {}

impl CTask {
    fn call(&self, block: usize) {
        // SAFETY: as `npk_threads_parallel_for`'s contract says.
        unsafe { (self.task)(self.ctx, block) }
    }
}

/// Runs `task(task_ctx, b)` for every `b` in `[0, n_blocks)` on the library's
/// persistent thread pool (the calling thread takes part) and returns when
/// all ran. Pass it as `npk_exec.parallel_for`.
///
/// `runner_ctx`: NULL = one thread per core; else a pointer to a `uint32_t`
/// thread count (0 also means one per core; at most 256). A call made while
/// the pool is busy with another call runs its blocks serially on the calling
/// thread. `task` must not unwind.
///
/// # Safety
/// `runner_ctx` is NULL or points to a readable `uint32_t`; `task` (if
/// non-NULL) may be called with `task_ctx` from any thread.
#[no_mangle]
pub unsafe extern "C" fn npk_threads_parallel_for(
    runner_ctx: *mut c_void,
    n_blocks: usize,
    task: npk_task_fn,
    task_ctx: *mut c_void,
) {
    let Some(task) = task else { return };
    let requested = if runner_ctx.is_null() {
        0
    } else {
        // SAFETY: non-NULL and readable (contract).
        unsafe { (runner_ctx as *const u32).read_unaligned() as usize }
    };
    let threads = match requested {
        0 => pool::cores(),
        n => n,
    };
    let t = CTask {
        task,
        ctx: task_ctx,
    };
    pool::run(threads, n_blocks, &|b| t.call(b));
}
