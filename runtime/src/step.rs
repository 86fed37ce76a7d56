//! One step's inputs: a ragged batch of token rows with its paged-cache bookkeeping.

/// A ragged batch: prefill chunks and decode rows of several sequences together.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepInputs {
    /// Every sequence's token rows, concatenated.
    pub tokens: Vec<i64>,
    /// Where each sequence's rows start, plus the end: `B + 1` offsets from 0.
    pub input_row_offsets: Vec<i32>,
    /// Tokens already cached, per sequence.
    pub cache_lengths: Vec<i32>,
    /// `[B, pages_per_seq]` cache page ids.
    pub kv_lookup_table: Vec<i32>,
    /// Columns of `kv_lookup_table`.
    pub pages_per_seq: usize,
}

impl StepInputs {
    /// Sequences in the step.
    pub fn batch_size(&self) -> usize {
        self.cache_lengths.len()
    }
}

/// Logits of a step: `rows × vocab`, one row per token row or per sequence.
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
