//! The CPU executor: loads a role's program (native code, weights, arena, KV cache, rotary
//! tables) once, at the bounds, and runs steps of ragged batches.

use super::code::{ExecutableCode, KernelFn};
use crate::artifact::Artifact;
use crate::error::{Result, RuntimeError};
use crate::logits::Logits;
use crate::profile::{LaunchTiming, StepProfile};
use crate::schema::ep_init;
use crate::schema::{
    DType, Extent, GatherIndex, KernelBody, Program, Rows, StepDim, StepInputs, StepLimits, Storage,
};
use half::{bf16, f16};
use maxc_kernels::options::KernelOptions;
use maxc_kernels::{attention, elementwise as ew, gemm, isa, matmul, mla, moe, pool};
use std::collections::BTreeMap;
use std::sync::Arc;

/// f32 storage aligned to 64 bytes.
pub(super) struct Aligned {
    mem: Memory,
    start: usize,
    len: usize,
}

/// Where [`Aligned`] keeps its values.
enum Memory {
    Heap(Vec<f32>),
    /// Transparent huge pages ([`crate::hugemem`]): what decode streams every step (the KV
    /// cache) reads about 1.4x as fast from them.
    Huge(crate::hugemem::HugeBuf),
}

impl Aligned {
    /// Zeroed memory of `bytes` bytes; an error (naming `what`) where it cannot be had. The
    /// memory comes zeroed from the allocator (fresh pages from the system for large sizes), so
    /// it costs no time at load and no resident memory until a step touches it.
    pub(super) fn zeroed(bytes: u64, what: &str) -> Result<Self> {
        let len = usize::try_from(bytes.div_ceil(4)).unwrap_or(usize::MAX);
        let cannot =
            || RuntimeError::Target(format!("cannot allocate {bytes} bytes for the {what}"));
        let total = len.checked_add(16).ok_or_else(cannot)?;
        let layout = std::alloc::Layout::array::<f32>(total).map_err(|_| cannot())?;
        // SAFETY: a non-zero-sized layout (at least 16 values); on success the pointer owns
        // `total` zeroed f32s, handed to a Vec with exactly that capacity and length.
        let buf = unsafe {
            let ptr = std::alloc::alloc_zeroed(layout).cast::<f32>();
            if ptr.is_null() {
                return Err(cannot());
            }
            Vec::from_raw_parts(ptr, total, total)
        };
        let start = buf.as_ptr().align_offset(64);
        Ok(Aligned {
            mem: Memory::Heap(buf),
            start,
            len,
        })
    }

    /// As [`Aligned::zeroed`], on transparent huge pages where the kernel offers them (pages
    /// still come on first touch, 2 MiB at a time).
    fn zeroed_huge(bytes: u64, what: &str) -> Result<Self> {
        if !crate::hugemem::available() || bytes < (2 << 20) {
            return Self::zeroed(bytes, what);
        }
        let len = usize::try_from(bytes.div_ceil(4)).unwrap_or(usize::MAX);
        match len.checked_mul(4).map(crate::hugemem::HugeBuf::zeroed) {
            Some(Ok(buf)) => Ok(Aligned {
                mem: Memory::Huge(buf),
                start: 0,
                len,
            }),
            _ => Self::zeroed(bytes, what),
        }
    }

    pub(super) fn ptr(&mut self) -> *mut u8 {
        self.slice_mut().as_mut_ptr().cast()
    }

    fn slice_mut(&mut self) -> &mut [f32] {
        match &mut self.mem {
            Memory::Heap(buf) => &mut buf[self.start..self.start + self.len],
            // SAFETY: 2 MiB-aligned bytes, len · 4 of them; any bit pattern is an f32.
            Memory::Huge(buf) => unsafe {
                std::slice::from_raw_parts_mut(
                    buf.as_mut_slice().as_mut_ptr().cast::<f32>(),
                    self.len,
                )
            },
        }
    }
}

/// A weight as the executor holds it: its mapped bytes, and an f32 copy where a library kernel
/// needs f32 and the artifact stores another dtype.
struct Param {
    ptr: *const u8,
    len: usize,
    dtype: DType,
    f32_copy: Option<Vec<f32>>,
    /// Where a library matmul reads it as its weight: how it runs at each row count, chosen
    /// at load.
    plan: Option<matmul::MatmulPlan>,
    /// Whether the weight was repacked into a format the matmuls read faster (`ptr` points
    /// into the executor's repacked weights, `dtype` is its format): see [`Repack`].
    repacked: bool,
    /// The format the artifact stores it in, and its bytes there.
    stored: DType,
    stored_len: usize,
}

impl Param {
    fn as_f32(&self, elems: usize) -> &[f32] {
        match &self.f32_copy {
            Some(v) => v,
            // SAFETY: without a copy the weight is f32 and holds `elems` elements.
            None => unsafe { std::slice::from_raw_parts(self.ptr.cast::<f32>(), elems) },
        }
    }
}

#[derive(Clone, Copy)]
struct SendPtrs(*const *mut u8, *const u64);

impl SendPtrs {
    /// Calls `f` on `start..end`.
    ///
    /// # Safety
    /// The pointers follow `f`'s documented buffer order and sizes; concurrent calls get
    /// disjoint ranges.
    unsafe fn call(self, f: KernelFn, start: u64, end: u64) {
        // SAFETY: as the caller guarantees.
        unsafe { f(self.0, self.1, start, end) }
    }
}
// SAFETY: kernels called on disjoint ranges write disjoint memory (the kernel IR's contract).
unsafe impl Send for SendPtrs {}
unsafe impl Sync for SendPtrs {}

/// A role's program, ready to run on this CPU.
pub struct CpuExecutor {
    artifact: Arc<Artifact>,
    program: Program,
    _code: Option<ExecutableCode>,
    fns: Vec<Option<KernelFn>>,
    params: BTreeMap<u32, Param>,
    arena: Aligned,
    kv: Aligned,
    rope: Vec<Aligned>,
    bounds: [u64; StepDim::COUNT],
    limits: StepLimits,
    tokens: Vec<i64>,
    ints: BTreeMap<String, Vec<i32>>,
    threads: usize,
    matmul_policy: Option<u64>,
    /// What runs each kernel, chosen at load.
    choices: Vec<KernelChoice>,
    /// The library kernels' choices, made at load.
    kernels: KernelOptions,
    /// Where set, each step's launches are timed into it.
    profile: Option<StepProfile>,
    /// Expert parallelism, where the artifact records a degree above 1.
    ep: Option<std::sync::Mutex<ExpertRanks>>,
    /// This rank's communicator, where the program is one rank of a tensor-parallel group
    /// (its all-reduce launches run on it).
    comm: Option<std::sync::Mutex<Box<dyn crate::comm::Communicator>>>,
    /// Whether the weight pointers have moved to the artifact's huge-page copy (or there is
    /// none to move to).
    weights_settled: bool,
    /// The weights chosen to be repacked, until their repacked copy is in place (or could not
    /// be made).
    repack: Option<Repack>,
    /// Whether a step has run (panels are read from the second on).
    stepped: bool,
    /// The weights chosen to be repacked, which the artifact's huge-page copy leaves out.
    unstaged: std::collections::BTreeSet<u32>,
    /// The repacked weights, one after another ([`Repack`]).
    _repacked: Option<crate::hugemem::HugeBuf>,
    /// Co-driven decode steps' buffers, where they run (`codrive.rs`).
    codrive: Option<super::codrive::Codrive>,
    /// Each buffer's address in the last step and its rows, where it ran co-driven (its
    /// outputs are there).
    codriven_ptrs: Option<(Vec<*mut u8>, usize)>,
    /// The step [`CpuExecutor::begin`] began: its buffers' addresses, its dims, its drivers'
    /// state and when it began.
    begun: Option<Begun>,
    /// Whether `begin` declined the next step after its `before_step` (`execute` skips it).
    prepared: bool,
}

/// A step begun for a loop of co-driven steps, not yet finished.
type Begun = (
    Vec<*mut u8>,
    [u64; StepDim::COUNT],
    Arc<super::codrive::StepState>,
    std::time::Instant,
);

// SAFETY: the raw pointers a `CpuExecutor` holds point into its own allocations and into the
// weights of the `Arc<Artifact>` it owns (its map or its huge-page copy, both read-only and
// `Send + Sync`, both living as long as the artifact); nothing is tied to the
// thread that built it, and `&mut self` serializes steps.
unsafe impl Send for CpuExecutor {}

impl Drop for CpuExecutor {
    fn drop(&mut self) {
        // A worker may still be inside a co-driven step that its peers finished.
        self.drivers_idle();
        // A helper thread may still be inside a speculative matmul chunk it lost to its caller
        // (`pool::run_speculative`), reading this executor's weights: they outlive it.
        pool::quiesce();
    }
}

