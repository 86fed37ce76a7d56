//! A simple driver of the interpreter over many sequences: it hands out cache pages from a free
//! list (so sequences' pages interleave) and builds each step's [`StepInputs`].

use super::{Interpreter, KvCache, StepInputs, Tensor};
use crate::{Error, Result};
use std::collections::BTreeMap;

/// Sequences being run by one interpreter, with their pages and cached lengths.
pub struct Session<'a> {
    interp: &'a Interpreter,
    cache: KvCache,
    pages_per_seq: usize,
    free: Vec<u32>,
    seqs: BTreeMap<u64, (Vec<u32>, usize)>,
}

impl<'a> Session<'a> {
    /// A session with `num_pages` cache pages, each sequence allowed `pages_per_seq` of them.
    pub fn new(interp: &'a Interpreter, num_pages: usize, pages_per_seq: usize) -> Self {
        Session {
            interp,
            cache: interp.new_kv_cache(num_pages),
            pages_per_seq,
            free: (0..num_pages as u32).rev().collect(),
            seqs: BTreeMap::new(),
        }
    }

    /// Tokens cached for sequence `id`.
    pub fn cached_len(&self, id: u64) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.1)
    }

    /// Runs one step in which each `(sequence, tokens)` pair appends its tokens (a prefill chunk
    /// or a decode token); new sequences start empty. Returns the graph's logits.
    pub fn step(&mut self, chunks: &[(u64, &[i64])]) -> Result<Tensor> {
        let page = self.interp.kv_layout.page_size;
        let mut s = StepInputs {
            pages_per_seq: self.pages_per_seq,
            input_row_offsets: vec![0],
            ..Default::default()
        };
        for &(id, tokens) in chunks {
            let (pages, len) = self.seqs.entry(id).or_default();
            let need = (*len + tokens.len()).div_ceil(page);
            if need > self.pages_per_seq {
                return Err(Error::Eval(format!(
                    "sequence {id} would need {need} pages; at most {} allowed",
                    self.pages_per_seq
                )));
            }
            while pages.len() < need {
                pages.push(
                    self.free
                        .pop()
                        .ok_or_else(|| Error::Eval("the KV cache is out of pages".into()))?,
                );
            }
            s.tokens.extend_from_slice(tokens);
            s.input_row_offsets.push(s.tokens.len() as u32);
            s.cache_lengths.push(*len as u32);
            let mut row = pages.clone();
            row.resize(self.pages_per_seq, 0);
            s.kv_lookup_table.extend(row);
        }
        let out = self.interp.step(&s, &mut self.cache)?;
        for &(id, tokens) in chunks {
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.1 += tokens.len();
            }
        }
        Ok(out)
    }

    /// Frees sequence `id`'s pages.
    pub fn release(&mut self, id: u64) {
        if let Some((pages, _)) = self.seqs.remove(&id) {
            self.free.extend(pages.into_iter().rev());
        }
    }
}
