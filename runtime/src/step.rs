//! One step's inputs: a ragged batch of token rows with its paged-cache bookkeeping.

use crate::error::{Result, RuntimeError};
use crate::schema::StepDim;

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

    /// The step's sizes in [`StepDim`] slot order, after checking them against the artifact's
    /// `bounds` and the inputs against themselves (offsets, lengths, token ids below `vocab`,
    /// page ids inside the cache).
    pub fn checked_dims(
        &self,
        bounds: &[u64; StepDim::COUNT],
        vocab: u64,
        page_size: usize,
    ) -> Result<[u64; StepDim::COUNT]> {
        let b = self.batch_size() as u64;
        let dims = [
            self.tokens.len() as u64,
            b,
            self.pages_per_seq as u64,
            bounds[StepDim::TotalNumPages as usize],
            b + 1,
        ];
        for d in [
            StepDim::TotalSeqLen,
            StepDim::BatchSize,
            StepDim::MaxNumPages,
        ] {
            if dims[d as usize] > bounds[d as usize] {
                return Err(RuntimeError::Input(format!(
                    "{} is {}, above the artifact's bound {}",
                    d.name(),
                    dims[d as usize],
                    bounds[d as usize]
                )));
            }
        }
        check_step(
            self,
            vocab,
            dims[StepDim::TotalNumPages as usize],
            page_size,
        )?;
        Ok(dims)
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

/// Checks a step's inputs: offsets, lengths, token ids and page ids.
fn check_step(s: &StepInputs, vocab: u64, pages: u64, page_size: usize) -> Result<()> {
    let b = s.batch_size();
    let bad = |m: String| Err(RuntimeError::Input(m));
    if s.input_row_offsets.len() != b + 1
        || s.input_row_offsets[0] != 0
        || s.input_row_offsets.windows(2).any(|w| w[0] > w[1])
    {
        return bad(format!(
            "input_row_offsets {:?} must be B + 1 = {} non-decreasing offsets from 0",
            s.input_row_offsets,
            b + 1
        ));
    }
    if s.input_row_offsets[b] as usize != s.tokens.len() {
        return bad(format!(
            "input_row_offsets ends at {}, but there are {} tokens",
            s.input_row_offsets[b],
            s.tokens.len()
        ));
    }
    if s.kv_lookup_table.len() != b * s.pages_per_seq {
        return bad(format!(
            "kv_lookup_table has {} entries, expected {b} × {}",
            s.kv_lookup_table.len(),
            s.pages_per_seq
        ));
    }
    if let Some(t) = s.tokens.iter().find(|&&t| t < 0 || t as u64 >= vocab) {
        return bad(format!(
            "token id {t} is outside the vocabulary (0..{vocab})"
        ));
    }
    for i in 0..b {
        let end = s.cache_lengths[i].max(0) as usize
            + (s.input_row_offsets[i + 1] - s.input_row_offsets[i]) as usize;
        if s.cache_lengths[i] < 0 || end > s.pages_per_seq * page_size {
            return bad(format!(
                "sequence {i} reaches {end} tokens, beyond its {} pages of {page_size}",
                s.pages_per_seq
            ));
        }
        let used = end.div_ceil(page_size);
        if let Some(p) = s.kv_lookup_table[i * s.pages_per_seq..][..used]
            .iter()
            .find(|&&p| p < 0 || p as u64 >= pages)
        {
            return bad(format!(
                "sequence {i} uses page {p}, but the cache has {pages} pages"
            ));
        }
    }
    Ok(())
}
