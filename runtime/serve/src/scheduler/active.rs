//! A request while the scheduler holds it: its tokens and how many are cached, its samplers,
//! its kernel capture; and the choice of its next token.

use super::request::{Event, EventSender, FinishReason, Request, TokenLogprob, Usage};
use crate::trace::capture::Capture;
use crate::trace::{ProfilingConfig, SpanContext, Tracer};
use maxc_runtime::sampling::{Distribution, Sampler, SamplingParams};
use std::collections::BTreeMap;

/// Where the draft's sampler starts: the request's seed moved to a stream of its own.
const DRAFT_SEED: u64 = 0xD1B5_4A32_D192_ED03;

/// A request the scheduler holds.
pub(super) struct Active {
    pub(super) req: Request,
    pub(super) events: EventSender,
    /// Its sequence in the page table, while admitted.
    pub(super) seq: u64,
    /// Prompt and generated tokens.
    pub(super) tokens: Vec<i64>,
    /// Tokens whose KV is cached.
    pub(super) computed: usize,
    pub(super) generated: usize,
    pub(super) sampler: Sampler,
    pub(super) output_counts: BTreeMap<i64, u32>,
    pub(super) replica: usize,
    /// Prompt tokens found in the prefix cache at first admission.
    pub(super) cached_tokens: usize,
    pub(super) admitted_once: bool,
    pub(super) prompt_logprobs: Vec<TokenLogprob>,
    /// Prompt tokens whose log-probability has been computed (a recomputation after
    /// preemption does not score them again).
    pub(super) scored: usize,
    /// Tokens whose KV the draft has cached (speculative decoding).
    pub(super) draft_computed: usize,
    /// The draft's sampler (its own stream, so that proposals do not shift the decoder's).
    pub(super) draft_sampler: Sampler,
    /// Its kernel capture, while armed (`x-max-trace-level: kernel`).
    pub(super) capture: Option<ArmedCapture>,
    /// An embedding's pooled hidden states so far (the sum, or the last row).
    pub(super) pooled: Vec<f32>,
}

/// A request's kernel capture: replayed into spans when it is full or the request ends
/// (dropped, whichever way it leaves the scheduler).
pub(super) struct ArmedCapture {
    pub(super) capture: Option<Capture>,
    pub(super) tracer: Tracer,
    pub(super) parent: SpanContext,
    pub(super) limits: ProfilingConfig,
}

impl ArmedCapture {
    /// Whether it still records passes.
    pub(super) fn recording(&self) -> bool {
        self.capture.as_ref().is_some_and(|c| !c.is_full())
    }

    /// Closes the file and hands it to the exporter for replay.
    pub(super) fn finish(&mut self) {
        if let Some(c) = self.capture.take() {
            match c.finish() {
                Ok(file) => self.tracer.replay(file, self.parent, self.limits),
                Err(e) => tracing::warn!("kernel capture: {e}"),
            }
        }
    }
}

impl Drop for ArmedCapture {
    fn drop(&mut self) {
        self.finish();
    }
}

impl Active {
    /// `req`, queued, its events going to `events`.
    pub(super) fn new(req: Request, events: EventSender, capture: Option<ArmedCapture>) -> Self {
        let sampler = Sampler::new(req.sampling.clone());
        let draft_sampler = Sampler::new(SamplingParams {
            seed: req.sampling.seed ^ DRAFT_SEED,
            ..req.sampling.clone()
        });
        Active {
            capture,
            tokens: req.prompt.clone(),
            req,
            events,
            seq: 0,
            computed: 0,
            generated: 0,
            sampler,
            output_counts: BTreeMap::new(),
            replica: 0,
            cached_tokens: 0,
            admitted_once: false,
            prompt_logprobs: Vec::new(),
            scored: 0,
            pooled: Vec::new(),
            draft_computed: 0,
            draft_sampler,
        }
    }

