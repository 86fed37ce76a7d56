//! A simple driver of the interpreter over many sequences: the KV crate's [`PageTable`] hands out
//! cache pages (so sequences' pages interleave, as in the runtime) and builds each step's
//! [`super::StepInputs`].

use super::{Interpreter, KvCache, Tensor};
use crate::{Error, Result};
use maxc_kv::PageTable;

/// Sequences being run by one interpreter, with their pages and cached lengths.
pub struct Session<'a> {
    interp: &'a Interpreter,
    cache: KvCache,
    pages: PageTable,
}

impl<'a> Session<'a> {
    /// A session with room for `num_pages` cache pages in each of the KV cache's page groups
    /// (a pool of `num_pages × groups` pages), each sequence allowed `pages_per_seq` of them
    /// per group.
    pub fn new(interp: &'a Interpreter, num_pages: usize, pages_per_seq: usize) -> Self {
        let windows = interp.kv_layout.windows();
        let pool = num_pages * windows.len().max(1);
        Session {
            interp,
            cache: interp.new_kv_cache(pool),
            pages: PageTable::with_groups(pool, interp.kv_layout.page_size, pages_per_seq, windows),
        }
    }

    /// Tokens cached for sequence `id`.
    pub fn cached_len(&self, id: u64) -> usize {
        self.pages.len(id)
    }

    /// Runs one step in which each `(sequence, tokens)` pair appends its tokens (a prefill chunk
    /// or a decode token); new sequences start empty. Returns the logits of each sequence's
    /// last row. A failing step changes no sequence.
    pub fn step(&mut self, chunks: &[(u64, &[i64])]) -> Result<Tensor> {
        self.step_with(chunks, |_| {})
    }

    /// [`Session::step`] returning the logits of every token row of the step, in order.
    pub fn step_all(&mut self, chunks: &[(u64, &[i64])]) -> Result<Tensor> {
        let rows: usize = chunks.iter().map(|c| c.1.len()).sum();
        self.step_with(chunks, |s| s.logit_indices = (0..rows as i32).collect())
    }

    fn step_with(
        &mut self,
        chunks: &[(u64, &[i64])],
        rows: impl FnOnce(&mut maxc_schema::StepInputs),
    ) -> Result<Tensor> {
        let eval = |e: maxc_kv::PageError| Error::Eval(e.to_string());
        let mut step = self.pages.prepare(chunks).map_err(eval)?;
        rows(&mut step.inputs);
        match self.interp.step(&step.inputs, &mut self.cache) {
            Ok(out) => {
                self.pages.commit(step).map_err(eval)?;
                // Sliding groups hand back what their windows left, as in the runtime.
                for &(seq, _) in chunks {
                    self.pages.slide(seq);
                }
                Ok(out)
            }
            Err(e) => {
                self.pages.rollback(step).map_err(eval)?;
                Err(e)
            }
        }
    }

    /// The page table.
    pub fn pages(&self) -> &PageTable {
        &self.pages
    }

    /// Frees sequence `id`'s pages.
    pub fn release(&mut self, id: u64) {
        self.pages.release(id);
    }
}
