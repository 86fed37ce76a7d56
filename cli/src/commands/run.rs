//! `maxc run ARTIFACT --tokens ...`: one prompt's logits from a compiled artifact.

use crate::args::parse_tokens;
use anyhow::Result;
use maxc_graph::weights::{write_safetensors, StateDict, WeightTensor};
use maxc_runtime::Engine;
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
    /// Write the logits of every position to this safetensors file (`logits`, f32 [n, vocab]).
    #[arg(long)]
    dump_logits: Option<PathBuf>,
}

/// Every position's logits of `tokens`: one step where the program returns every row, else one
/// step per token.
pub fn prompt_logits(engine: &mut Engine, tokens: &[i64]) -> Result<Vec<f32>> {
    let seq = 0;
    engine.release(seq);
    let mut out = Vec::with_capacity(tokens.len() * engine.vocab_size());
    if engine.all_logits() {
        for chunk in tokens.chunks(engine.max_step_tokens().max(1)) {
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
    let mut engine = Engine::open(&args.artifact, &args.role)?;
    if tokens.len() > engine.max_seq_len() {
        anyhow::bail!(
            "the prompt has {} tokens; the artifact's max_seq_len is {}",
            tokens.len(),
            engine.max_seq_len()
        );
    }
    let logits = prompt_logits(&mut engine, &tokens)?;
    let vocab = engine.vocab_size();
    let last = &logits[(tokens.len() - 1) * vocab..];
    let mut top: Vec<(usize, f32)> = last.iter().copied().enumerate().collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    println!(
        "{} tokens, vocab {vocab}; last position's top 5:",
        tokens.len()
    );
    for (id, logit) in top.iter().take(5) {
        println!("  {id:>8}  {logit:.5}");
    }
    if let Some(path) = &args.dump_logits {
        let mut out = StateDict::new();
        out.insert(
            "logits",
            WeightTensor::from_f32(vec![tokens.len(), vocab], &logits),
        );
        write_safetensors(path, &out, None)?;
        println!(
            "logits [{}, {vocab}] written to {}",
            tokens.len(),
            path.display()
        );
    }
    Ok(())
}
