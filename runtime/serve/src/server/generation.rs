//! A generation endpoint from request to response: the shared prologue, the endpoint's own
//! planning, the shared answer.

use super::admission::{body_bytes, check_common, Awaiting, Plan};
use super::observe::Traced;
use super::openai::{self, ApiError, Fields};
use super::respond::respond;
use super::{App, Loaded, Shared};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::Response;
use std::time::Instant;

/// A generation endpoint: reads the common checks' request `R`, then `plan`s its jobs (the
/// endpoint's own validation and tokenization), then answers them ([`respond`]).
pub(super) async fn generation<R: serde::de::DeserializeOwned + Fields>(
    app: Shared,
    traced: Traced,
    body: Result<Bytes, BytesRejection>,
    plan: impl FnOnce(&App, &Loaded, R) -> Result<Plan, ApiError>,
) -> Response {
    let arrival = Instant::now();
    let awaiting = Awaiting::new(&app.metrics);
    let result = (|| {
        let body = body_bytes(body)?;
        let req: R = openai::parse(&body)?;
        let l = app.ready()?;
        check_common(&app, req.common())?;
        plan(&app, l, req)
    })();
    respond(app, result, arrival, awaiting, traced).await
}
