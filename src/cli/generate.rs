//! `graft generate`: stream a continuation of a prompt, or with `--chat` one turn of a
//! chat (the prompt as the user's message, rendered with the model's chat template), on
//! the batched engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use graft::engine::chat::{ChatSession, EndReason, TurnEnd};
use graft::engine::{Engine, Event, FinishReason, KvBudget, Request, RequestId, Stop};
use graft::models::runtime::sampling::Resolved;
use graft::models::{text::tokenizer, SamplingParams, Tokenizer};
use graft::{Error, Result};

use super::chat::{chat_engine, chat_parts};
use super::dump::{preset, preset_help};
use super::engine_args::{single, EngineArgs};
use super::sampling_args::flag_error;
use super::{print_out, read_prompt, ModelArgs, SamplingArgs};

/// Arguments of `graft generate`: the prompt is one of --prompt, --file, --token-ids.
#[derive(clap::Args)]
#[command(
    group(clap::ArgGroup::new("input").required(true).args(["prompt", "file", "token_ids"])),
    override_usage = "graft generate [--model FILE.gguf|DIR] (--prompt TEXT | -f FILE | --token-ids 1,2,3) [OPTIONS]"
)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(
        long,
        conflicts_with_all = ["model", "chat", "prompt", "file"],
        requires = "token_ids",
        help = preset_help(
            "Instead of --model, a preset shape with seeded random weights made on the device, \
             for long runs and memory checks (--quantize picks their dtype, f16 when absent; \
             needs --token-ids)"
        )
    )]
    preset: Option<String>,
    /// Prompt text (needs the folder's tokenizer.json; BOS is added as it says).
    #[arg(long, conflicts_with_all = ["token_ids", "file"])]
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
    #[arg(long, conflicts_with = "token_ids")]
    chat: bool,
    /// With --chat: a system message before the prompt.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Tokens to generate (fewer if an end-of-sequence token comes first).
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    n: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// When the context is full, keep its last half (prefilled again) and go on, so that
    /// -n may exceed --ctx; without it, prompt + -n must fit the context.
    #[arg(long, conflicts_with = "chat")]
    context_shift: bool,
    /// Go on past end-of-sequence tokens to -n tokens.
    #[arg(long, conflicts_with = "chat")]
    ignore_eos: bool,
    /// Print one JSON object (ids, text, speeds, plan counters) instead of streaming; with
    /// --chat, the reply's ids and text, why it stopped and the turn's time.
    #[arg(long)]
    json: bool,
    /// No progress bar and no statistics on stderr.
    #[arg(long)]
    quiet: bool,
}

/// Runs `graft generate`.
pub fn run(a: Args) -> Result<()> {
    let path = match &a.preset {
        Some(name) => PathBuf::from(name),
        None => a.model.path()?,
    };
    if a.chat {
        return run_chat(&a, &path);
    }
    // a plain completion is greedy unless flags say otherwise (docs/sampling.md)
    let settings = a.sampling.resolve(None, &SamplingParams::greedy())?;
    let quiet = a.quiet || a.json;
    let (mut engine, tokenizer) = match &a.preset {
        Some(name) => {
            let args = EngineArgs::single_sequence();
            let mut cfg = args.config(&a.model, &preset(name)?, None);
            cfg.kv = KvBudget::Contexts(1);
            let e = Engine::random(
                preset(name)?,
                a.model.plan(),
                0,
                a.model.open_backend()?,
                cfg,
            )?;
            (e, None)
        }
        None => {
            let e = single(&a.model, &path, 1, quiet)?;
            let t = tokenizer::for_model(&path)?.map(|t| Arc::new(t.tokenizer));
            (e, t)
        }
    };
    let prompt = prompt_ids(&a, tokenizer.as_deref(), &path)?;
    if let Some(t) = &tokenizer {
        engine.set_detokenizer(t.clone());
    }
    let req = Request {
        prompt: prompt.clone(),
        sampling: settings.params.clone(),
        max_tokens: Some(a.n),
        stop: Stop {
            ignore_eos: a.ignore_eos,
            context_shift: a.context_shift,
            ..Stop::default()
        },
        logprobs: None,
    };
    let id = engine.add(req).map_err(cli_error)?;
    if !a.json {
        match (&tokenizer, &a.prompt) {
            (_, Some(text)) => print_out(text)?,
            (Some(t), None) => print_out(&t.decode(&prompt)?)?,
            (None, None) => print_out(&format!("{prompt:?} ->"))?,
        }
    }
    let run = stream(&mut engine, id, !a.json, tokenizer.is_some());
    let run = run.and_then(|g| {
        report(
            &a,
            &mut engine,
            &prompt,
            &g,
            tokenizer.as_deref(),
            &settings,
        )
    });
    let released = engine.release();
    run.and(released)
}

