//! `graft chat`: an interactive conversation on stdin/stdout (see
//! `graft::models::text::chat_session`).

use std::io::IsTerminal;
use std::path::Path;

use graft::models::text::chat::ChatTemplate;
use graft::models::text::chat_session::{ChatSession, LlamaOn};
use graft::models::{text::tokenizer, Tokenizer};
use graft::{Error, Result};

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
            "{}: chat needs the model's tokenizer (tokenizer.json, or tokenizer.ggml.* metadata)",
            path.display()
        ))
    })?;
    let template = found.template.compile()?;
    Ok((found.tokenizer, template))
}

/// Runs `graft chat`.
pub fn run(a: Args) -> Result<()> {
    let path = a.model.path()?;
    let (tok, template) = chat_parts(&path)?;
    let mut be = a.model.open_backend()?;
    let be = be.as_mut();
    let mut model = a.model.load(&path, be, None, a.quiet)?;
    let sampler = a.sampling.sampler(model.config().vocab_size)?;
    let on = LlamaOn {
        model: &mut model,
        be,
    };
    let mut session = ChatSession::new(on, tok, template, sampler, a.n, a.system)?;
    let stdin = std::io::stdin();
    if !a.quiet && stdin.is_terminal() {
        eprintln!(
            "chatting with {} (context {} tokens). /reset starts a new conversation, /exit or Ctrl-D quits.",
            path.display(),
            session.model().model.cache().ctx
        );
    }
    let mut input = stdin.lock();
    let mut out = std::io::stdout().lock();
    session.repl(&mut input, &mut out)?;
    if !a.quiet {
        let (replies, tokens) = session.totals();
        eprintln!("chat: {replies} replies, {tokens} tokens generated");
    }
    Ok(())
}
