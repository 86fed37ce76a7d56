//! A request's kernel capture: the launches of the passes that ran it (kernel name, kind,
//! graph nodes, start, duration, thread), one JSON line per pass in a file on disk, written on
//! the scheduler thread as the passes run; and its replay into spans on the exporter thread.
//!
//! The capture stops after `kernel_trace_max_passes` passes. The replay exports every pass's
//! summary span first, then kernel spans, at most `kernel_trace_max_spans` in all (a warning
//! says how many were dropped); a file larger than `kernel_trace_max_capture_bytes` stays on
//! disk, exports nothing and warns.

use super::{ProfilingConfig, Span, SpanContext, TraceStats};
use maxc_runtime::profile::StepProfile;
use maxc_runtime::schema::{Program, StepDim};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

/// One launch in a capture file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CapturedLaunch {
    /// The kernel's name.
    pub name: String,
    /// Its kind (`matmul`, `attention`, ...).
    pub kind: String,
    /// The graph nodes it computes.
    pub nodes: Vec<String>,
    /// Start, in nanoseconds since the Unix epoch.
    pub start_unix_ns: u64,
    /// Duration in nanoseconds.
    pub dur_ns: u64,
    /// The thread that launched it.
    pub thread: String,
}

/// One pass in a capture file (one line).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CapturedPass {
    /// The pass's index in this capture (from 0).
    pub pass: u64,
    /// Start, in nanoseconds since the Unix epoch.
    pub start_unix_ns: u64,
    /// Duration in nanoseconds.
    pub dur_ns: u64,
    /// Token rows the pass ran.
    pub total_seq_len: u64,
    /// Sequences the pass ran.
    pub batch_size: u64,
    /// Its launches, in order.
    pub launches: Vec<CapturedLaunch>,
}

/// A capture being written.
#[derive(Debug)]
pub struct Capture {
    path: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    passes: u64,
    max_passes: u64,
}

impl Capture {
    /// A new capture file in `dir` for the request `ctx`.
    pub fn create(dir: &Path, ctx: &SpanContext, max_passes: u64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!(
            "maxc-capture-{}-{}.jsonl",
            ctx.trace_hex(),
            ctx.span_hex()
        ));
        let out = std::io::BufWriter::new(std::fs::File::create(&path)?);
        Ok(Capture {
            path,
            out,
            passes: 0,
            max_passes,
        })
    }

    /// Whether it holds `kernel_trace_max_passes` passes.
    pub fn is_full(&self) -> bool {
        self.passes >= self.max_passes
    }

    /// Passes recorded.
    pub fn passes(&self) -> u64 {
        self.passes
    }

    /// Appends a pass of `program` that began at `start_unix_ns`, timed by `profile`.
    pub fn record(
        &mut self,
        program: &Program,
        profile: &StepProfile,
        start_unix_ns: u64,
        thread: &str,
    ) -> std::io::Result<()> {
        let pass = CapturedPass {
            pass: self.passes,
            start_unix_ns,
            dur_ns: profile.total_ns,
            total_seq_len: profile.dims[StepDim::TotalSeqLen as usize],
            batch_size: profile.dims[StepDim::BatchSize as usize],
            launches: profile
                .launches
                .iter()
                .filter_map(|l| {
                    let launch = program.launches.get(l.launch)?;
                    let k = program.kernels.get(launch.kernel as usize)?;
                    Some(CapturedLaunch {
                        name: k.name.clone(),
                        kind: k.body.kind().to_string(),
                        nodes: launch.nodes.clone(),
                        start_unix_ns: start_unix_ns + l.start_ns,
                        dur_ns: l.dur_ns,
                        thread: thread.to_string(),
                    })
                })
                .collect(),
        };
        serde_json::to_writer(&mut self.out, &pass)?;
        self.out.write_all(b"\n")?;
        self.passes += 1;
        Ok(())
    }

    /// Closes the file; returns its path.
    pub fn finish(mut self) -> std::io::Result<PathBuf> {
        self.out.flush()?;
        Ok(self.path)
    }
}

/// Replays the capture `file` into spans under the request span `parent`, within `limits`,
/// handing each to `sink`; deletes the file once replayed. Returns the spans exported.
pub fn replay(
    file: &Path,
    parent: SpanContext,
    limits: &ProfilingConfig,
    stats: &TraceStats,
    mut sink: impl FnMut(Span),
) -> std::io::Result<u64> {
    let size = std::fs::metadata(file)?.len();
    if size > limits.kernel_trace_max_capture_bytes {
        stats.captures_oversized.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            "kernel capture {} is {size} bytes, over kernel_trace_max_capture_bytes ({}): kept on disk, nothing exported",
            file.display(),
            limits.kernel_trace_max_capture_bytes
        );
        return Ok(0);
    }
    let mut passes = Vec::new();
    for line in std::io::BufReader::new(std::fs::File::open(file)?).lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let p: CapturedPass = serde_json::from_str(&line).map_err(std::io::Error::other)?;
        passes.push(p);
    }
    let total: u64 = passes.iter().map(|p| 1 + p.launches.len() as u64).sum();
    let budget = limits.kernel_trace_max_spans;
    let mut exported = 0u64;
    // Every pass's summary first, then the kernels of each pass in order.
    let mut pass_ctx = Vec::with_capacity(passes.len());
    for p in &passes {
        if exported >= budget {
            break;
        }
        let ctx = parent.child();
        pass_ctx.push(ctx);
        let mut attributes = std::collections::BTreeMap::new();
        attributes.insert("max.pass".into(), p.pass.into());
        attributes.insert("max.pass.total_seq_len".into(), p.total_seq_len.into());
        attributes.insert("max.pass.batch_size".into(), p.batch_size.into());
        attributes.insert("max.pass.launches".into(), (p.launches.len() as u64).into());
        sink(Span {
            name: "max.pass".into(),
            ctx,
            parent: Some(parent.span_id),
            start_unix_ns: p.start_unix_ns,
            end_unix_ns: p.start_unix_ns + p.dur_ns,
            attributes,
            links: Vec::new(),
        });
        exported += 1;
    }
    'kernels: for (p, ctx) in passes.iter().zip(&pass_ctx) {
        for l in &p.launches {
            if exported >= budget {
                break 'kernels;
            }
            sink(kernel_span(l, ctx));
            exported += 1;
        }
    }
    let dropped = total - exported;
    if dropped > 0 {
        stats.spans_dropped.fetch_add(dropped, Ordering::Relaxed);
        tracing::warn!(
            "kernel capture {}: {dropped} of {total} spans dropped (kernel_trace_max_spans = {budget})",
            file.display()
        );
    }
    std::fs::remove_file(file)?;
    Ok(exported)
}

/// A launch's span under its pass `pass`.
pub fn kernel_span(l: &CapturedLaunch, pass: &SpanContext) -> Span {
    let mut attributes = std::collections::BTreeMap::new();
    attributes.insert("max.kernel.kind".into(), l.kind.clone().into());
    attributes.insert("max.kernel.nodes".into(), serde_json::json!(l.nodes));
    attributes.insert("thread.name".into(), l.thread.clone().into());
    Span {
        name: l.name.clone(),
        ctx: pass.child(),
        parent: Some(pass.span_id),
        start_unix_ns: l.start_unix_ns,
        end_unix_ns: l.start_unix_ns + l.dur_ns,
        attributes,
        links: Vec::new(),
    }
}
