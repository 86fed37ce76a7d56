//! The pool's width: how many of its threads a job is split across now. It follows the CPUs the
//! threads actually get ([`Adapt`]), judged between steps ([`super::between_steps`]).

use std::time::{Duration, Instant};

use super::Shared;

/// How long a thread has waited for a CPU while runnable, in nanoseconds: the second field of
/// its `schedstat` (Linux's run delay).
pub(super) fn run_delay_ns(path: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

/// How often the width is judged: the threads' waits over at least this long.
pub(super) const WINDOW: Duration = Duration::from_millis(25);
/// How long a narrowed width watches its CPUs' idle time before it widens (`/proc/stat`
/// counts in hundredths of a second).
const IDLE_WINDOW: Duration = Duration::from_millis(60);
/// Where the CPUs' idle time cannot be read: the first wait before a narrowed width is probed
/// at the whole width again, doubled after each probe that fails, up to [`PROBE_MAX`].
const PROBE_MIN: Duration = Duration::from_millis(100);
const PROBE_MAX: Duration = Duration::from_secs(1);
/// A width of one whose thread had less than this share of a CPU over two windows in a row
/// (or less than [`PAIR_AT_ONCE`] over one) shares its CPU with other processes: its pool pairs
/// two threads on that CPU instead.
const PAIR_BELOW: f64 = 0.8;
const PAIR_AT_ONCE: f64 = 0.6;
/// A width of one whose thread had at least this share of its CPU while no CPU stood idle
/// leads: its helper takes speculative chunks from the other CPUs. A helper that had this much
/// of a CPU has one of its own again: the pool widens.
const LEAD_ABOVE: f64 = 0.9;
/// A sharing width whose threads had at least this many CPUs fewer than the width over a
/// window has its CPUs again: its steps stop being co-driven.
const SHARED_QUIET: f64 = 0.25;
/// Windows in a row that a sharing width must see fewer other runnable tasks than its CPUs
/// before it spreads its threads apart, and as many or more before it stops.
const SPREAD_VOTES: i32 = 2;
/// A leading caller that waited for its CPU for more than this share of the time since the
/// last step moves to its helper's CPU ([`Adapt::keep_lead`]).
const SWAP_ABOVE: f64 = 0.25;

/// Where the pool's pinned threads are ([`Adapt::pin`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Place {
    /// Not pinned.
    Free,
    /// The caller and the first worker on the caller's CPU.
    Pair,
    /// The caller on its CPU, the first worker on the others (leading, or a sharing width
    /// spread apart).
    Lead,
}

