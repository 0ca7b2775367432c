//! `graft dump`: the planned prefill or decode graph of a model, as a text table or
//! Graphviz DOT, with real shapes and arena offsets. Only the config is read: the graph
//! is built against the weight and KV-cache layouts with placeholder buffers, so no
//! weights are loaded and no backend runs.

use std::path::PathBuf;

use clap::ValueEnum;

use graft::files::{check_output, write_output_guarded};
use graft::graph::{dump, BufferId, DType};
use graft::models::arch::tp::Split;
use graft::models::blocks::{build_decode, build_prefill, decode_n_kv};
use graft::models::load::safetensors::input_files;
use graft::models::runtime::model::default_ctx;
use graft::models::{arch::presets, Config, KvCache, QuantPlan, Weights};
use graft::{Error, Result};

use super::{print_out, CacheArgs, DTypeArg};

/// Output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    /// One row per node: op, name, dtype, ne, nb, sources, memory, parameters.
    Text,
    /// Graphviz DOT (render with `dot -Tsvg`).
    Dot,
}

/// Arguments of `graft dump`.
#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face model folder (only config.json is read) or GGUF file (only its
    /// metadata is used).
    #[arg(long, required_unless_present = "preset", conflicts_with = "preset")]
    model: Option<PathBuf>,
    #[arg(long, help = preset_help("A preset instead of a folder"))]
    preset: Option<String>,
    /// Dump the decode graph (one token, KV-length bucket of position --n-past).
    #[arg(long)]
    decode: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Write to this file instead of stdout (a temporary file renamed into place; never
    /// one of the model's files).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Prompt tokens of the prefill graph.
    #[arg(long, default_value_t = 8)]
    n_tokens: usize,
    /// Tokens already in the cache.
    #[arg(long, default_value_t = 0)]
    n_past: usize,
    /// KV-cache positions (default: max_position_embeddings, at most 4096).
    #[arg(long)]
    ctx: Option<usize>,
    /// Split the model over N devices (tensor parallelism): the graph every device runs
    /// on its share, with the all_reduce nodes, after one line per device saying what
    /// it holds.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Weight dtype or quantization mix (default: the config's dtype, else f32).
    #[arg(long, value_enum, alias = "quantize")]
    dtype: Option<DTypeArg>,
    #[command(flatten)]
    cache: CacheArgs,
}

