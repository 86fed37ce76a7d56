//! The endpoints that report rather than generate: health, version, the model list, the
//! metrics text, and the answer to a path no route serves.

use super::openai::ApiError;
use super::Shared;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

pub(super) async fn not_found() -> ApiError {
    ApiError::status(StatusCode::NOT_FOUND, "no such endpoint")
}

pub(super) async fn health(State(app): State<Shared>) -> Response {
    match app.ready() {
        Ok(_) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION"), "name": "maxc"}))
}

pub(super) async fn models(State(app): State<Shared>) -> Json<Value> {
    let max_model_len = app.loaded.get().map(|l| l.max_model_len);
    Json(json!({
        "object": "list",
        "data": [{
            "id": app.model,
            "object": "model",
            "created": app.created,
            "owned_by": "maxc",
            "max_model_len": max_model_len,
        }],
    }))
}

pub(super) async fn metrics_text(State(app): State<Shared>) -> Response {
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.encode(),
    )
        .into_response()
}
