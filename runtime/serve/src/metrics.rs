//! The serving metrics, named and meant as MAX's serve metrics (`maxserve_*`), in a
//! prometheus-client registry. The scheduler and the server record into one [`Metrics`]; the
//! metrics endpoint encodes it as Prometheus text.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use std::sync::atomic::AtomicU64;

type Labels = Vec<(String, String)>;
type HistFamily = Family<Labels, Histogram, fn() -> Histogram>;

fn ms_histogram() -> Histogram {
    // 0.5 ms to about 4.6 minutes.
    Histogram::new(exponential_buckets(0.5, 2.0, 20))
}
fn fine_ms_histogram() -> Histogram {
    // 10 µs to about 5 s.
    Histogram::new(exponential_buckets(0.01, 2.0, 20))
}
fn count_histogram() -> Histogram {
    // 1 to about 65k.
    Histogram::new(exponential_buckets(1.0, 2.0, 17))
}
fn pct_histogram() -> Histogram {
    Histogram::new([1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 100.0])
}
fn rate_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 20))
}

/// A step's batch type as MAX labels it: `CE` (context encoding: the step holds a prefill
/// chunk) or `TG` (token generation: decode rows only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchType {
    /// Context encoding.
    Ce,
    /// Token generation.
    Tg,
}

impl BatchType {
    fn labels(self) -> Labels {
        let v = match self {
            BatchType::Ce => "CE",
            BatchType::Tg => "TG",
        };
        vec![("batch_type".into(), v.into())]
    }
}

