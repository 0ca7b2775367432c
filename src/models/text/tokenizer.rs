//! Tokenizer glue: a model folder's `tokenizer.json`, or GGUF tokenizer metadata (see
//! [`crate::models::text::gguf_tokenizer::TokenizerSpec`]), through the `tokenizers` crate.
//!
//! Encoding adds special tokens the way the file's post-processor says (a BOS in front
//! for Llama 2 and 3). Decoding streams: [`TokenStream`] returns the text each new token
//! adds, holding back pieces that end inside a UTF-8 sequence (byte-level tokens of a
//! multi-byte character) until the character is complete, and keeping earlier tokens as
//! context so word-leading spaces come out right.
//!
//! [`for_model`] finds a model's tokenizer and chat template wherever the model keeps
//! them: the metadata of a `.gguf` file (only the metadata is read, no weights), or a
//! folder's `tokenizer.json` and `tokenizer_config.json`.

use std::path::Path;

use tokenizers::{
    DecodeStream, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper,
    PreTokenizerWrapper,
};

use crate::error::{Error, Result};
use crate::models::text::chat::ChatTemplate;
use crate::models::text::gguf_tokenizer::{TokenizerSpec, END_OF_TURN_TEXTS};

/// Whether a special token's text marks the end of a text or of a turn.
fn is_end_of_text(text: &str) -> bool {
    END_OF_TURN_TEXTS.contains(&text) || matches!(text, "</s>" | "<|end_of_text|>")
}

pub use crate::models::load::safetensors::{TOKENIZER_CONFIG_FILE, TOKENIZER_FILE};

/// The GGUF key that names the tokenizer kind; a file without it has no tokenizer.
const GGUF_TOKENIZER_KEY: &str = "tokenizer.ggml.model";

/// A tokenizer: from a Hugging Face `tokenizer.json` or from GGUF metadata.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Where it came from (a path), for error messages.
    origin: String,
    /// Ids that end generation, sorted.
    stop: Vec<u32>,
    /// Why the special tokens this tokenizer must add around a text cannot be added (a
    /// GGUF tokenizer whose BOS id is outside its vocabulary), if so: encoding with them
    /// is then an error saying so.
    cannot_add: Option<String>,
}

