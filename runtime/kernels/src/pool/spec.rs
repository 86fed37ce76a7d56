//! Speculative jobs: chunks a helper thread may take without the caller ever waiting on it.
//!
//! Beside one busy process on two CPUs the pool's caller has a CPU of its own and its second
//! thread (the helper) shares the other: it runs about half the time, in slices of a few
//! milliseconds. A plain job splits a launch between them and waits for both, so each time the
//! helper is descheduled holding a chunk the step stalls for the rest of the other process's
//! slice, and two threads decode no faster than one (`width.rs`). A speculative job cannot
//! stall that way:
//!
//! - Its chunks are columns of an output (`rows × n`, chunk `c` of `chunks` is columns
//!   `n·c/chunks .. n·(c+1)/chunks` of every row), and it is plain data ([`Spec`]): a function,
//!   the inputs' bytes, the output. The caller computes its chunks straight into the output.
//! - The helper first copies the inputs (the activations, which the caller overwrites once the
//!   job is done) into memory of its own, then claims chunks and computes each into scratch of
//!   its own. It marks a chunk claimed, and publishes it only if it can still mark it
//!   committing: then it copies the scratch into the output and marks it done.
//! - The caller, once every chunk is claimed, waits a little longer than its own chunks took;
//!   a helper chunk still neither committing nor done by then it marks stolen and computes
//!   itself. The helper's result for a stolen chunk is thrown away.
//!
//! So a helper descheduled mid-chunk costs the caller one chunk, not a time slice; and a helper
//! that comes back late only ever writes into its own memory. It reads the inputs only while
//! the job is running (it copies them before its first claim, which succeeds only while the
//! caller is still in the job), and the weights, which an executor keeps alive until no helper
//! is computing ([`quiesce`]).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{pool, Current, InJob, Shared, IN_JOB};

/// How many input regions a [`Spec`] copies for its helper.
pub const SPEC_INPUTS: usize = 2;

/// The most chunks a speculative job splits into.
pub(super) const MAX_CHUNKS: usize = 64;

/// A speculative job's chunk: see [`Spec::compute`].
pub type SpecFn = unsafe fn(&Spec, &[&[u8]; SPEC_INPUTS], &mut [f32], Range<usize>);

/// A speculative job: columns of `out[rows, n]`, computed by `compute` from `inputs` and
/// `data` (plain values: a kernel's address, the weights' address and length, …).
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    /// Computes columns `cols` of every output row into `out` (row `r`'s columns at `r·n`,
    /// from `cols.start`), reading `inputs` (the job's, or a helper's copy of them, with the
    /// same lengths and 8-byte aligned). It must only read `inputs` and memory that outlives
    /// every helper's chunk (see [`quiesce`]), and write only `out`.
    pub compute: SpecFn,
    /// The input regions (address, bytes) a helper copies; unused ones `(null, 0)`.
    pub inputs: [(*const u8, usize); SPEC_INPUTS],
    /// `compute`'s own values.
    pub data: [usize; 4],
    /// The output, `rows × n` values.
    pub out: *mut f32,
    pub rows: usize,
    pub n: usize,
}

// SAFETY: a Spec is read by the helper only while its caller keeps the pointers valid (the
// module's protocol above).
unsafe impl Send for Spec {}
unsafe impl Sync for Spec {}

impl Spec {
    /// Columns of chunk `c` of `chunks`.
    fn cols(&self, c: usize, chunks: usize) -> Range<usize> {
        self.n * c / chunks..self.n * (c + 1) / chunks
    }

    /// Values of `out` a chunk of `cols` spans (from its first column of row 0).
    fn span(&self, cols: &Range<usize>) -> usize {
        (self.rows - 1) * self.n + cols.len()
    }
}

/// A chunk's state word: the job's epoch (high 32 bits) and what became of the chunk. A word of
/// another epoch is a chunk nobody has marked in this job.
const CLAIMED: u64 = 1;
const COMMITTING: u64 = 2;
const DONE: u64 = 3;
const STOLEN: u64 = 4;

fn word(epoch: u32, state: u64) -> u64 {
    (u64::from(epoch) << 32) | state
}

/// Whether the word `w` was written in the job of `epoch` or a later one (epochs wrap).
fn since(w: u64, epoch: u32) -> bool {
    ((w >> 32) as u32).wrapping_sub(epoch) as i32 >= 0
}

