//! Tokenizers described by GGUF metadata (the `tokenizer.ggml.*` keys llama.cpp writes):
//! [`TokenizerSpec::from_gguf`] reads the keys of a GGUF file's metadata (a spec can also
//! be filled by hand or from JSON), [`TokenizerSpec::build`] makes the tokenizer.
//!
//! Two kinds of `tokenizer.ggml.model` are supported, both built on the `tokenizers` crate:
//!
//! - `"gpt2"`: byte-level BPE with the file's merges. The text is first split by the
//!   regular expressions of the pre-tokenizer type `tokenizer.ggml.pre` (the same families
//!   llama.cpp uses: `llama-bpe`, `smollm`, `qwen2`, `gpt-2`, ... and its default when the key
//!   is missing), then mapped to the byte alphabet.
//! - `"llama"`: SentencePiece-style BPE. The file has no merges: a pair of pieces merges when
//!   their concatenation is a token, best score first (llama.cpp's SPM tokenizer). Spaces
//!   become `▁`, a `▁` is put in front of each run of text when `add_space_prefix` (the
//!   default), and characters without a token fall back to their `<0xXX>` byte tokens (or to
//!   the unknown token when there are none).
//!
//! Control, unknown-type and user-defined tokens are matched whole in the text, like
//! `llama-tokenize` does by default (it parses special tokens in the prompt);
//! [`Tokenizer::set_parse_special`] turns that off for control tokens, so text typed by a
//! user cannot smuggle in `<|im_end|>`. User-defined tokens are always matched, as in
//! llama.cpp. `add_bos`/`add_eos` become the post-processor (defaults as in llama.cpp: BOS
//! for `"llama"` and for Llama 3 pre-tokenizers). [`Tokenizer::stop_ids`] lists the ids that
//! end generation: EOS, EOT, EOM and the control tokens llama.cpp recognises as end of turn
//! by their text.

use std::collections::{HashMap, HashSet};

use ahash::AHashMap;

use serde::{Deserialize, Serialize};
use serde_json::json;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
};

use crate::error::{Error, Result};
use crate::gguf::{Array, Metadata};
use crate::models::text::tokenizer::Tokenizer;

/// The GGUF keys a [`TokenizerSpec`] mirrors, for error messages.
mod key {
    pub const MODEL: &str = "tokenizer.ggml.model";
    pub const PRE: &str = "tokenizer.ggml.pre";
    pub const TOKENS: &str = "tokenizer.ggml.tokens";
    pub const SCORES: &str = "tokenizer.ggml.scores";
    pub const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
    pub const MERGES: &str = "tokenizer.ggml.merges";
    pub const BOS: &str = "tokenizer.ggml.bos_token_id";
    pub const EOS: &str = "tokenizer.ggml.eos_token_id";
    pub const EOT: &str = "tokenizer.ggml.eot_token_id";
    pub const EOM: &str = "tokenizer.ggml.eom_token_id";
    pub const UNK: &str = "tokenizer.ggml.unknown_token_id";
    pub const PAD: &str = "tokenizer.ggml.padding_token_id";
    pub const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
    pub const ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
    pub const ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
    pub const CHAT_TEMPLATE: &str = "tokenizer.chat_template";
}

/// Tokenizer metadata as llama.cpp stores it in a GGUF file (`tokenizer.ggml.*` and
/// `tokenizer.chat_template`). Serialises to JSON with these field names.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer type of a `"gpt2"` model.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: the text of each token id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`: merge priorities of a `"llama"` model (higher first).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`: see [`TokenType`].
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: `"left right"` pairs of a `"gpt2"` model, best first.
    pub merges: Option<Vec<String>>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` (end of turn).
    pub eot: Option<u32>,
    /// `tokenizer.ggml.eom_token_id` (end of message).
    pub eom: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix`.
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template` (Jinja).
    pub chat_template: Option<String>,
}

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    /// 0: not set; treated as normal.
    Undefined,
    /// 1: an ordinary piece of text.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: a control token (`<s>`, `<|im_start|>`): special, skipped when decoding.
    Control,
    /// 4: a user-defined token, always matched whole in the text.
    UserDefined,
    /// 5: an unused slot.
    Unused,
    /// 6: a byte token `<0xXX>` (SentencePiece byte fallback).
    Byte,
}

impl TokenType {
    /// The type of a `tokenizer.ggml.token_type` value.
    pub fn from_i32(v: i32) -> Option<TokenType> {
        Some(match v {
            0 => TokenType::Undefined,
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }

    fn is_text(self) -> bool {
        match self {
            TokenType::Undefined | TokenType::Normal => true,
            TokenType::Unknown
            | TokenType::Control
            | TokenType::UserDefined
            | TokenType::Unused
            | TokenType::Byte => false,
        }
    }
}

/// Texts of control tokens that end a turn, as llama.cpp recognises them.
pub(crate) const END_OF_TURN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
];

/// The two tokenizer kinds of `tokenizer.ggml.model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    BytePairs,
    SentencePiece,
}

