//! The scheduler: continuous batching of requests over one [`Engine`], with no HTTP in sight.
//!
//! Every step holds, per data-parallel replica, at most `max_batch_size` contexts and
//! `max_batch_input_tokens` new tokens: decode rows first, then the prefill chunks of admitted
//! requests, then new requests admitted first come, first served. With chunked prefill a prompt
//! runs in budget-sized chunks; without it a prompt runs whole, and one prompt may land on a
//! full budget (the artifact's bound allows it). The replicas' rows are staged into one ragged
//! step.
//!
//! Full KV pages are shared between requests through the [`prefix::PrefixCache`]. When pages
//! run out, unreferenced cached pages are evicted first, then the youngest running request is
//! preempted: its pages are freed and it goes back to the head of the queue with the tokens it
//! generated, to be recomputed (its client sees no difference). A request whose event receiver
//! is gone is cancelled before the next step.

pub mod request;
pub mod speculative;

use crate::metrics::{BatchType, Metrics};
use crate::trace::capture::Capture;
use crate::trace::{
    GpuProfiling, ProfilingConfig, Span, SpanContext, StepTracing, TraceLevel, Tracer,
};
use maxc_kv::PageError;
use maxc_kv::PrefixCache;
use maxc_runtime::engine::Engine;
use maxc_runtime::error::RuntimeError;
use maxc_runtime::sampling::{Distribution, Sampler};
use maxc_runtime::schema::manifest::RuntimeSettings;
pub use request::{Event, EventSender, FinishReason, Request, TokenLogprob, Usage};
use speculative::{Acceptance, Planned};
pub use speculative::{Speculation, SpeculationOptions, SpeculationStats};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

/// Batch limits and policies of the scheduler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Contexts per step, per replica.
    pub max_batch_size: usize,
    /// New tokens per step, per replica.
    pub max_batch_input_tokens: usize,
    /// Replicas staged into each step.
    pub data_parallel_degree: usize,
    /// Prompts run in budget-sized chunks.
    pub enable_chunked_prefill: bool,
    /// Share full KV pages between requests.
    pub prefix_caching: bool,
}

impl SchedulerConfig {
    /// The limits an artifact was compiled for, with prefix caching on.
    pub fn from_runtime(rt: &RuntimeSettings) -> Self {
        SchedulerConfig {
            max_batch_size: rt.max_batch_size.max(1) as usize,
            max_batch_input_tokens: rt.max_batch_input_tokens.max(1) as usize,
            data_parallel_degree: rt.data_parallel_degree.max(1) as usize,
            enable_chunked_prefill: rt.enable_chunked_prefill,
            prefix_caching: true,
        }
    }
}

/// A request the scheduler holds.
struct Active {
    req: Request,
    events: EventSender,
    /// Its sequence in the page table, while admitted.
    seq: u64,
    /// Prompt and generated tokens.
    tokens: Vec<i64>,
    /// Tokens whose KV is cached.
    computed: usize,
    generated: usize,
    sampler: Sampler,
    output_counts: BTreeMap<i64, u32>,
    replica: usize,
    /// Prompt tokens found in the prefix cache at first admission.
    cached_tokens: usize,
    admitted_once: bool,
    prompt_logprobs: Vec<TokenLogprob>,
    /// Tokens whose KV the draft has cached (speculative decoding).
    draft_computed: usize,
    /// The draft's sampler (its own stream, so that proposals do not shift the decoder's).
    draft_sampler: Sampler,
    /// Its kernel capture, while armed (`x-max-trace-level: kernel`).
    capture: Option<ArmedCapture>,
}

/// A request's kernel capture: replayed into spans when it is full or the request ends
/// (dropped, whichever way it leaves the scheduler).
struct ArmedCapture {
    capture: Option<Capture>,
    tracer: Tracer,
    parent: SpanContext,
    limits: ProfilingConfig,
}

impl ArmedCapture {
    /// Whether it still records passes.
    fn recording(&self) -> bool {
        self.capture.as_ref().is_some_and(|c| !c.is_full())
    }

    /// Closes the file and hands it to the exporter for replay.
    fn finish(&mut self) {
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
    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }
    fn is_decode(&self) -> bool {
        self.generated > 0 && self.pending() == 1
    }

