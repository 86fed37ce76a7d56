//! The paged KV cache's bookkeeping: pages handed out from a free list per sequence, and each
//! step's lookup table and cache lengths.

use crate::error::{Result, RuntimeError};
use crate::step::StepInputs;
use std::collections::BTreeMap;

/// Page allocation of one role's cache.
#[derive(Clone, Debug)]
pub struct PageTable {
    page_size: usize,
    pages_per_seq: usize,
    free: Vec<i32>,
    seqs: BTreeMap<u64, (Vec<i32>, usize)>,
}

impl PageTable {
    /// `num_pages` pages of `page_size` tokens; a sequence holds at most `pages_per_seq`.
    pub fn new(num_pages: usize, page_size: usize, pages_per_seq: usize) -> Self {
        PageTable {
            page_size,
            pages_per_seq,
            free: (0..num_pages as i32).rev().collect(),
            seqs: BTreeMap::new(),
        }
    }

    /// Tokens cached for `seq`.
    pub fn len(&self, seq: u64) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.1)
    }

    /// Whether no sequence holds pages.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Pages not held by any sequence.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Builds the step for `chunks` (sequence, new tokens), allocating the pages they need. The
    /// cached lengths advance only through [`PageTable::commit`], after the step ran.
    pub fn prepare(&mut self, chunks: &[(u64, &[i64])]) -> Result<StepInputs> {
        let mut s = StepInputs {
            pages_per_seq: self.pages_per_seq,
            input_row_offsets: vec![0],
            ..Default::default()
        };
        for &(seq, tokens) in chunks {
            let (pages, len) = self.seqs.entry(seq).or_default();
            let need = (*len + tokens.len()).div_ceil(self.page_size);
            if need > self.pages_per_seq {
                return Err(RuntimeError::Input(format!(
                    "sequence {seq} would reach {} tokens, beyond max_seq_len ({})",
                    *len + tokens.len(),
                    self.pages_per_seq * self.page_size
                )));
            }
            while pages.len() < need {
                let page = self
                    .free
                    .pop()
                    .ok_or_else(|| RuntimeError::Input("the KV cache has no free page".into()))?;
                pages.push(page);
            }
            s.tokens.extend_from_slice(tokens);
            s.input_row_offsets.push(s.tokens.len() as i32);
            s.cache_lengths.push(*len as i32);
            s.kv_lookup_table.extend(
                pages
                    .iter()
                    .copied()
                    .chain(std::iter::repeat(0))
                    .take(self.pages_per_seq),
            );
        }
        Ok(s)
    }

    /// Advances each chunk's sequence by its token count.
    pub fn commit(&mut self, chunks: &[(u64, &[i64])]) {
        for &(seq, tokens) in chunks {
            if let Some(s) = self.seqs.get_mut(&seq) {
                s.1 += tokens.len();
            }
        }
    }

    /// Frees `seq`'s pages.
    pub fn release(&mut self, seq: u64) {
        if let Some((pages, _)) = self.seqs.remove(&seq) {
            self.free.extend(pages.into_iter().rev());
        }
    }
}
