//! Co-driven steps (`pool::drive`): every thread walks the step, a split launch is one job that
//! all of them join, and no thread waits for one that stalls holding a chunk. Its own test
//! binary: it sets the pool's thread count.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use maxc_kernels::pool;

/// Some arithmetic: `n` dependent multiply-adds.
fn busy_work(n: u32) -> f64 {
    let mut x = 1.0f64;
    for i in 0..n {
        x = std::hint::black_box(x * 1.000_000_1 + f64::from(i));
    }
    x
}

const LAUNCHES: usize = 40;
const CHUNKS: usize = 4;

/// What chunk `c` of launch `l` of step `s` writes: a value of its own.
fn value(s: u64, l: usize, c: usize) -> u32 {
    (s as u32) * 10_000 + (l * CHUNKS + c) as u32 + 1
}

/// Two threads, whichever test starts the pool.
fn start() {
    static START: std::sync::Once = std::sync::Once::new();
    START.call_once(|| {
        pool::set_threads(2);
    });
}

/// Runs one co-driven step of `launches` launches of `CHUNKS` chunks, each storing
/// [`value`] of the drive's own step number `step` into `out`, and checks them.
fn checked_step(step: u64, launches: usize) {
    let out: Arc<Vec<AtomicU32>> =
        Arc::new((0..launches * CHUNKS).map(|_| AtomicU32::new(0)).collect());
    let body = {
        let out = out.clone();
        Arc::new(move |n: u64, _caller: bool| {
            for l in 0..launches {
                pool::enter_launch(n, l);
                pool::run(CHUNKS, &|c| {
                    std::hint::black_box(busy_work(500));
                    out[l * CHUNKS + c].store(value(step, l, c), Ordering::Release);
                });
            }
            pool::leave();
        })
    };
    pool::drive(body);
    for (i, v) in out.iter().enumerate() {
        assert_eq!(
            v.load(Ordering::Acquire),
            value(step, i / CHUNKS, i % CHUNKS),
            "step {step}, launch {}, chunk {}",
            i / CHUNKS,
            i % CHUNKS
        );
    }
}

#[test]
fn co_driven_steps_of_several_callers_take_turns_and_each_is_whole() {
    // Steps numbered as they are called, run as the pool serializes them: a step that waited
    // for another's must still find its own jobs to run (not take the other's later keys for
    // its jobs being done).
    start();
    let callers: Vec<_> = (0..3u64)
        .map(|t| {
            std::thread::spawn(move || {
                for i in 0..40 {
                    checked_step(1000 + t * 100 + i, 12);
                }
            })
        })
        .collect();
    for c in callers {
        c.join().expect("a caller's steps");
    }
}

#[test]
fn a_stalled_thread_holds_up_no_co_driven_step_and_every_chunk_lands() {
    start();
    let before = pool::codriving();
    let caller = std::thread::current().id();
    let release = Arc::new(AtomicBool::new(false));
    let stalled = Arc::new(AtomicUsize::new(0));
    for step in 0..6u64 {
        let out: Arc<Vec<AtomicU32>> =
            Arc::new((0..LAUNCHES * CHUNKS).map(|_| AtomicU32::new(0)).collect());
        let body = {
            let (out, release, stalled) = (out.clone(), release.clone(), stalled.clone());
            Arc::new(move |n: u64, _caller: bool| {
                for l in 0..LAUNCHES {
                    pool::enter_launch(n, l);
                    pool::run(CHUNKS, &|c| {
                        // The first chunk a worker computes from the second step on stalls
                        // until the caller is done with that step: were the caller to wait for
                        // it, the step would never end (the test would time out below).
                        if step >= 1
                            && std::thread::current().id() != caller
                            && stalled.fetch_add(1, Ordering::AcqRel) == 0
                        {
                            let t = Instant::now();
                            while !release.load(Ordering::Acquire)
                                && t.elapsed() < Duration::from_secs(60)
                            {
                                std::thread::sleep(Duration::from_millis(1));
                            }
                        }
                        std::hint::black_box(busy_work(20_000));
                        // A chunk computed twice (its holder late) stores the same value.
                        out[l * CHUNKS + c].store(value(step, l, c), Ordering::Release);
                    });
                    // Every chunk of the launch is in before the step goes on.
                    for c in 0..CHUNKS {
                        assert_eq!(
                            out[l * CHUNKS + c].load(Ordering::Acquire),
                            value(step, l, c),
                            "step {step}, launch {l}, chunk {c}"
                        );
                    }
                }
                pool::leave();
            })
        };
        let t = Instant::now();
        pool::drive(body);
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "step {step} waited for the stalled thread"
        );
        for (i, v) in out.iter().enumerate() {
            assert_eq!(
                v.load(Ordering::Acquire),
                value(step, i / CHUNKS, i % CHUNKS)
            );
        }
        if stalled.load(Ordering::Acquire) > 0 {
            release.store(true, Ordering::Release);
        }
    }
    // The worker took part (it claimed a chunk and stalled in it), and its chunk was taken over.
    assert!(
        stalled.load(Ordering::Acquire) > 0,
        "the worker drove no chunk"
    );
    let after = pool::codriving();
    assert!(after.taken_over > before.taken_over, "{after:?}");
    assert!(after.steps >= before.steps + 6, "{after:?}");
    pool::drivers_idle();
}
