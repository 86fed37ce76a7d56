//! Answers a plan: admission against the queue limit, the jobs submitted to the scheduler, and
//! their events rendered as one JSON response or as server-sent events.

use super::admission::{Awaiting, InFlight, Plan};
use super::choice::{ms, Choice, Delta};
use super::observe::Traced;
use super::openai::ApiError;
use super::Shared;
use crate::metrics::Metrics;
use crate::scheduler::{TokenLogprob, Usage};
use crate::tokenizer::Tokenizer;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;

/// Submits the plan's jobs and answers: one JSON response, or a stream of events.
pub(super) async fn respond(
    app: Shared,
    plan: Result<Plan, ApiError>,
    arrival: Instant,
    awaiting: Awaiting,
    traced: Traced,
) -> Response {
    let plan = match plan {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let l = match app.ready() {
        Ok(l) => l,
        Err(e) => return e.into_response(),
    };
    let n = plan.jobs.len();
    if app.inflight.load(Ordering::Relaxed) + n > l.capacity + app.max_queue {
        return ApiError::status(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "the server's queue is full ({} requests wait); retry later",
                app.max_queue
            ),
        )
        .into_response();
    }
    app.inflight.fetch_add(n, Ordering::Relaxed);
    let guards: Vec<InFlight> = (0..n)
        .map(|_| InFlight(app.clone(), traced.clone()))
        .collect();
    let trace = traced.0.as_ref().map(|s| s.trace);
    let tokenizer = l.tokenizer;
    let id = format!(
        "{}-{:x}",
        if plan.chat { "chatcmpl" } else { "cmpl" },
        app.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Delta, Instant)>();
    for (i, mut job) in plan.jobs.into_iter().enumerate() {
        // A prompt's usage counts once, with its first choice.
        let prompt_tokens = if job.counts_prompt {
            job.request.prompt.len()
        } else {
            0
        };
        job.request.trace = trace;
        let echo_logprobs = job.echo.is_some() && job.request.logprobs.is_some();
        let events = l.sched.submit(job.request);
        let Some(tok) = tokenizer.or_else(empty_tokenizer) else {
            continue;
        };
        let mut choice = Choice::new(
            events,
            tok,
            plan.stops.clone(),
            prompt_tokens,
            job.echo,
            app.metrics.clone(),
            arrival,
            plan.tools.clone(),
            plan.reasoning,
        )
        .with_json_response(plan.json_response)
        .with_echo_logprobs(echo_logprobs);
        let tx = tx.clone();
        let metrics = app.metrics.clone();
        tokio::spawn(async move {
            while let Some(d) = choice.next().await {
                metrics.num_responses_buffered.inc();
                if tx.send((i, d, Instant::now())).is_err() {
                    metrics.num_responses_buffered.dec();
                    return;
                }
            }
        });
    }
    drop(tx);
    drop(awaiting);
    let rx = Responses {
        rx,
        metrics: app.metrics.clone(),
    };
    let ctx = Ctx {
        id,
        model: app.model.clone(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        chat: plan.chat,
        logprobs: plan.logprobs,
        prompt_logprobs: plan.prompt_logprobs,
        best_of: plan.best_of,
        token_ids: plan.token_ids,
        tokenizer,
    };
    if plan.stream {
        stream_response(ctx, rx, n, plan.include_usage, guards)
    } else {
        let r = collect_response(ctx, rx, n).await;
        drop(guards);
        r
    }
}

/// A tokenizer with no vocabulary, for artifacts without one (token ids in, no text out).
pub(super) fn empty_tokenizer() -> Option<&'static Tokenizer> {
    static EMPTY: OnceLock<Option<Tokenizer>> = OnceLock::new();
    EMPTY
        .get_or_init(|| {
            Tokenizer::from_json_str(
                r#"{"version":"1.0","model":{"type":"WordLevel","vocab":{},"unk_token":"<unk>"}}"#,
            )
            .ok()
        })
        .as_ref()
}

pub(super) struct Ctx {
    pub(super) id: String,
    pub(super) model: String,
    pub(super) created: u64,
    pub(super) chat: bool,
    pub(super) logprobs: bool,
    /// Choices carry vLLM's `prompt_logprobs`.
    pub(super) prompt_logprobs: bool,
    /// `best_of` candidates per prompt and the `n` kept of them.
    pub(super) best_of: Option<(usize, usize)>,
    pub(super) token_ids: bool,
    pub(super) tokenizer: Option<&'static Tokenizer>,
}

