//! The pool's width under real contention: busy threads that keep its threads waiting for a
//! CPU narrow it, and their end widens it again. Its own test binary, so that no other test's
//! threads load the CPUs while it runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use maxc_kernels::pool;

mod common;

/// One "step": the width judged between steps, then a job split to it.
fn step() {
    pool::between_steps(1);
    let chunks = pool::threads();
    pool::run(chunks, &|_| busy_work(20_000));
}

/// Some arithmetic: `n` dependent multiply-adds.
fn busy_work(n: u32) {
    let mut x = 1.0f64;
    for i in 0..n {
        x = std::hint::black_box(x * 1.000_000_1 + f64::from(i));
    }
    std::hint::black_box(x);
}

/// Steps until `done` holds or `limit` passes; whether it held.
fn step_until(limit: Duration, done: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        step();
        if done() {
            return true;
        }
    }
    false
}

#[test]
fn busy_threads_narrow_the_width_and_their_end_widens_it_again() {
    let max = pool::max_threads();
    if max < 2 || !pool::adapts() {
        eprintln!("skipped: {} (the width cannot change)", pool::choice());
        return;
    }
    let changes = pool::width_changes();
    let before = cpus_allowed();
    // Quiet: the whole width.
    step_until(Duration::from_millis(300), || false);
    let stop = Arc::new(AtomicBool::new(false));
    let busy: Vec<_> = (0..2 * max)
        .map(|_| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let narrowed = step_until(Duration::from_secs(10), || pool::threads() < max);
    // A prefill-sized step splits across every thread while the width is narrow (its sleeping
    // workers wake for it), and the next decode-sized step is narrow again.
    let whole = narrowed.then(|| {
        let threads = pool::between_steps(pool::WHOLE_WIDTH_ROWS);
        let start = Instant::now();
        let mut seen = std::collections::HashSet::new();
        while seen.len() < 2 && start.elapsed() < Duration::from_secs(10) {
            let ids = std::sync::Mutex::new(Vec::new());
            pool::run(8 * threads, &|_| {
                busy_work(2_000);
                ids.lock().expect("ids").push(std::thread::current().id());
            });
            seen.extend(ids.into_inner().expect("ids"));
        }
        let narrow_again = pool::between_steps(1);
        // A width of one that waits for its CPU beside the busy threads pairs on that CPU:
        // both threads pinned to it (this one, the caller, among them).
        let pinned = (pool::threads() == 1 || pool::paired()).then(|| {
            step_until(Duration::from_secs(10), pool::paired);
            (pool::paired(), cpus_allowed())
        });
        (threads, seen.len(), narrow_again, pinned)
    });
    stop.store(true, Ordering::Relaxed);
    for b in busy {
        b.join().expect("a busy thread");
    }
    assert!(
        narrowed,
        "{} busy threads beside {max} pool threads: the width stayed {max}",
        2 * max
    );
    let (threads, seen, narrow_again, pinned) = whole.expect("checked while narrow");
    if let Some((paired, cpus)) = &pinned {
        assert!(
            *paired,
            "a width of one beside {} busy threads never paired",
            2 * max
        );
        assert_eq!(cpus.len(), 1, "the paired caller may run on CPUs {cpus:?}");
    }
    assert_eq!(threads, max, "a prefill-sized step's threads while narrow");
    assert!(
        seen >= 2,
        "a prefill-sized step ran on {seen} thread(s) of {max}"
    );
    // (Or two, pinned to one CPU: a width of one that waits for its CPU pairs.)
    assert!(
        narrow_again < max || pool::paired(),
        "the next decode-sized step took {narrow_again} threads on several CPUs"
    );
    let (idle0, t0) = (idle_seconds(), Instant::now());
    let widened = step_until(Duration::from_secs(10), || {
        pool::threads() == max && !pool::paired()
    });
    if widened && pinned.is_some() {
        assert_eq!(
            cpus_allowed(),
            before,
            "the pair ended, and its caller's CPUs"
        );
    }
    if widened {
        assert!(pool::width_changes() >= changes + 2);
        return;
    }
    // Other processes may keep this machine's CPUs busy (a build beside the tests): then
    // staying narrow is right. Only where a CPU stood idle must the width have grown.
    let idle = (idle_seconds() - idle0) / t0.elapsed().as_secs_f64();
    assert!(
        idle < 0.5,
        "the busy threads ended and {idle:.2} CPUs stood idle, but the width stayed {} of {max}",
        pool::threads()
    );
    eprintln!("the width stayed narrow beside other processes ({idle:.2} CPUs idle)");
}

/// The machine's idle and iowait time, in CPU-seconds (`/proc/stat`'s first line).
fn idle_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
    let fields: Vec<f64> = stat
        .lines()
        .next()
        .expect("its cpu line")
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().expect("a tick count"))
        .collect();
    (fields[3] + fields[4]) / 100.0
}

/// The CPUs this thread may run on.
fn cpus_allowed() -> Vec<usize> {
    common::cpus_allowed_of("thread-self")
}
