//! Chat prompts: a conversation rendered with the model's Jinja chat template
//! (`tokenizer.chat_template`), the way Hugging Face's `apply_chat_template` does.
//!
//! Templates run in `minijinja` with Python string methods (`.strip()`, `.startswith()`,
//! ... through `minijinja-contrib`'s pycompat), `trim_blocks` and `lstrip_blocks` on (as in
//! transformers), loop controls, `tojson`, and these variables: `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`, and the function
//! `raise_exception(msg)`. A model without a template gets ChatML ([`CHATML`]).
//!
//! For a chat loop that keeps the conversation in the KV cache, [`ChatTemplate::append`]
//! returns only the text a new turn adds to what the cache already holds.

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use crate::error::{Error, Result, TemplateProblem};
use crate::models::text::gguf_tokenizer::TokenizerSpec;
use crate::models::text::tokenizer::Tokenizer;

/// The built-in template for models that carry none: ChatML
/// (`<|im_start|>role\ncontent<|im_end|>\n` per message).
pub const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n\
{{ message.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// Steps (minijinja "fuel": one per VM instruction) a rendering may take. A real template
/// takes tens per message, so this allows conversations of over 100,000 messages while a
/// template that loops without end fails in about a second.
pub const MAX_TEMPLATE_STEPS: u64 = 20_000_000;

/// Bytes of text a rendering may produce: far past any model's context (a million tokens
/// are a few MiB of text), while a template that repeats text without bound stops early.
pub const MAX_RENDERED_BYTES: usize = 64 << 20;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// `"system"`, `"user"` or `"assistant"` (templates may accept others).
    pub role: String,
    /// The text of the turn.
    pub content: String,
}

impl Message {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// What a new turn adds to an earlier rendering (see [`ChatTemplate::append`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Continuation {
    /// The earlier rendering is a prefix of the new one: this is the text after it.
    Suffix(String),
    /// The template rewrote earlier text (some templates do, e.g. dropping old reasoning):
    /// this is the whole new rendering, to be prefilled from scratch.
    Diverged(String),
}

/// The error `raise_exception` produces; recognised to report [`TemplateProblem::Raised`].
#[derive(Debug)]
struct Raised;

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("raise_exception")
    }
}

impl std::error::Error for Raised {}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg).with_source(Raised))
}

/// A compiled chat template with its BOS/EOS token texts.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source` (ChatML when `None`); `bos_token`/`eos_token` are the texts the
    /// template sees under those names.
    pub fn new(source: Option<&str>, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(TemplateProblem::Syntax, &e))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(MAX_TEMPLATE_STEPS));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.unwrap_or(CHATML).to_string())
            .map_err(|e| template_error(TemplateProblem::Syntax, &e))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template of GGUF tokenizer metadata (`tokenizer.chat_template`), with its BOS
    /// and EOS texts; ChatML when the metadata has no template.
    pub fn from_spec(spec: &TokenizerSpec) -> Result<ChatTemplate> {
        ChatTemplate::new(
            spec.chat_template.as_deref(),
            spec.bos_text().unwrap_or(""),
            spec.eos_text().unwrap_or(""),
        )
    }

    /// The text the template sees as `bos_token`.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The token ids of a whole rendering `text`: the tokenizer's BOS is added unless the
    /// template wrote it.
    pub fn encode(&self, tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
        let has_bos = !self.bos_token.is_empty() && text.starts_with(&self.bos_token);
        tok.encode_with(text, !has_bos)
    }

    /// The prompt text of `messages`; with `add_generation_prompt` it ends where the
    /// assistant's reply starts.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error(TemplateProblem::Render, &e))?;
        let ctx = minijinja::context! {
            messages => Value::from(Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        let mut out = LimitedText::default();
        match template.render_captured_to(ctx, &mut out) {
            Ok(_) => String::from_utf8(out.text).map_err(|_| Error::ChatTemplate {
                problem: TemplateProblem::Render,
                detail: "the rendered text is not UTF-8".into(),
            }),
            Err(_) if out.over => Err(Error::ChatTemplate {
                problem: TemplateProblem::TooLong,
                detail: format!("more than {MAX_RENDERED_BYTES} bytes of text"),
            }),
            Err(e) => {
                let raised = std::error::Error::source(&e).is_some_and(|s| s.is::<Raised>());
                let problem = if raised {
                    TemplateProblem::Raised
                } else if e.kind() == ErrorKind::OutOfFuel {
                    TemplateProblem::TooManySteps
                } else {
                    TemplateProblem::Render
                };
                Err(template_error(problem, &e))
            }
        }
    }

    /// The text to feed after `rendered`, the text the model has already seen (an earlier
    /// rendering plus the reply generated after it, stop token included), so that the
    /// model's context equals the rendering of the whole of `messages`.
    pub fn append(
        &self,
        rendered: &str,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Continuation> {
        let full = self.render(messages, add_generation_prompt)?;
        Ok(match full.strip_prefix(rendered) {
            Some(suffix) => Continuation::Suffix(suffix.to_string()),
            None => Continuation::Diverged(full),
        })
    }
}

/// A rendering's output, refused past [`MAX_RENDERED_BYTES`].
#[derive(Default)]
struct LimitedText {
    text: Vec<u8>,
    over: bool,
}

impl std::io::Write for LimitedText {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > MAX_RENDERED_BYTES {
            self.over = true;
            return Err(std::io::Error::other("rendered text too long"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn template_error(problem: TemplateProblem, e: &minijinja::Error) -> Error {
    let mut detail = match e.detail() {
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    };
    if let Some(line) = e.line() {
        detail.push_str(&format!(" (line {line})"));
    }
    Error::ChatTemplate { problem, detail }
}
