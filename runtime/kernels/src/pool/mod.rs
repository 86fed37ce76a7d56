//! The CPU executor's worker threads: one per core beyond the caller's, each spinning for new
//! work for a while before it sleeps. A decode step is hundreds of kernel launches of tens of
//! microseconds; waking a sleeping thread per launch (as a general-purpose pool does when it has
//! gone idle) costs about as much as the launch, so workers stay hot between launches and the
//! caller computes a share itself instead of waiting.
//!
//! [`run`] splits work into `chunks` calls of one function. The chunks are taken dynamically:
//! the caller and every worker that sees the job claim the next chunk until none is left, and
//! the caller waits only for the chunks claimed, never for a worker to turn up. On a machine
//! whose cores are shared, a worker descheduled before the job costs nothing (the caller takes
//! its chunk); one descheduled while it holds a chunk costs that chunk, and a caller that waits
//! for it longer than [`WAIT_SPIN`] sleeps, leaving the core to it. (Splitting a decode step's
//! short launches into more chunks than threads, so that a held chunk is smaller, measured 3-5%
//! slower decode on a quiet machine and no steadier on a busy one: they split into [`threads`]
//! chunks. A prefill step's long launches split into [`long_chunks`].) Calls from
//! several threads are serialized; a call from inside a job (an MoE expert's matmul, run on one
//! thread of the experts' split) runs its chunks on its own thread, in turn.
//!
//! The thread count is, in order: [`set_threads`] (the `--threads` flag), `MAXC_THREADS`, and
//! the CPUs this process may use (`available_parallelism`: the affinity mask and the cgroup
//! CPU quota); [`choice`] says which. It is the most threads a job is split across: the width
//! jobs are split to now ([`threads`]) follows the CPUs the threads actually get (`width.rs`).
//! A job split across two threads waits for both, and one whose worker is descheduled while it
//! holds a chunk waits a whole time slice of the other process; so while other processes keep
//! the pool's threads waiting for a CPU, fewer threads run the decode steps and the rest sleep,
//! until a CPU stands idle again. Where that would leave one thread, two stay and share the
//! CPUs (`width.rs`, Sharing): their decode steps run co-driven (below), so the process keeps
//! two threads' share of the CPUs and no step waits for a descheduled thread. Where the
//! executor does not co-drive, the width narrows to one, and a width of one that still waits
//! for its CPU (more busy processes than the other CPUs hold) becomes two threads pinned to
//! its CPU, whose share of it is then two threads', and whose steps never wait for another
//! CPU. Prefill steps ([`WHOLE_WIDTH_ROWS`] rows or more) still take every thread: their
//! launches are long and split finely, so each thread's share of the CPUs adds to the step's.
//! A width of one that has its CPU beside busy processes also leads (`width.rs`, Leading;
//! `MAXC_LEAD=0` turns it off): its first worker, pinned to the other CPUs, helps.
//!
//! Where the threads share their CPUs (a sharing width of two, a leading width of one, a
//! pair), the executor runs its decode steps co-driven ([`drive`], `drive.rs`): every thread
//! walks the whole step, a split launch is one job all of them join, and a thread that finds a
//! chunk held by a descheduled one computes it itself after a short wait; so the step goes on
//! while any thread has a CPU. The scheduler runs such steps in a loop ([`drive_loop`]) whose
//! phases between steps any of the threads takes, so that the next step begins on whichever
//! has a CPU. A thread waiting for another yields its CPU only where the other last ran on the
//! same CPU ([`pause`]).
//! Where the executor cannot (a program of collectives), a leading helper takes chunks of
//! speculative jobs instead ([`run_speculative`], `spec.rs`), which the caller takes back
//! rather than waits for.

mod drive;
mod spec;
mod width;

pub use drive::{
    codriving, drive, drive_loop, drivers_idle, driving, enter_launch, in_body, leave, pause,
    step_number, Codriving, DriveFn,
};

pub use spec::{
    allow as allow_speculation, quiesce, run as run_speculative, speculating, speculation, Allow,
    Spec, SpecFn, Speculation, SPEC_INPUTS,
};

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use width::{run_delay_ns, Adapt, Place, WINDOW};

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

