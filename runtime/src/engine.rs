//! An executor with its page table: runs steps of sequences by id, and generates.

use crate::artifact::Artifact;
use crate::cpu::CpuExecutor;
use crate::cuda::CudaExecutor;
use crate::error::{Result, RuntimeError};
use crate::kv::PageTable;
use crate::logits::Logits;
use crate::sampling::{Sampler, SamplingParams};
use crate::schema::StepDim;
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

enum Executor {
    Cpu(CpuExecutor),
    Cuda(CudaExecutor),
}

impl Executor {
    fn execute(&mut self, s: &crate::schema::StepInputs) -> Result<Logits> {
        match self {
            Executor::Cpu(e) => e.execute(s),
            Executor::Cuda(e) => e.execute(s),
        }
    }
    fn program(&self) -> &crate::schema::Program {
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

/// One role of an artifact, ready to run sequences: an executor and the page table of its KV
/// cache. `Send`, so a scheduler thread can own it.
pub struct Engine {
    exec: Executor,
    pages: PageTable,
    max_seq_len: usize,
    max_step_tokens: usize,
}

/// Options of [`Engine::generate`].
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// How tokens are chosen.
    pub sampling: SamplingParams,
    /// Stop at an end-of-sequence token (the manifest's `eos_token_ids`).
    pub stop_at_eos: bool,
}

impl Engine {
    /// Opens the artifact at `dir` and prepares `role` on the CPU.
    pub fn open(dir: &Path, role: &str) -> Result<Self> {
        Engine::open_on(dir, role, Device::Cpu)
    }

    /// Opens the artifact at `dir` and prepares `role` on `device`.
    pub fn open_on(dir: &Path, role: &str, device: Device) -> Result<Self> {
        Engine::open_verified(dir, role, device, None)
    }

    /// [`Engine::open_on`], refusing an artifact whose manifest is not signed by `key` where
    /// one is given ([`Artifact::open_verified`]).
    pub fn open_verified(
        dir: &Path,
        role: &str,
        device: Device,
        key: Option<&ed25519_dalek::VerifyingKey>,
    ) -> Result<Self> {
        Engine::new(
            Arc::new(Artifact::open_verified(dir, key, device.weight_memory())?),
            role,
            device,
        )
    }

    /// Prepares `role` of an opened artifact on `device`.
    pub fn new(artifact: Arc<Artifact>, role: &str, device: Device) -> Result<Self> {
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
        let exec = match device {
            Device::Cpu => Executor::Cpu(CpuExecutor::new(artifact.clone(), role)?),
            Device::Cuda => Executor::Cuda(CudaExecutor::new(artifact.clone(), role)?),
        };
        let rt = &artifact.manifest.runtime;
        let bounds = *exec.bounds();
        let page = exec.program().page_size() as usize;
        let pages = PageTable::new(
            bounds[StepDim::TotalNumPages as usize] as usize,
            page,
            bounds[StepDim::MaxNumPages as usize] as usize,
        );
        Ok(Engine {
            exec,
            pages,
            max_seq_len: rt.max_seq_len as usize,
            max_step_tokens: bounds[StepDim::TotalSeqLen as usize] as usize,
        })
    }

    /// The artifact.
    pub fn artifact(&self) -> &Arc<Artifact> {
        self.exec.artifact()
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.exec.program().vocab_size as usize
    }

    /// Longest context.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// Most token rows in one step.
    pub fn max_step_tokens(&self) -> usize {
        self.max_step_tokens
    }

    /// Most sequences in one step (the `batch_size` bound: every data-parallel replica's).
    pub fn max_batch_size(&self) -> usize {
        self.exec.bounds()[StepDim::BatchSize as usize] as usize
    }

    /// Whether the program returns logits for every token row (else one row per sequence).
    pub fn all_logits(&self) -> bool {
        let p = self.exec.program();
        p.outputs.get("logits").is_some_and(|&o| {
            p.buffers[o as usize].shape.first()
                == Some(&crate::schema::Extent::Step(StepDim::TotalSeqLen))
        })
    }

