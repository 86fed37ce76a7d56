//! One role of an artifact on one device, ready to run steps: [`Engine`], and the interface
//! the scheduler drives it through, [`StepExecutor`]. An engine holds no KV bookkeeping: each
//! step's inputs (pages included) come from its caller's page table, which the scheduler owns
//! (a [`crate::session::Session`] pairs one with an engine for direct use).

use crate::artifact::Artifact;
use crate::cpu::CpuExecutor;
use crate::cuda::CudaExecutor;
use crate::error::{Result, RuntimeError};
use crate::kv::PageTable;
use crate::logits::Logits;
use crate::profile::{GpuProfiling, StepProfile};
use crate::schema::{Program, StepDim, StepInputs, TOKENIZER_FILE};
use maxc_kernels::options::KernelOptions;
use std::path::Path;
use std::sync::Arc;

/// Where an engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU executor (native code from the artifact).
    #[default]
    Cpu,
    /// The CUDA executor (PTX from the artifact), on GPU 0.
    Cuda,
}

impl Device {
    /// Where this device's executor wants the artifact's weights kept.
    pub fn weight_memory(self) -> crate::artifact::WeightMemory {
        match self {
            Device::Cpu => crate::artifact::WeightMemory::for_cpu(),
            // Uploaded once: a host copy would only hold memory.
            Device::Cuda => crate::artifact::WeightMemory::Mapped,
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            other => Err(format!("unknown device `{other}` (expected cpu or cuda)")),
        }
    }
}

// One per engine, made once and never moved in a step: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum Executor {
    Cpu(CpuExecutor),
    Cuda(CudaExecutor),
}

impl Executor {
    fn execute(&mut self, s: &StepInputs) -> Result<Logits> {
        match self {
            Executor::Cpu(e) => e.execute(s),
            Executor::Cuda(e) => e.execute(s),
        }
    }
    fn program(&self) -> &Program {
        match self {
            Executor::Cpu(e) => e.program(),
            Executor::Cuda(e) => e.program(),
        }
    }
    fn bounds(&self) -> &[u64; StepDim::COUNT] {
        match self {
            Executor::Cpu(e) => e.bounds(),
            Executor::Cuda(e) => e.bounds(),
        }
    }
    fn artifact(&self) -> &Arc<Artifact> {
        match self {
            Executor::Cpu(e) => e.artifact(),
            Executor::Cuda(e) => e.artifact(),
        }
    }
}

/// What a scheduler must know of the role it runs: the program's bounds and outputs, and
/// the model's end-of-sequence tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoleInfo {
    /// Vocabulary size (logit columns; token ids lie below it).
    pub vocab_size: usize,
    /// Longest context of a sequence.
    pub max_seq_len: usize,
    /// Most token rows in one step.
    pub max_step_tokens: usize,
    /// Most sequences in one step (every data-parallel replica's).
    pub max_batch_size: usize,
    /// Tokens per KV page.
    pub page_size: usize,
    /// Pages in the KV cache.
    pub total_pages: usize,
    /// Lookup-table columns: pages one sequence may hold in one page group.
    pub pages_per_seq: usize,
    /// Each KV page group's sliding window (`None`: full attention), in lookup-table order.
    pub kv_windows: Vec<Option<usize>>,
    /// Most logit rows one step returns (the `logit_rows` bound: the length of its
    /// [`StepInputs::logit_indices`]).
    pub max_logit_rows: usize,
    /// Most rows a step verifies per sequence: the artifact's `num_speculative_tokens` plus one
    /// (every sequence of a full batch can return this many).
    pub max_return_n_logits: usize,
    /// End-of-sequence token ids.
    pub eos_token_ids: Vec<i64>,
    /// The sha256 of the tokenizer the model was compiled with, where it has one.
    pub tokenizer_sha256: Option<String>,
}

