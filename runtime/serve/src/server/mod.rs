//! `maxc serve`: an OpenAI-compatible HTTP server over the scheduler (tokio + axum). A thin
//! translation layer: OpenAI requests become scheduler [`Request`]s, scheduler events become
//! responses or server-sent events, and both feed MAX's serve metrics, which a second listener
//! serves as Prometheus text.

mod choice;
pub mod listen;
pub mod openai;

use crate::chat::{ChatMessage, ChatTemplate};
use crate::metrics::Metrics;
use crate::scheduler::speculative::SpeculationOptions;
use crate::scheduler::{
    Request, Scheduler, SchedulerConfig, SchedulerHandle, Speculation, TokenLogprob, Usage,
};
use crate::tokenizer::Tokenizer;
use crate::trace::{
    ExportOptions, ProfilingConfig, RequestTrace, Span, SpanContext, StepTracing, TraceLevel,
    Tracer,
};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use choice::{ms, Choice, Delta};
use maxc_runtime::artifact::Artifact;
use maxc_runtime::engine::{Device, Engine};
use maxc_runtime::sampling::SamplingParams;
use openai::{ApiError, ChatRequest, Common, CompletionRequest, Content, Prompt};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The artifact directory.
    pub artifact: PathBuf,
    /// Address to listen on.
    pub host: String,
    /// Port of the API.
    pub port: u16,
    /// Port of `/metrics`.
    pub metrics_port: u16,
    /// The model id (default: the artifact's directory name).
    pub served_model_name: Option<String>,
    /// Share full KV pages between requests.
    pub prefix_caching: bool,
    /// Where to run.
    pub device: Device,
    /// The CPU library kernels' choices.
    pub kernels: maxc_runtime::kernels::options::KernelOptions,
    /// Largest request body, in bytes.
    pub max_request_bytes: usize,
    /// Requests that may wait beyond the running ones before new ones get 429.
    pub max_queue_size: usize,
    /// How long in-flight requests may take to finish after SIGTERM or SIGINT.
    pub shutdown_timeout: Duration,
    /// Refuse an artifact whose manifest this key has not signed.
    pub require_signature: Option<ed25519_dalek::VerifyingKey>,
    /// Speculative decoding for every request, with this draft.
    pub speculation: Option<SpeculationOptions>,
    /// API connections served at once (more wait in the listen backlog).
    pub max_connections: usize,
    /// Time for a request's headers to arrive.
    pub header_read_timeout: Duration,
    /// Time for a request's body to arrive (408 after).
    pub body_read_timeout: Duration,
    /// Traces: level, header captures, profiling limits, where spans go.
    pub tracing: ServeTracing,
    /// Refuse an artifact compiled for another expert-parallel degree.
    pub expert_parallel_degree: Option<usize>,
}

/// How the server traces (see [`crate::trace`]).
#[derive(Clone, Debug, Default)]
pub struct ServeTracing {
    /// `MAX_SERVE_KERNEL_TRACE_LEVEL`: request spans and `max.batch` spans from `batch` up.
    pub level: TraceLevel,
    /// `MAX_SERVE_KERNEL_TRACE_HEADERS`: a request's `x-max-trace-level: kernel` arms a kernel
    /// capture.
    pub headers: bool,
    /// MAX's ProfilingConfig (the config file's `profiling` section).
    pub profiling: ProfilingConfig,
    /// Where spans go (a JSON-lines file, OTLP).
    pub export: ExportOptions,
    /// Where kernel captures are written.
    pub capture_dir: PathBuf,
}

/// A failure to start serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A port could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The artifact could not be loaded.
    #[error("cannot serve {}: {message}", artifact.display())]
    Load {
        /// The artifact.
        artifact: PathBuf,
        /// Why.
        message: String,
    },
    /// The server stopped with an error.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// What is known once the artifact is loaded.
struct Loaded {
    sched: SchedulerHandle,
    tokenizer: Option<&'static Tokenizer>,
    chat: Option<ChatTemplate>,
    max_model_len: usize,
    vocab: usize,
    all_logits: bool,
    capacity: usize,
}

struct App {
    model: String,
    created: u64,
    loaded: OnceLock<Loaded>,
    load_error: OnceLock<String>,
    metrics: Arc<Metrics>,
    max_queue: usize,
    inflight: AtomicUsize,
    next_id: AtomicU64,
    tracer: Tracer,
    trace_level: TraceLevel,
}

/// A traced request's span, exported when the last holder (the middleware, the response's
/// stream) lets go of it.
struct RequestSpan {
    tracer: Tracer,
    trace: RequestTrace,
    parent: Option<u64>,
    start_unix_ns: u64,
    attributes: std::sync::Mutex<std::collections::BTreeMap<String, Value>>,
}

