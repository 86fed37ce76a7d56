//! The CPU executor's worker threads: one per core beyond the caller's, each spinning for new
//! work for a while before it sleeps. A decode step is hundreds of kernel launches of tens of
//! microseconds; waking a sleeping thread per launch (as a general-purpose pool does when it has
//! gone idle) costs about as much as the launch, so workers stay hot between launches and the
//! caller computes a share itself instead of waiting.
//!
//! [`run`] splits work into `chunks` calls of one function, the caller taking chunk 0. Calls
//! from several threads are serialized; a call from inside a job (an MoE expert's matmul, run
//! on one thread of the experts' split) runs its chunks on its own thread, in turn.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

thread_local! {
    /// Whether this thread is running a chunk of a job (where [`run`] must not wait for the
    /// workers: one of them may be this thread, or busy with the same job).
    static IN_JOB: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as inside a job until dropped (also when the job unwinds).
struct InJob(bool);

impl InJob {
    fn enter() -> Self {
        InJob(IN_JOB.with(|j| j.replace(true)))
    }
}

impl Drop for InJob {
    fn drop(&mut self) {
        IN_JOB.with(|j| j.set(self.0));
    }
}

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_millis(2);

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Bumped for every job; workers run a job when they see a new epoch.
    epoch: AtomicU64,
    /// The current job, valid from its epoch's bump until `pending` reaches zero (its
    /// lifetime is erased: [`run`] outlives every use).
    job: Mutex<Option<&'static Job>>,
    /// Chunks of the current job.
    chunks: AtomicUsize,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    /// Sleeping workers wait here.
    sleep: Mutex<()>,
    wake: Condvar,
}

struct Pool {
    shared: &'static Shared,
    workers: usize,
    /// Serializes callers.
    caller: Mutex<()>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = std::env::var("MAXC_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(threads);
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            chunks: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        }));
        let workers = threads - 1;
        for w in 0..workers {
            let spawned = std::thread::Builder::new()
                .name(format!("maxc-cpu-{}", w + 1))
                .spawn(move || worker(shared, w + 1));
            if spawned.is_err() {
                // Fewer workers than cores: jobs get fewer chunks.
                return Pool {
                    shared,
                    workers: w,
                    caller: Mutex::new(()),
                };
            }
        }
        Pool {
            shared,
            workers,
            caller: Mutex::new(()),
        }
    })
}

/// Threads a job can be split across (the caller and the workers).
pub fn threads() -> usize {
    pool().workers + 1
}

fn worker(s: &'static Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                break e;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                // Spinning politely: on an oversubscribed machine the thread this one waits for
                // may need the core.
                std::thread::yield_now();
            }
            if spins.is_multiple_of(1024) && start.elapsed() > SPIN {
                let guard = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
                if s.epoch.load(Ordering::Acquire) == seen {
                    let _guard = s
                        .wake
                        .wait_timeout(guard, Duration::from_millis(100))
                        .unwrap_or_else(|e| e.into_inner());
                }
                continue;
            }
            std::hint::spin_loop();
        };
        seen = epoch;
        if index < s.chunks.load(Ordering::Acquire) {
            let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(job) = job {
                // A panicking job must still count as done, or its caller would wait forever;
                // the panic is reported on this thread.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let _in = InJob::enter();
                    job(index)
                }));
            }
        }
        s.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Calls `f(0..chunks)`, chunk 0 on the calling thread and the others on the workers, and
/// returns when all are done. `chunks` is at most [`threads`]; more are run by the caller.
pub fn run<'a>(chunks: usize, f: &'a (dyn Fn(usize) + Sync + 'a)) {
    let p = pool();
    if chunks <= 1 || p.workers == 0 || IN_JOB.with(|j| j.get()) {
        (0..chunks).for_each(f);
        return;
    }
    let _one = p.caller.lock().unwrap_or_else(|e| e.into_inner());
    let s = p.shared;
    let on_workers = chunks.min(p.workers + 1);
    // SAFETY: only the lifetime is erased; workers use the reference only between the epoch
    // bump below and their decrement of `pending`, and this call returns after both.
    let job: &'static Job =
        unsafe { std::mem::transmute::<&'a (dyn Fn(usize) + Sync + 'a), &'static Job>(f) };
    *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(job);
    s.chunks.store(on_workers, Ordering::Release);
    s.pending.store(p.workers, Ordering::Release);
    {
        let _g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
        s.epoch.fetch_add(1, Ordering::AcqRel);
    }
    s.wake.notify_all();
    /// Waits for the workers, also when the caller's share unwinds: the job must outlive them.
    struct Wait(&'static Shared);
    impl Drop for Wait {
        fn drop(&mut self) {
            let mut spins = 0u32;
            while self.0.pending.load(Ordering::Acquire) != 0 {
                // A worker descheduled by an oversubscribed machine needs this core back.
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(16) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            *self.0.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
    let _wait = Wait(s);
    let _in = InJob::enter();
    f(0);
    for c in on_workers..chunks {
        f(c);
    }
}

/// An output pointer that threads of [`run`] write disjoint parts of.
#[derive(Clone, Copy)]
pub struct OutPtr(pub *mut f32);
// SAFETY: threads write disjoint columns (or disjoint panels) of the output.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the `Send` wrapper, not its field).
    pub fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_runs_once_per_job() {
        let counts: Vec<AtomicUsize> = (0..8).map(|_| AtomicUsize::new(0)).collect();
        for round in 0..500 {
            let chunks = 1 + round % 8;
            run(chunks, &|c| {
                counts[c].fetch_add(1, Ordering::Relaxed);
            });
        }
        let total: usize = counts.iter().map(|c| c.load(Ordering::Relaxed)).sum();
        assert_eq!(total, (0..500).map(|r| 1 + r % 8).sum::<usize>());
        // After a sleep, workers wake for the next job.
        std::thread::sleep(Duration::from_millis(30));
        let hits = AtomicUsize::new(0);
        run(threads(), &|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), threads());
    }

    #[test]
    fn a_job_that_splits_its_own_work_runs_it_on_its_thread() {
        let hits = AtomicUsize::new(0);
        for _ in 0..100 {
            run(threads().max(2), &|_| {
                run(3, &|_| {
                    hits.fetch_add(1, Ordering::Relaxed);
                });
            });
        }
        assert_eq!(hits.load(Ordering::Relaxed), 100 * 3 * threads().max(2));
    }
}