impl RoleInfo {
    /// An empty page table the size of this role's KV cache.
    pub fn page_table(&self) -> PageTable {
        PageTable::with_groups(
            self.total_pages,
            self.page_size,
            self.pages_per_seq,
            self.kv_windows.clone(),
        )
    }
}

/// A step whose launches every thread of a loop of co-driven steps walks
/// (`maxc_kernels::pool::drive_loop`): begun by [`StepExecutor::begin`], ended by
/// [`StepExecutor::finish`] once done.
pub trait StepWalk: Send + Sync {
    /// Computes the step's launches not yet done on this thread, joined with the others' walks;
    /// returns once every launch is done (by some thread) or one failed.
    fn walk(&self);
    /// Whether every launch is done (or one failed).
    fn done(&self) -> bool;
}

/// Runs `part` on the calling thread and on the CPU executor's helper threads at once, each
/// calling it once (`true` on the calling thread): the threads of a loop of co-driven steps,
/// any of which begins the next step ([`StepExecutor::begin`]) and all of which walk it.
/// Returns once the calling thread's part has returned and no other thread is inside `part`.
/// Inside `part`, work outside a step's launches runs on its thread alone.
pub fn drive_loop(part: &(dyn Fn(bool) + Sync)) {
    maxc_kernels::pool::drive_loop(part);
}

/// Runs whole steps of one role: what the scheduler needs of an executor. [`Engine`] is the
/// real one; the scheduler's tests drive it with fakes.
pub trait StepExecutor: Send {
    /// The role's bounds and tokens.
    fn info(&self) -> &RoleInfo;

    /// Runs one step whose pages its caller has allocated; returns its logit rows (see
    /// [`StepInputs::logit_indices`]). A step that fails leaves the KV cache's contents
    /// for the step's rows undefined: its caller rolls the step back.
    fn execute(&mut self, inputs: &StepInputs) -> Result<Logits>;

    /// Whether decode steps now run co-driven, in a loop of steps any of whose threads begins
    /// the next ([`StepExecutor::begin`]): where the executor's threads share their CPUs with
    /// other processes.
    fn loops(&self) -> bool {
        false
    }

    /// Begins a step (as [`StepExecutor::execute`] runs one) whose launches the threads of a
    /// loop of co-driven steps walk, where this executor runs it so now; `None` where it does
    /// not (the caller then runs it with `execute`). Called inside the loop's body, on any of
    /// its threads.
    fn begin(&mut self, _inputs: &StepInputs) -> Result<Option<std::sync::Arc<dyn StepWalk>>> {
        Ok(None)
    }

    /// Ends the step [`StepExecutor::begin`] began, once its walk is done: its logit rows.
    fn finish(&mut self) -> Result<Logits> {
        Err(RuntimeError::Input("this executor begins no steps".into()))
    }

    /// Rows `rows` of the last step's final hidden states (`[width]` each, the decoder's
    /// `hidden_states` output), for embeddings; `None` where the executor or program has none.
    fn hidden_states(&mut self, _rows: std::ops::Range<usize>) -> Option<Vec<f32>> {
        None
    }

    /// Times every kernel launch of the following steps, where the executor can.
    fn set_profiling(&mut self, on: bool) -> Result<()> {
        if on {
            return Err(RuntimeError::Target(
                "this executor does not time its launches".into(),
            ));
        }
        Ok(())
    }

    /// NVTX ranges around passes and launches (`gpu_profiling`), where the executor has them.
    fn set_gpu_profiling(&mut self, _level: GpuProfiling) {}

    /// The per-launch timings of the last step, while profiling.
    fn last_profile(&self) -> Option<&StepProfile> {
        None
    }

    /// The program it runs, where it runs one (kernel names for traces).
    fn program(&self) -> Option<&Program> {
        None
    }
}

