//! `maxc generate ARTIFACT --tokens ... --max-new-tokens N`: generation from a compiled artifact.

use crate::args::parse_tokens;
use anyhow::{bail, Result};
use maxc_runtime::engine::GenerateOptions;
use maxc_runtime::sampling::SamplingParams;
use maxc_runtime::Engine;
use std::path::PathBuf;

/// Arguments of `maxc generate`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["tokens", "prompt"])))]
pub struct Args {
    /// The artifact directory.
    artifact: PathBuf,
    /// The prompt's token ids, comma separated.
    #[arg(long)]
    tokens: Option<String>,
    /// The prompt as text (needs a tokenizer in the artifact).
    #[arg(long)]
    prompt: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value = "32")]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value = "0")]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value = "1")]
    top_p: f32,
    /// Sampling seed.
    #[arg(long, default_value = "0")]
    seed: u64,
    /// Keep going past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// The role to run.
    #[arg(long, default_value = "decoder")]
    role: String,
    /// Print the generated ids as JSON.
    #[arg(long)]
    json: bool,
}

/// Generates and prints the new token ids.
pub fn run(args: Args) -> Result<()> {
    let valid = args.temperature >= 0.0 && args.top_p > 0.0 && args.top_p <= 1.0;
    if !valid {
        bail!(
            "--temperature must be >= 0 and --top-p in (0, 1]; got {} and {}",
            args.temperature,
            args.top_p
        );
    }
    let tokens = match (&args.tokens, &args.prompt) {
        (Some(t), _) => parse_tokens(t)?,
        (None, Some(_)) => {
            bail!("--prompt needs a tokenizer, which this maxc does not load yet; pass --tokens")
        }
        (None, None) => bail!("pass --tokens or --prompt"),
    };
    let mut engine = Engine::open(&args.artifact, &args.role)?;
    let opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            seed: args.seed,
        },
        stop_at_eos: !args.ignore_eos,
    };
    let out = engine.generate(&tokens, &opts)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"prompt": tokens, "generated": out})
        );
    } else {
        let ids: Vec<String> = out.iter().map(|t| t.to_string()).collect();
        println!("{}", ids.join(","));
    }
    Ok(())
}
