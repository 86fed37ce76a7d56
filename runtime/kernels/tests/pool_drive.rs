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

#[test]
fn a_loop_of_steps_goes_on_on_a_worker_while_its_caller_stalls() {
    // A loop's body (`pool::drive_loop`) runs on the caller and the worker; either begins the
    // next step (here: the first to find the step done takes a turn and numbers the next).
    // The caller stalls between its steps, as a descheduled thread would: the worker goes on.
    start();
    if pool::max_threads() < 2 {
        return;
    }
    const STEPS: usize = 30;
    let begun_by = [AtomicUsize::new(0), AtomicUsize::new(0)];
    let turn = std::sync::Mutex::new(0usize);
    // The step being walked: its number and its outputs.
    let current: std::sync::Mutex<Option<(u64, Arc<Vec<AtomicU32>>)>> = std::sync::Mutex::new(None);
    let end = AtomicBool::new(false);
    let split_inline = AtomicUsize::new(0);
    let part = |owner: bool| {
        while !end.load(Ordering::Acquire) {
            let step = current.lock().unwrap().clone();
            let mut done = true;
            if let Some((n, out)) = &step {
                for l in 0..8 {
                    pool::enter_launch(*n, l);
                    pool::run(CHUNKS, &|c| {
                        std::hint::black_box(busy_work(2000));
                        out[l * CHUNKS + c].store(value(*n, l, c), Ordering::Release);
                    });
                }
                pool::leave();
                done = out.iter().all(|v| v.load(Ordering::Acquire) != 0);
            }
            if !done {
                continue;
            }
            if owner {
                std::thread::sleep(Duration::from_millis(2));
            }
            let Ok(mut steps) = turn.try_lock() else {
                std::hint::spin_loop();
                continue;
            };
            if end.load(Ordering::Acquire) {
                // The other thread ended the loop meanwhile.
                return;
            }
            let mut cur = current.lock().unwrap();
            if cur.as_ref().map(|(n, _)| *n) != step.as_ref().map(|(n, _)| *n) {
                // Another thread began a step meanwhile: walk it.
                continue;
            }
            if let Some((n, out)) = cur.as_ref() {
                for (i, v) in out.iter().enumerate() {
                    assert_eq!(v.load(Ordering::Acquire), value(*n, i / CHUNKS, i % CHUNKS));
                }
            }
            // Work split outside a launch runs on this thread alone (no other joins it, and
            // it does not wait for the pool).
            let me = std::thread::current().id();
            pool::run(4, &|_| {
                assert_eq!(std::thread::current().id(), me);
                split_inline.fetch_add(1, Ordering::Relaxed);
            });
            if *steps == STEPS {
                end.store(true, Ordering::Release);
                return;
            }
            *steps += 1;
            begun_by[usize::from(!owner)].fetch_add(1, Ordering::Relaxed);
            let n = pool::step_number();
            if let Some((before, _)) = cur.as_ref() {
                assert!(n > *before, "step {n} after {before}");
            }
            *cur = Some((
                n,
                Arc::new((0..8 * CHUNKS).map(|_| AtomicU32::new(0)).collect()),
            ));
        }
    };
    pool::drive_loop(&part);
    let (mine, workers) = (
        begun_by[0].load(Ordering::Relaxed),
        begun_by[1].load(Ordering::Relaxed),
    );
    assert_eq!(mine + workers, STEPS);
    assert!(
        workers > 0,
        "the worker began no step while the caller stalled"
    );
    assert_eq!(split_inline.load(Ordering::Relaxed), 4 * (STEPS + 1));
}
