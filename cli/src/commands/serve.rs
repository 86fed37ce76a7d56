//! `maxc serve ARTIFACT`: the OpenAI-compatible server (MAX's settings and environment
//! variables), until SIGTERM or SIGINT.

use anyhow::{Context, Result};
use maxc_runtime::engine::Device;
use maxc_serve::server::{serve, ReasoningParser, ServeOptions, ServeTracing};
use maxc_serve::trace::{ExportOptions, ProfilingConfig, TraceLevel};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Arguments of `maxc serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The artifact directory (`NAME.maxc`).
    pub artifact: PathBuf,
    /// Address to listen on.
    #[arg(long, env = "MAX_SERVE_HOST", default_value = "0.0.0.0")]
    pub host: String,
    /// Port of the API (0: any free port).
    #[arg(long, env = "MAX_SERVE_PORT", default_value = "8000")]
    pub port: u16,
    /// Port of the Prometheus metrics (`/metrics`; 0: any free port).
    #[arg(long, env = "MAX_SERVE_METRICS_ENDPOINT_PORT", default_value = "8001")]
    pub metrics_port: u16,
    /// The model id clients name [default: the artifact's directory name].
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Do not share KV pages between requests with a common prefix.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Which chat answers have their `<think>` section returned apart, as `reasoning_content`:
    /// auto (where the chat template writes one: Qwen 3, DeepSeek-R1's distills), think
    /// (every answer) or none.
    #[arg(long, default_value = "auto", value_parser = ["auto", "think", "none"])]
    pub reasoning_parser: String,
    /// Where to run: cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Largest request body in bytes (larger: 413).
    #[arg(long, env = "MAX_SERVE_MAX_REQUEST_BYTES", default_value = "10485760")]
    pub max_request_bytes: usize,
    /// Requests that may wait beyond the running ones (more: 429).
    #[arg(long, env = "MAX_SERVE_MAX_QUEUE_SIZE", default_value = "512")]
    pub max_queue_size: usize,
    /// Seconds in-flight requests get to finish after SIGTERM or SIGINT.
    #[arg(
        long,
        env = "MAX_SERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S",
        default_value = "5"
    )]
    pub graceful_shutdown_timeout_s: f64,
    /// API connections served at once; more wait in the listen backlog until one closes.
    #[arg(long, env = "MAXC_SERVE_MAX_CONNECTIONS", default_value = "1024")]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers (then the connection is closed).
    #[arg(long, env = "MAXC_SERVE_HEADER_READ_TIMEOUT_S", default_value = "30")]
    pub header_read_timeout_s: f64,
    /// Seconds a client has to send a request's body (then 408).
    #[arg(long, env = "MAXC_SERVE_BODY_READ_TIMEOUT_S", default_value = "30")]
    pub body_read_timeout_s: f64,
    /// Spans of requests and forward passes: none, batch (a `max.batch` span per pass, linked
    /// to its requests) or kernel.
    #[arg(long, env = "MAX_SERVE_KERNEL_TRACE_LEVEL", default_value = "none")]
    pub kernel_trace_level: TraceLevel,
    /// A request's `x-max-trace-level: kernel` header arms a capture of its kernel launches.
    #[arg(
        long,
        env = "MAX_SERVE_KERNEL_TRACE_HEADERS",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub kernel_trace_headers: bool,
    /// Append every span to this JSON-lines file (spans also go to OTLP where
    /// OTEL_EXPORTER_OTLP_ENDPOINT is set, and to the log at MAXC_LOG=maxc::trace=debug).
    #[arg(long, env = "MAXC_SERVE_TRACE_FILE", value_name = "FILE")]
    pub trace_file: Option<PathBuf>,
    /// Where kernel captures are written [default: the system's temporary directory].
    #[arg(long, env = "MAXC_SERVE_KERNEL_TRACE_DIR", value_name = "DIR")]
    pub kernel_trace_dir: Option<PathBuf>,
    /// A YAML file of these settings, keyed by the flags' names with `_` for `-`, and a
    /// `profiling` section (MAX's ProfilingConfig: gpu_profiling, kernel_trace_max_passes,
    /// kernel_trace_max_batch_links, kernel_trace_max_spans, kernel_trace_max_capture_bytes).
    /// Flags and their environment variables override it; relative paths in it are relative
    /// to its directory.
    #[arg(long, value_name = "FILE")]
    pub config_file: Option<PathBuf>,
    /// Read only this top-level section of the config file.
    #[arg(long, requires = "config_file", value_name = "S")]
    pub section_name: Option<String>,
    #[command(flatten)]
    pub signature: crate::commands::sign::RequireSignature,
    #[command(flatten)]
    pub expert_parallel: crate::args::ExpertParallelArgs,
    #[command(flatten)]
    pub speculative: crate::args::SpeculativeArgs,
    #[command(flatten)]
    pub activations: crate::args::ActivationArgs,
}

/// Takes the config file's settings where neither a flag nor its environment variable gave
/// one; returns its profiling section.
fn apply_config_file(
    args: &mut Args,
    matches: Option<&clap::ArgMatches>,
) -> Result<ProfilingConfig> {
    let Some(file) = args.config_file.clone() else {
        return Ok(ProfilingConfig::default());
    };
    let s = maxc_serve::config::read(&file, args.section_name.as_deref())?;
    let explicit = |id: &str| {
        matches.and_then(|m| m.value_source(id)).is_some_and(|v| {
            matches!(
                v,
                clap::parser::ValueSource::CommandLine | clap::parser::ValueSource::EnvVariable
            )
        })
    };
    let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
    let path = |p: PathBuf| if p.is_relative() { dir.join(p) } else { p };
    let bad =
        |key: &str, e: String| anyhow::anyhow!("config file {}: key `{key}`: {e}", file.display());
    macro_rules! take {
        ($key:ident, $target:expr) => {
            if let Some(v) = s.$key.clone() {
                if !explicit(stringify!($key)) {
                    $target = v.into();
                }
            }
        };
    }
    take!(host, args.host);
    take!(port, args.port);
    take!(metrics_port, args.metrics_port);
    take!(served_model_name, args.served_model_name);
    take!(no_prefix_caching, args.no_prefix_caching);
    take!(max_request_bytes, args.max_request_bytes);
    take!(max_queue_size, args.max_queue_size);
    take!(
        graceful_shutdown_timeout_s,
        args.graceful_shutdown_timeout_s
    );
    take!(max_connections, args.max_connections);
    take!(header_read_timeout_s, args.header_read_timeout_s);
    take!(body_read_timeout_s, args.body_read_timeout_s);
    take!(speculative, args.speculative.speculative);
    take!(
        num_speculative_tokens,
        args.speculative.num_speculative_tokens
    );
    take!(kernel_trace_headers, args.kernel_trace_headers);
    if let (Some(n), false) = (s.expert_parallel_degree, explicit("expert_parallel_degree")) {
        args.expert_parallel.expert_parallel_degree = Some(n);
    }
    if let (Some(d), false) = (&s.device, explicit("device")) {
        args.device = d.parse().map_err(|e| bad("device", e))?;
    }
    if let (Some(n), false) = (s.threads, explicit("threads")) {
        args.activations.threads = Some(n);
    }
    if let (Some(a), false) = (&s.activations, explicit("activations")) {
        args.activations.activations = a.parse().map_err(|e| bad("activations", e))?;
    }
    if let (Some(l), false) = (&s.kernel_trace_level, explicit("kernel_trace_level")) {
        args.kernel_trace_level = l.parse().map_err(|e| bad("kernel_trace_level", e))?;
    }
    if let (Some(p), false) = (&s.require_signature, explicit("require_signature")) {
        args.signature.require_signature = Some(path(p.clone()));
    }
    if let (Some(p), false) = (&s.draft, explicit("draft")) {
        args.speculative.draft = Some(path(p.clone()));
    }
    if let (Some(p), false) = (&s.trace_file, explicit("trace_file")) {
        args.trace_file = Some(path(p.clone()));
    }
    Ok(s.profiling.unwrap_or_default())
}

/// A duration flag in seconds: finite and not negative.
fn seconds(flag: &str, s: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| anyhow::anyhow!("{flag}: expected seconds (a number >= 0), got {s}"))
}

/// Serves until a signal ends it. `matches` tells which settings the command line or the
/// environment gave (they win over the config file).
pub fn run(mut args: Args, matches: Option<&clap::ArgMatches>) -> Result<()> {
    let profiling = apply_config_file(&mut args, matches)?;
    if !args.artifact.join("manifest.json").is_file() {
        anyhow::bail!(
            "{}: not a maxc artifact (no manifest.json); compile one with `maxc compile`",
            args.artifact.display()
        );
    }
    if args.max_connections == 0 {
        anyhow::bail!("--max-connections: expected at least 1");
    }
    // Read and checked now, so that a bad key file stops `serve` before it listens.
    let require_signature = args.signature.key()?;
    if let Some(key) = &require_signature {
        let manifest = std::fs::read(args.artifact.join("manifest.json"))
            .with_context(|| format!("{}: reading the manifest", args.artifact.display()))?;
        maxc_runtime::signature::verify(&args.artifact, &manifest, key)?;
    }
    let opts = ServeOptions {
        artifact: args.artifact,
        require_signature,
        host: args.host,
        port: args.port,
        metrics_port: args.metrics_port,
        served_model_name: args.served_model_name,
        prefix_caching: !args.no_prefix_caching,
        device: args.device,
        kernels: args.activations.kernels(),
        max_request_bytes: args.max_request_bytes,
        max_queue_size: args.max_queue_size,
        shutdown_timeout: seconds(
            "--graceful-shutdown-timeout-s",
            args.graceful_shutdown_timeout_s.max(0.0),
        )?,
        speculation: args.speculative.options(),
        max_connections: args.max_connections,
        header_read_timeout: seconds("--header-read-timeout-s", args.header_read_timeout_s)?,
        body_read_timeout: seconds("--body-read-timeout-s", args.body_read_timeout_s)?,
        expert_parallel_degree: args.expert_parallel.expert_parallel_degree,
        reasoning: match args.reasoning_parser.as_str() {
            "think" => ReasoningParser::Think,
            "none" => ReasoningParser::None,
            _ => ReasoningParser::Auto,
        },
        tracing: ServeTracing {
            level: args.kernel_trace_level,
            headers: args.kernel_trace_headers,
            profiling,
            export: ExportOptions {
                file: args.trace_file,
                otlp: true,
            },
            capture_dir: args.kernel_trace_dir.unwrap_or_else(std::env::temp_dir),
        },
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(opts, |api, metrics| {
        eprintln!("maxc serve: API on http://{api}, metrics on http://{metrics}/metrics");
    }))?;
    eprintln!("maxc serve: stopped");
    Ok(())
}