/// Helpers inside a speculative job now (from before their first look at it until they leave
/// it): [`quiesce`] waits for none.
static SPECULATING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Whether this thread's matmuls may run as speculative jobs ([`allow`]).
    static ALLOWED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// A helper's copies of a job's inputs (8-byte words) and its chunk scratch.
    static COPIES: std::cell::RefCell<([Vec<u64>; SPEC_INPUTS], Vec<f32>)> =
        std::cell::RefCell::new(Default::default());
}

/// Lets this thread's matmuls run as speculative jobs while the pool has a helper, until
/// dropped. The caller promises that the memory its jobs' weights live in stays valid until
/// [`quiesce`] has returned (an executor calls it before it drops its weights).
pub struct Allow(bool);

/// Starts an [`Allow`].
pub fn allow() -> Allow {
    Allow(ALLOWED.with(|a| a.replace(true)))
}

impl Drop for Allow {
    fn drop(&mut self) {
        ALLOWED.with(|a| a.set(self.0));
    }
}

/// Whether a job of this thread would run speculatively now: the pool has a helper (`width.rs`,
/// Leading), this thread allows it ([`allow`]), and it is not inside a job.
pub fn speculating() -> bool {
    ALLOWED.with(|a| a.get())
        && !IN_JOB.with(|j| j.get())
        && !super::drive::driving()
        && pool().shared.lead.load(Ordering::Acquire)
}

/// Waits until no helper is inside a speculative job: after it, memory that finished jobs read
/// (their weights) may be freed.
pub fn quiesce() {
    super::spin_until(16, || SPECULATING.load(Ordering::SeqCst) == 0);
}