/// The width's controller.
///
/// - **Narrowing.** Over a window of steps it sums how long the active threads waited for a
///   CPU while runnable (Linux's run delay, `/proc/…/schedstat`): `width − waited / wall` is
///   how many CPUs they actually had, and when two windows in a row say so the width becomes
///   that, rounded (never below 1; the larger of the two). On 2 cores with one busy process beside 2 threads that is about 1.1-1.3, so 1 thread runs
///   the steps on a core of its own; with two busy processes about 1.0. Idle time is not
///   waiting, so an idle server keeps its width.
/// - **Widening.** A narrowed width cannot see a CPU come free in its own waits (its sleeping
///   workers do not wait), so it watches the idle time of the CPUs this process may run on
///   (`/proc/stat`, the affinity mask of `/proc/self/status`): idle CPUs, rounded, join the
///   width. Where that cannot be read, it probes instead: one window at the whole width after
///   [`PROBE_MIN`], kept where the threads then get their CPUs, the wait doubling after each
///   failed probe.
/// - **Sharing.** Where the width would narrow to one (its threads had about one CPU or less
///   between them), a width of two stays and its decode steps run co-driven instead
///   (`drive.rs`: both threads walk each step, either begins the next, neither waits for the
///   other while it is descheduled). Both threads stay runnable and unpinned, so the process
///   has its fair share of the CPUs (two threads' worth) wherever the scheduler puts them. It
///   ends when the threads have their CPUs again (at most [`SHARED_QUIET`] of a CPU short of
///   the width), or where a window ran steps but none co-driven (the executor cannot: the
///   width narrows as below). Pinned threads fight the balancer: a pair pinned to a CPU that a
///   busy process keeps gets two thirds of one CPU at most (the README has the measurements).
///   `MAXC_CODRIVE=0` turns it off.
/// - **Spreading.** Unpinned, the two threads of a sharing width sometimes sit on one CPU
///   while the other processes have another to themselves: beside one busy process on 2
///   cores the balancer then sees two tasks against one and moves nothing, and the steps have
///   one CPU where one and a half are theirs to have (each run's speed followed how long its
///   threads sat together). So where fewer other tasks are runnable than this process has CPUs
///   (`/proc/loadavg`, over [`SPREAD_VOTES`] windows in a row), a sharing width pins its caller
///   to its CPU and its worker to the others (as leading does): one thread has a CPU of its
///   own, the other shares one. Where as many or more are (two busy processes on 2 cores),
///   the threads stay unpinned: pinned apart, each would share a CPU with a busy process and
///   wait for the other's time slices, slower than the two together on one CPU, which the
///   balancer allows there. `MAXC_SPREAD=0` turns it off.
/// - **Pairing.** A width of one whose thread still waits for its CPU (it had less than
///   [`PAIR_BELOW`] of one over two windows: more busy processes than the other CPUs hold) gets
///   a second thread on its own CPU (at once where it had less than [`PAIR_AT_ONCE`]): both
///   are pinned there ([`Adapt::pin`]), so the kernel's balancer
///   moves the other processes to the other CPUs and the pair's share of its CPU is two
///   threads' (the fair share of a process of two threads), while a step never waits for a
///   thread on another CPU. On 2 cores beside two busy processes one thread had a core or half
///   of one as the scheduler placed it: each run's decode 38-51% of quiet over three runs of
///   `bench-contention.sh`, and 47-59% over four paired. The pair ends, and the threads spread
///   out again, when a CPU stands idle; a width of one pairs only once an idle window has shown
///   none standing idle.
/// - **Leading.** A width of one whose thread has its CPU (at least [`LEAD_ABOVE`] of it) while
///   no CPU stands idle runs beside busy processes on the other CPUs, which its second thread
///   would share. That thread becomes a helper: the caller is pinned to its CPU, the helper to
///   the others, and the executor runs its decode steps co-driven by both (`drive.rs`: each
///   walks the step, a chunk the helper holds when it is descheduled the caller computes
///   itself), or, where it cannot, runs the block matmuls as speculative jobs (`spec.rs`). It
///   ends, unpinned, when the caller waits for its CPU (less than [`PAIR_BELOW`] of it: the
///   width of one judges again, and may pair), or when the helper has a CPU of its own again
///   (the width widens). `MAXC_LEAD=0` turns it off.
///
///   With speculative matmuls alone it gained nothing beyond the noise (medians of 101.9 and
///   104.4 tokens/s leading against 95.6 and 104.5 not, SmolLM2 Q4_1 beside one busy process):
///   the rest of the step ran on the caller, and the helper's part was at most the block
///   matmuls. Co-driven, beside one busy process started afresh before each run (2-core Intel
///   guest, 64 greedy tokens): 134-172 tokens/s over 17 runs against 125-149 over 6 for the
///   width of one (quiet: about 238 on two threads, 137 on one).
pub(super) struct Adapt {
    max: usize,
    /// The window's start, and the waits then: the caller's (by its thread) and the workers'.
    pub(super) start: Instant,
    caller: Option<(String, u64)>,
    workers: Vec<Option<u64>>,
    /// The CPUs this process may run on, and their idle ticks when the idle window started.
    cpus: Option<Vec<usize>>,
    idle: Option<(Instant, u64)>,
    /// The width the last window found fitting, where it was narrower: a width narrows only
    /// when two windows in a row say so, so a blip (kernel threads after a large allocation)
    /// does not cost the steps a narrowed stretch.
    narrower: Option<usize>,
    /// This window probes the whole width.
    probing: bool,
    next_probe: Instant,
    backoff: Duration,
    /// Whether the width is a pair of threads pinned to one CPU (see Pairing above).
    pub(super) paired: bool,
    /// The windows in a row in which a width of one had less than [`PAIR_BELOW`] of a CPU.
    pair_votes: u32,
    /// Whether a width of one leads, its helper on the other CPUs (see Leading above).
    pub(super) lead: bool,
    /// Whether a width of two co-drives its steps (see Sharing above).
    pub(super) shared: bool,
    /// Whether the pool never shares (`MAXC_CODRIVE=0`).
    no_share: bool,
    /// Whether a sharing width has its threads pinned apart (see Spreading above).
    pub(super) spread: bool,
    /// Windows in a row for spreading (positive) or against it (negative).
    spread_votes: i32,
    /// Whether the pool never spreads (`MAXC_SPREAD=0`, or pinning failed).
    pub(super) no_spread: bool,
    /// Co-driven steps when the window started.
    steps: usize,
    /// Whether the pool never leads: leading is off (`MAXC_LEAD=0`), or it failed to
    /// pin its threads (it is not tried again).
    pub(super) no_lead: bool,
    /// The helper's wait when the window started, while leading.
    helper: Option<u64>,
    /// The share of its CPU the thread that waited least had over the last window, and the CPU
    /// it last ran on: where a width of one leads from.
    least: Option<(f64, Option<usize>)>,
    /// The CPU a leading caller is pinned to.
    pub(super) lead_cpu: Option<usize>,
    /// The caller's wait at the last step, while leading ([`Adapt::keep_lead`]).
    step_wait: Option<(Instant, u64)>,
    /// How often a leading caller moved to its helper's CPU.
    pub(super) swaps: u64,
    /// The paired threads and the CPUs they may run on when not paired.
    #[cfg(target_os = "linux")]
    saved: Vec<(libc::pid_t, libc::cpu_set_t)>,
    /// The widths chosen, for [`width_changes`].
    pub(super) changes: u64,
    /// The CPUs the threads had over the last window judged.
    pub(super) had: f64,
}

/// The CPUs of a `Cpus_allowed_list` line's value (`0-3,8,10-11`), sorted.
fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (usize, usize) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    (!cpus.is_empty()).then_some(cpus)
}

/// The CPUs in this process's affinity mask (`Cpus_allowed_list` of `/proc/self/status`).
fn allowed_cpus() -> Option<Vec<usize>> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_cpu_list(
        status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?,
    )
}

/// The idle and iowait ticks (hundredths of a second) of `cpus` (sorted), summed, from the text
/// of `/proc/stat`; `None` unless every one of them is listed.
fn idle_ticks_in(stat: &str, cpus: &[usize]) -> Option<u64> {
    let mut total = 0u64;
    let mut found = 0;
    for line in stat.lines() {
        let Some(rest) = line.strip_prefix("cpu") else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let Some(Ok(cpu)) = fields.next().map(str::parse::<usize>) else {
            continue;
        };
        if cpus.binary_search(&cpu).is_ok() {
            let v: Vec<u64> = fields.take(5).filter_map(|f| f.parse().ok()).collect();
            total += v.get(3)? + v.get(4)?;
            found += 1;
        }
    }
    (found == cpus.len()).then_some(total)
}

