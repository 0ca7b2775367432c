//! A sequence's output text: generated tokens turned into text as they come (holding back
//! an unfinished UTF-8 sequence), and stop strings found in it, also across tokens, with
//! the text that may be the start of a stop string held back until it is known not to be.

use std::sync::Arc;

use crate::error::Result;
use crate::models::Tokenizer;

/// Turns token ids into text (a tokenizer).
pub trait Detokenize: Send + Sync {
    /// The text of `ids`.
    fn decode(&self, ids: &[u32]) -> Result<String>;
}

impl Detokenize for Tokenizer {
    fn decode(&self, ids: &[u32]) -> Result<String> {
        Tokenizer::decode(self, ids)
    }
}

/// Prompt tokens decoded before the first generated one, so that its text is decoded as
/// a continuation (a leading space that belongs to the token stays).
const CONTEXT_TOKENS: usize = 4;

/// The text state of one sequence.
pub(crate) struct TextState {
    detok: Option<Arc<dyn Detokenize>>,
    /// Token indices (into the sequence's tokens) of the decoding window: the text of
    /// `prefix..read` was already turned into output.
    prefix: usize,
    read: usize,
    /// Output text not emitted yet: it may be the start of a stop string.
    held: String,
    stops: Vec<String>,
}

/// What the text of a new token does.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TextStep {
    /// Emit this text (possibly empty) and go on.
    Emit(String),
    /// A stop string appeared: emit this text (what came before it) and stop.
    Stop(String),
}

impl TextState {
    /// The text state of a sequence whose first `prompt_len` tokens are the prompt.
    pub(crate) fn new(
        detok: Option<Arc<dyn Detokenize>>,
        prompt_len: usize,
        stops: Vec<String>,
    ) -> TextState {
        TextState {
            detok,
            prefix: prompt_len.saturating_sub(CONTEXT_TOKENS),
            read: prompt_len,
            held: String::new(),
            stops,
        }
    }

    /// Takes the sequence's newest token (the last of `tokens`).
    pub(crate) fn push(&mut self, tokens: &[u32]) -> Result<TextStep> {
        let Some(detok) = &self.detok else {
            return Ok(TextStep::Emit(String::new()));
        };
        let before = detok.decode(&tokens[self.prefix..self.read])?;
        let after = detok.decode(&tokens[self.prefix..])?;
        if after.ends_with('\u{FFFD}') || after.len() <= before.len() {
            return Ok(TextStep::Emit(String::new()));
        }
        let new = match after.get(before.len()..) {
            Some(s) if after.starts_with(&before) => s.to_string(),
            // a decoder that rewrites earlier text: take what differs at the end
            Some(_) | None => after.chars().skip(before.chars().count()).collect(),
        };
        self.prefix = self.read;
        self.read = tokens.len();
        self.held.push_str(&new);
        Ok(self.release())
    }

    /// The held text up to a stop string (then stop), or up to the longest end that may
    /// begin one.
    fn release(&mut self) -> TextStep {
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let out = self.held[..at].to_string();
            self.held.clear();
            return TextStep::Stop(out);
        }
        let keep = self
            .stops
            .iter()
            .map(|s| longest_prefix_suffix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        TextStep::Emit(out)
    }

    /// The sequence's first `n` tokens were dropped: token indices move down by `n`.
    pub(crate) fn shift(&mut self, n: usize) {
        self.prefix = self.prefix.saturating_sub(n);
        self.read = self.read.saturating_sub(n);
    }

    /// The text held back, at the end of the sequence.
    pub(crate) fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The length of the longest end of `text` that is a proper beginning of `stop` (cut at
/// a character boundary of `text`).
fn longest_prefix_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop
                    .as_bytes()
                    .starts_with(&text.as_bytes()[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A detokenizer over a fixed table of pieces.
    struct Pieces(Vec<&'static str>);

    impl Detokenize for Pieces {
        fn decode(&self, ids: &[u32]) -> Result<String> {
            Ok(ids.iter().map(|&i| self.0[i as usize]).collect())
        }
    }

    fn run(stops: &[&str], generated: &[u32]) -> (Vec<String>, Option<String>, String) {
        let pieces = Pieces(vec![
            "<s>", "Hel", "lo", " wor", "ld", "!", " EN", "D", "\u{FFFD}",
        ]);
        let mut t = TextState::new(
            Some(Arc::new(pieces)),
            1,
            stops.iter().map(|s| s.to_string()).collect(),
        );
        let mut tokens = vec![0u32];
        let mut out = Vec::new();
        for &g in generated {
            tokens.push(g);
            match t.push(&tokens).unwrap() {
                TextStep::Emit(s) => out.push(s),
                TextStep::Stop(s) => return (out, Some(s), String::new()),
            }
        }
        (out, None, t.finish())
    }

    #[test]
    fn text_comes_out_as_tokens_complete_it() {
        let (out, stop, rest) = run(&[], &[1, 2, 3, 4, 5]);
        assert_eq!(out, vec!["Hel", "lo", " wor", "ld", "!"]);
        assert_eq!((stop, rest), (None, String::new()));
    }

    #[test]
    fn a_stop_string_across_tokens_is_never_emitted() {
        // " END" arrives as " EN" + "D": " EN" is held back, then the stop is found
        let (out, stop, _) = run(&[" END"], &[1, 2, 6, 7, 5]);
        assert_eq!(out, vec!["Hel", "lo", ""]);
        assert_eq!(stop, Some(String::new()));
        // held text that turns out not to be a stop string comes out later
        let (out, stop, rest) = run(&[" ENx"], &[1, 6, 7]);
        assert_eq!(out, vec!["Hel", "", " END"]);
        assert_eq!((stop, rest), (None, String::new()));
        // text that may begin a stop string is held ("l", then "lo") until it is one
        let (out, stop, _) = run(&["lo w"], &[1, 2, 3]);
        assert_eq!(out, vec!["He", "l"]);
        assert_eq!(stop, Some(String::new()));
        // a stop string inside one token cuts the text before it
        let (out, stop, _) = run(&["or"], &[1, 3]);
        assert_eq!(out, vec!["Hel"]);
        assert_eq!(stop, Some(" w".to_string()));
    }

    #[test]
    fn held_text_is_released_at_the_end() {
        let (out, stop, rest) = run(&[" EN!"], &[1, 6]);
        assert_eq!(out, vec!["Hel", ""]);
        assert_eq!((stop, rest), (None, " EN".to_string()));
    }

    #[test]
    fn an_open_utf8_sequence_is_held() {
        let (out, _, _) = run(&[], &[1, 8, 2]);
        assert_eq!(out[1], "");
    }
}
