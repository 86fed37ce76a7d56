//! The scheduler's state (its requests, the KV cache it owns, the executor it drives) and its
//! public calls: submit a request, run a step. A step is three phases in order:
//! [`Scheduler::schedule`] (in `schedule.rs`), the executor's `execute`, and
//! [`Scheduler::update`] (in `update.rs`); what they did is returned as [`StepStats`] and
//! recorded in the metrics by the caller of the phases, never by the phases themselves.

use super::active::{Active, ArmedCapture};
use super::plan::StepPlan;
use super::request::{Event, EventSender, Request};
use super::speculative::Speculation;
use super::stats::{Gauges, StepStats};
use crate::metrics::Metrics;
use crate::trace::capture::Capture;
use crate::trace::{StepTracing, TraceLevel};
use maxc_kv::KvCache;
use maxc_runtime::engine::{RoleInfo, StepExecutor};
use maxc_runtime::schema::manifest::RuntimeSettings;
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

/// Continuous batching over one executor, whose KV cache it owns.
pub struct Scheduler {
    pub(super) exec: Box<dyn StepExecutor>,
    pub(super) info: RoleInfo,
    pub(super) kv: KvCache,
    pub(super) cfg: SchedulerConfig,
    pub(super) waiting: VecDeque<Active>,
    pub(super) running: Vec<Active>,
    pub(super) next_seq: u64,
    pub(super) metrics: Arc<Metrics>,
    pub(super) spec: Option<Speculation>,
    pub(super) tracing: StepTracing,
    /// Whether the executor times launches now.
    pub(super) profiling_on: bool,
    /// Forward passes run.
    pub(super) passes: u64,
    /// Choices of `n > 1` requests waiting for their leader's prefill, by fork group.
    pub(super) parked: BTreeMap<u64, Vec<Active>>,
    /// Why the executor can run no more steps (its ranks' group ended), once it cannot.
    pub(super) broken: Arc<std::sync::OnceLock<String>>,
}

impl Scheduler {
    /// A scheduler over `exec` with `cfg`, recording into `metrics`.
    pub fn new(
        exec: impl StepExecutor + 'static,
        cfg: SchedulerConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        let info = exec.info().clone();
        let kv = KvCache::new(info.page_table(), cfg.prefix_caching);
        let s = Scheduler {
            exec: Box::new(exec),
            info,
            kv,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_seq: 0,
            metrics,
            spec: None,
            tracing: StepTracing::default(),
            profiling_on: false,
            passes: 0,
            parked: BTreeMap::new(),
            broken: Arc::default(),
        };
        s.gauges().record(&s.metrics);
        s
    }

    /// A scheduler over `engine` at its artifact's limits, without prefix caching and with
    /// metrics of its own: for one prompt at a time through [`super::generate`].
    pub fn alone(engine: maxc_runtime::Engine) -> Self {
        let mut cfg = SchedulerConfig::from_runtime(&engine.artifact().manifest.runtime);
        cfg.prefix_caching = false;
        Scheduler::new(engine, cfg, Arc::new(Metrics::new()))
    }

