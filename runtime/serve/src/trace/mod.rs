//! Traces of a running model: request spans, `max.batch` spans (one per forward pass, linked to
//! the requests it ran), per-request kernel captures and their replay, and the forward-pass and
//! launch spans of `gpu_profiling` on the CPU.
//!
//! Spans are made where the work happens (the scheduler thread, the server's tasks) as plain
//! [`Span`] records and handed to one exporter thread, which writes them to a JSON-lines file,
//! to OTLP (where `OTEL_EXPORTER_OTLP_ENDPOINT` is set) and to `tracing` (target `maxc::trace`,
//! level debug). Nothing is made at all while tracing is off: the scheduler checks one flag
//! per step.

pub mod capture;
mod export;
#[cfg(feature = "otlp")]
mod otlp;

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

pub use crate::config::{GpuProfiling, ProfilingConfig};

/// How much the server traces (`MAX_SERVE_KERNEL_TRACE_LEVEL`, or a request's
/// `x-max-trace-level` header).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum TraceLevel {
    /// No spans.
    #[default]
    None,
    /// Request spans and a `max.batch` span per forward pass.
    Batch,
    /// As `batch`, and (for a request whose header asks for it, where
    /// `MAX_SERVE_KERNEL_TRACE_HEADERS` is on) a capture of the kernel launches.
    Kernel,
}

impl std::str::FromStr for TraceLevel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "none" | "off" | "0" => Ok(TraceLevel::None),
            "batch" | "1" => Ok(TraceLevel::Batch),
            "kernel" | "kernels" | "2" => Ok(TraceLevel::Kernel),
            other => Err(format!(
                "unknown trace level `{other}` (expected none, batch or kernel)"
            )),
        }
    }
}

impl TraceLevel {
    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            TraceLevel::None => "none",
            TraceLevel::Batch => "batch",
            TraceLevel::Kernel => "kernel",
        }
    }
}

/// A span's identity: W3C trace and span ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpanContext {
    /// 128-bit trace id (never 0).
    pub trace_id: u128,
    /// 64-bit span id (never 0).
    pub span_id: u64,
}

static ID_STATE: AtomicU64 = AtomicU64::new(0);

/// A fresh non-zero 64-bit id: SplitMix64 over a counter seeded once from the OS.
fn next_id() -> u64 {
    let mut s = ID_STATE.load(Ordering::Relaxed);
    if s == 0 {
        let mut b = [0u8; 8];
        let seed = getrandom::fill(&mut b)
            .map(|()| u64::from_le_bytes(b))
            .unwrap_or_else(|_| now_unix_ns() ^ u64::from(std::process::id()));
        let _ = ID_STATE.compare_exchange(0, seed | 1, Ordering::Relaxed, Ordering::Relaxed);
    }
    s = ID_STATE.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    let mut z = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)).max(1)
}

impl SpanContext {
    /// The root of a new trace.
    pub fn new_root() -> Self {
        SpanContext {
            trace_id: (u128::from(next_id()) << 64) | u128::from(next_id()),
            span_id: next_id(),
        }
    }

    /// A new span in this one's trace.
    pub fn child(&self) -> Self {
        SpanContext {
            trace_id: self.trace_id,
            span_id: next_id(),
        }
    }

    /// The context of a W3C `traceparent` header (`00-TRACEID-SPANID-FLAGS`), if it is one.
    pub fn from_traceparent(v: &str) -> Option<Self> {
        let mut parts = v.trim().split('-');
        let (ver, t, s, _flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if ver.len() != 2 || t.len() != 32 || s.len() != 16 {
            return None;
        }
        let trace_id = u128::from_str_radix(t, 16).ok().filter(|&t| t != 0)?;
        let span_id = u64::from_str_radix(s, 16).ok().filter(|&s| s != 0)?;
        Some(SpanContext { trace_id, span_id })
    }

    /// Its trace id as 32 hex digits.
    pub fn trace_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// Its span id as 16 hex digits.
    pub fn span_hex(&self) -> String {
        format!("{:016x}", self.span_id)
    }
}

/// Nanoseconds since the Unix epoch, now.
pub fn now_unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// One finished span.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// Its name (`max.batch`, `max.request`, a kernel's name, ...).
    pub name: String,
    /// Its identity.
    pub ctx: SpanContext,
    /// Its parent's span id, in the same trace.
    pub parent: Option<u64>,
    /// Start, in nanoseconds since the Unix epoch.
    pub start_unix_ns: u64,
    /// End, in nanoseconds since the Unix epoch.
    pub end_unix_ns: u64,
    /// Attributes by name.
    pub attributes: BTreeMap<String, Value>,
    /// Spans it is linked to (a `max.batch` span: the requests it ran).
    pub links: Vec<SpanContext>,
}