/// One role of an artifact on one device, ready to run steps. `Send`, so a scheduler thread
/// can own it.
pub struct Engine {
    exec: Executor,
    /// Tensor-parallel ranks 1.. of the role, where the artifact has several (rank 0 is
    /// `exec`): each runs its program beside rank 0's on a thread of its own, every step.
    peers: Vec<CpuExecutor>,
    /// Whether ranks 1.. run in other processes (started by `mpirun`), which [`follow`] this
    /// engine's steps: each step's inputs are broadcast to them first.
    remote: bool,
    info: RoleInfo,
    kernels: KernelOptions,
}

impl Engine {
    /// Opens the artifact at `dir` and prepares `role` on the CPU.
    pub fn open(dir: &Path, role: &str) -> Result<Self> {
        Engine::open_on(dir, role, Device::Cpu)
    }

    /// Opens the artifact at `dir` and prepares `role` on `device`.
    pub fn open_on(dir: &Path, role: &str, device: Device) -> Result<Self> {
        Engine::open_verified(dir, role, device, None, KernelOptions::default())
    }

    /// [`Engine::open_on`], refusing an artifact whose manifest is not signed by `key` where
    /// one is given ([`Artifact::open_verified`]), the CPU's library kernels chosen by
    /// `kernels`.
    pub fn open_verified(
        dir: &Path,
        role: &str,
        device: Device,
        key: Option<&ed25519_dalek::VerifyingKey>,
        kernels: KernelOptions,
    ) -> Result<Self> {
        Engine::with_kernels(
            Arc::new(Artifact::open_verified(dir, key, device.weight_memory())?),
            role,
            device,
            kernels,
        )
    }

    /// Prepares `role` of an opened artifact on `device`.
    pub fn new(artifact: Arc<Artifact>, role: &str, device: Device) -> Result<Self> {
        Engine::with_kernels(artifact, role, device, KernelOptions::default())
    }