    /// Traces steps and requests as `tracing` says (`max.batch` spans, kernel captures,
    /// forward-pass spans of `gpu_profiling`).
    pub fn with_tracing(mut self, tracing: StepTracing) -> Self {
        self.exec.set_gpu_profiling(tracing.profiling.gpu_profiling);
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

    /// The role it runs: bounds and tokens.
    pub fn info(&self) -> &RoleInfo {
        &self.info
    }

    /// The KV cache it owns (read-only).
    pub fn kv(&self) -> &KvCache {
        &self.kv
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
        !self.waiting.is_empty() || !self.running.is_empty() || !self.parked.is_empty()
    }

    /// Pages held by the prefix cache alone (freed when needed).
    pub fn cached_only_pages(&self) -> usize {
        self.kv.cached_only_pages()
    }

    /// Queues `req`; its events go to `events`. A request that can never run (empty prompt,
    /// longer than the model's context, a token outside the vocabulary, prompt
    /// log-probabilities without per-token logits) gets an `Error` event at once.
    pub fn submit(&mut self, req: Request, events: EventSender) {
        if let Some(p) = self.refusal(&req) {
            let _ = events.send(Event::Error(p));
            return;
        }
        let capture = self.arm_capture(&req);
        let a = Active::new(req, events, capture);
        match a.req.fork {
            // A choice after the first waits for the first's prefill.
            Some(f) if !f.leader && self.leader(f.group).is_some_and(|l| l.prefilling()) => {
                self.parked.entry(f.group).or_default().push(a)
            }
            _ => self.waiting.push_back(a),
        }
    }

    /// The leader of fork group `group`, where it is queued or running.
    pub(super) fn leader(&self, group: u64) -> Option<&Active> {
        let is_leader = |a: &&Active| {
            a.req.fork
                == Some(super::request::Fork {
                    group,
                    leader: true,
                })
        };
        self.running
            .iter()
            .find(is_leader)
            .or_else(|| self.waiting.iter().find(is_leader))
    }

    /// Sends the parked choices whose leader has prefilled its prompt (or is gone) to the head
    /// of the queue, in submission order.
    pub(super) fn release_forks(&mut self) {
        let ready: Vec<u64> = self
            .parked
            .keys()
            .copied()
            .filter(|&g| !self.leader(g).is_some_and(|l| l.prefilling()))
            .collect();
        for g in ready {
            for a in self.parked.remove(&g).into_iter().flatten().rev() {
                self.waiting.push_front(a);
            }
        }
    }

    /// Why `req` can never run, if it cannot.
    /// Why the executor can run no more steps (the ranks of its group failed), once it cannot.
    pub fn broken(&self) -> Option<&str> {
        self.broken.get().map(String::as_str)
    }

    fn refusal(&self, req: &Request) -> Option<String> {
        if let Some(why) = self.broken.get() {
            return Some(format!("the model can run no more steps: {why}"));
        }
        let max = self.info.max_seq_len;
        let vocab = self.info.vocab_size as i64;
        if req.prompt.is_empty() {
            Some("the prompt is empty".to_string())
        } else if req.prompt.len() >= max && req.max_tokens > 0 || req.prompt.len() > max {
            Some(format!(
                "the prompt has {} tokens; the model's context is {max}",
                req.prompt.len()
            ))
        } else {
            req.prompt
                .iter()
                .find(|&&t| t < 0 || t >= vocab)
                .map(|t| format!("token id {t} is outside the vocabulary (0..{vocab})"))
        }
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

    /// Runs one step, its three phases in order, and records what it did in the metrics;
    /// returns a summary (nothing where no request can run).
    pub fn step(&mut self) -> StepReport {
        let mut stats = StepStats::default();
        if let Some(plan) = self.schedule(&mut stats) {
            self.run_planned(plan, &mut stats);
        }
        self.report(stats)
    }

    /// The rows of `plan` whose requests' structured outputs sample this step.
    pub(super) fn constrained(&self, plan: &StepPlan) -> Vec<usize> {
        plan.rows
            .iter()
            .filter(|p| {
                let a = &self.running[p.idx];
                a.req.constraint.is_some() && a.pending() == p.n
            })
            .map(|p| p.idx)
            .collect()
    }

    /// The executor's and the update's phases of a scheduled step.
    pub(super) fn run_planned(&mut self, plan: StepPlan, stats: &mut StepStats) {
        let t = Instant::now();
        let start_unix = crate::trace::now_unix_ns();
        // The structured outputs' masks of the tokens this step samples are computed
        // while the forward pass runs: they depend on the tokens chosen so far only.
        let sampling = self.constrained(&plan);
        let mut constraints: Vec<&mut crate::constraint::Constraint> = self
            .running
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| sampling.contains(i))
            .filter_map(|(_, a)| a.req.constraint.as_mut())
            .collect();
        let exec_step = &mut self.exec;
        let result = if constraints.is_empty() {
            exec_step.execute(&plan.step.inputs)
        } else {
            let (result, forward, masks) = std::thread::scope(|scope| {
                let masks = scope.spawn(|| {
                    let t = Instant::now();
                    constraints.iter_mut().for_each(|c| c.prepare());
                    t.elapsed()
                });
                let result = exec_step.execute(&plan.step.inputs);
                let forward = t.elapsed();
                let masks = masks
                    .join()
                    .unwrap_or_else(|e| std::panic::resume_unwind(e));
                (result, forward, masks)
            });
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            let m = &self.metrics;
            m.structured_output_mask_time.observe(ms(masks));
            m.structured_output_mask_exposed_time
                .observe(ms(t.elapsed().saturating_sub(forward)));
            result
        };
        self.conclude(plan, result, t, start_unix, stats);
    }

    /// The update phase of a step whose forward pass began at `t` (`start_unix` since the
    /// epoch) and gave `result`.
    pub(super) fn conclude(
        &mut self,
        plan: StepPlan,
        result: maxc_runtime::Result<maxc_runtime::Logits>,
        t: Instant,
        start_unix: u64,
        stats: &mut StepStats,
    ) {
        let exec = t.elapsed();
        if result.is_ok() {
            self.trace_pass(&plan, start_unix, start_unix + exec.as_nanos() as u64);
        }
        self.update(plan, result, exec, stats);
    }

    /// Records what a step did in the metrics, and sums it up.
    pub(super) fn report(&self, mut stats: StepStats) -> StepReport {
        stats.gauges = self.gauges();
        stats.record(&self.metrics);
        StepReport {
            sequences: stats.batch.as_ref().map_or(0, |b| b.sequences),
            tokens: stats.batch.as_ref().map_or(0, |b| b.tokens),
            finished: stats.finished,
            preempted: stats.preempted,
        }
    }

    /// The queues and the KV cache now.
    pub(super) fn gauges(&self) -> Gauges {
        let pages = self.kv.pages();
        Gauges {
            queued: self.waiting.len(),
            running: self.running.len(),
            used_pages: pages.total_pages() - pages.free_pages(),
            total_pages: pages.total_pages(),
            cached_only_pages: self.kv.cached_only_pages(),
        }
    }

    /// Frees `a`'s pages in every cache, caching its full computed pages first.
    pub(super) fn retire(&mut self, a: &Active) {
        self.kv.cache_prefix(a.seq, &a.tokens[..a.computed]);
        self.kv.release(a.seq);
        if let Some(spec) = self.spec.as_mut() {
            spec.kv.release(a.seq);
        }
    }
}
