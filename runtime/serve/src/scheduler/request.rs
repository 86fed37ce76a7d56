//! What the scheduler takes (a request: prompt tokens, limits, sampling) and what it gives back
//! (a stream of events: tokens, then one finish or error).

use maxc_runtime::sampling::SamplingParams;

/// One generation request, in tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The prompt (never empty).
    pub prompt: Vec<i64>,
    /// Tokens to generate at most (0: score the prompt only).
    pub max_tokens: usize,
    /// Tokens generated before an end-of-sequence or stop token may end the request.
    pub min_tokens: usize,
    /// How tokens are chosen.
    pub sampling: SamplingParams,
    /// Tokens that end the request (besides the model's end-of-sequence tokens).
    pub stop_token_ids: Vec<i64>,
    /// Do not stop at the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Alternatives to report with each generated token's log-probability (`None`: no
    /// log-probabilities).
    pub logprobs: Option<usize>,
    /// Score the prompt: report each prompt token's log-probability with this many
    /// alternatives (the step returns logits for every prompt row, in chunks of the rows it has
    /// room for; the prompt is computed whole, no cached prefix).
    pub prompt_logprobs: Option<usize>,
    /// Its place in a trace, where it is traced (the server's level, or its
    /// `x-max-trace-level` header).
    pub trace: Option<crate::trace::RequestTrace>,
    /// The grammar its output must match (structured outputs), compiled; it ends the request
    /// once the output is complete.
    pub constraint: Option<crate::constraint::Constraint>,
    /// One of several choices of one prompt (`n > 1`): the choices after the group's leader
    /// wait until its prefill is done, then start from its prompt pages.
    pub fork: Option<Fork>,
    /// Pool the prompt's final hidden states into an embedding (sent as
    /// [`Event::Embedding`] before the request finishes; `max_tokens` is then 0).
    pub embed: Option<Pooling>,
}

/// How an embedding pools the prompt's final hidden states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The last token's.
    Last,
    /// Every token's mean (the prompt is computed whole, without the prefix cache).
    Mean,
}

/// A request's place among the choices of one prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fork {
    /// The group: every choice of the prompt has the same, unique among requests.
    pub group: u64,
    /// Whether this is the choice that prefills the prompt (submitted first).
    pub leader: bool,
}

impl Request {
    /// A greedy request for `max_tokens` tokens after `prompt`.
    pub fn greedy(prompt: Vec<i64>, max_tokens: usize) -> Self {
        Request {
            prompt,
            max_tokens,
            min_tokens: 0,
            sampling: SamplingParams::default(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            trace: None,
            constraint: None,
            fork: None,
            embed: None,
        }
    }
}

/// A token's log-probability and the most likely alternatives at its position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub token: i64,
    /// Its log-probability under the model (before sampling adjustments).
    pub logprob: f32,
    /// The most likely tokens at this position with theirs, most likely first.
    pub top: Vec<(i64, f32)>,
    /// Its rank in the vocabulary: 1 plus the tokens more likely than it (0 where it has no
    /// log-probability, as the first prompt token).
    pub rank: usize,
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token (OpenAI's `stop`).
    Stop,
    /// `max_tokens`, or the artifact's `max_seq_len` (OpenAI's `length`).
    Length,
}

impl FinishReason {
    /// OpenAI's name.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

/// What the scheduler reports of a request, in order: `Admitted`, the prompt's
/// log-probabilities (where asked), tokens, then exactly one `Finished` or `Error` (an `Error`
/// may also come alone).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The request got its first step; this many prompt tokens came from the prefix cache.
    Admitted {
        /// Prompt tokens served from the prefix cache.
        cached_tokens: usize,
    },
    /// The prompt tokens with their log-probabilities (the first token's is NaN: nothing
    /// predicts it).
    PromptLogprobs(Vec<TokenLogprob>),
    /// A generated token, with its log-probability where asked.
    Token {
        /// The token.
        id: i64,
        /// Its log-probability and alternatives.
        logprob: Option<TokenLogprob>,
    },
    /// The request ended.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// The prompt's embedding: its final hidden states pooled and normalized to length 1.
    Embedding(Vec<f32>),
    /// The request failed; the message says why.
    Error(String),
}

/// Where a request's events go: an unbounded channel whose receiver the client holds. A closed
/// receiver cancels the request.
pub type EventSender = tokio::sync::mpsc::UnboundedSender<Event>;