/// Every serving metric.
pub struct Metrics {
    registry: Registry,
    /// Request latency, arrival to last byte.
    pub request_time: Histogram,
    /// Tokenizing (and templating) a request.
    pub input_processing_time: Histogram,
    /// Detokenizing a request's output.
    pub output_processing_time: Histogram,
    /// Arrival to first generated token.
    pub time_to_first_token: Histogram,
    /// Mean time per output token after the first, per request.
    pub time_per_output_token: Histogram,
    /// Time between consecutive output tokens.
    pub itl: Histogram,
    /// Prompt tokens of finished requests.
    pub num_input_tokens: Counter,
    /// Generated tokens.
    pub num_output_tokens: Counter,
    /// Characters of prompts received.
    pub num_input_characters: Counter,
    /// Prompt tokens per request.
    pub input_tokens_per_request: Histogram,
    /// Generated tokens per request.
    pub output_tokens_per_request: Histogram,
    /// HTTP requests by `code` and `path`.
    pub request_count: Family<Labels, Counter>,
    /// Requests being generated for.
    pub num_requests_running: Gauge,
    /// Requests waiting for their first step.
    pub num_requests_queued: Gauge,
    /// Requests received but not yet handed to the scheduler.
    pub num_requests_awaiting_admission: Gauge,
    /// Per step: requests awaiting admission.
    pub requests_awaiting_admission: Histogram,
    /// Responses produced but not yet sent to their client.
    pub num_responses_buffered: Gauge,
    /// Per response event: events buffered ahead of it.
    pub responses_buffered: Histogram,
    /// Time an event waits between the scheduler and the client.
    pub response_queue_time: Histogram,
    /// Per step by batch type: sequences.
    pub batch_size: HistFamily,
    /// Per step by batch type: execution time.
    pub batch_execution_time: HistFamily,
    /// Per step by batch type: time to compose the step.
    pub batch_creation_time: HistFamily,
    /// Per step by batch type: new tokens.
    pub batch_input_tokens: HistFamily,
    /// Per step by batch type: context tokens (cached plus new).
    pub batch_context_tokens: HistFamily,
    /// Per CE step: prompt tokens per second.
    pub batch_prompt_throughput: Histogram,
    /// Per TG step: generated tokens per second.
    pub batch_generation_throughput: Histogram,
    /// Per step by batch type: requests that finished.
    pub batch_terminated_reqs: HistFamily,
    /// Per step by batch type: requests left waiting.
    pub batch_pending_reqs: HistFamily,
    /// KV pages in use (held by a sequence or the prefix cache).
    pub cache_num_used_blocks: Gauge,
    /// KV pages in all.
    pub cache_num_total_blocks: Gauge,
    /// KV pages held by the prefix cache alone, which no request uses (maxc's own metric:
    /// once every request is done, the pages in use are exactly these).
    pub cache_prefix_only_blocks: Gauge,
    /// Per request: share of the prompt found in the prefix cache.
    pub cache_request_prefix_coverage: Histogram,
    /// Requests preempted (to be recomputed) for lack of pages.
    pub cache_preemption_count: Counter,
    /// Prompt tokens found in the prefix cache, by `tier` (`g0`: device memory).
    pub cache_hits: Family<Labels, Counter>,
    /// Prompt tokens not found in the prefix cache.
    pub cache_misses: Counter,
    /// Share of KV pages in use.
    pub cache_used_kv_pct: Gauge<f64, AtomicU64>,
    /// Threads the CPU kernels split a decode step across now (maxc's own metric: fewer than
    /// the thread count while other processes keep the CPUs busy; prefill steps take every
    /// thread), and the thread count.
    pub cpu_threads: Gauge,
    pub cpu_threads_max: Gauge,
    /// Pages served from the prefix cache.
    pub cache_device_blocks_served: Counter,
    /// Per step (data parallel): new tokens over the replicas' token budgets.
    pub dp_active_token_occupancy: Histogram,
    /// Per step (data parallel): contexts over the replicas' batch sizes.
    pub dp_context_token_occupancy: Histogram,
    /// New tokens run (data parallel).
    pub dp_active_tokens: Counter,
    /// Token budget offered by steps (data parallel).
    pub dp_step_capacity_tokens: Counter,
    /// Per speculative step: the share of draft tokens accepted at each draft `position`
    /// (0 is the first draft token), over the sequences that proposed one there.
    pub spec_decode_acceptance_rate_per_position: HistFamily,
    /// Per speculative step: draft tokens accepted per proposing sequence (the decoder's own
    /// token not counted).
    pub spec_decode_avg_acceptance_length: Histogram,
    /// Load time by `component`.
    pub model_load_time: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Pipelines (artifacts) loaded.
    pub pipeline_load: Counter,
    /// Answers that do not conform to their JSON `response_format`, by `outcome`
    /// (`truncated`: cut at `max_tokens`; `invalid_json`: ended and does not parse).
    pub response_format_conformance_errors: Family<Labels, Counter>,
    /// Answers whose tool calls did not conform, by `outcome` (`invalid_json`: text that
    /// opened a call is not one; `unknown_tool`: a call of a tool not listed).
    pub tool_call_conformance_errors: Family<Labels, Counter>,
    /// Requests refused with a 400 because their grammar could not be compiled, by `kind`
    /// (`json_schema`, `tool_grammar`, `regex`, `choice`, `grammar`).
    pub structured_output_grammar_rejections: Family<Labels, Counter>,
    /// Per step with constrained sequences: the time their next-token masks took, computed on
    /// a thread beside the forward pass.
    pub structured_output_mask_time: Histogram,
    /// Per step with constrained sequences: the time the step waited for their masks after its
    /// forward pass ended (the mask time the overlap did not hide).
    pub structured_output_mask_exposed_time: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Every metric registered, at zero.
    pub fn new() -> Self {
        let mut r = Registry::default();
        let ms = || Unit::Other("milliseconds".into());
        let tokens = || Unit::Other("tokens".into());
        let hist = |r: &mut Registry, name: &str, help: &str, unit: Option<Unit>, h: Histogram| {
            match unit {
                Some(u) => r.register_with_unit(name, help, u, h.clone()),
                None => r.register(name, help, h.clone()),
            }
            h
        };
        let fam =
            |r: &mut Registry, name: &str, help: &str, unit: Option<Unit>, f: fn() -> Histogram| {
                let fam: HistFamily = Family::new_with_constructor(f);
                match unit {
                    Some(u) => r.register_with_unit(name, help, u, fam.clone()),
                    None => r.register(name, help, fam.clone()),
                }
                fam
            };
        let counter = |r: &mut Registry, name: &str, help: &str, unit: Option<Unit>| {
            let c = Counter::default();
            match unit {
                Some(u) => r.register_with_unit(name, help, u, c.clone()),
                None => r.register(name, help, c.clone()),
            }
            c
        };
        let gauge = |r: &mut Registry, name: &str, help: &str| {
            let g = Gauge::default();
            r.register(name, help, g.clone());
            g
        };
        let m = Metrics {
            request_time: hist(
                &mut r,
                "maxserve_request_time",
                "Request latency",
                Some(ms()),
                ms_histogram(),
            ),
            input_processing_time: hist(
                &mut r,
                "maxserve_input_processing_time",
                "Input processing (tokenization) time",
                Some(ms()),
                ms_histogram(),
            ),
            output_processing_time: hist(
                &mut r,
                "maxserve_output_processing_time",
                "Output processing (detokenization) time",
                Some(ms()),
                ms_histogram(),
            ),
            time_to_first_token: hist(
                &mut r,
                "maxserve_time_to_first_token",
                "Time to first token",
                Some(ms()),
                ms_histogram(),
            ),
            time_per_output_token: hist(
                &mut r,
                "maxserve_time_per_output_token",
                "Time per output token",
                Some(ms()),
                ms_histogram(),
            ),
            itl: hist(
                &mut r,
                "maxserve_itl",
                "Inter-token latency",
                Some(ms()),
                ms_histogram(),
            ),
            num_input_tokens: counter(&mut r, "maxserve_num_input_tokens", "Input tokens", None),
            num_output_tokens: counter(&mut r, "maxserve_num_output_tokens", "Output tokens", None),
            num_input_characters: counter(
                &mut r,
                "maxserve_num_input_characters",
                "Input characters",
                None,
            ),
            input_tokens_per_request: hist(
                &mut r,
                "maxserve_input_tokens_per_request",
                "Input tokens per request",
                Some(tokens()),
                count_histogram(),
            ),
            output_tokens_per_request: hist(
                &mut r,
                "maxserve_output_tokens_per_request",
                "Output tokens per request",
                Some(tokens()),
                count_histogram(),
            ),
            request_count: {
                let f = Family::<Labels, Counter>::default();
                r.register(
                    "maxserve_request_count",
                    "HTTP requests by code and path",
                    f.clone(),
                );
                f
            },
            num_requests_running: gauge(
                &mut r,
                "maxserve_num_requests_running",
                "Requests running",
            ),
            num_requests_queued: gauge(&mut r, "maxserve_num_requests_queued", "Requests queued"),
            num_requests_awaiting_admission: gauge(
                &mut r,
                "maxserve_num_requests_awaiting_admission",
                "Requests awaiting admission",
            ),
            requests_awaiting_admission: hist(
                &mut r,
                "maxserve_requests_awaiting_admission",
                "Requests awaiting admission, per step",
                None,
                count_histogram(),
            ),
            num_responses_buffered: gauge(
                &mut r,
                "maxserve_num_responses_buffered",
                "Responses buffered",
            ),
            responses_buffered: hist(
                &mut r,
                "maxserve_responses_buffered",
                "Responses buffered, per event",
                None,
                count_histogram(),
            ),
            response_queue_time: hist(
                &mut r,
                "maxserve_response_queue_time",
                "Response queue time",
                Some(ms()),
                ms_histogram(),
            ),
            batch_size: fam(
                &mut r,
                "maxserve_batch_size",
                "Sequences per batch",
                None,
                count_histogram,
            ),
            batch_execution_time: fam(
                &mut r,
                "maxserve_batch_execution_time",
                "Batch execution time",
                Some(ms()),
                ms_histogram,
            ),
            batch_creation_time: fam(
                &mut r,
                "maxserve_batch_creation_time",
                "Batch creation time",
                Some(ms()),
                ms_histogram,
            ),
            batch_input_tokens: fam(
                &mut r,
                "maxserve_batch_input_tokens",
                "New tokens per batch",
                None,
                count_histogram,
            ),
            batch_context_tokens: fam(
                &mut r,
                "maxserve_batch_context_tokens",
                "Context tokens per batch",
                None,
                count_histogram,
            ),
            batch_prompt_throughput: hist(
                &mut r,
                "maxserve_batch_prompt_throughput",
                "Prompt tokens per second of a CE batch",
                Some(Unit::Other("tokens_per_second".into())),
                rate_histogram(),
            ),
            batch_generation_throughput: hist(
                &mut r,
                "maxserve_batch_generation_throughput",
                "Generated tokens per second of a TG batch",
                Some(Unit::Other("tokens_per_second".into())),
                rate_histogram(),
            ),
            batch_terminated_reqs: fam(
                &mut r,
                "maxserve_batch_terminated_reqs",
                "Requests finished per batch",
                None,
                count_histogram,
            ),
            batch_pending_reqs: fam(
                &mut r,
                "maxserve_batch_pending_reqs",
                "Requests pending per batch",
                None,
                count_histogram,
            ),
            cache_num_used_blocks: gauge(
                &mut r,
                "maxserve_cache_num_used_blocks",
                "KV cache pages in use",
            ),
            cache_num_total_blocks: gauge(
                &mut r,
                "maxserve_cache_num_total_blocks",
                "KV cache pages",
            ),
            cache_prefix_only_blocks: gauge(
                &mut r,
                "maxc_cache_prefix_only_blocks",
                "KV cache pages held by the prefix cache alone",
            ),
            cache_request_prefix_coverage: hist(
                &mut r,
                "maxserve_cache_request_prefix_coverage",
                "Share of a prompt found in the prefix cache",
                Some(Unit::Other("percent".into())),
                pct_histogram(),
            ),
            cache_preemption_count: counter(
                &mut r,
                "maxserve_cache_preemption_count",
                "Requests preempted",
                None,
            ),
            response_format_conformance_errors: {
                let f = Family::<Labels, Counter>::default();
                r.register(
                    "maxserve_response_format_conformance_errors",
                    "Answers that do not conform to their JSON response_format, by outcome",
                    f.clone(),
                );
                f
            },
            tool_call_conformance_errors: {
                let f = Family::<Labels, Counter>::default();
                r.register(
                    "maxserve_tool_call_conformance_errors",
                    "Answers whose tool calls did not conform, by outcome",
                    f.clone(),
                );
                f
            },
            structured_output_grammar_rejections: {
                let f = Family::<Labels, Counter>::default();
                r.register(
                    "maxserve_structured_output_grammar_rejections",
                    "Requests rejected with a 400 because their structured-output grammar could not be compiled, by kind",
                    f.clone(),
                );
                f
            },
            structured_output_mask_time: hist(
                &mut r,
                "maxc_structured_output_mask_time",
                "Per step, the time the constrained sequences' next-token masks took (beside the forward pass)",
                Some(ms()),
                fine_ms_histogram(),
            ),
            structured_output_mask_exposed_time: hist(
                &mut r,
                "maxc_structured_output_mask_exposed_time",
                "Per step, the time the step waited for its masks after the forward pass ended",
                Some(ms()),
                fine_ms_histogram(),
            ),
            cache_hits: {
                let f = Family::<Labels, Counter>::default();
                r.register_with_unit(
                    "maxserve_cache_hits",
                    "Prompt tokens found in the prefix cache",
                    tokens(),
                    f.clone(),
                );
                f
            },
            cache_misses: counter(
                &mut r,
                "maxserve_cache_misses",
                "Prompt tokens not found in the prefix cache",
                Some(tokens()),
            ),
            cpu_threads: {
                let g = Gauge::default();
                r.register(
                    "maxc_cpu_threads",
                    "Threads the CPU kernels split a decode step across now (fewer while other processes keep the CPUs busy; prefill steps take every thread)",
                    g.clone(),
                );
                g
            },
            cpu_threads_max: {
                let g = Gauge::default();
                r.register(
                    "maxc_cpu_threads_max",
                    "The most threads the CPU kernels split a step across (--threads, MAXC_THREADS, or the CPUs this process may use)",
                    g.clone(),
                );
                g
            },
            cache_used_kv_pct: {
                let g = Gauge::<f64, AtomicU64>::default();
                r.register_with_unit(
                    "maxserve_cache_used_kv_pct",
                    "Share of KV cache pages in use",
                    Unit::Other("percent".into()),
                    g.clone(),
                );
                g
            },
            cache_device_blocks_served: counter(
                &mut r,
                "maxserve_cache_device_blocks_served",
                "Pages served from the prefix cache",
                Some(Unit::Other("blocks".into())),
            ),
            dp_active_token_occupancy: hist(
                &mut r,
                "maxserve_dp_active_token_occupancy",
                "New tokens over the replicas' budgets",
                Some(Unit::Other("percent".into())),
                pct_histogram(),
            ),
            dp_context_token_occupancy: hist(
                &mut r,
                "maxserve_dp_context_token_occupancy",
                "Contexts over the replicas' batch sizes",
                Some(Unit::Other("percent".into())),
                pct_histogram(),
            ),
            dp_active_tokens: counter(
                &mut r,
                "maxserve_dp_active_tokens",
                "New tokens run across replicas",
                None,
            ),
            dp_step_capacity_tokens: counter(
                &mut r,
                "maxserve_dp_step_capacity_tokens",
                "Token budget offered across replicas",
                None,
            ),
            spec_decode_acceptance_rate_per_position: fam(
                &mut r,
                "maxserve_spec_decode_acceptance_rate_per_position",
                "Share of draft tokens accepted at each draft position",
                Some(Unit::Other("percent".into())),
                pct_histogram,
            ),
            spec_decode_avg_acceptance_length: hist(
                &mut r,
                "maxserve_spec_decode_avg_acceptance_length",
                "Draft tokens accepted per sequence in a speculative step",
                Some(tokens()),
                Histogram::new([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0]),
            ),
            model_load_time: {
                let f = Family::<Labels, Gauge<f64, AtomicU64>>::default();
                r.register_with_unit(
                    "maxserve_model_load_time",
                    "Model load time by component",
                    ms(),
                    f.clone(),
                );
                f
            },
            pipeline_load: counter(&mut r, "maxserve_pipeline_load", "Pipelines loaded", None),
            registry: Registry::default(),
        };
        Metrics { registry: r, ..m }
    }