impl Drop for RequestSpan {
    fn drop(&mut self) {
        let attributes =
            std::mem::take(&mut *self.attributes.lock().unwrap_or_else(|e| e.into_inner()));
        self.tracer.export(Span {
            name: "max.request".into(),
            ctx: self.trace.ctx,
            parent: self.parent,
            start_unix_ns: self.start_unix_ns,
            end_unix_ns: crate::trace::now_unix_ns(),
            attributes,
            links: Vec::new(),
        });
    }
}

/// The request's span, where it is traced (a request extension).
#[derive(Clone, Default)]
struct Traced(Option<Arc<RequestSpan>>);

type Shared = Arc<App>;

impl App {
    fn ready(&self) -> Result<&Loaded, ApiError> {
        self.loaded.get().ok_or_else(|| {
            let why = self
                .load_error
                .get()
                .map_or("the model is still loading".to_string(), |e| {
                    format!("the model failed to load: {e}")
                });
            ApiError::status(StatusCode::SERVICE_UNAVAILABLE, why)
        })
    }
}

fn error_response(e: &ApiError) -> Response {
    let mut r = (e.status, Json(e.body())).into_response();
    if e.status == StatusCode::TOO_MANY_REQUESTS {
        r.headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
    }
    r
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error_response(&self)
    }
}

/// Loads the artifact and starts the scheduler (blocking).
fn load(opts: &ServeOptions, metrics: &Arc<Metrics>, tracer: Tracer) -> Result<Loaded, String> {
    let t = Instant::now();
    let artifact = Arc::new(
        Artifact::open_verified(
            &opts.artifact,
            opts.require_signature.as_ref(),
            opts.device.weight_memory(),
        )
        .map_err(|e| e.to_string())?,
    );
    let record = |component: &str, d: Duration| {
        metrics
            .model_load_time
            .get_or_create(&vec![("component".into(), component.into())])
            .set(ms(d));
    };
    record("artifact", t.elapsed());
    let t = Instant::now();
    let engine = Engine::with_kernels(artifact.clone(), "decoder", opts.device, opts.kernels)
        .map_err(|e| e.to_string())?;
    record("engine", t.elapsed());
    if let Some(n) = opts.expert_parallel_degree {
        engine
            .require_expert_parallel_degree(n)
            .map_err(|e| e.to_string())?;
    }
    let tokenizer: Option<&'static Tokenizer> = Tokenizer::of_artifact(&artifact)
        .map_err(|e| e.to_string())?
        .map(|t| &*Box::leak(Box::new(t)));
    let chat = match tokenizer {
        Some(t) => ChatTemplate::of_artifact(&artifact, t).map_err(|e| e.to_string())?,
        None => None,
    };
    let rt = &artifact.manifest.runtime;
    let mut cfg = SchedulerConfig::from_runtime(rt);
    cfg.prefix_caching = opts.prefix_caching;
    let spec = match &opts.speculation {
        Some(s) => {
            let t = Instant::now();
            let spec = Speculation::open(&engine, s, opts.device, opts.require_signature.as_ref())
                .map_err(|e| e.to_string())?;
            record("draft", t.elapsed());
            Some(spec)
        }
        None => None,
    };
    let all_logits = engine.all_logits();
    let (max_model_len, vocab) = (engine.max_seq_len(), engine.vocab_size());
    let t = &opts.tracing;
    let mut scheduler =
        Scheduler::new(engine, cfg.clone(), metrics.clone()).with_tracing(StepTracing {
            tracer,
            level: t.level,
            headers: t.headers,
            profiling: t.profiling,
            capture_dir: t.capture_dir.clone(),
        });
    if let Some(spec) = spec {
        scheduler = scheduler.with_speculation(spec);
    }
    let loaded = Loaded {
        max_model_len,
        vocab,
        all_logits,
        capacity: cfg.max_batch_size * cfg.data_parallel_degree,
        tokenizer,
        chat,
        sched: SchedulerHandle::spawn(scheduler).map_err(|e| e.to_string())?,
    };
    metrics.pipeline_load.inc();
    Ok(loaded)
}

