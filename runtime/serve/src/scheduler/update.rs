//! The last phase of a step, [`Scheduler::update`]: the page table's step committed (or rolled
//! back where the executor failed), prompt log-probabilities, the next token of every
//! sequence that finished its pending tokens (sampled, or drafts verified), stop rules,
//! rejected drafts dropped from both caches, full pages into the prefix cache, retirement.

use super::active::{logprob, Active};
use super::plan::{Planned, StepPlan};
use super::request::{Event, FinishReason, TokenLogprob};
use super::state::Scheduler;
use super::stats::{AcceptanceStats, BatchStats, StepStats};
use crate::metrics::BatchType;
use maxc_runtime::{Logits, Result};
use std::time::Duration;

/// What became of one sequence in a step.
#[derive(Default)]
struct Outcome {
    /// It is done (finished or failed).
    done: bool,
    /// Draft tokens examined and accepted.
    examined: usize,
    accepted: usize,
}

impl Scheduler {
    /// Applies the executor's `result` for `plan` (which took `exec`) to every request in it.
    pub(super) fn update(
        &mut self,
        plan: StepPlan,
        result: Result<Logits>,
        exec: Duration,
        stats: &mut StepStats,
    ) {
        let StepPlan {
            rows: planned,
            step,
            creation_ms,
        } = plan;
        let idx: Vec<usize> = planned.iter().map(|p| p.idx).collect();
        let logits = match result {
            Ok(l) => match self.kv.commit(step) {
                Ok(()) => l,
                Err(e) => {
                    stats.finished += self.fail(&idx, &e.to_string());
                    return;
                }
            },
            Err(e) => {
                // A group of ranks that ended runs no more steps: new requests are refused
                // and health reports it, while the launcher ends the job.
                if let maxc_runtime::RuntimeError::Collective(why) = &e {
                    tracing::error!("the executor's ranks failed: {why}");
                    let _ = self.broken.set(why.clone());
                }
                // The step's inputs were refused: fail its requests, keep serving others.
                if let Err(r) = self.kv.rollback(step) {
                    tracing::error!("rolling back a failed step: {r}");
                }
                stats.finished += self.fail(&idx, &e.to_string());
                return;
            }
        };
        let mut batch = BatchStats {
            batch_type: BatchType::Tg,
            sequences: planned.len(),
            tokens: 0,
            context_tokens: 0,
            creation_ms,
            exec_ms: exec.as_secs_f64() * 1e3,
            finished: 0,
        };
        let mut acceptance = AcceptanceStats::default();
        let mut done = Vec::new();
        let (mut row_end, mut logit_end) = (0, 0);
        for p in &planned {
            let a = &self.running[p.idx];
            if !a.is_decode() {
                batch.batch_type = BatchType::Ce;
            }
            batch.tokens += p.rows();
            batch.context_tokens += a.computed + p.rows();
            row_end += p.rows();
            logit_end += p.logit_rows();
            if self.running[p.idx].req.embed.is_some() {
                let start = row_end - p.rows();
                let hidden = self.exec.hidden_states(start..start + p.n);
                self.running[p.idx].pool(hidden, p.n);
            }
            let out = self.update_sequence(p, &logits, logit_end);
            acceptance.add(out.examined, out.accepted);
            if out.done {
                done.push(p.idx);
            }
        }
        if let Some(spec) = self.spec.as_mut() {
            spec.record(&acceptance);
            stats.acceptance = Some(acceptance);
        }
        // Lengths are final (rejected drafts truncated): sliding page groups hand back what
        // their windows left, in both caches, the prefix cache keeping a copy where it is on.
        for p in &planned {
            if !done.contains(&p.idx) {
                let a = &self.running[p.idx];
                self.kv.slide(a.seq, &a.tokens[..a.computed]);
                if let Some(spec) = self.spec.as_mut() {
                    spec.kv.slide(a.seq, &[]);
                }
            }
        }
        batch.finished = done.len();
        stats.finished += done.len();
        done.sort_unstable();
        for &i in done.iter().rev() {
            let a = self.running.remove(i);
            self.retire(&a);
        }
        stats.batch = Some(batch);
    }

