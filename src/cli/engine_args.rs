//! The options of the commands that run the batched engine ([`EngineArgs`]: the KV pool's
//! size and block, the sequence cap, the step's token budget, the prefix cache), and the
//! one place that turns them with [`ModelArgs`] into an [`Engine`].

use std::path::Path;

use graft::backend::Backend;
use graft::engine::{Engine, EngineConfig, KvBudget, SchedulerConfig, DEFAULT_BLOCK_SIZE};
use graft::models::runtime::model::{default_ctx, read_config};
use graft::models::Config;
use graft::{Error, Result};

use super::ModelArgs;

/// How the engine runs: pool, sequences, step budget.
#[derive(clap::Args, Clone, Debug)]
pub(super) struct EngineArgs {
    /// KV pool positions, over all sequences (default: 4 contexts, or what the device has
    /// free); conflicts with --kv-mem.
    #[arg(long, conflicts_with = "kv_mem")]
    pub kv_size: Option<usize>,
    /// KV pool size in bytes (suffixes K, M, G: 8G).
    #[arg(long, value_parser = parse_bytes)]
    pub kv_mem: Option<usize>,
    /// Positions per KV block.
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    pub kv_block: usize,
    /// Most sequences computed together (each gets the whole --ctx).
    #[arg(long, visible_alias = "np", default_value_t = 64)]
    pub parallel: usize,
    /// Most tokens computed in one step (prompt chunks and decode tokens), like
    /// llama.cpp's -ub.
    #[arg(long, visible_alias = "ub", default_value_t = 512)]
    pub ubatch: usize,
    /// Do not reuse the K/V of equal prompt beginnings.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// A pool of this many whole contexts when neither --kv-size nor --kv-mem is given
    /// (commands without those flags: [`KvBudget::Contexts`]); else the automatic budget.
    #[arg(skip)]
    pub contexts: Option<usize>,
}

/// `8G`, `512M`, `64K` or a plain byte count.
pub(super) fn parse_bytes(s: &str) -> std::result::Result<usize, String> {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim()
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a byte count (a number, optionally with K, M or G)"))
}

impl EngineArgs {
    /// The engine's settings for `m` on a model shaped `cfg`; `ctx` is the command's
    /// own default context when `--ctx` is absent.
    pub fn config(&self, m: &ModelArgs, cfg: &Config, ctx: Option<usize>) -> EngineConfig {
        let ctx = m.ctx.or(ctx).unwrap_or_else(|| default_ctx(cfg));
        let kv = match (self.kv_size, self.kv_mem) {
            (Some(n), _) => KvBudget::Tokens(n),
            (None, Some(b)) => KvBudget::Bytes(b),
            (None, None) => self.contexts.map_or(KvBudget::Auto, KvBudget::Contexts),
        };
        EngineConfig {
            ctx,
            block_size: self.kv_block,
            kv,
            cache: m.cache.types(),
            scheduler: SchedulerConfig {
                max_seqs: self.parallel,
                step_tokens: self.ubatch,
                prefix_cache: !self.no_prefix_cache,
                prefill_first: false,
            },
        }
    }

    /// Loads the model at `path` behind an engine.
    pub fn load(
        &self,
        m: &ModelArgs,
        path: &Path,
        ctx: Option<usize>,
        quiet: bool,
    ) -> Result<Engine> {
        self.load_on(m, path, ctx, quiet, m.open_backend()?)
    }

    /// Loads the model at `path` behind an engine on `be`.
    pub fn load_on(
        &self,
        m: &ModelArgs,
        path: &Path,
        ctx: Option<usize>,
        quiet: bool,
        be: Box<dyn Backend>,
    ) -> Result<Engine> {
        if !m.cache.types().flash_attn {
            return Err(flash_attn_off());
        }
        let cfg = read_config(path)?;
        let ecfg = self.config(m, &cfg, ctx);
        let engine = Engine::load(path, be, &m.options(Some(ecfg.ctx), quiet), ecfg)?;
        if !quiet {
            note_engine(&engine);
        }
        Ok(engine)
    }

