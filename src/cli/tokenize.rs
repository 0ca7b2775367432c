//! `graft tokenize`: the token ids of a text, like llama.cpp's `llama-tokenize`.

use std::path::PathBuf;

use serde_json::json;

use graft::models::text::tokenizer::{self, Tokenizer};
use graft::{Error, Result};

use super::model_args::model_path;
use super::print_out;

/// Arguments of `graft tokenize`.
#[derive(clap::Args)]
pub struct Args {
    /// A `.gguf` file (only its metadata is read) or a Hugging Face model folder
    /// (`tokenizer.json`); default: the default model, SmolLM2-135M-Instruct Q4_1, pulled
    /// into the cache on first use.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The text to tokenize.
    #[arg(long)]
    text: String,
    /// Print `{"ids": [...]}` instead of one `id -> 'piece'` line per token.
    #[arg(long)]
    json: bool,
    /// Do not add the special tokens the tokenizer puts around a text (BOS, EOS).
    #[arg(long)]
    no_bos: bool,
    /// Tokenize the text of control tokens (`<|im_end|>`) as plain text.
    #[arg(long)]
    no_parse_special: bool,
}

/// Runs `graft tokenize`.
pub fn run(a: Args) -> Result<()> {
    let path = model_path(a.model)?;
    let Some(found) = tokenizer::for_model(&path)? else {
        return Err(Error::model(format!(
            "{}: the model has no tokenizer (no tokenizer.json, or no tokenizer.ggml.* metadata)",
            path.display()
        )));
    };
    let mut tok = found.tokenizer;
    tok.set_parse_special(!a.no_parse_special);
    let ids = tok.encode_with(&a.text, !a.no_bos)?;
    if a.json {
        return print_out(&format!("{}\n", json!({ "ids": ids })));
    }
    print_out(&lines(&tok, &ids)?)
}

/// One `{id:>6} -> '{piece}'` line per token, as `llama-tokenize` prints them: the piece
/// is the text the token adds when the ids are decoded in order (empty while a UTF-8
/// character spread over byte tokens is incomplete), or the token's own text for a
/// special token. Control characters in a piece are escaped (`\n`, `\t`, `\u{1b}`) so
/// that each token stays on its line.
fn lines(tok: &Tokenizer, ids: &[u32]) -> Result<String> {
    let mut stream = tok.stream(&[])?;
    let mut out = String::new();
    for &id in ids {
        let text = stream.next(id)?.unwrap_or_default();
        let piece = if tok.is_special(id) {
            tok.id_to_token(id).unwrap_or_default()
        } else {
            text
        };
        out.push_str(&format!("{id:>6} -> '{}'\n", escape_controls(&piece)));
    }
    Ok(out)
}

/// `s` with its control characters escaped as Rust writes them.
fn escape_controls(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().collect()
            } else {
                c.to_string()
            }
        })
        .collect()
}
