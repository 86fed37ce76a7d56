//! The middleware every API request passes: its `x-request-id`, its span where it is traced,
//! `maxserve_request_count` (labelled from the fixed set of routes) and
//! `maxserve_request_time_milliseconds`, and one log line.

use super::choice::ms;
use super::{App, Shared};
use crate::trace::{RequestTrace, Span, SpanContext, TraceLevel, Tracer};
use axum::extract::State;
use axum::http::HeaderValue;
use axum::response::Response;
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// A traced request's span, exported when the last holder (the middleware, the response's
/// stream) lets go of it.
pub(super) struct RequestSpan {
    pub(super) tracer: Tracer,
    pub(super) trace: RequestTrace,
    pub(super) parent: Option<u64>,
    pub(super) start_unix_ns: u64,
    pub(super) attributes: std::sync::Mutex<std::collections::BTreeMap<String, Value>>,
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
pub(super) struct Traced(pub(super) Option<Arc<RequestSpan>>);

/// Every response: an `x-request-id` (the client's, or a new one), `maxserve_request_count`,
/// `maxserve_request_time_milliseconds`, and one log line.
pub(super) async fn observe(
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
pub(super) fn route_label(matched: &str) -> &'static str {
    ROUTES
        .iter()
        .find(|r| **r == matched)
        .copied()
        .unwrap_or("other")
}

/// The API's routes, as [`router`] serves them and `maxserve_request_count` labels them.
pub(super) const ROUTES: [&str; 6] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/v1/health",
    "/version",
];

/// The span of a request that is traced: at level `batch` and up, or where it carries an
/// `x-max-trace-level` header (a W3C `traceparent` header puts it in the caller's trace).
pub(super) fn request_span(
    app: &App,
    req: &axum::extract::Request,
    id: &str,
    path: &str,
) -> Traced {
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
