//! `graft serve`: the OpenAI-compatible HTTP server ([`graft::serve`]) on a model given
//! by [`ModelArgs`] (the default model without `--model`), with the engine's settings
//! ([`EngineArgs`]: `--ctx` per sequence, `--parallel`, `--ubatch`, the KV pool) and the
//! server's (address, API key, body and queue limits, shutdown timeout).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use graft::engine::Engine;
use graft::models::runtime::sampling::ModelSampling;
use graft::models::text::tokenizer;
use graft::serve::answer::unix_now;
use graft::serve::{ServeConfig, ServedModel};
use graft::{Error, Result};

use super::engine_args::{parse_bytes, EngineArgs};
use super::sampling_args::SamplingArgs;
use super::ModelArgs;

/// Arguments of `graft serve`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// The defaults of requests' sampling settings (a request's fields override them).
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Address to listen on (0.0.0.0 for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: a free one, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests that may wait beyond --parallel; past that a request gets 503 with
    /// Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Largest request body in bytes (suffixes K, M, G); larger ones get 413.
    #[arg(long, default_value = "4M", value_parser = parse_bytes)]
    max_body: usize,
    /// Seconds a client may take to send its request body (then 408).
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Seconds running requests may take to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Require `Authorization: Bearer <KEY>` on the API (not on /health and the page).
    #[arg(long)]
    api_key: Option<String>,
    /// The model's name in requests and /v1/models (default: the file or folder name).
    #[arg(long)]
    alias: Option<String>,
}

/// Seconds as a duration, refusing negative and non-finite values.
fn seconds(flag: &str, s: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| Error::model(format!("{flag} {s}: give a number of seconds, 0 or more")))
}

/// Runs `graft serve`.
pub fn run(a: Args) -> Result<()> {
    if a.engine.parallel == 0 {
        return Err(Error::model("--parallel must be at least 1"));
    }
    let cfg = ServeConfig {
        host: a.host.clone(),
        port: a.port,
        api_key: a.api_key.clone(),
        max_body: a.max_body,
        read_timeout: seconds("--timeout", a.timeout)?,
        parallel: a.engine.parallel,
        max_queue: a.max_queue,
        shutdown_timeout: seconds("--shutdown-timeout", a.shutdown_timeout)?,
    };
    graft::serve::run(cfg, move || load(&a))
}

/// Loads the model behind an engine (on the engine thread) with its tokenizer, chat
/// template and the defaults of requests' sampling settings (the flags over the
/// model's recommendation).
fn load(a: &Args) -> Result<(Engine, ServedModel)> {
    let path = a.model.path()?;
    let found = tokenizer::for_model(&path)?.ok_or_else(|| {
        Error::model(format!(
            "{}: serving needs the model's tokenizer (tokenizer.json, or tokenizer.ggml.* metadata)",
            path.display()
        ))
    })?;
    let recommended = ModelSampling::of(&path)?;
    let engine = a.engine.load(&a.model, &path, None, false)?;
    let vocab = engine.config().vocab_size;
    let sampling = a.sampling.server_defaults(&recommended, vocab)?;
    let mut tok = found.tokenizer;
    tok.set_parse_special(true);
    let template = found.template.compile().map_err(|e| e.to_string());
    if let Err(e) = &template {
        eprintln!("warning: the model's chat template does not compile; /v1/chat/completions will answer 500: {e}");
    }
    if let Some(from) = &recommended.from {
        eprintln!(
            "graft serve: sampling settings a request leaves out come from {}",
            from.display()
        );
    }
    let model = ServedModel {
        id: a.alias.clone().unwrap_or_else(|| model_name(&path)),
        created: unix_now(),
        tokenizer: Arc::new(tok),
        template,
        ctx: engine.ctx(),
        vocab,
        sampling,
    };
    Ok((engine, model))
}

/// A model's name: its file name without `.gguf`, or its folder's name.
fn model_name(path: &Path) -> String {
    let name = path
        .file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy();
    name.strip_suffix(".gguf").unwrap_or(&name).to_string()
}
