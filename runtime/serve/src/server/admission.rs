//! What a generation request passes before its endpoint plans it: its count while it awaits
//! admission, its body read, the fields every endpoint shares checked; and the checks that turn
//! a prompt and those fields into a scheduler [`Request`].

use super::observe::Traced;
use super::openai::{ApiError, Common};
use super::{App, Loaded, Shared};
use crate::metrics::Metrics;
use crate::scheduler::Request;
use crate::tokenizer::Tokenizer;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use maxc_runtime::sampling::SamplingParams;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

pub(super) fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::status(status, format!("the request body is too large: {e}"))
        } else {
            ApiError::status(status, format!("cannot read the request body: {e}"))
        }
    })
}

/// Counts a request awaiting admission (received, not yet handed to the scheduler) while alive.
pub(super) struct Awaiting(Arc<Metrics>);

impl Awaiting {
    pub(super) fn new(m: &Arc<Metrics>) -> Self {
        m.num_requests_awaiting_admission.inc();
        m.requests_awaiting_admission
            .observe(m.num_requests_awaiting_admission.get().max(0) as f64);
        Awaiting(m.clone())
    }
}

impl Drop for Awaiting {
    fn drop(&mut self) {
        self.0.num_requests_awaiting_admission.dec();
    }
}

/// Counts a generation request in flight for the queue limit while alive.
/// (The request's span rides along so that it ends when the response does.)
pub(super) struct InFlight(pub(super) Shared, #[allow(dead_code)] pub(super) Traced);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One choice of a prompt, ready for the scheduler.
pub(super) struct Job {
    pub(super) request: Request,
    pub(super) echo: Option<String>,
    /// Whether its usage counts the prompt (the first choice of each prompt does).
    pub(super) counts_prompt: bool,
}

impl Job {
    /// A prompt's one choice.
    pub(super) fn new(request: Request, echo: Option<String>) -> Self {
        Job {
            request,
            echo,
            counts_prompt: true,
        }
    }
}

/// Each prompt's job as `n` choices (`n` of the request, 1 by default), in prompt order, the
/// choices of a prompt next to each other: the first prefills the prompt, the others start
/// from its pages, each with a seed of its own (the request's plus the choice's index).
pub(super) fn choices(
    app: &App,
    l: &Loaded,
    c: &Common,
    jobs: Vec<Job>,
) -> Result<Vec<Job>, ApiError> {
    let n = choice_count(l, "n", c.n)?;
    Ok(fork(app, jobs, n))
}

/// A count of choices (`n`, `best_of`): 1 by default, at least 1, at most the sequences a step
/// holds.
pub(super) fn choice_count(l: &Loaded, param: &str, v: Option<i64>) -> Result<usize, ApiError> {
    Ok(match v {
        None => 1,
        Some(n) if n < 1 => {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` is {n}; it must be at least 1"),
            ))
        }
        Some(n) if n as usize > l.capacity => {
            return Err(ApiError::invalid(
                param,
                format!(
                    "`{param}` is {n}, above the {} sequences a step of this artifact holds",
                    l.capacity
                ),
            ))
        }
        Some(n) => n as usize,
    })
}

/// Each of `jobs` as `n` forked choices, next to each other.
pub(super) fn fork(app: &App, jobs: Vec<Job>, n: usize) -> Vec<Job> {
    if n == 1 {
        return jobs;
    }
    let mut out = Vec::with_capacity(jobs.len() * n);
    for job in jobs {
        let group = app.next_id.fetch_add(1, Ordering::Relaxed);
        for j in 0..n {
            let mut request = job.request.clone();
            request.sampling.seed = request.sampling.seed.wrapping_add(j as u64);
            request.fork = Some(crate::scheduler::Fork {
                group,
                leader: j == 0,
            });
            out.push(Job {
                request,
                echo: job.echo.clone(),
                counts_prompt: j == 0,
            });
        }
    }
    out
}

/// What both endpoints share once their prompts are tokenized.
pub(super) struct Plan {
    pub(super) token_ids: bool,
    pub(super) jobs: Vec<Job>,
    pub(super) stops: Vec<String>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) chat: bool,
    pub(super) logprobs: bool,
    /// Choices carry the prompt's log-probabilities (vLLM's `prompt_logprobs`).
    pub(super) prompt_logprobs: bool,
    /// Where the answer may call tools: how the model writes calls, and the tools' names.
    pub(super) tools: Option<ToolParsing>,
    /// Where the answer's thinking section is split out: whether the prompt opened it.
    pub(super) reasoning: Option<bool>,
    /// Whether `response_format` asked for JSON (its answers are checked for conformance).
    pub(super) json_response: bool,
    /// `best_of`: each prompt's jobs are this many candidates, of which the response keeps
    /// `n`, the most likely.
    pub(super) best_of: Option<(usize, usize)>,
}

/// How a response's text is read for tool calls.
#[derive(Clone, Debug)]
pub(super) struct ToolParsing {
    pub(super) format: crate::tools::ToolFormat,
    pub(super) names: Vec<String>,
    /// Each tool's parameters as a validator, where they compile: calls whose arguments do not
    /// validate count as `schema_mismatch`.
    pub(super) params: BTreeMap<String, Arc<jsonschema::Validator>>,
    /// End-of-sequence ids, kept out of the text (special tokens are decoded, since some
    /// formats open calls with one).
    pub(super) eos: Vec<i64>,
}

impl Plan {
    pub(super) fn new(c: &Common, jobs: Vec<Job>, chat: bool, logprobs: bool) -> Self {
        Plan {
            token_ids: c.return_tokens_as_token_ids.unwrap_or(false),
            jobs,
            stops: c.stop.as_ref().map(|s| s.strings()).unwrap_or_default(),
            stream: c.stream.unwrap_or(false),
            include_usage: c
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            chat,
            logprobs,
            prompt_logprobs: c.prompt_logprobs.is_some(),
            best_of: None,
            tools: None,
            reasoning: None,
            json_response: c.response_format.as_ref().is_some_and(|f| {
                matches!(
                    f["type"].as_str(),
                    Some("json_object") | Some("json_schema")
                )
            }),
        }
    }
}

/// A count field (`logprobs`, `top_logprobs`, `prompt_logprobs`) checked to lie in `0..=max`.
pub(super) fn count_in(param: &str, v: Option<i64>, max: i64) -> Result<Option<usize>, ApiError> {
    match v {
        Some(k) if !(0..=max).contains(&k) => Err(ApiError::invalid(
            param,
            format!("`{param}` is {k}; expected 0 to {max}"),
        )),
        k => Ok(k.map(|k| k as usize)),
    }
}

pub(super) fn check_range(
    param: &str,
    v: Option<f32>,
    lo: f32,
    hi: f32,
    lo_open: bool,
) -> Result<(), ApiError> {
    if let Some(x) = v {
        let ok = x.is_finite() && x <= hi && if lo_open { x > lo } else { x >= lo };
        if !ok {
            let lo_b = if lo_open { "(" } else { "[" };
            return Err(ApiError::invalid(
                param,
                format!("`{param}` is {x}; expected a value in {lo_b}{lo}, {hi}]"),
            ));
        }
    }
    Ok(())
}

/// Validates the common fields and builds the request for `prompt`.
pub(super) fn request_for(
    l: &Loaded,
    c: &Common,
    prompt: Vec<i64>,
    prompt_param: &str,
    metrics: &Metrics,
) -> Result<Request, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid(prompt_param, "the prompt is empty"));
    }
    if let Some(t) = prompt.iter().find(|&&t| t < 0 || t as usize >= l.vocab) {
        return Err(ApiError::invalid(
            prompt_param,
            format!("token id {t} is outside the vocabulary (0..{})", l.vocab),
        ));
    }
    let room = l.max_model_len.saturating_sub(prompt.len());
    if prompt.len() > l.max_model_len {
        return Err(ApiError::invalid(
            prompt_param,
            format!(
                "the prompt has {} tokens; the model's context is {}",
                prompt.len(),
                l.max_model_len
            ),
        ));
    }
    let (param, max) = match (c.max_completion_tokens, c.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let max_tokens = match max {
        Some(m) if m < 0 => {
            return Err(ApiError::invalid(param, format!("`{param}` is {m}; it must be 0 or more")))
        }
        Some(m) if m as usize > room => {
            return Err(ApiError::invalid(
                param,
                format!(
                    "the prompt ({} tokens) plus `{param}` ({m}) exceeds the model's context of {} tokens",
                    prompt.len(),
                    l.max_model_len
                ),
            ))
        }
        Some(m) => m as usize,
        None => room,
    };
    let min_tokens = match c.min_tokens {
        Some(m) if m < 0 => {
            return Err(ApiError::invalid(
                "min_tokens",
                "`min_tokens` must be 0 or more",
            ))
        }
        Some(m) => (m as usize).min(max_tokens),
        None => 0,
    };
    let top_k = match c.top_k {
        Some(k) if k < -1 => {
            return Err(ApiError::invalid(
                "top_k",
                "`top_k` must be -1, 0 or positive",
            ))
        }
        Some(k) if k > 0 => k as usize,
        _ => 0,
    };
    if let Some(ids) = &c.stop_token_ids {
        if let Some(t) = ids.iter().find(|&&t| t < 0 || t as usize >= l.vocab) {
            return Err(ApiError::invalid(
                "stop_token_ids",
                format!("token id {t} is outside the vocabulary (0..{})", l.vocab),
            ));
        }
    }
    let logit_bias = logit_bias(l, c)?;
    let prompt_logprobs = count_in("prompt_logprobs", c.prompt_logprobs, 20)?;
    let constraint = match super::structured::grammar_spec(c)? {
        Some((spec, param)) => {
            let compiled = l
                .grammars()
                .map_err(|e| {
                    ApiError::invalid(param, format!("structured output is not available: {e}"))
                })?
                .compile(&spec);
            match compiled {
                Ok(c) => Some(c),
                Err(e) => {
                    metrics
                        .structured_output_grammar_rejections
                        .get_or_create(&vec![("kind".into(), spec.kind().into())])
                        .inc();
                    return Err(ApiError::invalid(
                        param,
                        format!("`{param}` cannot be compiled to a grammar: {e}"),
                    ));
                }
            }
        }
        None => None,
    };
    Ok(Request {
        prompt,
        max_tokens,
        min_tokens,
        sampling: SamplingParams {
            temperature: c.temperature.unwrap_or(1.0),
            top_p: c.top_p.unwrap_or(1.0),
            seed: c.seed.map_or_else(rand_seed, |s| s as u64),
            top_k,
            min_p: c.min_p.unwrap_or(0.0),
            repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
            frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
            presence_penalty: c.presence_penalty.unwrap_or(0.0),
            logit_bias,
        },
        stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: c.ignore_eos.unwrap_or(false),
        logprobs: None,
        prompt_logprobs,
        trace: None,
        constraint,
        fork: None,
        embed: None,
    })
}

/// `logit_bias` checked: each key a token id in the vocabulary, each bias in -100..=100.
fn logit_bias(l: &Loaded, c: &Common) -> Result<BTreeMap<u32, f32>, ApiError> {
    let mut out = BTreeMap::new();
    for (key, &bias) in c.logit_bias.iter().flatten() {
        let id = key
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&t| (t as usize) < l.vocab)
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!(
                        "`logit_bias` key `{key}` is not a token id in the vocabulary (0..{})",
                        l.vocab
                    ),
                )
            })?;
        if !(bias.is_finite() && (-100.0..=100.0).contains(&bias)) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` of token {id} is {bias}; expected a value in [-100, 100]"),
            ));
        }
        out.insert(id, bias);
    }
    Ok(out)
}