    /// The next token from the decoder's logits `raw` at this position: sampled, or, where a
    /// draft proposed `draft` from its distribution, verified (see
    /// [`maxc_runtime::sampling::Sampler::verify`]). Returns the token and whether it is the draft's.
    fn choose(
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
    fn stops(&self, t: i64, eos: &[i64]) -> bool {
        (!self.req.ignore_eos && eos.contains(&t)) || self.req.stop_token_ids.contains(&t)
    }

    fn finished(&self, reason: FinishReason) -> Event {
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

/// What one call of [`Scheduler::step`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Sequences in the step.
    pub sequences: usize,
    /// New tokens in the step.
    pub tokens: usize,
    /// Requests that finished (or failed).
    pub finished: usize,
    /// Requests preempted for lack of pages.
    pub preempted: usize,
}

/// Continuous batching over one engine.
pub struct Scheduler {
    engine: Engine,
    cfg: SchedulerConfig,
    waiting: VecDeque<Active>,
    running: Vec<Active>,
    prefix: Option<PrefixCache>,
    next_seq: u64,
    eos: Vec<i64>,
    metrics: Arc<Metrics>,
    spec: Option<Speculation>,
    tracing: StepTracing,
    /// Whether the engine times launches now.
    profiling_on: bool,
    /// Forward passes run.
    passes: u64,
}

/// This thread's name (or id), for kernel spans.
fn thread_name() -> String {
    let t = std::thread::current();
    t.name()
        .map_or_else(|| format!("{:?}", t.id()), str::to_string)
}

/// Where the draft's sampler starts: the request's seed moved to a stream of its own.
const DRAFT_SEED: u64 = 0xD1B5_4A32_D192_ED03;

/// The log-softmax of `row` at `token`, and the `k` most likely tokens with theirs.
fn logprob(row: &[f32], token: i64, k: usize) -> TokenLogprob {
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
    TokenLogprob {
        token,
        logprob: at(token),
        top,
    }
}

impl Scheduler {
    /// A scheduler over `engine` with `cfg`, recording into `metrics`.
    pub fn new(engine: Engine, cfg: SchedulerConfig, metrics: Arc<Metrics>) -> Self {
        let page_size = engine.pages().page_size();
        let eos = engine.artifact().manifest.eos_token_ids.clone();
        let prefix = cfg.prefix_caching.then(|| PrefixCache::new(page_size));
        metrics.kv(0, engine.pages().total_pages());
        Scheduler {
            engine,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefix,
            next_seq: 0,
            eos,
            metrics,
            spec: None,
            tracing: StepTracing::default(),
            profiling_on: false,
            passes: 0,
        }
    }

    /// Traces steps and requests as `tracing` says (`max.batch` spans, kernel captures,
    /// forward-pass spans of `gpu_profiling`).
    pub fn with_tracing(mut self, tracing: StepTracing) -> Self {
        self.engine
            .set_gpu_profiling(tracing.profiling.gpu_profiling);
        self.tracing = tracing;
        self
    }

    /// Turns on speculative decoding with `spec` for every request.
    pub fn with_speculation(mut self, spec: Speculation) -> Self {
        self.spec = Some(spec);
        self
    }

    /// The speculative-decoding draft, where it is on.
    pub fn speculation(&self) -> Option<&Speculation> {
        self.spec.as_ref()
    }

    /// Draft tokens `a` may have verified in its next step: none without speculation, while
    /// its draft is far behind, or where more tokens could not be used (max_tokens, the
    /// context length).
    fn proposals(&self, a: &Active) -> usize {
        let Some(spec) = &self.spec else {
            return 0;
        };
        if a.tokens.len() - a.draft_computed.min(a.tokens.len()) > spec.depth + 1 {
            return 0;
        }
        spec.depth
            .min(a.req.max_tokens.saturating_sub(a.generated + 1))
            .min(self.engine.max_seq_len().saturating_sub(a.tokens.len() + 1))
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Requests waiting for admission.
    pub fn queued(&self) -> usize {
        self.waiting.len()
    }

    /// Requests admitted.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Pages held by the prefix cache alone (freed when needed).
    pub fn cached_only_pages(&self) -> usize {
        self.prefix
            .as_ref()
            .map_or(0, |p| p.evictable(self.engine.pages()))
    }

    /// Queues `req`; its events go to `events`. A request that can never run (empty prompt,
    /// longer than the artifact's context, a token outside the vocabulary, prompt
    /// log-probabilities without per-token logits) gets an `Error` event at once.
    pub fn submit(&mut self, req: Request, events: EventSender) {
        let max = self.engine.max_seq_len();
        let vocab = self.engine.vocab_size() as i64;
        let problem = if req.prompt.is_empty() {
            Some("the prompt is empty".to_string())
        } else if req.prompt.len() >= max && req.max_tokens > 0 || req.prompt.len() > max {
            Some(format!(
                "the prompt has {} tokens; the model's context is {max}",
                req.prompt.len()
            ))
        } else if let Some(t) = req.prompt.iter().find(|&&t| t < 0 || t >= vocab) {
            Some(format!(
                "token id {t} is outside the vocabulary (0..{vocab})"
            ))
        } else if req.prompt_logprobs && !self.engine.all_logits() {
            Some("prompt log-probabilities need an artifact compiled with --all-logits".to_string())
        } else {
            None
        };
        if let Some(p) = problem {
            let _ = events.send(Event::Error(p));
            return;
        }
        let sampler = Sampler::new(req.sampling.clone());
        let draft_sampler = Sampler::new(maxc_runtime::sampling::SamplingParams {
            seed: req.sampling.seed ^ DRAFT_SEED,
            ..req.sampling.clone()
        });
        let capture = self.arm_capture(&req);
        self.waiting.push_back(Active {
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
            draft_computed: 0,
            draft_sampler,
        });
        self.metrics
            .num_requests_queued
            .set(self.waiting.len() as i64);
    }

    /// A kernel capture for `req`, where its header asks for kernels and headers may.
    fn arm_capture(&self, req: &Request) -> Option<ArmedCapture> {
        let t = &self.tracing;
        let trace = req.trace?;
        if !(t.headers && t.tracer.is_on() && trace.header >= Some(TraceLevel::Kernel)) {
            return None;
        }
        let limits = t.profiling;
        match Capture::create(&t.capture_dir, &trace.ctx, limits.kernel_trace_max_passes) {
            Ok(c) => Some(ArmedCapture {
                capture: Some(c),
                tracer: t.tracer.clone(),
                parent: trace.ctx,
                limits,
            }),
            Err(e) => {
                tracing::warn!(
                    "kernel capture in {}: {e}; the request runs uncaptured",
                    t.capture_dir.display()
                );
                None
            }
        }
    }

    /// Times launches in the coming step where a capture records it or `gpu_profiling` is
    /// `detailed`.
    fn choose_profiling(&mut self, plan: &[Planned]) {
        let want = self.tracing.tracer.is_on()
            && (self.tracing.profiling.gpu_profiling == GpuProfiling::Detailed
                || plan.iter().any(|p| {
                    self.running[p.idx]
                        .capture
                        .as_ref()
                        .is_some_and(ArmedCapture::recording)
                }));
        if want != self.profiling_on {
            match self.engine.set_profiling(want) {
                Ok(()) => self.profiling_on = want,
                Err(e) => {
                    // Once: the tracer stays on, launches go untimed.
                    tracing::warn!("kernel timings: {e}");
                    self.tracing.profiling.gpu_profiling = GpuProfiling::Off;
                    for a in self.running.iter_mut().chain(self.waiting.iter_mut()) {
                        a.capture = None;
                    }
                    self.tracing.headers = false;
                }
            }
        }
    }

    /// The spans of a pass over `plan` that ran from `start` to `end` (Unix nanoseconds):
    /// `max.batch` (at level `batch`, or where a request in it carries a trace header) linked
    /// to the requests it ran, at most `kernel_trace_max_batch_links`; `gpu_profiling`'s
    /// forward-pass span (and launch spans where `detailed`); and the pass in each armed
    /// capture.
    fn trace_pass(&mut self, plan: &[Planned], start: u64, end: u64) {
        let pass = self.passes;
        self.passes += 1;
        let t = &self.tracing;
        if !t.tracer.is_on() {
            return;
        }
        // Each traced request once (an HTTP request's `n` choices share its span).
        let mut traced: Vec<&crate::trace::RequestTrace> = Vec::new();
        for p in plan {
            if let Some(r) = self.running[p.idx].req.trace.as_ref() {
                if !traced.iter().any(|t| t.ctx == r.ctx) {
                    traced.push(r);
                }
            }
        }
        let rows: usize = plan.iter().map(|p| p.n + p.drafts.len()).sum();
        let prefill = plan.iter().any(|p| !self.running[p.idx].is_decode());
        if t.level >= TraceLevel::Batch || traced.iter().any(|r| r.header.is_some()) {
            let cap =
                usize::try_from(t.profiling.kernel_trace_max_batch_links).unwrap_or(usize::MAX);
            let links: Vec<SpanContext> = traced.iter().take(cap).map(|r| r.ctx).collect();
            let mut attributes = BTreeMap::new();
            attributes.insert("max.batch.pass".into(), pass.into());
            attributes.insert("max.batch.size".into(), plan.len().into());
            attributes.insert("max.batch.tokens".into(), rows.into());
            attributes.insert(
                "max.batch.type".into(),
                if prefill { "CE" } else { "TG" }.into(),
            );
            attributes.insert(
                "max.batch.links_dropped".into(),
                (traced.len() - links.len()).into(),
            );
            t.tracer.export(Span {
                name: "max.batch".into(),
                ctx: SpanContext::new_root(),
                parent: None,
                start_unix_ns: start,
                end_unix_ns: end,
                attributes,
                links,
            });
        }
        let profile = if self.profiling_on {
            self.engine.last_profile().cloned()
        } else {
            None
        };
        if t.profiling.gpu_profiling != GpuProfiling::Off {
            let ctx = SpanContext::new_root();
            let mut attributes = BTreeMap::new();
            attributes.insert("max.pass".into(), pass.into());
            attributes.insert("max.pass.total_seq_len".into(), rows.into());
            attributes.insert("max.pass.batch_size".into(), plan.len().into());
            t.tracer.export(Span {
                name: "max.forward".into(),
                ctx,
                parent: None,
                start_unix_ns: start,
                end_unix_ns: end,
                attributes,
                links: Vec::new(),
            });
            if let (GpuProfiling::Detailed, Some(profile)) = (t.profiling.gpu_profiling, &profile) {
                let program = self.engine.program();
                for l in &profile.launches {
                    let Some(launch) = program.launches.get(l.launch) else {
                        continue;
                    };
                    let Some(k) = program.kernels.get(launch.kernel as usize) else {
                        continue;
                    };
                    let launch = crate::trace::capture::CapturedLaunch {
                        name: k.name.clone(),
                        kind: k.body.kind().to_string(),
                        nodes: launch.nodes.clone(),
                        start_unix_ns: start + l.start_ns,
                        dur_ns: l.dur_ns,
                        thread: thread_name(),
                    };
                    t.tracer
                        .export(crate::trace::capture::kernel_span(&launch, &ctx));
                }
            }
        }
        if let Some(profile) = &profile {
            let thread = thread_name();
            for p in plan {
                let a = &mut self.running[p.idx];
                let Some(armed) = a.capture.as_mut() else {
                    continue;
                };
                let Some(c) = armed.capture.as_mut() else {
                    continue;
                };
                if let Err(e) = c.record(self.engine.program(), profile, start, &thread) {
                    tracing::warn!("kernel capture: {e}; capture stopped");
                    armed.capture = None;
                    continue;
                }
                if c.is_full() {
                    armed.finish();
                }
            }
        }
    }

    /// Frees `a`'s pages, caching its full computed pages first.
    fn retire(&mut self, a: &Active) {
        if let Some(p) = self.prefix.as_mut() {
            let pages = self.engine.pages().pages(a.seq).to_vec();
            p.insert(self.engine.pages_mut(), &a.tokens[..a.computed], &pages);
        }
        self.engine.release(a.seq);
        if let Some(spec) = self.spec.as_mut() {
            spec.engine.release(a.seq);
        }
    }

    fn drop_cancelled(&mut self) -> usize {
        let mut n = 0;
        self.waiting.retain(|a| {
            let keep = !a.events.is_closed();
            n += usize::from(!keep);
            keep
        });
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].events.is_closed() {
                let a = self.running.remove(i);
                self.retire(&a);
                n += 1;
            } else {
                i += 1;
            }
        }
        n
    }

    /// Pages the next `tokens` of a sequence at `computed` need beyond what it holds.
    fn pages_needed(&self, seq: u64, computed: usize, tokens: usize) -> usize {
        let ps = self.engine.pages().page_size();
        (computed + tokens)
            .div_ceil(ps)
            .saturating_sub(self.engine.pages().pages(seq).len())
    }

    /// Composes the next step: each planned sequence with its tokens and the draft tokens it
    /// may propose, in replica order.
    fn compose(&mut self) -> Vec<Planned> {
        let dp = self.cfg.data_parallel_degree;
        let mut budget = vec![self.cfg.max_batch_input_tokens; dp];
        let mut contexts = vec![0usize; dp];
        let mut has_prefill = vec![false; dp];
        let mut plan: Vec<Vec<Planned>> = (0..dp).map(|_| Vec::new()).collect();
        for a in &self.running {
            contexts[a.replica] += 1;
        }
        let chunked = self.cfg.enable_chunked_prefill;
        let take = |pending: usize, budget: usize, has_prefill: bool| -> usize {
            if chunked {
                pending.min(budget)
            } else if pending <= budget || !has_prefill {
                pending
            } else {
                0
            }
        };
        // Decode rows, then prefill chunks of admitted requests.
        for pass in [true, false] {
            for (i, a) in self.running.iter().enumerate() {
                if a.is_decode() != pass || a.pending() == 0 {
                    continue;
                }
                let r = a.replica;
                let n = if pass {
                    usize::from(budget[r] > 0)
                } else {
                    take(a.pending(), budget[r], has_prefill[r])
                };
                if n > 0 {
                    let propose = if pass {
                        self.proposals(a).min(budget[r] - n)
                    } else {
                        0
                    };
                    budget[r] = budget[r].saturating_sub(n + propose);
                    has_prefill[r] |= !pass;
                    plan[r].push(Planned::new(i, n, propose));
                }
            }
        }
        // Admission, first come first served, while pages last.
        let mut free = self.engine.pages().free_pages() + self.cached_only_pages();
        for p in plan.iter().flatten() {
            let a = &self.running[p.idx];
            free = free.saturating_sub(self.pages_needed(a.seq, a.computed, p.n + p.propose));
        }
        while let Some(head) = self.waiting.front() {
            let Some(r) = (0..dp)
                .filter(|&r| contexts[r] < self.cfg.max_batch_size && budget[r] > 0)
                .min_by_key(|&r| (contexts[r], r))
            else {
                break;
            };
            let ps = self.engine.pages().page_size();
            let first = take(head.tokens.len(), budget[r], has_prefill[r]);
            if first == 0 || first.div_ceil(ps) > free {
                break;
            }
            let Some(mut a) = self.waiting.pop_front() else {
                break;
            };
            self.next_seq += 1;
            a.seq = self.next_seq;
            a.replica = r;
            a.computed = 0;
            // Prompt log-probabilities need every prompt row computed: no cache for them.
            if let Some(cache) = self.prefix.as_mut().filter(|_| !a.req.prompt_logprobs) {
                let pages = cache.lookup(&a.tokens);
                if !pages.is_empty() && self.engine.pages_mut().attach_prefix(a.seq, &pages).is_ok()
                {
                    a.computed = pages.len() * ps;
                    if !a.admitted_once {
                        self.metrics
                            .cache_device_blocks_served
                            .inc_by(pages.len() as u64);
                    }
                }
            }
            if !a.admitted_once {
                a.admitted_once = true;
                let hit = a.computed.min(a.req.prompt.len());
                a.cached_tokens = hit;
                let _ = a.events.send(Event::Admitted { cached_tokens: hit });
                if self.prefix.is_some() {
                    self.metrics
                        .cache_hits
                        .get_or_create(&vec![("tier".into(), "g0".into())])
                        .inc_by(hit as u64);
                    self.metrics
                        .cache_misses
                        .inc_by((a.req.prompt.len() - hit) as u64);
                    self.metrics
                        .cache_request_prefix_coverage
                        .observe(100.0 * hit as f64 / a.req.prompt.len() as f64);
                }
            }
            let n = take(a.pending(), budget[r], has_prefill[r]);
            free = free.saturating_sub(n.div_ceil(ps));
            budget[r] -= n.min(budget[r]);
            has_prefill[r] = true;
            contexts[r] += 1;
            self.running.push(a);
            plan[r].push(Planned::new(self.running.len() - 1, n, 0));
        }
        if dp > 1 {
            let used: usize = plan.iter().flatten().map(|p| p.n + p.propose).sum();
            let capacity = self.cfg.max_batch_input_tokens * dp;
            let ctx: usize = contexts.iter().sum();
            let m = &self.metrics;
            m.dp_active_tokens.inc_by(used as u64);
            m.dp_step_capacity_tokens.inc_by(capacity as u64);
            m.dp_active_token_occupancy
                .observe(100.0 * used as f64 / capacity as f64);
            m.dp_context_token_occupancy
                .observe(100.0 * ctx as f64 / (self.cfg.max_batch_size * dp) as f64);
        }
        plan.into_iter().flatten().collect()
    }

    /// Preempts the youngest running request in `plan` (freeing its pages and sending it back to
    /// the head of the queue to be recomputed); returns false where there is none.
    fn preempt_youngest(&mut self, plan: &mut Vec<Planned>) -> bool {
        let Some(victim) = plan.iter().map(|p| p.idx).max() else {
            return false;
        };
        let mut a = self.running.remove(victim);
        self.engine.release(a.seq);
        if let Some(spec) = self.spec.as_mut() {
            spec.engine.release(a.seq);
        }
        a.computed = 0;
        a.draft_computed = 0;
        plan.retain(|p| p.idx != victim);
        for p in plan.iter_mut() {
            if p.idx > victim {
                p.idx -= 1;
            }
        }
        self.metrics.cache_preemption_count.inc();
        self.waiting.push_front(a);
        true
    }

    /// Runs one step; returns what it did (nothing where no request can run).
    pub fn step(&mut self) -> StepReport {
        let mut report = StepReport::default();
        report.finished += self.drop_cancelled();
        let t0 = Instant::now();
        let mut plan = self.compose();
        if let Some(spec) = self.spec.as_mut() {
            speculative::propose(spec, &mut self.running, &mut plan);
        }
        let creation_ms = t0.elapsed().as_secs_f64() * 1e3;
        // Execute, evicting cached pages and then preempting until the step fits.
        let (logits, plan, exec_ms, start_unix, exec) = loop {
            if plan.is_empty() {
                if self.running.is_empty() {
                    // Nothing runs and the head of the queue does not fit an empty cache.
                    if let Some(a) = self.waiting.pop_front() {
                        let pages = self.engine.pages();
                        let _ = a.events.send(Event::Error(format!(
                            "the KV cache ({} pages of {}) cannot hold this request",
                            pages.total_pages(),
                            pages.page_size()
                        )));
                        report.finished += 1;
                    }
                }
                self.update_gauges();
                return report;
            }
            self.choose_profiling(&plan);
            let rows: Vec<Vec<i64>> = plan
                .iter()
                .map(|p| {
                    let a = &self.running[p.idx];
                    let mut t = a.tokens[a.computed..a.computed + p.n].to_vec();
                    t.extend(p.drafts.iter().map(|d| d.0));
                    t
                })
                .collect();
            let chunks: Vec<(u64, &[i64])> = plan
                .iter()
                .zip(&rows)
                .map(|(p, t)| (self.running[p.idx].seq, &t[..]))
                .collect();
            let n_logits = 1 + plan.iter().map(|p| p.drafts.len()).max().unwrap_or(0);
            let t = Instant::now();
            let start_unix = crate::trace::now_unix_ns();
            match self.engine.step_n(&chunks, n_logits) {
                Ok(l) => {
                    let exec = t.elapsed();
                    break (l, plan, exec.as_secs_f64() * 1e3, start_unix, exec);
                }
                Err(RuntimeError::Pages(PageError::OutOfPages { needed, .. })) => {
                    let want = self.engine.pages().free_pages() + needed;
                    let evicted = match self.prefix.as_mut() {
                        Some(p) => p.evict(self.engine.pages_mut(), want),
                        None => 0,
                    };
                    if evicted == 0 {
                        if self.running.len() == 1 {
                            // Alone and still out of pages: the cache cannot hold it.
                            let a = self.running.remove(0);
                            let total = self.engine.pages().total_pages();
                            let _ = a.events.send(Event::Error(format!(
                                "the KV cache ({total} pages of {}) cannot hold this request",
                                self.engine.pages().page_size()
                            )));
                            self.engine.release(a.seq);
                            if let Some(spec) = self.spec.as_mut() {
                                spec.engine.release(a.seq);
                            }
                            report.finished += 1;
                            self.update_gauges();
                            return report;
                        }
                        if !self.preempt_youngest(&mut plan) {
                            self.update_gauges();
                            return report;
                        }
                        report.preempted += 1;
                    }
                }
                Err(e) => {
                    // The step's inputs were refused: fail its requests, keep serving others.
                    let mut idx: Vec<usize> = plan.iter().map(|p| p.idx).collect();
                    idx.sort_unstable();
                    for &i in idx.iter().rev() {
                        let a = self.running.remove(i);
                        let _ = a.events.send(Event::Error(e.to_string()));
                        self.retire(&a);
                        report.finished += 1;
                    }
                    self.update_gauges();
                    return report;
                }
            }
        };
        self.trace_pass(&plan, start_unix, start_unix + exec.as_nanos() as u64);
        let all_logits = self.engine.all_logits();
        let n_logits = if all_logits {
            1
        } else {
            logits.rows / plan.len().max(1)
        };
        let page_size = self.engine.pages().page_size();
        let max_seq_len = self.engine.max_seq_len();
        let mut done = Vec::new();
        let mut row_end = 0usize;
        let mut prefill = false;
        let mut context_tokens = 0;
        let mut acceptance = Acceptance::default();
        for (b, p) in plan.iter().enumerate() {
            let (i, n, k) = (p.idx, p.n, p.drafts.len());
            let a = &mut self.running[i];
            let start = a.computed;
            prefill |= !a.is_decode();
            report.tokens += n + k;
            context_tokens += start + n + k;
            row_end += n + k;
            if a.req.prompt_logprobs && all_logits {
                if start == 0 {
                    // The first prompt token has no log-probability.
                    a.prompt_logprobs.push(TokenLogprob {
                        token: a.tokens[0],
                        logprob: f32::NAN,
                        top: Vec::new(),
                    });
                }
                // Row `p` predicts the token at `p + 1`.
                for (j, p) in (start..start + n).enumerate() {
                    if p + 1 < a.req.prompt.len() {
                        let row = logits.row(row_end - n + j);
                        let k = a.req.logprobs.unwrap_or(0);
                        a.prompt_logprobs.push(logprob(row, a.tokens[p + 1], k));
                    }
                }
            }
            a.computed += n;
            let mut finish = None;
            if a.pending() == 0 {
                if !a.prompt_logprobs.is_empty() {
                    let lp = std::mem::take(&mut a.prompt_logprobs);
                    let _ = a.events.send(Event::PromptLogprobs(lp));
                }
                if a.generated >= a.req.max_tokens {
                    finish = Some(FinishReason::Length);
                }
                // The logits of the sequence's last row, and of each proposal before it.
                let row_of = |j: usize| {
                    if all_logits {
                        row_end - 1
                    } else {
                        b * n_logits + n_logits - 1 - k + j
                    }
                };
                // Proposals in play (all k after a rejection; those compared where the
                // request ended first), and those accepted.
                let (mut examined, mut accepted) = (0, 0);
                let mut j = 0;
                while finish.is_none() && j <= k {
                    examined += usize::from(j < k);
                    let raw = logits.row(row_of(j));
                    let (token, ok) = a.choose(raw, p.drafts.get(j), &self.eos);
                    let lp = a.req.logprobs.map(|k| logprob(raw, token, k));
                    a.tokens.push(token);
                    a.generated += 1;
                    *a.output_counts.entry(token).or_default() += 1;
                    let _ = a.events.send(Event::Token {
                        id: token,
                        logprob: lp,
                    });
                    finish = if a.stops(token, &self.eos) && a.generated >= a.req.min_tokens {
                        Some(FinishReason::Stop)
                    } else if a.generated >= a.req.max_tokens || a.tokens.len() >= max_seq_len {
                        Some(FinishReason::Length)
                    } else {
                        None
                    };
                    if !ok {
                        examined = k;
                        break;
                    }
                    // The accepted draft token's KV is already cached.
                    accepted += 1;
                    a.computed += 1;
                    j += 1;
                }
                acceptance.add(examined, accepted);
            }
            if k > 0 {
                // Drop the rejected proposals from both caches.
                a.draft_computed = a.draft_computed.min(a.computed);
                let dropped = self.engine.truncate(a.seq, a.computed).and_then(|()| {
                    match self.spec.as_mut() {
                        Some(spec) => spec.engine.truncate(a.seq, a.draft_computed),
                        None => Ok(()),
                    }
                });
                if let Err(e) = dropped {
                    // Never go on over rejected tokens' keys and values.
                    let _ = a.events.send(Event::Error(format!(
                        "dropping rejected draft tokens failed: {e}"
                    )));
                    done.push(i);
                    continue;
                }
            }
            if a.computed / page_size > start / page_size {
                if let Some(cache) = self.prefix.as_mut() {
                    let pages = self.engine.pages().pages(a.seq).to_vec();
                    cache.insert(self.engine.pages_mut(), &a.tokens[..a.computed], &pages);
                }
            }
            if let Some(reason) = finish {
                let _ = a.events.send(a.finished(reason));
                done.push(i);
            }
        }
        if let Some(spec) = self.spec.as_mut() {
            acceptance.record(&self.metrics, spec);
        }
        report.sequences = plan.len();
        report.finished += done.len();
        done.sort_unstable();
        for &i in done.iter().rev() {
            let a = self.running.remove(i);
            self.retire(&a);
        }
        let batch = if prefill {
            BatchType::Ce
        } else {
            BatchType::Tg
        };
        self.metrics.batch(batch).record(
            plan.len(),
            report.tokens,
            context_tokens,
            creation_ms,
            exec_ms,
            done.len(),
            self.waiting.len(),
        );
        let rate = report.tokens as f64 / (exec_ms / 1e3).max(1e-9);
        match batch {
            BatchType::Ce => self.metrics.batch_prompt_throughput.observe(rate),
            BatchType::Tg => self.metrics.batch_generation_throughput.observe(rate),
        }
        self.update_gauges();
        report
    }

    fn update_gauges(&self) {
        let pages = self.engine.pages();
        self.metrics.kv(
            pages.total_pages() - pages.free_pages(),
            pages.total_pages(),
        );
        self.metrics
            .cache_prefix_only_blocks
            .set(self.cached_only_pages() as i64);
        self.metrics
            .num_requests_queued
            .set(self.waiting.len() as i64);
        self.metrics
            .num_requests_running
            .set(self.running.len() as i64);
    }
}

/// What the scheduler thread is told.
enum Command {
    Submit(Request, EventSender),
}

/// A scheduler running on its own thread; requests reach it through [`SchedulerHandle::submit`].
/// Dropping every handle stops the thread once its requests are done.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: std::sync::mpsc::Sender<Command>,
}

impl SchedulerHandle {
    /// Runs `scheduler` on a new thread.
    pub fn spawn(mut scheduler: Scheduler) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<Command>();
        std::thread::Builder::new()
            .name("maxc-scheduler".into())
            .spawn(move || loop {
                if !scheduler.has_work() {
                    match rx.recv() {
                        Ok(Command::Submit(r, e)) => scheduler.submit(r, e),
                        Err(_) => return,
                    }
                }
                while let Ok(Command::Submit(r, e)) = rx.try_recv() {
                    scheduler.submit(r, e);
                }
                scheduler.step();
            })?;
        Ok(SchedulerHandle { tx })
    }

    /// Queues `req`; its events arrive on the returned receiver, and dropping the receiver
    /// cancels it.
    pub fn submit(&self, req: Request) -> tokio::sync::mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        if let Err(std::sync::mpsc::SendError(Command::Submit(_, events))) =
            self.tx.send(Command::Submit(req, tx))
        {
            let _ = events.send(Event::Error("the scheduler has stopped".into()));
        }
        rx
    }
}