    /// [`Engine::new`], the CPU's library kernels chosen by `kernels` (the CUDA executor has
    /// no choices to make).
    pub fn with_kernels(
        artifact: Arc<Artifact>,
        role: &str,
        device: Device,
        kernels: KernelOptions,
    ) -> Result<Self> {
        if role == crate::schema::ep_init::ROLE {
            return Err(RuntimeError::Input(format!(
                "role `{role}` runs once at load, on each expert-parallel rank, to set up the exchange; it runs no steps (run the `decoder` role)"
            )));
        }
        if device == Device::Cuda {
            if let Some(plan) =
                crate::cpu::ep::EpPlan::from_records(&artifact.manifest.export_records)?
            {
                return Err(RuntimeError::Target(format!(
                    "{}: compiled for expert-parallel degree {}; the CUDA executor has no exchange between GPUs yet (the NCCL/NVSHMEM plan is in runtime/docs/expert-parallelism.md); run it with --device cpu, or compile with --expert-parallel-degree 1 for one GPU",
                    artifact.dir.display(),
                    plan.degree
                )));
            }
        }
        let tp = tensor_parallel_degree(&artifact)?;
        if tp > 1 && role.contains("@tp") {
            return Err(RuntimeError::Input(format!(
                "role `{role}` is one rank of a tensor-parallel group of {tp}; open `decoder`, which runs every rank"
            )));
        }
        let mut peers = Vec::new();
        let group = Group::of(&artifact)?;
        let world = if group.ranks() > 1 && device == Device::Cpu && role == "decoder" {
            crate::comm::take_world()
        } else {
            None
        };
        let remote = world.is_some();
        let exec = match device {
            Device::Cpu if world.is_some() => {
                let mut world = world.expect("checked");
                if let Err(e) = group.check_launch(&artifact, world.rank(), world.size(), true) {
                    crate::comm::set_world(world);
                    return Err(e);
                }
                // The other ranks open their share of the same role, then follow its steps.
                let mut open = OPEN.to_vec();
                open.extend_from_slice(role.as_bytes());
                world.broadcast(&mut open, 0)?;
                match CpuExecutor::in_group(artifact.clone(), role, kernels, world) {
                    Ok(e) => Executor::Cpu(e),
                    Err(e) => {
                        // Nothing to hand back: the group's communicator went with the failed
                        // executor, and this process ends with the error (mpirun ends the job).
                        return Err(e);
                    }
                }
            }
            Device::Cpu if tp > 1 && role == "decoder" => {
                let mut comms = crate::comm::LocalGroup::ranks(tp).into_iter();
                let mut rank0 = CpuExecutor::new(artifact.clone(), role, kernels)?;
                rank0.set_communicator(Box::new(comms.next().expect("rank 0")));
                for (r, comm) in (1..tp).zip(comms) {
                    let mut e =
                        CpuExecutor::new(artifact.clone(), &format!("{role}@tp{r}"), kernels)?;
                    e.set_communicator(Box::new(comm));
                    peers.push(e);
                }
                Executor::Cpu(rank0)
            }
            Device::Cpu => Executor::Cpu(CpuExecutor::new(artifact.clone(), role, kernels)?),
            Device::Cuda if tp > 1 => {
                return Err(RuntimeError::Target(format!(
                    "{}: compiled for tensor-parallel degree {tp}; the CUDA executor has no collectives between GPUs yet (NCCL); run it with --device cpu",
                    artifact.dir.display()
                )))
            }
            Device::Cuda => Executor::Cuda(CudaExecutor::new(artifact.clone(), role)?),
        };
        let bounds = *exec.bounds();
        let bound = |d: StepDim| bounds[d as usize] as usize;
        let program = exec.program();
        let m = &artifact.manifest;
        let max_logit_rows = bound(StepDim::LogitRows);
        let max_return_n_logits = (m.runtime.num_speculative_tokens as usize + 1)
            .min(max_logit_rows / bound(StepDim::BatchSize).max(1))
            .max(1);
        let info = RoleInfo {
            vocab_size: program.vocab_size as usize,
            max_seq_len: m.runtime.max_seq_len as usize,
            max_step_tokens: bound(StepDim::TotalSeqLen),
            max_batch_size: bound(StepDim::BatchSize),
            page_size: program.page_size() as usize,
            total_pages: bound(StepDim::TotalNumPages),
            pages_per_seq: bound(StepDim::MaxNumPages),
            kv_windows: program
                .kv
                .as_ref()
                .map(|kv| kv.windows().iter().map(|w| w.map(|w| w as usize)).collect())
                .unwrap_or_else(|| vec![None]),
            max_logit_rows,
            max_return_n_logits,
            eos_token_ids: m.eos_token_ids.clone(),
            tokenizer_sha256: m.files.get(TOKENIZER_FILE).map(|f| f.sha256.clone()),
        };
        Ok(Engine {
            exec,
            peers,
            remote,
            info,
            kernels,
        })
    }

    /// The artifact.
    pub fn artifact(&self) -> &Arc<Artifact> {
        self.exec.artifact()
    }

    /// The CPU library kernels' choices this engine was made with.
    pub fn kernels(&self) -> KernelOptions {
        self.kernels
    }

    /// The role's bounds and tokens.
    pub fn info(&self) -> &RoleInfo {
        &self.info
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.info.vocab_size
    }

    /// Longest context.
    pub fn max_seq_len(&self) -> usize {
        self.info.max_seq_len
    }

    /// Most token rows in one step.
    pub fn max_step_tokens(&self) -> usize {
        self.info.max_step_tokens
    }

    /// Most sequences in one step (the `batch_size` bound: every data-parallel replica's).
    pub fn max_batch_size(&self) -> usize {
        self.info.max_batch_size
    }

    /// Most logit rows one step returns.
    pub fn max_logit_rows(&self) -> usize {
        self.info.max_logit_rows
    }

