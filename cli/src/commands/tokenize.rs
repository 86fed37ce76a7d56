//! `maxc tokenize ARTIFACT TEXT`: the token ids the artifact's tokenizer gives a text.

use anyhow::{Context, Result};
use maxc_runtime::Artifact;
use std::path::PathBuf;

/// Arguments of `maxc tokenize`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The artifact directory.
    artifact: PathBuf,
    /// The text.
    text: String,
    /// Add the tokenizer's special tokens (BOS, ...) as its post-processor says.
    #[arg(long)]
    add_special_tokens: bool,
    /// Print JSON with ids and token strings.
    #[arg(long)]
    json: bool,
}

/// Prints the ids.
pub fn run(args: Args) -> Result<()> {
    let artifact = Artifact::open(&args.artifact)?;
    let tok = maxc_serve::tokenizer::Tokenizer::of_artifact(&artifact)?
        .with_context(|| format!("{} has no tokenizer.json", args.artifact.display()))?;
    let ids = tok.encode(&args.text, args.add_special_tokens)?;
    if args.json {
        let tokens: Vec<String> = ids
            .iter()
            .map(|&i| tok.token(i).unwrap_or_default())
            .collect();
        println!("{}", serde_json::json!({"ids": ids, "tokens": tokens}));
    } else {
        println!(
            "{}",
            ids.iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    Ok(())
}
