//! Speculative decoding in the scheduler: a draft engine proposes tokens that the decoder
//! verifies in its next step.
//!
//! Each decoding sequence's draft cache follows the decoder's tokens. Before a step the draft
//! catches every planned sequence up with the tokens the decoder will hold after it (prefill
//! chunks included) and, for each decoding sequence, proposes up to `depth` tokens one draft
//! step at a time. The decoder runs the sequence's pending token and the proposals as rows of
//! one step, returns the logits of those rows ([`Engine::step_n`]) and the scheduler accepts
//! proposals by [`maxc_runtime::sampling::Sampler::verify`]: the tokens that come out are distributed
//! exactly as the decoder's own. Rejected proposals leave both caches through
//! [`Engine::truncate`].

use super::Active;
use crate::metrics::Metrics;
use maxc_runtime::engine::{Device, Engine};
use maxc_runtime::error::{Result, RuntimeError};
use maxc_runtime::sampling::Distribution;
use maxc_runtime::schema::TOKENIZER_FILE;
use std::path::PathBuf;

/// Where the draft comes from and how far it proposes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpeculationOptions {
    /// A separately compiled draft artifact (its `decoder` role); `None`: the decoder's own
    /// artifact's `draft` role.
    pub draft: Option<PathBuf>,
    /// Tokens proposed per step (`None`: as many as the decoder's artifact verifies).
    pub depth: Option<usize>,
}

/// The draft of speculative decoding and how far ahead it proposes.
pub struct Speculation {
    pub(super) engine: Engine,
    pub(super) depth: usize,
    stats: SpeculationStats,
}

/// What speculation achieved since the scheduler started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// `(proposed, accepted)` draft tokens per draft position (0: the first).
    pub positions: Vec<(u64, u64)>,
    /// Sequence steps that verified at least one draft token.
    pub verifications: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
}

impl SpeculationStats {
    /// Accepted draft tokens per verification (the decoder's own token not counted).
    pub fn mean_accepted(&self) -> f64 {
        self.accepted as f64 / self.verifications.max(1) as f64
    }

    /// The share of draft tokens accepted at each position.
    pub fn rates(&self) -> Vec<f64> {
        self.positions
            .iter()
            .map(|&(p, a)| a as f64 / p.max(1) as f64)
            .collect()
    }
}

impl Speculation {
    /// `draft` proposing up to `depth` tokens per step for `decoder` (at most what the decoder's
    /// artifact verifies in a step, its `num_speculative_tokens`; `None`: that many). The two
    /// must share the vocabulary and tokenizer, and the draft must hold contexts as long as the
    /// decoder's.
    pub fn new(decoder: &Engine, draft: Engine, depth: Option<usize>) -> Result<Self> {
        let most = decoder.max_return_n_logits() - 1;
        if most == 0 {
            return Err(RuntimeError::Input(
                "the decoder's artifact verifies no draft tokens per step; compile it with \
                 --num-speculative-tokens N (N >= 1)"
                    .into(),
            ));
        }
        let depth = depth.unwrap_or(most);
        if depth == 0 || depth > most {
            return Err(RuntimeError::Input(format!(
                "the speculation depth is {depth}; the decoder's artifact verifies 1 to {most} \
                 draft tokens per step"
            )));
        }
        if draft.vocab_size() != decoder.vocab_size() {
            return Err(RuntimeError::Input(format!(
                "the draft's vocabulary has {} tokens, the decoder's {}: they must be the same",
                draft.vocab_size(),
                decoder.vocab_size()
            )));
        }
        let tokenizer = |e: &Engine| {
            e.artifact()
                .manifest
                .files
                .get(TOKENIZER_FILE)
                .map(|f| f.sha256.clone())
        };
        if tokenizer(&draft) != tokenizer(decoder) {
            return Err(RuntimeError::Input(format!(
                "the draft's {TOKENIZER_FILE} differs from the decoder's (sha256 {} and {}): \
                 both must tokenize alike",
                tokenizer(&draft).unwrap_or_else(|| "none".into()),
                tokenizer(decoder).unwrap_or_else(|| "none".into())
            )));
        }
        if draft.all_logits() {
            return Err(RuntimeError::Input(
                "the draft returns logits for every token row; compile it without --all-logits"
                    .into(),
            ));
        }
        if draft.max_seq_len() < decoder.max_seq_len() {
            return Err(RuntimeError::Input(format!(
                "the draft's max_seq_len is {}, below the decoder's {}",
                draft.max_seq_len(),
                decoder.max_seq_len()
            )));
        }
        Ok(Speculation {
            engine: draft,
            depth,
            stats: SpeculationStats::default(),
        })
    }

    /// Opens the draft `opts` names for `decoder` on `device` (a separate artifact is
    /// checked against `key` where one is given).
    pub fn open(
        decoder: &Engine,
        opts: &SpeculationOptions,
        device: Device,
        key: Option<&ed25519_dalek::VerifyingKey>,
    ) -> Result<Self> {
        let draft = match &opts.draft {
            Some(dir) => Engine::open_verified(dir, "decoder", device, key)?,
            None => {
                let artifact = decoder.artifact().clone();
                if !artifact.manifest.roles.contains_key("draft") {
                    return Err(RuntimeError::Input(format!(
                        "{} has no draft role; pass a draft artifact (--draft ARTIFACT)",
                        artifact.dir.display()
                    )));
                }
                Engine::new(artifact, "draft", device)?
            }
        };
        Speculation::new(decoder, draft, opts.depth)
    }

