//! `maxc serve`: an OpenAI-compatible HTTP server over the scheduler (tokio + axum). A thin
//! translation layer: OpenAI requests become scheduler [`Request`]s, scheduler events become
//! responses or server-sent events, and both feed MAX's serve metrics, which a second listener
//! serves as Prometheus text.

mod admission;
mod chat;
mod choice;
mod completions;
mod embeddings;
mod generation;
mod info;
pub mod listen;
mod observe;
pub mod openai;
mod respond;
mod structured;
mod tokenize;
mod tool_choice;

use crate::chat::ChatTemplate;
use crate::metrics::Metrics;
use crate::scheduler::speculative::SpeculationOptions;
use crate::scheduler::{Scheduler, SchedulerConfig, SchedulerHandle, Speculation};
use crate::tokenizer::Tokenizer;
use crate::trace::{ExportOptions, ProfilingConfig, StepTracing, TraceLevel, Tracer};
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use choice::ms;
use maxc_runtime::artifact::Artifact;
use maxc_runtime::engine::{Device, Engine};
use openai::ApiError;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
    /// Where chat answers' thinking sections go to `reasoning_content`.
    pub reasoning: ReasoningParser,
}

/// Which chat answers have their `<think>` section split into `reasoning_content`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReasoningParser {
    /// Where the chat template writes a thinking section (Qwen 3, DeepSeek-R1's distills).
    #[default]
    Auto,
    /// Every chat answer.
    Think,
    /// None.
    None,
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
    /// The artifact's `tokenizer.json` and end-of-sequence ids, for structured outputs.
    grammar_source: Option<(PathBuf, Vec<i64>)>,
    /// The model's end-of-sequence token ids.
    eos: Vec<i64>,
    /// Whether chat answers' thinking sections go to `reasoning_content`.
    reasoning: bool,
    /// Structured outputs' grammar compiler, built at the first request that needs it.
    grammars: OnceLock<Result<crate::constraint::Grammars, String>>,
    chat: Option<ChatTemplate>,
    max_model_len: usize,
    vocab: usize,
    capacity: usize,
}

impl Loaded {
    /// The grammar compiler over this artifact's tokenizer (built once), or why there is none.
    fn grammars(&self) -> Result<&crate::constraint::Grammars, String> {
        self.grammars
            .get_or_init(|| {
                let (Some(tokenizer), Some((path, eos))) = (self.tokenizer, &self.grammar_source)
                else {
                    return Err("the artifact has no tokenizer".into());
                };
                let json = std::fs::read_to_string(path)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                crate::constraint::Grammars::new(&json, tokenizer, self.vocab, eos)
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

struct App {
    model: String,
    created: u64,
    loaded: OnceLock<Loaded>,
    load_error: OnceLock<String>,
    metrics: Arc<Metrics>,
    max_queue: usize,
    inflight: AtomicUsize,
    /// Set at the shutdown signal: health and new requests answer 503 while those in flight
    /// finish.
    draining: AtomicBool,
    next_id: AtomicU64,
    tracer: Tracer,
    trace_level: TraceLevel,
}

type Shared = Arc<App>;

impl App {
    fn ready(&self) -> Result<&Loaded, ApiError> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
            ));
        }
        if let Some(why) = self.loaded.get().and_then(|l| l.sched.broken()) {
            return Err(ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the model can run no more steps: {why}"),
            ));
        }
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
        capacity: cfg.max_batch_size * cfg.data_parallel_degree,
        tokenizer,
        grammar_source: tokenizer.map(|_| {
            (
                artifact.dir.join(maxc_runtime::schema::TOKENIZER_FILE),
                artifact.manifest.eos_token_ids.clone(),
            )
        }),
        grammars: OnceLock::new(),
        eos: artifact.manifest.eos_token_ids.clone(),
        reasoning: match opts.reasoning {
            ReasoningParser::Think => true,
            ReasoningParser::None => false,
            ReasoningParser::Auto => chat.as_ref().is_some_and(|c| c.thinks()),
        },
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
        draining: AtomicBool::new(false),
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
                tracing::info!(
                    model = %app.model,
                    cpu_threads = %maxc_runtime::kernels::pool::choice(),
                    "model loaded"
                );
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
        .route(
            "/v1/completions",
            post(generation::generation::<openai::CompletionRequest>),
        )
        .route(
            "/v1/chat/completions",
            post(generation::generation::<openai::ChatRequest>),
        )
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/v1/models", get(info::models))
        .route("/health", get(info::health))
        .route("/v1/health", get(info::health))
        .route("/version", get(info::version))
        .fallback(info::not_found)
        .layer(axum::middleware::from_fn_with_state(
            limits,
            listen::read_body,
        ))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            observe::observe,
        ))
        .layer(DefaultBodyLimit::max(opts.max_request_bytes))
        .with_state(app.clone());
    let metrics_router = Router::new()
        .route("/metrics", get(info::metrics_text))
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
    // Health answers 503 (a readiness probe takes the server out of rotation) while the
    // requests in flight finish; then the listener closes.
    app.draining.store(true, Ordering::Relaxed);
    let deadline = tokio::time::Instant::now() + opts.shutdown_timeout;
    while app.inflight.load(Ordering::Relaxed) > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout_at(deadline, server).await;
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
