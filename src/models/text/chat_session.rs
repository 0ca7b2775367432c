//! A multi-turn chat that keeps the conversation in the model's KV cache, independent of
//! the model (anything that implements [`ChatModel`]) and of the terminal: `graft chat`
//! and `graft generate --chat` drive a [`ChatSession`].
//!
//! Each turn renders the whole conversation with the model's chat template, but only
//! the text it adds to what the cache already holds is tokenized and prefilled
//! ([`ChatTemplate::append`]). The session keeps `seen`, the text the cache stands for:
//! the rendering up to the generation prompt, the reply, and the stop token's text. The
//! last sampled token (the stop token, or the reply's last token at the length limit) is
//! never run through the model during its turn; it is *pending* and goes in front of the
//! next turn's prefill, so no forward pass is spent on it twice. When a template rewrites
//! earlier text (some drop old reasoning), the whole rendering is prefilled from an empty
//! cache instead.
//!
//! Template text is tokenized with special tokens parsed (`<|im_start|>` becomes its id),
//! so a user who types a control token's text gets that token, as in llama.cpp's chat.

use std::io::{BufRead, Write};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::models::runtime::model::Model;
use crate::models::runtime::output::{Logits, Output};
use crate::models::runtime::sampling::SamplerChain;
use crate::models::text::chat::{ChatTemplate, Continuation, Message};
use crate::models::text::tokenizer::Tokenizer;

/// What a chat needs from a model: a KV cache that grows with each forward pass.
pub trait ChatModel {
    /// Positions the KV cache holds.
    fn n_past(&self) -> usize;
    /// Positions the KV cache can hold.
    fn ctx(&self) -> usize;
    /// Forgets every cached position.
    fn reset(&mut self);
    /// Runs `tokens` at positions `n_past..`, appending them to the cache.
    fn prefill(&mut self, tokens: &[u32], logits: Logits) -> Result<Output>;
    /// Runs one token at position `n_past`.
    fn decode(&mut self, token: u32, logits: bool) -> Result<Output>;
    /// Whether the model's own configuration ends generation at `token` (besides the
    /// tokenizer's stop ids).
    fn is_eos(&self, token: u32) -> bool;
}

/// A [`Model`] with the backend it lives on.
pub struct LlamaOn<'a> {
    /// The model.
    pub model: &'a mut Model,
    /// Its backend.
    pub be: &'a mut dyn Backend,
}

impl ChatModel for LlamaOn<'_> {
    fn n_past(&self) -> usize {
        self.model.n_past()
    }

    fn ctx(&self) -> usize {
        self.model.cache().ctx
    }

    fn reset(&mut self) {
        self.model.reset();
    }

    fn prefill(&mut self, tokens: &[u32], logits: Logits) -> Result<Output> {
        self.model.prefill(self.be, tokens, logits)
    }

    fn decode(&mut self, token: u32, logits: bool) -> Result<Output> {
        self.model.decode_step(self.be, token, logits)
    }

    fn is_eos(&self, token: u32) -> bool {
        self.model.config().is_eos(token)
    }
}

/// Why a turn's reply ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    /// The model produced a stop token (EOS, end of turn).
    Stop,
    /// The reply reached the per-turn token limit.
    Length,
    /// The context is full: the reply was cut, or (when nothing was prefilled) the turn
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
    /// Tokens prefilled for this turn: the previous turn's pending token and the new
    /// text, or the whole conversation when it was prefilled from scratch.
    pub prefilled: usize,
    /// Whether the cache was emptied first (first turn, or the template rewrote earlier
    /// text).
    pub from_scratch: bool,
}

/// A conversation with a model (see the module documentation).
pub struct ChatSession<M: ChatModel> {
    model: M,
    tok: Tokenizer,
    template: ChatTemplate,
    sampler: SamplerChain,
    max_tokens: usize,
    system: Option<String>,
    messages: Vec<Message>,
    /// The tokens the cache holds, in order (the penalties' history).
    history: Vec<u32>,
    /// The text the cache and `pending` stand for.
    seen: String,
    /// Tokens of `seen` not yet run through the model.
    pending: Vec<u32>,
    /// Replies and reply tokens generated since the session began (across resets).
    totals: (usize, usize),
}

