//! A multi-turn chat on the engine, independent of the terminal: `graft chat` and
//! `graft generate --chat` drive a [`ChatSession`].
//!
//! Each turn renders the conversation with the model's chat template and sends the
//! whole of it as one request; the engine's prefix cache holds the K/V of everything a
//! turn before computed, so only the new text (and the last token of the previous reply,
//! which was sampled but never run) is computed. The session keeps `seen`, the text the
//! token history stands for: the rendering up to the generation prompt, the reply and the
//! stop token's text; a turn appends only what the template adds to it
//! ([`ChatTemplate::append`]), tokenized on its own, so the history's tokens stay the
//! same from turn to turn. When a template rewrites earlier text (some drop old
//! reasoning), the whole rendering is tokenized again; the cache still serves the part
//! that did not change.
//!
//! Template text is tokenized with special tokens parsed (`<|im_start|>` becomes its id),
//! so a user who types a control token's text gets that token, as in llama.cpp's chat.

use std::io::{BufRead, Write};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::models::runtime::sampling::SamplingParams;
use crate::models::text::chat::{ChatTemplate, Continuation, Message};
use crate::models::text::tokenizer::Tokenizer;

use super::{Engine, Event, FinishReason, Request, Stop};

/// Why a turn's reply ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    /// The model produced a stop token (EOS, end of turn).
    Stop,
    /// The reply reached the per-turn token limit.
    Length,
    /// The context is full: the reply was cut, or (when nothing was computed) the turn
    /// did not fit at all and the conversation is unchanged. `/reset` starts over.
    ContextFull,
}

/// How a turn went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnEnd {
    /// Why the reply ended.
    pub reason: EndReason,
    /// The reply's text.
    pub reply: String,
    /// The reply's token ids (without the stop token).
    pub tokens: Vec<u32>,
    /// Tokens computed for this turn's prompt (the rest came from the prefix cache).
    pub prefilled: usize,
    /// Whether the template rewrote earlier text (the whole rendering was tokenized).
    pub from_scratch: bool,
}

/// A conversation on an engine (see the module documentation).
pub struct ChatSession<'e> {
    engine: &'e mut Engine,
    tok: Arc<Tokenizer>,
    template: ChatTemplate,
    sampling: SamplingParams,
    max_tokens: usize,
    system: Option<String>,
    messages: Vec<Message>,
    /// The tokens of the conversation so far (prompts, replies, stop tokens).
    history: Vec<u32>,
    /// The text `history` stands for.
    seen: String,
    /// Replies and reply tokens generated since the session began (across resets).
    totals: (usize, usize),
}

impl<'e> ChatSession<'e> {
    /// A new conversation on `engine`, opened by `system` when given; replies are
    /// sampled with `sampling` and stop after `max_tokens` tokens (at least 1).
    pub fn new(
        engine: &'e mut Engine,
        mut tok: Tokenizer,
        template: ChatTemplate,
        sampling: SamplingParams,
        max_tokens: usize,
        system: Option<String>,
    ) -> Result<Self> {
        if max_tokens == 0 {
            return Err(Error::model("the per-turn token limit must be at least 1"));
        }
        tok.set_parse_special(true);
        let tok = Arc::new(tok);
        engine.set_detokenizer(tok.clone());
        let mut s = ChatSession {
            engine,
            tok,
            template,
            sampling,
            max_tokens,
            system,
            messages: Vec::new(),
            history: Vec::new(),
            seen: String::new(),
            totals: (0, 0),
        };
        s.reset();
        Ok(s)
    }

    /// The engine.
    pub fn engine(&mut self) -> &mut Engine {
        self.engine
    }

    /// The conversation so far (the system message first, when there is one).
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The text of the conversation's tokens.
    pub fn seen(&self) -> &str {
        &self.seen
    }

    /// The conversation's tokens.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Starts a new conversation (the system message kept).
    pub fn reset(&mut self) {
        self.messages.clear();
        if let Some(s) = &self.system {
            self.messages.push(Message::new("system", s.as_str()));
        }
        self.seen.clear();
        self.history.clear();
    }

    /// One turn: `user` says something, the reply streams to `on_text` piece by piece.
    pub fn turn(&mut self, user: &str, mut on_text: impl FnMut(&str)) -> Result<TurnEnd> {
        let mut messages = self.messages.clone();
        messages.push(Message::new("user", user));
        let (rendered, prompt, from_scratch) = self.prompt(&messages)?;
        let ctx = self.engine.ctx();
        if prompt.len() >= ctx {
            return Ok(TurnEnd {
                reason: EndReason::ContextFull,
                reply: String::new(),
                tokens: Vec::new(),
                prefilled: 0,
                from_scratch: false,
            });
        }
        let mut sampling = self.sampling.clone();
        // a new draw each turn, the same for the same seed and conversation
        sampling.seed = sampling.seed.map(|s| s.wrapping_add(self.totals.0 as u64));
        let req = Request {
            prompt: prompt.clone(),
            sampling,
            max_tokens: Some(self.max_tokens.min(ctx - prompt.len())),
            stop: Stop {
                token_ids: self.tok.stop_ids().to_vec(),
                ..Stop::default()
            },
            logprobs: None,
        };
        let (tokens, finish) = self.run(req, &mut on_text)?;
        let reply = self.tok.decode(&tokens)?;
        self.messages = messages;
        self.seen = rendered;
        self.seen.push_str(&reply);
        self.history = prompt;
        self.history.extend_from_slice(&tokens);
        if let Some(stop) = finish.stop_token {
            self.seen
                .push_str(&self.tok.id_to_token(stop).unwrap_or_default());
            self.history.push(stop);
        }
        self.messages
            .push(Message::new("assistant", reply.as_str()));
        self.totals.0 += 1;
        self.totals.1 += tokens.len();
        let full = self.history.len() >= ctx;
        Ok(TurnEnd {
            reason: match finish.reason {
                FinishReason::Stop => EndReason::Stop,
                FinishReason::Length | FinishReason::Cancelled if full => EndReason::ContextFull,
                FinishReason::Length | FinishReason::Cancelled => EndReason::Length,
            },
            reply,
            tokens,
            prefilled: finish.computed,
            from_scratch,
        })
    }