async fn bind(host: &str, port: u16) -> Result<tokio::net::TcpListener, ServeError> {
    let addr = format!("{host}:{port}");
    tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// Serves `opts.artifact` until SIGTERM or SIGINT; then stops accepting, lets in-flight
/// requests finish within the shutdown timeout, and returns. `on_listening` gets the API's and
/// the metrics' bound addresses once both listen.
pub async fn serve(
    opts: ServeOptions,
    on_listening: impl FnOnce(SocketAddr, SocketAddr),
) -> Result<(), ServeError> {
    let api = bind(&opts.host, opts.port).await?;
    let metrics_listener = bind(&opts.host, opts.metrics_port).await?;
    // Always on: a request's `x-max-trace-level` header is honoured at any level. Idle, it is
    // one sleeping thread.
    let tracer = Tracer::start(&opts.tracing.export)?;
    let model = opts.served_model_name.clone().unwrap_or_else(|| {
        opts.artifact
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "model".into())
    });
    let app = Arc::new(App {
        model,
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        loaded: OnceLock::new(),
        load_error: OnceLock::new(),
        metrics: Arc::new(Metrics::new()),
        max_queue: opts.max_queue_size,
        inflight: AtomicUsize::new(0),
        next_id: AtomicU64::new(1),
        tracer: tracer.clone(),
        trace_level: opts.tracing.level,
    });
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<String>();
    {
        let app = app.clone();
        let opts = opts.clone();
        let tracer = tracer.clone();
        tokio::task::spawn_blocking(move || match load(&opts, &app.metrics, tracer) {
            Ok(l) => {
                tracing::info!(model = %app.model, "model loaded");
                let _ = app.loaded.set(l);
            }
            Err(e) => {
                let _ = app.load_error.set(e.clone());
                let _ = failed_tx.send(e);
            }
        });
    }
    let limits = listen::ConnectionLimits {
        max_connections: opts.max_connections,
        header_read_timeout: opts.header_read_timeout,
        body_read_timeout: opts.body_read_timeout,
        max_request_bytes: opts.max_request_bytes,
    };
    let router = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/version", get(version))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            limits,
            listen::read_body,
        ))
        .layer(axum::middleware::from_fn_with_state(app.clone(), observe))
        .layer(DefaultBodyLimit::max(opts.max_request_bytes))
        .with_state(app.clone());
    let metrics_router = Router::new()
        .route("/metrics", get(metrics_text))
        .with_state(app.clone());
    on_listening(api.local_addr()?, metrics_listener.local_addr()?);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let metrics_task = tokio::spawn({
        let mut rx = stop_rx.clone();
        async move {
            let _ = axum::serve(metrics_listener, metrics_router)
                .with_graceful_shutdown(async move {
                    let _ = rx.changed().await;
                })
                .await;
        }
    });
    let server = tokio::spawn(listen::serve_connections(
        api,
        router,
        limits,
        stop_rx.clone(),
    ));
    // Until a signal, or until the artifact fails to load (then nothing could ever be served).
    let load_failure = async {
        match failed_rx.await {
            Ok(e) => e,
            Err(_) => std::future::pending().await,
        }
    };
    let failure = tokio::select! {
        _ = shutdown_signal() => None,
        e = load_failure => Some(e),
    };
    if let Some(e) = failure {
        let _ = stop_tx.send(true);
        metrics_task.abort();
        return Err(ServeError::Load {
            artifact: opts.artifact.clone(),
            message: e,
        });
    }
    tracing::info!("shutting down: draining in-flight requests");
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(opts.shutdown_timeout, server).await;
    if drained.is_err() {
        tracing::warn!(
            "in-flight requests did not finish within {:?}",
            opts.shutdown_timeout
        );
    }
    metrics_task.abort();
    tracer.flush();
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Every response: an `x-request-id` (the client's, or a new one), `maxserve_request_count`,
/// `maxserve_request_time_milliseconds`, and one log line.
async fn observe(
    State(app): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let t = Instant::now();
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .unwrap_or_else(|| format!("{:016x}", app.next_id.fetch_add(1, Ordering::Relaxed)));
    let path = req.uri().path().to_string();
    // A label from the router's fixed set of routes: a raw path would let clients grow the
    // series without bound.
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("other", |m| route_label(m.as_str()));
    let method = req.method().clone();
    let mut req = req;
    let traced = request_span(&app, &req, &id, &path);
    req.extensions_mut().insert(traced.clone());
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    let code = resp.status().as_u16();
    app.metrics
        .request_count
        .get_or_create(&vec![
            ("code".into(), code.to_string()),
            ("path".into(), route.into()),
        ])
        .inc();
    let elapsed = ms(t.elapsed());
    app.metrics.request_time.observe(elapsed);
    if let Some(span) = &traced.0 {
        if let Ok(mut a) = span.attributes.lock() {
            a.insert("http.response.status_code".into(), code.into());
        }
    }
    drop(traced);
    tracing::info!(request_id = %id, %method, %path, status = code, ms = elapsed, "request");
    resp
}

/// The `path` label of a matched route: the router's own path, or `other`.
fn route_label(matched: &str) -> &'static str {
    ROUTES
        .iter()
        .find(|r| **r == matched)
        .copied()
        .unwrap_or("other")
}

/// The API's routes, as [`router`] serves them and `maxserve_request_count` labels them.
const ROUTES: [&str; 6] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/v1/health",
    "/version",
];