impl Ctx {
    fn token_text(&self, id: i64) -> String {
        if self.token_ids {
            return format!("token_id:{id}");
        }
        match (self.tokenizer, u32::try_from(id)) {
            (Some(t), Ok(i)) => t.decode(&[i], false).unwrap_or_default(),
            _ => String::new(),
        }
    }

    /// Completions' logprobs object for `lps`, with text offsets from `offset`.
    fn completion_logprobs(&self, lps: &[TokenLogprob], offset: &mut usize) -> Value {
        let mut tokens = Vec::new();
        let mut token_logprobs = Vec::new();
        let mut top = Vec::new();
        let mut offsets = Vec::new();
        for lp in lps {
            let text = self.token_text(lp.token);
            offsets.push(*offset);
            *offset += text.len();
            tokens.push(Value::from(text));
            if lp.logprob.is_nan() {
                token_logprobs.push(Value::Null);
                top.push(Value::Null);
                continue;
            }
            token_logprobs.push(json!(lp.logprob));
            let mut m = serde_json::Map::new();
            for (t, l) in &lp.top {
                m.insert(self.token_text(*t), json!(l));
            }
            top.push(Value::Object(m));
        }
        json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
    }

    /// vLLM's `prompt_logprobs`: per prompt token, `null` for the first, else a map from token
    /// id to `{logprob, rank, decoded_token}` of the token and its most likely alternatives.
    fn prompt_logprobs_json(&self, lps: &[TokenLogprob]) -> Value {
        let entry = |t: i64, l: f32, rank: usize| json!({"logprob": l, "rank": rank, "decoded_token": self.token_text(t)});
        Value::Array(
            lps.iter()
                .map(|lp| {
                    if lp.logprob.is_nan() {
                        return Value::Null;
                    }
                    let mut m = serde_json::Map::new();
                    m.insert(lp.token.to_string(), entry(lp.token, lp.logprob, lp.rank));
                    for (k, (t, l)) in lp.top.iter().enumerate() {
                        m.entry(t.to_string())
                            .or_insert_with(|| entry(*t, *l, k + 1));
                    }
                    Value::Object(m)
                })
                .collect(),
        )
    }

    /// Chat's logprobs entries for `lps`.
    fn chat_logprobs(&self, lps: &[TokenLogprob]) -> Vec<Value> {
        let entry = |t: i64, l: f32| {
            let text = self.token_text(t);
            json!({"token": text, "logprob": l, "bytes": text.as_bytes()})
        };
        lps.iter()
            .map(|lp| {
                let mut e = entry(lp.token, lp.logprob);
                e["top_logprobs"] =
                    Value::Array(lp.top.iter().map(|(t, l)| entry(*t, *l)).collect());
                e
            })
            .collect()
    }
}

pub(super) fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// OpenAI's `tool_calls` of choice `choice`: ids unique in the response; with `indexed`, as a
/// stream delta (each call's `index`).
fn tool_calls_json(
    id: &str,
    choice: usize,
    calls: &[crate::tools::ToolCall],
    indexed: bool,
) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let mut v = json!({
                    "id": format!("call-{id}-{choice}-{k}"),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                });
                if indexed {
                    v["index"] = json!(k);
                }
                v
            })
            .collect(),
    )
}

pub(super) fn add(total: &mut Usage, u: &Usage) {
    total.prompt_tokens += u.prompt_tokens;
    total.completion_tokens += u.completion_tokens;
    total.cached_tokens += u.cached_tokens;
}

/// The deltas of a response's choices, in the order they were produced; receiving one records
/// the response-buffering metrics.
pub(super) struct Responses {
    pub(super) rx: UnboundedReceiver<(usize, Delta, Instant)>,
    pub(super) metrics: Arc<Metrics>,
}

impl Responses {
    async fn recv(&mut self) -> Option<(usize, Delta)> {
        let (i, d, at) = self.rx.recv().await?;
        let m = &self.metrics;
        m.responses_buffered
            .observe(m.num_responses_buffered.get().max(0) as f64);
        m.num_responses_buffered.dec();
        m.response_queue_time.observe(ms(at.elapsed()));
        Some((i, d))
    }
}