pub(super) fn rand_seed() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A 404 naming `model` where a request names another model than this server's.
pub(super) fn check_model(app: &App, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != app.model => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "the model `{m}` does not exist; this server serves `{}`",
                app.model
            ),
            param: Some("model".into()),
        }),
        _ => Ok(()),
    }
}

/// Checks the fields every endpoint shares that do not depend on the prompt.
pub(super) fn check_common(app: &App, c: &Common) -> Result<(), ApiError> {
    check_model(app, c.model.as_deref())?;
    check_range("temperature", c.temperature, 0.0, 2.0, false)?;
    check_range("top_p", c.top_p, 0.0, 1.0, true)?;
    check_range("min_p", c.min_p, 0.0, 1.0, false)?;
    check_range("frequency_penalty", c.frequency_penalty, -2.0, 2.0, false)?;
    check_range("presence_penalty", c.presence_penalty, -2.0, 2.0, false)?;
    if let Some(r) = c.repetition_penalty {
        if !(r.is_finite() && r > 0.0) {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("`repetition_penalty` is {r}; it must be above 0"),
            ));
        }
    }
    if c.stream_options.is_some() && c.stream != Some(true) {
        return Err(ApiError::invalid(
            "stream_options",
            "`stream_options` needs `stream: true`",
        ));
    }
    Ok(())
}

pub(super) fn tokenizer(l: &Loaded, param: &str) -> Result<&'static Tokenizer, ApiError> {
    l.tokenizer
        .ok_or_else(|| ApiError::invalid(param, "the artifact has no tokenizer: send token ids"))
}