/// Runs `graft dump`.
pub fn run(a: Args) -> Result<()> {
    let inputs = a.model.as_deref().map(input_files).unwrap_or_default();
    if let Some(path) = &a.out {
        check_output(path, &inputs)?;
    }
    let cfg = match (&a.model, &a.preset) {
        (Some(file), _) if graft::models::load::gguf::is_gguf_path(file) => {
            graft::models::load::gguf::config_from_gguf(
                &graft::models::load::gguf::open_model_file(file)?,
            )?
        }
        (Some(dir), _) => {
            if !dir.is_dir() {
                return Err(Error::model(format!(
                    "--model {}: does not exist; give a Hugging Face model folder or a .gguf file",
                    dir.display()
                )));
            }
            Config::from_file(&dir.join("config.json"))?
        }
        (None, Some(name)) => preset(name)?,
        (None, None) => return Err(Error::model("give --model or --preset")),
    };
    let plan = match (a.dtype, cfg.dtype) {
        (Some(d), _) => QuantPlan::from(d),
        (None, Some(DType::F16)) => QuantPlan::F16,
        (None, Some(DType::BF16)) => QuantPlan::BF16,
        (None, Some(_) | None) => QuantPlan::F32,
    };
    check_dump_size(&cfg)?;
    let ctx = a.ctx.unwrap_or_else(|| default_ctx(&cfg));
    let split = Split::new(&cfg, a.tp)?;
    let full = cfg;
    let cfg = split.shard();
    let pick = |role, layer| plan.pick(role, layer, &cfg).dtype;
    let weights = Weights::layout(&cfg, &pick, BufferId::fresh());
    // The graph every backend runs for these options.
    let types = a.cache.types();
    types.check(&cfg)?;
    KvCache::check_ctx(&cfg, ctx, types)?;
    let cache = KvCache::layout(&cfg, ctx, types, BufferId::fresh());
    let mg = if a.decode {
        if a.n_past >= ctx {
            return Err(Error::model(format!(
                "--n-past {} leaves no room in a context of {ctx}: give a smaller --n-past or a larger --ctx",
                a.n_past
            )));
        }
        build_decode(&cfg, &weights, &cache, decode_n_kv(&cache, a.n_past))?
    } else {
        if a.n_past.checked_add(a.n_tokens).is_none_or(|end| end > ctx) {
            return Err(Error::model(format!(
                "--n-past {} + --n-tokens {} exceeds the context of {ctx} tokens (--ctx)",
                a.n_past, a.n_tokens
            )));
        }
        build_prefill(&cfg, &weights, &cache, a.n_tokens, a.n_past, false)?
    };
    let plan = mg.plan()?;
    let mut text = match a.format {
        Format::Text => dump::text(&mg.graph, &plan),
        Format::Dot => dump::dot(&mg.graph, &plan),
    };
    if split.n > 1 {
        let mut head = String::new();
        let comment = if a.format == Format::Dot { "//" } else { "#" };
        for d in 0..split.n {
            head.push_str(&format!("{comment} {}\n", split.describe(d)));
        }
        head.push_str(&format!(
            "{comment} every device runs this graph ({} of {} query heads) on its share\n",
            cfg.num_attention_heads, full.num_attention_heads
        ));
        text.insert_str(0, &head);
    }
    match &a.out {
        Some(path) => write_output_guarded(path, &inputs, |w| w.write_all(text.as_bytes())),
        None => print_out(&text),
    }
}

/// Most parameters a dumped model may have (2^44, 17.6 trillion): `dump` lays out a graph
/// from a config alone, with no tensors to check its sizes against.
const MAX_DUMP_PARAMS: f64 = (1u64 << 44) as f64;
/// Most layers a dumped model may have (the graph holds a node set per layer).
const MAX_DUMP_LAYERS: usize = 1 << 16;

/// Refuses a config whose layer count or parameter count no real model has (a corrupt
/// or hostile file), before anything is laid out from it.
fn check_dump_size(cfg: &Config) -> Result<()> {
    if cfg.num_hidden_layers > MAX_DUMP_LAYERS {
        return Err(Error::model(format!(
            "num_hidden_layers {} is more than {MAX_DUMP_LAYERS}: the config is not one dump can lay out",
            cfg.num_hidden_layers
        )));
    }
    // In f64: no product of these fields can overflow it.
    let (h, i, v) = (
        cfg.hidden_size as f64,
        cfg.intermediate_size as f64,
        cfg.vocab_size as f64,
    );
    let params = cfg.num_hidden_layers as f64 * (4.0 * h * h + 3.0 * h * i) + 2.0 * v * h;
    if params > MAX_DUMP_PARAMS {
        return Err(Error::model(format!(
            "hidden_size {}, intermediate_size {}, vocab_size {} and num_hidden_layers {} \
             make about {params:.3e} parameters, more than {MAX_DUMP_PARAMS:.3e}",
            cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
        )));
    }
    Ok(())
}

/// The help of a `--preset` option: `what`, then every preset name.
pub fn preset_help(what: &str) -> String {
    format!("{what}: {}", presets::NAMES.join(", "))
}

/// A preset's config, or an error listing the presets.
pub fn preset(name: &str) -> Result<Config> {
    presets::preset(name).ok_or_else(|| {
        Error::model(format!(
            "unknown preset '{name}'; presets: {}",
            presets::NAMES.join(", ")
        ))
    })
}
