//! `graft generate`: stream a continuation of a prompt, or with `--chat` one turn of a
//! chat (the prompt as the user's message, rendered with the model's chat template).

use std::path::{Path, PathBuf};

use serde_json::json;

use graft::backend::Backend;
use graft::models::runtime::model::default_ctx;
use graft::models::runtime::sampling::Resolved;
use graft::models::text::chat_session::{ChatSession, EndReason, LlamaOn};
use graft::models::{
    text::tokenizer, Generation, Model, QuantPlan, SamplingParams, Stop, Tokenizer,
};
use graft::{Error, Result};

use super::chat::{chat_parts, model_path};
use super::dump::preset;
use super::{
    load_model, make_backend, print_out, read_prompt, sampler_for, BackendKind, CacheArgs,
    DTypeArg, SamplingArgs,
};

/// Arguments of `graft generate`.
#[derive(clap::Args)]
pub struct Args {
    /// A `.gguf` file or a Hugging Face model folder (config.json, safetensors weights,
    /// tokenizer.json); default: the default model, SmolLM2-135M-Instruct Q4_1, pulled
    /// into the cache on first use.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Instead of --model: a preset shape with seeded random weights made on the device
    /// (llama2-7b, mistral-7b, ...; --quantize picks their dtype, f16 when absent), for
    /// long runs and memory checks; needs --token-ids.
    #[arg(long, conflicts_with_all = ["model", "chat", "prompt", "file"], requires = "token_ids")]
    preset: Option<String>,
    /// Prompt text (needs the folder's tokenizer.json; BOS is added as it says).
    #[arg(long, required_unless_present_any = ["token_ids", "file"], conflicts_with_all = ["token_ids", "file"])]
    prompt: Option<String>,
    /// Read the prompt text from a file (`-` for standard input), for prompts longer than
    /// a command line.
    #[arg(short = 'f', long, conflicts_with = "token_ids")]
    file: Option<PathBuf>,
    /// Prompt token ids, comma-separated (works without a tokenizer).
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
    /// Treat the prompt text (--prompt or --file) as a user's chat message: render it with the model's chat template
    /// and print the reply (up to -n tokens, or the end of the turn).
    #[arg(long, conflicts_with_all = ["json", "token_ids"])]
    chat: bool,
    /// With --chat: a system message before the prompt.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Tokens to generate (fewer if an end-of-sequence token comes first).
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    n: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// KV-cache positions (default: max_position_embeddings, at most 4096).
    #[arg(long)]
    ctx: Option<usize>,
    /// When the context is full, keep its last half (prefilled again) and go on, so that
    /// -n may exceed --ctx; without it, prompt + -n must fit the context.
    #[arg(long, conflicts_with = "chat")]
    context_shift: bool,
    /// Go on past end-of-sequence tokens to -n tokens.
    #[arg(long, conflicts_with = "chat")]
    ignore_eos: bool,
    /// Quantize (or convert) the matrices while loading: one type for all, or ggml's
    /// q4_k_m / q5_k_m mixes (norms stay F32).
    #[arg(long, value_enum)]
    quantize: Option<DTypeArg>,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    backend: BackendKind,
    /// Split the model over N devices (tensor parallelism: heads and the MLP divided,
    /// partial sums joined by all_reduce); on the CPU backend, N simulated devices.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Print one JSON object (ids, text, speeds, plan counters) instead of streaming.
    #[arg(long)]
    json: bool,
    /// No progress bar and no statistics on stderr.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    cache: CacheArgs,
}

/// Runs `graft generate`.
pub fn run(a: Args) -> Result<()> {
    if a.chat {
        return run_chat(&a, &model_path(a.model.clone())?);
    }
    // a plain completion is greedy unless flags say otherwise (docs/sampling.md)
    let settings = a.sampling.resolve(None, &SamplingParams::greedy())?;
    let mut be = make_backend(a.backend, a.tp)?;
    let be = be.as_mut();
    let (mut model, tokenizer, path) = match &a.preset {
        Some(name) => {
            let cfg = preset(name)?;
            let ctx = a.ctx.unwrap_or_else(|| default_ctx(&cfg));
            let plan = QuantPlan::from(a.quantize.unwrap_or(DTypeArg::F16));
            let cache = a.cache.types();
            let model = Model::random(cfg, plan, ctx, cache, 0, be)?;
            (model, None, PathBuf::from(name))
        }
        None => {
            let path = model_path(a.model.clone())?;
            let model = load_model(&path, be, a.ctx, a.quantize, &a.cache, a.quiet || a.json)?;
            let tokenizer = tokenizer::for_model(&path)?.map(|t| t.tokenizer);
            (model, tokenizer, path)
        }
    };
    let prompt = prompt_ids(&a, tokenizer.as_ref(), &path)?;
    let mut sampler = sampler_for(&settings, &model)?;
    model.set_context_shift(a.context_shift);
    model.set_ignore_eos(a.ignore_eos);
    model.check_generation(&prompt, a.n)?;

    // Streaming: the prompt first, then each piece of text (or id) as it comes.
    let mut stream = match (&tokenizer, a.json) {
        (Some(t), false) => Some(t.stream(&prompt)?),
        _ => None,
    };
    if !a.json {
        match (&tokenizer, &a.prompt) {
            (_, Some(text)) => print_out(text)?,
            (Some(t), None) => print_out(&t.decode(&prompt)?)?,
            (None, None) => print_out(&format!("{prompt:?} ->"))?,
        }
    }
    let json = a.json;
    let g = model.generate(be, &prompt, a.n, &mut sampler, &mut |id| {
        if json {
            return Ok(());
        }
        match stream.as_mut() {
            Some(s) => match s.next(id)? {
                Some(text) => print_out(&text),
                None => Ok(()),
            },
            None => print_out(&format!(" {id}")),
        }
    })?;
    report(&a, be, &model, &prompt, &g, tokenizer.as_ref(), &settings)
}

