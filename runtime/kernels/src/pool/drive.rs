//! Co-driven steps: every thread of the width runs the whole step, so the step goes on while any
//! of them has a CPU.
//!
//! A plain job ([`super::run`]) is split by one caller, which alone walks the step's launches:
//! when the caller is descheduled, the workers have nothing to do, and when a worker is
//! descheduled holding a chunk, the caller waits for it. On CPUs shared with other processes
//! both happen every time slice. In a co-driven step ([`drive`]) every thread walks the
//! launches itself (the executor's loop, `drive_step`), and a split launch is one job that all of
//! them join under the same key: each claims chunks while any is left, and one that finds only
//! chunks another thread holds waits a little (about two of its own chunks) and then computes
//! them itself. So no thread ever waits for a descheduled one for longer than that:
//!
//! - A chunk may be computed twice (by its holder, late, and by the thread that took it over).
//!   Both write the same values from the same inputs, and the executor gives every buffer of a
//!   co-driven step its own memory (no buffer's bytes are reused within a step, and steps
//!   alternate between two sets of buffers), so a late write only ever stores what is already
//!   there. Kernels run this way must write each output value once, from inputs alone (never
//!   read-modify-write their outputs, never keep per-call scratch that another thread's chunks
//!   fill); the executor runs the others on one thread (its exclusive launches).
//! - Launches a thread finds done by another it skips; launches not split (a norm, a rope)
//!   every thread that reaches them computes, alike.
//!
//! A job's key is its step, its launch and its place among the launch's jobs
//! ([`enter_launch`]): every thread computes the same launches in the same order with the same
//! split, so the n-th job of a launch is the same job on every thread.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{pool, Current, InJob, Shared, IN_JOB};

/// A co-driven step's body: called on the caller and on every worker of the width with the
/// drive's number (for [`enter_launch`]) and whether it runs on the caller.
pub type DriveFn = Arc<dyn Fn(u64, bool) + Send + Sync>;

/// The most claimable parts of a co-driven job (its chunks are grouped into at most this many).
const SLOTS: usize = 12;
/// Bits of a job's key: its drive's number (20 bits, wrapping), its launch (14) and its place
/// among the launch's jobs (6).
const KEY_BITS: u32 = 40;
const LAUNCH_BITS: u32 = 14;
const SUB_BITS: u32 = 6;

thread_local! {
    /// The launch this thread is driving (its key) and how many jobs it has run in it.
    static KEY: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
    /// How long this thread's last two co-driven chunks took: the shorter is how long it waits
    /// for another's (one chunk's time may include a time slice it waited for its CPU).
    static LAST: Cell<[Duration; 2]> = const { Cell::new([Duration::ZERO; 2]) };
}

/// Co-driven steps since the start.
pub(super) static STEPS: AtomicUsize = AtomicUsize::new(0);
/// Chunks computed by a thread that took them over from a descheduled one, since the start.
static TAKEN_OVER: AtomicUsize = AtomicUsize::new(0);

/// Co-driven steps' counts since the pool started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Codriving {
    /// Steps run co-driven.
    pub steps: usize,
    /// Chunks a thread took over from another that held them (descheduled) and computed.
    pub taken_over: usize,
}

/// The co-driven steps' counts so far.
pub fn codriving() -> Codriving {
    Codriving {
        steps: STEPS.load(Ordering::Relaxed),
        taken_over: TAKEN_OVER.load(Ordering::Relaxed),
    }
}

/// A test hook: with `MAXC_CODRIVE_STALL=N`, a worker sleeps 2 ms before every `N`th chunk of a
/// co-driven job it claims, as a descheduled thread would stall, so that the others take its
/// chunks over and it writes them again, late.
fn stall_every() -> usize {
    static EVERY: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *EVERY.get_or_init(|| {
        std::env::var("MAXC_CODRIVE_STALL")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    })
}