fn idle_ticks(cpus: &[usize]) -> Option<u64> {
    idle_ticks_in(&std::fs::read_to_string("/proc/stat").ok()?, cpus)
}

/// Tasks runnable on the whole system now: the numerator of `/proc/loadavg`'s fourth field
/// (`0.52 0.58 0.59 3/467 12345`).
fn runnable_tasks() -> Option<usize> {
    runnable_in(&std::fs::read_to_string("/proc/loadavg").ok()?)
}

fn runnable_in(loadavg: &str) -> Option<usize> {
    loadavg
        .split_whitespace()
        .nth(3)?
        .split_once('/')?
        .0
        .parse()
        .ok()
}

/// The CPU a thread last ran on: field 39 of its `stat`, counted after the parenthesized name
/// (which may hold spaces).
fn last_cpu(stat_path: &str) -> Option<usize> {
    last_cpu_in(&std::fs::read_to_string(stat_path).ok()?)
}

fn last_cpu_in(stat: &str) -> Option<usize> {
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(36)?
        .parse()
        .ok()
}

/// What a narrowed pool knows of its CPUs' idle time.
#[derive(Clone, Copy, Debug)]
enum Idle {
    /// It cannot be read: probe instead.
    Unknown,
    /// The idle window is not long enough yet.
    Pending,
    /// Idle CPUs over the idle window that just ended.
    Cpus(f64),
}

impl Adapt {
    pub(super) fn new(max: usize) -> Self {
        let cpus = allowed_cpus().filter(|c| idle_ticks(c).is_some());
        Adapt {
            max,
            start: Instant::now(),
            caller: None,
            workers: Vec::new(),
            cpus,
            idle: None,
            narrower: None,
            probing: false,
            next_probe: Instant::now(),
            backoff: PROBE_MIN,
            paired: false,
            pair_votes: 0,
            lead: false,
            no_lead: std::env::var("MAXC_LEAD").is_ok_and(|v| v == "0"),
            shared: false,
            no_share: std::env::var("MAXC_CODRIVE").is_ok_and(|v| v == "0"),
            spread: false,
            spread_votes: 0,
            no_spread: std::env::var("MAXC_SPREAD").is_ok_and(|v| v == "0"),
            steps: 0,
            helper: None,
            least: None,
            lead_cpu: None,
            step_wait: None,
            swaps: 0,
            #[cfg(target_os = "linux")]
            saved: Vec::new(),
            changes: 0,
            had: max as f64,
        }
    }

    /// The active workers' task folders (`None` for one not yet registered).
    fn worker_tasks(s: &Shared, width: usize) -> Vec<Option<String>> {
        let tasks = s.tasks.lock().unwrap_or_else(|e| e.into_inner());
        (0..width.saturating_sub(1))
            .map(|i| tasks.get(i).cloned().flatten())
            .collect()
    }

    /// The active workers' waits now (`None` for one not yet registered).
    fn worker_waits(s: &Shared, width: usize) -> Vec<Option<u64>> {
        Self::worker_tasks(s, width)
            .into_iter()
            .map(|t| t.and_then(|t| run_delay_ns(&format!("{t}/schedstat"))))
            .collect()
    }

    /// Whether the active threads (this one and the workers) last ran on one CPU: then they
    /// take turns on it, and their waits are each other's, not other processes'. (On 2 cores
    /// beside two busy processes, the scheduler sometimes puts both threads on one core and
    /// both busy processes on the other: the steps then have a core to themselves, 93-98
    /// tokens/s against 66-70 for one thread that shares a core.)
    fn sharing_one_cpu(s: &Shared, width: usize) -> bool {
        let Some(mine) = last_cpu("/proc/thread-self/stat") else {
            return false;
        };
        let tasks = Self::worker_tasks(s, width);
        !tasks.is_empty()
            && tasks.iter().all(|t| {
                t.as_ref()
                    .and_then(|t| last_cpu(&format!("{t}/stat")))
                    .is_some_and(|c| c == mine)
            })
    }

    /// Where the pinned threads should be: nowhere in particular, a pair on one CPU, or the
    /// caller leading on its CPU with its helper on the others.
    pub(super) fn place(&self) -> Place {
        if self.paired {
            Place::Pair
        } else if self.lead || self.spread {
            Place::Lead
        } else {
            Place::Free
        }
    }

