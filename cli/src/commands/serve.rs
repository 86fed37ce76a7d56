//! `maxc serve ARTIFACT`: the OpenAI-compatible server (MAX's settings and environment
//! variables), until SIGTERM or SIGINT.

use anyhow::{Context, Result};
use maxc_runtime::engine::Device;
use maxc_runtime::server::{serve, ServeOptions};
use std::path::PathBuf;
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
    #[command(flatten)]
    pub signature: crate::commands::sign::RequireSignature,
    #[command(flatten)]
    pub speculative: crate::args::SpeculativeArgs,
}

/// A duration flag in seconds: finite and not negative.
fn seconds(flag: &str, s: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| anyhow::anyhow!("{flag}: expected seconds (a number >= 0), got {s}"))
}

/// Serves until a signal ends it.
pub fn run(args: Args) -> Result<()> {
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
