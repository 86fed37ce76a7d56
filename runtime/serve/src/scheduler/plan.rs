//! What [`super::Scheduler::schedule`] hands on: the step that runs next, its pages already
//! allocated.

use maxc_kv::PreparedStep;
use maxc_runtime::sampling::Distribution;

/// One sequence's share of a step.
pub(super) struct Planned {
    /// Its index in the scheduler's running requests.
    pub idx: usize,
    /// Its own tokens in the step: a prefill chunk, or the pending token of a decode.
    pub n: usize,
    /// Draft tokens it may propose this step.
    pub propose: usize,
    /// The proposals, each with the distribution the draft drew it from.
    pub drafts: Vec<(i64, Distribution)>,
    /// Every row's logits come back (its prompt is being scored), not only the last and the
    /// proposals'.
    pub score: bool,
}

impl Planned {
    /// Running request `idx` with `n` tokens of its own and room for `propose` proposals.
    pub fn new(idx: usize, n: usize, propose: usize) -> Self {
        Planned {
            idx,
            n,
            propose,
            drafts: Vec::new(),
            score: false,
        }
    }

    /// Token rows it has in the step.
    pub fn rows(&self) -> usize {
        self.n + self.drafts.len()
    }

    /// Logit rows it takes: every row where it scores, else its last row and its proposals'.
    pub fn logit_rows(&self) -> usize {
        if self.score {
            self.rows()
        } else {
            1 + self.drafts.len()
        }
    }

    /// The step's logit indices for its rows, which start at step row `start`.
    pub fn logit_indices(&self, start: usize) -> impl Iterator<Item = i32> {
        let end = start + self.rows();
        (end - self.logit_rows()..end).map(|r| r as i32)
    }
}

/// A step that fits: its sequences in replica order and its inputs, whose pages the KV cache
/// has allocated (the step is committed or rolled back by `update`).
pub(super) struct StepPlan {
    /// The sequences, in the order of the step's rows.
    pub rows: Vec<Planned>,
    /// The inputs and the page table's open step.
    pub step: PreparedStep,
    /// Time spent planning it, in milliseconds.
    pub creation_ms: f64,
}