    /// Pins the calling thread to the CPU it last ran on and the first worker to that CPU too
    /// ([`Place::Pair`]) or to the other CPUs it may run on ([`Place::Lead`]); or gives the
    /// pinned threads back the CPUs they had ([`Place::Free`]). Returns whether it could (where
    /// it cannot, nothing stays pinned).
    #[cfg(target_os = "linux")]
    pub(super) fn pin(&mut self, s: &Shared, place: Place) -> bool {
        const SIZE: usize = std::mem::size_of::<libc::cpu_set_t>();
        for (tid, mask) in self.saved.drain(..) {
            // SAFETY: a cpu_set_t of SIZE bytes, read by the call.
            unsafe { libc::sched_setaffinity(tid, SIZE, &mask) };
        }
        if place == Place::Free {
            return true;
        }
        let tid = |task: &str| task.rsplit('/').next()?.parse::<libc::pid_t>().ok();
        let me = std::fs::read_link("/proc/thread-self")
            .ok()
            .and_then(|l| tid(&l.display().to_string()));
        let worker = Self::worker_tasks(s, 2)
            .into_iter()
            .next()
            .flatten()
            .and_then(|t| tid(&t));
        let cpu = match place {
            Place::Lead if self.lead => {
                self.lead_cpu.or_else(|| last_cpu("/proc/thread-self/stat"))
            }
            _ => last_cpu("/proc/thread-self/stat"),
        };
        let (Some(cpu), Some(me), Some(worker)) = (cpu, me, worker) else {
            return false;
        };
        for t in [me, worker] {
            // SAFETY: cpu_set_t is plain bits; CPU_SET / CPU_CLR write one of them (they check
            // the bound); the calls read and write SIZE bytes of the sets given.
            let mut mask: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            if unsafe { libc::sched_getaffinity(t, SIZE, &mut mask) } != 0 {
                return !self.pin(s, Place::Free);
            }
            let mut to = mask;
            if t == me || place == Place::Pair {
                to = unsafe { std::mem::zeroed() };
                unsafe { libc::CPU_SET(cpu, &mut to) };
            } else {
                unsafe { libc::CPU_CLR(cpu, &mut to) };
                if unsafe { libc::CPU_COUNT(&to) } == 0 {
                    return !self.pin(s, Place::Free);
                }
            }
            if unsafe { libc::sched_setaffinity(t, SIZE, &to) } != 0 {
                return !self.pin(s, Place::Free);
            }
            self.saved.push((t, mask));
        }
        true
    }

    /// Pinning needs Linux's affinity calls: elsewhere nothing is pinned.
    #[cfg(not(target_os = "linux"))]
    pub(super) fn pin(&mut self, _: &Shared, place: Place) -> bool {
        place == Place::Free
    }

    /// The idle CPUs (of this process's) since the idle window began, once it is long enough.
    fn read_idle(&mut self, now: Instant) -> Idle {
        let Some(ticks) = self.cpus.as_deref().and_then(idle_ticks) else {
            return Idle::Unknown;
        };
        let Some((t0, i0)) = self.idle else {
            self.idle = Some((now, ticks));
            return Idle::Pending;
        };
        let wall = now.duration_since(t0);
        if wall < IDLE_WINDOW {
            return Idle::Pending;
        }
        self.idle = Some((now, ticks));
        Idle::Cpus(ticks.saturating_sub(i0) as f64 / 100.0 / wall.as_secs_f64())
    }

    /// Judges the window that ends now, on the calling thread; returns the new width.
    /// While `own_work` runs, waits do not narrow the width ([`super::OwnWork`]).
    pub(super) fn judge(
        &mut self,
        s: &Shared,
        width: usize,
        now: Instant,
        own_work: bool,
    ) -> usize {
        let wall = now.duration_since(self.start).as_nanos().max(1) as f64;
        let me = std::fs::read_link("/proc/thread-self")
            .ok()
            .map(|l| l.display().to_string());
        let mine = run_delay_ns("/proc/thread-self/schedstat");
        let mut waited = 0u64;
        // The thread that waited least (`None`: this one, else the worker's index), and how
        // long: where it had its CPU while the others waited, a width of one may lead from
        // that CPU.
        let mut least: Option<(u64, Option<usize>)> = None;
        if let (Some((tid0, d0)), Some(tid), Some(d)) = (&self.caller, &me, mine) {
            if tid0 == tid {
                let w = d.saturating_sub(*d0);
                waited += w;
                least = Some((w, None));
            }
        }
        for (i, w) in Self::worker_waits(s, width).into_iter().enumerate() {
            if let (Some(w), Some(Some(w0))) = (w, self.workers.get(i)) {
                let w = w.saturating_sub(*w0);
                waited += w;
                if least.is_none_or(|(l, _)| w < l) {
                    least = Some((w, Some(i)));
                }
            }
        }
        // Its CPU, read only where the pool may lead.
        self.least = least.filter(|_| !self.no_lead).map(|(w, thread)| {
            let cpu = match thread {
                None => last_cpu("/proc/thread-self/stat"),
                Some(i) => Self::worker_tasks(s, width)
                    .get(i)
                    .cloned()
                    .flatten()
                    .and_then(|t| last_cpu(&format!("{t}/stat"))),
            };
            (1.0 - w as f64 / wall, cpu)
        });
        // Other tasks runnable now, where known (our threads are: they spin between launches).
        let others = runnable_tasks().map(|n| n.saturating_sub(width));
        // Threads on one CPU while the other processes fill the others have a CPU to
        // themselves: their waits are each other's. (Co-driven threads on one CPU wait for
        // each other's time slices, as for others'; and beside fewer other tasks than CPUs,
        // one of them could have a CPU of its own: see Spreading above.)
        let stacked =
            !self.shared && others.is_none_or(|o| o >= self.max) && Self::sharing_one_cpu(s, width);
        let had = if own_work || stacked {
            width as f64
        } else {
            width as f64 - waited as f64 / wall
        };
        let helper_wait = if self.no_lead {
            None
        } else {
            Self::worker_waits(s, 2).into_iter().next().flatten()
        };
        if self.lead {
            let helper_had = match (self.helper, helper_wait) {
                (Some(w0), Some(w)) => 1.0 - w.saturating_sub(w0) as f64 / wall,
                _ => 0.0,
            };
            let next = self.decide_lead(had, helper_had);
            tracing::trace!(
                width,
                had,
                helper_had,
                next,
                "CPU threads: a leading window judged"
            );
            self.start = now;
            self.caller = me.zip(mine);
            self.workers = Self::worker_waits(s, next);
            self.helper = helper_wait;
            return next;
        }
        let idle = if (width < self.max || self.paired) && !self.probing {
            self.read_idle(now)
        } else {
            Idle::Pending
        };
        let steps = super::drive::STEPS.load(std::sync::atomic::Ordering::Relaxed);
        let codriven = steps != self.steps;
        self.steps = steps;
        let next = if self.shared {
            self.decide_shared(width, had, codriven, others)
        } else {
            let next = self.decide(width, had, idle, now);
            if self.shared {
                // (Just began sharing: this window votes too.)
                self.vote_spread(others);
            }
            next
        };
        tracing::trace!(width, had, ?idle, next, "CPU threads: a window judged");
        // The next window starts now, with the waits of the threads active in it.
        self.start = now;
        self.caller = me.zip(mine);
        self.workers = Self::worker_waits(s, next);
        self.helper = helper_wait;
        next
    }