    /// Runs `req` to its end, streaming its text: the generated ids and how it ended.
    fn run(&mut self, req: Request, on_text: &mut dyn FnMut(&str)) -> Result<(Vec<u32>, Finish)> {
        let id = self.engine.add(req)?;
        let mut tokens = Vec::new();
        loop {
            for ev in self.engine.step()? {
                match ev {
                    Event::Token {
                        id: i, token, text, ..
                    } if i == id => {
                        tokens.push(token);
                        on_text(&text);
                    }
                    Event::Finished {
                        id: i,
                        reason,
                        text,
                        usage,
                        stop_token,
                    } if i == id => {
                        on_text(&text);
                        let computed = usage.prompt_tokens - usage.cached_tokens;
                        return Ok((
                            tokens,
                            Finish {
                                reason,
                                stop_token,
                                computed,
                            },
                        ));
                    }
                    Event::Error { id: i, error } if i == id => return Err(error),
                    Event::Token { .. } | Event::Finished { .. } | Event::Error { .. } => {}
                }
            }
        }
    }

    /// The rendering of `messages` up to the generation prompt, the whole token
    /// sequence of the conversation, and whether the template rewrote earlier text.
    fn prompt(&self, messages: &[Message]) -> Result<(String, Vec<u32>, bool)> {
        if self.seen.is_empty() {
            let full = self.template.render(messages, true)?;
            let ids = self.encode_whole(&full)?;
            return Ok((full, ids, false));
        }
        match self.template.append(&self.seen, messages, true)? {
            Continuation::Suffix(suffix) => {
                let mut ids = self.history.clone();
                ids.extend(self.tok.encode_with(&suffix, false)?);
                Ok((format!("{}{suffix}", self.seen), ids, false))
            }
            Continuation::Diverged(full) => {
                let ids = self.encode_whole(&full)?;
                Ok((full, ids, true))
            }
        }
    }

    /// A whole rendering: the tokenizer's BOS is added unless the template wrote it.
    fn encode_whole(&self, text: &str) -> Result<Vec<u32>> {
        self.template.encode(&self.tok, text)
    }

    /// Replies generated since the session began (across resets), and their tokens.
    pub fn totals(&self) -> (usize, usize) {
        self.totals
    }

    /// The interactive loop: reads one message per line from `input`, streams each reply
    /// to `out`, and takes the commands `/reset` (a new conversation) and `/exit` (or
    /// the end of the input). A full context is said on `out`, with the way out.
    pub fn repl(&mut self, input: &mut dyn BufRead, out: &mut dyn Write) -> Result<()> {
        let io = |e| Error::io("stdout", e);
        let mut line = String::new();
        loop {
            write!(out, "> ").and_then(|()| out.flush()).map_err(io)?;
            line.clear();
            let n = input
                .read_line(&mut line)
                .map_err(|e| Error::io("stdin", e))?;
            if n == 0 {
                writeln!(out).map_err(io)?;
                return Ok(());
            }
            let text = line.trim_end_matches(['\n', '\r']);
            match text.trim() {
                "" => continue,
                "/exit" | "/quit" => return Ok(()),
                "/reset" => {
                    self.reset();
                    writeln!(out, "[new conversation]").map_err(io)?;
                    continue;
                }
                cmd if cmd.starts_with('/') => {
                    writeln!(
                        out,
                        "[unknown command {cmd}: /reset starts over, /exit quits]"
                    )
                    .map_err(io)?;
                    continue;
                }
                _ => {}
            }
            let mut failed = None;
            let end = self.turn(text, |piece| {
                if failed.is_none() {
                    failed = out
                        .write_all(piece.as_bytes())
                        .and_then(|()| out.flush())
                        .err();
                }
            })?;
            if let Some(e) = failed {
                return Err(io(e));
            }
            writeln!(out).map_err(io)?;
            if let Some(note) = self.note(&end) {
                writeln!(out, "{note}").map_err(io)?;
            }
        }
    }

    /// What to tell the user after a turn that did not end normally.
    pub fn note(&self, end: &TurnEnd) -> Option<String> {
        let ctx = self.engine.ctx();
        let used = self.history.len();
        match end.reason {
            EndReason::Stop => None,
            EndReason::Length => Some(format!(
                "[reply cut at the limit of {} tokens per turn (-n)]",
                self.max_tokens
            )),
            EndReason::ContextFull if end.tokens.is_empty() && end.prefilled == 0 => Some(format!(
                "[context full: {used} of {ctx} tokens used and this message does not fit; type /reset to start a new conversation (or use a larger --ctx)]"
            )),
            EndReason::ContextFull => Some(format!(
                "[context full: all {ctx} tokens used, the reply was cut; type /reset to start a new conversation (or use a larger --ctx)]"
            )),
        }
    }
}

/// How a request of a turn ended.
struct Finish {
    reason: FinishReason,
    stop_token: Option<u32>,
    /// Prompt tokens computed (not from the prefix cache).
    computed: usize,
}