    pub(super) fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }
    /// Pools the final hidden states of its `n` rows of a step (`hidden`, `None` where the
    /// executor has none); once the prompt is done, sends its embedding (normalized) or an
    /// error.
    pub(super) fn pool(&mut self, hidden: Option<Vec<f32>>, n: usize) {
        let Some(pooling) = self.req.embed else {
            return;
        };
        let Some(h) = hidden.filter(|h| n > 0 && !h.is_empty()) else {
            let _ = self.events.send(Event::Error(
                "embeddings need the final hidden states, which this executor does not return \
                 (run on the CPU)"
                    .into(),
            ));
            return;
        };
        let width = h.len() / n;
        match pooling {
            super::request::Pooling::Last => self.pooled = h[(n - 1) * width..].to_vec(),
            super::request::Pooling::Mean => {
                self.pooled.resize(width, 0.0);
                for row in h.chunks_exact(width) {
                    for (s, x) in self.pooled.iter_mut().zip(row) {
                        *s += x;
                    }
                }
            }
        }
        if self.computed + n == self.tokens.len() {
            let norm = self.pooled.iter().map(|x| x * x).sum::<f32>().sqrt();
            let v: Vec<f32> = self
                .pooled
                .iter()
                .map(|x| if norm > 0.0 { x / norm } else { *x })
                .collect();
            let _ = self.events.send(Event::Embedding(v));
        }
    }

    /// Whether it has not chosen a token yet (its prompt is not prefilled).
    pub(super) fn prefilling(&self) -> bool {
        self.generated == 0
    }

    /// Whether its next rows' logits score its prompt (`echo` with `logprobs`).
    pub(super) fn scores(&self) -> bool {
        self.req.prompt_logprobs.is_some() && self.scored < self.req.prompt.len()
    }

    pub(super) fn is_decode(&self) -> bool {
        self.generated > 0 && self.pending() == 1
    }

    /// The next token from the decoder's logits `raw` at this position: sampled, or, where a
    /// draft proposed `draft` from its distribution, verified (see
    /// [`Sampler::verify`]). Returns the token and whether it is the draft's.
    pub(super) fn choose(
        &mut self,
        raw: &[f32],
        draft: Option<&(i64, Distribution)>,
        eos: &[i64],
    ) -> (i64, bool) {
        let mut row = raw.to_vec();
        if self.req.sampling.has_penalties() {
            self.req
                .sampling
                .penalize(&mut row, &self.req.prompt, &self.output_counts);
        }
        self.req.sampling.bias(&mut row);
        if let Some(c) = self.req.constraint.as_mut() {
            c.apply(&mut row);
        }
        if self.generated < self.req.min_tokens {
            for (t, l) in row.iter_mut().enumerate() {
                if self.stops(t as i64, eos) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        match draft {
            None => (self.sampler.sample(&row) as i64, false),
            Some((d, q)) => {
                let p = self.sampler.distribution(&row);
                let (t, ok) = self.sampler.verify(&p, q, *d as usize);
                (t as i64, ok)
            }
        }
    }

    /// Whether `t` ends the request (an end-of-sequence token unless ignored, or a stop id).
    pub(super) fn stops(&self, t: i64, eos: &[i64]) -> bool {
        (!self.req.ignore_eos && eos.contains(&t)) || self.req.stop_token_ids.contains(&t)
    }

    pub(super) fn finished(&self, reason: FinishReason) -> Event {
        Event::Finished {
            reason,
            usage: Usage {
                prompt_tokens: self.req.prompt.len(),
                completion_tokens: self.generated,
                cached_tokens: self.cached_tokens,
            },
        }
    }
}

/// The log-softmax of `row` at `token`, and the `k` most likely tokens with theirs.
pub(super) fn logprob(row: &[f32], token: i64, k: usize) -> TokenLogprob {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + row.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let at = |t: i64| {
        usize::try_from(t)
            .ok()
            .and_then(|i| row.get(i))
            .map_or(f32::NEG_INFINITY, |&l| l - lse)
    };
    let mut top = Vec::new();
    if k > 0 {
        let mut idx: Vec<usize> = (0..row.len()).collect();
        let k = k.min(row.len());
        idx.select_nth_unstable_by(k.saturating_sub(1), |&a, &b| {
            row[b].total_cmp(&row[a]).then(a.cmp(&b))
        });
        idx.truncate(k);
        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        top = idx.into_iter().map(|i| (i as i64, row[i] - lse)).collect();
    }
    let rank = usize::try_from(token)
        .ok()
        .and_then(|i| row.get(i))
        .map_or(row.len(), |&l| row.iter().filter(|&&x| x > l).count() + 1);
    TokenLogprob {
        token,
        logprob: at(token),
        top,
        rank,
    }
}