/// The span of a request that is traced: at level `batch` and up, or where it carries an
/// `x-max-trace-level` header (a W3C `traceparent` header puts it in the caller's trace).
fn request_span(app: &App, req: &axum::extract::Request, id: &str, path: &str) -> Traced {
    let header = req
        .headers()
        .get("x-max-trace-level")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| match v.parse::<TraceLevel>() {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::debug!(request_id = %id, "x-max-trace-level: {e}");
                None
            }
        })
        // `none` asks for nothing.
        .filter(|l| *l > TraceLevel::None);
    if app.trace_level < TraceLevel::Batch && header.is_none() {
        return Traced(None);
    }
    let caller = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(SpanContext::from_traceparent);
    let ctx = caller.map_or_else(SpanContext::new_root, |c| c.child());
    let mut attributes = std::collections::BTreeMap::new();
    attributes.insert("http.request.method".into(), req.method().as_str().into());
    attributes.insert("url.path".into(), path.into());
    attributes.insert("max.request_id".into(), id.into());
    if let Some(h) = header {
        attributes.insert("max.trace_level".into(), h.as_str().into());
    }
    Traced(Some(Arc::new(RequestSpan {
        tracer: app.tracer.clone(),
        trace: RequestTrace { ctx, header },
        parent: caller.map(|c| c.span_id),
        start_unix_ns: crate::trace::now_unix_ns(),
        attributes: std::sync::Mutex::new(attributes),
    })))
}

async fn not_found() -> ApiError {
    ApiError::status(StatusCode::NOT_FOUND, "no such endpoint")
}

async fn health(State(app): State<Shared>) -> Response {
    match app.ready() {
        Ok(_) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION"), "name": "maxc"}))
}

async fn models(State(app): State<Shared>) -> Json<Value> {
    let max_model_len = app.loaded.get().map(|l| l.max_model_len);
    Json(json!({
        "object": "list",
        "data": [{
            "id": app.model,
            "object": "model",
            "created": app.created,
            "owned_by": "maxc",
            "max_model_len": max_model_len,
        }],
    }))
}

async fn metrics_text(State(app): State<Shared>) -> Response {
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.encode(),
    )
        .into_response()
}

fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::status(status, format!("the request body is too large: {e}"))
        } else {
            ApiError::status(status, format!("cannot read the request body: {e}"))
        }
    })
}

/// Counts a request awaiting admission (received, not yet handed to the scheduler) while alive.
struct Awaiting(Arc<Metrics>);

impl Awaiting {
    fn new(m: &Arc<Metrics>) -> Self {
        m.num_requests_awaiting_admission.inc();
        m.requests_awaiting_admission
            .observe(m.num_requests_awaiting_admission.get().max(0) as f64);
        Awaiting(m.clone())
    }
}

impl Drop for Awaiting {
    fn drop(&mut self) {
        self.0.num_requests_awaiting_admission.dec();
    }
}

/// Counts a generation request in flight for the queue limit while alive.
/// (The request's span rides along so that it ends when the response does.)
struct InFlight(Shared, #[allow(dead_code)] Traced);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One prompt ready for the scheduler.
struct Job {
    request: Request,
    echo: Option<String>,
}

/// What both endpoints share once their prompts are tokenized.
struct Plan {
    token_ids: bool,
    jobs: Vec<Job>,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
    chat: bool,
    logprobs: bool,
}

impl Plan {
    fn new(c: &Common, jobs: Vec<Job>, chat: bool, logprobs: bool) -> Self {
        Plan {
            token_ids: c.return_tokens_as_token_ids.unwrap_or(false),
            jobs,
            stops: c.stop.as_ref().map(|s| s.strings()).unwrap_or_default(),
            stream: c.stream.unwrap_or(false),
            include_usage: c
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            chat,
            logprobs,
        }
    }
}

fn check_range(
    param: &str,
    v: Option<f32>,
    lo: f32,
    hi: f32,
    lo_open: bool,
) -> Result<(), ApiError> {
    if let Some(x) = v {
        let ok = x.is_finite() && x <= hi && if lo_open { x > lo } else { x >= lo };
        if !ok {
            let lo_b = if lo_open { "(" } else { "[" };
            return Err(ApiError::invalid(
                param,
                format!("`{param}` is {x}; expected a value in {lo_b}{lo}, {hi}]"),
            ));
        }
    }
    Ok(())
}

/// Validates the common fields and builds the request for `prompt`.
fn request_for(
    l: &Loaded,
    c: &Common,
    prompt: Vec<i64>,
    prompt_param: &str,
) -> Result<Request, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid(prompt_param, "the prompt is empty"));
    }
    if let Some(t) = prompt.iter().find(|&&t| t < 0 || t as usize >= l.vocab) {
        return Err(ApiError::invalid(
            prompt_param,
            format!("token id {t} is outside the vocabulary (0..{})", l.vocab),
        ));
    }
    let room = l.max_model_len.saturating_sub(prompt.len());
    if prompt.len() > l.max_model_len {
        return Err(ApiError::invalid(
            prompt_param,
            format!(
                "the prompt has {} tokens; the model's context is {}",
                prompt.len(),
                l.max_model_len
            ),
        ));
    }
    let (param, max) = match (c.max_completion_tokens, c.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let max_tokens = match max {
        Some(m) if m < 0 => {
            return Err(ApiError::invalid(param, format!("`{param}` is {m}; it must be 0 or more")))
        }
        Some(m) if m as usize > room => {
            return Err(ApiError::invalid(
                param,
                format!(
                    "the prompt ({} tokens) plus `{param}` ({m}) exceeds the model's context of {} tokens",
                    prompt.len(),
                    l.max_model_len
                ),
            ))
        }
        Some(m) => m as usize,
        None => room,
    };
    let min_tokens = match c.min_tokens {
        Some(m) if m < 0 => {
            return Err(ApiError::invalid(
                "min_tokens",
                "`min_tokens` must be 0 or more",
            ))
        }
        Some(m) => (m as usize).min(max_tokens),
        None => 0,
    };
    let top_k = match c.top_k {
        Some(k) if k < -1 => {
            return Err(ApiError::invalid(
                "top_k",
                "`top_k` must be -1, 0 or positive",
            ))
        }
        Some(k) if k > 0 => k as usize,
        _ => 0,
    };
    if let Some(ids) = &c.stop_token_ids {
        if let Some(t) = ids.iter().find(|&&t| t < 0 || t as usize >= l.vocab) {
            return Err(ApiError::invalid(
                "stop_token_ids",
                format!("token id {t} is outside the vocabulary (0..{})", l.vocab),
            ));
        }
    }
    Ok(Request {
        prompt,
        max_tokens,
        min_tokens,
        sampling: SamplingParams {
            temperature: c.temperature.unwrap_or(1.0),
            top_p: c.top_p.unwrap_or(1.0),
            seed: c.seed.map_or_else(rand_seed, |s| s as u64),
            top_k,
            min_p: c.min_p.unwrap_or(0.0),
            repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
            frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
            presence_penalty: c.presence_penalty.unwrap_or(0.0),
        },
        stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: c.ignore_eos.unwrap_or(false),
        logprobs: None,
        prompt_logprobs: false,
        trace: None,
    })
}