/// Families of pre-tokenizer regular expressions (`tokenizer.ggml.pre`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreKind {
    /// llama.cpp's fallback when the key is missing or `"default"`.
    Default,
    /// GPT-2's pattern alone.
    Gpt2,
    /// Each digit on its own, then GPT-2's pattern (StarCoder, SmolLM).
    Digits,
    /// Llama 3: case-insensitive contractions, numbers in groups of up to three.
    Llama3,
    /// Qwen 2: like Llama 3 but one digit at a time.
    Qwen2,
}

const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

impl PreKind {
    fn from_pre(pre: Option<&str>) -> Result<PreKind> {
        Ok(match pre.unwrap_or("") {
            "" | "default" => PreKind::Default,
            "gpt-2" | "mpt" | "olmo" | "jais" => PreKind::Gpt2,
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" => PreKind::Digits,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => {
                PreKind::Llama3
            }
            "qwen2" | "stablelm2" | "deepseek-r1-qwen" | "megrez" => PreKind::Qwen2,
            other => {
                return Err(Error::tokenizer_spec(
                    key::PRE,
                    format!("unknown pre-tokenizer type '{other}'"),
                ))
            }
        })
    }

    /// The regular expressions applied one after the other; text between matches is kept.
    fn patterns(self) -> Vec<String> {
        let modern = |numbers: &str| {
            format!(
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|{numbers}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            )
        };
        match self {
            PreKind::Default => vec![
                r"[\p{P}\$\+<=>\^~\|]+".into(),
                GPT2_PATTERN.into(),
                r"\p{N}+".into(),
                "[0-9][0-9][0-9]".into(),
            ],
            PreKind::Gpt2 => vec![GPT2_PATTERN.into()],
            PreKind::Digits => vec![r"\p{N}".into(), GPT2_PATTERN.into()],
            PreKind::Llama3 => vec![modern(r"\p{N}{1,3}")],
            PreKind::Qwen2 => vec![modern(r"\p{N}")],
        }
    }

    /// The regular expressions as splits (matches and the text between them kept), then
    /// the mapping of bytes to the byte-level alphabet.
    fn pre_tokenizer(self) -> Result<PreSequence> {
        let mut steps = self
            .patterns()
            .into_iter()
            .map(|p| {
                Split::new(
                    SplitPattern::Regex(p),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map(PreTokenizerWrapper::from)
                .map_err(|e| Error::tokenizer_spec(key::PRE, e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        steps.push(ByteLevel::new(false, false, false).into());
        Ok(PreSequence::new(steps))
    }

    /// Llama 3 vocabularies take a whole pre-token when it is a token (`ignore_merges`).
    fn ignores_merges(self) -> bool {
        match self {
            PreKind::Llama3 => true,
            PreKind::Default | PreKind::Gpt2 | PreKind::Digits | PreKind::Qwen2 => false,
        }
    }

    /// llama.cpp adds BOS by default for Llama 3 style vocabularies.
    fn adds_bos(self) -> bool {
        self.ignores_merges()
    }
}

impl TokenizerSpec {
    /// Reads llama.cpp's tokenizer keys from GGUF metadata. `tokenizer.ggml.model` and
    /// `tokenizer.ggml.tokens` are required; every other key is optional. A key of the
    /// wrong type (a string where an id belongs, scores that are not `f32`, ...) is an
    /// error naming the key. Nothing is checked against the token list here: that is
    /// [`build`](Self::build)'s job.
    pub fn from_gguf(md: &Metadata) -> Result<TokenizerSpec> {
        let opt_str = |k: &str| optional(md, k, Metadata::get_str).map(|v| v.map(String::from));
        let opt_id = |k: &str| optional(md, k, Metadata::get_u32);
        let opt_bool = |k: &str| optional(md, k, Metadata::get_bool);
        Ok(TokenizerSpec {
            model: md.get_str(key::MODEL)?.to_string(),
            pre: opt_str(key::PRE)?,
            tokens: md.get_array_str(key::TOKENS)?.to_vec(),
            scores: optional(md, key::SCORES, Metadata::get_array_f32)?.map(<[f32]>::to_vec),
            token_types: token_types(md, key::TOKEN_TYPE)?,
            merges: optional(md, key::MERGES, Metadata::get_array_str)?.map(<[String]>::to_vec),
            bos: opt_id(key::BOS)?,
            eos: opt_id(key::EOS)?,
            eot: opt_id(key::EOT)?,
            eom: opt_id(key::EOM)?,
            unk: opt_id(key::UNK)?,
            pad: opt_id(key::PAD)?,
            add_bos: opt_bool(key::ADD_BOS)?,
            add_eos: opt_bool(key::ADD_EOS)?,
            add_space_prefix: opt_bool(key::ADD_SPACE_PREFIX)?,
            chat_template: opt_str(key::CHAT_TEMPLATE)?,
        })
    }

    /// Builds the tokenizer, checking every id, length and merge against the token list.
    pub fn build(&self) -> Result<Tokenizer> {
        let kind = match self.model.as_str() {
            "gpt2" => Kind::BytePairs,
            "llama" => Kind::SentencePiece,
            other => {
                return Err(Error::tokenizer_spec(
                    key::MODEL,
                    format!("unsupported tokenizer model '{other}' (expected 'gpt2' or 'llama')"),
                ))
            }
        };
        if self.tokens.is_empty() {
            return Err(Error::tokenizer_spec(key::TOKENS, "no tokens"));
        }
        let types = self.types()?;
        self.check_ids()?;
        let vocab = self.vocab();
        let mut inner = match kind {
            Kind::BytePairs => self.byte_level(&vocab)?,
            Kind::SentencePiece => self.sentence_piece(&vocab, &types)?,
        };
        let added = self.added_tokens(&types);
        inner
            .add_special_tokens(added.special)
            .map_err(|e| Error::tokenizer_spec(key::TOKEN_TYPE, e.to_string()))?;
        inner
            .add_tokens(added.user)
            .map_err(|e| Error::tokenizer_spec(key::TOKEN_TYPE, e.to_string()))?;
        let (post, cannot_add) = self.post_processor(kind)?;
        inner.with_post_processor(post);
        Ok(
            Tokenizer::from_parts(inner, "GGUF tokenizer metadata".into(), self.stop_ids())
                .cannot_add_special(cannot_add),
        )
    }

    /// The ids that end generation: EOS, EOT, EOM and control tokens whose text marks an
    /// end of turn (`<|im_end|>`, `<|eot_id|>`, `<|endoftext|>`, ...), sorted, no repeats.
    pub fn stop_ids(&self) -> Vec<u32> {
        let n = self.tokens.len();
        let mut ids: Vec<u32> = [self.eos_id(), self.eot, self.eom]
            .into_iter()
            .flatten()
            .filter(|&id| (id as usize) < n)
            .collect();
        let types = self.token_types.as_deref().unwrap_or(&[]);
        for (id, text) in self.tokens.iter().enumerate() {
            let control =
                types.get(id).copied().and_then(TokenType::from_i32) == Some(TokenType::Control);
            if control && END_OF_TURN_TEXTS.contains(&text.as_str()) {
                ids.push(id as u32);
            }
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The text of the BOS token (for chat templates), if there is one.
    pub fn bos_text(&self) -> Option<&str> {
        self.token_text(self.bos_id())
    }

    /// The text of the EOS token (for chat templates), if there is one.
    pub fn eos_text(&self) -> Option<&str> {
        self.token_text(self.eos_id())
    }

    fn token_text(&self, id: Option<u32>) -> Option<&str> {
        id.and_then(|id| self.tokens.get(id as usize))
            .map(String::as_str)
    }

    fn is_spm(&self) -> bool {
        self.model == "llama"
    }

    /// BOS id, with llama.cpp's default (1) for SentencePiece vocabularies.
    fn bos_id(&self) -> Option<u32> {
        self.bos.or(self.is_spm().then_some(1))
    }

    /// EOS id, with llama.cpp's default (2) for SentencePiece vocabularies.
    fn eos_id(&self) -> Option<u32> {
        self.eos.or(self.is_spm().then_some(2))
    }

    /// Unknown-token id, with llama.cpp's default (0) for SentencePiece vocabularies.
    fn unk_id(&self) -> Option<u32> {
        self.unk.or(self.is_spm().then_some(0))
    }

    fn types(&self) -> Result<Vec<TokenType>> {
        let n = self.tokens.len();
        let Some(raw) = &self.token_types else {
            return Ok(vec![TokenType::Normal; n]);
        };
        if raw.len() != n {
            return Err(Error::tokenizer_spec(
                key::TOKEN_TYPE,
                format!("{} token types for {n} tokens", raw.len()),
            ));
        }
        raw.iter()
            .enumerate()
            .map(|(id, &t)| {
                TokenType::from_i32(t).ok_or_else(|| {
                    Error::tokenizer_spec(
                        key::TOKEN_TYPE,
                        format!("token {id} has unknown type {t} (expected 0..=6)"),
                    )
                })
            })
            .collect()
    }

    fn check_ids(&self) -> Result<()> {
        let n = self.tokens.len();
        if let Some(scores) = &self.scores {
            if scores.len() != n {
                return Err(Error::tokenizer_spec(
                    key::SCORES,
                    format!("{} scores for {n} tokens", scores.len()),
                ));
            }
        }
        let ids = [
            (key::BOS, self.bos),
            (key::EOS, self.eos),
            (key::EOT, self.eot),
            (key::EOM, self.eom),
            (key::UNK, self.unk),
            (key::PAD, self.pad),
        ];
        // As llama.cpp ("bad special token"): an id outside the token list is not used
        // (no stop id, no template text; BOS or EOS that the tokenizer must add is an
        // error where it is added).
        for (k, id) in ids {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                crate::models::load::gguf::warn_bad_special_token(k, id, n);
            }
        }
        Ok(())
    }

    /// Token text to id; a text listed twice keeps its last id, as in llama.cpp.
    fn vocab(&self) -> AHashMap<String, u32> {
        self.tokens
            .iter()
            .enumerate()
            .map(|(id, t)| (t.clone(), id as u32))
            .collect()
    }

    fn byte_level(&self, vocab: &AHashMap<String, u32>) -> Result<tokenizers::Tokenizer> {
        let pre = PreKind::from_pre(self.pre.as_deref())?;
        let merges = self.parsed_merges(vocab)?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab.clone(), merges)
            .ignore_merges(pre.ignores_merges())
            .build()
            .map_err(|e| Error::tokenizer_spec(key::MERGES, e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre.pre_tokenizer()?));
        inner.with_decoder(Some(ByteLevel::default()));
        Ok(inner)
    }

    /// `tokenizer.ggml.merges` as pairs, each side and the merged text a known token.
    fn parsed_merges(&self, vocab: &AHashMap<String, u32>) -> Result<Vec<(String, String)>> {
        let Some(merges) = &self.merges else {
            return Err(Error::tokenizer_spec(
                key::MERGES,
                "missing for a 'gpt2' tokenizer",
            ));
        };
        merges
            .iter()
            .enumerate()
            .map(|(i, m)| {
                // The separator is the first space after the first character (a side may
                // itself be a space in some vocabularies).
                let split = m
                    .char_indices()
                    .skip(1)
                    .find(|&(_, c)| c == ' ')
                    .map(|(at, _)| (&m[..at], &m[at + 1..]));
                let Some((left, right)) = split else {
                    return Err(Error::tokenizer_spec(
                        key::MERGES,
                        format!("merge {i} '{m}' is not two tokens separated by a space"),
                    ));
                };
                for part in [left, right, &format!("{left}{right}")] {
                    if !vocab.contains_key(part) {
                        return Err(Error::tokenizer_spec(
                            key::MERGES,
                            format!("merge {i} '{m}' references unknown token '{part}'"),
                        ));
                    }
                }
                Ok((left.to_string(), right.to_string()))
            })
            .collect()
    }

    fn sentence_piece(
        &self,
        vocab: &AHashMap<String, u32>,
        types: &[TokenType],
    ) -> Result<tokenizers::Tokenizer> {
        let byte_fallback = types.contains(&TokenType::Byte);
        let mut builder = BPE::builder()
            .vocab_and_merges(vocab.clone(), self.score_merges(vocab, types))
            .byte_fallback(byte_fallback)
            .fuse_unk(false);
        if let Some(unk) = self.token_text(self.unk_id()) {
            builder = builder.unk_token(unk.to_string());
        }
        let bpe = builder
            .build()
            .map_err(|e| Error::tokenizer_spec(key::SCORES, e.to_string()))?;
        let prefix = self.add_space_prefix.unwrap_or(true);
        let space = Replace::new(" ", "\u{2581}")
            .map_err(|e| Error::tokenizer_spec(key::MODEL, e.to_string()))?;
        let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
        if prefix {
            normalizers.push(Prepend::new("\u{2581}".into()).into());
        }
        normalizers.push(space.clone().into());
        let mut decoders: Vec<DecoderWrapper> = vec![
            Replace::new("\u{2581}", " ")
                .map_err(|e| Error::tokenizer_spec(key::MODEL, e.to_string()))?
                .into(),
            ByteFallback::new().into(),
            Fuse::new().into(),
        ];
        if prefix {
            decoders.push(Strip::new(' ', 1, 0).into());
        }
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner
            .with_normalizer(Some(NormalizerSequence::new(normalizers)))
            .map_err(|e| Error::tokenizer_spec(key::MODEL, e.to_string()))?;
        inner.with_decoder(Some(DecoderSequence::new(decoders)));
        Ok(inner)
    }

    /// Merges implied by the scores: every split of a text token into two tokens, the
    /// pair ranked by the score of the whole (higher first, then by id), which is how
    /// llama.cpp's SentencePiece tokenizer picks the next pair to merge.
    fn score_merges(
        &self,
        vocab: &AHashMap<String, u32>,
        types: &[TokenType],
    ) -> Vec<(String, String)> {
        let score = |id: usize| self.scores.as_ref().map_or(0.0, |s| s[id]);
        let mut ranked: Vec<(f32, u32, u32, u32)> = Vec::new();
        for (id, text) in self.tokens.iter().enumerate() {
            if !types[id].is_text() || vocab.get(text) != Some(&(id as u32)) {
                continue;
            }
            for (at, _) in text.char_indices().skip(1) {
                let (l, r) = text.split_at(at);
                if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                    ranked.push((score(id), id as u32, li, ri));
                }
            }
        }
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        ranked
            .into_iter()
            .map(|(_, _, l, r)| {
                (
                    self.tokens[l as usize].clone(),
                    self.tokens[r as usize].clone(),
                )
            })
            .collect()
    }

    fn added_tokens(&self, types: &[TokenType]) -> AddedTokens {
        let mut special = Vec::new();
        let mut user = Vec::new();
        let mut seen = HashSet::new();
        for (text, &ty) in self.tokens.iter().zip(types) {
            if !seen.insert(text.as_str()) {
                continue;
            }
            let token = AddedToken::from(text.clone(), true).normalized(false);
            match ty {
                TokenType::Control | TokenType::Unknown => special.push(token),
                TokenType::UserDefined => user.push(token.special(false)),
                TokenType::Undefined | TokenType::Normal | TokenType::Unused | TokenType::Byte => {}
            }
        }
        AddedTokens { special, user }
    }

    /// BOS/EOS around the text as `add_bos`/`add_eos` (or llama.cpp's defaults) say.
    fn post_processor(&self, kind: Kind) -> Result<(Option<TemplateProcessing>, Option<String>)> {
        let add_bos = self.add_bos.unwrap_or(match kind {
            Kind::SentencePiece => true,
            Kind::BytePairs => PreKind::from_pre(self.pre.as_deref())?.adds_bos(),
        });
        let add_eos = self.add_eos.unwrap_or(false);
        // A BOS or EOS that must be added but cannot: encoding with special tokens is then
        // an error saying why (the tokenizer still decodes, and encodes without them).
        let mut cannot: Option<String> = None;
        let mut piece = |add, k, id| match self.special_piece(add, k, id) {
            Ok(p) => p,
            Err(why) => {
                cannot.get_or_insert(why);
                None
            }
        };
        let bos = piece(add_bos, key::BOS, self.bos_id());
        let eos = piece(add_eos, key::EOS, self.eos_id());
        if bos.is_none() && eos.is_none() {
            return Ok((None, cannot));
        }
        // Built through its serialised form: the builder's string templates cannot hold
        // token texts with spaces or colons.
        let template = |seq: &str| {
            let mut pieces = Vec::new();
            let special = |t: &str| json!({"SpecialToken": {"id": t, "type_id": 0}});
            pieces.extend(bos.iter().map(|(t, _)| special(t)));
            pieces.push(json!({"Sequence": {"id": seq, "type_id": 0}}));
            pieces.extend(eos.iter().map(|(t, _)| special(t)));
            pieces
        };
        let mut pair = template("A");
        pair.extend(template("B"));
        let tokens: serde_json::Map<String, serde_json::Value> = bos
            .iter()
            .chain(eos.iter())
            .map(|(t, id)| (t.clone(), json!({"id": t, "ids": [id], "tokens": [t]})))
            .collect();
        let value = json!({
            "type": "TemplateProcessing",
            "single": template("A"),
            "pair": pair,
            "special_tokens": tokens,
        });
        serde_json::from_value(value)
            .map(|p| (Some(p), cannot))
            .map_err(|e| Error::tokenizer_spec(key::BOS, e.to_string()))
    }

    /// `(text, id)` of a token the post-processor adds, when `add` says so; the reason
    /// it cannot be added when its id is missing or outside the token list.
    fn special_piece(
        &self,
        add: bool,
        k: &'static str,
        id: Option<u32>,
    ) -> std::result::Result<Option<(String, u32)>, String> {
        if !add {
            return Ok(None);
        }
        let Some(id) = id else {
            return Err(format!("{k} is missing, but the tokenizer must add it"));
        };
        let text = self.token_text(Some(id)).ok_or_else(|| {
            format!(
                "{k} {id} is outside the vocabulary of {} tokens, but the tokenizer must add it",
                self.tokens.len()
            )
        })?;
        Ok(Some((text.to_string(), id)))
    }
}

/// The value of an optional key read by `get`: `None` when absent, an error when present
/// with the wrong type.
fn optional<'m, T>(
    md: &'m Metadata,
    k: &str,
    get: impl Fn(&'m Metadata, &str) -> Result<T>,
) -> Result<Option<T>> {
    if md.contains_key(k) {
        get(md, k).map(Some)
    } else {
        Ok(None)
    }
}

/// `tokenizer.ggml.token_type`: `i32` as llama.cpp writes it; other integer arrays
/// (some converters write `u32` or `i8`) are accepted when every value fits `i32`.
fn token_types(md: &Metadata, k: &str) -> Result<Option<Vec<i32>>> {
    if !md.contains_key(k) {
        return Ok(None);
    }
    let bad = |found: String| Error::GgufInput {
        field: format!("metadata key '{k}'"),
        msg: format!("expected an array of i32 token types, found {found}"),
    };
    fn narrow<T: Copy + Into<i128>>(v: &[T], bad: impl Fn(String) -> Error) -> Result<Vec<i32>> {
        v.iter()
            .map(|&x| {
                let x: i128 = x.into();
                i32::try_from(x).map_err(|_| bad(format!("the value {x}")))
            })
            .collect()
    }
    let types = match md.get_array(k)? {
        Array::I32(v) => v.clone(),
        Array::U8(v) => narrow(v, bad)?,
        Array::I8(v) => narrow(v, bad)?,
        Array::U16(v) => narrow(v, bad)?,
        Array::I16(v) => narrow(v, bad)?,
        Array::U32(v) => narrow(v, bad)?,
        Array::U64(v) => narrow(v, bad)?,
        Array::I64(v) => narrow(v, bad)?,
        other @ (Array::F32(_)
        | Array::Bool(_)
        | Array::String(_)
        | Array::Array(_)
        | Array::F64(_)) => return Err(bad(format!("an array of {}", other.element_type()))),
    };
    Ok(Some(types))
}

struct AddedTokens {
    special: Vec<AddedToken>,
    user: Vec<AddedToken>,
}

/// What a Hugging Face `tokenizer.json` says, read the way llama.cpp's converter reads it.
struct HfTokenizer<'a> {
    json: &'a serde_json::Value,
    tokens: Vec<String>,
    /// Ids of special and of non-special added tokens.
    special: HashSet<u32>,
    user: HashSet<u32>,
    bos: Option<u32>,
}

impl TokenizerSpec {
    /// The GGUF tokenizer metadata of a Hugging Face `tokenizer.json`, converted as
    /// llama.cpp's `convert_hf_to_gguf.py` converts a vocabulary (and as
    /// `scripts/make-tokenizer-vectors.py` does for the test vectors):
    /// - byte-level BPE (Llama 3 style) becomes `"gpt2"`: tokens by id, merges as
    ///   `"left right"`, control type for special added tokens, user-defined for the other
    ///   added ones, the pre-tokenizer type from the file's pre-tokenizer (`gpt-2` for a
    ///   plain ByteLevel, `llama-bpe` for Llama 3's split, `smollm` for single digits);
    /// - SentencePiece-style BPE (a Metaspace pre-tokenizer or byte fallback, Llama 2
    ///   style) becomes `"llama"`: a piece's score orders its merges (`-rank` of the merge
    ///   that makes it, single characters below all merges), `<0xXX>` pieces are byte
    ///   tokens, the unknown token has the unknown type.
    ///
    /// BOS is the post-processor's leading special token (`add_bos` when there is one);
    /// `eos_ids` (config.json's `eos_token_id`) give EOS and, when there are two, EOT.
    pub fn from_hf_tokenizer_json(text: &str, eos_ids: &[u32]) -> Result<TokenizerSpec> {
        let json: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::model(format!("tokenizer.json: not valid JSON: {e}")))?;
        let hf = HfTokenizer::read(&json)?;
        let model = &json["model"];
        let spm = json["pre_tokenizer"]["type"] == "Metaspace" || model["byte_fallback"] == true;
        let mut spec = if spm { hf.spm_spec()? } else { hf.bpe_spec()? };
        spec.add_bos = Some(hf.bos.is_some());
        spec.add_eos = Some(false);
        if let Some(&e) = eos_ids.first() {
            spec.eos = Some(e);
        }
        if !spm {
            spec.eot = eos_ids.get(1).copied();
        }
        Ok(spec)
    }
}

/// The merges of a BPE model as `"left right"` strings.
fn hf_merges(model: &serde_json::Value) -> Result<Vec<String>> {
    let bad = || Error::model("tokenizer.json: field 'model.merges' must be a list of pairs");
    let list = model["merges"].as_array().ok_or_else(bad)?;
    list.iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Ok(s.clone()),
            serde_json::Value::Array(p) => match (p.first(), p.get(1)) {
                (Some(serde_json::Value::String(a)), Some(serde_json::Value::String(b))) => {
                    Ok(format!("{a} {b}"))
                }
                (Some(_), Some(_)) | (None, _) | (Some(_), None) => Err(bad()),
            },
            serde_json::Value::Null
            | serde_json::Value::Bool(_)
            | serde_json::Value::Number(_)
            | serde_json::Value::Object(_) => Err(bad()),
        })
        .collect()
}