fn to_f32(dtype: DType, bytes: &[u8]) -> Option<Vec<f32>> {
    match dtype {
        DType::F32 => None,
        DType::BF16 => Some(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        DType::F16 => Some(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        DType::I32 | DType::I64 => None,
        q => crate::schema::blocks::dequantize(q, bytes),
    }
}

/// The expert-parallel ranks an executor runs its MoE layers over.
enum ExpertRanks {
    /// Every rank, in this process.
    All(Box<dyn super::ep::Exchange>),
    /// One rank, its peers in other processes, exchanging over the executor's communicator.
    One(super::ep::EpPlan, super::ep::RankState),
}

impl ExpertRanks {
    fn plan(&self) -> super::ep::EpPlan {
        match self {
            ExpertRanks::All(ex) => *ex.plan(),
            ExpertRanks::One(plan, _) => *plan,
        }
    }
}

impl CpuExecutor {
    /// Prepares `role` of `artifact`: checks the CPU target against this machine, loads the
    /// native code, binds weights, and allocates the arena and KV cache at the bounds. An
    /// expert-parallel artifact runs every rank's experts here (see [`CpuExecutor::in_group`]).
    pub fn new(artifact: Arc<Artifact>, role: &str, kernels: KernelOptions) -> Result<Self> {
        Self::build(artifact, role, kernels, None)
    }

    /// [`CpuExecutor::new`] as rank `comm.rank()` of a group of processes: a tensor-parallel
    /// rank's all-reduces, or an expert-parallel artifact's rank `comm.rank()`, its experts'
    /// weights alone staged, its tokens exchanged with the other processes' ranks over `comm`.
    pub fn in_group(
        artifact: Arc<Artifact>,
        role: &str,
        kernels: KernelOptions,
        comm: Box<dyn crate::comm::Communicator>,
    ) -> Result<Self> {
        Self::build(artifact, role, kernels, Some(comm))
    }

    fn build(
        artifact: Arc<Artifact>,
        role: &str,
        kernels: KernelOptions,
        comm: Option<Box<dyn crate::comm::Communicator>>,
    ) -> Result<Self> {
        let program = artifact.programs.get(role).cloned().ok_or_else(|| {
            RuntimeError::Input(format!(
                "the artifact has no role `{role}`; it has {:?}",
                artifact.programs.keys().collect::<Vec<_>>()
            ))
        })?;
        let module = artifact.cpu.get(role).ok_or_else(|| {
            RuntimeError::Target(format!(
                "the artifact has no CPU code for role `{role}`; compile it with --target cpu"
            ))
        })?;
        if let Some(missing) = module.target.host_lacks() {
            return Err(RuntimeError::Target(missing));
        }
        // `Artifact::open` validated the program and this module (entries inside the code and
        // aligned, one per kernel, compiled from these kernel bodies), so only code offsets
        // the compiler emitted are turned into functions.
        let code = if module.code.is_empty() {
            None
        } else {
            Some(
                ExecutableCode::new(&module.code).map_err(|source| RuntimeError::Io {
                    path: artifact.dir.clone(),
                    source,
                })?,
            )
        };
        let mut fns = Vec::new();
        for entry in &module.entries {
            fns.push(match (entry, &code) {
                // SAFETY: the compiler placed a kernel's entry at `off` for this target (checked
                // against the host above); the code's checksum and digests were verified.
                (Some(off), Some(code)) => Some(unsafe { code.kernel(*off as usize) }),
                _ => None,
            });
        }
        // Matmul weights and gathered tables are read as stored; the other operands of
        // library kernels (biases, MoE experts) are widened to f32 once.
        let mut library_params = std::collections::BTreeSet::new();
        // Auto: generated matmuls only where the library has no hand-vectorized kernels for
        // steps of a few rows on this CPU (AVX-512 register tiles, AVX2 row groups).
        let matmul_policy = module.generated_matmul_max_rows.map(|max| {
            if isa::few_rows_kernels_available() {
                0
            } else {
                max
            }
        });
        let mut choices: Vec<KernelChoice> = program
            .kernels
            .iter()
            .zip(&fns)
            .map(|(k, f)| KernelChoice::of(&k.body, f.is_some(), matmul_policy))
            .collect();
        for l in &program.launches {
            let body = &program.kernels[l.kernel as usize].body;
            let read_as_stored: &[usize] = match body {
                KernelBody::Matmul { .. } | KernelBody::HeadMatmul { .. } => &[1],
                KernelBody::Gather { .. } => &[0],
                _ => &[],
            };
            let library = fns[l.kernel as usize].is_none()
                || (matches!(body, KernelBody::Matmul { .. }) && matmul_policy.is_some())
                || (matmul_policy.is_some() && library_elementwise(body));
            if library {
                library_params.extend(
                    l.buffers
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| !read_as_stored.contains(i))
                        .map(|(_, &b)| b),
                );
            }
        }
        // A program with MoE layers exchanges over the ranks the `ep_init` program sets up: all
        // of them here, or, in a group of processes, the one this process is.
        let has_moe = program
            .kernels
            .iter()
            .any(|k| matches!(k.body, KernelBody::MoeExperts { .. }));
        let ep_plan =
            super::ep::EpPlan::from_records(&artifact.manifest.export_records)?.filter(|_| has_moe);
        let ep_rank = match (&ep_plan, &comm) {
            (Some(plan), Some(c)) if c.size() != plan.degree => {
                return Err(RuntimeError::Input(format!(
                    "{}: compiled for expert-parallel degree {}, launched as rank {} of {} (mpirun -np {} runs it)",
                    artifact.dir.display(),
                    plan.degree,
                    c.rank(),
                    c.size(),
                    plan.degree
                )))
            }
            (Some(plan), Some(c)) => Some((*plan, c.rank())),
            _ => None,
        };
        // One rank of several processes reads only its own experts' weights.
        let mut foreign = std::collections::BTreeSet::new();
        if let Some((plan, rank)) = ep_rank {
            for l in &program.launches {
                if let KernelBody::MoeExperts { experts, .. } =
                    program.kernels[l.kernel as usize].body
                {
                    for e in 0..experts as usize {
                        if e / plan.experts_per_rank != rank {
                            foreign.extend(l.buffers.iter().skip(2 + 3 * e).take(3).copied());
                        }
                    }
                }
            }
        }
        let mut params = BTreeMap::new();
        for (id, b) in program.buffers.iter().enumerate() {
            if let Storage::Param { key } = &b.storage {
                let (view, bytes) = artifact.weight(key)?;
                if view.dtype != b.dtype {
                    return Err(RuntimeError::artifact(
                        &artifact.dir,
                        format!(
                            "weight `{key}` is {:?}, the program reads {:?}",
                            view.dtype, b.dtype
                        ),
                    ));
                }
                let f32_copy =
                    if library_params.contains(&(id as u32)) && !foreign.contains(&(id as u32)) {
                        to_f32(view.dtype, bytes)
                    } else {
                        None
                    };
                params.insert(
                    id as u32,
                    Param {
                        ptr: bytes.as_ptr(),
                        len: bytes.len(),
                        dtype: view.dtype,
                        f32_copy,
                        plan: None,
                        repacked: false,
                        stored: view.dtype,
                        stored_len: bytes.len(),
                    },
                );
            }
        }
        for l in &program.launches {
            if let KernelBody::Matmul { k, .. } = &program.kernels[l.kernel as usize].body {
                if let Some(p) = l.buffers.get(1).and_then(|w| params.get_mut(w)) {
                    p.plan = Some(matmul::MatmulPlan::new(p.dtype, *k as usize, &kernels));
                }
            }
        }
        let repack = Repack::choose(&program, &choices, &foreign, &params, &kernels);
        // A table repacked in panels is gathered by the library kernel, which reads them.
        for &k in repack.iter().flat_map(|r| &r.gathers) {
            choices[k as usize] = KernelChoice::Library;
            fns[k as usize] = None;
        }
        let unstaged: std::collections::BTreeSet<u32> = repack
            .iter()
            .flat_map(|r| r.chosen.iter().map(|c| c.buffer))
            .collect();
        let (bounds, limits) = artifact.step_limits(role)?;
        let kv = Aligned::zeroed_huge(program.kv_cache_bytes(limits.bounds), "KV cache")?;
        let max_seq_len = limits.max_seq_len as usize;
        let mut rope = Vec::new();
        for t in &program.rope_tables {
            let rows = t.rows(max_seq_len);
            let mut a = Aligned::zeroed((rows.len() * 4) as u64, "rotary table")?;
            a.slice_mut()[..rows.len()].copy_from_slice(&rows);
            rope.push(a);
        }
        let arena = Aligned::zeroed(program.arena_bytes, "arena")?;
        // Step inputs live in buffers at their bounds, so every kernel reads inside them
        // whatever its rows; each step fills them and zeroes the rest.
        let mut tokens = Vec::new();
        let mut ints = BTreeMap::new();
        for b in &program.buffers {
            if b.storage != Storage::Input {
                continue;
            }
            let n = b.elements_at(&bounds);
            if b.name == "tokens" {
                tokens = vec![0i64; n as usize];
            } else {
                ints.insert(b.name.clone(), vec![0i32; n as usize]);
            }
        }
        // The staged copy of the weights holds what this process's executors read (the weights
        // to be repacked are read in their repacked copy).
        artifact.want_weights(
            params
                .iter()
                .filter(|(id, _)| !foreign.contains(*id) && !unstaged.contains(*id))
                .filter_map(|(_, p)| artifact.weights_range(p.ptr, p.len)),
        );
        let mut run_init = |r: usize| {
            let mut exec = Box::new(CpuExecutor::new(artifact.clone(), ep_init::ROLE, kernels)?);
            let outs = exec.run_once(&[(ep_init::RANK_INPUT, vec![r as i32])])?;
            Ok((exec as Box<dyn std::any::Any + Send>, outs))
        };
        let ep = match (ep_plan, ep_rank) {
            (_, Some((plan, rank))) => Some(ExpertRanks::One(
                plan,
                super::ep::rank_state(&artifact, &plan, rank, &mut run_init)?,
            )),
            (Some(plan), None) => Some(ExpertRanks::All(Box::new(
                super::ep::InProcessExchange::from_artifact(&artifact, plan, &mut run_init)?,
            ))),
            (None, None) => None,
        };
        let mut exec = CpuExecutor {
            _repacked: None,
            stepped: false,
            repack,
            unstaged,
            weights_settled: false,
            ep: ep.map(std::sync::Mutex::new),
            comm: comm.map(std::sync::Mutex::new),
            artifact,
            program,
            _code: code,
            fns,
            params,
            arena,
            kv,
            rope,
            bounds,
            limits,
            tokens,
            ints,
            threads: pool::threads(),
            matmul_policy,
            choices,
            kernels,
            profile: None,
            codrive: None,
            codriven_ptrs: None,
            begun: None,
            prepared: false,
        };
        if CodriveMode::get() != CodriveMode::Off && pool::max_threads() > 1 {
            exec.codrive = super::codrive::Codrive::new(&exec.program, &exec.tokens, &exec.ints);
        }
        // Weights read into huge pages before the first step (`MAXC_WEIGHTS=huge`: a server
        // or a benchmark that wants full speed from the first step) are repacked then too.
        if crate::artifact::WeightMemory::for_cpu() == crate::artifact::WeightMemory::HugePages {
            exec.settle_repack_now();
        }
        Ok(exec)
    }

    /// Makes this executor rank `comm.rank()` of a tensor-parallel group: its all-reduce
    /// launches sum over the group's ranks.
    pub fn set_communicator(&mut self, comm: Box<dyn crate::comm::Communicator>) {
        self.comm = Some(std::sync::Mutex::new(comm));
    }

    /// This rank's communicator back (the executor keeps none).
    pub fn take_communicator(&mut self) -> Option<Box<dyn crate::comm::Communicator>> {
        self.comm
            .take()
            .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()))
    }

    /// Runs `f` on this rank's communicator, where it has one.
    pub fn with_communicator<T>(
        &self,
        f: impl FnOnce(&mut dyn crate::comm::Communicator) -> T,
    ) -> Option<T> {
        let c = self.comm.as_ref()?;
        let mut guard = c.lock().unwrap_or_else(|e| e.into_inner());
        Some(f(guard.as_mut()))
    }

    /// Ends its group's collectives after this rank failed on its own, so that the other
    /// ranks' steps fail at once (see [`crate::comm::Communicator::abort`]).
    pub fn abort_collectives(&self, why: &str) {
        if let Some(c) = &self.comm {
            c.lock().unwrap_or_else(|e| e.into_inner()).abort(why);
        }
    }

    /// The expert-parallel plan, where the artifact has one.
    pub fn ep_plan(&self) -> Option<super::ep::EpPlan> {
        self.ep
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).plan())
    }

    /// The program being run.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The artifact.
    pub fn artifact(&self) -> &Arc<Artifact> {
        &self.artifact
    }

    /// The bound of each step dim.
    pub fn bounds(&self) -> &[u64; StepDim::COUNT] {
        &self.bounds
    }

    /// Rows `rows` of the last step's f32 output `name` (`[rows of the step, width]` in the
    /// arena, as the decoder's `hidden_states`); `None` where the program has no such output or
    /// the rows pass its bound.
    pub fn output_rows(&mut self, name: &str, rows: std::ops::Range<usize>) -> Option<Vec<f32>> {
        let (buf, width) = self.program.row_output(name, &self.bounds, &rows)?;
        let Storage::Arena { offset } = buf.storage else {
            return None;
        };
        let start = match &self.codriven_ptrs {
            // The last step ran co-driven: its outputs are in its set, which holds the
            // step's rows.
            Some((ptrs, step_rows)) => {
                if rows.end > *step_rows {
                    return None;
                }
                ptrs[*self.program.outputs.get(name)? as usize]
            }
            // SAFETY: the buffer holds `bound × width` f32 at its arena offset
            // (Program::validate checked it lies in the arena).
            None => unsafe { self.arena.ptr().add(offset as usize) },
        };
        // SAFETY: `rows` lie below the rows its memory holds (the bound, or the co-driven
        // step's rows, checked above).
        let data = unsafe {
            std::slice::from_raw_parts(
                start.cast::<f32>().add(rows.start * width),
                rows.len() * width,
            )
        };
        Some(data.to_vec())
    }

    /// Runs one step and returns the `logits` output.
    pub fn execute(&mut self, s: &StepInputs) -> Result<Logits> {
        let dims = s.checked_dims(&self.limits)?;
        // (Done already where `begin` declined this step.)
        if !std::mem::take(&mut self.prepared) {
            self.before_step(&dims);
        }
        let step_start = std::time::Instant::now();
        let mut ptrs = self.bind_step(s)?;
        // Co-driven (`codrive.rs`) where the pool's threads share their CPUs with other
        // processes (`CpuExecutor::loops`).
        let timings = if self.codrives(&dims) {
            let st = self.start_codriven(&mut ptrs, &dims);
            let body = st.clone();
            pool::drive(Arc::new(move |n, _| {
                // (Numbered under the pool's caller lock: steps of several callers take turns,
                // and a later step's keys must be later.)
                body.drive.store(n, std::sync::atomic::Ordering::Release);
                super::codrive::drive_step(&body)
            }));
            self.codriven_failure(&st)?;
            None
        } else {
            self.run_launches(&ptrs, &dims, step_start)?
        };
        self.step_output(&ptrs, &dims, timings, step_start, Some(s))
    }

    /// Begins a step whose launches the threads of a loop of co-driven steps walk
    /// (`maxc_kernels::pool::drive_loop`), where this step runs co-driven; `None` where it
    /// does not (then [`CpuExecutor::execute`] runs it). [`CpuExecutor::finish`] ends it.
    pub fn begin(&mut self, s: &StepInputs) -> Result<Option<Arc<dyn crate::engine::StepWalk>>> {
        let dims = s.checked_dims(&self.limits)?;
        self.before_step(&dims);
        if !self.codrives(&dims) {
            // `execute` runs it next, without a second `before_step`.
            self.prepared = true;
            return Ok(None);
        }
        let mut ptrs = self.bind_step(s)?;
        let st = self.start_codriven(&mut ptrs, &dims);
        // (Inside the loop, which holds the pool's caller lock.)
        st.drive
            .store(pool::step_number(), std::sync::atomic::Ordering::Release);
        self.begun = Some((ptrs, dims, st.clone(), std::time::Instant::now()));
        Ok(Some(st))
    }

    /// Ends the step [`CpuExecutor::begin`] began, once its walk is done: the `logits` output.
    pub fn finish(&mut self) -> Result<Logits> {
        let Some((ptrs, dims, st, start)) = self.begun.take() else {
            return Err(RuntimeError::Input("no step was begun".into()));
        };
        self.codriven_failure(&st)?;
        self.step_output(&ptrs, &dims, None, start, None)
    }

    /// What every step does before its launches: settles the weights, and sets the width.
    fn before_step(&mut self, dims: &[u64; StepDim::COUNT]) {
        // Panels give other roundings than the stored rows: the first step reads the rows, every
        // later one the panels (this one waits for them), so that the same steps give the same
        // logits whatever the repack's pace.
        if self.stepped && self.repack.as_ref().is_some_and(|r| r.changes_values()) {
            self.settle_repack_now();
        }
        self.settle_weights();
        // The width the pool splits jobs to follows the CPUs its threads get (prefill steps
        // take every thread); it changes only here, between steps, so every launch of a step
        // splits alike.
        self.threads = pool::between_steps(dims[StepDim::TotalSeqLen as usize] as usize);
    }

    /// Fills the step's inputs from `s` and returns each buffer's address.
    fn bind_step(&mut self, s: &StepInputs) -> Result<Vec<*mut u8>> {
        fill(&mut self.tokens, &s.tokens);
        let context = s.context_lengths();
        for (name, v) in [
            ("input_row_offsets", s.input_row_offsets.as_slice()),
            ("cache_lengths", &s.cache_lengths),
            ("batch_context_lengths", &context),
            ("logit_indices", &s.logit_indices),
        ] {
            if let Some(buf) = self.ints.get_mut(name) {
                fill(buf, v);
            }
        }
        for g in 0..s.kv_groups {
            if let Some(buf) = self.ints.get_mut(&crate::schema::kv_lookup_input(g)) {
                fill(buf, s.lookup_table(g));
            }
        }
        self.codriven_ptrs = None;
        self.bind()
    }

    /// Whether decode steps run co-driven now (`codrive.rs`), in loops of steps that any of the
    /// pool's threads begins: where those threads share their CPUs with other processes (a
    /// width of two sharing them, a leading width of one whose helper co-drives, or a pair).
    pub fn loops(&self) -> bool {
        self.codrive.is_some()
            && self.profile.is_none()
            && self.comm.is_none()
            && self.ep.is_none()
            && match CodriveMode::get() {
                CodriveMode::Off => false,
                CodriveMode::Shared => pool::shared() || pool::leading() || pool::paired(),
                CodriveMode::Always => self.threads > 1 || pool::leading(),
            }
    }

    /// Whether a step at `dims` runs co-driven (`codrive.rs`): steps do now
    /// ([`CpuExecutor::loops`]), and this one is decode-sized.
    fn codrives(&mut self, dims: &[u64; StepDim::COUNT]) -> bool {
        self.loops()
            && self
                .codrive
                .as_mut()
                .is_some_and(|c| c.ready(&self.program, &self.bounds, dims))
    }

    /// The logits of the step run over `ptrs` at `dims` (and its profile, where `timings` has
    /// one; `s`, its inputs, names its sequences there), and what follows a first step.
    fn step_output(
        &mut self,
        ptrs: &[*mut u8],
        dims: &[u64; StepDim::COUNT],
        timings: Option<Vec<LaunchTiming>>,
        step_start: std::time::Instant,
        s: Option<&StepInputs>,
    ) -> Result<Logits> {
        let out = self.program.outputs.get("logits").ok_or_else(|| {
            RuntimeError::artifact(&self.artifact.dir, "the program has no `logits` output")
        })?;
        let buf = &self.program.buffers[*out as usize];
        let rows = match buf.shape.first() {
            Some(Extent::Step(d)) => dims[*d as usize] as usize,
            Some(Extent::Fixed(n)) => *n as usize,
            None => 1,
        };
        let vocab = self.program.vocab_size as usize;
        // SAFETY: the logits buffer holds rows × vocab f32 at its arena offset.
        let data =
            unsafe { std::slice::from_raw_parts(ptrs[*out as usize].cast::<f32>(), rows * vocab) }
                .to_vec();
        if let (Some(p), Some(launches), Some(s)) = (self.profile.as_mut(), timings, s) {
            *p = StepProfile {
                dims: *dims,
                total_ns: step_start.elapsed().as_nanos() as u64,
                launches,
                seqs: s
                    .cache_lengths
                    .iter()
                    .zip(s.input_row_offsets.windows(2))
                    .map(|(&c, w)| (c as u64, (w[1] - w[0]) as u64))
                    .collect(),
            };
        }
        if !self.weights_settled {
            // Behind the first step: the weights' huge-page copy (once per artifact), and the
            // repacked weights (the first token does not wait for either).
            self.artifact.stage_weights();
            self.start_repack();
        }
        self.stepped = true;
        Ok(Logits { rows, vocab, data })
    }

    /// Whether the weight pointers have moved to the artifact's huge-page copy.
    pub fn on_staged_weights(&self) -> bool {
        self.weights_settled && self.artifact.staged_weights().is_some()
    }

    /// Blocks until what steps start behind the first one is made (the weights' huge-page
    /// copy and the repacked weights; both started now if no step has yet), and moves the
    /// weight pointers to them (benchmarks and tests measure after this).
    pub fn settle_weights_now(&mut self) {
        self.artifact.stage_weights();
        self.settle_repack_now();
        self.artifact.wait_for_staged_weights();
        self.settle_weights();
    }

    /// Makes the repacked weights now (where there are any to make) and reads them from here on.
    fn settle_repack_now(&mut self) {
        self.start_repack();
        if let Some(r) = &self.repack {
            // (Disconnected: the thread is gone without a result; the rows stay.)
            let made = r.made.recv().unwrap_or(None);
            self.apply_repack(made);
        }
    }

    /// Starts repacking the weights chosen at load (once).
    fn start_repack(&mut self) {
        if let Some(r) = self.repack.as_mut() {
            r.start(&self.params, &self.artifact, self.threads);
        }
    }

    /// Moves the repacked weights' pointers, formats and plans to the copy `made` (where it
    /// was made; otherwise they stay as stored).
    fn apply_repack(&mut self, made: Made) {
        let Some(r) = self.repack.take() else {
            return;
        };
        self.drivers_idle();
        let Some((buf, wrote)) = made else {
            tracing::warn!("weights stay as stored: their repacked copy could not be made");
            return;
        };
        let base = buf.as_slice().as_ptr();
        for (c, _) in r.chosen.iter().zip(&wrote).filter(|(_, w)| **w) {
            let Some(p) = self.params.get_mut(&c.buffer) else {
                continue;
            };
            // SAFETY: `at + len` lies inside the buffer (`Repack::total` bytes).
            p.ptr = unsafe { base.add(c.at) };
            p.stored_len = p.len;
            p.len = c.len;
            p.dtype = c.to.to;
            p.plan = Some(matmul::MatmulPlan::with_layout(
                c.to.to,
                c.k,
                c.to.layout,
                &self.kernels,
            ));
            p.repacked = true;
        }
        self._repacked = Some(buf);
    }

    /// At a step boundary: the repacked weights where they are made; then, where the
    /// artifact's huge-page copy of staged weights is whole, every weight pointer moves to the
    /// same offset in it.
    fn settle_weights(&mut self) {
        if let Some(r) = &self.repack {
            match r.made.try_recv() {
                Ok(made) => self.apply_repack(made),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => self.apply_repack(None),
                Err(std::sync::mpsc::TryRecvError::Empty) => {}
            }
        }
        if self.weights_settled {
            return;
        }
        // The copy lacks the stored bytes of the weights to be repacked: they move first.
        if self.repack.is_some() {
            return;
        }
        let Some(copy) = self.artifact.staged_weights() else {
            return;
        };
        self.drivers_idle();
        let mapped = self.artifact.weights_bytes().as_ptr_range();
        for (id, p) in self.params.iter_mut() {
            // (A weight left out of the copy, whose repacked copy could not be made, stays
            // where it was.)
            if mapped.contains(&p.ptr) && !self.unstaged.contains(id) {
                // SAFETY: `p.ptr` lies in the mapped file, and the copy has its length.
                p.ptr = unsafe { copy.as_ptr().add(p.ptr.offset_from(mapped.start) as usize) };
            }
        }
        self.weights_settled = true;
        self.artifact.release_mapped_weights();
    }

    /// Waits until no thread is inside a co-driven step (before the weights they read move).
    fn drivers_idle(&self) {
        if let Some(cd) = &self.codrive {
            if pool::in_body() {
                // Between the steps of a loop (whose threads stay in its body): its steps'.
                cd.steps_idle();
            } else {
                pool::drivers_idle();
            }
        }
    }

    /// Readies a co-driven step (`codrive.rs`) over `ptrs`, whose arena buffers and inputs move
    /// to the next set: each of its drivers walks it (`codrive::drive_step`).
    fn start_codriven(
        &mut self,
        ptrs: &mut [*mut u8],
        dims: &[u64; StepDim::COUNT],
    ) -> Arc<super::codrive::StepState> {
        use std::sync::atomic::AtomicUsize;
        let exec = self as *const CpuExecutor;
        // A leading width of one splits its jobs between the caller and its helper.
        let threads = self.threads.max(2);
        let exclusive: Arc<[bool]> = (0..self.program.launches.len())
            .map(|i| !self.codrive_shared(i, dims))
            .collect();
        let cd = self.codrive.as_mut().expect("codrives() checked the sets");
        let set = cd.next_set(&self.program, ptrs, &self.tokens, &self.ints);
        let st = Arc::new(super::codrive::StepState {
            exec,
            drive: std::sync::atomic::AtomicU64::new(0),
            ptrs: ptrs.to_vec(),
            dims: *dims,
            threads,
            exclusive,
            progress: AtomicUsize::new(0),
            claimed: AtomicUsize::new(0),
            inside: AtomicUsize::new(0),
            failed: std::sync::Mutex::new(None),
        });
        cd.running(set, st.clone());
        self.codriven_ptrs = Some((ptrs.to_vec(), dims[StepDim::TotalSeqLen as usize] as usize));
        st
    }

    /// The error (or panic, resumed here) a co-driven step's launch gave, if any.
    fn codriven_failure(&self, st: &super::codrive::StepState) -> Result<()> {
        let failed = st.failed.lock().unwrap_or_else(|e| e.into_inner()).take();
        match failed {
            None => Ok(()),
            Some(super::codrive::Failure::Error(e)) => Err(e),
            Some(super::codrive::Failure::Panic(p)) => std::panic::resume_unwind(p),
        }
    }

    /// Whether launch `i` at `dims` may be shared between a co-driven step's threads: a library
    /// kernel that writes each output value once from its inputs (`codrive.rs`); the others run
    /// on the caller alone.
    fn codrive_shared(&self, i: usize, dims: &[u64; StepDim::COUNT]) -> bool {
        let launch = &self.program.launches[i];
        let body = &self.program.kernels[launch.kernel as usize].body;
        let generated = self.fns[launch.kernel as usize].is_some()
            && self.generated_fits(launch.kernel as usize, body, dims);
        if generated {
            return false;
        }
        match body {
            KernelBody::Matmul { bias: false, .. } => self
                .params
                .get(&launch.buffers[1])
                .is_some_and(|p| p.dtype != DType::F32),
            #[cfg(target_arch = "x86_64")]
            KernelBody::Attention { .. } => attention_library() && self.matmul_policy.is_some(),
            #[cfg(target_arch = "x86_64")]
            KernelBody::Elementwise { .. } => {
                self.matmul_policy.is_some() && library_elementwise(body)
            }
            _ => false,
        }
    }

    /// Each buffer's address, in buffer order.
    fn bind(&mut self) -> Result<Vec<*mut u8>> {
        let arena = self.arena.ptr();
        let kv = self.kv.ptr();
        let rope: Vec<*mut u8> = self.rope.iter_mut().map(|r| r.ptr()).collect();
        let mut ptrs: Vec<*mut u8> = Vec::with_capacity(self.program.buffers.len());
        for (id, buf) in self.program.buffers.iter().enumerate() {
            // Program::validate (at open) checked each offset, index and layer below, and that
            // every launch's operands hold what its kernel touches at the bounds.
            ptrs.push(match &buf.storage {
                // SAFETY: offset + size lies inside arena_bytes, the arena's size.
                Storage::Arena { offset } => unsafe { arena.add(*offset as usize) },
                Storage::Param { .. } => self.params[&(id as u32)].ptr as *mut u8,
                Storage::KvCache => kv,
                // SAFETY: layer < num_layers: the slot lies inside the cache's first page.
                Storage::KvCacheLayer { layer } => unsafe {
                    kv.add((layer * self.program.kv_layer_bytes()) as usize)
                },
                Storage::RopeTable { table } => rope[*table as usize],
                Storage::Input if buf.name == "tokens" => self.tokens.as_mut_ptr().cast(),
                Storage::Input => self
                    .ints
                    .get_mut(&buf.name)
                    .ok_or_else(|| {
                        RuntimeError::Input(format!("no value for program input `{}`", buf.name))
                    })?
                    .as_mut_ptr()
                    .cast(),
            });
        }
        Ok(ptrs)
    }

    /// Runs every launch at `dims` over the buffers at `ptrs`; the launches' timings where
    /// profiling.
    fn run_launches(
        &mut self,
        ptrs: &[*mut u8],
        dims: &[u64; StepDim::COUNT],
        step_start: std::time::Instant,
    ) -> Result<Option<Vec<LaunchTiming>>> {
        let mut args: Vec<*mut u8> = Vec::new();
        let mut timings = self.profile.as_ref().map(|_| Vec::new());
        // Matmuls may run as speculative jobs (the weights outlive them: `Drop`).
        let _speculate = pool::allow_speculation();
        for i in 0..self.program.launches.len() {
            let t = std::time::Instant::now();
            let generated = self.run_launch(i, ptrs, dims, self.threads, &mut args)?;
            if let Some(v) = timings.as_mut() {
                v.push(LaunchTiming {
                    launch: i,
                    start_ns: (t - step_start).as_nanos() as u64,
                    dur_ns: t.elapsed().as_nanos() as u64,
                    generated,
                });
            }
        }
        Ok(timings)
    }

    /// Runs launch `i` at `dims` over the buffers at `ptrs`, its jobs split across `threads`
    /// (`args`: room for its operands); returns whether generated code ran it.
    pub(super) fn run_launch(
        &self,
        i: usize,
        ptrs: &[*mut u8],
        dims: &[u64; StepDim::COUNT],
        threads: usize,
        args: &mut Vec<*mut u8>,
    ) -> Result<bool> {
        let launch = &self.program.launches[i];
        let kernel = &self.program.kernels[launch.kernel as usize];
        args.clear();
        args.extend(launch.buffers.iter().map(|&b| ptrs[b as usize]));
        Ok(match self.fns[launch.kernel as usize] {
            Some(f) if self.generated_fits(launch.kernel as usize, &kernel.body, dims) => {
                run_generated(f, &kernel.body, args, dims, threads);
                true
            }
            _ => {
                self.run_library(&kernel.body, &launch.buffers, args, dims, threads)?;
                false
            }
        })
    }

    /// Runs a program without steps (the `ep_init` program) once, at its bounds, with its
    /// integer inputs by name, and returns each output's address and bytes. The outputs live
    /// in this executor's arena: they stay valid, and no other buffer shares their bytes
    /// (the program's validation), for as long as the executor lives and runs nothing else.
    pub fn run_once(
        &mut self,
        inputs: &[(&str, Vec<i32>)],
    ) -> Result<BTreeMap<String, (*mut u8, usize)>> {
        for (name, values) in inputs {
            let buf = self.ints.get_mut(*name).ok_or_else(|| {
                RuntimeError::Input(format!(
                    "the {} program has no input `{name}`",
                    self.program.role
                ))
            })?;
            if values.len() != buf.len() {
                return Err(RuntimeError::Input(format!(
                    "input `{name}` of the {} program takes {} values, got {}",
                    self.program.role,
                    buf.len(),
                    values.len()
                )));
            }
            buf.copy_from_slice(values);
        }
        let ptrs = self.bind()?;
        let dims = self.bounds;
        self.run_launches(&ptrs, &dims, std::time::Instant::now())?;
        let mut out = BTreeMap::new();
        for (name, &id) in &self.program.outputs {
            let b = &self.program.buffers[id as usize];
            let elements = b.elements_at(&dims);
            let bytes = b.dtype.bytes_for(elements).unwrap_or(0) as usize;
            out.insert(name.clone(), (ptrs[id as usize], bytes));
        }
        Ok(out)
    }

    /// Times every launch of the following steps (or stops timing).
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(|| StepProfile {
            dims: [0; StepDim::COUNT],
            total_ns: 0,
            launches: Vec::new(),
            seqs: Vec::new(),
        });
    }

    /// The timings of the last step, while profiling.
    pub fn last_profile(&self) -> Option<&StepProfile> {
        self.profile.as_ref()
    }

    /// Whether kernel `kernel`'s generated code runs it at these dims (its choice at load).
    fn generated_fits(
        &self,
        kernel: usize,
        body: &KernelBody,
        dims: &[u64; StepDim::COUNT],
    ) -> bool {
        match self.choices[kernel] {
            KernelChoice::Generated => true,
            KernelChoice::Library => false,
            KernelChoice::GeneratedRows(max) => match body {
                KernelBody::Matmul { rows, .. } => {
                    let r = match rows {
                        Rows::Step(d) => dims[*d as usize],
                        Rows::Fixed(n) => *n,
                    };
                    (2..=max).contains(&r)
                }
                _ => true,
            },
        }
    }

    /// What runs each kernel of the program (chosen at load), in kernel order.
    pub fn kernel_choices(&self) -> &[KernelChoice] {
        &self.choices
    }

    /// Each weight a library matmul reads (its buffer id) and how it runs at each row count,
    /// chosen at load, in buffer order.
    pub fn matmul_plans(&self) -> Vec<(u32, &matmul::MatmulPlan)> {
        self.params
            .iter()
            .filter_map(|(&id, p)| p.plan.as_ref().map(|plan| (id, plan)))
            .collect()
    }

    /// The buffers of the weights chosen at load to be repacked ([`Repack`]): read in their
    /// repacked copy once it is made, and left out of the artifact's huge-page copy.
    pub fn repacking(&self) -> &std::collections::BTreeSet<u32> {
        &self.unstaged
    }

    /// The weights repacked ([`Repack`]; behind the first step): each one's buffer id, stored
    /// format and bytes, and the format and bytes it is read in, in buffer order.
    pub fn repacked_weights(&self) -> Vec<RepackedWeight> {
        self.params
            .iter()
            .filter(|(_, p)| p.repacked)
            .map(|(&buffer, p)| RepackedWeight {
                buffer,
                stored: p.stored,
                stored_bytes: p.stored_len,
                read_as: p.dtype,
                read_bytes: p.len,
                layout: p
                    .plan
                    .as_ref()
                    .map_or(matmul::Layout::Rows, |plan| plan.layout()),
            })
            .collect()
    }

    /// The library kernels' choices this executor was made with.
    pub fn kernel_options(&self) -> KernelOptions {
        self.kernels
    }

    fn run_library(
        &self,
        body: &KernelBody,
        buffers: &[u32],
        args: &[*mut u8],
        dims: &[u64; StepDim::COUNT],
        threads: usize,
    ) -> Result<()> {
        let rows_of = |r: &Rows| match r {
            Rows::Step(d) => dims[*d as usize] as usize,
            Rows::Fixed(n) => *n as usize,
        };
        // SAFETY (all slices below): buffer sizes follow from the kernel body at these dims, and
        // the memory plan gives every output its own bytes.
        match body {
            KernelBody::Matmul {
                rows, n, k, bias, ..
            } => {
                let (rows, n, k) = (rows_of(rows), *n as usize, *k as usize);
                let x = unsafe { std::slice::from_raw_parts(args[0].cast::<f32>(), rows * k) };
                let b = bias.then(|| self.param_f32(buffers[2], args[2], n));
                let out_arg = args[args.len() - 1];
                let out =
                    unsafe { std::slice::from_raw_parts_mut(out_arg.cast::<f32>(), rows * n) };
                match self.params.get(&buffers[1]) {
                    Some(p) => {
                        // SAFETY: the weight's mapped bytes, `len` of them.
                        let w = unsafe { std::slice::from_raw_parts(p.ptr, p.len) };
                        match &p.plan {
                            Some(plan) => plan.run(x, w, out, rows, n, threads),
                            None => matmul::matmul(
                                x,
                                w,
                                p.dtype,
                                out,
                                rows,
                                n,
                                k,
                                threads,
                                &self.kernels,
                            ),
                        }
                    }
                    None => {
                        let w = self.param_f32(buffers[1], args[1], n * k);
                        gemm::matmul(x, w, None, out, rows, n, k);
                    }
                }
                if let Some(b) = b {
                    for row in out.chunks_exact_mut(n) {
                        for (o, b) in row.iter_mut().zip(b) {
                            *o += b;
                        }
                    }
                }
            }
            KernelBody::Gather {
                rows,
                cols,
                index,
                src_dtype,
                scale,
            } => {
                let (rows, cols) = (rows_of(rows), *cols as usize);
                let p = &self.params[&buffers[0]];
                // SAFETY: the table's mapped bytes; validated to hold `vocab` rows of `cols`.
                let table = unsafe { std::slice::from_raw_parts(p.ptr, p.len) };
                let table_rows =
                    p.stored_len as u64 / src_dtype.bytes_for(cols as u64).unwrap_or(1).max(1);
                // A table that is also a matmul's weight may be repacked in panels.
                let panels =
                    p.plan.as_ref().map(|plan| plan.layout()) == Some(matmul::Layout::Columns);
                let out =
                    unsafe { std::slice::from_raw_parts_mut(args[2].cast::<f32>(), rows * cols) };
                for (r, o) in out.chunks_exact_mut(cols).enumerate() {
                    let src = match index {
                        GatherIndex::Tokens => {
                            // SAFETY: `index` holds the step's token ids, one per row.
                            let id = unsafe { *args[1].cast::<i64>().add(r) };
                            u64::try_from(id).ok().filter(|&i| i < table_rows)
                        }
                        GatherIndex::LogitRows => {
                            // SAFETY: `index` holds the step's logit indices, one per row.
                            let row = unsafe { *args[1].cast::<i32>().add(r) };
                            u64::try_from(row).ok().filter(|&i| i < table_rows)
                        }
                    };
                    match src {
                        Some(i) => {
                            if panels {
                                // (In the format it was repacked into: Q5_0 as Q8_0.)
                                matmul::cols::gather_row(p.dtype, table, cols, i as usize, o);
                            } else {
                                matmul::gather_row(table, *src_dtype, cols, i as usize, o);
                            }
                            if *scale != 1.0 {
                                o.iter_mut().for_each(|v| *v *= scale);
                            }
                        }
                        None => o.fill(0.0),
                    }
                }
            }
            KernelBody::MoeExperts {
                rows,
                hidden,
                ffn,
                experts,
                ..
            } => {
                let (rows, h, f, e) = (
                    rows_of(rows),
                    *hidden as usize,
                    *ffn as usize,
                    *experts as usize,
                );
                let x = unsafe { std::slice::from_raw_parts(args[0].cast::<f32>(), rows * h) };
                let routing =
                    unsafe { std::slice::from_raw_parts(args[1].cast::<f32>(), rows * e) };
                // A rank of several processes holds its own experts' weights alone.
                let own = self.ep.as_ref().and_then(|ep| {
                    match &*ep.lock().unwrap_or_else(|e| e.into_inner()) {
                        ExpertRanks::One(plan, state) => {
                            Some((plan.experts_per_rank, state.rank()))
                        }
                        ExpertRanks::All(_) => None,
                    }
                });
                let held = |i: usize| own.is_none_or(|(per, rank)| i / per == rank);
                let ws: Vec<(&[f32], &[f32], &[f32])> = (0..e)
                    .map(|i| {
                        if !held(i) {
                            return (&[][..], &[][..], &[][..]);
                        }
                        let at = |j: usize, n: usize| {
                            self.param_f32(buffers[2 + 3 * i + j], args[2 + 3 * i + j], n)
                        };
                        (at(0, f * h), at(1, f * h), at(2, h * f))
                    })
                    .collect();
                let out = unsafe {
                    std::slice::from_raw_parts_mut(args[2 + 3 * e].cast::<f32>(), rows * h)
                };
                match &self.ep {
                    Some(ep) => match &mut *ep.lock().unwrap_or_else(|e| e.into_inner()) {
                        ExpertRanks::All(ex) => {
                            super::ep::moe_layer(&mut **ex, x, routing, &ws, out, rows, h, f)?;
                        }
                        ExpertRanks::One(plan, state) => {
                            let comm = self.comm.as_ref().ok_or_else(|| {
                                RuntimeError::Input(
                                    "an expert-parallel rank runs with its group's communicator"
                                        .into(),
                                )
                            })?;
                            let mut comm = comm.lock().unwrap_or_else(|e| e.into_inner());
                            let mut ex = super::ep::CommExchange::new(*plan, state, &mut **comm)?;
                            super::ep::moe_layer(&mut ex, x, routing, &ws, out, rows, h, f)?;
                        }
                    },
                    None => moe::moe_experts(x, routing, &ws, out, rows, h, f),
                }
            }
            #[cfg(target_arch = "x86_64")]
            &KernelBody::Attention {
                heads,
                scale,
                window,
                value_dim,
                ..
            } if attention_library() && self.matmul_policy.is_some() => {
                let batch = dims[StepDim::BatchSize as usize] as usize;
                let pages_per_seq = dims[StepDim::MaxNumPages as usize] as usize;
                let ints = |i: usize, n: usize| unsafe {
                    std::slice::from_raw_parts(args[i].cast::<i32>().cast_const(), n)
                };
                let seqs = attention::Seqs {
                    lookup: ints(2, batch * pages_per_seq),
                    cache_lengths: ints(3, batch),
                    offsets: ints(4, batch + 1),
                    pages_per_seq,
                };
                let shape = attention::Shape {
                    cache: body.kv_view().expect("an attention kernel has a KV view"),
                    heads: heads as usize,
                    scale,
                    window: window.map(|w| w as usize),
                    value_dim: value_dim as usize,
                };
                // SAFETY: attention runs on this CPU; the step inputs were checked
                // (`checked_dims`): offsets, cache lengths and the pages they use lie inside
                // the buffers and the cache.
                unsafe {
                    attention::attention(
                        args[0].cast::<f32>().cast_const(),
                        args[1].cast::<u8>().cast_const(),
                        args[5].cast::<f32>(),
                        &seqs,
                        shape,
                        threads,
                    )
                };
            }
            #[cfg(target_arch = "x86_64")]
            KernelBody::Elementwise {
                rows,
                cols,
                inputs,
                program,
            } if self.matmul_policy.is_some() && library_elementwise(body) => {
                let (rows, cols) = (rows_of(rows), *cols as usize);
                let mut ins = [ew::Input {
                    ptr: std::ptr::null(),
                    broadcast: false,
                }; ew::MAX_INPUTS];
                for (i, inp) in inputs.iter().enumerate() {
                    let n = if inp.broadcast { cols } else { rows * cols };
                    ins[i] = ew::Input {
                        ptr: self.param_f32(buffers[i], args[i], n).as_ptr(),
                        broadcast: inp.broadcast,
                    };
                }
                let ins = &ins[..inputs.len()];
                let out = pool::OutPtr(args[inputs.len()].cast::<f32>());
                let chunks = if body.work(dims) >= 1 << 16 {
                    threads.min(rows).max(1)
                } else {
                    1
                };
                pool::run(chunks, &|c| {
                    let (r0, r1) = (rows * c / chunks, rows * (c + 1) / chunks);
                    // SAFETY: the tiles (AVX-512) run on this CPU; the program was validated
                    // and is short enough (`library_elementwise`); inputs and output hold the
                    // body's sizes at these dims; row ranges are disjoint.
                    unsafe { ew::rows(ins, program, cols, r0, r1, out.get()) };
                });
            }
            KernelBody::HeadMatmul {
                rows,
                heads,
                n,
                k,
                weight_dtype,
            } => {
                let (rows, heads, n, k) =
                    (rows_of(rows), *heads as usize, *n as usize, *k as usize);
                let x =
                    unsafe { std::slice::from_raw_parts(args[0].cast::<f32>(), rows * heads * k) };
                let out = unsafe {
                    std::slice::from_raw_parts_mut(args[2].cast::<f32>(), rows * heads * n)
                };
                let p = &self.params[&buffers[1]];
                // SAFETY: the weight's mapped bytes, `len` of them.
                let w = unsafe { std::slice::from_raw_parts(p.ptr, p.len) };
                let per_head = w.len() / heads.max(1);
                let mut xh = vec![0.0f32; rows * k];
                let mut oh = vec![0.0f32; rows * n];
                for h in 0..heads {
                    for r in 0..rows {
                        xh[r * k..(r + 1) * k].copy_from_slice(&x[(r * heads + h) * k..][..k]);
                    }
                    matmul::matmul(
                        &xh,
                        &w[h * per_head..(h + 1) * per_head],
                        *weight_dtype,
                        &mut oh,
                        rows,
                        n,
                        k,
                        threads,
                        &self.kernels,
                    );
                    for r in 0..rows {
                        out[(r * heads + h) * n..][..n].copy_from_slice(&oh[r * n..(r + 1) * n]);
                    }
                }
            }
            KernelBody::MoeRouter {
                rows,
                experts,
                top_k,
                n_group,
                topk_group,
                scoring,
                group_score,
                renormalize,
                scale,
                ..
            } => {
                let (rows, e) = (rows_of(rows), *experts as usize);
                let logits = unsafe { std::slice::from_raw_parts(args[0].cast::<f32>(), rows * e) };
                let bias = self.param_f32(buffers[1], args[1], e);
                let out =
                    unsafe { std::slice::from_raw_parts_mut(args[2].cast::<f32>(), rows * e) };
                let routing = moe::GroupedRouting {
                    top_k: *top_k as usize,
                    n_group: *n_group as usize,
                    topk_group: *topk_group as usize,
                    sigmoid: *scoring == crate::schema::RouterScoring::Sigmoid,
                    top_two: *group_score == crate::schema::GroupScore::TopTwoSum,
                    renormalize: *renormalize,
                    scale: *scale,
                };
                moe::route_grouped(logits, bias, out, &routing);
            }
            &KernelBody::DecompressedAttention {
                heads,
                head_dim,
                rope,
                nope,
                value,
                scale,
                ..
            } => {
                let batch = dims[StepDim::BatchSize as usize] as usize;
                let pages_per_seq = dims[StepDim::MaxNumPages as usize] as usize;
                // SAFETY: the step inputs at these dims.
                let ints = |i: usize, n: usize| unsafe {
                    std::slice::from_raw_parts(args[i].cast::<i32>().cast_const(), n)
                };
                let seqs = mla::Seqs {
                    lookup: ints(5, batch * pages_per_seq),
                    cache_lengths: ints(6, batch),
                    offsets: ints(7, batch + 1),
                    context_lengths: ints(8, batch),
                    pages_per_seq,
                };
                let (h, lat) = (heads as usize, (head_dim - rope) as usize);
                let w_uk = self.param_f32(buffers[2], args[2], h * lat * nope as usize);
                let w_uv = self.param_f32(buffers[3], args[3], h * value as usize * lat);
                let shape = mla::Shape {
                    cache: body
                        .kv_view()
                        .expect("a latent attention kernel has a KV view"),
                    heads: h,
                    rope: rope as usize,
                    nope: nope as usize,
                    value: value as usize,
                    scale,
                };
                // SAFETY: the step inputs were checked (`checked_dims`): offsets, cache lengths
                // and the pages they use lie inside the buffers and the cache.
                unsafe {
                    mla::decompressed(
                        args[0].cast::<f32>().cast_const(),
                        args[1].cast::<f32>().cast_const(),
                        (w_uk, w_uv),
                        args[4].cast::<u8>().cast_const(),
                        args[9].cast::<f32>(),
                        &seqs,
                        shape,
                    )
                };
            }
            KernelBody::AllReduce { rows, cols } => {
                let n = rows_of(rows) * *cols as usize;
                let comm = self.comm.as_ref().ok_or_else(|| {
                    RuntimeError::Input(
                        "this program is one rank of a tensor-parallel group: open the artifact's `decoder` role, which runs every rank".into(),
                    )
                })?;
                // SAFETY: x and out hold rows × cols f32 (they may be the same bytes: copy
                // handles overlap).
                let out = unsafe {
                    std::ptr::copy(args[0].cast::<f32>().cast_const(), args[1].cast::<f32>(), n);
                    std::slice::from_raw_parts_mut(args[1].cast::<f32>(), n)
                };
                comm.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .all_reduce_sum(out)?;
            }
            KernelBody::AllGather { rows, cols, ranks } => {
                let (rows, cols, ranks) = (rows_of(rows), *cols as usize, *ranks as usize);
                let comm = self.comm.as_ref().ok_or_else(|| {
                    RuntimeError::Input(
                        "this program is one rank of a tensor-parallel group: open the artifact's `decoder` role, which runs every rank".into(),
                    )
                })?;
                // SAFETY: x holds rows × cols f32 and out rows × ranks · cols, apart.
                let (x, out) = unsafe {
                    (
                        std::slice::from_raw_parts(args[0].cast::<f32>().cast_const(), rows * cols),
                        std::slice::from_raw_parts_mut(args[1].cast::<f32>(), rows * cols * ranks),
                    )
                };
                // The gather gives each rank's rows in turn; each row takes its ranks' pieces.
                let mut all = vec![0f32; rows * cols * ranks];
                comm.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .all_gather(x, &mut all)?;
                for (p, part) in all.chunks_exact((rows * cols).max(1)).enumerate() {
                    for r in 0..rows {
                        out[(r * ranks + p) * cols..][..cols]
                            .copy_from_slice(&part[r * cols..(r + 1) * cols]);
                    }
                }
            }
            other => unreachable!("{} is generated on the CPU", other.kind()),
        }
        Ok(())
    }

    fn param_f32(&self, buffer: u32, ptr: *mut u8, elems: usize) -> &[f32] {
        match self.params.get(&buffer) {
            Some(p) => p.as_f32(elems),
            // SAFETY: a non-weight operand of a library kernel is an f32 activation.
            None => unsafe { std::slice::from_raw_parts(ptr.cast::<f32>(), elems) },
        }
    }
}

