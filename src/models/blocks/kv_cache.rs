//! The KV cache: per layer, one K tensor and one V tensor of `ctx` positions, in one
//! zero-filled backend buffer, of the types [`CacheTypes`] picks (F16 by default; F32,
//! BF16, Q8_0 and Q4_0 too, llama.cpp's `-ctk` / `-ctv`).
//!
//! - K is stored by position: state ne `[n_kv_dim, ctx]` (row `p` holds the keys of all
//!   KV heads at position `p`), so attention reads it as `[head_dim, n_kv, n_kv_head]`.
//! - V is stored by position too when the model uses the fused attention op
//!   (`flash_attn_ext` reads `[head_dim, n_kv, n_kv_head]`, like K); for the classic
//!   chain of ops it is stored transposed, ne `[ctx, n_kv_dim]` (row `c` holds channel `c`
//!   at every position), so the weighted sum over positions is a plain mul_mat. A
//!   transposed V cannot hold blocks (a block runs along a row), so a quantized V cache
//!   needs the fused op.
//!
//! The buffer starts zeroed and is only ever written with finite values, which is what
//! lets a decode graph read a whole KV-length bucket and mask the positions it must not
//! see (see [`crate::models::blocks`]).
//!
//! **Sliding windows.** A model whose attention sees only the last `window` positions
//! (Mistral) needs no more than `window` positions of cache plus the tokens of one
//! prefill chunk. When the context exceeds that, the cache is a ring of
//! [`KvCache::slots`] = `window + chunk` positions (chunk = [`ring_chunk`]): position `p`
//! lives in slot `p % slots`, writes go through `set_rows` at the slot, attention reads
//! every slot with a mask built from the position each slot holds, and a prefill runs in
//! chunks of at most `chunk` tokens. A chunk overwrites only positions older than
//! `window` before its first token, so every key a query of the chunk may see is still
//! there.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::graph::alloc::ALIGN;
use crate::graph::{BufferId, BufferRef, DType, Graph, TensorId};

use crate::models::arch::config::Config;
use crate::models::arch::Positions;
use crate::models::load::options::CacheTypes;

/// The tokens of one prefill chunk of a ring cache: at most 256, and at most the window
/// (so a ring holds at most twice the window).
pub fn ring_chunk(window: usize) -> usize {
    window.clamp(1, 256)
}

/// Positions a cache of `ctx` stores for `cfg`: `ctx`, or `window + ring_chunk(window)`
/// when a sliding window makes that fewer.
pub fn stored_positions(cfg: &Config, ctx: usize) -> usize {
    match cfg.sliding_window {
        Some(w) => ctx.min(w.saturating_add(ring_chunk(w))),
        None => ctx,
    }
}

/// The longest context: positions are I32 inputs on the device.
pub const MAX_CTX: usize = i32::MAX as usize;

/// The KV cache of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCache {
    /// The buffer holding every layer's K and V.
    pub buffer: BufferId,
    /// Positions of the context (the longest sequence the cache serves).
    pub ctx: usize,
    /// Positions stored per layer: `ctx`, or fewer for a sliding-window ring.
    pub slots: usize,
    /// Width of one position: `num_key_value_heads * head_dim`.
    pub n_kv_dim: usize,
    /// Layers.
    pub n_layer: usize,
    /// Element types and attention kind.
    pub types: CacheTypes,
}

impl KvCache {
    /// The layout of a cache of `ctx` positions for `cfg`, in `buffer`.
    pub fn layout(cfg: &Config, ctx: usize, types: CacheTypes, buffer: BufferId) -> KvCache {
        KvCache {
            buffer,
            ctx,
            slots: stored_positions(cfg, ctx),
            n_kv_dim: cfg.n_kv_dim(),
            n_layer: cfg.num_hidden_layers,
            types,
        }
    }