fn rand_seed() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Checks the fields every endpoint shares that do not depend on the prompt.
fn check_common(app: &App, c: &Common) -> Result<(), ApiError> {
    if let Some(m) = &c.model {
        if *m != app.model {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    app.model
                ),
                param: Some("model".into()),
            });
        }
    }
    if let Some(n) = c.n {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("`n` is {n}; this server returns one choice per prompt (n = 1)"),
            ));
        }
    }
    check_range("temperature", c.temperature, 0.0, 2.0, false)?;
    check_range("top_p", c.top_p, 0.0, 1.0, true)?;
    check_range("min_p", c.min_p, 0.0, 1.0, false)?;
    check_range("frequency_penalty", c.frequency_penalty, -2.0, 2.0, false)?;
    check_range("presence_penalty", c.presence_penalty, -2.0, 2.0, false)?;
    if let Some(r) = c.repetition_penalty {
        if !(r.is_finite() && r > 0.0) {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("`repetition_penalty` is {r}; it must be above 0"),
            ));
        }
    }
    if c.stream_options.is_some() && c.stream != Some(true) {
        return Err(ApiError::invalid(
            "stream_options",
            "`stream_options` needs `stream: true`",
        ));
    }
    Ok(())
}

fn tokenizer(l: &Loaded, param: &str) -> Result<&'static Tokenizer, ApiError> {
    l.tokenizer
        .ok_or_else(|| ApiError::invalid(param, "the artifact has no tokenizer: send token ids"))
}

async fn completions(
    State(app): State<Shared>,
    axum::Extension(traced): axum::Extension<Traced>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = Instant::now();
    let awaiting = Awaiting::new(&app.metrics);
    let result = async {
        let body = body_bytes(body)?;
        let req: CompletionRequest = openai::parse(&body)?;
        let l = app.ready()?;
        check_common(&app, &req.common)?;
        let t = Instant::now();
        let prompts: Vec<(Vec<i64>, Option<String>)> = match req.prompt.clone() {
            None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
            Some(Prompt::Text(s)) if s.is_empty() => {
                return Err(ApiError::invalid("prompt", "the prompt is empty"))
            }
            Some(Prompt::Text(s)) => vec![(Vec::new(), Some(s))],
            Some(Prompt::Texts(v)) => v.into_iter().map(|s| (Vec::new(), Some(s))).collect(),
            Some(Prompt::Tokens(ids)) => vec![(ids, None)],
            Some(Prompt::TokenLists(v)) => v.into_iter().map(|ids| (ids, None)).collect(),
        };
        if prompts.is_empty() {
            return Err(ApiError::invalid("prompt", "the prompt list is empty"));
        }
        let logprobs = match req.logprobs {
            Some(k) if !(0..=5).contains(&k) => {
                return Err(ApiError::invalid("logprobs", format!("`logprobs` is {k}; expected 0 to 5")))
            }
            k => k.map(|k| k as usize),
        };
        let echo = req.echo.unwrap_or(false);
        if echo && logprobs.is_some() && !l.all_logits {
            return Err(ApiError::invalid(
                "echo",
                "`echo` with `logprobs` scores the prompt, which needs an artifact compiled with --all-logits",
            ));
        }
        let mut jobs = Vec::new();
        for (ids, text) in prompts {
            let ids = match &text {
                Some(s) => {
                    app.metrics.num_input_characters.inc_by(s.chars().count() as u64);
                    let tok = tokenizer(l, "prompt")?;
                    tok.encode(s, true)
                        .map_err(|e| ApiError::invalid("prompt", e.to_string()))?
                        .into_iter()
                        .map(i64::from)
                        .collect()
                }
                None => ids,
            };
            let mut request = request_for(l, &req.common, ids, "prompt")?;
            request.logprobs = logprobs;
            request.prompt_logprobs = echo && logprobs.is_some();
            let echo_text = if echo {
                Some(match text {
                    Some(s) => s,
                    None => match l.tokenizer {
                        Some(t) => {
                            let ids: Vec<u32> =
                                request.prompt.iter().map(|&i| i as u32).collect();
                            t.decode(&ids, false).unwrap_or_default()
                        }
                        None => String::new(),
                    },
                })
            } else {
                None
            };
            jobs.push(Job {
                request,
                echo: echo_text,
            });
        }
        app.metrics.input_processing_time.observe(ms(t.elapsed()));
        Ok(Plan::new(&req.common, jobs, false, logprobs.is_some()))
    }
    .await;
    respond(app, result, arrival, awaiting, traced).await
}

