//! Output shared by commands: a prompt's logits, printed and optionally dumped.

use anyhow::{Context, Result};
use std::path::Path;

/// Prints the last position's top 5 tokens of `logits` (`[n, vocab]`, row-major) and, with
/// `dump`, writes them as safetensors (`logits`, f32 [n, vocab]).
pub fn logits(n: usize, vocab: usize, logits: &[f32], dump: Option<&Path>) -> Result<()> {
    let last = &logits[(n - 1) * vocab..n * vocab];
    let mut top: Vec<(usize, f32)> = last.iter().copied().enumerate().collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    println!("{n} tokens, vocab {vocab}; last position's top 5:");
    for (id, logit) in top.iter().take(5) {
        println!("  {id:>8}  {logit:.5}");
    }
    if let Some(path) = dump {
        let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n, vocab], &bytes)
                .context("logits tensor")?;
        safetensors::serialize_to_file([("logits", view)], None, path)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("logits [{n}, {vocab}] written to {}", path.display());
    }
    Ok(())
}
