//! `POST /v1/chat/completions`: the conversation rendered by the artifact's chat template
//! into one job.

use super::admission::{choices, request_for, tokenizer, Job, Plan};
use super::choice::ms;
use super::generation::Endpoint;
use super::openai::{self, ApiError, ChatRequest, Content};
use super::{App, Loaded};
use crate::chat::ChatMessage;
use std::time::Instant;

pub(super) fn message_text(m: &openai::Message, i: usize) -> Result<String, ApiError> {
    Ok(match &m.content {
        None => String::new(),
        Some(Content::Text(s)) => s.clone(),
        Some(Content::Parts(parts)) => {
            let mut s = String::new();
            for p in parts {
                if p.kind != "text" {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].content"),
                        format!(
                            "content parts of type `{}` are not supported (text only)",
                            p.kind
                        ),
                    ));
                }
                s.push_str(p.text.as_deref().unwrap_or_default());
            }
            s
        }
    })
}

impl Endpoint for ChatRequest {
    /// The request's one job: the conversation rendered and tokenized.
    fn plan(self, app: &App, l: &Loaded) -> Result<Plan, ApiError> {
        let req = self;
        let messages = match &req.messages {
            None => return Err(ApiError::invalid("messages", "`messages` is required")),
            Some(m) if m.is_empty() => {
                return Err(ApiError::invalid("messages", "`messages` is empty"))
            }
            Some(m) => m,
        };
        let t = Instant::now();
        let msgs = messages
            .iter()
            .enumerate()
            .map(|(i, m)| Ok(ChatMessage::new(m.role.clone(), message_text(m, i)?)))
            .collect::<Result<Vec<_>, ApiError>>()?;
        app.metrics
            .num_input_characters
            .inc_by(msgs.iter().map(|m| m.content.chars().count() as u64).sum());
        let template = l.chat.as_ref().ok_or_else(|| {
            ApiError::invalid(
                "messages",
                "the artifact has no chat template; use /v1/completions",
            )
        })?;
        let text = template
            .render(&msgs, true)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        let ids: Vec<i64> = tokenizer(l, "messages")?
            .encode(&text, false)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?
            .into_iter()
            .map(i64::from)
            .collect();
        let logprobs = req.logprobs.unwrap_or(false);
        let top = match req.top_logprobs {
            Some(k) if !(0..=20).contains(&k) => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("`top_logprobs` is {k}; expected 0 to 20"),
                ))
            }
            Some(_) if !logprobs => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ))
            }
            k => k.unwrap_or(0) as usize,
        };
        let mut request = request_for(l, &req.common, ids, "messages", &app.metrics)?;
        request.logprobs = logprobs.then_some(top);
        app.metrics.input_processing_time.observe(ms(t.elapsed()));
        let jobs = choices(app, l, &req.common, vec![Job::new(request, None)])?;
        Ok(Plan::new(&req.common, jobs, true, logprobs))
    }
}
