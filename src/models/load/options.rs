//! How a model is loaded: the weight conversion, the context and the KV cache's types
//! ([`LoadOptions`], [`CacheTypes`]), shared by the loaders and the runtime.

use crate::error::{Error, Result};
use crate::graph::DType;
use crate::models::arch::config::Config;
use crate::models::load::quant_plan::QuantPlan;

/// The types a cache may have.
pub const CACHE_TYPES: [DType; 5] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
];

/// The cache's element types and the attention the model runs over it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheTypes {
    /// Type of the K cache.
    pub k: DType,
    /// Type of the V cache.
    pub v: DType,
    /// Whether attention is the fused `flash_attn_ext` op (V stored by position) or the
    /// classic chain of ops (V stored transposed).
    pub flash_attn: bool,
}

impl Default for CacheTypes {
    fn default() -> Self {
        CacheTypes {
            k: DType::F16,
            v: DType::F16,
            flash_attn: true,
        }
    }
}

impl CacheTypes {
    /// Checks the types against the model: cache types from [`CACHE_TYPES`], whole blocks
    /// per head for a block type, and no transposed block-typed V.
    pub fn check(&self, cfg: &Config) -> Result<()> {
        for (what, dt) in [("K", self.k), ("V", self.v)] {
            if !CACHE_TYPES.contains(&dt) {
                return Err(Error::model(format!(
                    "{what} cache type {dt} is not one of f32, f16, bf16, q8_0, q4_0"
                )));
            }
            if !cfg.head_dim.is_multiple_of(dt.block_size()) {
                return Err(Error::model(format!(
                    "a {dt} {what} cache needs a head size that is a multiple of {}; this model's is {}: use --cache-type-{} f16 (or f32, bf16)",
                    dt.block_size(),
                    cfg.head_dim,
                    what.to_lowercase()
                )));
            }
        }
        if !self.flash_attn && self.v.quant().is_some() {
            return Err(Error::model(format!(
                "a {} V cache needs flash attention (--flash-attn on): without it V is stored transposed",
                self.v
            )));
        }
        Ok(())
    }
}

/// Options of [`Model::load`](crate::models::Model::load).
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Convert the matrices on the host while loading ([`QuantPlan`]: one type, or one
    /// of ggml's K-quant mixes); `None` keeps each tensor's own dtype (norms become F32).
    pub quantize: Option<QuantPlan>,
    /// KV-cache positions ([`default_ctx`](crate::models::runtime::model::default_ctx) when `None`). A context longer than the
    /// model's `max_position_embeddings` is allowed (the caller may warn): nothing in
    /// graft limits it, but the model was not trained for it.
    pub ctx: Option<usize>,
    /// Whether to show a progress bar on stderr (only drawn on a terminal).
    pub progress: bool,
    /// The KV cache's types and the attention the model runs (fused by default).
    pub cache: CacheTypes,
}