/// How long a caller spins for the last chunks of its job before it sleeps until they are done.
const WAIT_SPIN: Duration = Duration::from_micros(50);

type Job = dyn Fn(usize) + Sync;

/// The current job: its function (lifetime erased; called only by a thread that claimed one of
/// its chunks, which its caller waits for) or its speculative job (`spec.rs`), its epoch and
/// its chunk count.
#[derive(Clone, Copy)]
struct Current {
    job: Option<&'static Job>,
    spec: Option<Spec>,
    /// Whether it is a co-driven step (`drive.rs`), whose body is in [`Shared::drive`].
    drive: bool,
    epoch: u32,
    chunks: usize,
}

struct Shared {
    /// The width jobs are split to now (1 ..= the thread count; [`Adapt`]): worker `i` takes
    /// part while `i + 1 < width`, and sleeps on `widened` otherwise.
    width: AtomicUsize,
    /// Whether the current step splits across every thread whatever the width (a step of at
    /// least [`WHOLE_WIDTH_ROWS`] rows): every worker takes part while it is set.
    whole: std::sync::atomic::AtomicBool,
    /// Whether the width is a pair of threads pinned to one CPU (`width.rs`, Pairing).
    paired: std::sync::atomic::AtomicBool,
    /// Whether the first worker, beyond a width of one, helps with speculative jobs
    /// (`width.rs`, Leading; `spec.rs`).
    lead: std::sync::atomic::AtomicBool,
    /// Whether a width of two shares its CPUs with other processes and co-drives its steps
    /// (`width.rs`, Sharing).
    shared: std::sync::atomic::AtomicBool,
    /// Each chunk's state in speculative jobs (`spec.rs`).
    states: Box<[AtomicU64]>,
    widened: Condvar,
    /// Bumped for every job; sleeping and spinning workers look for a new one.
    epoch: AtomicU64,
    current: Mutex<Current>,
    /// The current job's epoch (high 32 bits) and next unclaimed chunk (low 32 bits): a chunk is
    /// claimed by a compare-and-swap that also checks the epoch, so a worker that wakes late
    /// never runs a finished job.
    claim: AtomicU64,
    /// Chunks of the current job finished.
    done: AtomicUsize,
    /// The first panic of the current job's chunks, for its caller to resume.
    panic: Mutex<Option<Panic>>,
    /// Sleeping workers wait here.
    sleep: Mutex<()>,
    wake: Condvar,
    /// A caller that waited too long for the last chunks sleeps here, the thread that finishes
    /// the last chunk waking it.
    finish: Mutex<()>,
    finished: Condvar,
    caller_asleep: std::sync::atomic::AtomicBool,
    /// Each worker's `/proc/<pid>/task/<tid>`, where the controller reads its waits.
    tasks: Mutex<Vec<Option<String>>>,
    /// The last co-driven step's number and body (`drive.rs`).
    drive: Mutex<Option<(u64, DriveFn)>>,
    /// Workers inside a co-driven step's body.
    driving: AtomicUsize,
    /// The co-driven job now: its key, claimed and done slots (`drive.rs`).
    co: AtomicU64,
}

struct Pool {
    shared: &'static Shared,
    workers: usize,
    /// Serializes callers.
    caller: Mutex<()>,
    /// The width's controller; `None` where it is off (`MAXC_ADAPT_THREADS=0`, or no
    /// `/proc/thread-self/schedstat` to read the threads' waits from).
    adapt: Option<Mutex<Adapt>>,
}

/// Threads set before the pool starts ([`set_threads`]); 0: not set.
static REQUESTED: AtomicUsize = AtomicUsize::new(0);

/// How the thread count was chosen.
static CHOICE: OnceLock<String> = OnceLock::new();

/// Uses `n` threads (the caller and `n - 1` workers). Takes effect only before the first job
/// (the pool starts then); returns whether it did.
pub fn set_threads(n: usize) -> bool {
    if n == 0 || POOL.get().is_some() {
        return false;
    }
    REQUESTED.store(n, Ordering::Relaxed);
    POOL.get().is_none()
}

