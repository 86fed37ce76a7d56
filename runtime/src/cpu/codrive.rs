//! Co-driven decode steps (`maxc_kernels::pool::drive`): the caller and the pool's helper (or
//! its pair) each walk the step's launches, so the step goes on while either has a CPU.
//!
//! The pool's contract for co-driven jobs (a chunk may be computed twice: by a thread that took
//! it over from a descheduled holder, and late by the holder) needs memory that a late write
//! cannot harm. [`Codrive`] gives it: two sets of the program's arena buffers (and step inputs),
//! each buffer its own bytes, sized for the steps' rows; step `s` runs on set `s % 2`, and step
//! `s + 2` begins only once no thread is inside step `s`. Within a step no buffer's bytes are
//! reused, so a late write stores what is already there, provided the kernel writes each
//! output value once, from its inputs alone. The launches shared between the threads are those
//! whose kernels do, as audited: the library's matmuls on block and half-float weights (their
//! register tiles store each output once, after the whole `k`), its attention (each head's
//! result stored once from its own accumulators; its split over long contexts, whose partial
//! results are per-call memory, is off in a co-driven step) and its elementwise rows. Every
//! other launch (generated code, the KV cache's stores, f32 GEMMs, which accumulate into their
//! output across blocks of `k`, a bias added in place, a gather scaled in place, MoE) is
//! *exclusive*: the first driver to reach it computes it alone, and the others wait for it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::schema::{KernelBody, Program, StepDim, Storage};

/// Whether a program can run co-driven at all: no collective launches (they run in lockstep
/// with other ranks) and no expert ranks.
pub(super) fn possible(program: &Program) -> bool {
    !program.kernels.iter().any(|k| {
        matches!(
            k.body,
            KernelBody::AllReduce { .. }
                | KernelBody::AllGather { .. }
                | KernelBody::RankExperts { .. }
        )
    })
}

/// A co-driven step, shared by its drivers.
pub(super) struct StepState {
    pub exec: *const super::CpuExecutor,
    /// Its number among co-driven steps (`maxc_kernels::pool::enter_launch`), given under the
    /// pool's caller lock: by `pool::drive` to its body, or `pool::step_number` inside a loop.
    pub drive: AtomicU64,
    pub ptrs: Vec<*mut u8>,
    pub dims: [u64; StepDim::COUNT],
    pub threads: usize,
    pub exclusive: Arc<[bool]>,
    /// Launches done (every launch below it).
    pub progress: AtomicUsize,
    /// One past the last exclusive launch a driver has claimed.
    pub claimed: AtomicUsize,
    /// Drivers inside the step.
    pub inside: AtomicUsize,
    /// The first error or panic a launch gave (the step then ends: every driver leaves it).
    pub failed: Mutex<Option<Failure>>,
}

/// How a co-driven step's launch failed.
pub(super) enum Failure {
    Error(crate::error::RuntimeError),
    Panic(Box<dyn std::any::Any + Send>),
}

// SAFETY: the pointers are the executor's and its buffers', which outlive every driver of the
// step (the executor waits for them, `pool::drivers_idle`, before it frees or changes them).
unsafe impl Send for StepState {}
unsafe impl Sync for StepState {}

impl StepState {
    /// Waits until no driver is inside this step.
    fn wait_empty(&self) {
        maxc_kernels::pool::spin_until(16, || self.inside.load(Ordering::Acquire) == 0);
    }
}

/// The most rows of a co-driven step: decode-sized steps (prefill-sized ones split across every
/// thread in many chunks, `pool::WHOLE_WIDTH_ROWS`).
pub(super) const MAX_ROWS: u64 = maxc_kernels::pool::WHOLE_WIDTH_ROWS as u64 - 1;

/// The two sets of arena buffers, each buffer its own bytes, for steps of up to `rows` rows.
struct Sets {
    rows: u64,
    arenas: [super::executor::Aligned; 2],
    /// Each arena buffer's offset in a set.
    offsets: BTreeMap<u32, u64>,
}

impl Sets {
    fn new(program: &Program, bounds: &[u64; StepDim::COUNT], rows: u64) -> Option<Self> {
        let mut dims = *bounds;
        dims[StepDim::TotalSeqLen as usize] = rows;
        dims[StepDim::LogitRows as usize] = dims[StepDim::LogitRows as usize].min(rows);
        let mut offsets = BTreeMap::new();
        let mut total = 0u64;
        for (id, b) in program.buffers.iter().enumerate() {
            if !matches!(b.storage, Storage::Arena { .. }) {
                continue;
            }
            let n = b.elements_at(&dims);
            offsets.insert(id as u32, total);
            total += b.dtype.bytes_for(n)?.next_multiple_of(64);
        }
        let what = "co-driven steps' buffers";
        Some(Sets {
            rows,
            arenas: [
                super::executor::Aligned::zeroed(total, what).ok()?,
                super::executor::Aligned::zeroed(total, what).ok()?,
            ],
            offsets,
        })
    }
}

/// What co-driven steps run on: two sets of buffers and step inputs (made at the first
/// co-driven step, for its rows, and remade larger for a step of more), and which launches run
/// on one thread.
pub(super) struct Codrive {
    sets: Option<Sets>,
    tokens: [Vec<i64>; 2],
    ints: [BTreeMap<String, Vec<i32>>; 2],
    /// Steps run co-driven.
    step: u64,
    /// The last step run on each set.
    last: [Option<Arc<StepState>>; 2],
}