    /// The width after a window at `width` sharing its CPUs, in which the threads had `had`
    /// CPUs, `codriven` says whether steps ran co-driven, and `others` other tasks were
    /// runnable at its end (where known); whether the threads spread apart ([`Adapt::spread`]).
    fn decide_shared(
        &mut self,
        width: usize,
        had: f64,
        codriven: bool,
        others: Option<usize>,
    ) -> usize {
        self.had = had;
        if !codriven {
            // The executor does not co-drive its steps: one thread runs them.
            self.shared = false;
            self.spread = false;
            self.narrower = None;
            return 1;
        }
        if had >= width as f64 - SHARED_QUIET {
            self.shared = false;
            self.spread = false;
            self.narrower = None;
            return width;
        }
        self.vote_spread(others);
        width
    }

    /// A sharing window's vote on spreading its threads apart, `others` other tasks runnable
    /// at its end (where known).
    fn vote_spread(&mut self, others: Option<usize>) {
        self.spread_votes = match others {
            Some(o) if o < self.max => self.spread_votes.max(0) + 1,
            Some(_) => self.spread_votes.min(0) - 1,
            None => 0,
        };
        if self.no_spread || others.is_none() {
            self.spread = false;
        } else if self.spread_votes >= SPREAD_VOTES {
            self.spread = true;
        } else if self.spread_votes <= -SPREAD_VOTES {
            self.spread = false;
        }
    }

    /// The width after a leading window in which the caller had `had` of its CPU and the
    /// helper `helper_had` of one: 1 while leading holds; 1, not leading, where the caller
    /// waited for its CPU; the whole width where the helper had a CPU of its own.
    fn decide_lead(&mut self, had: f64, helper_had: f64) -> usize {
        self.had = had;
        if had < PAIR_BELOW && helper_had < PAIR_BELOW {
            // Both wait: busy processes on every CPU.
            self.lead = false;
            self.idle = None;
        } else if had >= LEAD_ABOVE && helper_had >= LEAD_ABOVE {
            // Both had a CPU: the busy process is gone.
            self.lead = false;
            self.idle = None;
            return self.max;
        }
        // (A caller that waited beside a helper that did not: the balancer moved the busy
        // process onto the caller's CPU, and `keep_lead` moved the caller.)
        1
    }

    /// Between the steps of a leading pool: where the caller waited for its CPU for more than
    /// [`SWAP_ABOVE`] of the time since the last step, the balancer has moved a busy process
    /// onto it (with the threads pinned, the busy process is the only task it can move, and it
    /// moves it now and then): the caller moves to the helper's CPU and the helper to the
    /// others. Returns whether it did.
    pub(super) fn keep_lead(&mut self, s: &Shared, now: Instant) -> bool {
        let d = run_delay_ns("/proc/thread-self/schedstat");
        let before = self.step_wait.replace((now, d.unwrap_or(0)));
        let (Some((t0, d0)), Some(d)) = (before, d) else {
            return false;
        };
        let wall = now.duration_since(t0).as_nanos() as f64;
        if wall < 1e6 || (d.saturating_sub(d0) as f64) < SWAP_ABOVE * wall {
            return false;
        }
        let helper = Self::worker_tasks(s, 2).into_iter().next().flatten();
        let Some(cpu) = helper.and_then(|t| last_cpu(&format!("{t}/stat"))) else {
            return false;
        };
        if Some(cpu) == self.lead_cpu {
            return false;
        }
        self.lead_cpu = Some(cpu);
        self.swaps += 1;
        self.pin(s, Place::Lead)
    }

