//! An engine with a page table of its own, for running sequences by id without a scheduler:
//! `maxc run`, `maxc bench`, `maxc profile` and the executors' tests. Serving goes through the
//! scheduler, which owns the KV cache itself.

use crate::engine::{Device, Engine};
use crate::error::{Result, RuntimeError};
use crate::kv::PageTable;
use crate::logits::Logits;
use std::path::Path;

/// An engine and the page table of its KV cache.
pub struct Session {
    engine: Engine,
    pages: PageTable,
}

impl Session {
    /// `engine` with an empty page table the size of its cache.
    pub fn new(engine: Engine) -> Self {
        let pages = engine.info().page_table();
        Session { engine, pages }
    }

    /// Opens `role` of the artifact at `dir` on the CPU.
    pub fn open(dir: &Path, role: &str) -> Result<Self> {
        Ok(Session::new(Engine::open(dir, role)?))
    }

    /// Opens `role` of the artifact at `dir` on `device`.
    pub fn open_on(dir: &Path, role: &str, device: Device) -> Result<Self> {
        Ok(Session::new(Engine::open_on(dir, role, device)?))
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The engine, to change its profiling.
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// The page table.
    pub fn pages(&self) -> &PageTable {
        &self.pages
    }

    /// Tokens cached for `seq`.
    pub fn cached_len(&self, seq: u64) -> usize {
        self.pages.len(seq)
    }

    /// One step: each `(sequence, tokens)` appends a prefill chunk or a decode token; the
    /// logits of each sequence's last row come back. A step that fails (bad input, an executor
    /// error) leaves every sequence as it was.
    pub fn step(&mut self, chunks: &[(u64, &[i64])]) -> Result<Logits> {
        self.step_n(chunks, 1)
    }

    /// [`Session::step`] returning the logits of the last `n` rows of each sequence (row
    /// `b·n + j` is sequence `b`'s `j`-th of its last `n`; zeros in front where it has fewer),
    /// so that one step verifies `n - 1` speculated tokens. Every sequence's `n` rows together
    /// are at most [`Engine::max_logit_rows`].
    pub fn step_n(&mut self, chunks: &[(u64, &[i64])], n: usize) -> Result<Logits> {
        let most = self.engine.max_logit_rows();
        if n == 0 || chunks.len() * n > most {
            return Err(RuntimeError::Input(format!(
                "{} sequences × {n} logit rows: this artifact returns 1 to {most} logit rows \
                 per step (compile with --max-logit-rows to return more)",
                chunks.len()
            )));
        }
        self.step_with(chunks, |inputs| inputs.last_rows(n))
    }

    /// [`Session::step`] returning the logits of every token row of the step, in order (for
    /// scoring): at most [`Engine::max_logit_rows`] rows, which `--all-logits` raises to the
    /// step's token budget.
    pub fn step_all(&mut self, chunks: &[(u64, &[i64])]) -> Result<Logits> {
        let rows: usize = chunks.iter().map(|c| c.1.len()).sum();
        let most = self.engine.max_logit_rows();
        if rows == 0 || rows > most {
            return Err(RuntimeError::Input(format!(
                "the step has {rows} token rows; this artifact returns 1 to {most} logit rows \
                 per step (compile with --all-logits to return every row of a full step)"
            )));
        }
        self.step_with(chunks, |inputs| {
            inputs.logit_indices = (0..rows as i32).collect();
        })
    }

    fn step_with(
        &mut self,
        chunks: &[(u64, &[i64])],
        rows: impl FnOnce(&mut crate::schema::StepInputs),
    ) -> Result<Logits> {
        let info = self.engine.info();
        for &(seq, tokens) in chunks {
            let end = self.pages.len(seq) + tokens.len();
            if end > info.max_seq_len {
                return Err(RuntimeError::Input(format!(
                    "sequence {seq} would reach {end} tokens; the artifact's max_seq_len is {}",
                    info.max_seq_len
                )));
            }
        }
        // Lengths are final now (a speculative caller truncated what it rejected): sliding
        // page groups hand back what their windows left before the step takes new pages.
        for &(seq, _) in chunks {
            self.pages.slide(seq);
        }
        let mut step = self.pages.prepare(chunks)?;
        rows(&mut step.inputs);
        match self.engine.execute(&step.inputs) {
            Ok(logits) => {
                self.pages.commit(step)?;
                Ok(logits)
            }
            Err(e) => {
                self.pages.rollback(step)?;
                Err(e)
            }
        }
    }

    /// Keeps the first `len` cached tokens of `seq`; pages past them return to the free list.
    pub fn truncate(&mut self, seq: u64, len: usize) -> Result<()> {
        Ok(self.pages.truncate(seq, len)?)
    }

    /// Frees `seq`'s cache pages.
    pub fn release(&mut self, seq: u64) {
        self.pages.release(seq);
    }

    /// Prefills `prompt` as sequence `seq` in chunks of at most the step budget; returns the
    /// logits of its last position.
    pub fn prefill(&mut self, seq: u64, prompt: &[i64]) -> Result<Vec<f32>> {
        if prompt.is_empty() {
            return Err(RuntimeError::Input("the prompt is empty".into()));
        }
        let max = self.engine.max_seq_len();
        if prompt.len() > max {
            return Err(RuntimeError::Input(format!(
                "the prompt has {} tokens; the artifact's max_seq_len is {max}",
                prompt.len()
            )));
        }
        let mut last = Vec::new();
        for chunk in prompt.chunks(self.engine.max_step_tokens().max(1)) {
            let logits = self.step(&[(seq, chunk)])?;
            last = logits.row(logits.rows - 1).to_vec();
        }
        Ok(last)
    }
}