fn message_text(m: &openai::Message, i: usize) -> Result<String, ApiError> {
    Ok(match &m.content {
        None => String::new(),
        Some(Content::Text(s)) => s.clone(),
        Some(Content::Parts(parts)) => {
            let mut s = String::new();
            for p in parts {
                if p.kind != "text" {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].content"),
                        format!(
                            "content parts of type `{}` are not supported (text only)",
                            p.kind
                        ),
                    ));
                }
                s.push_str(p.text.as_deref().unwrap_or_default());
            }
            s
        }
    })
}

async fn chat_completions(
    State(app): State<Shared>,
    axum::Extension(traced): axum::Extension<Traced>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = Instant::now();
    let awaiting = Awaiting::new(&app.metrics);
    let result = async {
        let body = body_bytes(body)?;
        let req: ChatRequest = openai::parse(&body)?;
        let l = app.ready()?;
        check_common(&app, &req.common)?;
        let messages = match &req.messages {
            None => return Err(ApiError::invalid("messages", "`messages` is required")),
            Some(m) if m.is_empty() => {
                return Err(ApiError::invalid("messages", "`messages` is empty"))
            }
            Some(m) => m,
        };
        let t = Instant::now();
        let msgs = messages
            .iter()
            .enumerate()
            .map(|(i, m)| Ok(ChatMessage::new(m.role.clone(), message_text(m, i)?)))
            .collect::<Result<Vec<_>, ApiError>>()?;
        app.metrics
            .num_input_characters
            .inc_by(msgs.iter().map(|m| m.content.chars().count() as u64).sum());
        let template = l.chat.as_ref().ok_or_else(|| {
            ApiError::invalid(
                "messages",
                "the artifact has no chat template; use /v1/completions",
            )
        })?;
        let text = template
            .render(&msgs, true)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        let ids: Vec<i64> = tokenizer(l, "messages")?
            .encode(&text, false)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?
            .into_iter()
            .map(i64::from)
            .collect();
        let logprobs = req.logprobs.unwrap_or(false);
        let top = match req.top_logprobs {
            Some(k) if !(0..=20).contains(&k) => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("`top_logprobs` is {k}; expected 0 to 20"),
                ))
            }
            Some(_) if !logprobs => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ))
            }
            k => k.unwrap_or(0) as usize,
        };
        let mut request = request_for(l, &req.common, ids, "messages")?;
        request.logprobs = logprobs.then_some(top);
        app.metrics.input_processing_time.observe(ms(t.elapsed()));
        let job = Job {
            request,
            echo: None,
        };
        Ok(Plan::new(&req.common, vec![job], true, logprobs))
    }
    .await;
    respond(app, result, arrival, awaiting, traced).await
}