/// The thread count and why (`--threads`, `MAXC_THREADS`, or the CPUs the process may use,
/// with the cgroup quota where one applies); starts the pool.
pub fn choice() -> String {
    pool();
    CHOICE.get().cloned().unwrap_or_default()
}

/// The CPU quota of this process's cgroup, in CPUs, where one is set: cgroup v2's `cpu.max`,
/// or v1's `cpu.cfs_quota_us` over `cpu.cfs_period_us`.
pub fn cgroup_quota() -> Option<f64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let read = |p: String| std::fs::read_to_string(p).ok();
    let ratio = |q: &str, p: &str| -> Option<f64> {
        let (q, p): (f64, f64) = (q.trim().parse().ok()?, p.trim().parse().ok()?);
        (q > 0.0 && p > 0.0).then(|| q / p)
    };
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?.trim_end());
        if controllers.is_empty() {
            if let Some(max) = read(format!("/sys/fs/cgroup{path}/cpu.max")) {
                let mut it = max.split_whitespace();
                if let (Some(q), Some(p)) = (it.next(), it.next()) {
                    return ratio(q, p);
                }
            }
        } else if controllers.split(',').any(|c| c == "cpu") {
            let dir = ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"]
                .into_iter()
                .find(|d| std::path::Path::new(&format!("{d}{path}")).is_dir())?;
            let q = read(format!("{dir}{path}/cpu.cfs_quota_us"))?;
            let p = read(format!("{dir}{path}/cpu.cfs_period_us"))?;
            return ratio(&q, &p);
        }
    }
    None
}

fn thread_count() -> (usize, String) {
    let requested = REQUESTED.load(Ordering::Relaxed);
    if requested > 0 {
        return (requested, format!("{requested} threads (--threads)"));
    }
    if let Some(n) = std::env::var("MAXC_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return (n, format!("{n} threads (MAXC_THREADS)"));
    }
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    let why = match cgroup_quota() {
        Some(q) => format!(
            "{n} threads (the CPUs this process may use: its affinity mask and its cgroup's \
             CPU quota of {q:.2} CPUs)"
        ),
        None => format!(
            "{n} threads (the CPUs this process may use: its affinity mask, no cgroup CPU quota)"
        ),
    };
    (n, why)
}

static POOL: OnceLock<Pool> = OnceLock::new();

fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let (threads, why) = thread_count();
        let adaptive = threads > 1
            && std::env::var("MAXC_ADAPT_THREADS").map_or(true, |v| v != "0")
            && run_delay_ns("/proc/thread-self/schedstat").is_some();
        let _ = CHOICE.set(if adaptive {
            format!(
                "{why}; fewer while other processes keep them waiting for a CPU \
                 (MAXC_ADAPT_THREADS=0: always all)"
            )
        } else {
            why
        });
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            width: AtomicUsize::new(threads),
            whole: std::sync::atomic::AtomicBool::new(false),
            paired: std::sync::atomic::AtomicBool::new(false),
            lead: std::sync::atomic::AtomicBool::new(false),
            shared: std::sync::atomic::AtomicBool::new(false),
            states: spec::states(),
            widened: Condvar::new(),
            epoch: AtomicU64::new(0),
            current: Mutex::new(Current {
                job: None,
                spec: None,
                drive: false,
                epoch: 0,
                chunks: 0,
            }),
            claim: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            finish: Mutex::new(()),
            finished: Condvar::new(),
            caller_asleep: std::sync::atomic::AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
            drive: Mutex::new(None),
            driving: AtomicUsize::new(0),
            co: drive::idle_word(),
        }));
        let mut workers = 0;
        for w in 0..threads - 1 {
            let spawned = std::thread::Builder::new()
                .name(format!("maxc-cpu-{}", w + 1))
                .spawn(move || worker(shared, w));
            if spawned.is_err() {
                // Fewer workers than asked for: the others' chunks are claimed by the rest.
                break;
            }
            workers += 1;
        }
        shared.width.store(workers + 1, Ordering::Release);
        Pool {
            shared,
            workers,
            caller: Mutex::new(()),
            adapt: (adaptive && workers > 0).then(|| Mutex::new(Adapt::new(workers + 1))),
        }
    })
}