impl<'a> HfTokenizer<'a> {
    fn read(json: &'a serde_json::Value) -> Result<HfTokenizer<'a>> {
        let bad = |msg: &str| Error::model(format!("tokenizer.json: {msg}"));
        if json["model"]["type"] != "BPE" {
            return Err(bad("only BPE models ('model.type': 'BPE') are supported"));
        }
        let vocab = json["model"]["vocab"]
            .as_object()
            .ok_or_else(|| bad("field 'model.vocab' is missing"))?;
        let mut by_id: Vec<Option<String>> = Vec::new();
        let mut put = |text: &str, id: u64| -> Result<()> {
            let id = usize::try_from(id).map_err(|_| bad("token id too large"))?;
            if id >= by_id.len() {
                by_id.resize(id + 1, None);
            }
            by_id[id] = Some(text.to_string());
            Ok(())
        };
        for (text, id) in vocab {
            put(
                text,
                id.as_u64()
                    .ok_or_else(|| bad("a vocab id is not an integer"))?,
            )?;
        }
        let (mut special, mut user) = (HashSet::new(), HashSet::new());
        for t in json["added_tokens"].as_array().into_iter().flatten() {
            let (Some(id), Some(text)) = (t["id"].as_u64(), t["content"].as_str()) else {
                return Err(bad("an added token lacks 'id' or 'content'"));
            };
            put(text, id)?;
            let set = if t["special"] == true {
                &mut special
            } else {
                &mut user
            };
            set.insert(id as u32);
        }
        let tokens: Vec<String> = by_id
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                t.ok_or_else(|| bad(&format!("token ids are not contiguous: no token {i}")))
            })
            .collect::<Result<_>>()?;
        let bos = hf_bos(json, &tokens);
        Ok(HfTokenizer {
            json,
            tokens,
            special,
            user,
            bos,
        })
    }

    fn bpe_spec(&self) -> Result<TokenizerSpec> {
        let types = (0..self.tokens.len() as u32)
            .map(|i| {
                if self.special.contains(&i) {
                    3
                } else if self.user.contains(&i) {
                    4
                } else {
                    1
                }
            })
            .collect();
        Ok(TokenizerSpec {
            model: "gpt2".into(),
            pre: Some(hf_pre_type(&self.json["pre_tokenizer"])?),
            tokens: self.tokens.clone(),
            token_types: Some(types),
            merges: Some(hf_merges(&self.json["model"])?),
            bos: Some(self.bos.unwrap_or(0)),
            ..TokenizerSpec::default()
        })
    }

    fn spm_spec(&self) -> Result<TokenizerSpec> {
        let unk_text = self.json["model"]["unk_token"].as_str();
        let types: Vec<i32> = (0..self.tokens.len())
            .map(|i| {
                let t = &self.tokens[i];
                let byte = t.len() == 6
                    && t.starts_with("<0x")
                    && t.ends_with('>')
                    && t[3..5]
                        .chars()
                        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_lowercase());
                if Some(t.as_str()) == unk_text {
                    2
                } else if self.special.contains(&(i as u32)) {
                    3
                } else if self.user.contains(&(i as u32)) {
                    4
                } else if byte {
                    6
                } else {
                    1
                }
            })
            .collect();
        let merges = hf_merges(&self.json["model"])?;
        let mut rank: HashMap<String, usize> = HashMap::new();
        for (r, m) in merges.iter().enumerate() {
            rank.entry(m.replacen(' ', "", 1)).or_insert(r);
        }
        let scores = self
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| match (types[i], rank.get(t)) {
                (1, Some(&r)) => -(r as f32),
                (1, None) => -((merges.len() + i) as f32),
                _ => 0.0,
            });
        let find = |s: &str| self.tokens.iter().position(|t| t == s).map(|i| i as u32);
        Ok(TokenizerSpec {
            model: "llama".into(),
            tokens: self.tokens.clone(),
            scores: Some(scores.collect()),
            token_types: Some(types),
            bos: Some(self.bos.unwrap_or(1)),
            eos: find("</s>"),
            unk: unk_text.and_then(find),
            add_space_prefix: Some(true),
            ..TokenizerSpec::default()
        })
    }
}