/// The prompt's token ids: `--prompt` or `--file` encoded with the model's tokenizer, or
/// `--token-ids`.
fn prompt_ids(a: &Args, tokenizer: Option<&Tokenizer>, path: &Path) -> Result<Vec<u32>> {
    match (prompt_text(a)?, &a.token_ids) {
        (Some(text), _) => match tokenizer {
            Some(t) => t.encode(&text),
            None => Err(Error::model(format!(
                "--prompt needs a tokenizer.json in {} (or tokenizer metadata in a .gguf file); pass --token-ids instead",
                path.display()
            ))),
        },
        (None, Some(ids)) => Ok(ids.clone()),
        (None, None) => Err(Error::model("give --prompt, --file or --token-ids")),
    }
}

/// After a generation `g` of `prompt`: one JSON object on stdout (`--json`), else the
/// end of the streamed line and, unless `--quiet`, speeds and plan counters on stderr.
fn report(
    a: &Args,
    be: &dyn Backend,
    model: &Model,
    prompt: &[u32],
    g: &Generation,
    tokenizer: Option<&Tokenizer>,
    settings: &Resolved,
) -> Result<()> {
    let stats = be.stats();
    let plans = model.plan_counts();
    let stop = match g.stop {
        Stop::Eos => "eos",
        Stop::Length => "length",
    };
    if a.json {
        let text = tokenizer.map(|t| t.decode(&g.tokens)).transpose()?;
        let obj = json!({
            "backend": be.name(),
            "prompt_ids": prompt,
            "generated_ids": g.tokens,
            "text": text,
            "stop": stop,
            "prompt_tokens": g.prompt_tokens,
            "prompt_tokens_per_s": g.prompt_tokens_per_s(),
            "gen_tokens": g.tokens.len(),
            "decode_steps": g.decode_steps,
            "gen_tokens_per_s": g.gen_tokens_per_s(),
            "plans": {"prefill": plans.prefill, "decode": plans.decode},
            "captures": stats.captures,
            "replays": stats.replays,
            "eager_runs": stats.eager_runs,
            "sampling": settings.to_json(),
        });
        return print_out(&format!("{obj}\n"));
    }
    print_out("\n")?;
    if !a.quiet {
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s | generated: {} tokens (stop: {stop}), {} | plans: {} prefill, {} decode | {} backend: {} captures, {} replays",
            g.prompt_tokens,
            g.prompt_tokens_per_s(),
            g.tokens.len(),
            g.gen_tokens_per_s()
                .map_or("no decode step".into(), |t| format!("{t:.1} tok/s")),
            plans.prefill,
            plans.decode,
            be.name(),
            stats.captures,
            stats.replays
        );
    }
    Ok(())
}

/// `--chat`: one turn of a [`ChatSession`], the reply streamed to stdout.
fn run_chat(a: &Args, path: &Path) -> Result<()> {
    let (tok, template) = chat_parts(path)?;
    let settings = a.sampling.resolve(Some(path), &SamplingParams::chat())?;
    let mut be = make_backend(a.backend, a.tp)?;
    let be = be.as_mut();
    let mut model = load_model(path, be, a.ctx, a.quantize, &a.cache, a.quiet)?;
    let sampler = sampler_for(&settings, &model)?;
    let on = LlamaOn {
        model: &mut model,
        be,
    };
    let mut session = ChatSession::new(on, tok, template, sampler, a.n, a.system.clone())?;
    let prompt = prompt_text(a)?.unwrap_or_default();
    let mut failed = None;
    let end = session.turn(&prompt, |piece| {
        if failed.is_none() {
            failed = print_out(piece).err();
        }
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    if end.reason == EndReason::ContextFull && end.prefilled == 0 {
        return Err(Error::model(format!(
            "the chat prompt does not fit the context of {} tokens (--ctx)",
            session.model().model.cache().ctx
        )));
    }
    print_out("\n")?;
    if end.reason != EndReason::Stop && !a.quiet {
        if let Some(note) = session.note(&end) {
            eprintln!("{note}");
        }
    }
    Ok(())
}

/// The prompt text: `--prompt`, or the file of `--file`; `None` with `--token-ids`.
fn prompt_text(a: &Args) -> Result<Option<String>> {
    Ok(match (&a.prompt, &a.file) {
        (Some(text), _) => Some(text.clone()),
        (None, Some(path)) => Some(read_prompt(path, "--file")?),
        (None, None) => None,
    })
}