impl Drop for Responses {
    fn drop(&mut self) {
        // Deltas never received are no longer buffered for anyone.
        while self.rx.try_recv().is_ok() {
            self.metrics.num_responses_buffered.dec();
        }
    }
}

pub(super) async fn collect_response(ctx: Ctx, mut rx: Responses, n: usize) -> Response {
    #[derive(Default)]
    struct Acc {
        text: String,
        logprobs: Vec<TokenLogprob>,
        prompt_logprobs: Vec<TokenLogprob>,
        finish: Option<&'static str>,
        tool_calls: Vec<crate::tools::ToolCall>,
        reasoning: String,
        /// The generated tokens' log-probabilities: sum and count.
        logprob_sum: f64,
        tokens: usize,
    }
    let mut acc: Vec<Acc> = (0..n).map(|_| Acc::default()).collect();
    let mut total = Usage::default();
    while let Some((i, d)) = rx.recv().await {
        if let Some(e) = d.error {
            return ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e).into_response();
        }
        let a = &mut acc[i];
        a.text.push_str(&d.text);
        a.logprobs.extend(d.logprobs);
        a.prompt_logprobs.extend(d.prompt_logprobs);
        a.tool_calls.extend(d.tool_calls);
        a.reasoning.push_str(&d.reasoning);
        if let Some(l) = d.token_logprob {
            a.logprob_sum += f64::from(l);
            a.tokens += 1;
        }
        if let Some(u) = &d.usage {
            add(&mut total, u);
        }
        if d.finish.is_some() {
            a.finish = d.finish;
        }
    }
    // `best_of`: each prompt's candidates ranked by their tokens' mean log-probability, the
    // first `n` kept and numbered as the prompt's choices.
    let kept: Vec<&Acc> = match ctx.best_of {
        None => acc.iter().collect(),
        Some((b, n)) => acc
            .chunks(b)
            .flat_map(|group| {
                let mean = |a: &Acc| a.logprob_sum / a.tokens.max(1) as f64;
                let mut order: Vec<&Acc> = group.iter().collect();
                order.sort_by(|x, y| mean(y).total_cmp(&mean(x)));
                order.truncate(n);
                order
            })
            .collect(),
    };
    let choices: Vec<Value> = kept
        .into_iter()
        .enumerate()
        .map(|(i, a)| {
            let mut choice = if ctx.chat {
                let lp = ctx
                    .logprobs
                    .then(|| json!({"content": ctx.chat_logprobs(&a.logprobs)}));
                let mut message = json!({"role": "assistant", "content": a.text});
                if !a.reasoning.is_empty() {
                    message["reasoning_content"] = json!(a.reasoning);
                }
                if !a.tool_calls.is_empty() {
                    message["tool_calls"] = tool_calls_json(&ctx.id, i, &a.tool_calls, false);
                    if a.text.is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                json!({
                    "index": i,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": a.finish,
                })
            } else {
                let lp = ctx.logprobs.then(|| {
                    let mut off = 0;
                    ctx.completion_logprobs(&a.logprobs, &mut off)
                });
                json!({"index": i, "text": a.text, "logprobs": lp, "finish_reason": a.finish})
            };
            if ctx.prompt_logprobs {
                choice["prompt_logprobs"] = ctx.prompt_logprobs_json(&a.prompt_logprobs);
            }
            choice
        })
        .collect();
    Json(json!({
        "id": ctx.id,
        "object": if ctx.chat { "chat.completion" } else { "text_completion" },
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage_json(&total),
    }))
    .into_response()
}