/// Threads a job is split across now (the caller and the workers taking part): the thread
/// count, or fewer while other processes keep the threads waiting, except in a prefill-sized
/// step ([`between_steps`]). Read it once per job: it changes only in [`between_steps`].
pub fn threads() -> usize {
    let p = pool();
    if p.shared.whole.load(Ordering::Acquire) {
        p.workers + 1
    } else {
        p.shared.width.load(Ordering::Acquire)
    }
}

/// The width decode-sized steps split to now: the thread count, or fewer while other
/// processes keep the threads waiting (prefill-sized steps take every thread whatever it is).
pub fn width() -> usize {
    pool().shared.width.load(Ordering::Acquire)
}

/// The most threads a job is split across (the thread count chosen at start).
pub fn max_threads() -> usize {
    pool().workers + 1
}

/// A chunk's panic, carried to the caller of [`run`].
type Panic = Box<dyn std::any::Any + Send>;

/// Claims and runs chunks of the job `cur` until none is left. A panicking chunk still counts
/// as done (or its caller would wait forever); the job's first panic is kept for its caller.
fn claim_and_run(s: &Shared, cur: Current) {
    let Some(job) = cur.job else { return };
    loop {
        let c = s.claim.load(Ordering::Acquire);
        if (c >> 32) as u32 != cur.epoch || (c & 0xffff_ffff) as usize >= cur.chunks {
            return;
        }
        if s.claim
            .compare_exchange_weak(c, c + 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            continue;
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _in = InJob::enter();
            job((c & 0xffff_ffff) as usize)
        }));
        if let Err(p) = r {
            s.panic
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(p);
        }
        if s.done.fetch_add(1, Ordering::SeqCst) + 1 == cur.chunks
            && s.caller_asleep.load(Ordering::SeqCst)
        {
            let _g = s.finish.lock().unwrap_or_else(|e| e.into_inner());
            s.finished.notify_one();
        }
    }
}

fn worker(s: &'static Shared, index: usize) {
    drive::WORKER.with(|w| w.set(true));
    drive::SLOT.with(|w| w.set(index + 1));
    if let Ok(link) = std::fs::read_link("/proc/thread-self") {
        let mut paths = s.tasks.lock().unwrap_or_else(|e| e.into_inner());
        if paths.len() <= index {
            paths.resize(index + 1, None);
        }
        paths[index] = Some(format!("/proc/{}", link.display()));
    }
    // Taking part in every job at this width; the first worker also helps with speculative
    // jobs while the pool leads (`width.rs`, Leading).
    let in_width =
        || index + 1 < s.width.load(Ordering::Acquire) || s.whole.load(Ordering::Acquire);
    let active = || in_width() || (index == 0 && s.lead.load(Ordering::Acquire));
    let mut seen = 0u64;
    loop {
        if !active() {
            // Not taking part at this width: sleep until it widens, without spinning (the CPU
            // is what the narrower width leaves to others). Jobs published meanwhile are the
            // active threads' to run.
            let guard = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
            if !active() {
                let _guard = s
                    .widened
                    .wait_timeout(guard, Duration::from_millis(100))
                    .unwrap_or_else(|e| e.into_inner());
            }
            seen = s.epoch.load(Ordering::Acquire);
            continue;
        }
        let start = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                break Some(e);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && !(index == 0 && s.lead.load(Ordering::Relaxed)) {
                // Spinning politely: on an oversubscribed machine the thread this one waits for
                // may need the core. (Not a leading pool's helper: the caller it waits for is
                // on another CPU, and a yield would give its share of its own CPU away.)
                std::thread::yield_now();
            }
            if spins.is_multiple_of(1024) {
                if !active() {
                    break None;
                }
                if start.elapsed() > SPIN {
                    let guard = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
                    if s.epoch.load(Ordering::Acquire) == seen {
                        let _guard = s
                            .wake
                            .wait_timeout(guard, Duration::from_millis(100))
                            .unwrap_or_else(|e| e.into_inner());
                    }
                    continue;
                }
            }
            std::hint::spin_loop();
        };
        let Some(epoch) = epoch else { continue };
        seen = epoch;
        let cur = *s.current.lock().unwrap_or_else(|e| e.into_inner());
        match cur.spec {
            None if cur.drive && (in_width() || (index == 0 && s.lead.load(Ordering::Acquire))) => {
                drive::join(s)
            }
            Some(spec) => spec::help(s, cur, spec),
            None if in_width() => claim_and_run(s, cur),
            None => {}
        }
    }
}