    /// The width after a window at `width` in which the threads had `had` CPUs (and, narrowed,
    /// saw `idle`).
    fn decide(&mut self, width: usize, had: f64, idle: Idle, now: Instant) -> usize {
        self.had = had;
        if self.paired {
            // Paired on one CPU (whose threads wait for each other, not for others): spread out
            // again once a CPU stands idle.
            if let Idle::Cpus(cpus) = idle {
                if cpus >= 0.5 {
                    self.paired = false;
                    self.idle = None;
                    return (width + cpus.round() as usize).min(self.max);
                }
            }
            return width;
        }
        if width == 1 && self.max >= 2 {
            self.pair_votes = if had < PAIR_BELOW {
                self.pair_votes + 1
            } else {
                0
            };
            // Only once an idle window has shown no CPU standing idle: where one does, the
            // thread's wait is the balancer's placement, and widening (below) is right.
            let none_idle = matches!(idle, Idle::Cpus(cpus) if cpus < 0.5);
            if none_idle && (self.pair_votes >= 2 || had < PAIR_AT_ONCE) {
                self.pair_votes = 0;
                self.paired = true;
                self.idle = None;
                return 2;
            }
            if none_idle && had >= LEAD_ABOVE && !self.no_lead {
                self.lead = true;
                self.step_wait = None;
                self.lead_cpu = self.least.and_then(|(_, cpu)| cpu);
                self.idle = None;
                return 1;
            }
        }
        let fits = (had.round().max(1.0) as usize).min(self.max);
        let next = if self.probing {
            self.probing = false;
            if fits >= width {
                self.backoff = PROBE_MIN;
                width
            } else {
                self.backoff = (self.backoff * 2).min(PROBE_MAX);
                self.next_probe = now + self.backoff;
                fits
            }
        } else if fits < width {
            match self.narrower.replace(fits) {
                Some(before) => {
                    self.next_probe = now + self.backoff;
                    let next = fits.max(before);
                    if next == 1 && !self.no_share {
                        // Two co-driving threads rather than one (Sharing above).
                        self.shared = true;
                        self.spread_votes = 0;
                        self.narrower = None;
                        return width.min(2);
                    }
                    // One thread had its CPU while the others waited: busy processes hold the
                    // other CPUs, and the width of one leads from that thread's CPU.
                    if let (1, Some((least, cpu))) = (next, self.least) {
                        if least >= LEAD_ABOVE && !self.no_lead {
                            self.lead = true;
                            self.step_wait = None;
                            self.lead_cpu = cpu;
                        }
                    }
                    next
                }
                None => width,
            }
        } else if width < self.max {
            match idle {
                Idle::Cpus(cpus) => (width + cpus.round() as usize).min(self.max),
                Idle::Unknown if now >= self.next_probe => {
                    self.probing = true;
                    self.max
                }
                Idle::Unknown | Idle::Pending => width,
            }
        } else {
            width
        };
        if next != width || fits >= width {
            self.narrower = None;
        }
        if next != width {
            // A new width starts a new idle window.
            self.idle = None;
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A controller that narrows (not sharing: `MAXC_CODRIVE=0`, or an executor that cannot
    /// co-drive its steps).
    fn narrowing(max: usize) -> Adapt {
        let mut a = Adapt::new(max);
        a.no_share = true;
        a
    }

    #[test]
    fn a_width_that_would_narrow_to_one_shares_its_cpus_while_its_steps_run_co_driven() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut a = Adapt::new(2);
        a.no_share = false;
        // Two busy processes beside two threads (about one CPU between them), two windows in a
        // row: the width stays two, sharing.
        assert_eq!(a.decide(2, 1.0, Idle::Pending, ms(0)), 2);
        assert!(!a.shared);
        assert_eq!(a.decide(2, 0.9, Idle::Pending, ms(25)), 2);
        assert!(a.shared && !a.lead && !a.paired);
        // Sharing holds while the steps run co-driven and the threads wait for their CPUs
        // (one busy process: about one and a half CPUs).
        assert_eq!(a.decide_shared(2, 1.0, true, Some(2)), 2);
        assert_eq!(a.decide_shared(2, 1.5, true, Some(2)), 2);
        assert!(a.shared && !a.spread);
        // The threads have their CPUs again: plain steps at the whole width.
        assert_eq!(a.decide_shared(2, 1.9, true, Some(2)), 2);
        assert!(!a.shared);
        // A window of steps none of which ran co-driven: the executor cannot, and one thread
        // runs them (and may pair or lead from there).
        a.decide(2, 1.0, Idle::Pending, ms(100));
        assert_eq!(a.decide(2, 1.0, Idle::Pending, ms(125)), 2);
        assert!(a.shared);
        assert_eq!(a.decide_shared(2, 1.0, false, Some(2)), 1);
        assert!(!a.shared);
        // Many cores: narrowing to more than one thread narrows as before.
        let mut a = Adapt::new(16);
        a.no_share = false;
        a.decide(16, 13.2, Idle::Pending, ms(0));
        assert_eq!(a.decide(16, 13.4, Idle::Pending, ms(25)), 13);
        assert!(!a.shared);
    }

    #[test]
    fn a_sharing_width_spreads_apart_while_fewer_others_than_its_cpus_run() {
        let mut a = Adapt::new(2);
        a.no_share = false;
        a.no_spread = false;
        a.shared = true;
        // One busy process beside the two threads (on one CPU between them): one window is
        // not enough, two in a row are.
        assert_eq!(a.decide_shared(2, 1.0, true, Some(1)), 2);
        assert!(!a.spread);
        assert_eq!(a.decide_shared(2, 1.0, true, Some(1)), 2);
        assert!(a.spread && a.shared);
        assert_eq!(a.place(), Place::Lead);
        // Apart they have one and a half CPUs: still sharing, still spread; a window with a
        // passing task does not end it, two in a row with a second busy process do.
        a.decide_shared(2, 1.5, true, Some(1));
        a.decide_shared(2, 1.5, true, Some(2));
        assert!(a.spread);
        a.decide_shared(2, 1.5, true, Some(1));
        a.decide_shared(2, 1.0, true, Some(2));
        assert!(a.spread);
        a.decide_shared(2, 1.0, true, Some(3));
        assert!(!a.spread && a.shared);
        assert_eq!(a.place(), Place::Free);
        // Two busy processes throughout: never spread.
        for _ in 0..4 {
            a.decide_shared(2, 1.0, true, Some(2));
        }
        assert!(!a.spread);
        // Spread, then the busy process goes: plain steps, unpinned.
        a.decide_shared(2, 1.0, true, Some(1));
        a.decide_shared(2, 1.0, true, Some(1));
        assert!(a.spread);
        a.decide_shared(2, 1.9, true, Some(0));
        assert!(!a.shared && !a.spread);
        assert_eq!(a.place(), Place::Free);
        // Unknown counts, or spreading off: never spread.
        a.shared = true;
        for _ in 0..3 {
            a.decide_shared(2, 1.0, true, None);
        }
        assert!(!a.spread);
        a.no_spread = true;
        for _ in 0..3 {
            a.decide_shared(2, 1.0, true, Some(1));
        }
        assert!(!a.spread);
        assert_eq!(runnable_in("0.52 0.58 0.59 3/467 12345\n"), Some(3));
        assert_eq!(runnable_in("0.52 0.58"), None);
    }

    #[test]
    fn cpu_lists_and_idle_ticks_are_read_as_linux_writes_them() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("0-x"), None);
        let stat = "cpu  100 0 50 9000 10 0 0 0 0 0\n\
                    cpu0 50 0 25 4000 5 0 0 0 0 0\n\
                    cpu1 50 0 25 5000 5 0 0 0 0 0\n\
                    intr 12345 0 0\n";
        assert_eq!(idle_ticks_in(stat, &[0, 1]), Some(9010));
        assert_eq!(idle_ticks_in(stat, &[1]), Some(5005));
        // A CPU of the mask missing from the text: unknown, not zero.
        assert_eq!(idle_ticks_in(stat, &[1, 2]), None);
        // A thread's last CPU, its name holding spaces and a parenthesis.
        let fields: Vec<String> = (3..=52)
            .map(|f| if f == 39 { "7".into() } else { f.to_string() })
            .collect();
        let line = format!("4242 (maxc cpu) 1) {}", fields.join(" "));
        assert_eq!(last_cpu_in(&line), Some(7));
        assert_eq!(last_cpu_in("4242 (maxc) R 1"), None);
        let me = last_cpu("/proc/thread-self/stat");
        assert!(me.is_none_or(|c| c < 4096), "{me:?}");
    }