impl Codrive {
    /// Co-driven steps of `program`, where it can run them (see [`possible`]).
    pub fn new(
        program: &Program,
        tokens: &[i64],
        ints: &BTreeMap<String, Vec<i32>>,
    ) -> Option<Self> {
        possible(program).then(|| Codrive {
            sets: None,
            tokens: [tokens.to_vec(), tokens.to_vec()],
            ints: [ints.clone(), ints.clone()],
            step: 0,
            last: [None, None],
        })
    }

    /// Readies the sets for a step at `dims` (within the program's `bounds`): `false` where
    /// the step is too large to run co-driven or the memory cannot be had.
    pub fn ready(
        &mut self,
        program: &Program,
        bounds: &[u64; StepDim::COUNT],
        dims: &[u64; StepDim::COUNT],
    ) -> bool {
        let rows = dims[StepDim::TotalSeqLen as usize].max(dims[StepDim::LogitRows as usize]);
        if rows > MAX_ROWS {
            return false;
        }
        if self.sets.as_ref().is_some_and(|s| s.rows >= rows) {
            return true;
        }
        // Larger sets: no thread may still be in a step on the old ones.
        for last in self.last.iter_mut() {
            if let Some(old) = last.take() {
                old.wait_empty();
            }
        }
        let rows = rows
            .next_power_of_two()
            .min(MAX_ROWS)
            .min(bounds[StepDim::TotalSeqLen as usize])
            .max(rows);
        self.sets = None;
        self.sets = Sets::new(program, bounds, rows);
        self.sets.is_some()
    }

    /// Moves `ptrs`' arena buffers and inputs to the next step's set, once no thread is inside
    /// the step that last ran on it, and fills its inputs from `tokens` and `ints`; returns the
    /// set. [`Codrive::ready`] must have said yes.
    pub fn next_set(
        &mut self,
        program: &Program,
        ptrs: &mut [*mut u8],
        tokens: &[i64],
        ints: &BTreeMap<String, Vec<i32>>,
    ) -> usize {
        let set = (self.step & 1) as usize;
        if let Some(old) = self.last[set].take() {
            old.wait_empty();
        }
        self.tokens[set].copy_from_slice(tokens);
        for (name, v) in ints {
            if let Some(mine) = self.ints[set].get_mut(name) {
                mine.copy_from_slice(v);
            }
        }
        let sets = self.sets.as_mut().expect("Codrive::ready made the sets");
        let base = sets.arenas[set].ptr();
        for (id, buf) in program.buffers.iter().enumerate() {
            match &buf.storage {
                Storage::Arena { .. } => {
                    // SAFETY: the offset and the buffer's bytes at the sets' rows lie in the set.
                    ptrs[id] = unsafe { base.add(sets.offsets[&(id as u32)] as usize) };
                }
                Storage::Input if buf.name == "tokens" => {
                    ptrs[id] = self.tokens[set].as_mut_ptr().cast();
                }
                Storage::Input => {
                    if let Some(v) = self.ints[set].get_mut(&buf.name) {
                        ptrs[id] = v.as_mut_ptr().cast();
                    }
                }
                _ => {}
            }
        }
        self.step += 1;
        set
    }

    /// Waits until no thread is inside a step run on either set.
    pub fn steps_idle(&self) {
        self.last.iter().flatten().for_each(|st| st.wait_empty());
    }

    /// Records `st` as the step running on `set`.
    pub fn running(&mut self, set: usize, st: Arc<StepState>) {
        self.last[set] = Some(st);
    }
}

/// One driver's walk of a co-driven step: every launch not yet done, in order. An exclusive
/// launch runs on the first driver to reach it (the others wait for it): no driver waits for
/// a descheduled one at an exclusive launch it could run itself, and a loop of steps
/// (`maxc_kernels::pool::drive_loop`) goes on on whichever thread has a CPU. A launch that
/// fails ends the step for every driver (the step's owner reports it).
pub(super) fn drive_step(st: &StepState) {
    st.inside.fetch_add(1, Ordering::AcqRel);
    // SAFETY: the executor outlives its steps' drivers (`StepState`).
    let exec = unsafe { &*st.exec };
    let n = st.exclusive.len();
    let mut args = Vec::new();
    for i in 0..n {
        if st.progress.load(Ordering::Acquire) > i {
            continue;
        }
        // Every launch before this one is done (this thread ran it, joined it until every
        // chunk was, or waited for it), so the first thread here may run an exclusive one.
        if st.exclusive[i] && st.claimed.fetch_max(i + 1, Ordering::AcqRel) > i {
            let mut spins = 0u32;
            while st.progress.load(Ordering::Acquire) <= i {
                spins = spins.wrapping_add(1);
                maxc_kernels::pool::pause(spins, 64);
            }
            continue;
        }
        maxc_kernels::pool::enter_launch(st.drive.load(Ordering::Acquire), i);
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            exec.run_launch(i, &st.ptrs, &st.dims, st.threads, &mut args)
        }));
        let failure = match ran {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(Failure::Error(e)),
            Err(p) => Some(Failure::Panic(p)),
        };
        if let Some(f) = failure {
            st.failed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(f);
            st.progress.store(n, Ordering::Release);
            break;
        }
        st.progress.fetch_max(i + 1, Ordering::AcqRel);
    }
    maxc_kernels::pool::leave();
    st.inside.fetch_sub(1, Ordering::AcqRel);
}

impl crate::engine::StepWalk for StepState {
    fn walk(&self) {
        drive_step(self);
    }
    fn done(&self) -> bool {
        self.progress.load(Ordering::Acquire) >= self.exclusive.len()
    }
}
