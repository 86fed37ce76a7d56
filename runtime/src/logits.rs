//! A step's output.

/// Logits of a step: `rows × vocab`, one row per entry of its `logit_indices`.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    /// Rows.
    pub rows: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl Logits {
    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}