    /// Most logit rows a step returns per sequence: the artifact's `num_speculative_tokens`
    /// plus one, for programs that return the last rows of each sequence.
    pub fn max_return_n_logits(&self) -> usize {
        self.info.max_return_n_logits
    }

    /// Times every kernel launch of the following steps (CPU only).
    pub fn set_profiling(&mut self, on: bool) -> Result<()> {
        match &mut self.exec {
            Executor::Cpu(e) => {
                e.set_profiling(on);
                Ok(())
            }
            Executor::Cuda(_) => Err(RuntimeError::Target(
                "per-kernel profiling runs on the CPU executor only for now".into(),
            )),
        }
    }

    /// `gpu_profiling`: NVTX ranges on the CUDA executor (a missing NVTX library is a warning);
    /// nothing here on the CPU, where the scheduler makes the same structure as spans.
    pub fn set_gpu_profiling(&mut self, level: GpuProfiling) {
        if let Executor::Cuda(e) = &mut self.exec {
            e.set_gpu_profiling(level);
        }
    }

    /// The expert-parallel ranks this engine runs its experts over (1 without expert
    /// parallelism), as the artifact records them.
    pub fn expert_parallel_degree(&self) -> usize {
        match &self.exec {
            Executor::Cpu(e) => e.ep_plan().map_or(1, |p| p.degree),
            Executor::Cuda(_) => {
                crate::cpu::ep::EpPlan::from_records(&self.artifact().manifest.export_records)
                    .ok()
                    .flatten()
                    .map_or(1, |p| p.degree)
            }
        }
    }

    /// Refuses to run where the deployment asks for `degree` ranks and the artifact was
    /// compiled for another number.
    pub fn require_expert_parallel_degree(&self, degree: usize) -> Result<()> {
        let have = self.expert_parallel_degree();
        if have != degree {
            return Err(RuntimeError::Input(format!(
                "{}: compiled for expert-parallel degree {have} (its records), asked to run at {degree}; recompile with --expert-parallel-degree {degree}",
                self.artifact().dir.display()
            )));
        }
        Ok(())
    }

    /// What runs each kernel of the program on the CPU (chosen at load, in kernel order);
    /// `None` on another device.
    pub fn cpu_kernel_choices(&self) -> Option<&[crate::cpu::KernelChoice]> {
        match &self.exec {
            Executor::Cpu(e) => Some(e.kernel_choices()),
            Executor::Cuda(_) => None,
        }
    }

    /// How each weight a library matmul reads runs at each row count on the CPU (chosen at
    /// load; buffer id and plan, in buffer order); `None` on another device.
    pub fn cpu_matmul_plans(&self) -> Option<Vec<(u32, &maxc_kernels::matmul::MatmulPlan)>> {
        match &self.exec {
            Executor::Cpu(e) => Some(e.matmul_plans()),
            Executor::Cuda(_) => None,
        }
    }

    /// The weights the CPU executor repacked (behind the first step) into a format its matmuls read faster:
    /// stored format and bytes, read format and bytes; `None` on another device.
    pub fn cpu_repacked_weights(&self) -> Option<Vec<crate::cpu::executor::RepackedWeight>> {
        match &self.exec {
            Executor::Cpu(e) => Some(e.repacked_weights()),
            Executor::Cuda(_) => None,
        }
    }

    /// Blocks until what CPU steps start behind the first one is made (the weights' huge-page
    /// copy and the repacked weights), and moves to them: benchmarks measure after this.
    pub fn settle_weights(&mut self) {
        if let Executor::Cpu(e) = &mut self.exec {
            e.settle_weights_now();
        }
    }

    /// Whether the CPU executor's weight pointers have moved to the artifact's huge-page copy
    /// of [`crate::artifact::WeightMemory::Staged`] weights (false before, elsewhere, and on
    /// another device).
    pub fn on_staged_weights(&self) -> bool {
        match &self.exec {
            Executor::Cpu(e) => e.on_staged_weights(),
            Executor::Cuda(_) => false,
        }
    }

