//! OTLP export over HTTP (protobuf by default, JSON with `OTEL_EXPORTER_OTLP_PROTOCOL=http/json`)
//! with the OpenTelemetry crates, where `OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set. Spans are batched on the exporter thread and
//! sent from a small runtime of its own; a failed export is a warning, never a failure.

use super::Span;
use opentelemetry::trace::{
    Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue, Value};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use std::time::{Duration, UNIX_EPOCH};

/// Spans sent per request at most.
const BATCH: usize = 512;

pub(super) struct Otlp {
    rt: tokio::runtime::Runtime,
    exporter: opentelemetry_otlp::SpanExporter,
    scope: InstrumentationScope,
    pending: Vec<SpanData>,
    failures: u64,
}

fn env_set(k: &str) -> bool {
    std::env::var_os(k).is_some_and(|v| !v.is_empty())
}

impl Otlp {
    /// The exporter the `OTEL_EXPORTER_OTLP_*` variables describe; `None` where no endpoint
    /// is set.
    pub(super) fn from_env() -> std::io::Result<Option<Self>> {
        if !env_set("OTEL_EXPORTER_OTLP_ENDPOINT") && !env_set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        {
            return Ok(None);
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let mut b = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_timeout(Duration::from_secs(10));
        // The specification's default is protobuf; the variables, read by the builder, win.
        if !env_set("OTEL_EXPORTER_OTLP_PROTOCOL") && !env_set("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        {
            b = b.with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
        }
        let mut exporter = {
            let _guard = rt.enter();
            b.build()
                .map_err(|e| std::io::Error::other(format!("OTLP exporter: {e}")))?
        };
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name("maxc")
            .build();
        exporter.set_resource(&resource);
        Ok(Some(Otlp {
            rt,
            exporter,
            scope: InstrumentationScope::builder("maxc")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            pending: Vec::new(),
            failures: 0,
        }))
    }

    pub(super) fn push(&mut self, s: Span) {
        let data = self.convert(s);
        self.pending.push(data);
        if self.pending.len() >= BATCH {
            self.flush();
        }
    }

    pub(super) fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.pending);
        let n = batch.len();
        if let Err(e) = self.rt.block_on(self.exporter.export(batch)) {
            self.failures += 1;
            // The first failure and then every hundredth, so that a dead collector does not
            // flood the log.
            if self.failures % 100 == 1 {
                tracing::warn!(
                    "OTLP export of {n} spans failed ({} so far): {e}",
                    self.failures
                );
            }
        }
    }

    fn convert(&self, s: Span) -> SpanData {
        let ctx = |c: &super::SpanContext| {
            SpanContext::new(
                TraceId::from(c.trace_id),
                SpanId::from(c.span_id),
                TraceFlags::SAMPLED,
                false,
                TraceState::NONE,
            )
        };
        let mut links = SpanLinks::default();
        links.links = s.links.iter().map(|l| Link::with_context(ctx(l))).collect();
        let attributes = s
            .attributes
            .into_iter()
            .map(|(k, v)| KeyValue::new(k, value(v)))
            .collect();
        SpanData {
            span_context: ctx(&s.ctx),
            parent_span_id: s.parent.map_or(SpanId::INVALID, SpanId::from),
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: s.name.into(),
            start_time: UNIX_EPOCH + Duration::from_nanos(s.start_unix_ns),
            end_time: UNIX_EPOCH + Duration::from_nanos(s.end_unix_ns),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links,
            status: Status::Unset,
            instrumentation_scope: self.scope.clone(),
        }
    }
}

fn value(v: serde_json::Value) -> Value {
    match v {
        serde_json::Value::Bool(b) => b.into(),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => i.into(),
            None => n.as_f64().unwrap_or(f64::NAN).into(),
        },
        serde_json::Value::String(s) => s.into(),
        other => other.to_string().into(),
    }
}