/// Submits the plan's jobs and answers: one JSON response, or a stream of events.
async fn respond(
    app: Shared,
    plan: Result<Plan, ApiError>,
    arrival: Instant,
    awaiting: Awaiting,
    traced: Traced,
) -> Response {
    let plan = match plan {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let l = match app.ready() {
        Ok(l) => l,
        Err(e) => return e.into_response(),
    };
    let n = plan.jobs.len();
    if app.inflight.load(Ordering::Relaxed) + n > l.capacity + app.max_queue {
        return ApiError::status(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "the server's queue is full ({} requests wait); retry later",
                app.max_queue
            ),
        )
        .into_response();
    }
    app.inflight.fetch_add(n, Ordering::Relaxed);
    let guards: Vec<InFlight> = (0..n)
        .map(|_| InFlight(app.clone(), traced.clone()))
        .collect();
    let trace = traced.0.as_ref().map(|s| s.trace);
    let tokenizer = l.tokenizer;
    let id = format!(
        "{}-{:x}",
        if plan.chat { "chatcmpl" } else { "cmpl" },
        app.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Delta, Instant)>();
    for (i, mut job) in plan.jobs.into_iter().enumerate() {
        let prompt_tokens = job.request.prompt.len();
        job.request.trace = trace;
        let events = l.sched.submit(job.request);
        let Some(tok) = tokenizer.or_else(empty_tokenizer) else {
            continue;
        };
        let mut choice = Choice::new(
            events,
            tok,
            plan.stops.clone(),
            prompt_tokens,
            job.echo,
            app.metrics.clone(),
            arrival,
        );
        let tx = tx.clone();
        let metrics = app.metrics.clone();
        tokio::spawn(async move {
            while let Some(d) = choice.next().await {
                metrics.num_responses_buffered.inc();
                if tx.send((i, d, Instant::now())).is_err() {
                    metrics.num_responses_buffered.dec();
                    return;
                }
            }
        });
    }
    drop(tx);
    drop(awaiting);
    let rx = Responses {
        rx,
        metrics: app.metrics.clone(),
    };
    let ctx = Ctx {
        id,
        model: app.model.clone(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        chat: plan.chat,
        logprobs: plan.logprobs,
        token_ids: plan.token_ids,
        tokenizer,
    };
    if plan.stream {
        stream_response(ctx, rx, n, plan.include_usage, guards)
    } else {
        let r = collect_response(ctx, rx, n).await;
        drop(guards);
        r
    }
}

/// A tokenizer with no vocabulary, for artifacts without one (token ids in, no text out).
fn empty_tokenizer() -> Option<&'static Tokenizer> {
    static EMPTY: OnceLock<Option<Tokenizer>> = OnceLock::new();
    EMPTY
        .get_or_init(|| {
            Tokenizer::from_json_str(
                r#"{"version":"1.0","model":{"type":"WordLevel","vocab":{},"unk_token":"<unk>"}}"#,
            )
            .ok()
        })
        .as_ref()
}

struct Ctx {
    id: String,
    model: String,
    created: u64,
    chat: bool,
    logprobs: bool,
    token_ids: bool,
    tokenizer: Option<&'static Tokenizer>,
}

impl Ctx {
    fn token_text(&self, id: i64) -> String {
        if self.token_ids {
            return format!("token_id:{id}");
        }
        match (self.tokenizer, u32::try_from(id)) {
            (Some(t), Ok(i)) => t.decode(&[i], false).unwrap_or_default(),
            _ => String::new(),
        }
    }

    /// Completions' logprobs object for `lps`, with text offsets from `offset`.
    fn completion_logprobs(&self, lps: &[TokenLogprob], offset: &mut usize) -> Value {
        let mut tokens = Vec::new();
        let mut token_logprobs = Vec::new();
        let mut top = Vec::new();
        let mut offsets = Vec::new();
        for lp in lps {
            let text = self.token_text(lp.token);
            offsets.push(*offset);
            *offset += text.len();
            tokens.push(Value::from(text));
            if lp.logprob.is_nan() {
                token_logprobs.push(Value::Null);
                top.push(Value::Null);
                continue;
            }
            token_logprobs.push(json!(lp.logprob));
            let mut m = serde_json::Map::new();
            for (t, l) in &lp.top {
                m.insert(self.token_text(*t), json!(l));
            }
            top.push(Value::Object(m));
        }
        json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
    }