    /// An engine over seeded random weights shaped `cfg` (benchmarks).
    pub fn random(
        &self,
        m: &ModelArgs,
        cfg: Config,
        ctx: Option<usize>,
        seed: u64,
        quiet: bool,
    ) -> Result<Engine> {
        self.random_on(m, cfg, ctx, seed, quiet, m.open_backend()?)
    }

    /// An engine over seeded random weights shaped `cfg` on `be`.
    pub fn random_on(
        &self,
        m: &ModelArgs,
        cfg: Config,
        ctx: Option<usize>,
        seed: u64,
        quiet: bool,
        be: Box<dyn Backend>,
    ) -> Result<Engine> {
        if !m.cache.types().flash_attn {
            return Err(flash_attn_off());
        }
        let ecfg = self.config(m, &cfg, ctx);
        let engine = Engine::random(cfg, m.plan(), seed, be, ecfg)?;
        if !quiet {
            note_engine(&engine);
        }
        Ok(engine)
    }
}

/// Says on stderr what the KV pool holds.
fn note_engine(e: &Engine) {
    let positions = e.kv_positions();
    eprintln!(
        "engine: KV pool of {positions} positions ({:.1} MiB; {:.1} contexts of {}), up to {} sequences",
        e.kv_bytes() as f64 / (1 << 20) as f64,
        positions as f64 / e.ctx() as f64,
        e.ctx(),
        e.max_seqs()
    );
}

impl EngineArgs {
    /// One sequence at a time, the default step budget and block size.
    pub fn single_sequence() -> EngineArgs {
        EngineArgs {
            kv_size: None,
            kv_mem: None,
            kv_block: DEFAULT_BLOCK_SIZE,
            parallel: 1,
            ubatch: 512,
            no_prefix_cache: false,
            contexts: None,
        }
    }
}

/// An engine for one sequence at a time on the model at `path` (generate, chat): the
/// default step budget, a pool of `contexts` contexts.
pub(super) fn single(m: &ModelArgs, path: &Path, contexts: usize, quiet: bool) -> Result<Engine> {
    let cfg = read_config(path)?;
    let args = EngineArgs {
        contexts: Some(contexts),
        ..EngineArgs::single_sequence()
    };
    let ecfg = args.config(m, &cfg, None);
    if !m.cache.types().flash_attn {
        return Err(flash_attn_off());
    }
    Engine::load(
        path,
        m.open_backend()?,
        &m.options(Some(ecfg.ctx), quiet),
        ecfg,
    )
}

/// Why the engine refuses `--flash-attn off`.
fn flash_attn_off() -> Error {
    Error::model(
        "--flash-attn off: generation runs the fused paged attention over its KV blocks; the unfused chain of ops is for logits, trace and dump",
    )
}

/// The context of a benchmark whose sequences are `sizes` (two flags and their values,
/// such as -p and -n) plus one position long, or `given` (`--ctx`) when that holds them;
/// at most `most` positions. The errors name the flags to change.
pub(super) fn bench_context(
    sizes: [(&str, usize); 2],
    given: Option<usize>,
    most: usize,
) -> Result<usize> {
    let [(a, x), (b, y)] = sizes;
    let need = x.checked_add(y).and_then(|c| c.checked_add(1));
    let err = |what: String| Err(Error::model(what));
    match (need.filter(|&c| c <= most), given) {
        (_, Some(g)) if g > most => err(format!(
            "--ctx {g}: a context holds at most {most} positions (positions are 32-bit): give a smaller --ctx"
        )),
        (Some(c), None) => Ok(c),
        (Some(c), Some(g)) if g >= c => Ok(g),
        (_, Some(g)) => err(format!(
            "--ctx {g} cannot hold {a} {x} + {b} {y} tokens: give a larger --ctx or smaller {a} and {b}"
        )),
        (None, None) => err(format!(
            "{a} {x} + {b} {y} tokens are more than a context holds ({most}): give smaller {a} and {b}"
        )),
    }
}