    /// The metrics as Prometheus text.
    pub fn encode(&self) -> String {
        use maxc_runtime::kernels::pool;
        self.cpu_threads.set(pool::width() as i64);
        self.cpu_threads_max.set(pool::max_threads() as i64);
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// Records one step of `batch_type`.
    pub fn batch(&self, batch_type: BatchType) -> BatchMetrics<'_> {
        BatchMetrics {
            m: self,
            labels: batch_type.labels(),
        }
    }

    /// Records the KV cache's occupancy.
    pub fn kv(&self, used: usize, total: usize) {
        self.cache_num_used_blocks.set(used as i64);
        self.cache_num_total_blocks.set(total as i64);
        let pct = if total == 0 {
            0.0
        } else {
            100.0 * used as f64 / total as f64
        };
        self.cache_used_kv_pct.set(pct);
    }
}

/// The batch metrics of one batch type.
pub struct BatchMetrics<'a> {
    m: &'a Metrics,
    labels: Labels,
}

impl BatchMetrics<'_> {
    /// Records a step's sizes and times.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        sequences: usize,
        input_tokens: usize,
        context_tokens: usize,
        creation_ms: f64,
        execution_ms: f64,
        terminated: usize,
        pending: usize,
    ) {
        let m = self.m;
        let l = &self.labels;
        m.batch_size.get_or_create(l).observe(sequences as f64);
        m.batch_input_tokens
            .get_or_create(l)
            .observe(input_tokens as f64);
        m.batch_context_tokens
            .get_or_create(l)
            .observe(context_tokens as f64);
        m.batch_creation_time.get_or_create(l).observe(creation_ms);
        m.batch_execution_time
            .get_or_create(l)
            .observe(execution_ms);
        m.batch_terminated_reqs
            .get_or_create(l)
            .observe(terminated as f64);
        m.batch_pending_reqs
            .get_or_create(l)
            .observe(pending as f64);
    }
}
