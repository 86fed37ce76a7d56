//! The API's connections: hyper's HTTP/1 under limits that a slow or hostile client cannot
//! outlast. At most `max_connections` connections are served at once (more wait in the listen
//! backlog until one closes); a request's headers must arrive within `header_read_timeout` and
//! its body within `body_read_timeout` (408 otherwise); on shutdown every connection finishes
//! its response in flight and closes.

use super::error_response;
use super::openai::ApiError;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// How long and how many clients may hold the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Time for a request's headers to arrive, from the connection's start or the previous
    /// response.
    pub header_read_timeout: Duration,
    /// Time for a request's whole body to arrive.
    pub body_read_timeout: Duration,
    /// Largest request body, in bytes.
    pub max_request_bytes: usize,
}

/// Accepts and serves connections on `listener` with `router` until `stop` turns true; then
/// lets each open connection finish its response in flight and returns once all are closed.
pub async fn serve_connections(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    mut stop: watch::Receiver<bool>,
) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = stop.changed() => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.changed() => break,
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection closed: {e}");
            }
            drop(permit);
        });
    }
    graceful.shutdown().await;
}

/// Middleware reading each request's body within the body read timeout (408 otherwise) and
/// the body limit (413 otherwise), before any handler runs.
pub async fn read_body(
    State(limits): State<ConnectionLimits>,
    req: Request,
    next: Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let read = axum::body::to_bytes(body, limits.max_request_bytes);
    match tokio::time::timeout(limits.body_read_timeout, read).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            let err = if too_large {
                ApiError::status(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "the request body is larger than {} bytes (MAX_SERVE_MAX_REQUEST_BYTES)",
                        limits.max_request_bytes
                    ),
                )
            } else {
                ApiError::status(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read the request body: {e}"),
                )
            };
            error_response(&err)
        }
        Err(_) => error_response(&ApiError::status(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {:?}",
                limits.body_read_timeout
            ),
        )),
    }
}
