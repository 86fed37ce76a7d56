//! The exporter thread: spans and capture replays arrive over a channel and go to the sinks
//! (a JSON-lines file, OTLP, `tracing`).

use super::{capture, ExportOptions, ProfilingConfig, Span, SpanContext, TraceStats};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// What the exporter thread is told.
pub(super) enum Msg {
    Span(Box<Span>),
    Replay {
        file: PathBuf,
        parent: SpanContext,
        limits: ProfilingConfig,
    },
    Flush(std::sync::mpsc::Sender<()>),
}

/// The running exporter; dropping it flushes and stops the thread.
pub(super) struct Exporter {
    tx: Mutex<Option<std::sync::mpsc::Sender<Msg>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    stats: std::sync::Arc<TraceStats>,
}

/// Where the exporter thread writes.
struct Sinks {
    file: Option<(PathBuf, std::io::BufWriter<std::fs::File>)>,
    #[cfg(feature = "otlp")]
    otlp: Option<super::otlp::Otlp>,
    stats: std::sync::Arc<TraceStats>,
}

impl Sinks {
    fn span(&mut self, s: Span) {
        tracing::debug!(
            target: "maxc::trace",
            name = %s.name,
            trace_id = %s.ctx.trace_hex(),
            span_id = %s.ctx.span_hex(),
            dur_us = (s.end_unix_ns.saturating_sub(s.start_unix_ns)) / 1000,
            links = s.links.len(),
            "span"
        );
        if let Some((path, f)) = self.file.as_mut() {
            let line = s.to_json().to_string();
            if let Err(e) = writeln!(f, "{line}") {
                tracing::warn!(
                    "trace file {}: {e}; spans are no longer written to it",
                    path.display()
                );
                self.file = None;
            }
        }
        #[cfg(feature = "otlp")]
        if let Some(o) = self.otlp.as_mut() {
            o.push(s);
        }
        self.stats.spans_exported.fetch_add(1, Ordering::Relaxed);
    }

    fn flush(&mut self) {
        if let Some((path, f)) = self.file.as_mut() {
            if let Err(e) = f.flush() {
                tracing::warn!("trace file {}: {e}", path.display());
            }
        }
        #[cfg(feature = "otlp")]
        if let Some(o) = self.otlp.as_mut() {
            o.flush();
        }
    }
}

impl Exporter {
    pub(super) fn start(opts: &ExportOptions) -> std::io::Result<Self> {
        let stats = std::sync::Arc::new(TraceStats::default());
        let file = match &opts.file {
            Some(p) => {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| {
                        std::io::Error::new(e.kind(), format!("trace file {}: {e}", p.display()))
                    })?;
                Some((p.clone(), std::io::BufWriter::new(f)))
            }
            None => None,
        };
        #[cfg(feature = "otlp")]
        let otlp = if opts.otlp {
            super::otlp::Otlp::from_env()?
        } else {
            None
        };
        let mut sinks = Sinks {
            file,
            #[cfg(feature = "otlp")]
            otlp,
            stats: stats.clone(),
        };
        let (tx, rx) = std::sync::mpsc::channel::<Msg>();
        let thread = std::thread::Builder::new()
            .name("maxc-trace".into())
            .spawn(move || {
                loop {
                    let m = match rx.recv_timeout(std::time::Duration::from_millis(500)) {
                        Ok(m) => m,
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                            // Idle: what is buffered goes out.
                            sinks.flush();
                            continue;
                        }
                        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                    };
                    match m {
                        Msg::Span(s) => sinks.span(*s),
                        Msg::Replay {
                            file,
                            parent,
                            limits,
                        } => {
                            let stats = sinks.stats.clone();
                            let r =
                                capture::replay(&file, parent, &limits, &stats, |s| sinks.span(s));
                            if let Err(e) = r {
                                tracing::warn!("kernel capture {}: {e}", file.display());
                            }
                        }
                        Msg::Flush(done) => {
                            sinks.flush();
                            let _ = done.send(());
                        }
                    }
                }
                sinks.flush();
            })?;
        Ok(Exporter {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            stats,
        })
    }

    pub(super) fn send(&self, m: Msg) {
        if let Ok(tx) = self.tx.lock() {
            if let Some(tx) = tx.as_ref() {
                let _ = tx.send(m);
            }
        }
    }

    pub(super) fn flush(&self) {
        let (done, wait) = std::sync::mpsc::channel();
        self.send(Msg::Flush(done));
        let _ = wait.recv();
    }

    pub(super) fn stats(&self) -> &TraceStats {
        &self.stats
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
    }
}
