//! `POST /v1/embeddings`: each input's final hidden states pooled (the last token's by default,
//! or the mean with `pooling: "mean"`, an extension) and normalized, as floats or base64 of
//! little-endian f32 (`encoding_format`); usage counts the inputs' tokens.

use super::admission::{body_bytes, check_model};
use super::openai::{ApiError, Prompt};
use super::Shared;
use crate::scheduler::{Event, Pooling, Request};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

/// `POST /v1/embeddings`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EmbeddingRequest {
    model: Option<String>,
    input: Option<Prompt>,
    encoding_format: Option<String>,
    dimensions: Option<i64>,
    user: Option<String>,
    /// `last` (default) or `mean`.
    pooling: Option<String>,
}

/// Standard base64 of `bytes`, padded.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

pub(super) async fn embeddings(
    State(app): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match answer(&app, body).await {
        Ok(v) => (StatusCode::OK, Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn answer(app: &Shared, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let req: EmbeddingRequest = serde_json::from_slice(&body_bytes(body)?)
        .map_err(|e| ApiError::invalid("body", e.to_string()))?;
    let _ = &req.user;
    check_model(app, req.model.as_deref())?;
    let l = app.ready()?;
    let base64_out = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` is `{other}`; expected float or base64"),
            ))
        }
    };
    if req.dimensions.is_some() {
        return Err(ApiError::invalid(
            "dimensions",
            "`dimensions` is not supported: embeddings have the model's hidden size",
        ));
    }
    let pooling = match req.pooling.as_deref() {
        None | Some("last") => Pooling::Last,
        Some("mean") => Pooling::Mean,
        Some(other) => {
            return Err(ApiError::invalid(
                "pooling",
                format!("`pooling` is `{other}`; expected last or mean"),
            ))
        }
    };
    let encode = |s: &str| -> Result<Vec<i64>, ApiError> {
        let tok = l.tokenizer.ok_or_else(|| {
            ApiError::invalid("input", "the artifact has no tokenizer: send token ids")
        })?;
        Ok(tok
            .encode(s, true)
            .map_err(|e| ApiError::invalid("input", e.to_string()))?
            .into_iter()
            .map(i64::from)
            .collect())
    };
    let inputs: Vec<Vec<i64>> = match req.input {
        None => return Err(ApiError::invalid("input", "`input` is required")),
        Some(Prompt::Text(s)) => vec![encode(&s)?],
        Some(Prompt::Texts(v)) => v.iter().map(|s| encode(s)).collect::<Result<_, _>>()?,
        Some(Prompt::Tokens(ids)) => vec![ids],
        Some(Prompt::TokenLists(v)) => v,
    };
    if inputs.is_empty() {
        return Err(ApiError::invalid("input", "`input` is empty"));
    }
    for (i, ids) in inputs.iter().enumerate() {
        if ids.is_empty() {
            return Err(ApiError::invalid("input", format!("input {i} is empty")));
        }
        if let Some(t) = ids.iter().find(|&&t| t < 0 || t as usize >= l.vocab) {
            return Err(ApiError::invalid(
                "input",
                format!(
                    "input {i}: token id {t} is outside the vocabulary (0..{})",
                    l.vocab
                ),
            ));
        }
        if ids.len() > l.max_model_len {
            return Err(ApiError::invalid(
                "input",
                format!(
                    "input {i} has {} tokens; the model's context is {}",
                    ids.len(),
                    l.max_model_len
                ),
            ));
        }
    }
    let receivers: Vec<_> = inputs
        .iter()
        .map(|ids| {
            let mut r = Request::greedy(ids.clone(), 0);
            r.embed = Some(pooling);
            l.sched.submit(r)
        })
        .collect();
    let mut data = Vec::with_capacity(inputs.len());
    for (i, mut rx) in receivers.into_iter().enumerate() {
        let mut vector = None;
        while let Some(event) = rx.recv().await {
            match event {
                Event::Embedding(v) => vector = Some(v),
                Event::Error(e) => {
                    return Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e))
                }
                Event::Finished { .. } => break,
                _ => {}
            }
        }
        let v = vector.ok_or_else(|| {
            ApiError::status(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("input {i} ended without an embedding"),
            )
        })?;
        let embedding = if base64_out {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            json!(base64(&bytes))
        } else {
            json!(v)
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    Ok(json!({
        "object": "list",
        "data": data,
        "model": app.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_as_python_writes_it() {
        assert_eq!(super::base64(b""), "");
        assert_eq!(super::base64(b"f"), "Zg==");
        assert_eq!(super::base64(b"fo"), "Zm8=");
        assert_eq!(super::base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(super::base64(&[0xff, 0xfe, 0x00, 0x01]), "//4AAQ==");
    }
}
