//! One choice of a response: a request's scheduler events turned into text pieces, with stop
//! strings cut (never emitted) and log-probabilities, as deltas a response or a stream is built
//! from.

use crate::metrics::Metrics;
use crate::scheduler::{Event, TokenLogprob, Usage};
use crate::tokenizer::{DecodeStream, Tokenizer};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

/// What a choice adds to the response at one event.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Delta {
    /// New text (possibly empty).
    pub text: String,
    /// Log-probabilities of the tokens behind the text (prompt tokens first, with `echo`).
    pub logprobs: Vec<TokenLogprob>,
    /// The prompt tokens' log-probabilities (vLLM's `prompt_logprobs`), in the delta that
    /// brings them.
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// `stop` or `length` when the choice ended.
    pub finish: Option<&'static str>,
    /// The token counts, when the choice ended.
    pub usage: Option<Usage>,
    /// An error that ended the choice.
    pub error: Option<String>,
    /// The tool calls the choice ended with (its finish is then `tool_calls`).
    pub tool_calls: Vec<crate::tools::ToolCall>,
    /// New text of the answer's thinking section (`reasoning_content`).
    pub reasoning: String,
    /// The log-probability of the token behind this delta, where it brings a generated token
    /// and log-probabilities are computed (`best_of` ranks choices by them).
    pub token_logprob: Option<f32>,
}

/// A choice's text read for tool calls: held back while it may still be a call.
struct ToolHold {
    parsing: super::admission::ToolParsing,
    held: String,
    holding: bool,
}

/// Text produced so far, holding back the bytes that could begin a stop string.
struct TextState {
    stops: Vec<String>,
    hold: usize,
    text: String,
    sent: usize,
}

impl TextState {
    fn new(stops: Vec<String>) -> Self {
        let hold = stops.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
        TextState {
            stops,
            hold,
            text: String::new(),
            sent: 0,
        }
    }

    /// Adds `piece`; returns the text safe to send and whether a stop string ended the text.
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.text.push_str(piece);
        let found = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[self.sent..]
                    .find(s.as_str())
                    .map(|i| self.sent + i)
            })
            .min();
        if let Some(at) = found {
            self.text.truncate(at);
            return (self.flush(), true);
        }
        let mut safe = self.text.len().saturating_sub(self.hold).max(self.sent);
        while !self.text.is_char_boundary(safe) {
            safe -= 1;
        }
        let out = self.text[self.sent..safe].to_string();
        self.sent = safe;
        (out, false)
    }

    fn flush(&mut self) -> String {
        let out = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        out
    }
}

/// One request's progress toward its choice.
pub struct Choice {
    events: Option<UnboundedReceiver<Event>>,
    decode: DecodeStream<'static>,
    text: TextState,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    /// Text to put first (`echo`), sent with the first delta.
    echo: Option<String>,
    done: bool,
    metrics: Arc<Metrics>,
    arrival: Instant,
    last_token: Option<Instant>,
    first_token: Option<Instant>,
    tools: Option<ToolHold>,
    reasoning: Option<crate::reasoning::ReasoningSplit>,
    /// Whether the answer must be JSON (`response_format`): checked when it ends.
    json_response: bool,
    /// Whether the prompt's log-probabilities lead the answer's (`echo` with `logprobs`).
    echo_logprobs: bool,
}