/// Threads of this process's own one-off work (the weights' copy into huge pages behind the
/// first steps) running now.
static OWN_WORK: AtomicUsize = AtomicUsize::new(0);

/// Marks this process's own one-off work (the weights' copy behind the first steps) until
/// dropped: its thread's competition does not narrow the width. Measured on 2 cores, quiet
/// decode over the copy was faster at the whole width than narrowed to one thread.
pub struct OwnWork(());

/// Starts an [`OwnWork`].
pub fn own_work() -> OwnWork {
    OWN_WORK.fetch_add(1, Ordering::AcqRel);
    OwnWork(())
}

impl Drop for OwnWork {
    fn drop(&mut self) {
        OWN_WORK.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Steps of at least this many token rows (prefill) split across every thread, whatever the
/// width: their launches are long, split into many chunks ([`long_chunks`]) taken dynamically,
/// so a thread descheduled mid-launch holds up one small chunk while the others take the rest.
/// Measured on 2 cores beside two busy processes (SmolLM2 Q4_1, 8 × 128-token prefill): 3.8 s
/// on one thread, 3.1-3.5 s on two in one chunk each, 2.4-2.8 s on two in eight chunks each;
/// 1.2-1.6 s quiet either way.
pub const WHOLE_WIDTH_ROWS: usize = 32;

/// Chunks per thread of a launch made of long pieces (a prefill matmul's panels, its
/// attention's query blocks): enough that a descheduled thread's chunk is small.
const LONG_CHUNKS_PER_THREAD: usize = 8;

/// How many chunks a launch of `pieces` long pieces splits into on `threads` threads.
pub fn long_chunks(threads: usize, pieces: usize) -> usize {
    let per = if threads > 1 {
        LONG_CHUNKS_PER_THREAD
    } else {
        1
    };
    (threads.max(1) * per).min(pieces).max(1)
}

/// Called by an executor before each step of `rows` token rows (the only place the width
/// changes): judges the width once a window has passed ([`Adapt`]), and returns the threads
/// this step's jobs split across: the width, or every thread for a step of at least
/// [`WHOLE_WIDTH_ROWS`] rows.
pub fn between_steps(rows: usize) -> usize {
    let p = pool();
    let s = p.shared;
    // Judged on the caller's thread only (it reads and pins "this thread"): in a loop of
    // co-driven steps a worker begins some of the steps.
    let worker = drive::WORKER.with(|w| w.get());
    if let Some(adapt) = p.adapt.as_ref().filter(|_| !worker) {
        if let Ok(mut a) = adapt.try_lock() {
            let now = Instant::now();
            if a.lead && a.keep_lead(s, now) {
                tracing::debug!(cpu = a.lead_cpu, "CPU threads: the leading caller moved");
            }
            if now.duration_since(a.start) >= WINDOW {
                let width = s.width.load(Ordering::Acquire);
                let place = a.place();
                let mut next = a.judge(s, width, now, OWN_WORK.load(Ordering::Acquire) > 0);
                if a.place() != place {
                    let want = a.place();
                    let pinned = a.pin(s, want);
                    tracing::debug!(?want, pinned, "CPU threads: pinned");
                    if want != Place::Free && !pinned {
                        a.no_lead |= a.lead;
                        a.no_spread |= a.spread;
                        a.spread = false;
                        a.paired = false;
                        a.lead = false;
                        next = width;
                    }
                    let _g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
                    s.paired.store(a.paired, Ordering::Release);
                    s.lead.store(a.lead, Ordering::Release);
                    s.widened.notify_all();
                }
                if a.shared != s.shared.load(Ordering::Acquire) {
                    tracing::debug!(shared = a.shared, "CPU threads: co-driven steps");
                    s.shared.store(a.shared, Ordering::Release);
                }
                if next != width {
                    a.changes += 1;
                    let _g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
                    s.width.store(next, Ordering::Release);
                    s.widened.notify_all();
                    tracing::debug!(
                        from = width,
                        to = next,
                        had = a.had,
                        "CPU threads: the width jobs split to"
                    );
                }
            }
        }
    }
    let whole = rows >= WHOLE_WIDTH_ROWS && s.width.load(Ordering::Acquire) <= p.workers;
    if whole != s.whole.load(Ordering::Acquire) {
        let _g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
        s.whole.store(whole, Ordering::Release);
        s.widened.notify_all();
    }
    threads()
}

/// Whether the width is now a pair of threads pinned to one CPU: a width of one waited for its
/// CPU beside other processes, so two threads share that CPU instead (`width.rs`, Pairing).
pub fn paired() -> bool {
    pool().shared.paired.load(Ordering::Acquire)
}

/// Whether a width of two shares its CPUs with other processes: its steps run co-driven
/// (`width.rs`, Sharing).
pub fn shared() -> bool {
    pool().shared.shared.load(Ordering::Acquire)
}

/// Whether the pool leads: a width of one whose helper takes speculative chunks on the other
/// CPUs, which it shares with other processes (`width.rs`, Leading).
pub fn leading() -> bool {
    pool().shared.lead.load(Ordering::Acquire)
}

/// Whether the width follows the CPUs the threads get (more than one thread, Linux's
/// `schedstat` readable, `MAXC_ADAPT_THREADS` not `0`).
pub fn adapts() -> bool {
    pool().adapt.is_some()
}

/// How many times a leading caller moved to its helper's CPU since the pool started.
pub fn lead_moves() -> u64 {
    pool()
        .adapt
        .as_ref()
        .map_or(0, |a| a.lock().unwrap_or_else(|e| e.into_inner()).swaps)
}

/// How many times the width has changed since the pool started.
pub fn width_changes() -> u64 {
    pool()
        .adapt
        .as_ref()
        .map_or(0, |a| a.lock().unwrap_or_else(|e| e.into_inner()).changes)
}

/// Calls `f(0..chunks)` on the calling thread and the workers, each chunk once, and returns
/// when all are done; a chunk's panic is resumed on the calling thread.
pub fn run<'a>(chunks: usize, f: &'a (dyn Fn(usize) + Sync + 'a)) {
    let p = pool();
    if chunks <= 1 || p.workers == 0 || IN_JOB.with(|j| j.get()) {
        (0..chunks).for_each(f);
        return;
    }
    let s = p.shared;
    if let Some(key) = drive::next_key() {
        drive::run(s, key, chunks, f);
        return;
    }
    if drive::in_body() {
        // Outside a launch of a co-driven body (between a loop's steps): its own work.
        (0..chunks).for_each(f);
        return;
    }
    let _one = p.caller.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: only the lifetime is erased; a worker calls the job only after claiming one of
    // its chunks (a compare-and-swap that checks this job's epoch), and this call returns only
    // after every chunk is done, so no call outlives `f`.
    let job: &'static Job =
        unsafe { std::mem::transmute::<&'a (dyn Fn(usize) + Sync + 'a), &'static Job>(f) };
    let epoch = (s.epoch.load(Ordering::Acquire) + 1) as u32;
    let cur = Current {
        job: Some(job),
        spec: None,
        drive: false,
        epoch,
        chunks,
    };
    *s.current.lock().unwrap_or_else(|e| e.into_inner()) = cur;
    s.done.store(0, Ordering::Release);
    s.claim.store(u64::from(epoch) << 32, Ordering::Release);
    {
        let _g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
        s.epoch.fetch_add(1, Ordering::AcqRel);
    }
    s.wake.notify_all();
    /// Waits for every chunk: the job must outlive them. Then no new claim can succeed (all
    /// are taken) and the job is dropped.
    struct Wait(&'static Shared, usize);
    impl Drop for Wait {
        fn drop(&mut self) {
            let s = self.0;
            let start = Instant::now();
            let mut spins = 0u32;
            while s.done.load(Ordering::Acquire) < self.1 {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) && start.elapsed() > WAIT_SPIN {
                    // A chunk's thread is late (descheduled on a busy machine, perhaps on
                    // this very core): sleep until the last chunk's thread wakes this one.
                    let guard = s.finish.lock().unwrap_or_else(|e| e.into_inner());
                    s.caller_asleep.store(true, Ordering::SeqCst);
                    if s.done.load(Ordering::SeqCst) < self.1 {
                        let _ = s
                            .finished
                            .wait_timeout(guard, Duration::from_millis(1))
                            .unwrap_or_else(|e| e.into_inner());
                    }
                    s.caller_asleep.store(false, Ordering::SeqCst);
                    continue;
                }
                if spins.is_multiple_of(16) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            self.0.current.lock().unwrap_or_else(|e| e.into_inner()).job = None;
        }
    }
    let wait = Wait(s, chunks);
    claim_and_run(s, cur);
    drop(wait);
    let panic = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(p) = panic {
        std::panic::resume_unwind(p);
    }
}

/// Spins until `done()` says so, yielding the CPU every `every` looks (the thread waited for
/// may need this one's CPU).
pub fn spin_until(every: u32, done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(every) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
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
    fn long_launches_split_into_several_chunks_per_thread_but_never_more_than_their_pieces() {
        assert_eq!(long_chunks(1, 100), 1);
        assert_eq!(long_chunks(2, 100), 2 * LONG_CHUNKS_PER_THREAD);
        assert_eq!(long_chunks(2, 12), 12);
        assert_eq!(long_chunks(4, 0), 1);
        assert_eq!(long_chunks(0, 5), 1);
    }

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
    fn more_chunks_than_threads_are_shared_out_and_each_runs_once() {
        for chunks in [threads(), 3 * threads() + 1, 64] {
            let counts: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..200 {
                run(chunks, &|c| {
                    counts[c].fetch_add(1, Ordering::Relaxed);
                });
            }
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 200));
        }
    }

    #[test]
    fn while_one_chunk_stalls_the_other_threads_take_the_rest() {
        // The first chunk claimed stalls (a thread descheduled mid-chunk) until every other
        // chunk is done: with chunks handed out in a fixed share per thread, the stalled
        // thread's later chunks would wait behind it and this would time out.
        if threads() < 2 {
            return;
        }
        let done = AtomicUsize::new(0);
        let first = AtomicUsize::new(usize::MAX);
        let timed_out = AtomicUsize::new(0);
        run(16, &|c| {
            if first
                .compare_exchange(usize::MAX, c, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                let start = Instant::now();
                while done.load(Ordering::Acquire) < 15 {
                    if start.elapsed() > Duration::from_secs(20) {
                        timed_out.store(1, Ordering::Relaxed);
                        break;
                    }
                    std::thread::yield_now();
                }
            } else {
                done.fetch_add(1, Ordering::AcqRel);
            }
        });
        assert_eq!(
            timed_out.load(Ordering::Relaxed),
            0,
            "the other chunks waited"
        );
        assert_eq!(done.load(Ordering::Relaxed), 15);
    }

    #[test]
    fn a_panicking_chunk_reaches_the_caller_and_the_pool_goes_on() {
        // Whichever thread runs the panicking chunk, the caller sees the panic.
        for bad in 0..8 {
            let r = std::panic::catch_unwind(|| {
                run(8, &|c| {
                    if c == bad {
                        panic!("chunk {bad}");
                    }
                })
            });
            assert!(r.is_err(), "chunk {bad}'s panic");
        }
        let hits = AtomicUsize::new(0);
        run(8, &|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 8);
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