/// Copies `values` to the start of `buf` and zeroes the rest (stale indices of an earlier step
/// never reach a kernel).
fn fill<T: Copy + Default>(buf: &mut [T], values: &[T]) {
    let n = values.len().min(buf.len());
    buf[..n].copy_from_slice(&values[..n]);
    buf[n..].fill(T::default());
}

/// A weight the CPU executor repacked ([`CpuExecutor::repacked_weights`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RepackedWeight {
    /// Its buffer in the program.
    pub buffer: u32,
    /// The format and bytes the artifact stores it in.
    pub stored: DType,
    pub stored_bytes: usize,
    /// The format, bytes and layout the matmuls read it in.
    pub read_as: DType,
    pub read_bytes: usize,
    pub layout: maxc_kernels::matmul::Layout,
}

/// The most bytes of stored weights [`Repack`] repacks unless `MAXC_REPACK=1`: small
/// models (where Q5_0 is llama-quantize's fallback for rows that K-quants do not divide, as
/// in SmolLM2 and Gemma 3 270M) decode compute-bound, and their larger repacked weights cost
/// little memory; a large Q5_0 model's would cost gigabytes, and on a machine with many cores
/// its decode is bandwidth-bound, where Q5_0's fewer bytes win.
const REPACK_MAX_BYTES: usize = 512 << 20;