impl<M: ChatModel> ChatSession<M> {
    /// A new conversation, opened by `system` when given; replies stop after
    /// `max_tokens` tokens (at least 1). The model's cache is emptied.
    pub fn new(
        mut model: M,
        mut tok: Tokenizer,
        template: ChatTemplate,
        sampler: SamplerChain,
        max_tokens: usize,
        system: Option<String>,
    ) -> Result<Self> {
        if max_tokens == 0 {
            return Err(Error::model("the per-turn token limit must be at least 1"));
        }
        tok.set_parse_special(true);
        model.reset();
        let mut s = ChatSession {
            model,
            tok,
            template,
            sampler,
            max_tokens,
            system,
            messages: Vec::new(),
            history: Vec::new(),
            seen: String::new(),
            pending: Vec::new(),
            totals: (0, 0),
        };
        s.reset();
        Ok(s)
    }

    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// The conversation so far (the system message first, when there is one).
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The text the model has seen (its cache and the pending token).
    pub fn seen(&self) -> &str {
        &self.seen
    }

    /// Tokens of [`seen`](Self::seen) that the next turn runs first.
    pub fn pending(&self) -> &[u32] {
        &self.pending
    }

    /// Starts a new conversation (the system message kept) with an empty cache.
    pub fn reset(&mut self) {
        self.model.reset();
        self.messages.clear();
        if let Some(s) = &self.system {
            self.messages.push(Message::new("system", s.as_str()));
        }
        self.seen.clear();
        self.pending.clear();
        self.history.clear();
    }

    /// One turn: `user` says something, the reply streams to `on_text` piece by piece.
    pub fn turn(&mut self, user: &str, mut on_text: impl FnMut(&str)) -> Result<TurnEnd> {
        let mut messages = self.messages.clone();
        messages.push(Message::new("user", user));
        let (rendered, tokens, from_scratch) = self.new_tokens(&messages)?;
        let start = if from_scratch { 0 } else { self.model.n_past() };
        if start + tokens.len() > self.model.ctx() {
            return Ok(TurnEnd {
                reason: EndReason::ContextFull,
                reply: String::new(),
                tokens: Vec::new(),
                prefilled: 0,
                from_scratch: false,
            });
        }
        if from_scratch {
            self.model.reset();
            self.history.clear();
        }
        let mode = if self.sampler.is_greedy() {
            Logits::None
        } else {
            Logits::Last
        };
        let out = self.model.prefill(&tokens, mode)?;
        self.history.extend_from_slice(&tokens);
        self.pending.clear();
        self.messages = messages;
        self.seen = rendered;
        let (reason, ids, stop) = self.reply(&out, &mut on_text)?;
        let reply = self.tok.decode(&ids)?;
        self.seen.push_str(&reply);
        if let Some(stop) = stop {
            self.seen
                .push_str(&self.tok.id_to_token(stop).unwrap_or_default());
        }
        self.messages
            .push(Message::new("assistant", reply.as_str()));
        self.totals.0 += 1;
        self.totals.1 += ids.len();
        Ok(TurnEnd {
            reason,
            reply,
            tokens: ids,
            prefilled: tokens.len(),
            from_scratch,
        })
    }