    /// Tokens cached for `seq`.
    pub fn cached_len(&self, seq: u64) -> usize {
        self.pages.len(seq)
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
    pub fn set_gpu_profiling(&mut self, level: crate::profile::GpuProfiling) {
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

    /// The per-launch timings of the last step, while profiling.
    pub fn last_profile(&self) -> Option<&crate::profile::StepProfile> {
        match &self.exec {
            Executor::Cpu(e) => e.last_profile(),
            Executor::Cuda(_) => None,
        }
    }

    /// The program of this engine's role.
    pub fn program(&self) -> &crate::schema::Program {
        self.exec.program()
    }

    /// The KV cache's page table (read-only: steps and releases go through the engine).
    pub fn pages(&self) -> &PageTable {
        &self.pages
    }

    /// The page table, for the scheduler's prefix cache (sharing and holding full pages).
    pub fn pages_mut(&mut self) -> &mut PageTable {
        &mut self.pages
    }

    /// Keeps the first `len` cached tokens of `seq` (speculative decoding drops rejected
    /// tokens this way); pages past them return to the free list.
    pub fn truncate(&mut self, seq: u64, len: usize) -> Result<()> {
        Ok(self.pages.truncate(seq, len)?)
    }

    /// Most logit rows a step returns per sequence ([`Engine::step_n`]): the artifact's
    /// `num_speculative_tokens` plus one, for programs that return the last rows of each
    /// sequence.
    pub fn max_return_n_logits(&self) -> usize {
        if self.all_logits() {
            return 1;
        }
        let b = self.exec.bounds();
        (b[StepDim::LogitRows as usize] / b[StepDim::BatchSize as usize].max(1)).max(1) as usize
    }

    /// One step: each `(sequence, tokens)` appends a prefill chunk or a decode token; the
    /// logits of each sequence's last row come back (every row's, where the program returns
    /// all). A step that fails (bad input, an executor error) leaves every sequence as it was.
    pub fn step(&mut self, chunks: &[(u64, &[i64])]) -> Result<Logits> {
        self.step_n(chunks, 1)
    }

    /// [`Engine::step`] returning the logits of the last `n` rows of each sequence (row
    /// `b·n + j` is sequence `b`'s `j`-th of its last `n`; zeros in front where it has fewer),
    /// so that one step verifies `n - 1` speculated tokens. `n` is at most
    /// [`Engine::max_return_n_logits`].
    pub fn step_n(&mut self, chunks: &[(u64, &[i64])], n: usize) -> Result<Logits> {
        if n == 0 || n > self.max_return_n_logits() {
            return Err(RuntimeError::Input(format!(
                "return_n_logits is {n}; this artifact returns 1 to {} logit rows per sequence \
                 (compile with --num-speculative-tokens to return more)",
                self.max_return_n_logits()
            )));
        }
        for &(seq, tokens) in chunks {
            let end = self.pages.len(seq) + tokens.len();
            if end > self.max_seq_len {
                return Err(RuntimeError::Input(format!(
                    "sequence {seq} would reach {end} tokens; the artifact's max_seq_len is {}",
                    self.max_seq_len
                )));
            }
        }
        let mut step = self.pages.prepare(chunks)?;
        step.inputs.return_n_logits = n;
        match self.exec.execute(&step.inputs) {
            Ok(logits) => {
                self.pages.commit(step)?;
                Ok(logits)
            }
            Err(e) => {
                self.pages.rollback(step)?;
                Err(e)
            }
        }
    }

    /// Frees `seq`'s cache pages.
    pub fn release(&mut self, seq: u64) {
        self.pages.release(seq);
    }

    /// Prefills `prompt` as sequence `seq` in chunks of at most the step budget; returns the
    /// logits of its last position.
    pub fn prefill(&mut self, seq: u64, prompt: &[i64]) -> Result<Vec<f32>> {
        if prompt.is_empty() {
            return Err(RuntimeError::Input("the prompt is empty".into()));
        }
        if prompt.len() > self.max_seq_len {
            return Err(RuntimeError::Input(format!(
                "the prompt has {} tokens; the artifact's max_seq_len is {}",
                prompt.len(),
                self.max_seq_len
            )));
        }
        let mut last = Vec::new();
        for chunk in prompt.chunks(self.max_step_tokens.max(1)) {
            let logits = self.step(&[(seq, chunk)])?;
            last = logits.row(logits.rows - 1).to_vec();
        }
        Ok(last)
    }

    /// Generates up to `opts.max_new_tokens` tokens after `prompt`, stopping early at the end of
    /// sequence (where asked) or when prompt and output fill max_seq_len.
    pub fn generate(&mut self, prompt: &[i64], opts: &GenerateOptions) -> Result<Vec<i64>> {
        self.generate_with(prompt, opts, |_| {})
    }

    /// [`Engine::generate`], calling `on_token` with each token as it is chosen.
    pub fn generate_with(
        &mut self,
        prompt: &[i64],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(i64),
    ) -> Result<Vec<i64>> {
        let seq = u64::MAX;
        self.release(seq);
        let eos = self.artifact().manifest.eos_token_ids.clone();
        let mut sampler = Sampler::new(opts.sampling.clone());
        let result = (|| {
            let mut logits = self.prefill(seq, prompt)?;
            let mut out = Vec::new();
            // The context (prompt and generated tokens) never exceeds max_seq_len.
            while out.len() < opts.max_new_tokens && prompt.len() + out.len() < self.max_seq_len {
                let next = sampler.sample(&logits) as i64;
                out.push(next);
                on_token(next);
                let full = out.len() == opts.max_new_tokens
                    || prompt.len() + out.len() >= self.max_seq_len;
                if full || (opts.stop_at_eos && eos.contains(&next)) {
                    break;
                }
                let l = self.step(&[(seq, &[next])])?;
                logits = l.row(l.rows - 1).to_vec();
            }
            Ok(out)
        })();
        self.release(seq);
        result
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