/// The repacked weights and which of [`Repack::chosen`] were written (`None`: no memory for
/// them).
type Made = Option<(crate::hugemem::HugeBuf, Vec<bool>)>;

/// What the repacking thread reads and writes for one weight.
struct Job {
    /// The stored bytes' address and length, and their format.
    ptr: usize,
    len: usize,
    dtype: DType,
    chosen: Chosen,
}

/// A weight chosen to be repacked.
#[derive(Clone, Copy, Debug)]
struct Chosen {
    buffer: u32,
    /// The format and layout it is repacked into.
    to: matmul::Repacking,
    /// Its shape, `[n, k]`.
    n: usize,
    k: usize,
    /// Its offset and bytes in the repacked weights.
    at: usize,
    len: usize,
}

/// The weights that only library matmuls read, repacked into the form they read faster
/// ([`matmul::repacking`]: Q5_0 as Q8_0, the same values; with AVX-512, bf16, f16 and Q8_0 in
/// panels of 32 columns), where the stored bytes of those that grow are at most
/// [`REPACK_MAX_BYTES`] in all; `MAXC_REPACK=0` (or `MAXC_MAP_WEIGHTS`, which keeps the
/// file's pages shared) keeps every weight as stored, `=1` repacks whatever the size. A weight that another kernel reads (a generated matmul, an embedding
/// gather) stays as stored, except a table gathered from panels, whose gather then runs the
/// library kernel.
///
/// The repacked weights lie one after another in one buffer of huge pages, made by a thread of
/// their own behind the first step, as the artifact's huge-page copy is: a fresh page costs
/// its first touch (on a 2-core guest, making SmolLM2 Q4_K_M's 83 MB at load took 50-100 ms
/// of a 0.2 s start to the first token). Rows of the same values (Q5_0 as Q8_0): until they
/// are made, the steps read the stored weights, and the executor moves to them at a step
/// boundary. Panels, whose sums round otherwise than the stored rows', are made on as many
/// threads as the steps run on, and the second step waits for them: the first step reads the
/// rows, every later one the panels, whatever the repack's pace. Then the executor moves to
/// the artifact's copy (which leaves the repacked weights' stored bytes out).
struct Repack {
    chosen: Vec<Chosen>,
    /// The gather kernels that read a weight repacked in panels (they run the library's).
    gathers: Vec<u32>,
    /// Bytes of the repacked weights.
    total: usize,
    /// What the thread made, once it is done.
    made: std::sync::mpsc::Receiver<Made>,
    /// The thread's end of `made`, until it starts.
    send: Option<std::sync::mpsc::Sender<Made>>,
}

