//! `graft serve`: the OpenAI-compatible HTTP server ([`graft::serve`]) on a model given
//! by [`ModelArgs`] (the default model without `--model`), with the engine's settings
//! (`--ctx` per sequence, `--parallel`, `--ubatch`, the KV budget) and the server's
//! (address, API key, body and queue limits, shutdown timeout).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use graft::engine::{Engine, EngineConfig, KvBudget, SchedulerConfig};
use graft::models::runtime::model::{default_ctx, read_config};
use graft::models::text::tokenizer;
use graft::serve::answer::unix_now;
use graft::serve::{ServeConfig, ServedModel};
use graft::{Error, Result};

use super::ModelArgs;

/// Arguments of `graft serve`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on (0.0.0.0 for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: a free one, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Sequences computed at once; more requests wait (each with the whole --ctx).
    #[arg(long, default_value_t = 8)]
    parallel: usize,
    /// Most tokens computed in one step (decode tokens plus prompt chunks); default: 512,
    /// or --parallel when larger.
    #[arg(long)]
    ubatch: Option<usize>,
    /// KV pool size in positions, shared by every sequence (default: 4 contexts, or what
    /// the device's free memory holds).
    #[arg(long, conflicts_with = "kv_mem")]
    kv_size: Option<usize>,
    /// KV pool size in bytes (suffixes K, M, G: 512M, 4G).
    #[arg(long, value_parser = parse_size)]
    kv_mem: Option<usize>,
    /// Requests that may wait beyond --parallel; past that a request gets 503 with
    /// Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Largest request body (suffixes K, M, G); larger ones get 413.
    #[arg(long, default_value = "4M", value_parser = parse_size)]
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

/// A size in bytes: a number with an optional K, M or G suffix (powers of 1024; `KiB`,
/// `MB` and the like read the same).
fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: usize = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size: give a number of bytes, e.g. 4M or 512K"))?;
    let shift = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches(['B', 'I'])
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return Err(format!("'{s}': unknown unit '{unit}' (use K, M or G)")),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("'{s}' is too large"))
}

/// Seconds as a duration, refusing negative and non-finite values.
fn seconds(flag: &str, s: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| Error::model(format!("{flag} {s}: give a number of seconds, 0 or more")))
}

/// Runs `graft serve`.
pub fn run(a: Args) -> Result<()> {
    if a.parallel == 0 {
        return Err(Error::model("--parallel must be at least 1"));
    }
    let cfg = ServeConfig {
        host: a.host.clone(),
        port: a.port,
        api_key: a.api_key.clone(),
        max_body: a.max_body,
        read_timeout: seconds("--timeout", a.timeout)?,
        parallel: a.parallel,
        max_queue: a.max_queue,
        shutdown_timeout: seconds("--shutdown-timeout", a.shutdown_timeout)?,
    };
    graft::serve::run(cfg, move || load(&a))
}

/// Loads the model behind an engine (on the engine thread) and says what it chose.
fn load(a: &Args) -> Result<(Engine, ServedModel)> {
    let path = a.model.path()?;
    let found = tokenizer::for_model(&path)?.ok_or_else(|| {
        Error::model(format!(
            "{}: serving needs the model's tokenizer (tokenizer.json, or tokenizer.ggml.* metadata)",
            path.display()
        ))
    })?;
    let config = read_config(&path)?;
    let ctx = a.model.ctx.unwrap_or_else(|| default_ctx(&config));
    let kv = match (a.kv_size, a.kv_mem) {
        (Some(n), _) => KvBudget::Tokens(n),
        (None, Some(b)) => KvBudget::Bytes(b),
        (None, None) => KvBudget::Auto,
    };
    let step_tokens = a.ubatch.unwrap_or(a.parallel.max(512));
    let cfg = EngineConfig {
        kv,
        cache: a.model.cache.types(),
        scheduler: SchedulerConfig {
            max_seqs: a.parallel,
            step_tokens,
            prefix_cache: true,
            prefill_first: false,
        },
        ..EngineConfig::new(ctx)
    };
    let be = a.model.open_backend()?;
    let mut engine = Engine::load(&path, be, &a.model.options(Some(ctx), false), cfg)?;
    let backend = engine.backend().name();
    let per_seq = engine.kv_positions() as f64 / ctx as f64;
    eprintln!(
        "graft serve: {} on {}: {ctx} positions per sequence (--ctx), up to {} sequences at once (--parallel), {step_tokens} tokens per step (--ubatch); KV pool: {} positions, {:.1} MiB ({per_seq:.1} full contexts)",
        path.display(),
        backend,
        a.parallel,
        engine.kv_positions(),
        engine.kv_bytes() as f64 / (1 << 20) as f64,
    );
    let mut tok = found.tokenizer;
    tok.set_parse_special(true);
    let template = found.template.compile().map_err(|e| e.to_string());
    if let Err(e) = &template {
        eprintln!("warning: the model's chat template does not compile; /v1/chat/completions will answer 500: {e}");
    }
    let model = ServedModel {
        id: a.alias.clone().unwrap_or_else(|| model_name(&path)),
        created: unix_now(),
        tokenizer: Arc::new(tok),
        template,
        ctx,
        vocab: engine.config().vocab_size,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4M"), Ok(4 << 20));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("4X").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }
}