/// Runs `spec` in `chunks` chunks (at most 64) on the calling thread and, where the
/// pool has one, its helper; returns when every chunk's columns are in the output.
pub fn run(chunks: usize, spec: &Spec) {
    let p = pool();
    let chunks = chunks.clamp(1, MAX_CHUNKS);
    let direct = |c: usize| {
        let cols = spec.cols(c, chunks);
        // SAFETY: the output holds rows × n values; chunk c's columns of every row lie in
        // `span` values from its first column, which no other chunk writes.
        unsafe {
            let out = std::slice::from_raw_parts_mut(spec.out.add(cols.start), spec.span(&cols));
            (spec.compute)(spec, &inputs_of(spec), out, cols)
        }
    };
    if chunks == 1 || p.workers == 0 || IN_JOB.with(|j| j.get()) {
        (0..chunks).for_each(direct);
        return;
    }
    let _one = p.caller.lock().unwrap_or_else(|e| e.into_inner());
    let s = p.shared;
    JOBS.fetch_add(1, Ordering::Relaxed);
    CHUNKS.fetch_add(chunks, Ordering::Relaxed);
    let epoch = (s.epoch.load(Ordering::Acquire) + 1) as u32;
    *s.current.lock().unwrap_or_else(|e| e.into_inner()) = Current {
        job: None,
        spec: Some(*spec),
        drive: false,
        epoch,
        chunks,
    };
    s.done.store(0, Ordering::Release);
    s.claim.store(u64::from(epoch) << 32, Ordering::SeqCst);
    {
        let _g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
        s.epoch.fetch_add(1, Ordering::AcqRel);
    }
    s.wake.notify_all();
    // Whatever happens below (a chunk may panic), no helper chunk commits once this returns.
    let finish = Finish {
        s,
        epoch,
        chunks,
        mine: 0,
    };
    let mut finish = finish;
    let _in = InJob::enter();
    let mut took = Duration::ZERO;
    let mut own = 0u32;
    while let Some(c) = claim(s, epoch, chunks) {
        let t = Instant::now();
        direct(c);
        took += t.elapsed();
        own += 1;
        finish.mine |= 1 << c;
        s.done.fetch_add(1, Ordering::AcqRel);
    }
    // Every chunk is claimed. The helper's should end about when the caller's did: a chunk
    // later than twice the caller's own is the helper's that was descheduled.
    let patience = (took / own.max(1) * 2).max(Duration::from_micros(10));
    let start = Instant::now();
    let mut spins = 0u32;
    while s.done.load(Ordering::Acquire) < chunks {
        if start.elapsed() >= patience {
            for c in 0..chunks {
                if finish.mine & (1 << c) == 0 && steal(s, epoch, c) {
                    finish.mine |= 1 << c;
                    TAKEN_BACK.fetch_add(1, Ordering::Relaxed);
                    direct(c);
                    s.done.fetch_add(1, Ordering::AcqRel);
                }
            }
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) {
            // A helper committing (a copy of a few hundred bytes) was descheduled.
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    drop(finish);
}

/// Claims the next chunk of the job of `epoch`, where one is left.
fn claim(s: &Shared, epoch: u32, chunks: usize) -> Option<usize> {
    loop {
        let c = s.claim.load(Ordering::SeqCst);
        if (c >> 32) as u32 != epoch || (c & 0xffff_ffff) as usize >= chunks {
            return None;
        }
        if s.claim
            .compare_exchange_weak(c, c + 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            return Some((c & 0xffff_ffff) as usize);
        }
    }
}

/// Marks the helper's chunk `c` stolen, where it has not begun committing; returns whether it
/// did (the caller must then compute it).
fn steal(s: &Shared, epoch: u32, c: usize) -> bool {
    let state = &s.states[c];
    loop {
        let w = state.load(Ordering::SeqCst);
        if w >> 32 == u64::from(epoch) && w & 0xffff_ffff != CLAIMED {
            // Committing, done, or already stolen.
            return false;
        }
        if state
            .compare_exchange(w, word(epoch, STOLEN), Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            return true;
        }
    }
}

/// Ends a caller's speculative job (also when a chunk panics): no chunk is left to claim, every
/// helper chunk not yet committing is stolen (and, when unwinding, left undone), and those
/// committing are waited for.
struct Finish {
    s: &'static Shared,
    epoch: u32,
    chunks: usize,
    /// The chunks the caller computed (or stole).
    mine: u64,
}

impl Drop for Finish {
    fn drop(&mut self) {
        let s = self.s;
        s.claim.store(
            (u64::from(self.epoch) << 32) | self.chunks as u64,
            Ordering::SeqCst,
        );
        for c in 0..self.chunks {
            if self.mine & (1 << c) != 0 || steal(s, self.epoch, c) {
                continue;
            }
            while s.states[c].load(Ordering::SeqCst) == word(self.epoch, COMMITTING) {
                std::thread::yield_now();
            }
        }
        s.current.lock().unwrap_or_else(|e| e.into_inner()).spec = None;
    }
}

/// The job's own inputs, as byte slices.
fn inputs_of(spec: &Spec) -> [&[u8]; SPEC_INPUTS] {
    std::array::from_fn(|i| match spec.inputs[i] {
        (p, len) if !p.is_null() && len > 0 => {
            // SAFETY: the caller of `run` gives inputs valid for the job.
            unsafe { std::slice::from_raw_parts(p, len) }
        }
        _ => &[][..],
    })
}

/// A helper's part in the speculative job `cur`: copies the inputs, then claims, computes and
/// commits chunks until none is left.
pub(super) fn help(s: &Shared, cur: Current, spec: Spec) {
    struct Inside;
    impl Drop for Inside {
        fn drop(&mut self) {
            SPECULATING.fetch_sub(1, Ordering::SeqCst);
        }
    }
    SPECULATING.fetch_add(1, Ordering::SeqCst);
    let _inside = Inside;
    // Only while the job still has chunks to claim: its caller is in it, so its inputs are
    // whole (and `quiesce`, which waits for this helper now, is not freeing its weights).
    let unclaimed = |s: &Shared| {
        let c = s.claim.load(Ordering::SeqCst);
        (c >> 32) as u32 == cur.epoch && ((c & 0xffff_ffff) as usize) < cur.chunks
    };
    if !unclaimed(s) {
        return;
    }
    COPIES.with(|copies| {
        let (copies, scratch) = &mut *copies.borrow_mut();
        for (i, &(p, len)) in spec.inputs.iter().enumerate() {
            let words = len.div_ceil(8);
            if copies[i].len() < words {
                copies[i].resize(words, 0);
            }
            if len > 0 && !p.is_null() {
                // SAFETY: the job's input of `len` bytes; the caller may overwrite it once the
                // job is done, and then no claim below succeeds and the copy is never used.
                // (Volatile: the bytes may change under the copy.)
                let dst = copies[i].as_mut_ptr().cast::<u8>();
                let words = if p.cast::<u32>().is_aligned() {
                    len / 4
                } else {
                    0
                };
                for w in 0..words {
                    unsafe {
                        dst.cast::<u32>()
                            .add(w)
                            .write(p.cast::<u32>().add(w).read_volatile())
                    };
                }
                for b in words * 4..len {
                    unsafe { dst.add(b).write(p.add(b).read_volatile()) };
                }
            }
        }
        let inputs: [&[u8]; SPEC_INPUTS] = std::array::from_fn(|i| {
            // SAFETY: `words` 8-byte words hold at least `len` bytes.
            unsafe { std::slice::from_raw_parts(copies[i].as_ptr().cast::<u8>(), spec.inputs[i].1) }
        });
        while let Some(c) = claim(s, cur.epoch, cur.chunks) {
            let state = &s.states[c];
            // Mark it claimed, unless the caller stole it already. (A word of a later job means
            // this thread is late for this one: its caller stole every chunk it did not get
            // back, as the job ended. So a late helper never marks a chunk, and never commits.)
            let marked = loop {
                let w = state.load(Ordering::SeqCst);
                if since(w, cur.epoch) {
                    break false;
                }
                if state
                    .compare_exchange(
                        w,
                        word(cur.epoch, CLAIMED),
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    )
                    .is_ok()
                {
                    break true;
                }
            };
            if !marked {
                continue;
            }
            let cols = spec.cols(c, cur.chunks);
            let span = spec.span(&cols);
            if scratch.len() < span {
                scratch.resize(span, 0.0);
            }
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _in = InJob::enter();
                // SAFETY: the inputs are this thread's copies; `compute` writes `span` values.
                unsafe { (spec.compute)(&spec, &inputs, &mut scratch[..span], cols.clone()) }
            }))
            .is_ok();
            // A panicking chunk stays claimed: the caller steals it and runs it itself.
            if !ok
                || state
                    .compare_exchange(
                        word(cur.epoch, CLAIMED),
                        word(cur.epoch, COMMITTING),
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    )
                    .is_err()
            {
                continue;
            }
            for r in 0..spec.rows {
                let from = &scratch[r * spec.n..r * spec.n + cols.len()];
                // SAFETY: the caller waits while the chunk is committing; row r's columns of
                // this chunk are its alone.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        from.as_ptr(),
                        spec.out.add(r * spec.n + cols.start),
                        cols.len(),
                    )
                };
            }
            state.store(word(cur.epoch, DONE), Ordering::SeqCst);
            s.done.fetch_add(1, Ordering::AcqRel);
            COMMITTED.fetch_add(1, Ordering::Relaxed);
        }
    });
}