impl Repack {
    /// The weights of `params` to repack, if any.
    fn choose(
        program: &Program,
        choices: &[KernelChoice],
        foreign: &std::collections::BTreeSet<u32>,
        params: &BTreeMap<u32, Param>,
        kernels: &KernelOptions,
    ) -> Option<Repack> {
        let mode = std::env::var("MAXC_REPACK").unwrap_or_default();
        // A kept mapping's pages are shared by the processes serving one artifact; a repacked
        // copy would be each one's own.
        let mapped = std::env::var_os("MAXC_MAP_WEIGHTS").is_some_and(|v| !v.is_empty());
        if mode == "0" || mapped {
            return None;
        }
        // Each param's readers: repackable while every one is a library matmul's weight, or
        // (into panels, which the library gather reads too) a gather's table: the gather then
        // runs the library kernel.
        let mut only_matmuls: BTreeMap<u32, bool> = BTreeMap::new();
        let mut gathers: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for l in &program.launches {
            let body = &program.kernels[l.kernel as usize].body;
            let library_matmul = matches!(body, KernelBody::Matmul { .. })
                && choices[l.kernel as usize] == KernelChoice::Library;
            let gather = matches!(body, KernelBody::Gather { .. });
            for (i, b) in l.buffers.iter().enumerate() {
                if params.contains_key(b) {
                    let ok = (library_matmul && i == 1) || (gather && i == 0);
                    *only_matmuls.entry(*b).or_insert(true) &= ok;
                    if gather && i == 0 {
                        gathers.entry(*b).or_default().push(l.kernel);
                    }
                }
            }
        }
        let mut gather_kernels = Vec::new();
        let mut chosen = Vec::new();
        let (mut grown, mut total) = (0usize, 0usize);
        for (buffer, ok) in only_matmuls {
            let p = &params[&buffer];
            let Some(plan) = p.plan.as_ref() else {
                continue;
            };
            let Some(to) = matmul::repacking(p.dtype, kernels) else {
                continue;
            };
            let panels = to.layout == matmul::Layout::Columns;
            if !ok || foreign.contains(&buffer) || (gathers.contains_key(&buffer) && !panels) {
                continue;
            }
            gather_kernels.extend(gathers.get(&buffer).into_iter().flatten());
            let k = plan.k();
            let row = p.dtype.bytes_for(k as u64).unwrap_or(0) as usize;
            if row == 0 || !p.len.is_multiple_of(row) {
                continue;
            }
            let n = p.len / row;
            let len = matmul::repacked_len(to, n, k);
            chosen.push(Chosen {
                buffer,
                to,
                n,
                k,
                at: total,
                len,
            });
            if len > p.len + p.len / 8 {
                grown += p.len;
            }
            // Each weight starts on a cache line.
            total = (total + len).next_multiple_of(64);
        }
        if chosen.is_empty() || (grown > REPACK_MAX_BYTES && mode != "1") {
            return None;
        }
        gather_kernels.sort_unstable();
        gather_kernels.dedup();
        let (send, made) = std::sync::mpsc::channel();
        Some(Repack {
            gathers: gather_kernels,
            chosen,
            total,
            made,
            send: Some(send),
        })
    }

