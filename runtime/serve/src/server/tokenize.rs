//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: a prompt (or a conversation
//! rendered by the chat template) to token ids, and token ids back to text.

use super::admission::{body_bytes, check_model, tokenizer};
use super::chat::message_text;
use super::openai::{ApiError, Message};
use super::Shared;
use crate::chat::ChatMessage;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

/// `POST /tokenize`: a `prompt`, or chat `messages`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    /// Add the tokenizer's special tokens (BOS): default true for a prompt, false for
    /// messages (the template writes them).
    add_special_tokens: Option<bool>,
    /// Messages only: end with the opening of the assistant's turn (default true).
    add_generation_prompt: Option<bool>,
    /// Also return each token's text.
    return_token_strs: Option<bool>,
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<i64>,
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid("body", e.to_string()))
}

pub(super) async fn tokenize(
    State(app): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = (|| {
        let req: TokenizeRequest = parse(&body_bytes(body)?)?;
        check_model(&app, req.model.as_deref())?;
        let l = app.ready()?;
        let (text, param, special) = match (&req.prompt, &req.messages) {
            (Some(p), None) => (p.clone(), "prompt", req.add_special_tokens.unwrap_or(true)),
            (None, Some(messages)) => {
                let msgs = messages
                    .iter()
                    .enumerate()
                    .map(|(i, m)| Ok(ChatMessage::new(m.role.clone(), message_text(m, i)?)))
                    .collect::<Result<Vec<_>, ApiError>>()?;
                let template = l.chat.as_ref().ok_or_else(|| {
                    ApiError::invalid("messages", "the artifact has no chat template")
                })?;
                let text = template
                    .render(&msgs, req.add_generation_prompt.unwrap_or(true))
                    .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
                (text, "messages", req.add_special_tokens.unwrap_or(false))
            }
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "give exactly one of `prompt` and `messages`",
                ))
            }
        };
        let tok = tokenizer(l, param)?;
        let ids = tok
            .encode(&text, special)
            .map_err(|e| ApiError::invalid(param, e.to_string()))?;
        let strs = req.return_token_strs.unwrap_or(false).then(|| {
            ids.iter()
                .map(|&t| tok.token(t).unwrap_or_default())
                .collect::<Vec<_>>()
        });
        Ok(json!({
            "count": ids.len(),
            "max_model_len": l.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }))
    })();
    match result {
        Ok(v) => (StatusCode::OK, Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn detokenize(
    State(app): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = (|| {
        let req: DetokenizeRequest = parse(&body_bytes(body)?)?;
        check_model(&app, req.model.as_deref())?;
        let l = app.ready()?;
        let tok = tokenizer(l, "tokens")?;
        let ids = req
            .tokens
            .iter()
            .map(|&t| {
                u32::try_from(t)
                    .ok()
                    .filter(|&t| (t as usize) < l.vocab)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "tokens",
                            format!("token id {t} is outside the vocabulary (0..{})", l.vocab),
                        )
                    })
            })
            .collect::<Result<Vec<u32>, ApiError>>()?;
        let text = tok
            .decode(&ids, false)
            .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
        Ok::<_, ApiError>(json!({ "prompt": text }))
    })();
    match result {
        Ok(v) => (StatusCode::OK, Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}
