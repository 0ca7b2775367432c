//! `graft chat`: an interactive conversation on stdin/stdout on the batched engine (see
//! `graft::engine::chat`).

use std::io::IsTerminal;
use std::path::Path;

use graft::engine::chat::ChatSession;
use graft::engine::Engine;
use graft::models::text::chat::ChatTemplate;
use graft::models::{text::tokenizer, SamplingParams, Tokenizer};
use graft::{Error, Result};

use super::engine_args::single;
use super::{ModelArgs, SamplingArgs};

/// Arguments of `graft chat`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// A system message that opens the conversation (and survives /reset).
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    n: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// No progress bar and no greeting on stderr.
    #[arg(long)]
    quiet: bool,
}

/// The tokenizer and compiled chat template of the model at `path`.
pub fn chat_parts(path: &Path) -> Result<(Tokenizer, ChatTemplate)> {
    let found = tokenizer::for_model(path)?.ok_or_else(|| {
        Error::model(format!(
            "{}: chat needs the model's tokenizer (tokenizer.json, or tokenizer.ggml.* metadata), which this model lacks; run `graft generate --token-ids` instead",
            path.display()
        ))
    })?;
    let template = found.template.compile()?;
    Ok((found.tokenizer, template))
}

/// The engine of a chat on the model at `path`: one sequence at a time, a pool of two
/// contexts (the conversation, and what the cache keeps of earlier turns).
pub fn chat_engine(m: &ModelArgs, path: &Path, quiet: bool) -> Result<Engine> {
    single(m, path, 2, quiet)
}

/// Runs `graft chat`.
pub fn run(a: Args) -> Result<()> {
    let path = a.model.path()?;
    let (tok, template) = chat_parts(&path)?;
    let settings = a.sampling.resolve(Some(&path), &SamplingParams::chat())?;
    let mut engine = chat_engine(&a.model, &path, a.quiet)?;
    let ctx = engine.ctx();
    let mut session = ChatSession::new(&mut engine, tok, template, settings.params, a.n, a.system)?;
    let stdin = std::io::stdin();
    if !a.quiet && stdin.is_terminal() {
        eprintln!(
            "chatting with {} (context {ctx} tokens). /reset starts a new conversation, /exit or Ctrl-D quits.",
            path.display()
        );
    }
    let mut input = stdin.lock();
    let mut out = std::io::stdout().lock();
    session.repl(&mut input, &mut out)?;
    let (replies, tokens) = session.totals();
    drop(session);
    if !a.quiet {
        eprintln!("chat: {replies} replies, {tokens} tokens generated");
    }
    engine.release()
}