    /// Starts the thread that makes the repacked weights from the stored ones of `params`
    /// (once).
    fn start(&mut self, params: &BTreeMap<u32, Param>, artifact: &Arc<Artifact>, threads: usize) {
        let Some(send) = self.send.take() else {
            return;
        };
        let jobs = self.jobs(params);
        let total = self.total;
        // Panels are waited for by the second step (`CpuExecutor::execute`): made on as many
        // threads as the steps run on.
        let threads = if self.changes_values() { threads } else { 1 };
        // The stored bytes live in the artifact's weights, which the thread keeps alive.
        let artifact = Arc::clone(artifact);
        let spawned = std::thread::Builder::new()
            .name("maxc-repack".into())
            .spawn(move || {
                let _artifact = artifact;
                // The kernels' width ignores this one-off competition.
                let _own = maxc_kernels::pool::own_work();
                // SAFETY: the jobs' stored bytes live in the artifact's weights (kept alive
                // above).
                let made = unsafe { make(&jobs, total, threads) };
                // (An executor dropped meanwhile no longer wants them.)
                let _ = send.send(made);
            });
        if let Err(e) = spawned {
            tracing::warn!("weights stay as stored: no thread to repack them ({e})");
        }
    }

    /// What the repacking reads and writes, from the weights' stored bytes in `params`.
    fn jobs(&self, params: &BTreeMap<u32, Param>) -> Vec<Job> {
        self.chosen
            .iter()
            .map(|c| {
                let p = &params[&c.buffer];
                Job {
                    ptr: p.ptr as usize,
                    len: p.len,
                    dtype: p.dtype,
                    chosen: *c,
                }
            })
            .collect()
    }

