//! What goes into the engine and what comes out: a [`Request`] (prompt tokens, sampling
//! settings, stop conditions), the [`Event`]s a step reports for it, and the engine's
//! counters ([`EngineStats`]).

use crate::error::Error;
use crate::models::runtime::sampling::SamplingParams;

/// A request's handle, unique for the engine's lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request {}", self.0)
    }
}

/// When a request's generation ends, besides its token limit.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stop {
    /// Token ids that end generation (besides the model's end-of-sequence tokens); the
    /// stop token itself is not part of the output.
    pub token_ids: Vec<u32>,
    /// Texts that end generation when the output text contains one; the text from the
    /// stop string on is never emitted, also when it spans several tokens.
    pub strings: Vec<String>,
    /// Go on past the model's end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// At the end of the context, keep its last half (computed again) and go on, so
    /// that a generation may be longer than the context (llama.cpp's context shift);
    /// without it the end of the context finishes the request.
    pub context_shift: bool,
}

/// One generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// How to pick each token.
    pub sampling: SamplingParams,
    /// The most tokens to generate (`None`: up to the context).
    pub max_tokens: Option<usize>,
    /// When to stop before that.
    pub stop: Stop,
    /// Report the log-probability of each generated token and of this many most likely
    /// alternatives (`None`: no log-probabilities).
    pub logprobs: Option<usize>,
}

impl Request {
    /// A request for up to `max_tokens` tokens after `prompt`, greedy, no extra stop
    /// condition.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
        Request {
            prompt,
            sampling: SamplingParams::greedy(),
            max_tokens: Some(max_tokens),
            stop: Stop::default(),
            logprobs: None,
        }
    }
}

/// Why a request finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token or a stop string.
    Stop,
    /// Its token limit, or the end of the context.
    Length,
    /// Cancelled by the caller.
    Cancelled,
}

impl FinishReason {
    /// The OpenAI API's name of the reason (`stop`, `length`, `cancelled`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache (not computed).
    pub cached_tokens: usize,
    /// Generated tokens (a stop token not included).
    pub completion_tokens: usize,
}

/// The log-probability of a generated token and of the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The generated token's log-probability (under the model's distribution, before
    /// sampling filters and temperature).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What a step reports about one request.
#[derive(Debug)]
pub enum Event {
    /// A generated token and the text it completes (empty while a UTF-8 sequence or a
    /// possible stop string is still open; text held back for a stop string that did
    /// not come is emitted with a later token or at the end).
    Token {
        /// The request.
        id: RequestId,
        /// The token.
        token: u32,
        /// The new text.
        text: String,
        /// Its log-probabilities, when the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    /// The request finished; `text` is what was still held back (emitted now).
    Finished {
        /// The request.
        id: RequestId,
        /// Why.
        reason: FinishReason,
        /// Text held back until the end.
        text: String,
        /// Its token counts.
        usage: Usage,
        /// The stop or end-of-sequence token that ended it, if one did (not part of the
        /// output).
        stop_token: Option<u32>,
    },
    /// The request failed; nothing else was disturbed.
    Error {
        /// The request.
        id: RequestId,
        /// What went wrong.
        error: Error,
    },
}

impl Event {
    /// The request the event is about.
    pub fn id(&self) -> RequestId {
        match self {
            Event::Token { id, .. } | Event::Finished { id, .. } | Event::Error { id, .. } => *id,
        }
    }
}

/// The engine's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Sequences being computed.
    pub running: usize,
    /// Requests waiting for room (including preempted ones).
    pub waiting: usize,
    /// KV blocks held by sequences.
    pub blocks_used: usize,
    /// KV blocks that can be handed out (free, or cached and unheld).
    pub blocks_free: usize,
    /// Unheld blocks that keep known tokens.
    pub blocks_cached: usize,
    /// Prompt tokens served from the prefix cache so far.
    pub prefix_hit_tokens: u64,
    /// Prompt tokens looked up in the prefix cache so far.
    pub prefix_lookup_tokens: u64,
    /// Sequences preempted (their blocks freed, recomputed later) so far.
    pub preemptions: u64,
    /// Steps run so far.
    pub steps: u64,
    /// Tokens drawn from the device's top candidates of their row so far.
    pub sampled_from_candidates: u64,
    /// Tokens drawn from a whole row of logits read back so far.
    pub sampled_from_rows: u64,
}
