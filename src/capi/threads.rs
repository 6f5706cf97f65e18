//! `npk_threads_parallel_for`: a ready `npk_parallel_for_fn` backed by a
//! persistent thread pool inside the library.
//!
//! Design: one process-wide pool, created on first use and grown on demand
//! (never shrunk; workers sleep on a condition variable between jobs). A call
//! publishes one job; the calling thread and up to `threads - 1` workers take
//! blocks from a shared counter; the call returns when every block ran and
//! every worker has left the job. Only one job runs on the pool at a time:
//! a call made while the pool is busy — from another host thread, or nested
//! inside a task — runs its blocks serially on its own thread instead of
//! waiting (waiting could deadlock a nested call). Results never depend on
//! this: the kernels make every block's output independent of who runs it.
//! Creating or growing the pool allocates (thread stacks); running a job does
//! not. If the OS refuses a thread, the pool simply has fewer workers.

use core::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError, TryLockError};

use super::types::npk_task_fn;

/// Most threads one call may ask for (a guard against absurd counts).
const MAX_THREADS: usize = 256;

/// The job currently published, as plain data (the task's context pointer is
/// stored as an address so the state is `Send`).
#[derive(Clone, Copy)]
struct Job {
    task: unsafe extern "C" fn(*mut c_void, usize),
    ctx: usize,
    n: usize,
    /// Workers with an index below this join the job.
    helpers: usize,
}

struct State {
    /// Bumped for every published job; a worker runs each job at most once.
    seq: u64,
    /// The open job; `None` once its caller has stopped accepting helpers.
    job: Option<Job>,
    /// Workers currently inside the job.
    active: usize,
    /// Workers spawned so far.
    workers: usize,
}

struct Pool {
    state: Mutex<State>,
    /// Wakes workers for a new job.
    wake: Condvar,
    /// Wakes the caller when the last active worker leaves.
    left: Condvar,
    /// The next block to hand out.
    next: AtomicUsize,
    /// Held by the caller of the running job: one job at a time.
    busy: Mutex<()>,
}

static POOL: OnceLock<Pool> = OnceLock::new();

fn pool() -> &'static Pool {
    POOL.get_or_init(|| Pool {
        state: Mutex::new(State {
            seq: 0,
            job: None,
            active: 0,
            workers: 0,
        }),
        wake: Condvar::new(),
        left: Condvar::new(),
        next: AtomicUsize::new(0),
        busy: Mutex::new(()),
    })
}

/// Locks, ignoring poisoning (a poisoned lock only means some thread
/// panicked while holding it; with `panic = "abort"` that cannot happen, and
/// the protected state stays consistent anyway).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Takes blocks from the shared counter until none is left.
fn run_blocks(p: &Pool, job: Job) {
    loop {
        let b = p.next.fetch_add(1, Ordering::Relaxed);
        if b >= job.n {
            break;
        }
        // SAFETY: the job's task and context, called as `npk_task_fn`'s
        // contract says, while the publishing call is still waiting.
        unsafe { (job.task)(job.ctx as *mut c_void, b) };
    }
}

fn worker(p: &'static Pool, index: usize) {
    let mut seen = 0u64;
    let mut st = lock(&p.state);
    loop {
        while st.seq == seen {
            st = p.wake.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        seen = st.seq;
        let Some(job) = st.job.filter(|j| index < j.helpers) else {
            continue;
        };
        st.active += 1;
        drop(st);
        run_blocks(p, job);
        st = lock(&p.state);
        st.active -= 1;
        if st.active == 0 {
            p.left.notify_all();
        }
    }
}

/// Spawns workers until there are `want` (or the OS refuses); returns how
/// many there are.
fn grow(p: &'static Pool, st: &mut State, want: usize) -> usize {
    while st.workers < want {
        let index = st.workers;
        let spawned = std::thread::Builder::new()
            .name(format!("npukern-{index}"))
            .spawn(move || worker(p, index));
        if spawned.is_err() {
            break;
        }
        st.workers += 1;
    }
    st.workers
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
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
    .min(MAX_THREADS)
    .min(n_blocks);
    let serial = || {
        for b in 0..n_blocks {
            // SAFETY: as the contract of this function says.
            unsafe { task(task_ctx, b) };
        }
    };
    if threads <= 1 {
        return serial();
    }
    let p = pool();
    let _busy = match p.busy.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(g)) => g.into_inner(),
        Err(TryLockError::WouldBlock) => return serial(),
    };
    let job = {
        let mut st = lock(&p.state);
        let workers = grow(p, &mut st, threads - 1);
        let job = Job {
            task,
            ctx: task_ctx as usize,
            n: n_blocks,
            helpers: workers.min(threads - 1),
        };
        p.next.store(0, Ordering::Relaxed);
        st.job = Some(job);
        st.seq = st.seq.wrapping_add(1);
        job
    };
    p.wake.notify_all();
    run_blocks(p, job);
    // Close the job to late helpers, then wait for those inside to leave:
    // after that no thread touches `task_ctx` again.
    let mut st = lock(&p.state);
    st.job = None;
    while st.active > 0 {
        st = p.left.wait(st).unwrap_or_else(PoisonError::into_inner);
    }
}