    #[test]
    fn the_width_follows_the_cpus_the_threads_had() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut a = narrowing(2);
        // Quiet: the threads had their two CPUs.
        assert_eq!(a.decide(2, 1.97, Idle::Pending, ms(0)), 2);
        // One busy process beside them (each thread waits a third or more): one thread, once
        // two windows say so; a blip of one window does not narrow.
        assert_eq!(a.decide(2, 1.1, Idle::Pending, ms(25)), 2);
        assert_eq!(a.decide(2, 1.95, Idle::Pending, ms(50)), 2);
        assert_eq!(a.decide(2, 1.1, Idle::Pending, ms(75)), 2);
        assert_eq!(a.decide(2, 1.2, Idle::Pending, ms(100)), 1);
        // Narrowed: no idle CPU, or too little, keeps it; a free CPU widens it.
        assert_eq!(a.decide(1, 1.0, Idle::Pending, ms(125)), 1);
        assert_eq!(a.decide(1, 1.0, Idle::Cpus(0.3), ms(150)), 1);
        assert_eq!(a.decide(1, 1.0, Idle::Cpus(0.9), ms(250)), 2);
        // Waiting even at width 1 never goes below 1.
        assert_eq!(a.decide(2, 0.4, Idle::Pending, ms(275)), 2);
        assert_eq!(a.decide(2, 0.4, Idle::Pending, ms(300)), 1);
        // (A width of one that waits that long for its CPU, no CPU idle, becomes a pair: see
        // below.)
        assert_eq!(a.decide(1, -0.2, Idle::Cpus(0.0), ms(375)), 2);
        assert!(a.paired);
        // Many cores, one busy process: all but one.
        let mut a = narrowing(16);
        assert_eq!(a.decide(16, 13.2, Idle::Pending, ms(0)), 16);
        assert_eq!(a.decide(16, 15.06, Idle::Pending, ms(25)), 15);
        assert_eq!(a.decide(15, 15.0, Idle::Cpus(1.0), ms(100)), 16);
    }

    #[test]
    fn a_width_of_one_that_waits_for_its_cpu_becomes_a_pair_until_a_cpu_stands_idle() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut a = narrowing(2);
        // (Not leading, which a width of one with its CPU does: see the next test.)
        a.no_lead = true;
        // One busy process beside one thread: it has its CPU, and stays alone.
        for i in 0..4 {
            assert_eq!(a.decide(1, 0.97, Idle::Cpus(0.0), ms(25 * i)), 1);
        }
        assert!(!a.paired);
        // Two: it shares its CPU. One window below PAIR_BELOW is a blip; two pair it, once an
        // idle window has shown no CPU standing idle.
        assert_eq!(a.decide(1, 0.7, Idle::Cpus(0.0), ms(100)), 1);
        assert_eq!(a.decide(1, 0.95, Idle::Cpus(0.0), ms(125)), 1);
        assert_eq!(a.decide(1, 0.7, Idle::Pending, ms(150)), 1);
        assert_eq!(a.decide(1, 0.75, Idle::Pending, ms(175)), 1);
        assert!(!a.paired);
        assert_eq!(a.decide(1, 0.75, Idle::Cpus(0.1), ms(200)), 2);
        assert!(a.paired);
        // Paired, the threads wait for each other (had: the width): it holds while no CPU
        // stands idle, and ends, spreading out, once one does.
        assert_eq!(a.decide(2, 2.0, Idle::Pending, ms(200)), 2);
        assert_eq!(a.decide(2, 1.0, Idle::Cpus(0.1), ms(300)), 2);
        assert!(a.paired);
        assert_eq!(a.decide(2, 2.0, Idle::Cpus(0.9), ms(400)), 2);
        assert!(!a.paired);
        // Half a CPU in one window pairs at once, unless a CPU stands idle: then it widens.
        let mut a = narrowing(2);
        assert_eq!(a.decide(1, 0.5, Idle::Cpus(0.8), ms(0)), 2);
        assert!(!a.paired);
        let mut a = narrowing(2);
        assert_eq!(a.decide(1, 0.5, Idle::Pending, ms(0)), 1);
        assert_eq!(a.decide(1, 0.5, Idle::Cpus(0.0), ms(75)), 2);
        assert!(a.paired);
        // Without the CPUs' idle times (nothing would end the pair) it never pairs (it probes
        // the whole width instead, as below).
        let mut a = narrowing(2);
        for i in 0..4 {
            a.decide(1, 0.4, Idle::Unknown, ms(25 * i));
            assert!(!a.paired);
        }
        // Many cores: a pair on one CPU that widens to every idle CPU when they come free.
        let mut a = narrowing(16);
        assert_eq!(a.decide(1, 0.5, Idle::Cpus(0.2), ms(0)), 2);
        assert_eq!(a.decide(2, 2.0, Idle::Cpus(3.2), ms(100)), 5);
        assert!(!a.paired);
    }

    #[test]
    fn a_width_of_one_with_its_cpu_leads_until_both_threads_have_one_or_neither_has() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        // Narrowing from two threads, one of which had its CPU (on CPU 1) while the other
        // waited: one busy process beside them, and the width of one leads from CPU 1.
        let mut a = narrowing(2);
        a.no_lead = false;
        a.least = Some((0.97, Some(1)));
        assert_eq!(a.decide(2, 1.2, Idle::Pending, ms(0)), 2);
        assert_eq!(a.decide(2, 1.1, Idle::Pending, ms(25)), 1);
        assert!(a.lead && !a.paired);
        assert_eq!(a.lead_cpu, Some(1));
        // Leading: it holds while the caller has its CPU and the helper half of one, and while
        // the caller waits beside a helper that does not (the balancer moved the busy process
        // onto the caller's CPU, and the caller moves: `keep_lead`).
        assert_eq!(a.decide_lead(0.99, 0.5), 1);
        assert_eq!(a.decide_lead(0.4, 0.95), 1);
        assert!(a.lead);
        // Both wait: busy processes on both CPUs; a width of one again (which may pair).
        assert_eq!(a.decide_lead(0.5, 0.5), 1);
        assert!(!a.lead);
        // Narrowing where every thread waited (two busy processes): no lead.
        let mut a = narrowing(2);
        a.no_lead = false;
        a.least = Some((0.6, Some(0)));
        a.decide(2, 1.0, Idle::Pending, ms(0));
        assert_eq!(a.decide(2, 1.0, Idle::Pending, ms(25)), 1);
        assert!(!a.lead);
        // A width of one with its CPU while no CPU stands idle leads; with one idle it widens.
        assert_eq!(a.decide(1, 0.97, Idle::Pending, ms(50)), 1);
        assert!(!a.lead);
        assert_eq!(a.decide(1, 0.97, Idle::Cpus(0.1), ms(125)), 1);
        assert!(a.lead);
        // Both had a CPU: the busy process ended, and the whole width comes back.
        assert_eq!(a.decide_lead(0.98, 0.96), 2);
        assert!(!a.lead);
        let mut a = narrowing(2);
        a.no_lead = false;
        assert_eq!(a.decide(1, 0.97, Idle::Cpus(0.8), ms(0)), 2);
        assert!(!a.lead);
        // Never where leading is off (`MAXC_LEAD=0`, or where pinning failed).
        let mut a = narrowing(2);
        a.no_lead = true;
        a.least = Some((1.0, Some(0)));
        a.decide(2, 1.2, Idle::Pending, ms(0));
        assert_eq!(a.decide(2, 1.2, Idle::Pending, ms(25)), 1);
        assert_eq!(a.decide(1, 1.0, Idle::Cpus(0.0), ms(100)), 1);
        assert!(!a.lead);
    }

    #[test]
    fn without_idle_times_a_narrowed_width_probes_and_backs_off() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut a = narrowing(2);
        assert_eq!(a.decide(2, 1.0, Idle::Unknown, ms(0)), 2);
        assert_eq!(a.decide(2, 1.0, Idle::Unknown, ms(0)), 1);
        // No probe before PROBE_MIN.
        assert_eq!(a.decide(1, 1.0, Idle::Unknown, ms(50)), 1);
        assert_eq!(a.decide(1, 1.0, Idle::Unknown, ms(100)), 2);
        // The probe fails (still contended): back to 1, the next probe twice as far.
        assert_eq!(a.decide(2, 1.05, Idle::Pending, ms(125)), 1);
        assert_eq!(a.decide(1, 1.0, Idle::Unknown, ms(300)), 1);
        assert_eq!(a.decide(1, 1.0, Idle::Unknown, ms(325)), 2);
        // This probe holds: the width stays, and the next narrowing probes after PROBE_MIN.
        assert_eq!(a.decide(2, 1.9, Idle::Pending, ms(350)), 2);
        assert_eq!(a.decide(2, 1.2, Idle::Unknown, ms(375)), 2);
        assert_eq!(a.decide(2, 1.2, Idle::Unknown, ms(375)), 1);
        assert_eq!(a.decide(1, 1.0, Idle::Unknown, ms(475)), 2);
    }
}