/// A generation as it ran.
struct Generation {
    tokens: Vec<u32>,
    reason: FinishReason,
    /// Seconds to the first token (the prompt), and from it to the last.
    prompt_secs: f64,
    decode_secs: f64,
    /// Prompt tokens served from the prefix cache.
    cached: usize,
}

/// Steps the engine until request `id` finishes, printing its text (or its ids when
/// there is no tokenizer) as it comes when `print`.
fn stream(e: &mut Engine, id: RequestId, print: bool, text: bool) -> Result<Generation> {
    let t0 = Instant::now();
    let mut first = None;
    let mut tokens = Vec::new();
    loop {
        for ev in e.step()? {
            match ev {
                Event::Token {
                    token, text: piece, ..
                } => {
                    first.get_or_insert_with(Instant::now);
                    tokens.push(token);
                    if print {
                        match text {
                            true => print_out(&piece)?,
                            false => print_out(&format!(" {token}"))?,
                        }
                    }
                }
                Event::Finished {
                    reason,
                    text: piece,
                    usage,
                    ..
                } => {
                    if print {
                        print_out(&piece)?;
                    }
                    let end = Instant::now();
                    let first = first.unwrap_or(end);
                    return Ok(Generation {
                        tokens,
                        reason,
                        prompt_secs: (first - t0).as_secs_f64(),
                        decode_secs: (end - first).as_secs_f64(),
                        cached: usage.cached_tokens,
                    });
                }
                Event::Error { error, .. } => return Err(error),
            }
        }
        if !e.has_work() {
            return Err(Error::model(format!("internal: {id} vanished")));
        }
    }
}

/// A request error in terms of the flags: the tokens asked for are `-n`, the context
/// `--ctx`.
fn cli_error(e: Error) -> Error {
    match e {
        Error::Request { param, msg, .. } => {
            let flag = match param {
                "max_tokens" => "-n / --ctx",
                "prompt" => "--prompt / --token-ids",
                other => other,
            };
            Error::model(format!("{msg} ({flag})"))
        }
        e @ Error::Sampling { .. } => flag_error(e),
        other => other,
    }
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
    e: &mut Engine,
    prompt: &[u32],
    g: &Generation,
    tokenizer: Option<&Tokenizer>,
    settings: &Resolved,
) -> Result<()> {
    let stats = e.backend().stats();
    let (built, _) = e.plans();
    let stop = match g.reason {
        FinishReason::Stop => "eos",
        FinishReason::Length | FinishReason::Cancelled => "length",
    };
    let prompt_tps = (prompt.len() - g.cached) as f64 / g.prompt_secs;
    let steps = g.tokens.len().saturating_sub(1);
    let gen_tps = (steps > 0).then(|| steps as f64 / g.decode_secs);
    if a.json {
        let text = tokenizer.map(|t| t.decode(&g.tokens)).transpose()?;
        let obj = json!({
            "backend": e.backend().name(),
            "prompt_ids": prompt,
            "generated_ids": g.tokens,
            "text": text,
            "stop": stop,
            "prompt_tokens": prompt.len(),
            "cached_prompt_tokens": g.cached,
            "prompt_tokens_per_s": prompt_tps,
            "gen_tokens": g.tokens.len(),
            "decode_steps": steps,
            "gen_tokens_per_s": gen_tps,
            "plans": built,
            "captures": stats.captures,
            "replays": stats.replays,
            "eager_runs": stats.eager_runs,
            "host_peak_rss_bytes": peak_rss(),
            "sampling": settings.to_json(),
        });
        return print_out(&format!("{obj}\n"));
    }
    print_out("\n")?;
    if !a.quiet {
        eprintln!(
            "prompt: {} tokens, {prompt_tps:.1} tok/s | generated: {} tokens (stop: {stop}), {} | plans: {built} | {} backend: {} captures, {} replays",
            prompt.len(),
            g.tokens.len(),
            gen_tps.map_or("no decode step".into(), |t| format!("{t:.1} tok/s")),
            e.backend().name(),
            stats.captures,
            stats.replays
        );
    }
    Ok(())
}