    /// One sequence `p` (its logit rows ending at `logit_end`) after the step: its prompt
    /// log-probabilities, its next tokens, its caches.
    fn update_sequence(&mut self, p: &Planned, logits: &Logits, logit_end: usize) -> Outcome {
        let eos = self.info.eos_token_ids.clone();
        let max_seq_len = self.info.max_seq_len;
        let a = &mut self.running[p.idx];
        let start = a.computed;
        if p.score {
            prompt_logprobs(a, p.n, logits, logit_end);
        }
        a.computed += p.n;
        let mut out = Outcome::default();
        let mut finish = None;
        if a.pending() == 0 {
            if !a.prompt_logprobs.is_empty() {
                let lp = std::mem::take(&mut a.prompt_logprobs);
                let _ = a.events.send(Event::PromptLogprobs(lp));
            }
            let k = p.drafts.len();
            // The logits of the sequence's last row, and of each proposal before it: its
            // last logit rows.
            let row_of = |j: usize| logit_end - 1 - k + j;
            finish = next_tokens(a, p, |j| logits.row(row_of(j)), &eos, max_seq_len, &mut out);
        }
        if !p.drafts.is_empty() {
            // Drop the rejected proposals from both caches.
            a.draft_computed = a.draft_computed.min(a.computed);
            let (seq, computed, draft) = (a.seq, a.computed, a.draft_computed);
            let dropped = self
                .kv
                .truncate(seq, computed)
                .and_then(|()| match self.spec.as_mut() {
                    Some(spec) => spec.kv.truncate(seq, draft),
                    None => Ok(()),
                });
            if let Err(e) = dropped {
                // Never go on over rejected tokens' keys and values.
                let a = &self.running[p.idx];
                let _ = a.events.send(Event::Error(format!(
                    "dropping rejected draft tokens failed: {e}"
                )));
                out.done = true;
                return out;
            }
        }
        let a = &self.running[p.idx];
        let ps = self.kv.page_size();
        if a.computed / ps > start / ps {
            self.kv.cache_prefix(a.seq, &a.tokens[..a.computed]);
        }
        if let Some(reason) = finish {
            let _ = a.events.send(a.finished(reason));
            out.done = true;
        }
        out
    }
}

/// The log-probabilities of the prompt tokens that `a`'s `n` rows (their logits ending at
/// `logit_end`) predict, row `p` predicting the token at `p + 1`; tokens scored before a
/// preemption are not scored again.
fn prompt_logprobs(a: &mut Active, n: usize, logits: &Logits, logit_end: usize) {
    if a.scored == 0 {
        // The first prompt token has no log-probability.
        a.prompt_logprobs.push(TokenLogprob {
            token: a.tokens[0],
            logprob: f32::NAN,
            top: Vec::new(),
            rank: 0,
        });
        a.scored = 1;
    }
    let start = a.computed;
    for (j, p) in (start..start + n).enumerate() {
        if p + 1 == a.scored && p + 1 < a.req.prompt.len() {
            let row = logits.row(logit_end - n + j);
            let k = a.req.prompt_logprobs.unwrap_or(0);
            a.prompt_logprobs.push(logprob(row, a.tokens[p + 1], k));
            a.scored += 1;
        }
    }
}

/// Chooses `a`'s next tokens from `row(j)`, the logits after its `j`-th proposal (0: after
/// its own last token): each proposal is verified in turn until one is rejected, and every
/// token chosen is sent. Returns why the request finished, if it did.
fn next_tokens<'l>(
    a: &mut Active,
    p: &Planned,
    row: impl Fn(usize) -> &'l [f32],
    eos: &[i64],
    max_seq_len: usize,
    out: &mut Outcome,
) -> Option<FinishReason> {
    let k = p.drafts.len();
    let mut finish = (a.generated >= a.req.max_tokens).then_some(FinishReason::Length);
    let mut j = 0;
    while finish.is_none() && j <= k {
        out.examined += usize::from(j < k);
        let raw = row(j);
        let (token, ok) = a.choose(raw, p.drafts.get(j), eos);
        let lp = a.req.logprobs.map(|k| logprob(raw, token, k));
        a.tokens.push(token);
        a.generated += 1;
        *a.output_counts.entry(token).or_default() += 1;
        let _ = a.events.send(Event::Token {
            id: token,
            logprob: lp,
        });
        let complete = match a.req.constraint.as_mut() {
            Some(c) => {
                if let Err(e) = c.consume(token) {
                    tracing::warn!("structured output: {e}");
                }
                c.is_complete()
            }
            None => false,
        };
        finish = if complete || (a.stops(token, eos) && a.generated >= a.req.min_tokens) {
            Some(FinishReason::Stop)
        } else if a.generated >= a.req.max_tokens || a.tokens.len() >= max_seq_len {
            Some(FinishReason::Length)
        } else {
            None
        };
        if !ok {
            // After a rejection every proposal counts as examined.
            out.examined = k;
            break;
        }
        // The accepted draft token's KV is already cached.
        out.accepted += 1;
        a.computed += 1;
        j += 1;
    }
    finish
}