    /// The per-launch timings of the last step, while profiling.
    pub fn last_profile(&self) -> Option<&StepProfile> {
        match &self.exec {
            Executor::Cpu(e) => e.last_profile(),
            Executor::Cuda(_) => None,
        }
    }

    /// The program of this engine's role.
    pub fn program(&self) -> &Program {
        self.exec.program()
    }

    /// Runs one step (see [`StepExecutor::execute`]).
    pub fn execute(&mut self, inputs: &StepInputs) -> Result<Logits> {
        self.run_step(inputs)
    }

    /// Tensor-parallel ranks of the role (1 without tensor parallelism).
    pub fn tensor_parallel_degree(&self) -> usize {
        match &self.exec {
            Executor::Cpu(e) if self.remote => e.with_communicator(|c| c.size()).unwrap_or(1),
            _ => 1 + self.peers.len(),
        }
    }

    /// One step on every rank: rank 0 here, the others on threads of their own, their
    /// all-reduces meeting in the ranks' communicators. Rank 0's logits (the ranks' are the
    /// same). A rank that fails ends the group's collectives, so that the others fail at
    /// once rather than wait for it; the error names the rank.
    fn run_step(&mut self, inputs: &StepInputs) -> Result<Logits> {
        if self.remote {
            let Executor::Cpu(rank0) = &mut self.exec else {
                unreachable!("tensor-parallel ranks run on the CPU")
            };
            let mut bytes = inputs.to_bytes();
            rank0
                .with_communicator(|c| c.broadcast(&mut bytes, 0))
                .expect("rank 0 has its communicator")?;
            let r = rank0.execute(inputs);
            if let Err(e) = &r {
                if ends_the_group(e) {
                    rank0.abort_collectives(&e.to_string());
                }
            }
            return r;
        }
        if self.peers.is_empty() {
            return self.exec.execute(inputs);
        }
        let Executor::Cpu(rank0) = &mut self.exec else {
            unreachable!("tensor-parallel ranks run on the CPU")
        };
        let peers = &mut self.peers;
        std::thread::scope(|scope| {
            let handles: Vec<_> = peers
                .iter_mut()
                .map(|p| {
                    scope.spawn(move || {
                        let r = p.execute(inputs);
                        if let Some(e) = r.as_ref().err().filter(|e| ends_the_group(e)) {
                            p.abort_collectives(&e.to_string());
                        }
                        r
                    })
                })
                .collect();
            let mine = rank0.execute(inputs);
            if let Some(e) = mine.as_ref().err().filter(|e| ends_the_group(e)) {
                rank0.abort_collectives(&e.to_string());
            }
            let mut first_err = mine.as_ref().err().map(|e| e.to_string());
            for (i, h) in handles.into_iter().enumerate() {
                let r = h.join().unwrap_or_else(|_| {
                    Err(RuntimeError::Collective(format!(
                        "tensor-parallel rank {} panicked",
                        i + 1
                    )))
                });
                if let (Err(e), None) = (r, &first_err) {
                    first_err = Some(format!("tensor-parallel rank {}: {e}", i + 1));
                }
            }
            match first_err {
                None => mine,
                Some(_) if mine.is_err() => mine,
                Some(e) => Err(RuntimeError::Collective(e)),
            }
        })
    }
}