/// Speculative jobs split since the pool started, their chunks, the helper's chunks committed,
/// and the chunks the caller took back.
static JOBS: AtomicUsize = AtomicUsize::new(0);
static CHUNKS: AtomicUsize = AtomicUsize::new(0);
static COMMITTED: AtomicUsize = AtomicUsize::new(0);
static TAKEN_BACK: AtomicUsize = AtomicUsize::new(0);

/// What the speculative jobs came to since the pool started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Speculation {
    /// Jobs split (between the caller and a helper).
    pub jobs: usize,
    /// Their chunks.
    pub chunks: usize,
    /// Chunks the helper computed and committed.
    pub helped: usize,
    /// Chunks the helper claimed that the caller took back (and computed).
    pub taken_back: usize,
}

/// The speculative jobs' counts so far.
pub fn speculation() -> Speculation {
    Speculation {
        jobs: JOBS.load(Ordering::Relaxed),
        chunks: CHUNKS.load(Ordering::Relaxed),
        helped: COMMITTED.load(Ordering::Relaxed),
        taken_back: TAKEN_BACK.load(Ordering::Relaxed),
    }
}

/// The state words of a pool's chunks.
pub(super) fn states() -> Box<[AtomicU64]> {
    (0..MAX_CHUNKS).map(|_| AtomicU64::new(0)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Column `j` of row `r` of the test jobs' output: the input's value at `j` times `r + 1`.
    fn expected(x: &[f32], r: usize, j: usize) -> f32 {
        x[j % x.len()] * (r + 1) as f32
    }

    fn on_a_worker() -> bool {
        std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("maxc-cpu"))
    }

    /// Writes [`expected`] from `inputs[0]` (f32); on a worker, with `data[0]` set, first
    /// sleeps `data[0]` ms (a helper descheduled mid-chunk) and then writes -1 instead, which
    /// must never reach the output.
    unsafe fn columns(
        spec: &Spec,
        inputs: &[&[u8]; SPEC_INPUTS],
        out: &mut [f32],
        cols: Range<usize>,
    ) {
        // SAFETY: the test's inputs are f32.
        let x = unsafe {
            std::slice::from_raw_parts(inputs[0].as_ptr().cast::<f32>(), inputs[0].len() / 4)
        };
        let late = spec.data[0] > 0 && on_a_worker();
        if late {
            std::thread::sleep(Duration::from_millis(spec.data[0] as u64));
        }
        if spec.data[1] > 0 && cols.start == spec.n * 3 / 8 {
            panic!("chunk 3");
        }
        for r in 0..spec.rows {
            for j in cols.clone() {
                out[r * spec.n + j - cols.start] = if late { -1.0 } else { expected(x, r, j) };
            }
        }
    }

    fn job(
        x: &[f32],
        out: &mut [f32],
        rows: usize,
        n: usize,
        sleep_ms: usize,
        panic: bool,
    ) -> Spec {
        assert!(out.len() >= rows * n);
        Spec {
            compute: columns,
            inputs: [(x.as_ptr().cast(), x.len() * 4), (std::ptr::null(), 0)],
            data: [sleep_ms, usize::from(panic), 0, 0],
            out: out.as_mut_ptr(),
            rows,
            n,
        }
    }

    #[test]
    fn a_speculative_job_fills_every_column_of_every_row_whoever_computes_it() {
        let x: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        for (rows, n, chunks) in [
            (1, 1000, 8),
            (3, 517, 5),
            (2, 9, 8),
            (1, 64, 1),
            (4, 100, 64),
        ] {
            for round in 0..200 {
                let mut out = vec![f32::NAN; rows * n];
                run(chunks, &job(&x, &mut out, rows, n, 0, false));
                for r in 0..rows {
                    for j in 0..n {
                        assert_eq!(
                            out[r * n + j],
                            expected(&x, r, j),
                            "rows {rows}, n {n}, {chunks} chunks, round {round}: row {r} column {j}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_helper_descheduled_mid_chunk_is_taken_back_and_its_late_result_never_lands() {
        if pool().workers == 0 {
            return;
        }
        let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let (rows, n) = (2, 800);
        let before = speculation().taken_back;
        let start = Instant::now();
        // Until a helper has claimed a chunk (and slept in it), which a worker spinning for
        // jobs does within a few tries.
        while speculation().taken_back == before && start.elapsed() < Duration::from_secs(20) {
            let mut out = vec![f32::NAN; rows * n];
            run(8, &job(&x, &mut out, rows, n, 30, false));
            let check = |out: &[f32], when: &str| {
                for r in 0..rows {
                    for j in 0..n {
                        assert_eq!(
                            out[r * n + j],
                            expected(&x, r, j),
                            "{when}: row {r} column {j}"
                        );
                    }
                }
            };
            check(&out, "when the job returned");
            // The late helper finishes its chunk after this; its commit must be refused.
            quiesce();
            check(&out, "after the late helper finished");
        }
        assert!(
            speculation().taken_back > before,
            "no helper claimed a chunk in 20 s (threads: {})",
            super::super::threads()
        );
    }

    #[test]
    fn a_panicking_chunk_reaches_the_caller_and_the_pool_goes_on() {
        let x = vec![1.0f32; 8];
        for _ in 0..20 {
            let mut out = vec![0.0f32; 64];
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run(8, &job(&x, &mut out, 1, 64, 0, true))
            }));
            assert!(r.is_err(), "chunk 3's panic");
        }
        let mut out = vec![0.0f32; 64];
        run(8, &job(&x, &mut out, 1, 64, 0, false));
        assert!(out.iter().all(|&v| v == 1.0));
    }

    #[test]
    fn a_state_word_of_a_later_job_is_never_taken_for_this_ones() {
        assert!(since(word(7, CLAIMED), 7));
        assert!(since(word(8, STOLEN), 7));
        assert!(!since(word(6, DONE), 7));
        assert!(!since(0, 1));
        // Across the wrap of the 32-bit epoch.
        assert!(since(word(2, DONE), u32::MAX));
        assert!(!since(word(u32::MAX, DONE), 2));
    }
}