/// This process's peak resident memory in bytes (Linux: `VmHWM`), when known.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    kb.trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()
        .map(|k| k * 1024)
}

/// `--chat`: one turn of a [`ChatSession`], the reply streamed to stdout (or, with
/// `--json`, one object after it).
fn run_chat(a: &Args, path: &Path) -> Result<()> {
    let (tok, template) = chat_parts(path)?;
    let settings = a.sampling.resolve(Some(path), &SamplingParams::chat())?;
    let mut engine = chat_engine(&a.model, path, a.quiet || a.json)?;
    let ctx = engine.ctx();
    let mut session = ChatSession::new(
        &mut engine,
        tok,
        template,
        settings.params.clone(),
        a.n,
        a.system.clone(),
    )?;
    let prompt = prompt_text(a)?.unwrap_or_default();
    let mut failed = None;
    let start = Instant::now();
    let end = session.turn(&prompt, |piece| {
        if failed.is_none() && !a.json {
            failed = print_out(piece).err();
        }
    })?;
    let seconds = start.elapsed().as_secs_f64();
    let note = session.note(&end);
    drop(session);
    let json = a
        .json
        .then(|| chat_json(&mut engine, &end, seconds, &settings));
    engine.release()?;
    if let Some(e) = failed {
        return Err(e);
    }
    if end.reason == EndReason::ContextFull && end.prefilled == 0 && end.tokens.is_empty() {
        return Err(Error::model(format!(
            "the chat prompt does not fit the context of {ctx} tokens: give a larger --ctx or a shorter prompt"
        )));
    }
    if let Some(obj) = json {
        return print_out(&format!("{obj}\n"));
    }
    print_out("\n")?;
    if end.reason != EndReason::Stop && !a.quiet {
        if let Some(note) = note {
            eprintln!("{note}");
        }
    }
    Ok(())
}

/// The `--chat --json` object of a turn that ended with `end` after `seconds`.
fn chat_json(
    e: &mut Engine,
    end: &TurnEnd,
    seconds: f64,
    settings: &Resolved,
) -> serde_json::Value {
    let stats = e.backend().stats();
    let (built, _) = e.plans();
    let stop = match end.reason {
        EndReason::Stop => "eos",
        EndReason::Length => "length",
        EndReason::ContextFull => "context_full",
    };
    json!({
        "backend": e.backend().name(),
        "generated_ids": end.tokens,
        "text": end.reply,
        "stop": stop,
        "prompt_tokens": end.prefilled,
        "gen_tokens": end.tokens.len(),
        "seconds": seconds,
        "plans": built,
        "captures": stats.captures,
        "replays": stats.replays,
        "eager_runs": stats.eager_runs,
        "sampling": settings.to_json(),
    })
}

/// The prompt text: `--prompt`, or the file of `--file`; `None` with `--token-ids`.
fn prompt_text(a: &Args) -> Result<Option<String>> {
    Ok(match (&a.prompt, &a.file) {
        (Some(text), _) => Some(text.clone()),
        (None, Some(path)) => Some(read_prompt(path, "--file")?),
        (None, None) => None,
    })
}