    /// The rendering of `messages` up to the generation prompt, the tokens to prefill to
    /// reach it, and whether they start from an empty cache.
    fn new_tokens(&self, messages: &[Message]) -> Result<(String, Vec<u32>, bool)> {
        if self.seen.is_empty() {
            let full = self.template.render(messages, true)?;
            let ids = self.encode_whole(&full)?;
            return Ok((full, ids, true));
        }
        match self.template.append(&self.seen, messages, true)? {
            Continuation::Suffix(suffix) => {
                let mut ids = self.pending.clone();
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

    fn is_stop(&self, id: u32) -> bool {
        self.tok.stop_ids().binary_search(&id).is_ok() || self.model.is_eos(id)
    }

    /// Samples the reply after the prefill's output `out`: why it ended, its ids and the
    /// stop token. The last sampled token is left pending.
    fn reply(
        &mut self,
        out: &Output,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<(EndReason, Vec<u32>, Option<u32>)> {
        let greedy = self.sampler.is_greedy();
        let mut next = self.sampler.pick(out, &self.history)?;
        let mut stream = self.tok.stream(&[])?;
        let mut ids = Vec::new();
        let reason = loop {
            if self.is_stop(next) {
                self.pending = vec![next];
                return Ok((EndReason::Stop, ids, Some(next)));
            }
            ids.push(next);
            if let Some(text) = stream.next(next)? {
                on_text(&text);
            }
            if ids.len() >= self.max_tokens {
                break EndReason::Length;
            }
            if self.model.n_past() >= self.model.ctx() {
                break EndReason::ContextFull;
            }
            let out = self.model.decode(next, !greedy)?;
            self.history.push(next);
            next = self.sampler.pick(&out, &self.history)?;
        };
        self.pending = vec![next];
        Ok((reason, ids, None))
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
        let (used, ctx) = (self.model.n_past(), self.model.ctx());
        match end.reason {
            EndReason::Stop => None,
            EndReason::Length => Some(format!(
                "[reply cut at the limit of {} tokens per turn (-n)]",
                self.max_tokens
            )),
            EndReason::ContextFull if end.prefilled == 0 => Some(format!(
                "[context full: {used} of {ctx} tokens used and this message does not fit; type /reset to start a new conversation (or use a larger --ctx)]"
            )),
            EndReason::ContextFull => Some(format!(
                "[context full: all {ctx} tokens used, the reply was cut; type /reset to start a new conversation (or use a larger --ctx)]"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// A model that answers with scripted tokens and records what it was given.
    struct Scripted {
        n_past: usize,
        ctx: usize,
        script: Vec<u32>,
        prefills: Vec<Vec<u32>>,
        decoded: Vec<u32>,
    }

    impl Scripted {
        fn next(&mut self) -> Output {
            let argmax = if self.script.is_empty() {
                9
            } else {
                self.script.remove(0)
            };
            Output::argmax(argmax)
        }
    }

    impl ChatModel for Scripted {
        fn n_past(&self) -> usize {
            self.n_past
        }
        fn ctx(&self) -> usize {
            self.ctx
        }
        fn reset(&mut self) {
            self.n_past = 0;
        }
        fn prefill(&mut self, tokens: &[u32], _: Logits) -> Result<Output> {
            self.n_past += tokens.len();
            self.prefills.push(tokens.to_vec());
            Ok(self.next())
        }
        fn decode(&mut self, token: u32, _: bool) -> Result<Output> {
            self.n_past += 1;
            self.decoded.push(token);
            Ok(self.next())
        }
        fn is_eos(&self, _: u32) -> bool {
            false
        }
    }

    /// `<|eot_id|>` (id 2) ends each turn in this template, as in Llama 3's.
    const EOT_TEMPLATE: &str = "{% for m in messages %}<|begin_of_text|>{{ m.role }}\n\
        {{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}\
        <|begin_of_text|>assistant\n{% endif %}";

    fn session(template: Option<&str>, script: &[u32]) -> ChatSession<Scripted> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama3-tiny-bf16");
        let tok = Tokenizer::from_dir(&dir).unwrap().unwrap();
        let model = Scripted {
            n_past: 0,
            ctx: 1000,
            script: script.to_vec(),
            prefills: Vec::new(),
            decoded: Vec::new(),
        };
        let template = ChatTemplate::new(template, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        ChatSession::new(model, tok, template, SamplerChain::greedy(), 10, None).unwrap()
    }

    /// A stop token ends the reply, is not run during its turn, and opens the next turn's
    /// prefill; the template's own BOS is not doubled.
    #[test]
    fn stop_token_is_pending_until_the_next_turn() {
        let mut s = session(Some(EOT_TEMPLATE), &[40, 41, 2, 50, 2]);
        let t1 = s.turn("Hi", |_| {}).unwrap();
        assert_eq!(
            (t1.reason, t1.tokens.as_slice()),
            (EndReason::Stop, &[40, 41][..])
        );
        assert_eq!(s.pending(), [2]);
        assert_eq!(s.model().decoded, [40, 41], "the stop token is not run");
        assert_eq!(s.model().prefills[0][0], 0, "one BOS");
        assert_ne!(s.model().prefills[0][1], 0, "the template wrote the BOS");
        assert!(s.seen().ends_with("<|eot_id|>"));
        let t2 = s.turn("Again", |_| {}).unwrap();
        assert!(!t2.from_scratch);
        assert_eq!(s.model().prefills[1][0], 2, "the pending stop token first");
        assert_eq!(s.model().n_past, t1.prefilled + 2 + t2.prefilled + 1);
    }

    /// When the stop token's text is not what the template writes after a reply (ChatML
    /// here, `<|eot_id|>` from the model), the conversation is prefilled from scratch.
    #[test]
    fn a_rewritten_history_is_prefilled_from_scratch() {
        let mut s = session(None, &[40, 2, 50, 2]);
        let t1 = s.turn("Hi", |_| {}).unwrap();
        let t2 = s.turn("Again", |_| {}).unwrap();
        assert!(t1.from_scratch && t2.from_scratch);
        assert_eq!(s.model().n_past, t2.prefilled + 1);
        let whole = s.template.render(&s.messages[..3], true).unwrap();
        assert_eq!(s.tok.encode(&whole).unwrap(), s.model().prefills[1]);
    }
}