impl StepExecutor for Engine {
    fn info(&self) -> &RoleInfo {
        &self.info
    }
    fn execute(&mut self, inputs: &StepInputs) -> Result<Logits> {
        self.run_step(inputs)
    }
    fn loops(&self) -> bool {
        match &self.exec {
            Executor::Cpu(e) => self.peers.is_empty() && !self.remote && e.loops(),
            Executor::Cuda(_) => false,
        }
    }
    fn begin(&mut self, inputs: &StepInputs) -> Result<Option<std::sync::Arc<dyn StepWalk>>> {
        match &mut self.exec {
            // (Tensor-parallel ranks run each step in lockstep on threads of their own.)
            Executor::Cpu(e) if self.peers.is_empty() && !self.remote => e.begin(inputs),
            _ => Ok(None),
        }
    }
    fn finish(&mut self) -> Result<Logits> {
        match &mut self.exec {
            Executor::Cpu(e) => e.finish(),
            Executor::Cuda(_) => Err(RuntimeError::Input("no step was begun".into())),
        }
    }
    fn hidden_states(&mut self, rows: std::ops::Range<usize>) -> Option<Vec<f32>> {
        match &mut self.exec {
            Executor::Cpu(e) => e.output_rows("hidden_states", rows),
            Executor::Cuda(e) => e.output_rows("hidden_states", rows),
        }
    }
    fn set_profiling(&mut self, on: bool) -> Result<()> {
        Engine::set_profiling(self, on)
    }
    fn set_gpu_profiling(&mut self, level: GpuProfiling) {
        Engine::set_gpu_profiling(self, level);
    }
    fn last_profile(&self) -> Option<&StepProfile> {
        Engine::last_profile(self)
    }
    fn program(&self) -> Option<&Program> {
        Some(self.exec.program())
    }
}

impl Drop for Engine {
    /// Ranks in other processes close their share (an empty step), and the group goes back to
    /// this process for the next engine (or [`end_group`]).
    fn drop(&mut self) {
        if let (true, Executor::Cpu(rank0)) = (self.remote, &mut self.exec) {
            if let Some(mut world) = rank0.take_communicator() {
                if world.broadcast(&mut Vec::new(), 0).is_ok() {
                    crate::comm::set_world(world);
                }
            }
        }
    }
}

/// What rank 0 broadcasts when an engine opens: this, then the role's name.
const OPEN: &[u8] = b"\0maxc:open:";
/// What rank 0 broadcasts once it has no more engines to open: the other ranks exit.
const END: &[u8] = b"\0maxc:end";

/// Rank 0 of a group of processes, done with its engines: the other ranks stop following and
/// return from [`follow`]. Does nothing where this process holds no group.
pub fn end_group() {
    if let Some(mut world) = crate::comm::take_world() {
        if world.rank() == 0 {
            let _ = world.broadcast(&mut END.to_vec(), 0);
        }
    }
}

/// Runs rank `comm.rank()` (above 0) of a tensor- or expert-parallel artifact in this process,
/// for each engine rank 0 opens in turn (its role's share, made when rank 0 announces it): each
/// step's inputs come from rank 0's engine by broadcast, and the rank runs its program on them,
/// its collectives meeting rank 0's and the others'. Returns when rank 0 ends the group
/// ([`end_group`]). A step every rank refuses (its inputs) is skipped as rank 0 skips it; any
/// other failure ends the group.
pub fn follow(
    artifact: Arc<Artifact>,
    kernels: KernelOptions,
    mut comm: Box<dyn crate::comm::Communicator>,
) -> Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let group = Group::of(&artifact)?;
    group.check_launch(&artifact, rank, size, false)?;
    loop {
        let mut bytes = Vec::new();
        // However long rank 0 takes to open its next engine.
        comm.broadcast_unbounded(&mut bytes, 0)?;
        if bytes == END {
            return Ok(());
        }
        let role = bytes
            .strip_prefix(OPEN)
            .and_then(|r| std::str::from_utf8(r).ok())
            .ok_or_else(|| {
                RuntimeError::Collective(format!(
                    "rank {rank}: expected rank 0 to open an engine or end the group; it sent {} bytes",
                    bytes.len()
                ))
            })?
            .to_string();
        comm = follow_engine(artifact.clone(), group, &role, kernels, comm)?;
    }
}

