//! The library's one persistent thread pool, behind both `Threads` and the
//! C ABI's `npk_threads_parallel_for`.
//!
//! One process-wide pool, created on first use and grown on demand (never
//! shrunk). A launch publishes one job; the calling thread and up to
//! `threads - 1` workers take blocks from a shared counter; the launch
//! returns when every block ran and every worker has left the job. Between
//! jobs a worker spins for `SPIN` (so back-to-back launches, a model's layers,
//! cost a store and a cache-line transfer, not a futex wake), then sleeps on
//! a condition variable. Only one job runs at a time: a launch made while
//! the pool is busy — from another thread, or nested inside a block — runs
//! its blocks serially on its own thread instead of waiting (waiting could
//! deadlock a nested launch). Results never depend on this: every block's
//! output is independent of who runs it. Creating or growing the pool
//! allocates (thread stacks); running a job does not. If the OS refuses a
//! thread, the pool simply has fewer workers.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError, TryLockError};
use std::time::{Duration, Instant};

/// Most threads one launch may use (a guard against absurd counts).
pub(crate) const MAX_THREADS: usize = 256;

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(100);

/// The task of the open job, its lifetime erased: valid while the launch
/// that published it waits (it returns only after every worker left).
#[derive(Clone, Copy)]
struct Job {
    task: *const (dyn Fn(usize) + Sync + 'static),
    n: usize,
    /// Workers with an index below this join the job.
    helpers: usize,
}

// SAFETY: the task is `Sync` and outlives every use (see `Job`).
unsafe impl Send for Job {}

struct State {
    /// The open job; `None` once its launch has stopped accepting helpers.
    job: Option<Job>,
    /// Workers spawned so far.
    workers: usize,
    /// Workers asleep on `wake`.
    sleeping: usize,
}

struct Pool {
    state: Mutex<State>,
    /// Bumped (under `state`) for every published job; a worker runs each
    /// job at most once. Atomic so that spinning workers can watch it.
    seq: AtomicU64,
    /// Workers inside the open job (joined under `state`).
    active: AtomicUsize,
    /// The next block to hand out.
    next: AtomicUsize,
    /// Wakes sleeping workers for a new job.
    wake: Condvar,
    /// Wakes the launch when the last active worker leaves.
    left: Condvar,
    /// Held by the launch of the running job: one job at a time.
    busy: Mutex<()>,
}

static POOL: OnceLock<Pool> = OnceLock::new();

fn pool() -> &'static Pool {
    POOL.get_or_init(|| Pool {
        state: Mutex::new(State {
            job: None,
            workers: 0,
            sleeping: 0,
        }),
        seq: AtomicU64::new(0),
        active: AtomicUsize::new(0),
        next: AtomicUsize::new(0),
        wake: Condvar::new(),
        left: Condvar::new(),
        busy: Mutex::new(()),
    })
}

/// One thread per available core.
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Locks, ignoring poisoning (a poisoned lock only means some thread
/// panicked while holding it; the library has no panicking path, and the
/// protected state stays consistent anyway).
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
        // SAFETY: the publishing launch keeps the task alive until every
        // worker has left the job (see `run`).
        unsafe { (*job.task)(b) };
    }
}

/// Spins until `seq` moves past `seen` or `SPIN` has passed.
fn spin_for_job(p: &Pool, seen: u64) {
    let start = Instant::now();
    loop {
        for _ in 0..64 {
            if p.seq.load(Ordering::Acquire) != seen {
                return;
            }
            core::hint::spin_loop();
        }
        if start.elapsed() >= SPIN {
            return;
        }
    }
}

fn worker(p: &'static Pool, index: usize) {
    let mut seen = 0u64;
    loop {
        spin_for_job(p, seen);
        let mut st = lock(&p.state);
        while p.seq.load(Ordering::Relaxed) == seen {
            st.sleeping += 1;
            st = p.wake.wait(st).unwrap_or_else(PoisonError::into_inner);
            st.sleeping -= 1;
        }
        seen = p.seq.load(Ordering::Relaxed);
        let Some(job) = st.job.filter(|j| index < j.helpers) else {
            continue;
        };
        // Joined under the lock: once the launch closes the job (under the
        // lock too), no worker can join it.
        p.active.fetch_add(1, Ordering::Relaxed);
        drop(st);
        run_blocks(p, job);
        if p.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The launch checks `active` under the lock before it waits.
            let _st = lock(&p.state);
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

/// Calls `task(b)` for every `b` in `0..n_blocks` on up to `threads`
/// threads (the caller's included) and returns when all returned.
pub(crate) fn run(threads: usize, n_blocks: usize, task: &(dyn Fn(usize) + Sync)) {
    let threads = threads.min(MAX_THREADS).min(n_blocks);
    let serial = || (0..n_blocks).for_each(task);
    if threads <= 1 {
        return serial();
    }
    let p = pool();
    let _busy = match p.busy.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(g)) => g.into_inner(),
        Err(TryLockError::WouldBlock) => return serial(),
    };
    // SAFETY: only the lifetime is erased; this function returns only after
    // the job is closed and every worker that joined it has left.
    let task: *const (dyn Fn(usize) + Sync + 'static) = unsafe {
        core::mem::transmute::<
            *const (dyn Fn(usize) + Sync + '_),
            *const (dyn Fn(usize) + Sync + 'static),
        >(task)
    };
    let job = {
        let mut st = lock(&p.state);
        let workers = grow(p, &mut st, threads - 1);
        let job = Job {
            task,
            n: n_blocks,
            helpers: workers.min(threads - 1),
        };
        p.next.store(0, Ordering::Relaxed);
        st.job = Some(job);
        p.seq.fetch_add(1, Ordering::Release);
        if st.sleeping > 0 {
            p.wake.notify_all();
        }
        job
    };
    run_blocks(p, job);
    // Close the job to late helpers, then wait for those inside to leave:
    // after that no thread touches `task` again.
    let mut st = lock(&p.state);
    st.job = None;
    drop(st);
    let start = Instant::now();
    while p.active.load(Ordering::Acquire) > 0 && start.elapsed() < SPIN {
        core::hint::spin_loop();
    }
    let mut st = lock(&p.state);
    while p.active.load(Ordering::Acquire) > 0 {
        st = p.left.wait(st).unwrap_or_else(PoisonError::into_inner);
    }
}
