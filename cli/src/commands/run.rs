//! `maxc run ARTIFACT --tokens ...`: one prompt's logits from a compiled artifact.

use crate::args::parse_tokens;
use anyhow::Result;
use maxc_runtime::{Engine, Session};
use std::path::PathBuf;

/// Arguments of `maxc run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The artifact directory.
    artifact: PathBuf,
    /// The prompt's token ids, comma separated.
    #[arg(long)]
    tokens: String,
    /// The role to run.
    #[arg(long, default_value = "decoder")]
    role: String,
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
    activations: crate::args::ActivationArgs,
}

/// Every position's logits of `tokens`: one step where the program returns every row, else one
/// step per token.
pub fn prompt_logits(engine: &mut Session, tokens: &[i64]) -> Result<Vec<f32>> {
    let seq = 0;
    engine.release(seq);
    let mut out = Vec::with_capacity(tokens.len() * engine.engine().vocab_size());
    if engine.engine().all_logits() {
        for chunk in tokens.chunks(engine.engine().max_step_tokens().max(1)) {
            out.extend(engine.step(&[(seq, chunk)])?.data);
        }
    } else {
        for t in tokens {
            out.extend(engine.step(&[(seq, std::slice::from_ref(t))])?.data);
        }
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
    let logits = prompt_logits(&mut engine, &tokens)?;
    crate::report::logits(
        tokens.len(),
        engine.engine().vocab_size(),
        &logits,
        args.dump_logits.as_deref(),
    )?;
    Ok(())
}
