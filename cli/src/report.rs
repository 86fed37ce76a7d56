//! Output shared by commands: a prompt's logits, printed and optionally dumped.

use anyhow::Result;
use maxc_graph::weights::{write_safetensors, StateDict, WeightTensor};
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
        let mut out = StateDict::new();
        out.insert("logits", WeightTensor::from_f32(vec![n, vocab], logits));
        write_safetensors(path, &out, None)?;
        println!("logits [{n}, {vocab}] written to {}", path.display());
    }
    Ok(())
}