    /// Whether the repacked weights give other roundings than the stored ones (panels do;
    /// Q5_0 as Q8_0 by rows gives the same bits).
    fn changes_values(&self) -> bool {
        self.chosen
            .iter()
            .any(|c| c.to.layout != matmul::Layout::Rows)
    }
}

/// Repacks `jobs` into a fresh buffer of `total` bytes on `threads` threads (each a share of
/// the weights, by bytes); `None` where the memory is not there.
///
/// # Safety
/// Each job's `ptr` points at `len` readable bytes for the whole call.
unsafe fn make(jobs: &[Job], total: usize, threads: usize) -> Made {
    let start = std::time::Instant::now();
    let mut buf = crate::hugemem::HugeBuf::zeroed(total).ok()?;
    // Each job's destination, cut from the buffer in order (the offsets ascend).
    let mut rest = buf.as_mut_slice();
    let mut cut = 0;
    let mut dsts = Vec::with_capacity(jobs.len());
    for j in jobs {
        let (_, tail) = rest.split_at_mut(j.chosen.at - cut);
        let (dst, tail) = tail.split_at_mut(j.chosen.len);
        dsts.push(dst);
        rest = tail;
        cut = j.chosen.at + j.chosen.len;
    }
    let run = |j: &Job, dst: &mut [u8]| {
        let c = &j.chosen;
        // SAFETY: as the function says.
        let src = unsafe { std::slice::from_raw_parts(j.ptr as *const u8, j.len) };
        matmul::repack(j.dtype, c.to, src, dst, c.n, c.k)
    };
    let mut wrote = vec![false; jobs.len()];
    let threads = threads.clamp(1, jobs.len().max(1));
    if threads == 1 {
        for ((j, dst), w) in jobs.iter().zip(dsts).zip(&mut wrote) {
            *w = run(j, dst);
        }
    } else {
        // Job `i` to thread `i % threads`: weights of a model's layers come in the same few
        // shapes, so the shares' bytes are close.
        let mut shares: Vec<Vec<(usize, &Job, &mut [u8])>> =
            (0..threads).map(|_| Vec::new()).collect();
        for (i, (j, dst)) in jobs.iter().zip(dsts).enumerate() {
            shares[i % threads].push((i, j, dst));
        }
        let done: Vec<(usize, bool)> = std::thread::scope(|scope| {
            let handles: Vec<_> = shares
                .into_iter()
                .map(|share| {
                    scope.spawn(move || {
                        share
                            .into_iter()
                            .map(|(i, j, dst)| (i, run(j, dst)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        for (i, ok) in done {
            wrote[i] = ok;
        }
    }
    tracing::debug!(
        weights = jobs.len(),
        bytes = total,
        threads,
        ms = start.elapsed().as_secs_f64() * 1e3,
        "weights repacked"
    );
    Some((buf, wrote))
}

/// What runs one kernel of a program on this CPU, chosen when the executor is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelChoice {
    /// The artifact's generated code.
    Generated,
    /// The runtime's library kernel ([`maxc_kernels`]).
    Library,
    /// The generated code for steps of `2..=max` rows, the library kernel for the others
    /// (a matmul under the artifact's row policy where this CPU has no hand kernels).
    GeneratedRows(u64),
}

impl KernelChoice {
    /// The choice for `body` with or without generated code, under the artifact's matmul row
    /// policy (`None`: generated code wherever it exists) made for this CPU.
    fn of(body: &KernelBody, generated: bool, policy: Option<u64>) -> Self {
        if !generated {
            return KernelChoice::Library;
        }
        match (body, policy) {
            // Under the auto policy, the library's blocked attention where it runs, and its
            // sixteen-lane elementwise kernel.
            (KernelBody::Attention { .. }, Some(_)) if attention_library() => KernelChoice::Library,
            (KernelBody::Elementwise { .. }, Some(_)) if library_elementwise(body) => {
                KernelChoice::Library
            }
            (KernelBody::Matmul { .. }, Some(max)) if max < 2 => KernelChoice::Library,
            (KernelBody::Matmul { .. }, Some(max)) => KernelChoice::GeneratedRows(max),
            _ => KernelChoice::Generated,
        }
    }

    /// In words, as `maxc profile` prints it.
    pub fn describe(&self) -> String {
        match self {
            KernelChoice::Generated => "generated".into(),
            KernelChoice::Library => "library".into(),
            KernelChoice::GeneratedRows(max) => {
                format!("generated for 2..={max} rows, library otherwise")
            }
        }
    }
}

/// Whether the library's blocked attention runs on this CPU (under the auto policy).
fn attention_library() -> bool {
    #[cfg(target_arch = "x86_64")]
    return attention::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the library's sixteen-lane kernel runs this elementwise kernel (under the auto
/// policy): where the register tiles run and the program and its inputs are within its bounds.
fn library_elementwise(body: &KernelBody) -> bool {
    #[cfg(target_arch = "x86_64")]
    if let KernelBody::Elementwise {
        program, inputs, ..
    } = body
    {
        return isa::tiles_available()
            && program.len() <= ew::MAX_PROGRAM
            && inputs.len() <= ew::MAX_INPUTS;
    }
    let _ = body;
    false
}

fn run_generated(
    f: KernelFn,
    body: &KernelBody,
    args: &[*mut u8],
    dims: &[u64; StepDim::COUNT],
    threads: usize,
) {
    let extent = body.parallel_extent(dims);
    if extent == 0 {
        return;
    }
    let p = SendPtrs(args.as_ptr().cast(), dims.as_ptr());
    // Splitting costs a few microseconds: only worth it for kernels with real work.
    let chunks = if body.work(dims) >= 1 << 16 {
        threads.min(extent as usize) as u64
    } else {
        1
    };
    if chunks <= 1 {
        // SAFETY: arguments follow the kernel's documented buffer order and sizes.
        unsafe { f(p.0, p.1, 0, extent) };
        return;
    }
    pool::run(chunks as usize, &|c| {
        let c = c as u64;
        let (start, end) = (extent * c / chunks, extent * (c + 1) / chunks);
        // SAFETY: as above; the slices [start, end) are disjoint.
        unsafe { p.call(f, start, end) };
    });
}

/// When decode steps run co-driven (`codrive.rs`): `MAXC_CODRIVE=0` never, `always` at every
/// width above one (for tests and measurements), otherwise where the pool's threads share
/// their CPUs with other processes (it leads or pairs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CodriveMode {
    Off,
    Shared,
    Always,
}

impl CodriveMode {
    fn get() -> Self {
        static MODE: std::sync::OnceLock<CodriveMode> = std::sync::OnceLock::new();
        *MODE.get_or_init(|| match std::env::var("MAXC_CODRIVE").as_deref() {
            Ok("0") => CodriveMode::Off,
            Ok("always") => CodriveMode::Always,
            _ => CodriveMode::Shared,
        })
    }
}