impl Choice {
    /// A choice fed by `events`, decoding with `tokenizer`, cutting at `stops`; where
    /// `tools` says how, its text is read for tool calls.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        events: UnboundedReceiver<Event>,
        tokenizer: &'static Tokenizer,
        stops: Vec<String>,
        prompt_tokens: usize,
        echo: Option<String>,
        metrics: Arc<Metrics>,
        arrival: Instant,
        tools: Option<super::admission::ToolParsing>,
        reasoning: Option<bool>,
    ) -> Self {
        Choice {
            events: Some(events),
            // Some formats open a call with a special token: read them all where tools may
            // be called (end-of-sequence ids are kept out below).
            decode: tokenizer.decode_stream(tools.is_none()),
            text: TextState::new(stops),
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
            echo,
            done: false,
            metrics,
            arrival,
            last_token: None,
            first_token: None,
            tools: tools.map(|parsing| ToolHold {
                parsing,
                held: String::new(),
                holding: true,
            }),
            reasoning: reasoning.map(crate::reasoning::ReasoningSplit::new),
            json_response: false,
            echo_logprobs: false,
        }
    }

    /// The choice with the prompt's log-probabilities leading the answer's where `on`.
    pub(super) fn with_echo_logprobs(mut self, on: bool) -> Self {
        self.echo_logprobs = on;
        self
    }

    /// The next delta, `None` once the choice has ended.
    pub async fn next(&mut self) -> Option<Delta> {
        if self.done {
            return None;
        }
        let mut delta = Delta {
            text: self.echo.take().unwrap_or_default(),
            ..Default::default()
        };
        let event = match self.events.as_mut() {
            Some(rx) => rx.recv().await,
            None => None,
        };
        let Some(event) = event else {
            self.done = true;
            delta.error = Some("the scheduler dropped the request".into());
            return Some(delta);
        };
        match event {
            Event::Admitted { cached_tokens } => self.cached_tokens = cached_tokens,
            Event::PromptLogprobs(lp) => {
                if self.echo_logprobs {
                    delta.logprobs = lp.clone();
                }
                delta.prompt_logprobs = lp;
            }
            // Embeddings are answered by their own endpoint.
            Event::Embedding(_) => {}
            Event::Token { id, logprob } => {
                let now = Instant::now();
                match self.last_token {
                    None => {
                        self.first_token = Some(now);
                        self.metrics
                            .time_to_first_token
                            .observe(ms(now - self.arrival));
                    }
                    Some(last) => self.metrics.itl.observe(ms(now - last)),
                }
                self.last_token = Some(now);
                self.completion_tokens += 1;
                delta.token_logprob = logprob.as_ref().map(|l| l.logprob);
                delta.logprobs.extend(logprob);
                let t = Instant::now();
                let eos = self
                    .tools
                    .as_ref()
                    .is_some_and(|t| t.parsing.eos.contains(&id));
                let piece = match u32::try_from(id)
                    .ok()
                    .filter(|_| !eos)
                    .map(|i| self.decode.push(i))
                {
                    Some(Ok(Some(p))) => p,
                    _ => String::new(),
                };
                let (text, stopped) = self.text.push(&piece);
                self.metrics.output_processing_time.observe(ms(t.elapsed()));
                delta.text.push_str(&text);
                if stopped {
                    // Cancels the request in the scheduler.
                    self.events = None;
                    self.finish(&mut delta, "stop");
                }
            }
            Event::Finished { reason, usage } => {
                if let Ok(Some(rest)) = self.decode.flush() {
                    let (text, _) = self.text.push(&rest);
                    delta.text.push_str(&text);
                }
                delta.text.push_str(&self.text.flush());
                self.cached_tokens = usage.cached_tokens;
                self.finish(&mut delta, reason.as_str());
            }
            Event::Error(e) => {
                self.done = true;
                delta.error = Some(e);
            }
        }
        self.split_reasoning(&mut delta);
        self.read_tool_calls(&mut delta);
        Some(delta)
    }

    /// Checks the answer against its JSON `response_format` when it ends.
    pub(super) fn with_json_response(mut self, on: bool) -> Self {
        self.json_response = on;
        self
    }

    /// Counts an answer that does not conform to its JSON `response_format` in
    /// `maxserve_response_format_conformance_errors_total{outcome}`: `truncated` where it
    /// ended at `max_tokens` before the JSON was complete, `invalid_json` where it ended and
    /// does not parse (a stop string cut it, say).
    fn check_json(&self, finish: &str) {
        if !self.json_response {
            return;
        }
        let text = &self.text.text;
        let outcome = if serde_json::from_str::<serde_json::Value>(text).is_ok() {
            return;
        } else if finish == "length" {
            "truncated"
        } else {
            "invalid_json"
        };
        self.metrics
            .response_format_conformance_errors
            .get_or_create(&vec![("outcome".into(), outcome.into())])
            .inc();
    }

    /// Moves the text of the answer's thinking section to `reasoning`.
    fn split_reasoning(&mut self, delta: &mut Delta) {
        let Some(r) = self.reasoning.as_mut() else {
            return;
        };
        let mut split = r.push(&std::mem::take(&mut delta.text));
        if delta.finish.is_some() || delta.error.is_some() {
            let rest = r.finish();
            split.reasoning.push_str(&rest.reasoning);
            split.content.push_str(&rest.content);
        }
        delta.reasoning = split.reasoning;
        delta.text = split.content;
    }

    /// Holds the text back while it may still be a tool call; at the end, turns it into the
    /// calls it holds (counting text that opened a call but is none, or calls a tool not
    /// listed, in `maxserve_tool_call_conformance_errors_total`).
    fn read_tool_calls(&mut self, delta: &mut Delta) {
        let Some(t) = self.tools.as_mut() else {
            return;
        };
        if !t.holding {
            return;
        }
        t.held.push_str(&delta.text);
        delta.text.clear();
        let format = t.parsing.format;
        if delta.finish.is_none() && delta.error.is_none() {
            if !format.may_open_call(&t.held) {
                t.holding = false;
                delta.text = std::mem::take(&mut t.held);
            }
            return;
        }
        t.holding = false;
        let held = std::mem::take(&mut t.held);
        let parsed = format.parse(&held);
        let count = |outcome: &str| {
            self.metrics
                .tool_call_conformance_errors
                .get_or_create(&vec![("outcome".into(), outcome.into())])
                .inc();
        };
        if parsed.calls.is_empty() {
            if !held.trim().is_empty() {
                count("invalid_json");
            }
            delta.text = held;
            return;
        }
        if parsed
            .calls
            .iter()
            .any(|c| !t.parsing.names.contains(&c.name))
        {
            count("unknown_tool");
        } else if parsed.calls.iter().any(|c| {
            let args = serde_json::from_str::<serde_json::Value>(&c.arguments);
            match (t.parsing.params.get(&c.name), args) {
                (Some(v), Ok(args)) => !v.is_valid(&args),
                (Some(_), Err(_)) => true,
                (None, _) => false,
            }
        }) {
            count("schema_mismatch");
        }
        delta.text = parsed.content;
        delta.tool_calls = parsed.calls;
        if delta.finish == Some("stop") {
            delta.finish = Some("tool_calls");
        }
    }

    fn finish(&mut self, delta: &mut Delta, reason: &'static str) {
        self.done = true;
        delta.finish = Some(reason);
        self.check_json(reason);
        // A choice that does not count the prompt (n > 1) does not count its cached part.
        let usage = Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens: if self.prompt_tokens == 0 {
                0
            } else {
                self.cached_tokens
            },
        };
        delta.usage = Some(usage);
        let m = &self.metrics;
        m.num_input_tokens.inc_by(usage.prompt_tokens as u64);
        m.num_output_tokens.inc_by(usage.completion_tokens as u64);
        m.input_tokens_per_request
            .observe(usage.prompt_tokens as f64);
        m.output_tokens_per_request
            .observe(usage.completion_tokens as f64);
        if let (Some(first), Some(last)) = (self.first_token, self.last_token) {
            if usage.completion_tokens > 1 {
                m.time_per_output_token
                    .observe(ms(last - first) / (usage.completion_tokens - 1) as f64);
            }
        }
    }
}

/// Milliseconds of `d`.
pub fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::TextState;

    #[test]
    fn stop_strings_are_cut_and_never_sent() {
        let mut t = TextState::new(vec!["\n\n".into(), "END".into()]);
        let mut sent = String::new();
        for piece in ["Hello", " wor", "ld", "\n", "\nmore"] {
            let (s, stop) = t.push(piece);
            sent.push_str(&s);
            if stop {
                break;
            }
        }
        assert_eq!(sent, "Hello world");
        let mut t = TextState::new(vec!["END".into()]);
        let (a, _) = t.push("abcE");
        let (b, _) = t.push("N");
        let (c, stop) = t.push("Dx");
        assert_eq!(
            (a.as_str(), b.as_str(), c.as_str(), stop),
            ("ab", "c", "", true)
        );
        let mut t = TextState::new(vec![]);
        assert_eq!(t.push("é").0, "é");
    }
}
