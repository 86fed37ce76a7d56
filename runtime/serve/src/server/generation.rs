//! A generation endpoint from request to response: the shared prologue, the endpoint's own
//! planning, the shared answer.

use super::admission::{body_bytes, check_common, Awaiting, Plan};
use super::observe::Traced;
use super::openai::{self, ApiError, Fields};
use super::respond::respond;
use super::{App, Loaded, Shared};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use std::time::Instant;

/// A generation endpoint's request: its body's fields, and how it becomes jobs (the endpoint's
/// own validation and tokenization).
pub(super) trait Endpoint: serde::de::DeserializeOwned + Fields {
    /// The request's jobs, its common fields already checked.
    fn plan(self, app: &App, l: &Loaded) -> Result<Plan, ApiError>;
}

/// The handler of every generation endpoint: reads the request `R` and checks its common
/// fields, then [`Endpoint::plan`]s its jobs, then answers them ([`respond`]).
pub(super) async fn generation<R: Endpoint>(
    State(app): State<Shared>,
    axum::Extension(traced): axum::Extension<Traced>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = Instant::now();
    let awaiting = Awaiting::new(&app.metrics);
    let result = (|| {
        let body = body_bytes(body)?;
        let req: R = openai::parse(&body)?;
        let l = app.ready()?;
        check_common(&app, req.common())?;
        req.plan(&app, l)
    })();
    respond(app, result, arrival, awaiting, traced).await
}