thread_local! {
    /// Whether this thread runs a co-driven body now ([`drive`], [`drive_loop`]): a job it
    /// splits outside a launch runs on it alone, and a step it drives runs on it alone.
    static IN_BODY: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as inside a co-driven body until dropped.
struct InBody(bool);

impl InBody {
    fn enter() -> Self {
        note_cpu();
        InBody(IN_BODY.with(|b| b.replace(true)))
    }
}

impl Drop for InBody {
    fn drop(&mut self) {
        IN_BODY.with(|b| b.set(self.0));
        if !self.0 {
            CPUS[slot()].store(0, Ordering::Relaxed);
        }
    }
}

/// The CPU each thread in a co-driven body last began a launch on (plus one; zero: none):
/// the pool's callers' at 0, worker `i`'s at `i + 1` (the last slot shared by the rest).
static CPUS: [AtomicUsize; 8] = [const { AtomicUsize::new(0) }; 8];

thread_local! {
    /// This thread's place in [`CPUS`].
    pub(super) static SLOT: Cell<usize> = const { Cell::new(0) };
}

fn slot() -> usize {
    SLOT.with(|s| s.get()).min(CPUS.len() - 1)
}

/// The CPU this thread runs on now, where the system says.
fn current_cpu() -> Option<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: no arguments; returns the CPU or -1.
        let cpu = unsafe { libc::sched_getcpu() };
        usize::try_from(cpu).ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// Records the CPU this thread runs on in [`CPUS`]; returns it (plus one; zero: unknown).
fn note_cpu() -> usize {
    let cpu = current_cpu().map_or(0, |c| c + 1);
    CPUS[slot()].store(cpu, Ordering::Relaxed);
    cpu
}

/// Whether another thread in a co-driven body last ran on this thread's CPU (where unknown:
/// unless the pool leads, whose threads are pinned apart).
fn sharing_cpu() -> bool {
    let mine = note_cpu();
    if mine == 0 {
        return !super::leading();
    }
    let me = slot();
    CPUS.iter()
        .enumerate()
        .any(|(i, c)| i != me && c.load(Ordering::Relaxed) == mine)
}

/// Whether this thread runs a co-driven body now ([`drive`], [`drive_loop`]).
pub fn in_body() -> bool {
    IN_BODY.with(|b| b.get())
}

thread_local! {
    /// Whether this thread is a worker of the pool (the stall hook stalls only workers).
    pub(super) static WORKER: Cell<bool> = const { Cell::new(false) };
    /// Chunks this thread claimed in co-driven jobs (for the stall hook).
    static CLAIMED: Cell<usize> = const { Cell::new(0) };
}

/// Marks this thread as driving launch `launch` of step `step`: its jobs until the next call
/// (or [`leave`]) are that launch's, joined with the other drivers'.
pub fn enter_launch(drive: u64, launch: usize) {
    note_cpu();
    let step = drive & ((1 << (KEY_BITS - LAUNCH_BITS - SUB_BITS)) - 1);
    let launch = launch as u64 & ((1 << LAUNCH_BITS) - 1);
    let key = (step << (LAUNCH_BITS + SUB_BITS)) | (launch << SUB_BITS);
    KEY.with(|k| k.set(Some((key, 0))));
}

/// Ends this thread's part in a co-driven step: its jobs are its own again.
pub fn leave() {
    KEY.with(|k| k.set(None));
}

/// Whether this thread drives a co-driven step now (kernels then keep no per-call scratch that
/// several threads' chunks fill: see the module's contract).
pub fn driving() -> bool {
    KEY.with(|k| k.get().is_some())
}

/// The key of this thread's next job in the launch it drives, where it drives one.
pub(super) fn next_key() -> Option<u64> {
    if IN_JOB.with(|j| j.get()) {
        return None;
    }
    KEY.with(|k| {
        let (base, n) = k.get()?;
        k.set(Some((base, n + 1)));
        Some(base | (n & ((1 << SUB_BITS) - 1)))
    })
}

/// Whether key `a` comes after key `b` (the step's 8 bits wrap; live keys are at most a few
/// steps apart).
fn later(a: u64, b: u64) -> bool {
    let d = a.wrapping_sub(b) & ((1 << KEY_BITS) - 1);
    d != 0 && d < 1 << (KEY_BITS - 1)
}

/// The job word: its key, then the claimed and the done slots.
fn pack(key: u64, claimed: u64, done: u64) -> u64 {
    (key << (2 * SLOTS)) | (claimed << SLOTS) | done
}

fn unpack(w: u64) -> (u64, u64, u64) {
    let mask = (1 << SLOTS) - 1;
    (w >> (2 * SLOTS), (w >> SLOTS) & mask, w & mask)
}

/// Runs the co-driven job `key` of `chunks` chunks, joined with whichever other drivers reach
/// it: returns once every chunk has been computed (by some thread).
pub(super) fn run(s: &Shared, key: u64, chunks: usize, f: &(dyn Fn(usize) + Sync)) {
    let slots = chunks.min(SLOTS);
    let full = (1u64 << slots) - 1;
    let run_slot = |i: usize| {
        let every = stall_every();
        if every > 0 && WORKER.with(|w| w.get()) {
            let n = CLAIMED.with(|c| {
                c.set(c.get() + 1);
                c.get()
            });
            if n.is_multiple_of(every) {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let _in = InJob::enter();
        let t = Instant::now();
        for c in chunks * i / slots..chunks * (i + 1) / slots {
            f(c);
        }
        LAST.with(|l| l.set([l.get()[1], t.elapsed()]));
    };
    let mark_done = |i: usize| {
        let mut w = s.co.load(Ordering::Acquire);
        loop {
            let (k, _, _) = unpack(w);
            if k != key {
                return;
            }
            match s
                .co
                .compare_exchange_weak(w, w | (1 << i), Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(now) => w = now,
            }
        }
    };
    let mut waiting: Option<Instant> = None;
    let mut spins = 0u32;
    loop {
        let w = s.co.load(Ordering::Acquire);
        let (k, claimed, done) = unpack(w);
        if later(k, key) {
            // Another driver finished it and went on.
            return;
        }
        if k != key {
            // The first driver here publishes it.
            let _ =
                s.co.compare_exchange(w, pack(key, 0, 0), Ordering::AcqRel, Ordering::Acquire);
            continue;
        }
        if done & full == full {
            return;
        }
        let free = !claimed & full;
        if free != 0 {
            let i = free.trailing_zeros() as usize;
            if s.co
                .compare_exchange(
                    w,
                    w | (1 << (SLOTS + i)),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
            {
                run_slot(i);
                mark_done(i);
                waiting = None;
            }
            continue;
        }
        // Every slot is claimed, some by threads still computing them: wait about two of this
        // thread's chunks, then compute the first of them here.
        let since = *waiting.get_or_insert_with(Instant::now);
        let last = LAST.with(|l| l.get());
        let patience = (last[0].min(last[1]) * 2).max(Duration::from_micros(10));
        if since.elapsed() >= patience {
            let held = claimed & !done & full;
            let i = held.trailing_zeros() as usize;
            TAKEN_OVER.fetch_add(1, Ordering::Relaxed);
            run_slot(i);
            mark_done(i);
            waiting = None;
            continue;
        }
        spins = spins.wrapping_add(1);
        pause(spins, 256);
    }
}

/// One spin of a co-driven thread's wait for another: every `every` spins, yields the CPU if
/// another of the body's threads last ran on this one's (the thread waited for may be waiting
/// for it). Where they run on different CPUs a yield would hand this thread's share of its
/// CPU to another process for a whole time slice, and the thread waited for does not need it.
pub fn pause(spins: u32, every: u32) {
    if spins.is_multiple_of(every) && sharing_cpu() {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Runs `step` on the calling thread and on every worker of the width at once (each calls it
/// once); returns when the caller's call does, which is when the step is done (the body's
/// contract: it returns only once every launch is). Workers may still be inside their call:
/// the body keeps what it reads alive until [`drivers_idle`] (its owner waits for that before
/// freeing it). Called inside a co-driven body, the step runs on this thread alone.
pub fn drive(step: DriveFn) {
    start(step, true);
}

/// Runs `part` on the calling thread and on every worker of the width at once, each calling it
/// once (`true` on the calling thread), for a body that runs many steps (a loop of steps that
/// any of its threads may begin, each numbered by [`step_number`]): not counted as a co-driven
/// step itself. Returns once the calling thread's part has returned and no other thread is
/// inside `part` (so `part` may borrow). Inside it, a job split outside a launch
/// ([`super::run`]) runs on its thread alone.
pub fn drive_loop(part: &(dyn Fn(bool) + Sync)) {
    /// `part`'s address for the pool's threads (`'static` by erasure).
    struct Part(*const (dyn Fn(bool) + Sync + 'static));
    // SAFETY: `part` is `Sync`; the pointer is used only until `drivers_idle` returns, below.
    unsafe impl Send for Part {}
    unsafe impl Sync for Part {}
    impl Part {
        fn get(&self) -> *const (dyn Fn(bool) + Sync + 'static) {
            self.0
        }
    }
    // SAFETY: only the lifetime is erased; every thread has left `part` when this returns.
    let ptr = Part(unsafe {
        std::mem::transmute::<
            *const (dyn Fn(bool) + Sync + '_),
            *const (dyn Fn(bool) + Sync + 'static),
        >(part)
    });
    /// Waits for the pool's threads to leave `part` (also where the caller's part panicked).
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            drivers_idle();
        }
    }
    let _leave = Leave;
    start(
        Arc::new(move |_, owner| {
            // SAFETY: see `Part`.
            unsafe { (*ptr.get())(owner) }
        }),
        false,
    );
}

/// A new co-driven step's number (counted as one), for [`enter_launch`]: later than every
/// step's before it.
pub fn step_number() -> u64 {
    STEPS.fetch_add(1, Ordering::Relaxed) as u64
}

fn start(step: DriveFn, counted: bool) {
    let p = pool();
    let number = || {
        if counted {
            step_number()
        } else {
            STEPS.load(Ordering::Relaxed) as u64
        }
    };
    if p.workers > 0 && !IN_JOB.with(|j| j.get()) && !in_body() {
        let s = p.shared;
        // Held for the whole step: co-driven steps (and other jobs) of several callers take
        // turns, as jobs do.
        let _one = p.caller.lock().unwrap_or_else(|e| e.into_inner());
        // Numbered in the order the steps run (under the lock), across every caller: no two
        // steps' jobs share a key, so a worker late in one never joins another's, and a later
        // step's keys are later (a job whose key is behind the current one's is done).
        let n = number();
        *s.drive.lock().unwrap_or_else(|e| e.into_inner()) = Some((n, step.clone()));
        let epoch = (s.epoch.load(Ordering::Acquire) + 1) as u32;
        *s.current.lock().unwrap_or_else(|e| e.into_inner()) = Current {
            job: None,
            spec: None,
            drive: true,
            epoch,
            chunks: 0,
        };
        {
            let _g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
            s.epoch.fetch_add(1, Ordering::AcqRel);
        }
        s.wake.notify_all();
        let _in = InBody::enter();
        step(n, true);
        return;
    }
    // (No worker joins: every job of the step runs on this thread.)
    let n = number();
    let _in = InBody::enter();
    step(n, true);
}

/// A worker's part in the co-driven step published last (it runs the newest: an older one is
/// done).
pub(super) fn join(s: &Shared) {
    let step = {
        let slot = s.drive.lock().unwrap_or_else(|e| e.into_inner());
        let step = slot.clone();
        if step.is_some() {
            s.driving.fetch_add(1, Ordering::AcqRel);
        }
        step
    };
    let Some((n, step)) = step else { return };
    // A panic in a worker's part leaves the step to the caller, which computes every launch
    // it finds undone (and meets the same panic, on its own thread, if it is the kernel's).
    let in_body = InBody::enter();
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(n, false)));
    drop(in_body);
    leave();
    s.driving.fetch_sub(1, Ordering::AcqRel);
}

/// Forgets the last co-driven step and waits until no worker is inside one: after it, what
/// co-driven steps read may be freed or changed.
pub fn drivers_idle() {
    let Some(p) = super::POOL.get() else { return };
    let s = p.shared;
    *s.drive.lock().unwrap_or_else(|e| e.into_inner()) = None;
    super::spin_until(16, || s.driving.load(Ordering::Acquire) == 0);
}

/// The job word's starting value.
pub(super) fn idle_word() -> AtomicU64 {
    AtomicU64::new(0)
}
