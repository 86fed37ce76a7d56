//! `maxc run ARTIFACT --tokens ...`: one prompt's logits from a compiled artifact.

use crate::args::parse_tokens;
use anyhow::Result;
use maxc_runtime::{Engine, Session};
use std::path::PathBuf;

/// Arguments of `maxc run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The artifact directory.
    pub(crate) artifact: PathBuf,
    /// The prompt's token ids, comma separated.
    #[arg(long)]
    tokens: String,
    /// The role to run.
    #[arg(long, default_value = "decoder")]
    pub(crate) role: String,
    /// Prompt tokens per step [default: as many as a step returns logits for]; 1 runs the
    /// prompt as decode steps, through the kernels decoding takes.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    step_tokens: Option<u32>,
    /// Where to run: `cpu`, or `cuda` (GPU 0; the artifact needs --target cuda or all).
    #[arg(long, default_value = "cpu")]
    device: maxc_runtime::engine::Device,
    /// Write the logits of every position to this safetensors file (`logits`, f32 [n, vocab]).
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    #[command(flatten)]
    signature: crate::commands::sign::RequireSignature,
    #[command(flatten)]
    expert_parallel: crate::args::ExpertParallelArgs,
    #[command(flatten)]
    pub(crate) activations: crate::args::ActivationArgs,
}

/// Every position's logits of `tokens`, in steps of `step` tokens at most, or of as many rows
/// as the artifact returns logits for (the whole step budget where compiled with
/// `--all-logits`).
pub fn prompt_logits(
    engine: &mut Session,
    tokens: &[i64],
    step: Option<usize>,
) -> Result<Vec<f32>> {
    let seq = 0;
    engine.release(seq);
    let mut out = Vec::with_capacity(tokens.len() * engine.engine().vocab_size());
    let e = engine.engine();
    let most = e.max_step_tokens().min(e.max_logit_rows()).max(1);
    let chunk = step.unwrap_or(most).min(most);
    for chunk in tokens.chunks(chunk) {
        out.extend(engine.step_all(&[(seq, chunk)])?.data);
    }
    engine.release(seq);
    Ok(out)
}

/// Runs the prompt and prints the last position's top tokens.
pub fn run(args: Args) -> Result<()> {
    let tokens = parse_tokens(&args.tokens)?;
    let key = args.signature.key()?;
    let mut engine = Session::new(Engine::open_verified(
        &args.artifact,
        &args.role,
        args.device,
        key.as_ref(),
        args.activations.kernels(),
    )?);
    args.expert_parallel.check(engine.engine())?;
    if tokens.len() > engine.engine().max_seq_len() {
        anyhow::bail!(
            "the prompt has {} tokens; the artifact's max_seq_len is {}",
            tokens.len(),
            engine.engine().max_seq_len()
        );
    }
    let step = args.step_tokens.map(|n| n as usize);
    let logits = prompt_logits(&mut engine, &tokens, step)?;
    crate::report::logits(
        tokens.len(),
        engine.engine().vocab_size(),
        &logits,
        args.dump_logits.as_deref(),
    )?;
    Ok(())
}