    /// Checks a context of `ctx` positions before anything is sized by it: at least 1, at
    /// most [`MAX_CTX`] (positions are I32 on the device), and a cache whose bytes can be
    /// counted without overflow. Returns those bytes; errors name `--ctx`.
    pub fn check_ctx(cfg: &Config, ctx: usize, types: CacheTypes) -> Result<usize> {
        if ctx == 0 || ctx > MAX_CTX {
            return Err(Error::model(format!(
                "--ctx {ctx}: the context length must be 1 to {MAX_CTX} (positions are 32-bit)"
            )));
        }
        let learned = cfg.arch.spec().positions == Positions::Learned;
        if learned && ctx > cfg.max_position_embeddings {
            return Err(Error::model(format!(
                "--ctx {ctx}: {} has learned positions for {} tokens only (its position table); use --ctx {} or less",
                cfg.arch, cfg.max_position_embeddings, cfg.max_position_embeddings
            )));
        }
        let slots = stored_positions(cfg, ctx);
        let tensor = |dt: DType| {
            slots
                .checked_mul(dt.row_bytes(cfg.n_kv_dim()))
                .and_then(|b| b.checked_next_multiple_of(ALIGN))
        };
        tensor(types.k)
            .zip(tensor(types.v))
            .and_then(|(k, v)| k.checked_add(v))
            .and_then(|l| l.checked_mul(cfg.num_hidden_layers))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::model(format!(
                    "--ctx {ctx}: a KV cache of {ctx} positions x {} layers x {} values is too large to address",
                    cfg.num_hidden_layers,
                    cfg.n_kv_dim()
                ))
            })
    }

    /// Allocates a zero-filled cache of `ctx` positions on `be` (after checking `types`
    /// and the size, see [`KvCache::check_ctx`]).
    pub fn alloc(
        cfg: &Config,
        ctx: usize,
        types: CacheTypes,
        be: &mut dyn Backend,
    ) -> Result<KvCache> {
        types.check(cfg)?;
        let bytes = KvCache::check_ctx(cfg, ctx, types)?;
        let buffer = be.alloc_buffer(bytes)?;
        Ok(KvCache::layout(cfg, ctx, types, buffer))
    }

    /// The layout of a pool of `n_slots` positions (whole blocks of the engine's block
    /// size) in `buffer`: the same per-layer K and V tensors as a cache, read through
    /// block tables rather than by position (V always by position: the pool serves
    /// the fused paged attention). `ctx` is the pool's size.
    pub fn pool(cfg: &Config, n_slots: usize, types: CacheTypes, buffer: BufferId) -> KvCache {
        KvCache {
            buffer,
            ctx: n_slots,
            slots: n_slots,
            n_kv_dim: cfg.n_kv_dim(),
            n_layer: cfg.num_hidden_layers,
            types: CacheTypes {
                flash_attn: true,
                ..types
            },
        }
    }

    /// Bytes of a pool of `n_slots` positions, or `None` when they cannot be addressed.
    pub fn pool_bytes(cfg: &Config, n_slots: usize, types: CacheTypes) -> Option<usize> {
        let tensor = |dt: DType| {
            n_slots
                .checked_mul(dt.row_bytes(cfg.n_kv_dim()))
                .and_then(|b| b.checked_next_multiple_of(ALIGN))
        };
        tensor(types.k)
            .zip(tensor(types.v))
            .and_then(|(k, v)| k.checked_add(v))
            .and_then(|l| l.checked_mul(cfg.num_hidden_layers))
            .filter(|&b| b <= isize::MAX as usize && n_slots <= MAX_CTX)
    }

    /// Allocates a zero-filled pool of `n_slots` positions on `be` (after checking
    /// `types` and the size).
    pub fn alloc_pool(
        cfg: &Config,
        n_slots: usize,
        types: CacheTypes,
        be: &mut dyn Backend,
    ) -> Result<KvCache> {
        types.check(cfg)?;
        let bytes = KvCache::pool_bytes(cfg, n_slots, types).ok_or_else(|| {
            Error::model(format!(
                "a KV pool of {n_slots} positions x {} layers x {} values is too large to address",
                cfg.num_hidden_layers,
                cfg.n_kv_dim()
            ))
        })?;
        let buffer = be.alloc_buffer(bytes)?;
        Ok(KvCache::pool(cfg, n_slots, types, buffer))
    }

    /// The byte ranges of `slots` consecutive rows from row `first` in every K and V
    /// tensor of the pool, as (offset, length) pairs: what copying a block moves.
    pub fn row_ranges(&self, first: usize, rows: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::with_capacity(2 * self.n_layer);
        for layer in 0..self.n_layer {
            let base = layer * self.layer_bytes();
            let k_row = self.types.k.row_bytes(self.n_kv_dim);
            let v_row = self.types.v.row_bytes(self.n_kv_dim);
            let v_base = base + self.tensor_bytes(self.types.k);
            out.push((base + first * k_row, rows * k_row));
            out.push((v_base + first * v_row, rows * v_row));
        }
        out
    }

    /// Whether V is stored by position (the fused attention op) rather than transposed.
    pub fn v_by_position(&self) -> bool {
        self.types.flash_attn
    }

    /// Bytes of one K or V tensor of `dtype`, aligned.
    fn tensor_bytes(&self, dtype: DType) -> usize {
        (self.slots * dtype.row_bytes(self.n_kv_dim)).div_ceil(ALIGN) * ALIGN
    }

    /// Bytes of one layer's K and V.
    fn layer_bytes(&self) -> usize {
        self.tensor_bytes(self.types.k) + self.tensor_bytes(self.types.v)
    }

    /// Size of the whole buffer.
    pub fn bytes(&self) -> usize {
        self.n_layer * self.layer_bytes()
    }

    /// Whether the cache is a sliding-window ring (fewer slots than positions).
    pub fn is_ring(&self) -> bool {
        self.slots < self.ctx
    }

    /// The K and V state leaves of `layer` in a graph: K `[n_kv_dim, slots]`, V
    /// `[n_kv_dim, slots]` (by position) or `[slots, n_kv_dim]` (transposed).
    pub(crate) fn leaves(&self, g: &mut Graph, layer: usize) -> Result<(TensorId, TensorId)> {
        let base = layer * self.layer_bytes();
        let at = |offset: usize| BufferRef {
            buffer: self.buffer,
            offset,
        };
        let (n, ctx) = (self.n_kv_dim, self.slots);
        let k = g.state(
            &format!("cache_k.{layer}"),
            self.types.k,
            &[n, ctx],
            at(base),
        )?;
        let v_shape = if self.v_by_position() {
            [n, ctx]
        } else {
            [ctx, n]
        };
        let v_at = at(base + self.tensor_bytes(self.types.k));
        let v = g.state(&format!("cache_v.{layer}"), self.types.v, &v_shape, v_at)?;
        Ok((k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::arch::presets;

    /// Learned positions end at the position table; a sliding window makes a ring.
    #[test]
    fn contexts_follow_the_architecture() {
        let gpt2 = presets::preset("gpt2-xl").unwrap();
        assert!(KvCache::check_ctx(&gpt2, 1024, CacheTypes::default()).is_ok());
        let e = KvCache::check_ctx(&gpt2, 1025, CacheTypes::default()).unwrap_err();
        assert!(e.to_string().contains("learned positions for 1024"), "{e}");
        let mistral = presets::preset("mistral-7b").unwrap();
        let ring = KvCache::layout(&mistral, 32_768, CacheTypes::default(), BufferId(0));
        assert_eq!((ring.slots, ring.is_ring()), (4096 + 256, true));
        let short = KvCache::layout(&mistral, 4096, CacheTypes::default(), BufferId(0));
        assert_eq!((short.slots, short.is_ring()), (4096, false));
        let bytes = KvCache::check_ctx(&mistral, 32_768, CacheTypes::default()).unwrap();
        assert_eq!(bytes, ring.bytes(), "the ring's bytes, not the context's");
    }
}
