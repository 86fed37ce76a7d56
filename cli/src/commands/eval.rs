//! `maxc eval MODEL --tokens ...`: one prompt through the reference interpreter.

use crate::args::parse_tokens;
use anyhow::{Context, Result};
use maxc_graph::interp::{Interpreter, Session};
use maxc_graph::pipeline::{load_model, LoadOptions, WeightFormat};
use maxc_graph::{BatchProcessorRuntime, GraphRole, KvCacheParams, ModuleRuntime, Registry};
use std::path::PathBuf;

/// Arguments of `maxc eval`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint folder (config.json + safetensors).
    model: PathBuf,
    /// The prompt's token ids, comma separated.
    #[arg(long)]
    tokens: String,
    /// The graph role to run.
    #[arg(long, default_value = "decoder")]
    role: GraphRole,
    /// Write the logits of every position to this safetensors file (`logits`, f32 [n, vocab]).
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// The weight formats, as `maxc compile --weights` makes them; the interpreter computes on
    /// those weights dequantized, the reference a compiled artifact is held to.
    #[arg(long, alias = "dtype", default_value = "keep")]
    weights: WeightFormat,
}

/// Runs the prompt and prints the last position's top tokens.
pub fn run(args: Args) -> Result<()> {
    let tokens = parse_tokens(&args.tokens)?;
    let page_size = 16;
    let runtime = ModuleRuntime {
        batch: BatchProcessorRuntime {
            max_batch_size: 1,
            max_seq_len: tokens.len(),
            max_batch_input_tokens: tokens.len(),
            ..Default::default()
        },
        kv: KvCacheParams {
            page_size,
            num_pages: None,
            dtype: Default::default(),
        },
        ..Default::default()
    };
    let opts = LoadOptions {
        runtime,
        roles: vec![args.role],
        weights: args.weights,
    };
    let mut loaded = load_model(&args.model, &Registry::builtin(), &opts)?;
    let rg = loaded
        .roles
        .remove(&args.role)
        .context("role was not built")?;
    let interp = Interpreter::new(rg.graph, &rg.weights)?;
    let pages = tokens.len().div_ceil(page_size);
    let mut session = Session::new(&interp, pages, pages);
    let logits = session.step_all(&[(0, &tokens)])?;
    crate::report::logits(
        tokens.len(),
        interp.vocab_size(),
        &logits.data,
        args.dump_logits.as_deref(),
    )?;
    Ok(())
}
