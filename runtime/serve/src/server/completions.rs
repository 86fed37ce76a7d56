//! `POST /v1/completions`: prompts (text or token ids, one or many) become one job each.

use super::admission::{choice_count, count_in, fork, request_for, tokenizer, Job, Plan};
use super::choice::ms;
use super::generation::Endpoint;
use super::openai::{ApiError, CompletionRequest, Prompt};
use super::{App, Loaded};
use std::time::Instant;

impl Endpoint for CompletionRequest {
    /// The request's jobs: one per prompt, tokenized where it is text.
    fn plan(self, app: &App, l: &Loaded) -> Result<Plan, ApiError> {
        let req = self;
        let t = Instant::now();
        let prompts: Vec<(Vec<i64>, Option<String>)> = match req.prompt.clone() {
            None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
            Some(Prompt::Text(s)) if s.is_empty() => {
                return Err(ApiError::invalid("prompt", "the prompt is empty"))
            }
            Some(Prompt::Text(s)) => vec![(Vec::new(), Some(s))],
            Some(Prompt::Texts(v)) => v.into_iter().map(|s| (Vec::new(), Some(s))).collect(),
            Some(Prompt::Tokens(ids)) => vec![(ids, None)],
            Some(Prompt::TokenLists(v)) => v.into_iter().map(|ids| (ids, None)).collect(),
        };
        if prompts.is_empty() {
            return Err(ApiError::invalid("prompt", "the prompt list is empty"));
        }
        let logprobs = count_in("logprobs", req.logprobs, 5)?;
        let echo = req.echo.unwrap_or(false);
        let n = choice_count(l, "n", req.common.n)?;
        let best_of = match req.best_of {
            None => n,
            Some(b) => {
                let b = choice_count(l, "best_of", Some(b))?;
                if b < n {
                    return Err(ApiError::invalid(
                        "best_of",
                        format!("`best_of` is {b}, below `n` ({n})"),
                    ));
                }
                if b > n && req.common.stream.unwrap_or(false) {
                    return Err(ApiError::invalid(
                        "best_of",
                        "`best_of` above `n` chooses among finished choices: it cannot be streamed",
                    ));
                }
                b
            }
        };
        let mut jobs = Vec::new();
        for (ids, text) in prompts {
            let ids = match &text {
                Some(s) => {
                    app.metrics
                        .num_input_characters
                        .inc_by(s.chars().count() as u64);
                    let tok = tokenizer(l, "prompt")?;
                    tok.encode(s, true)
                        .map_err(|e| ApiError::invalid("prompt", e.to_string()))?
                        .into_iter()
                        .map(i64::from)
                        .collect()
                }
                None => ids,
            };
            let mut request = request_for(l, &req.common, ids, "prompt", &app.metrics)?;
            request.logprobs = logprobs;
            if let (true, Some(k)) = (echo, logprobs) {
                // The prompt's log-probabilities lead the completion's (OpenAI's `echo`).
                request.prompt_logprobs = Some(request.prompt_logprobs.unwrap_or(0).max(k));
            }
            let echo_text = if echo {
                Some(match text {
                    Some(s) => s,
                    None => match l.tokenizer {
                        Some(t) => {
                            let ids: Vec<u32> = request.prompt.iter().map(|&i| i as u32).collect();
                            t.decode(&ids, false).unwrap_or_default()
                        }
                        None => String::new(),
                    },
                })
            } else {
                None
            };
            if best_of > n {
                // Candidates are ranked by their tokens' log-probabilities.
                request.logprobs = Some(request.logprobs.unwrap_or(0));
            }
            jobs.push(Job::new(request, echo_text));
        }
        let jobs = fork(app, jobs, best_of);
        app.metrics.input_processing_time.observe(ms(t.elapsed()));
        let mut plan = Plan::new(&req.common, jobs, false, logprobs.is_some());
        plan.best_of = (best_of > n).then_some((best_of, n));
        Ok(plan)
    }
}
