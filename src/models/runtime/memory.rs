//! Whether a model fits its backend's memory, checked at load before the KV cache and
//! the plans are allocated, so that a context too large for the GPU is an error that
//! gives the bytes needed and free and the largest context that fits, never an
//! out-of-memory failure in the middle of a run.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::graph::BufferId;
use crate::models::arch::config::Config;
use crate::models::blocks::kv_cache::KvCache;
use crate::models::blocks::{build_prefill, prefill_room};
use crate::models::load::options::CacheTypes;
use crate::models::load::weights::Weights;

pub use crate::models::load::fit::HEADROOM;

/// Prompt tokens whose prefill arena is counted at load (a longer prompt's arena is
/// allocated, and checked, when its plan is loaded).
pub const PREFILL_RESERVE: usize = 512;

/// What a context of `ctx` positions needs beyond the weights, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Need {
    /// The KV cache.
    pub cache: usize,
    /// The arena of the prefill plan of [`PREFILL_RESERVE`] tokens (at most the
    /// context).
    pub arena: usize,
}

impl Need {
    /// Cache, arena and [`HEADROOM`] together.
    pub fn total(&self) -> usize {
        self.cache
            .saturating_add(self.arena)
            .saturating_add(HEADROOM)
    }
}

/// The cache and arena bytes of a context of `ctx` positions.
pub fn need(cfg: &Config, weights: &Weights, ctx: usize, types: CacheTypes) -> Result<Need> {
    let ctx = ctx.max(1);
    let cache = KvCache::layout(cfg, ctx, types, BufferId(0));
    let n = prefill_room(cfg, &cache, 0).min(PREFILL_RESERVE);
    let prefill = build_prefill(cfg, weights, &cache, n, 0, true)?;
    Ok(Need {
        cache: cache.bytes(),
        arena: prefill.plan()?.arena_bytes,
    })
}

/// Checks that a context of `ctx` positions fits in `free` bytes (what the backend has
/// left after the weights); the error gives the bytes and the largest context that fits.
pub fn check_fits(
    cfg: &Config,
    weights: &Weights,
    ctx: usize,
    types: CacheTypes,
    free: usize,
    device: &str,
) -> Result<()> {
    let want = need(cfg, weights, ctx, types)?;
    if want.total() <= free {
        return Ok(());
    }
    // The largest context that fits: the need grows with the context.
    let (mut lo, mut hi) = (0usize, ctx);
    while lo + 1 < hi {
        let mid = lo + (hi - lo) / 2;
        if need(cfg, weights, mid, types)?.total() <= free {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let advice = if lo == 0 {
        "no context fits: use a smaller model or weight type".to_string()
    } else {
        format!("the largest --ctx that fits is {lo}")
    };
    Err(Error::model(format!(
        "a context of {ctx} tokens does not fit in {device} memory: the KV cache needs {} \
         bytes and the plans' arena {} bytes (+{HEADROOM} bytes of headroom), {free} bytes \
         are free after the weights ({} bytes); {advice}",
        want.cache, want.arena, weights.bytes
    )))
}

/// [`check_fits`] against what `be` has free; nothing to check on a backend that
/// allocates from the host's memory.
pub fn check_backend(
    cfg: &Config,
    weights: &Weights,
    ctx: usize,
    types: CacheTypes,
    be: &mut dyn Backend,
) -> Result<()> {
    match be.free_memory()? {
        Some(free) => check_fits(cfg, weights, ctx, types, free, be.name()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::arch::presets;
    use crate::models::load::quant_plan::QuantPlan;

    fn seven_b() -> (Config, Weights) {
        let cfg = presets::preset("llama2-7b").unwrap();
        let pick = |role, layer| QuantPlan::F16.pick(role, layer, &cfg).dtype;
        let w = Weights::layout(&cfg, &pick, BufferId(0));
        (cfg, w)
    }

    #[test]
    fn the_cache_grows_with_the_context_and_the_error_gives_the_largest_that_fits() {
        let (cfg, w) = seven_b();
        let types = CacheTypes::default();
        let small = need(&cfg, &w, 4096, types).unwrap();
        // F16 K and V: 2 x 2 bytes x 4096 dims x 32 layers per position.
        assert_eq!(small.cache, 4096 * 2 * 2 * 4096 * 32);
        assert!(small.arena > 0);
        let free = small.total() + 1000;
        check_fits(&cfg, &w, 4096, types, free, "test").unwrap();
        let e = check_fits(&cfg, &w, 8192, types, free, "test")
            .unwrap_err()
            .to_string();
        assert!(e.contains("8192 tokens") && e.contains("free"), "{e}");
        let largest: usize = e
            .rsplit("the largest --ctx that fits is ")
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{e}"));
        assert!((4096..8192).contains(&largest), "{e}");
        assert!(need(&cfg, &w, largest, types).unwrap().total() <= free);
        assert!(need(&cfg, &w, largest + 1, types).unwrap().total() > free);
    }

    #[test]
    fn nothing_fits_in_too_little_memory() {
        let (cfg, w) = seven_b();
        let e = check_fits(&cfg, &w, 4096, CacheTypes::default(), 1 << 20, "test")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no context fits"), "{e}");
    }
}
