//! One request's answer, built from the engine's events: the whole response
//! ([`Answer::response`]) or its stream chunks ([`Answer::token_chunk`],
//! [`Answer::end_chunks`]). Both are made from the same texts in the same order, so a
//! streamed answer is the non-streamed one cut into pieces. The answer also keeps the
//! request's timings (time to first token, per output token) and token counts for
//! `/metrics` and the request log.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::engine::{FinishReason, TokenLogprobs, Usage};

use super::metrics::Metrics;
use super::wire::{
    AssistantMessage, ChatChoice, ChatLogprobs, ChunkChoice, CompletionChoice, CompletionLogprobs,
    Delta, Endpoint, Envelope, TokenLogprob, TopLogprob, UsageBody,
};
use super::{ServedModel, TokenLog};

/// The answer to one request.
pub struct Answer {
    endpoint: Endpoint,
    /// `chatcmpl-…` / `cmpl-…`.
    id: String,
    created: u64,
    model: Arc<ServedModel>,
    metrics: Arc<Metrics>,
    log: TokenLog,
    include_usage: bool,
    arrived: Instant,
    first_token: Option<Instant>,
    /// The text so far (non-streamed answers).
    pub text: String,
    /// Log-probabilities so far (non-streamed answers), when asked for.
    logprobs: Option<Vec<(u32, TokenLogprobs)>>,
    /// Characters of the token pieces so far (completions' `text_offset`).
    offset: usize,
}

/// How a request ended.
pub struct End {
    pub reason: FinishReason,
    pub usage: Usage,
}

