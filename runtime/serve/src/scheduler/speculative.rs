//! Speculative decoding in the scheduler: a draft engine proposes tokens that the decoder
//! verifies in its next step.
//!
//! Each decoding sequence's draft cache follows the decoder's tokens. Before a step the draft
//! catches every planned sequence up with the tokens the decoder will hold after it (prefill
//! chunks included) and, for each decoding sequence, proposes up to `depth` tokens one draft
//! step at a time. The decoder runs the sequence's pending token and the proposals as rows of
//! one step, returns the logits of those rows and the scheduler accepts proposals by
//! [`maxc_runtime::sampling::Sampler::verify`]: the tokens that come out are distributed
//! exactly as the decoder's own. Rejected proposals leave both caches by truncation. The
//! draft's KV cache (no prefix cache) is the scheduler's too: it lives here, beside the draft.

use super::active::Active;
use super::plan::Planned;
use super::stats::AcceptanceStats;
use maxc_kv::KvCache;
use maxc_runtime::engine::{Device, Engine, RoleInfo, StepExecutor};
use maxc_runtime::error::{Result, RuntimeError};
use maxc_runtime::schema::TOKENIZER_FILE;
use maxc_runtime::Logits;
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
    engine: Box<dyn StepExecutor>,
    info: RoleInfo,
    pub(super) kv: KvCache,
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
    pub fn new(
        decoder: &RoleInfo,
        draft: impl StepExecutor + 'static,
        depth: Option<usize>,
    ) -> Result<Self> {
        let most = decoder.max_return_n_logits - 1;
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
        let info = draft.info().clone();
        if info.vocab_size != decoder.vocab_size {
            return Err(RuntimeError::Input(format!(
                "the draft's vocabulary has {} tokens, the decoder's {}: they must be the same",
                info.vocab_size, decoder.vocab_size
            )));
        }
        if info.tokenizer_sha256 != decoder.tokenizer_sha256 {
            let sha = |s: &Option<String>| s.clone().unwrap_or_else(|| "none".into());
            return Err(RuntimeError::Input(format!(
                "the draft's {TOKENIZER_FILE} differs from the decoder's (sha256 {} and {}): \
                 both must tokenize alike",
                sha(&info.tokenizer_sha256),
                sha(&decoder.tokenizer_sha256)
            )));
        }
        if info.max_seq_len < decoder.max_seq_len {
            return Err(RuntimeError::Input(format!(
                "the draft's max_seq_len is {}, below the decoder's {}",
                info.max_seq_len, decoder.max_seq_len
            )));
        }
        Ok(Speculation {
            kv: KvCache::new(info.page_table(), false),
            info,
            engine: Box::new(draft),
            depth,
            stats: SpeculationStats::default(),
        })
    }

    /// Opens the draft `opts` names for `decoder` on `device`, with the decoder's kernel
    /// choices (a separate artifact is checked against `key` where one is given).
    pub fn open(
        decoder: &Engine,
        opts: &SpeculationOptions,
        device: Device,
        key: Option<&ed25519_dalek::VerifyingKey>,
    ) -> Result<Self> {
        let draft = match &opts.draft {
            Some(dir) => Engine::open_verified(dir, "decoder", device, key, decoder.kernels())?,
            None => {
                let artifact = decoder.artifact().clone();
                if !artifact.manifest.roles.contains_key("draft") {
                    return Err(RuntimeError::Input(format!(
                        "{} has no draft role; pass a draft artifact (--draft ARTIFACT)",
                        artifact.dir.display()
                    )));
                }
                Engine::with_kernels(artifact, "draft", device, decoder.kernels())?
            }
        };
        Speculation::new(decoder.info(), draft, opts.depth)
    }

    /// Tokens proposed per step at most.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The draft's bounds and tokens.
    pub fn info(&self) -> &RoleInfo {
        &self.info
    }

    /// The draft's KV cache.
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// One draft step over `chunks`, in the draft's own cache (left as it was where it fails).
    fn step(&mut self, chunks: &[(u64, &[i64])]) -> Result<Logits> {
        let step = self.kv.prepare(chunks)?;
        match self.engine.execute(&step.inputs) {
            Ok(logits) => {
                self.kv.commit(step)?;
                Ok(logits)
            }
            Err(e) => {
                self.kv.rollback(step)?;
                Err(e)
            }
        }
    }

    /// Adds one step's acceptance to the totals.
    pub(super) fn record(&mut self, a: &AcceptanceStats) {
        if a.sequences == 0 {
            return;
        }
        let st = &mut self.stats;
        if st.positions.len() < a.positions.len() {
            st.positions.resize(a.positions.len(), (0, 0));
        }
        for (t, p) in st.positions.iter_mut().zip(&a.positions) {
            t.0 += p.0;
            t.1 += p.1;
        }
        st.verifications += a.sequences;
        st.accepted += a.accepted;
    }

    /// Acceptance so far.
    pub fn stats(&self) -> &SpeculationStats {
        &self.stats
    }
}

/// Runs the draft before a step: catches each planned sequence's draft cache up with what the
/// decoder will hold after the step, then proposes up to `propose` tokens for each. A draft
/// step that fails proposes nothing further (the decoder then runs without proposals).
pub(super) fn propose(spec: &mut Speculation, running: &mut [Active], plan: &mut [Planned]) {
    let mut budget = spec.info.max_step_tokens;
    let max_batch = spec.info.max_batch_size;
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
    let logits = match spec.step(&chunks) {
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
        let logits = match spec.step(&chunks) {
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
