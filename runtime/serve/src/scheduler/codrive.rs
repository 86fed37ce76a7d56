//! Loops of co-driven steps: where the executor's threads share their CPUs with other
//! processes, every one of them runs the scheduler's loop, so that the steps go on while any of
//! them has a CPU.
//!
//! A co-driven step (the executor's `codrive.rs`) is walked by the caller and the pool's helper
//! together, but a step *begins* on one thread: the one that runs the scheduler. On a machine
//! where every CPU is shared, that thread is descheduled for whole time slices (4 ms beside a
//! busy process), and the helper, having finished the step, waits for it. In a loop
//! ([`Scheduler::run_loop`], run on the caller and the helper by `pool::drive_loop`) the phases
//! between the steps are a turn that either thread takes: the first to find the step's launches
//! done (and the turn free) ends the step (the executor's `finish`, the update phase), asks the
//! loop's owner whether to go on, schedules the next step and begins it (the executor's
//! `begin`), and both walk it. The scheduler is touched by one thread at a time (the turn's
//! lock), so its phases are the same code as [`Scheduler::step`]'s.
//!
//! A step that cannot run co-driven (a prefill of many rows, a step whose structured outputs
//! sample, profiling) ends the loop: the thread that owns the scheduler runs it the plain way,
//! and a later call begins a new loop.

use super::plan::StepPlan;
use super::state::Scheduler;
use super::stats::StepStats;
use maxc_runtime::StepWalk;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Instant;

/// A step begun and not yet ended.
struct InFlight {
    plan: StepPlan,
    stats: StepStats,
    walk: Arc<dyn StepWalk>,
    start: Instant,
    start_unix: u64,
}

/// The turn between steps: the scheduler and what the loop's owner asks of it.
struct Turn<'a> {
    sched: &'a mut Scheduler,
    go_on: &'a mut (dyn FnMut(&mut Scheduler) -> bool + Send),
    in_flight: Option<InFlight>,
    /// A scheduled step that does not run co-driven: the owner runs it after the loop.
    plain: Option<(StepPlan, StepStats)>,
}

/// A loop's state, shared by its threads.
struct Loop<'a> {
    turn: Mutex<Turn<'a>>,
    /// The step being walked now.
    walk: Mutex<Option<Arc<dyn StepWalk>>>,
    end: AtomicBool,
    /// A panic of the loop's phases (on any thread), resumed by its owner.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

/// Steps begun by each kind of thread since the start: the loop's owner, the pool's workers.
static BEGUN: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

/// Steps begun in loops of co-driven steps since the start: by the thread that runs the
/// scheduler, and by the pool's workers (while the scheduler's thread waited for a CPU).
pub fn loop_steps() -> (usize, usize) {
    (
        BEGUN[0].load(Ordering::Relaxed),
        BEGUN[1].load(Ordering::Relaxed),
    )
}

impl Turn<'_> {
    /// Takes the turn: ends the step in flight once its launches are done, and begins the next
    /// (or ends the loop).
    fn take(&mut self, lp: &Loop, owner: bool) {
        if let Some(f) = &self.in_flight {
            if !f.walk.done() {
                // Still being computed (this thread came from an older step): walk it.
                return;
            }
        }
        if let Some(mut f) = self.in_flight.take() {
            let result = self.sched.exec.finish();
            self.sched
                .conclude(f.plan, result, f.start, f.start_unix, &mut f.stats);
            self.sched.report(f.stats);
        }
        if !(self.go_on)(self.sched) || !self.sched.has_work() {
            lp.end.store(true, Ordering::Release);
            return;
        }
        let mut stats = StepStats::default();
        let Some(plan) = self.sched.schedule(&mut stats) else {
            // Nothing could run this time: the owner's plain loop goes on.
            self.sched.report(stats);
            lp.end.store(true, Ordering::Release);
            return;
        };
        if !self.sched.constrained(&plan).is_empty() {
            self.plain = Some((plan, stats));
            lp.end.store(true, Ordering::Release);
            return;
        }
        let start = Instant::now();
        let start_unix = crate::trace::now_unix_ns();
        match self.sched.exec.begin(&plan.step.inputs) {
            Ok(Some(walk)) => {
                BEGUN[usize::from(!owner)].fetch_add(1, Ordering::Relaxed);
                *lp.walk.lock().unwrap_or_else(|e| e.into_inner()) = Some(walk.clone());
                self.in_flight = Some(InFlight {
                    plan,
                    stats,
                    walk,
                    start,
                    start_unix,
                });
            }
            Ok(None) => {
                self.plain = Some((plan, stats));
                lp.end.store(true, Ordering::Release);
            }
            Err(e) => {
                self.sched
                    .conclude(plan, Err(e), start, start_unix, &mut stats);
                self.sched.report(stats);
            }
        }
    }
}

/// One thread's part in a loop: walk the step in flight, then take the turn if it is free.
fn run_part(lp: &Loop, owner: bool) {
    let mut waits = 0u32;
    while !lp.end.load(Ordering::Acquire) {
        let walk = lp.walk.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if let Some(w) = &walk {
                w.walk();
            }
            match lp.turn.try_lock() {
                Ok(mut turn) => {
                    turn.take(lp, owner);
                    false
                }
                Err(TryLockError::WouldBlock) => true,
                Err(TryLockError::Poisoned(_)) => {
                    lp.end.store(true, Ordering::Release);
                    false
                }
            }
        }));
        match ran {
            // Another thread has the turn: it begins the next step soon (unless descheduled;
            // this one's CPU may be the one it needs).
            Ok(true) => {
                waits = waits.wrapping_add(1);
                maxc_runtime::kernels::pool::pause(waits, 16);
            }
            Ok(false) => waits = 0,
            Err(p) => {
                lp.panic
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(p);
                lp.end.store(true, Ordering::Release);
            }
        }
    }
}

impl Scheduler {
    /// Whether steps now run in loops of co-driven steps ([`Scheduler::run_loop`]).
    pub fn loops(&self) -> bool {
        self.spec.is_none() && self.exec.loops()
    }

    /// Runs steps in a loop of co-driven steps (the module's doc) while `go_on` (called between
    /// steps, on whichever thread ends one) says so and there is work, until a step that does
    /// not run co-driven, which it then runs the plain way.
    pub fn run_loop(&mut self, go_on: &mut (dyn FnMut(&mut Scheduler) -> bool + Send)) {
        let lp = Loop {
            turn: Mutex::new(Turn {
                sched: self,
                go_on,
                in_flight: None,
                plain: None,
            }),
            walk: Mutex::new(None),
            end: AtomicBool::new(false),
            panic: Mutex::new(None),
        };
        maxc_runtime::engine::drive_loop(&|owner| run_part(&lp, owner));
        if let Some(p) = lp.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            std::panic::resume_unwind(p);
        }
        let turn = lp.turn.into_inner().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = turn.in_flight {
            // (Only after a panic, resumed above: a loop ends between steps.)
            drop(f);
        }
        if let Some((plan, mut stats)) = turn.plain {
            turn.sched.run_planned(plan, &mut stats);
            turn.sched.report(stats);
        }
    }
}
