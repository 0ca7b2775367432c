//! `graft chat`: an interactive conversation on stdin/stdout (see
//! `graft::models::text::chat_session`).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use graft::models::text::chat::ChatTemplate;
use graft::models::text::chat_session::{ChatSession, LlamaOn};
use graft::models::{pull, text::tokenizer, SamplingParams, Tokenizer};
use graft::{Error, Result};

use super::{load_model, make_backend, sampler_for, BackendKind, CacheArgs, SamplingArgs};

/// Arguments of `graft chat`.
#[derive(clap::Args)]
pub struct Args {
    /// A `.gguf` file or a Hugging Face model folder (default: the default model,
    /// SmolLM2-135M-Instruct Q4_1, pulled into the cache on first use).
    #[arg(long)]
    model: Option<PathBuf>,
    /// A system message that opens the conversation (and survives /reset).
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    n: usize,
    /// KV-cache positions: the whole conversation must fit (default:
    /// max_position_embeddings, at most 4096).
    #[arg(long)]
    ctx: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    backend: BackendKind,
    /// Split the model over N devices (tensor parallelism: heads and the MLP divided,
    /// partial sums joined by all_reduce); on the CPU backend, N simulated devices.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// No progress bar and no greeting on stderr.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    cache: CacheArgs,
}

/// The model path: `--model`, or the default model (pulled first when missing).
pub fn model_path(model: Option<PathBuf>) -> Result<PathBuf> {
    match model {
        Some(p) => Ok(p),
        None => pull::default_model(),
    }
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
    let path = model_path(a.model)?;
    let (tok, template) = chat_parts(&path)?;
    let settings = a.sampling.resolve(Some(&path), &SamplingParams::chat())?;
    let mut be = make_backend(a.backend, a.tp)?;
    let be = be.as_mut();
    let mut model = load_model(&path, be, a.ctx, None, &a.cache, a.quiet)?;
    let sampler = sampler_for(&settings, &model)?;
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