/// The post-processor's leading special token (the BOS it adds), looking inside a
/// `Sequence` of processors too.
fn hf_bos(json: &serde_json::Value, tokens: &[String]) -> Option<u32> {
    let post = &json["post_processor"];
    let template = match post["type"].as_str() {
        Some("Sequence") => post["processors"]
            .as_array()?
            .iter()
            .find(|p| p["type"] == "TemplateProcessing")?,
        Some(_) | None => post,
    };
    let first = template["single"].as_array()?.first()?;
    let name = first["SpecialToken"]["id"].as_str()?;
    let id = template["special_tokens"][name]["ids"][0].as_u64();
    id.map(|i| i as u32)
        .or_else(|| tokens.iter().position(|t| t == name).map(|i| i as u32))
}

/// llama.cpp's pre-tokenizer type for a byte-level pre-tokenizer.
fn hf_pre_type(pre: &serde_json::Value) -> Result<String> {
    let ty = pre["type"].as_str().unwrap_or("");
    let splits = || pre["pretokenizers"].as_array().into_iter().flatten();
    let found = match ty {
        "ByteLevel" if pre["use_regex"] != false => Some("gpt-2"),
        "Sequence" if splits().any(|p| p["type"] == "Digits" && p["individual_digits"] == true) => {
            Some("smollm")
        }
        "Sequence"
            if splits().any(|p| {
                p["pattern"]["Regex"]
                    .as_str()
                    .is_some_and(|r| r.contains(r"\p{N}{1,3}"))
            }) =>
        {
            Some("llama-bpe")
        }
        // Qwen2's split: the Llama 3 regex with single digits
        "Sequence"
            if splits().any(|p| {
                p["pattern"]["Regex"]
                    .as_str()
                    .is_some_and(|r| r.contains(r"\p{L}+|\p{N}|"))
            }) =>
        {
            Some("qwen2")
        }
        _ => None,
    };
    found.map(str::to_string).ok_or_else(|| {
        let text = pre.to_string();
        Error::model(format!(
            "tokenizer.json: no GGUF pre-tokenizer type for pre_tokenizer {}",
            &text[..text.len().min(200)]
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn pieces(pre: &str, text: &str) -> Vec<String> {
        let seq = PreKind::from_pre(Some(pre))
            .unwrap()
            .pre_tokenizer()
            .unwrap();
        let mut s = PreTokenizedString::from(text);
        seq.pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(p, _, _)| p.to_string())
            .collect()
    }

    /// Numbers: groups of up to three (Llama 3), one digit at a time (Qwen 2, SmolLM), whole
    /// runs (GPT-2); contractions are case-insensitive only in the newer patterns.
    #[test]
    fn pre_tokenizer_types_split_as_llama_cpp() {
        assert_eq!(pieces("llama-bpe", "12345"), ["123", "45"]);
        assert_eq!(pieces("qwen2", "12345"), ["1", "2", "3", "4", "5"]);
        assert_eq!(pieces("smollm", "12345"), ["1", "2", "3", "4", "5"]);
        assert_eq!(pieces("gpt-2", "12345"), ["12345"]);
        assert_eq!(pieces("llama-bpe", "IT'S"), ["IT", "'S"]);
        assert_eq!(pieces("gpt-2", "IT'S"), ["IT", "'", "S"]);
        // The byte-level alphabet: a space is 'Ġ'.
        assert_eq!(pieces("gpt-2", "a b"), ["a", "Ġb"]);
    }

    fn spm(tokens: &[&str], scores: &[f32]) -> TokenizerSpec {
        let types = tokens
            .iter()
            .map(|t| match *t {
                "<unk>" => 2,
                "<s>" | "</s>" => 3,
                t if t.starts_with("<0x") => 6,
                _ => 1,
            })
            .collect();
        TokenizerSpec {
            model: "llama".into(),
            tokens: tokens.iter().map(|t| t.to_string()).collect(),
            scores: Some(scores.to_vec()),
            token_types: Some(types),
            ..TokenizerSpec::default()
        }
    }

    const SPM_TOKENS: [&str; 10] = [
        "<unk>", "<s>", "</s>", "<0x41>", "\u{2581}", "a", "b", "c", "ab", "bc",
    ];

    /// The pair whose merged piece scores higher merges first; BOS is added by default
    /// and a `▁` goes in front of the text; characters without a piece use byte tokens.
    #[test]
    fn sentencepiece_merges_follow_scores() {
        let ab_first = spm(&SPM_TOKENS, &[0., 0., 0., 0., -9., -9., -9., -9., -1., -2.]);
        let tok = ab_first.build().unwrap();
        assert_eq!(tok.encode("abc").unwrap(), [1, 4, 8, 7]);
        let bc_first = spm(&SPM_TOKENS, &[0., 0., 0., 0., -9., -9., -9., -9., -2., -1.]);
        let tok = bc_first.build().unwrap();
        assert_eq!(tok.encode("abc").unwrap(), [1, 4, 5, 9]);
        assert_eq!(tok.encode("A").unwrap(), [1, 4, 3]);
        assert_eq!(tok.decode(&[1, 4, 5, 9, 4, 3]).unwrap(), "abc A");
        let plain = TokenizerSpec {
            add_bos: Some(false),
            add_space_prefix: Some(false),
            ..bc_first
        };
        assert_eq!(plain.build().unwrap().encode("abc").unwrap(), [5, 9]);
    }

    #[test]
    fn stop_ids_cover_eos_eot_and_end_of_turn_controls() {
        let mut spec = spm(&SPM_TOKENS, &[0.0; 10]);
        spec.tokens[3] = "<|im_end|>".into();
        spec.token_types.as_mut().unwrap()[3] = 3;
        spec.eot = Some(7);
        // EOS defaults to 2 for SentencePiece vocabularies.
        assert_eq!(spec.stop_ids(), [2, 3, 7]);
        assert_eq!(spec.build().unwrap().stop_ids(), [2, 3, 7]);
    }

    /// The committed test vectors' specs were made from the fixtures' tokenizer.json by
    /// scripts/make-tokenizer-vectors.py; the Rust conversion gives the same metadata.
    #[test]
    fn hf_tokenizer_json_converts_like_the_vector_script() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        for (fixture, vectors, eos) in [
            ("llama3-tiny-bf16", "llama3-tiny-gpt2", vec![1, 2]),
            ("llama2-tiny-f32", "llama2-tiny-spm", vec![2]),
        ] {
            let text = std::fs::read_to_string(root.join(fixture).join("tokenizer.json")).unwrap();
            let got = TokenizerSpec::from_hf_tokenizer_json(&text, &eos).unwrap();
            let v: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(root.join(format!("tokenizer/{vectors}.json"))).unwrap(),
            )
            .unwrap();
            let want: TokenizerSpec = serde_json::from_value(v["spec"].clone()).unwrap();
            assert_eq!(got, want, "{fixture}");
        }
        let err = TokenizerSpec::from_hf_tokenizer_json("{}", &[]).unwrap_err();
        assert!(err.to_string().contains("BPE"), "{err}");
    }
}
