//! Tokenizer glue: a model folder's `tokenizer.json`, or GGUF tokenizer metadata (see
//! [`super::gguf_tokenizer::TokenizerSpec`]), through the `tokenizers` crate.
//!
//! Encoding adds special tokens the way the file's post-processor says (a BOS in front
//! for Llama 2 and 3). Decoding streams: [`TokenStream`] returns the text each new token
//! adds, holding back pieces that end inside a UTF-8 sequence (byte-level tokens of a
//! multi-byte character) until the character is complete, and keeping earlier tokens as
//! context so word-leading spaces come out right.

use std::path::Path;

use tokenizers::{
    DecodeStream, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper,
    PreTokenizerWrapper,
};

use super::gguf_tokenizer::END_OF_TURN_TEXTS;
use crate::error::{Error, Result};

/// Whether a special token's text marks the end of a text or of a turn.
fn is_end_of_text(text: &str) -> bool {
    END_OF_TURN_TEXTS.contains(&text) || matches!(text, "</s>" | "<|end_of_text|>")
}

/// File name of a Hugging Face tokenizer inside a model folder.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// A tokenizer: from a Hugging Face `tokenizer.json` or from GGUF metadata.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Where it came from (a path), for error messages.
    origin: String,
    /// Ids that end generation, sorted.
    stop: Vec<u32>,
}

impl Tokenizer {
    /// Reads a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::model(format!("{}: cannot load tokenizer: {e}", path.display())))?;
        // A tokenizer.json does not say which token is EOS: its special tokens whose text
        // ends a turn in the known chat formats stand in.
        let mut stop: Vec<u32> = inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special && is_end_of_text(&t.content))
            .map(|(&id, _)| id)
            .collect();
        stop.sort_unstable();
        Ok(Tokenizer::from_parts(
            inner,
            path.display().to_string(),
            stop,
        ))
    }

    /// Wraps a built tokenizer; `stop` lists the ids that end generation.
    pub(crate) fn from_parts(inner: tokenizers::Tokenizer, origin: String, stop: Vec<u32>) -> Self {
        Tokenizer {
            inner,
            origin,
            stop,
        }
    }

    /// The ids that end generation (EOS, end of turn), sorted.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The text of token `id`, as stored in the vocabulary (byte-level or `▁` spelling).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether [`encode`](Self::encode) turns the text of special (control) tokens into
    /// their ids, as `llama-tokenize` does by default (on), or tokenizes it as plain text
    /// (off: for text typed by a user, so that it cannot fake a chat turn).
    pub fn set_parse_special(&mut self, on: bool) {
        self.inner.set_encode_special_tokens(!on);
    }

    /// The folder's tokenizer, or `None` when it has no `tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Option<Tokenizer>> {
        let path = dir.join(TOKENIZER_FILE);
        if path.is_file() {
            Tokenizer::from_file(&path).map(Some)
        } else {
            Ok(None)
        }
    }

    fn err(&self, what: &str, e: impl std::fmt::Display) -> Error {
        Error::model(format!("{}: {what}: {e}", self.origin))
    }

    /// Token ids of `text`, with the special tokens (BOS) the tokenizer adds.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| self.err("cannot encode", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, without special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| self.err("cannot decode", e))
    }

    /// A streaming decoder that has already seen `context` (the prompt), so the first
    /// new token's text is decoded as a continuation of it.
    pub fn stream(&self, context: &[u32]) -> Result<TokenStream<'_>> {
        let mut s = TokenStream {
            inner: self.inner.decode_stream(true),
            tok: self,
        };
        for &id in context {
            s.next(id)?;
        }
        Ok(s)
    }
}

/// Incremental decoding of generated tokens (see [`Tokenizer::stream`]).
pub struct TokenStream<'a> {
    inner: DecodeStream<
        'a,
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >,
    tok: &'a Tokenizer,
}

impl TokenStream<'_> {
    /// The text `id` completes, or `None` while a UTF-8 sequence is still open.
    pub fn next(&mut self, id: u32) -> Result<Option<String>> {
        self.inner
            .step(id)
            .map_err(|e| self.tok.err("cannot decode", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        Tokenizer::from_dir(&dir).unwrap().unwrap()
    }

    fn streamed(tok: &Tokenizer, context: &[u32], ids: &[u32]) -> String {
        let mut s = tok.stream(context).unwrap();
        ids.iter().filter_map(|&id| s.next(id).unwrap()).collect()
    }

    #[test]
    fn encode_adds_bos_and_round_trips() {
        let l2 = fixture("llama2-tiny-f32");
        let ids = l2.encode("The keeper lit the lamp.").unwrap();
        assert_eq!(ids[0], 1, "Llama 2 style <s>");
        assert_eq!(l2.decode(&ids).unwrap(), "The keeper lit the lamp.");
        let l3 = fixture("llama3-tiny-bf16");
        let ids = l3.encode("The keeper lit the lamp.").unwrap();
        assert_eq!(ids[0], 0, "Llama 3 style <|begin_of_text|>");
        assert_eq!(l3.decode(&ids).unwrap(), "The keeper lit the lamp.");
    }

    #[test]
    fn stop_ids_are_the_end_tokens() {
        let l2 = fixture("llama2-tiny-f32");
        assert_eq!(l2.stop_ids(), [2], "</s>");
        let l3 = fixture("llama3-tiny-bf16");
        assert_eq!(l3.stop_ids(), [1, 2], "<|end_of_text|> and <|eot_id|>");
        assert_eq!(l3.id_to_token(2).as_deref(), Some("<|eot_id|>"));
    }

    /// Streaming yields exactly the text of a full decode, piece by piece, for words with
    /// leading spaces and for multi-byte characters split over byte-level tokens.
    #[test]
    fn streaming_matches_a_full_decode() {
        for (name, text) in [
            (
                "llama2-tiny-f32",
                "The river runs under the old bridge, slowly.",
            ),
            ("llama3-tiny-bf16", "Café naïve — 日本の灯台 🌊 at night."),
        ] {
            let tok = fixture(name);
            let ids = tok.encode(text).unwrap();
            for split in [1, 3, ids.len() - 1] {
                let (ctx, rest) = ids.split_at(split);
                let whole = tok.decode(&ids).unwrap();
                let head = tok.decode(ctx).unwrap();
                assert_eq!(
                    head + &streamed(&tok, ctx, rest),
                    whole,
                    "{name} split {split}"
                );
            }
        }
        // Byte-level tokens of one character: nothing until the character is complete.
        let tok = fixture("llama3-tiny-bf16");
        let ids = tok.encode("日").unwrap();
        assert!(ids.len() > 2, "expected several byte tokens, got {ids:?}");
        let mut s = tok.stream(&ids[..1]).unwrap();
        let pieces: Vec<Option<String>> = ids[1..].iter().map(|&i| s.next(i).unwrap()).collect();
        assert!(
            pieces[..pieces.len() - 1].iter().all(Option::is_none),
            "{pieces:?}"
        );
        assert_eq!(pieces.last().unwrap().as_deref(), Some("日"));
    }
}
