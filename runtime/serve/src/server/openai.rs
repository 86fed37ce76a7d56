//! OpenAI's request bodies (with MAX's extensions), strictly parsed (an unknown field is an
//! error naming it), and the error envelope.

use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};

/// An error as OpenAI reports it: status, message, type, param and code.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, naming the field.
    pub message: String,
    /// The field at fault, where one is.
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    /// An error with `status` and no field.
    pub fn status(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// OpenAI's `type` for the status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 408 | 413 | 422 => "invalid_request_error",
            401 => "authentication_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            _ => "server_error",
        }
    }

    /// The envelope `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
}

/// `prompt`: a text, texts, token ids, or lists of token ids.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Prompt {
    /// One text.
    Text(String),
    /// Several texts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<i64>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<i64>>),
}

/// `stop`: a string or a list of them.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings, empty ones dropped.
    pub fn strings(&self) -> Vec<String> {
        let v = match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        };
        v.into_iter().filter(|s| !s.is_empty()).collect()
    }
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// Send the usage in every chunk (accepted; the usage goes in the last chunk).
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// The sampling and limit fields common to both endpoints.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct Common {
    /// The model id.
    pub model: Option<String>,
    /// Tokens to generate at most.
    pub max_tokens: Option<i64>,
    /// Tokens to generate at most (wins over `max_tokens`).
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature, 0 to 2 (0: greedy).
    pub temperature: Option<f32>,
    /// Nucleus mass, above 0 up to 1.
    pub top_p: Option<f32>,
    /// Seed of the sampler.
    pub seed: Option<i64>,
    /// Stop strings (never part of the text).
    pub stop: Option<Stop>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Choices per prompt (1).
    pub n: Option<i64>,
    /// -2 to 2.
    pub frequency_penalty: Option<f32>,
    /// -2 to 2.
    pub presence_penalty: Option<f32>,
    /// The end user (recorded nowhere).
    pub user: Option<String>,
    /// MAX: sample among the k most likely tokens (-1 or 0: all).
    pub top_k: Option<i64>,
    /// MAX: drop tokens below this share of the most likely one.
    pub min_p: Option<f32>,
    /// MAX: Hugging Face's repetition penalty (above 0; 1 is off).
    pub repetition_penalty: Option<f32>,
    /// MAX: tokens to generate before a stop may end the request.
    pub min_tokens: Option<i64>,
    /// MAX: do not stop at end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
    /// MAX: token ids that end the request.
    pub stop_token_ids: Option<Vec<i64>>,
    /// vLLM's extension: score the prompt, returning each prompt token's log-probability and
    /// this many alternatives (0 to 20) in the choice's `prompt_logprobs`.
    pub prompt_logprobs: Option<i64>,
    /// vLLM's extension: log-probability entries name tokens as `token_id:ID`.
    pub return_tokens_as_token_ids: Option<bool>,
    /// Added to the logits of tokens (by id, as a string key) before sampling: -100 to 100.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// OpenAI: `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`.
    pub response_format: Option<Value>,
    /// vLLM: one of `json` (a schema), `json_object`, `regex`, `choice`, `grammar` (Lark).
    pub structured_outputs: Option<Value>,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    /// The prompt(s).
    pub prompt: Option<Prompt>,
    /// Log-probabilities of the chosen token and this many alternatives (0 to 5).
    pub logprobs: Option<i64>,
    /// Put the prompt before the completion in `text` (and its log-probabilities with
    /// `logprobs`).
    pub echo: Option<bool>,
    /// Generate this many choices of each prompt and return the `n` whose tokens are most
    /// likely (highest mean log-probability); at least `n`, never streamed.
    pub best_of: Option<i64>,
    /// The other fields.
    #[serde(flatten)]
    pub common: Common,
}

/// A chat message's content: a text, or parts of which the text ones count.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed parts.
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    /// `text` (other types are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    pub text: Option<String>,
}

/// A chat message.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The content.
    pub content: Option<Content>,
    /// A participant name, or a tool result's tool.
    pub name: Option<String>,
    /// An assistant's tool calls (OpenAI's shape; `function.arguments` a JSON string).
    pub tool_calls: Option<Value>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Option<Vec<Message>>,
    /// Return log-probabilities of the chosen tokens.
    pub logprobs: Option<bool>,
    /// Alternatives per token with `logprobs`, 0 to 20.
    pub top_logprobs: Option<i64>,
    /// Functions the model may call: `{"type": "function", "function": {"name",
    /// "description", "parameters"}}` each.
    pub tools: Option<Vec<Value>>,
    /// `none`, `auto` (the default with tools), `required`, or
    /// `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    /// Several calls in one answer (accepted; `required` and a named function make one).
    pub parallel_tool_calls: Option<bool>,
    /// More variables for the chat template (`enable_thinking`, say), as vLLM takes them.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// The other fields.
    #[serde(flatten)]
    pub common: Common,
}

/// Parses a JSON body strictly into `T`; the error names the field (serde's message names
/// unknown fields, missing ones and type mismatches with their path).
pub fn parse<T: serde::de::DeserializeOwned + Fields>(body: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid("body", format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::invalid("body", "the body must be a JSON object"));
    }
    // `flatten` hides unknown fields from deny_unknown_fields; check them by name.
    let known = T::fields();
    if let Some(obj) = value.as_object() {
        if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(ApiError::invalid(
                k,
                format!("unknown field `{k}`; this endpoint does not accept it"),
            ));
        }
    }
    serde_json::from_value::<T>(value.clone()).map_err(|e| {
        // serde's message names a mismatched value, not its field: every field is optional,
        // so the first field that fails alone is the one to name.
        let field = value.as_object().and_then(|obj| {
            obj.iter().find_map(|(k, v)| {
                let alone = Value::Object([(k.clone(), v.clone())].into_iter().collect());
                serde_json::from_value::<T>(alone)
                    .err()
                    .map(|e| (k.clone(), e))
            })
        });
        let (param, msg) = match field {
            Some((k, e)) => (k.clone(), format!("`{k}`: {e}")),
            None => ("body".to_string(), e.to_string()),
        };
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("invalid request: {msg}"),
            param: Some(param),
        }
    })
}

const COMMON: [&str; 25] = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "logprobs",
    "prompt_logprobs",
    "return_tokens_as_token_ids",
    "logit_bias",
    "response_format",
    "structured_outputs",
];

/// The top-level fields a request body may have, and those every endpoint shares.
pub trait Fields {
    /// Every accepted field name.
    fn fields() -> Vec<&'static str>;
    /// The fields every endpoint shares.
    fn common(&self) -> &Common;
}

impl Fields for CompletionRequest {
    fn fields() -> Vec<&'static str> {
        let mut v = COMMON.to_vec();
        v.extend(["prompt", "echo", "best_of"]);
        v
    }
    fn common(&self) -> &Common {
        &self.common
    }
}

impl Fields for ChatRequest {
    fn fields() -> Vec<&'static str> {
        let mut v = COMMON.to_vec();
        v.extend([
            "messages",
            "top_logprobs",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "chat_template_kwargs",
        ]);
        v
    }
    fn common(&self) -> &Common {
        &self.common
    }
}