/// One engine's life on a following rank: its share of `role`, then each step until rank 0's
/// engine closes (an empty step). Returns the group's communicator for the next.
fn follow_engine(
    artifact: Arc<Artifact>,
    group: Group,
    role: &str,
    kernels: KernelOptions,
    comm: Box<dyn crate::comm::Communicator>,
) -> Result<Box<dyn crate::comm::Communicator>> {
    let rank = comm.rank();
    let role = match group {
        Group::Tensor(_) => format!("{role}@tp{rank}"),
        // Every expert-parallel rank runs the same program; its rank picks its experts.
        Group::Expert(_) => role.to_string(),
    };
    let mut exec = CpuExecutor::in_group(artifact, &role, kernels, comm)?;
    loop {
        let mut bytes = Vec::new();
        // However long rank 0 stays idle (a server without requests).
        exec.with_communicator(|c| c.broadcast_unbounded(&mut bytes, 0))
            .expect("set above")?;
        if bytes.is_empty() {
            return Ok(exec.take_communicator().expect("set above"));
        }
        let inputs = StepInputs::from_bytes(&bytes)?;
        match exec.execute(&inputs) {
            Ok(_) => {}
            // Refused before any collective, as rank 0 refuses it.
            Err(RuntimeError::Input(e)) => tracing::debug!("rank {rank}: step refused: {e}"),
            Err(e) => {
                exec.abort_collectives(&e.to_string());
                return Err(e);
            }
        }
    }
}

/// The ranks an artifact runs as, where it runs as several processes under `mpirun`.
#[derive(Clone, Copy, Debug)]
enum Group {
    /// `tp.degree` tensor-parallel ranks (1: one process).
    Tensor(usize),
    /// `ep.degree` expert-parallel ranks (run in one process without `mpirun`).
    Expert(usize),
}

impl Group {
    fn of(artifact: &Artifact) -> Result<Group> {
        let tp = tensor_parallel_degree(artifact)?;
        match crate::cpu::ep::EpPlan::from_records(&artifact.manifest.export_records)? {
            Some(plan) if tp == 1 => Ok(Group::Expert(plan.degree)),
            _ => Ok(Group::Tensor(tp)),
        }
    }

    fn ranks(self) -> usize {
        match self {
            Group::Tensor(n) | Group::Expert(n) => n,
        }
    }

    /// A launch as rank `rank` of `size` processes must be one of the artifact's ranks, rank 0
    /// leading (`leads`) and the others following.
    fn check_launch(
        self,
        artifact: &Artifact,
        rank: usize,
        size: usize,
        leads: bool,
    ) -> Result<()> {
        if size == self.ranks() && (rank == 0) == leads {
            return Ok(());
        }
        let (kind, n) = match self {
            Group::Tensor(n) => ("tensor", n),
            Group::Expert(n) => ("expert", n),
        };
        Err(RuntimeError::Input(format!(
            "{}: compiled for {kind}-parallel degree {n}, launched as rank {rank} of {size} (mpirun -np {n} runs it)",
            artifact.dir.display()
        )))
    }
}

/// Whether a rank's failed step ends its group's collectives: every failure but a refused
/// step (its inputs, refused by every rank alike before any collective), which leaves the
/// group whole for the next step.
fn ends_the_group(e: &RuntimeError) -> bool {
    !matches!(e, RuntimeError::Input(_))
}

/// The tensor-parallel degree an artifact records (`tp.degree`; 1 without).
fn tensor_parallel_degree(artifact: &Artifact) -> Result<usize> {
    match artifact.manifest.export_records.get("tp.degree") {
        None => Ok(1),
        Some(v) => v
            .as_u64()
            .filter(|&d| d >= 1)
            .map(|d| d as usize)
            .ok_or_else(|| {
                RuntimeError::artifact(
                    &artifact.dir,
                    format!("the export record `tp.degree` is {v}; expected a whole number from 1"),
                )
            }),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_engine_can_move_to_another_thread() {
        fn send<T: Send>() {}
        send::<super::Engine>();
    }
}