impl Answer {
    /// A new answer to a request that arrived at `arrived`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        endpoint: Endpoint,
        model: Arc<ServedModel>,
        metrics: Arc<Metrics>,
        log: TokenLog,
        logprobs: bool,
        include_usage: bool,
        arrived: Instant,
    ) -> Answer {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        Answer {
            endpoint,
            id: format!("{prefix}-{:032x}", rand::random::<u128>()),
            created: unix_now(),
            model,
            metrics,
            log,
            include_usage,
            arrived,
            first_token: None,
            text: String::new(),
            logprobs: logprobs.then(Vec::new),
            offset: 0,
        }
    }

    /// Takes a generated token (its first observes the time to first token).
    pub fn token(&mut self) {
        if self.first_token.is_none() {
            let now = Instant::now();
            self.metrics
                .ttft
                .observe(now.duration_since(self.arrived).as_secs_f64());
            self.first_token = Some(now);
        }
    }

    /// Takes the end: counts the tokens and the time per output token.
    pub fn finish(&mut self, usage: Usage) {
        self.metrics
            .prompt_tokens
            .inc_by(usage.prompt_tokens as u64);
        if let (Some(first), n @ 2..) = (self.first_token, usage.completion_tokens) {
            let per = first.elapsed().as_secs_f64() / (n - 1) as f64;
            self.metrics.tpot.observe(per);
        }
        self.log.set(usage.prompt_tokens, usage.completion_tokens);
    }

    /// Keeps a token's text and log-probabilities for the whole response.
    pub fn keep(&mut self, text: &str, token: u32, lp: Option<TokenLogprobs>) {
        self.text.push_str(text);
        if let (Some(all), Some(lp)) = (&mut self.logprobs, lp) {
            all.push((token, lp));
        }
    }

    /// Whether log-probabilities were asked for.
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs.is_some()
    }

    /// The text of token `id` alone.
    fn piece(&self, id: u32) -> String {
        self.model.tokenizer.decode(&[id]).unwrap_or_default()
    }

    fn chat_logprobs(&self, items: &[(u32, TokenLogprobs)]) -> ChatLogprobs {
        let top = |&(id, lp): &(u32, f32)| {
            let token = self.piece(id);
            TopLogprob {
                bytes: token.as_bytes().to_vec(),
                token,
                logprob: lp,
            }
        };
        ChatLogprobs {
            content: items
                .iter()
                .map(|(id, lp)| {
                    let token = self.piece(*id);
                    TokenLogprob {
                        bytes: token.as_bytes().to_vec(),
                        token,
                        logprob: lp.logprob,
                        top_logprobs: lp.top.iter().map(top).collect(),
                    }
                })
                .collect(),
        }
    }

    fn completion_logprobs(&mut self, items: &[(u32, TokenLogprobs)]) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for (id, lp) in items {
            let token = self.piece(*id);
            out.text_offset.push(self.offset);
            self.offset += token.chars().count();
            out.tokens.push(token);
            out.token_logprobs.push(lp.logprob);
            let top: BTreeMap<String, f32> =
                lp.top.iter().map(|&(t, l)| (self.piece(t), l)).collect();
            out.top_logprobs.push(top);
        }
        out
    }

    /// The whole response (non-streamed).
    pub fn response(&mut self, end: &End) -> String {
        let items = self.logprobs.take();
        let usage = Some(Some(UsageBody::from(end.usage)));
        let reason = end.reason.as_str();
        let text = std::mem::take(&mut self.text);
        match self.endpoint {
            Endpoint::Chat => {
                let choice = ChatChoice {
                    index: 0,
                    message: AssistantMessage {
                        role: "assistant",
                        content: text,
                    },
                    logprobs: items.as_deref().map(|i| self.chat_logprobs(i)),
                    finish_reason: reason,
                };
                self.envelope("chat.completion", vec![choice], usage)
            }
            Endpoint::Completions => {
                let choice = CompletionChoice {
                    text,
                    index: 0,
                    logprobs: items.as_deref().map(|i| self.completion_logprobs(i)),
                    finish_reason: Some(reason),
                };
                self.envelope("text_completion", vec![choice], usage)
            }
        }
    }

    /// The `usage` field of a chunk that is not the last.
    fn chunk_usage(&self) -> Option<Option<UsageBody>> {
        self.include_usage.then_some(None)
    }

    /// The `object` of the endpoint's stream chunks.
    fn chunk_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        }
    }

    /// A body of `object` with `choices` and `usage`, as JSON.
    fn envelope<C: Serialize>(
        &self,
        object: &'static str,
        choices: Vec<C>,
        usage: Option<Option<UsageBody>>,
    ) -> String {
        let body = Envelope {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model.id,
            choices,
            usage,
        };
        serde_json::to_string(&body).unwrap_or_default()
    }

    /// A chat chunk with `delta`, `logprobs` and `finish_reason`.
    fn chat_chunk(
        &self,
        delta: Delta,
        logprobs: Option<ChatLogprobs>,
        finish: Option<&'static str>,
    ) -> String {
        let choice = ChunkChoice {
            index: 0,
            delta,
            logprobs,
            finish_reason: finish,
        };
        self.envelope(self.chunk_object(), vec![choice], self.chunk_usage())
    }

    /// A completion chunk with `text`, `logprobs` and `finish_reason`.
    fn completion_chunk(
        &self,
        text: String,
        logprobs: Option<CompletionLogprobs>,
        finish: Option<&'static str>,
    ) -> String {
        let choice = CompletionChoice {
            text,
            index: 0,
            logprobs,
            finish_reason: finish,
        };
        self.envelope(self.chunk_object(), vec![choice], self.chunk_usage())
    }

    /// The chunk that opens a stream (chat: the assistant's role), if the endpoint has one.
    pub fn first_chunk(&self) -> Option<String> {
        match self.endpoint {
            Endpoint::Chat => Some(self.chat_chunk(
                Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                },
                None,
                None,
            )),
            Endpoint::Completions => None,
        }
    }

    /// The chunk of one token's text (and log-probabilities), or `None` when it adds
    /// nothing to send.
    pub fn token_chunk(
        &mut self,
        text: String,
        token: u32,
        lp: Option<TokenLogprobs>,
    ) -> Option<String> {
        let lp = lp.filter(|_| self.wants_logprobs());
        if text.is_empty() && lp.is_none() {
            return None;
        }
        let items: Vec<(u32, TokenLogprobs)> = lp.map(|lp| (token, lp)).into_iter().collect();
        Some(match self.endpoint {
            Endpoint::Chat => {
                let logprobs = (!items.is_empty()).then(|| self.chat_logprobs(&items));
                let delta = Delta {
                    role: None,
                    content: Some(text),
                };
                self.chat_chunk(delta, logprobs, None)
            }
            Endpoint::Completions => {
                let logprobs = (!items.is_empty()).then(|| self.completion_logprobs(&items));
                self.completion_chunk(text, logprobs, None)
            }
        })
    }

    /// The chunks that close a stream: the text held back to the end, the finish reason,
    /// and the usage when asked for.
    pub fn end_chunks(&mut self, held: String, end: &End) -> Vec<String> {
        let mut out = Vec::new();
        if !held.is_empty() {
            out.extend(self.token_chunk(held, 0, None));
        }
        let reason = Some(end.reason.as_str());
        out.push(match self.endpoint {
            Endpoint::Chat => self.chat_chunk(Delta::default(), None, reason),
            Endpoint::Completions => self.completion_chunk(String::new(), None, reason),
        });
        if self.include_usage {
            let usage = Some(Some(UsageBody::from(end.usage)));
            out.push(self.envelope(self.chunk_object(), Vec::<ChunkChoice>::new(), usage));
        }
        out
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
