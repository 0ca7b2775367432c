//! The KV cache: per layer, one F16 K tensor and one F16 V tensor of `ctx` positions, in
//! one zero-filled backend buffer.
//!
//! - K is stored by position: state ne `[n_kv_dim, ctx]` (row `p` holds the keys of all
//!   KV heads at position `p`), so attention reads it as `[head_dim, n_kv, n_kv_head]`.
//! - V is stored transposed: state ne `[ctx, n_kv_dim]` (row `c` holds channel `c` at
//!   every position), so attention reads it as `[n_kv, head_dim, n_kv_head]` and the
//!   weighted sum over positions is a plain mul_mat.
//!
//! The buffer starts zeroed and is only ever written with finite values, which is what
//! lets a decode graph read a whole KV-length bucket and mask the positions it must not
//! see (see [`super::llama`]).

use crate::backend::Backend;
use crate::error::Result;
use crate::graph::alloc::ALIGN;
use crate::graph::{BufferId, BufferRef, DType, Graph, TensorId};

use super::config::Config;

/// Element type of the cache.
pub const KV_DTYPE: DType = DType::F16;

/// The KV cache of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCache {
    /// The buffer holding every layer's K and V.
    pub buffer: BufferId,
    /// Positions per layer.
    pub ctx: usize,
    /// Width of one position: `num_key_value_heads * head_dim`.
    pub n_kv_dim: usize,
    /// Layers.
    pub n_layer: usize,
}

impl KvCache {
    /// The layout of a cache of `ctx` positions for `cfg`, in `buffer`.
    pub fn layout(cfg: &Config, ctx: usize, buffer: BufferId) -> KvCache {
        KvCache {
            buffer,
            ctx,
            n_kv_dim: cfg.n_kv_dim(),
            n_layer: cfg.num_hidden_layers,
        }
    }

    /// Allocates a zero-filled cache of `ctx` positions on `be`.
    pub fn alloc(cfg: &Config, ctx: usize, be: &mut dyn Backend) -> Result<KvCache> {
        let bytes = KvCache::layout(cfg, ctx, BufferId(0)).bytes();
        let buffer = be.alloc_buffer(bytes)?;
        Ok(KvCache::layout(cfg, ctx, buffer))
    }

    /// Bytes of one K or V tensor, aligned.
    fn tensor_bytes(&self) -> usize {
        (self.ctx * self.n_kv_dim * KV_DTYPE.block_bytes()).div_ceil(ALIGN) * ALIGN
    }

    /// Size of the whole buffer.
    pub fn bytes(&self) -> usize {
        2 * self.n_layer * self.tensor_bytes()
    }

    /// The K and V state leaves of `layer` in a graph: K `[n_kv_dim, ctx]`, V
    /// `[ctx, n_kv_dim]`.
    pub(crate) fn leaves(&self, g: &mut Graph, layer: usize) -> Result<(TensorId, TensorId)> {
        let at = |k: usize| BufferRef {
            buffer: self.buffer,
            offset: (2 * layer + k) * self.tensor_bytes(),
        };
        let k = g.state(
            &format!("cache_k.{layer}"),
            KV_DTYPE,
            &[self.n_kv_dim, self.ctx],
            at(0),
        )?;
        let v = g.state(
            &format!("cache_v.{layer}"),
            KV_DTYPE,
            &[self.ctx, self.n_kv_dim],
            at(1),
        )?;
        Ok((k, v))
    }
}
