//! Arguments shared by several commands: token lists, speculative decoding.

use anyhow::{bail, Context, Result};

/// Parses `1,17,42` into token ids.
pub fn parse_tokens(s: &str) -> Result<Vec<i64>> {
    let tokens = s
        .split(',')
        .map(|t| t.trim())
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<i64>()
                .with_context(|| format!("--tokens: `{t}` is not an integer token id"))
        })
        .collect::<Result<Vec<_>>>()?;
    if tokens.is_empty() {
        bail!("--tokens: expected at least one token id, e.g. --tokens 1,17,42");
    }
    Ok(tokens)
}

/// Speculative decoding flags, shared by `generate` and `serve`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SpeculativeArgs {
    /// Speculative decoding: the artifact's draft role (or --draft's model) proposes tokens
    /// that the decoder verifies, several per step; the output is distributed as without it.
    #[arg(long)]
    pub speculative: bool,
    /// A separately compiled draft artifact (implies --speculative); its tokenizer and
    /// vocabulary must match the decoder's.
    #[arg(long, alias = "draft-model-path", value_name = "ARTIFACT")]
    pub draft: Option<std::path::PathBuf>,
    /// Draft tokens proposed per step [default: as many as the decoder's artifact verifies,
    /// its num_speculative_tokens].
    #[arg(long, value_name = "N")]
    pub num_speculative_tokens: Option<usize>,
}

impl SpeculativeArgs {
    /// The speculation asked for, if any.
    pub fn options(&self) -> Option<maxc_serve::scheduler::speculative::SpeculationOptions> {
        (self.speculative || self.draft.is_some()).then(|| {
            maxc_serve::scheduler::speculative::SpeculationOptions {
                draft: self.draft.clone(),
                depth: self.num_speculative_tokens,
            }
        })
    }
}

/// How the CPU runs kernels (block-format matmuls' activations, threads), shared by the
/// commands that run an artifact.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ActivationArgs {
    /// CPU threads the kernels run on (the calling thread and N - 1 workers; fewer while other
    /// processes keep the CPUs busy, unless MAXC_ADAPT_THREADS=0) [default: MAXC_THREADS, else
    /// the CPUs this process may use: its affinity mask and its cgroup's CPU quota].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub threads: Option<u32>,
    /// Activations of the CPU's matmuls on block-format weights (Q4_1, Q8_0, K-quants, ...) in
    /// decode steps: f32 (the interpreter's arithmetic), i16 (16 bits per 32 values and
    /// integer dot products: SmolLM2's logits within 0.01, Gemma 3's within 0.09) or q8 (8
    /// bits, as llama.cpp: faster on AVX2, logits further from the reference, 1-12). Float
    /// weights, prefill and other CPUs keep f32.
    #[arg(long, default_value = "f32", value_name = "f32|i16|q8")]
    pub activations: maxc_runtime::kernels::options::Activations,
}

impl ActivationArgs {
    /// `role` of the artifact at `dir` on the CPU with these kernel choices, in a session.
    pub fn open_cpu(
        &self,
        dir: &std::path::Path,
        role: &str,
    ) -> anyhow::Result<maxc_runtime::Session> {
        Ok(maxc_runtime::Session::new(
            maxc_runtime::Engine::open_verified(
                dir,
                role,
                maxc_runtime::engine::Device::Cpu,
                None,
                self.kernels(),
            )?,
        ))
    }

    /// The kernel choices these arguments make (the defaults otherwise); sets the CPU thread
    /// count where `--threads` gives one (before the first kernel runs).
    pub fn kernels(&self) -> maxc_runtime::kernels::options::KernelOptions {
        if let Some(n) = self.threads {
            maxc_runtime::kernels::pool::set_threads(n as usize);
        }
        maxc_runtime::kernels::options::KernelOptions {
            activations: self.activations,
            ..Default::default()
        }
    }
}

/// The expert-parallel degree a deployment runs at.
#[derive(clap::Args, Debug, Clone)]
pub struct ExpertParallelArgs {
    /// Expert-parallel ranks to run on; an artifact compiled for another degree is refused
    /// [default: the artifact's].
    #[arg(long, value_name = "N")]
    pub expert_parallel_degree: Option<usize>,
}

impl ExpertParallelArgs {
    /// Refuses `engine` where a degree was asked for and it differs from the artifact's.
    pub fn check(&self, engine: &maxc_runtime::Engine) -> anyhow::Result<()> {
        if let Some(n) = self.expert_parallel_degree {
            engine.require_expert_parallel_degree(n)?;
        }
        Ok(())
    }
}