    /// Chat's logprobs entries for `lps`.
    fn chat_logprobs(&self, lps: &[TokenLogprob]) -> Vec<Value> {
        let entry = |t: i64, l: f32| {
            let text = self.token_text(t);
            json!({"token": text, "logprob": l, "bytes": text.as_bytes()})
        };
        lps.iter()
            .map(|lp| {
                let mut e = entry(lp.token, lp.logprob);
                e["top_logprobs"] =
                    Value::Array(lp.top.iter().map(|(t, l)| entry(*t, *l)).collect());
                e
            })
            .collect()
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

fn add(total: &mut Usage, u: &Usage) {
    total.prompt_tokens += u.prompt_tokens;
    total.completion_tokens += u.completion_tokens;
    total.cached_tokens += u.cached_tokens;
}

/// The deltas of a response's choices, in the order they were produced; receiving one records
/// the response-buffering metrics.
struct Responses {
    rx: UnboundedReceiver<(usize, Delta, Instant)>,
    metrics: Arc<Metrics>,
}

impl Responses {
    async fn recv(&mut self) -> Option<(usize, Delta)> {
        let (i, d, at) = self.rx.recv().await?;
        let m = &self.metrics;
        m.responses_buffered
            .observe(m.num_responses_buffered.get().max(0) as f64);
        m.num_responses_buffered.dec();
        m.response_queue_time.observe(ms(at.elapsed()));
        Some((i, d))
    }
}

impl Drop for Responses {
    fn drop(&mut self) {
        // Deltas never received are no longer buffered for anyone.
        while self.rx.try_recv().is_ok() {
            self.metrics.num_responses_buffered.dec();
        }
    }
}

async fn collect_response(ctx: Ctx, mut rx: Responses, n: usize) -> Response {
    #[derive(Default)]
    struct Acc {
        text: String,
        logprobs: Vec<TokenLogprob>,
        finish: Option<&'static str>,
    }
    let mut acc: Vec<Acc> = (0..n).map(|_| Acc::default()).collect();
    let mut total = Usage::default();
    while let Some((i, d)) = rx.recv().await {
        if let Some(e) = d.error {
            return ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e).into_response();
        }
        let a = &mut acc[i];
        a.text.push_str(&d.text);
        a.logprobs.extend(d.logprobs);
        if let Some(u) = &d.usage {
            add(&mut total, u);
        }
        if d.finish.is_some() {
            a.finish = d.finish;
        }
    }
    let choices: Vec<Value> = acc
        .iter()
        .enumerate()
        .map(|(i, a)| {
            if ctx.chat {
                let lp = ctx
                    .logprobs
                    .then(|| json!({"content": ctx.chat_logprobs(&a.logprobs)}));
                json!({
                    "index": i,
                    "message": {"role": "assistant", "content": a.text},
                    "logprobs": lp,
                    "finish_reason": a.finish,
                })
            } else {
                let lp = ctx.logprobs.then(|| {
                    let mut off = 0;
                    ctx.completion_logprobs(&a.logprobs, &mut off)
                });
                json!({"index": i, "text": a.text, "logprobs": lp, "finish_reason": a.finish})
            }
        })
        .collect();
    Json(json!({
        "id": ctx.id,
        "object": if ctx.chat { "chat.completion" } else { "text_completion" },
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage_json(&total),
    }))
    .into_response()
}

fn stream_response(
    ctx: Ctx,
    rx: Responses,
    n: usize,
    include_usage: bool,
    guards: Vec<InFlight>,
) -> Response {
    struct St {
        ctx: Ctx,
        rx: Responses,
        started: Vec<bool>,
        offsets: Vec<usize>,
        total: Usage,
        include_usage: bool,
        phase: u8,
        _guards: Vec<InFlight>,
    }
    let st = St {
        ctx,
        rx,
        started: vec![false; n],
        offsets: vec![0; n],
        total: Usage::default(),
        include_usage,
        phase: 0,
        _guards: guards,
    };
    let chunk = |ctx: &Ctx, choices: Vec<Value>, usage: Option<Value>| -> SseEvent {
        let mut v = json!({
            "id": ctx.id,
            "object": if ctx.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        SseEvent::default().data(v.to_string())
    };
    let stream = futures_util::stream::unfold(st, move |mut st| async move {
        loop {
            match st.phase {
                0 => match st.rx.recv().await {
                    Some((i, d)) => {
                        if let Some(e) = d.error {
                            let err = ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e);
                            st.phase = 2;
                            return Some((
                                Ok::<_, std::convert::Infallible>(
                                    SseEvent::default().data(err.body().to_string()),
                                ),
                                st,
                            ));
                        }
                        if let Some(u) = &d.usage {
                            add(&mut st.total, u);
                        }
                        // Nothing new to say (text held back for a stop string, say).
                        if st.started[i]
                            && d.text.is_empty()
                            && d.finish.is_none()
                            && d.logprobs.is_empty()
                        {
                            continue;
                        }
                        let ctx = &st.ctx;
                        let choice = if ctx.chat {
                            let mut delta = json!({});
                            if !st.started[i] {
                                delta["role"] = json!("assistant");
                                st.started[i] = true;
                            }
                            if !d.text.is_empty() || d.finish.is_none() {
                                delta["content"] = json!(d.text);
                            }
                            let lp = (ctx.logprobs && !d.logprobs.is_empty())
                                .then(|| json!({"content": ctx.chat_logprobs(&d.logprobs)}));
                            json!({"index": i, "delta": delta, "logprobs": lp, "finish_reason": d.finish})
                        } else {
                            st.started[i] = true;
                            let lp = (ctx.logprobs && !d.logprobs.is_empty())
                                .then(|| ctx.completion_logprobs(&d.logprobs, &mut st.offsets[i]));
                            json!({"index": i, "text": d.text, "logprobs": lp, "finish_reason": d.finish})
                        };
                        let ev = chunk(&st.ctx, vec![choice], None);
                        return Some((Ok(ev), st));
                    }
                    None => {
                        st.phase = 1;
                        if st.include_usage {
                            let ev = chunk(&st.ctx, vec![], Some(usage_json(&st.total)));
                            return Some((Ok(ev), st));
                        }
                    }
                },
                1 => {
                    st.phase = 3;
                    return Some((Ok(SseEvent::default().data("[DONE]")), st));
                }
                2 => {
                    st.phase = 3;
                    return Some((Ok(SseEvent::default().data("[DONE]")), st));
                }
                _ => return None,
            }
        }
    });
    let mut headers = HeaderMap::new();
    headers.insert("cache-control", HeaderValue::from_static("no-cache"));
    (headers, Sse::new(stream)).into_response()
}