    /// Tokens proposed per step at most.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The draft engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Acceptance so far.
    pub fn stats(&self) -> &SpeculationStats {
        &self.stats
    }
}

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
}

impl Planned {
    pub fn new(idx: usize, n: usize, propose: usize) -> Self {
        Planned {
            idx,
            n,
            propose,
            drafts: Vec::new(),
        }
    }
}

/// Runs the draft before a step: catches each planned sequence's draft cache up with what the
/// decoder will hold after the step, then proposes up to `propose` tokens for each. A draft
/// step that fails proposes nothing further (the decoder then runs without proposals).
pub(super) fn propose(spec: &mut Speculation, running: &mut [Active], plan: &mut [Planned]) {
    let mut budget = spec.engine.max_step_tokens();
    let max_batch = spec.engine.max_batch_size();
    // (plan entry, from, to) of each catch-up chunk.
    let mut feeds: Vec<(usize, usize, usize)> = Vec::new();
    for (pi, p) in plan.iter_mut().enumerate() {
        let a = &running[p.idx];
        let end = a.computed + p.n;
        let from = a.draft_computed;
        let take = end.saturating_sub(from).min(budget);
        if from + take < end || feeds.len() == max_batch || from > end {
            // The draft cannot see the whole context this step: no proposals.
            p.propose = 0;
        }
        if take == 0 || feeds.len() == max_batch {
            continue;
        }
        budget -= take;
        feeds.push((pi, from, from + take));
    }
    if feeds.is_empty() {
        return;
    }
    let chunks: Vec<(u64, &[i64])> = feeds
        .iter()
        .map(|&(pi, from, to)| {
            let a = &running[plan[pi].idx];
            (a.seq, &a.tokens[from..to])
        })
        .collect();
    let logits = match spec.engine.step(&chunks) {
        Ok(l) => l,
        Err(e) => {
            tracing::debug!("draft step failed, no proposals this step: {e}");
            plan.iter_mut().for_each(|p| p.propose = 0);
            return;
        }
    };
    for (row, &(pi, _, to)) in feeds.iter().enumerate() {
        let p = &mut plan[pi];
        let a = &mut running[p.idx];
        a.draft_computed = to;
        if p.propose > 0 {
            let q = a.draft_sampler.distribution(logits.row(row));
            let d = a.draft_sampler.draw(&q) as i64;
            p.drafts.push((d, q));
        }
    }
    // Further proposals, one draft step each.
    let most = plan.iter().map(|p| p.propose).max().unwrap_or(0);
    for j in 1..most {
        let next: Vec<usize> = (0..plan.len())
            .filter(|&pi| plan[pi].propose > j && plan[pi].drafts.len() == j)
            .collect();
        if next.is_empty() {
            break;
        }
        let last: Vec<[i64; 1]> = next.iter().map(|&pi| [plan[pi].drafts[j - 1].0]).collect();
        let chunks: Vec<(u64, &[i64])> = next
            .iter()
            .zip(&last)
            .map(|(&pi, t)| (running[plan[pi].idx].seq, &t[..]))
            .collect();
        let logits = match spec.engine.step(&chunks) {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!("draft step failed, fewer proposals this step: {e}");
                break;
            }
        };
        for (row, &pi) in next.iter().enumerate() {
            let p = &mut plan[pi];
            let a = &mut running[p.idx];
            a.draft_computed += 1;
            let q = a.draft_sampler.distribution(logits.row(row));
            let d = a.draft_sampler.draw(&q) as i64;
            p.drafts.push((d, q));
        }
    }
    for p in plan.iter_mut() {
        p.propose = p.drafts.len();
    }
}

/// Acceptance counts of one decoder step, for the metrics.
#[derive(Default)]
pub(super) struct Acceptance {
    /// `(proposed, accepted)` per draft position.
    positions: Vec<(u64, u64)>,
    /// Sequences that proposed.
    sequences: u64,
    /// Draft tokens accepted.
    accepted: u64,
}

impl Acceptance {
    /// One sequence proposed `proposed` tokens and `accepted` of them were accepted.
    pub fn add(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        if self.positions.len() < proposed {
            self.positions.resize(proposed, (0, 0));
        }
        for (j, p) in self.positions.iter_mut().take(proposed).enumerate() {
            p.0 += 1;
            p.1 += u64::from(j < accepted);
        }
        self.sequences += 1;
        self.accepted += accepted as u64;
    }

    /// Records the step in MAX's speculative-decoding metrics and in `spec`'s totals (nothing
    /// where no sequence proposed).
    pub fn record(&self, m: &Metrics, spec: &mut Speculation) {
        if self.sequences == 0 {
            return;
        }
        let st = &mut spec.stats;
        if st.positions.len() < self.positions.len() {
            st.positions.resize(self.positions.len(), (0, 0));
        }
        for (t, p) in st.positions.iter_mut().zip(&self.positions) {
            t.0 += p.0;
            t.1 += p.1;
        }
        st.verifications += self.sequences;
        st.accepted += self.accepted;
        m.spec_decode_avg_acceptance_length
            .observe(self.accepted as f64 / self.sequences as f64);
        for (j, &(proposed, accepted)) in self.positions.iter().enumerate() {
            m.spec_decode_acceptance_rate_per_position
                .get_or_create(&vec![("position".into(), j.to_string())])
                .observe(100.0 * accepted as f64 / proposed as f64);
        }
    }
}