pub(super) fn stream_response(
    ctx: Ctx,
    rx: Responses,
    n: usize,
    include_usage: bool,
    guards: Vec<InFlight>,
) -> Response {
    struct St {
        ctx: Ctx,
        rx: Responses,
        started: Vec<bool>,
        offsets: Vec<usize>,
        total: Usage,
        include_usage: bool,
        phase: u8,
        /// Events made ahead (a tool call's arguments after its name).
        pending: std::collections::VecDeque<SseEvent>,
        _guards: Vec<InFlight>,
    }
    let st = St {
        ctx,
        rx,
        started: vec![false; n],
        offsets: vec![0; n],
        total: Usage::default(),
        include_usage,
        phase: 0,
        pending: std::collections::VecDeque::new(),
        _guards: guards,
    };
    let chunk = |ctx: &Ctx, choices: Vec<Value>, usage: Option<Value>| -> SseEvent {
        let mut v = json!({
            "id": ctx.id,
            "object": if ctx.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        SseEvent::default().data(v.to_string())
    };
    let stream = futures_util::stream::unfold(st, move |mut st| async move {
        loop {
            if let Some(ev) = st.pending.pop_front() {
                return Some((Ok(ev), st));
            }
            match st.phase {
                0 => match st.rx.recv().await {
                    Some((i, d)) => {
                        if let Some(e) = d.error {
                            let err = ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e);
                            st.phase = 2;
                            return Some((
                                Ok::<_, std::convert::Infallible>(
                                    SseEvent::default().data(err.body().to_string()),
                                ),
                                st,
                            ));
                        }
                        if let Some(u) = &d.usage {
                            add(&mut st.total, u);
                        }
                        // Nothing new to say (text held back for a stop string, say).
                        if st.started[i]
                            && d.text.is_empty()
                            && d.reasoning.is_empty()
                            && d.finish.is_none()
                            && d.logprobs.is_empty()
                            && d.prompt_logprobs.is_empty()
                        {
                            continue;
                        }
                        let ctx = &st.ctx;
                        let choice = if ctx.chat {
                            let mut delta = json!({});
                            if !st.started[i] {
                                delta["role"] = json!("assistant");
                                st.started[i] = true;
                            }
                            if !d.reasoning.is_empty() {
                                delta["reasoning_content"] = json!(d.reasoning);
                            }
                            if !d.text.is_empty() || (d.finish.is_none() && d.reasoning.is_empty())
                            {
                                delta["content"] = json!(d.text);
                            }
                            if !d.tool_calls.is_empty() {
                                // As OpenAI streams calls: each call's id and name with empty
                                // arguments, then (in a chunk of their own, with the finish)
                                // the arguments.
                                let mut calls = tool_calls_json(&ctx.id, i, &d.tool_calls, true);
                                let args: Vec<Value> = calls
                                    .as_array_mut()
                                    .into_iter()
                                    .flatten()
                                    .map(|c| {
                                        let a = c["function"]["arguments"].take();
                                        c["function"]["arguments"] = json!("");
                                        json!({"index": c["index"], "function": {"arguments": a}})
                                    })
                                    .collect();
                                delta["tool_calls"] = calls;
                                let head = json!({"index": i, "delta": delta, "logprobs": null, "finish_reason": null});
                                let tail = json!({"index": i, "delta": {"tool_calls": args}, "logprobs": null, "finish_reason": d.finish});
                                let ev = chunk(&st.ctx, vec![head], None);
                                st.pending.push_back(chunk(&st.ctx, vec![tail], None));
                                return Some((Ok(ev), st));
                            }
                            let lp = (ctx.logprobs && !d.logprobs.is_empty())
                                .then(|| json!({"content": ctx.chat_logprobs(&d.logprobs)}));
                            json!({"index": i, "delta": delta, "logprobs": lp, "finish_reason": d.finish})
                        } else {
                            st.started[i] = true;
                            let lp = (ctx.logprobs && !d.logprobs.is_empty())
                                .then(|| ctx.completion_logprobs(&d.logprobs, &mut st.offsets[i]));
                            json!({"index": i, "text": d.text, "logprobs": lp, "finish_reason": d.finish})
                        };
                        let mut choice = choice;
                        if ctx.prompt_logprobs && !d.prompt_logprobs.is_empty() {
                            choice["prompt_logprobs"] =
                                ctx.prompt_logprobs_json(&d.prompt_logprobs);
                        }
                        let ev = chunk(&st.ctx, vec![choice], None);
                        return Some((Ok(ev), st));
                    }
                    None => {
                        st.phase = 1;
                        if st.include_usage {
                            let ev = chunk(&st.ctx, vec![], Some(usage_json(&st.total)));
                            return Some((Ok(ev), st));
                        }
                    }
                },
                1 => {
                    st.phase = 3;
                    return Some((Ok(SseEvent::default().data("[DONE]")), st));
                }
                2 => {
                    st.phase = 3;
                    return Some((Ok(SseEvent::default().data("[DONE]")), st));
                }
                _ => return None,
            }
        }
    });
    let mut headers = HeaderMap::new();
    headers.insert("cache-control", HeaderValue::from_static("no-cache"));
    (headers, Sse::new(stream)).into_response()
}