impl Span {
    /// The span as one JSON object (the JSON-lines file's line; ids in hex as OTLP/JSON).
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "name": self.name,
            "trace_id": self.ctx.trace_hex(),
            "span_id": self.ctx.span_hex(),
            "parent_span_id": self.parent.map(|p| format!("{p:016x}")),
            "start_unix_nano": self.start_unix_ns,
            "end_unix_nano": self.end_unix_ns,
            "attributes": self.attributes,
            "links": self.links.iter().map(|l| serde_json::json!({
                "trace_id": l.trace_hex(), "span_id": l.span_hex(),
            })).collect::<Vec<_>>(),
        })
    }
}

/// Where spans go.
#[derive(Clone, Debug, Default)]
pub struct ExportOptions {
    /// A JSON-lines file, one span per line (appended to).
    pub file: Option<PathBuf>,
    /// OTLP over HTTP, where `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set.
    pub otlp: bool,
}

/// What the exporter did, for tests and metrics.
#[derive(Debug, Default)]
pub struct TraceStats {
    /// Spans handed to the sinks.
    pub spans_exported: AtomicU64,
    /// Spans a capture's replay left out (over `kernel_trace_max_spans`).
    pub spans_dropped: AtomicU64,
    /// Captures over `kernel_trace_max_capture_bytes`, kept on disk and not exported.
    pub captures_oversized: AtomicU64,
}

/// The handle spans are sent through; cheap to clone. [`Tracer::off`] drops everything.
#[derive(Clone, Default)]
pub struct Tracer {
    inner: Option<Arc<export::Exporter>>,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer")
            .field("on", &self.inner.is_some())
            .finish()
    }
}

impl Tracer {
    /// A tracer that drops every span.
    pub fn off() -> Self {
        Tracer { inner: None }
    }

    /// Starts the exporter thread with the sinks of `opts` (the `tracing` sink always).
    pub fn start(opts: &ExportOptions) -> std::io::Result<Self> {
        Ok(Tracer {
            inner: Some(Arc::new(export::Exporter::start(opts)?)),
        })
    }

    /// Whether spans go anywhere.
    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// Exports a finished span.
    pub fn export(&self, span: Span) {
        if let Some(e) = &self.inner {
            e.send(export::Msg::Span(Box::new(span)));
        }
    }

    /// Replays a finished capture file (see [`capture`]) into spans under `parent`, within
    /// `limits`, and deletes it; an oversized one stays on disk and exports nothing.
    pub fn replay(&self, file: PathBuf, parent: SpanContext, limits: ProfilingConfig) {
        if let Some(e) = &self.inner {
            e.send(export::Msg::Replay {
                file,
                parent,
                limits,
            });
        }
    }

    /// Waits until every span sent so far is written out.
    pub fn flush(&self) {
        if let Some(e) = &self.inner {
            e.flush();
        }
    }

    /// What the exporter did.
    pub fn stats(&self) -> Option<&TraceStats> {
        self.inner.as_ref().map(|e| e.stats())
    }
}

/// How the scheduler traces its steps.
#[derive(Clone, Debug, Default)]
pub struct StepTracing {
    /// Where spans go.
    pub tracer: Tracer,
    /// The server's level (`MAX_SERVE_KERNEL_TRACE_LEVEL`).
    pub level: TraceLevel,
    /// Requests' `x-max-trace-level` headers may arm kernel captures
    /// (`MAX_SERVE_KERNEL_TRACE_HEADERS`).
    pub headers: bool,
    /// Limits and GPU profiling.
    pub profiling: ProfilingConfig,
    /// Where capture files are written.
    pub capture_dir: PathBuf,
}

/// A request's place in a trace: its span, and the level its `x-max-trace-level` header asked
/// for (if it had one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestTrace {
    /// The request's span.
    pub ctx: SpanContext,
    /// The header's level.
    pub header: Option<TraceLevel>,
}