impl Tokenizer {
    /// Reads a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let bytes = crate::files::read_regular(path)?;
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
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
            cannot_add: None,
        }
    }

    /// The tokenizer with `why` its special tokens cannot be added, if they cannot.
    pub(crate) fn cannot_add_special(self, why: Option<String>) -> Self {
        Tokenizer {
            cannot_add: why,
            ..self
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
        if path.exists() {
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
        self.encode_with(text, true)
    }

    /// Token ids of `text`; the special tokens the tokenizer adds around a text (BOS,
    /// EOS) only when `add_special` (off for text that continues a sequence).
    pub fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        if let (true, Some(why)) = (add_special, &self.cannot_add) {
            return Err(Error::model(format!(
                "{}: cannot encode a text with its special tokens: {why}; give token ids (--token-ids) or encode without them (tokenize --no-bos)",
                self.origin
            )));
        }
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| self.err("cannot encode", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Whether `id` is a special (control) token such as BOS or `<|im_end|>`.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
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

/// The chat template of a model, not yet compiled: its source (ChatML when `None`) and
/// the BOS/EOS texts it sees.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateSource {
    /// The Jinja source; `None` for the built-in ChatML.
    pub source: Option<String>,
    /// The text of the BOS token (`bos_token` in the template).
    pub bos_token: String,
    /// The text of the EOS token (`eos_token` in the template).
    pub eos_token: String,
}

impl TemplateSource {
    /// Compiles the template.
    pub fn compile(&self) -> Result<ChatTemplate> {
        ChatTemplate::new(self.source.as_deref(), &self.bos_token, &self.eos_token)
    }
}

/// A model's tokenizer and chat template (see [`for_model`]).
pub struct ModelTokenizer {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template (compiled on demand: a model whose template does not parse can
    /// still be tokenized).
    pub template: TemplateSource,
}

/// The tokenizer of the model at `path`: from the GGUF metadata when `path` is a file
/// (only the metadata is read; a file that is not GGUF is an error), from `tokenizer.json`
/// when it is a folder, with the chat template of `tokenizer_config.json` (ChatML when it
/// has none). `None` when the model carries no tokenizer.
pub fn for_model(path: &Path) -> Result<Option<ModelTokenizer>> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        return from_folder(path);
    }
    let file = crate::models::load::gguf::open_model_file(path)?;
    let md = file.metadata();
    if !md.contains_key(GGUF_TOKENIZER_KEY) {
        return Ok(None);
    }
    let spec = TokenizerSpec::from_gguf(md)?;
    let tokenizer = spec.build()?;
    let template = TemplateSource {
        source: spec.chat_template.clone(),
        bos_token: spec.bos_text().unwrap_or("").to_string(),
        eos_token: spec.eos_text().unwrap_or("").to_string(),
    };
    Ok(Some(ModelTokenizer {
        tokenizer,
        template,
    }))
}

/// `tokenizer.json` and `tokenizer_config.json` of a Hugging Face model folder.
fn from_folder(dir: &Path) -> Result<Option<ModelTokenizer>> {
    let Some(tokenizer) = Tokenizer::from_dir(dir)? else {
        return Ok(None);
    };
    let config = dir.join(TOKENIZER_CONFIG_FILE);
    let template = if config.exists() {
        template_of_config(&config)?
    } else {
        TemplateSource::default()
    };
    Ok(Some(ModelTokenizer {
        tokenizer,
        template,
    }))
}

/// The chat template and BOS/EOS texts of a `tokenizer_config.json`. `chat_template` is
/// a string or a list of `{"name", "template"}` (the one named `default` is used);
/// `bos_token`/`eos_token` are strings or `{"content": ...}` objects.
fn template_of_config(path: &Path) -> Result<TemplateSource> {
    let text = crate::files::read_regular_to_string(path)?;
    let bad = |what: &str| Error::model(format!("{}: {what}", path.display()));
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(&format!("not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(bad("expected a JSON object"));
    }
    let source = match v.get("chat_template") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(name))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
            };
            Some(
                named("default")
                    .ok_or_else(|| bad("chat_template lists no template named 'default'"))?
                    .to_string(),
            )
        }
        Some(_) => return Err(bad("chat_template is neither a string nor a list")),
    };
    let token = |k: &str| {
        let t = v.get(k);
        t.and_then(|t| t.as_str())
            .or_else(|| t.and_then(|t| t.get("content")).and_then(|c| c.as_str()))
            .unwrap_or("")
            .to_string()
    };
    Ok(TemplateSource {
        source,
        bos_token: token("bos_token"),
        eos_token: token("eos_token"),
    })
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

    fn config_file(tag: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("graft-tokcfg-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(TOKENIZER_CONFIG_FILE);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// `chat_template` as a string or as a named list; BOS/EOS as strings or objects.
    #[test]
    fn tokenizer_config_templates() {
        let path = config_file(
            "str",
            r#"{"chat_template": "{{ bos_token }}x", "bos_token": "<s>",
                "eos_token": {"content": "</s>", "special": true}}"#,
        );
        let t = template_of_config(&path).unwrap();
        assert_eq!(t.source.as_deref(), Some("{{ bos_token }}x"));
        assert_eq!(
            (t.bos_token.as_str(), t.eos_token.as_str()),
            ("<s>", "</s>")
        );
        assert_eq!(t.compile().unwrap().render(&[], false).unwrap(), "<s>x");
        let path = config_file(
            "list",
            r#"{"chat_template": [{"name": "tool_use", "template": "t"},
                {"name": "default", "template": "d"}]}"#,
        );
        assert_eq!(
            template_of_config(&path).unwrap().source.as_deref(),
            Some("d")
        );
        let path = config_file("none", "{}");
        assert_eq!(
            template_of_config(&path).unwrap(),
            TemplateSource::default()
        );
        let path = config_file("bad", "{\"chat_template\": 3}");
        assert!(template_of_config(&path).is_err());
        let path = config_file("json", "{");
        let e = template_of_config(&path).unwrap_err().to_string();
        assert!(e.contains(TOKENIZER_CONFIG_FILE), "{e}");
    }

    /// A folder without tokenizer.json has no tokenizer; one with it gets ChatML.
    #[test]
    fn for_model_reads_folders() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama3-tiny-bf16");
        let found = for_model(&dir).unwrap().unwrap();
        assert_eq!(found.template, TemplateSource::default());
        assert_eq!(found.tokenizer.stop_ids(), [1, 2]);
        let empty = std::env::temp_dir().join(format!("graft-tokcfg-{}-empty", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        assert!(for_model(&empty).unwrap().is_none());
    }
}
