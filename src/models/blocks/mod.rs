//! The shared building blocks of decoder-only transformers, as functions over graft's
//! graph API, and the graphs built from them. A model's architecture
//! ([`Arch`](crate::models::arch::Arch)) picks the blocks; nothing here is written for one model.
//!
//! A block is pre-norm: `x += attn(norm(x)); x += mlp(norm(x))` where
//! - the norm is RMSNorm (`rms_norm(x) * w`) or LayerNorm (`norm(x) * w + b`);
//! - attention projects q, k and v (one fused mul_mat when the weights share a dtype,
//!   with or without biases), optionally normalizes q and k per head (Qwen3), applies
//!   rotary embeddings (NeoX pairing, as HF stores the weights) unless positions are
//!   learned, writes K and V into the [`KvCache`] and attends with grouped-query heads,
//!   causal and, for Mistral, over a sliding window; then the output projection (with
//!   bias where the architecture has one);
//! - the MLP is SwiGLU (`down(silu(gate(x)) * up(x))`, gate|up fused) or GELU
//!   (`down(gelu(up(x) + b) ) + b`).
//!
//! The embedding is a `get_rows` of the token table, plus one of the position table for
//! learned positions (GPT-2); the head is the final norm and the output projection (the
//! embedding table when tied).
//!
//! The graphs:
//! - **batch** ([`batch::build_batch`]): the tokens of many sequences over a pool of KV
//!   blocks, what the batched engine runs every step;
//! - **prefill** of `n` tokens at positions `n_past..n_past + n`: K/V are written with
//!   `cpy` into views of the cache at `n_past`, and attention is `mul_mat` + `scale` +
//!   `diag_mask_inf(n_past)` + `soft_max` + `mul_mat` over exactly the `n_past + n` filled
//!   positions, or the fused `flash_attn_ext`; with a sliding window or the fused op, the
//!   mask is an input the host fills. One sequence's forward pass
//!   ([`Model`](crate::models::Model)) runs it from position 0;
//! - **decode** of one token over a KV-length bucket ([`DECODE_BUCKET`] positions) of a
//!   contiguous cache: nothing in the graph depends on the position (it comes in as data,
//!   `pos`), K/V are written with `set_rows` at row `pos`, and attention reads the whole
//!   bucket with an additive mask input (0 where visible, -inf elsewhere). The masked
//!   positions are inert because the cache is zero-initialised and only ever written with
//!   finite values: their scores become -inf, their weights exactly 0, and 0 times a
//!   finite V is 0. `graft dump --decode` shows it; no generation runs it.
//!
//! A **trace** graph ([`build_trace`]) is the prefill graph from position 0 with every
//! named intermediate ([`TRACE_NAMES`]) kept as an output, for `graft trace`.

pub mod batch;
pub mod kv_cache;
pub(crate) mod moe;

use crate::error::{Error, Result};
use crate::graph::{DType, FlashAttnParams, Graph, Plan, TensorId};
use crate::ops::RopeParams;

use crate::models::arch::config::Config;
use crate::models::arch::{MlpKind, NormKind, Positions};
use crate::models::load::options::CacheTypes;
use crate::models::load::weights::{
    FfnLeaves, GateUpLeaves, LayerLeaves, Leaves, NormLeaves, QkvLeaves, Weights,
};
use kv_cache::{ring_chunk, KvCache};
use moe::route;

/// Positions per decode KV-length bucket (ggml pads the KV length the same way).
pub const DECODE_BUCKET: usize = 256;

/// Bytes of an F32 element (every mul_mat result is F32).
const F32_BYTES: usize = 4;

/// The names of a trace, per layer `{i}` (`blk.{i}.q`) and for the whole model, in
/// execution order, with the layout of each (outermost first; `n` tokens).
pub const TRACE_NAMES: &[(&str, &str)] = &[
    ("embd", "[n, n_embd]: the input of block 0"),
    (
        "blk.{i}.attn_norm",
        "[n, n_embd]: the normalized input of attention",
    ),
    (
        "blk.{i}.q",
        "[n, n_head, head_dim]: queries after q-norm and rope",
    ),
    (
        "blk.{i}.k",
        "[n, n_kv_head, head_dim]: keys after k-norm and rope",
    ),
    ("blk.{i}.v", "[n, n_kv_head, head_dim]: values"),
    (
        "blk.{i}.kqv",
        "[n, n_head * head_dim]: attention with heads merged",
    ),
    ("blk.{i}.attn_out", "[n, n_embd]: the output projection"),
    (
        "blk.{i}.ffn_inp",
        "[n, n_embd]: the residual after attention",
    ),
    (
        "blk.{i}.ffn_norm",
        "[n, n_embd]: the normalized input of the MLP",
    ),
    ("blk.{i}.ffn_out", "[n, n_embd]: the MLP's output"),
    ("blk.{i}.out", "[n, n_embd]: the block's output"),
    ("output_norm", "[n, n_embd]: the final norm"),
    ("logits", "[n, vocab]"),
];

/// The additive mask of queries at positions `queries` over the first `n_kv` cache
/// positions, `[n_kv, queries.len()]`: 0 where key `j` is visible to the query at `p`
/// (`j <= p`, and `p - j < window` with a sliding window), -inf elsewhere. Each row is
/// one run of zeros between two runs of -inf, filled in parallel over rows when the mask
/// is large (a 16,384-token prefill's mask is 1 GiB; per-element code made it seconds of
/// host time), on the calling thread when it is small (a decode step's single row, where
/// handing the work to the thread pool and waiting for it costs more than the fill).
pub fn attention_mask(
    queries: impl Iterator<Item = usize>,
    n_kv: usize,
    window: Option<usize>,
) -> Vec<f32> {
    use rayon::prelude::*;
    let queries: Vec<usize> = queries.collect();
    let mut m = vec![f32::NEG_INFINITY; n_kv * queries.len()];
    if n_kv == 0 {
        return m;
    }
    let fill = |(row, &p): (&mut [f32], &usize)| {
        // visible: lo..=p (clipped to the cache)
        let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
        let hi = (p + 1).min(n_kv);
        if lo < hi {
            row[lo..hi].fill(0.0);
        }
    };
    if m.len() < PARALLEL_MASK_ELEMENTS {
        m.chunks_mut(n_kv).zip(&queries).for_each(fill);
    } else {
        m.par_chunks_mut(n_kv)
            .zip(queries.par_iter())
            .for_each(fill);
    }
    m
}

/// Mask elements from which [`attention_mask`] fills rows on the thread pool.
const PARALLEL_MASK_ELEMENTS: usize = 1 << 20;

/// The additive mask of queries at positions `queries` (the last one just written) over
/// the `slots` slots of a ring cache, `[slots, queries.len()]`: slot `j` holds the
/// latest position `q <= queries.end - 1` with `q % slots == j` (none if never written),
/// visible to the query at `p` when `q <= p` and `p - q < window`.
pub fn ring_mask(queries: std::ops::Range<usize>, slots: usize, window: Option<usize>) -> Vec<f32> {
    let latest = queries.end.saturating_sub(1);
    queries
        .flat_map(|p| {
            (0..slots).map(move |j| {
                let held = (latest >= j).then(|| latest - (latest - j) % slots);
                let seen = held.is_some_and(|q| q <= p && window.is_none_or(|w| p - q < w));
                if seen {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect()
}

/// The KV length a decode step at `pos` attends over: `pos + 1` rounded up to a
/// multiple of [`DECODE_BUCKET`], at most `ctx`.
pub fn decode_bucket(pos: usize, ctx: usize) -> usize {
    ((pos + 1).div_ceil(DECODE_BUCKET) * DECODE_BUCKET).min(ctx)
}

/// The cache positions a decode step at `pos` attends over: its bucket
/// ([`decode_bucket`]), or every slot of a ring cache.
pub fn decode_n_kv(cache: &KvCache, pos: usize) -> usize {
    match cache.is_ring() {
        true => cache.slots,
        false => decode_bucket(pos, cache.ctx),
    }
}

/// The most tokens one prefill graph over `cache` takes after `n_past`: the rest of the
/// context, or a ring cache's chunk.
pub fn prefill_room(cfg: &Config, cache: &KvCache, n_past: usize) -> usize {
    match (cache.is_ring(), cfg.sliding_window) {
        (true, Some(w)) => ring_chunk(w),
        (true, None) | (false, _) => cache.ctx.saturating_sub(n_past),
    }
}

/// One intermediate tensor kept by a trace graph.
#[derive(Clone, Debug)]
pub struct Traced {
    /// Its name ([`TRACE_NAMES`]).
    pub name: String,
    /// The node (contiguous F32).
    pub id: TensorId,
    /// Its shape, outermost first (`[n, n_embd]`).
    pub shape: Vec<usize>,
}

/// One graph of the model with its named inputs and outputs.
pub struct ModelGraph {
    /// The graph.
    pub graph: Graph,
    /// Input: token ids, I32 `[n]`.
    pub tokens: TensorId,
    /// Input: positions, I32 `[n]`.
    pub pos: TensorId,
    /// Input: the additive attention mask, F32 `[n_kv, n]` (decode, the fused
    /// attention and sliding windows).
    pub kq_mask: Option<TensorId>,
    /// Input (ring caches only): the cache slot of each token, I32 `[n]`.
    pub kv_idx: Option<TensorId>,
    /// Output: logits, F32 `[vocab, n_out]`.
    pub logits: TensorId,
    /// Output: argmax of the last logits, I32 `[1]`.
    pub argmax: TensorId,
    /// Positions whose logits are computed (1, or `n` for all).
    pub n_out: usize,
    /// Cache positions attention reads (the mask's row length).
    pub n_kv: usize,
    /// The intermediates kept as outputs (trace graphs only), in execution order.
    pub traced: Vec<Traced>,
}

impl ModelGraph {
    /// Plans the graph (logits, argmax and the traced tensors as outputs).
    pub fn plan(&self) -> Result<Plan> {
        let mut outs = vec![self.logits, self.argmax];
        outs.extend(self.traced.iter().map(|t| t.id));
        self.graph.plan(&outs)
    }
}

/// The device's part of sampling from `logits` F32 `[vocab, n]` (contiguous): the ids of
/// the `k` largest logits of each column, I32 `[k, n]` (`top_k`: largest first, ties to
/// the lower id), and their values, F32 `[k, n]` (`get_rows` of the logits seen as a
/// table of one-logit rows), so that the host reads `8 k` bytes a column instead of the
/// vocabulary.
pub fn sample_outputs(g: &mut Graph, logits: TensorId, k: usize) -> Result<(TensorId, TensorId)> {
    let [vocab, n, ..] = g.get(logits)?.ne;
    // ids: I32 [k, n]
    let ids = g.top_k(logits, k)?;
    // table: [1, vocab, n], one row per logit
    let table = g.reshape(logits, &[1, vocab, n])?;
    // vals: [1, k, n] -> [k, n]
    let vals = g.get_rows(table, ids)?;
    let vals = g.reshape(vals, &[k, n])?;
    Ok((ids, vals))
}

/// How attention scores are masked.
#[derive(Clone, Copy)]
enum Mask {
    /// Causal mask for queries at positions `n_past..` (prefill).
    Causal { n_past: usize },
    /// An additive mask input broadcast over heads.
    Input(TensorId),
}

/// The q/k/v projections of one layer.
struct Qkv {
    /// Roped queries: `[head_dim, n_head, n]`.
    q: TensorId,
    /// Roped keys: `[head_dim, n_kv_head, n]`.
    k: TensorId,
    /// Values: `[n_kv_dim, n]` (a strided view of the fused result, or its own tensor).
    v: TensorId,
}

/// A graph's inputs: tokens, positions, the mask and the ring slots.
type Inputs = (TensorId, TensorId, Option<TensorId>, Option<TensorId>);

/// Builds one graph of a model.
struct Builder<'a> {
    g: Graph,
    cfg: &'a Config,
    /// Positions stored per layer (the context, or a sliding-window ring's slots).
    ctx: usize,
    rope: RopeParams,
    /// The cache's types; `cache.flash_attn` picks the fused attention op.
    cache: CacheTypes,
    /// The intermediates kept (when tracing).
    trace: Option<Vec<Traced>>,
    /// Tokens of the graph.
    n: usize,
}

impl<'a> Builder<'a> {
    fn new(cfg: &'a Config, cache: &KvCache, n: usize, trace: bool) -> Self {
        Builder {
            g: Graph::new(),
            cfg,
            ctx: cache.slots,
            rope: cfg.rope(),
            cache: cache.types,
            trace: trace.then(Vec::new),
            n,
        }
    }

    /// Keeps `t` (of `shape`, outermost first, `n` first) as the trace tensor `name`
    /// (`{i}` replaced by `layer`), made contiguous; a no-op unless tracing.
    fn mark(&mut self, name: &str, layer: usize, t: TensorId, shape: &[usize]) -> Result<()> {
        let Some(trace) = &mut self.trace else {
            return Ok(());
        };
        let name = name.replace("{i}", &layer.to_string());
        let id = match self.g.tensor(t).is_contiguous() {
            true => self.g.set_name(t, name.clone())?,
            false => {
                let c = self.g.cont(t)?;
                self.g.set_name(c, name.clone())?
            }
        };
        let mut full = vec![self.n];
        full.extend_from_slice(shape);
        trace.push(Traced {
            name,
            id,
            shape: full,
        });
        Ok(())
    }

    /// The block's norm of `x`: RMSNorm times the weight, or LayerNorm times the weight
    /// plus the bias.
    fn norm(&mut self, x: TensorId, w: NormLeaves) -> Result<TensorId> {
        let eps = self.cfg.norm_eps;
        let g = &mut self.g;
        let cur = match self.cfg.arch.spec().norm {
            NormKind::Rms => g.rms_norm(x, eps)?,
            NormKind::Layer => g.norm(x, eps)?,
        };
        let cur = g.mul(cur, w.w)?;
        match w.b {
            Some(b) => g.add(cur, b),
            None => Ok(cur),
        }
    }

    /// `w x (+ b)`.
    fn linear(&mut self, w: TensorId, b: Option<TensorId>, x: TensorId) -> Result<TensorId> {
        let y = self.g.mul_mat(w, x)?;
        match b {
            Some(b) => self.g.add(y, b),
            None => Ok(y),
        }
    }

    /// `w x (+ b)` where `w` holds this device's columns of a split projection: the
    /// devices' partial products are summed (`all_reduce`) before the bias, which every
    /// device holds whole. The same as [`Builder::linear`] on one device.
    fn linear_summed(&mut self, w: TensorId, b: Option<TensorId>, x: TensorId) -> Result<TensorId> {
        let mut y = self.g.mul_mat(w, x)?;
        if self.cfg.tp > 1 {
            y = self.g.all_reduce(y, self.cfg.tp)?;
        }
        match b {
            Some(b) => self.g.add(y, b),
            None => Ok(y),
        }
    }

    /// The embedding of `tokens` at `pos`: `[n_embd, n]`.
    fn embed(&mut self, leaves: &Leaves, tokens: TensorId, pos: TensorId) -> Result<TensorId> {
        let x = self.g.get_rows(leaves.tok_embd, tokens)?;
        let x = match leaves.pos_embd {
            Some(p) => {
                let px = self.g.get_rows(p, pos)?;
                self.g.add(x, px)?
            }
            None => x,
        };
        self.mark("embd", 0, x, &[self.cfg.hidden_size])?;
        Ok(x)
    }

    /// q, k and v of `n` tokens (one fused mul_mat, or three when their weights differ
    /// in dtype), biases added; q and k normalized per head and roped at `pos` as the
    /// architecture says.
    fn qkv(
        &mut self,
        i: usize,
        l: &LayerLeaves,
        cur: TensorId,
        pos: TensorId,
        n: usize,
    ) -> Result<Qkv> {
        let c = self.cfg;
        let (hd, n_q, n_kv_dim) = (c.head_dim, c.n_q(), c.n_kv_dim());
        let (n_head, n_kv_head) = (c.num_attention_heads, c.num_key_value_heads);
        let g = &mut self.g;
        // biases of q, k and v (views of one vector when they are stored together)
        let bias = |g: &mut Graph, part: usize| -> Result<Option<TensorId>> {
            match &l.qkv_b {
                None => Ok(None),
                Some(QkvLeaves::Split { q, k, v }) => Ok(Some([*q, *k, *v][part])),
                Some(QkvLeaves::Fused(b)) => {
                    let (len, off) = [(n_q, 0), (n_kv_dim, n_q), (n_kv_dim, n_q + n_kv_dim)][part];
                    g.view_1d(*b, len, off * F32_BYTES).map(Some)
                }
            }
        };
        let (q, k, v) = match l.qkv {
            QkvLeaves::Fused(w) => {
                // qkv: [n_q + 2 * n_kv_dim, n]
                let mut qkv = g.mul_mat(w, cur)?;
                if let Some(QkvLeaves::Fused(b)) = l.qkv_b {
                    qkv = g.add(qkv, b)?;
                }
                let row = g.tensor(qkv).nb[1];
                // q: [hd, n_head, n], k: [hd, n_kv_head, n] (strided views of qkv's columns)
                let q = g.view_3d(qkv, hd, n_head, n, hd * F32_BYTES, row, 0)?;
                let k_off = n_q * F32_BYTES;
                let k = g.view_3d(qkv, hd, n_kv_head, n, hd * F32_BYTES, row, k_off)?;
                // v: [n_kv_dim, n]
                let v_off = (n_q + n_kv_dim) * F32_BYTES;
                let v = g.view_2d(qkv, n_kv_dim, n, row, v_off)?;
                (q, k, v)
            }
            QkvLeaves::Split { q, k, v } => {
                let proj = |g: &mut Graph, w: TensorId, part: usize| -> Result<TensorId> {
                    let y = g.mul_mat(w, cur)?;
                    match bias(g, part)? {
                        Some(b) => g.add(y, b),
                        None => Ok(y),
                    }
                };
                // q: [n_q, n] -> [hd, n_head, n]; k: [n_kv_dim, n] -> [hd, n_kv_head, n]
                let q = proj(g, q, 0)?;
                let q = g.reshape(q, &[hd, n_head, n])?;
                let k = proj(g, k, 1)?;
                let k = g.reshape(k, &[hd, n_kv_head, n])?;
                // v: [n_kv_dim, n]
                let v = proj(g, v, 2)?;
                (q, k, v)
            }
        };
        let q = self.head_norm(q, l.q_norm)?;
        let k = self.head_norm(k, l.k_norm)?;
        let (q, k) = match c.arch.spec().positions {
            Positions::Rope => (
                self.g.rope(q, pos, self.rope)?,
                self.g.rope(k, pos, self.rope)?,
            ),
            // contiguous, as the cache write and attention read them
            Positions::Learned => (self.contiguous(q)?, self.contiguous(k)?),
        };
        self.mark("blk.{i}.q", i, q, &[n_head, hd])?;
        self.mark("blk.{i}.k", i, k, &[n_kv_head, hd])?;
        self.mark("blk.{i}.v", i, v, &[n_kv_head, hd])?;
        Ok(Qkv { q, k, v })
    }

    /// `t` itself when contiguous, else a contiguous copy.
    fn contiguous(&mut self, t: TensorId) -> Result<TensorId> {
        match self.g.tensor(t).is_contiguous() {
            true => Ok(t),
            false => self.g.cont(t),
        }
    }

    /// The per-head RMSNorm of q or k (`[hd, heads, n]`, weight `[hd]`), if any.
    fn head_norm(&mut self, x: TensorId, w: Option<TensorId>) -> Result<TensorId> {
        let Some(w) = w else {
            return Ok(x);
        };
        let y = self.g.rms_norm(x, self.cfg.norm_eps)?;
        self.g.mul(y, w)
    }

    /// `softmax(K^T q / sqrt(hd) + mask) V` over the first `n_kv` cache positions, for
    /// `n` queries `q` [hd, n_head, n]; heads merged back into `[n_q, n]`.
    fn attend(
        &mut self,
        q: TensorId,
        k_all: TensorId,
        v_all: TensorId,
        n_kv: usize,
        n: usize,
        mask: Mask,
    ) -> Result<TensorId> {
        if self.cache.flash_attn {
            return self.attend_flash(q, k_all, v_all, n_kv, n, mask);
        }
        let c = self.cfg;
        let (hd, n_kv_head) = (c.head_dim, c.num_key_value_heads);
        let ctx = self.ctx;
        let vb = self.cache.v.block_bytes();
        let k = self.kv_view(k_all, self.cache.k, n_kv)?;
        let g = &mut self.g;
        // v: [n_kv, hd, n_kv_head] (channel rows of the transposed V cache)
        let v = g.view_3d(v_all, n_kv, hd, n_kv_head, ctx * vb, ctx * hd * vb, 0)?;
        // qp: [hd, n, n_head]
        let qp = g.permute(q, [0, 2, 1, 3])?;
        // kq: [n_kv, n, n_head]; query head h reads KV head h / (n_head / n_kv_head)
        let kq = g.mul_mat(k, qp)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let kq = match mask {
            Mask::Causal { n_past } => {
                let kq = g.scale(kq, scale)?;
                let kq = g.diag_mask_inf(kq, n_past)?;
                g.soft_max(kq)?
            }
            Mask::Input(m) => g.soft_max_ext(kq, Some(m), scale)?,
        };
        // kqv: [hd, n, n_head]
        let kqv = g.mul_mat(v, kq)?;
        // merged: [hd, n_head, n] -> [n_q, n] (already contiguous when n == 1)
        let merged = g.permute(kqv, [0, 2, 1, 3])?;
        let merged = self.contiguous(merged)?;
        self.g.reshape(merged, &[c.n_q(), n])
    }

    /// `[hd, n_kv, n_kv_head]`: each KV head's slice of the first `n_kv` position rows of
    /// a cache stored by position (`[n_kv_dim, ctx]` of `dtype`).
    fn kv_view(&mut self, cache: TensorId, dtype: DType, n_kv: usize) -> Result<TensorId> {
        let c = self.cfg;
        let (hd, n_kv_head, n_kv_dim) = (c.head_dim, c.num_key_value_heads, c.n_kv_dim());
        let (row, head) = (dtype.row_bytes(n_kv_dim), dtype.row_bytes(hd));
        self.g.view_3d(cache, hd, n_kv, n_kv_head, row, head, 0)
    }

    /// The fused attention op over the first `n_kv` cache positions for `n` queries `q`
    /// [hd, n_head, n]; the mask is an input (`Mask::Input`) of `[n_kv, n]`.
    fn attend_flash(
        &mut self,
        q: TensorId,
        k_all: TensorId,
        v_all: TensorId,
        n_kv: usize,
        n: usize,
        mask: Mask,
    ) -> Result<TensorId> {
        let Mask::Input(mask) = mask else {
            return Err(Error::model(
                "internal: the fused attention takes its causal mask as an input",
            ));
        };
        let (hd, n_q) = (self.cfg.head_dim, self.cfg.n_q());
        let k = self.kv_view(k_all, self.cache.k, n_kv)?;
        let v = self.kv_view(v_all, self.cache.v, n_kv)?;
        let g = &mut self.g;
        // qp: [hd, n, n_head]
        let qp = g.permute(q, [0, 2, 1, 3])?;
        let p = FlashAttnParams {
            scale: 1.0 / (hd as f32).sqrt(),
            max_bias: 0.0,
            softcap: 0.0,
        };
        // o: [hd, n_head, n] -> [n_q, n]
        let o = g.flash_attn_ext(qp, k, v, Some(mask), p)?;
        g.reshape(o, &[n_q, n])
    }

    /// Writes `v` [n_kv_dim, n] into cache positions `n_past..n_past + n`; returns the
    /// write.
    fn write_v_prefill(
        &mut self,
        v: TensorId,
        v_cache: TensorId,
        n: usize,
        n_past: usize,
    ) -> Result<TensorId> {
        let (n_kv_dim, ctx, dt) = (self.cfg.n_kv_dim(), self.ctx, self.cache.v);
        let g = &mut self.g;
        if self.cache.flash_attn {
            // rows n_past..n_past + n of [n_kv_dim, ctx]
            let rb = dt.row_bytes(n_kv_dim);
            let v_dst = g.view_2d(v_cache, n_kv_dim, n, rb, n_past * rb)?;
            return g.cpy(v, v_dst);
        }
        // v: [n_kv_dim, n] -> transposed [n, n_kv_dim] into columns n_past.. of [ctx, n_kv_dim]
        let vb = dt.block_bytes();
        let vt = g.transpose(v)?;
        let v_dst = g.view_2d(v_cache, n, n_kv_dim, ctx * vb, n_past * vb)?;
        g.cpy(vt, v_dst)
    }

    /// The attention output projection of the merged heads `[n_q, n]` (traced).
    fn attn_output(&mut self, i: usize, l: &LayerLeaves, merged: TensorId) -> Result<TensorId> {
        self.mark("blk.{i}.kqv", i, merged, &[self.cfg.n_q()])?;
        // o: [n_embd, n]
        let o = self.linear_summed(l.attn_out, l.attn_out_b, merged)?;
        self.mark("blk.{i}.attn_out", i, o, &[self.cfg.hidden_size])?;
        Ok(o)
    }

    /// Writes `k` `[hd, n_kv_head, n]` and `v` `[n_kv_dim, n]` of `n` tokens into the
    /// cache slots `idx` (I32 `[n]`) with `set_rows`; returns the caches to read after
    /// the writes.
    fn write_rows(
        &mut self,
        (k_cache, v_cache): (TensorId, TensorId),
        k: TensorId,
        v: TensorId,
        idx: TensorId,
    ) -> Result<(TensorId, TensorId)> {
        let (n_kv_dim, ctx, n) = (self.cfg.n_kv_dim(), self.ctx, self.n);
        let vb = self.cache.v.block_bytes();
        let by_position = self.cache.flash_attn;
        let g = &mut self.g;
        // K: rows `idx` of [n_kv_dim, slots]
        let k_rows = g.reshape(k, &[n_kv_dim, n])?;
        let k_all = g.set_rows(k_cache, k_rows, idx)?;
        let v_write = if by_position {
            // V: rows `idx` of [n_kv_dim, slots], like K
            g.set_rows(v_cache, v, idx)?
        } else {
            // V: the transposed cache seen as [1, slots, n_kv_dim] (row p of matrix c is
            // the element (p, c)), so writing row `idx[t]` of every matrix writes column
            // `idx[t]`; the source is v as [1, n, n_kv_dim] and the ids broadcast over dim 2
            let v_dst = g.view_3d(v_cache, 1, ctx, n_kv_dim, vb, ctx * vb, 0)?;
            let row = g.tensor(v).nb[1];
            let v_src = g.view_3d(v, 1, n, n_kv_dim, row, F32_BYTES, 0)?;
            g.set_rows(v_dst, v_src, idx)?
        };
        let v_all = g.after(v_cache, &[v_write])?;
        Ok((k_all, v_all))
    }

    /// Prefill attention into a ring cache: K/V of the `n` tokens written at their slots
    /// (`idx`), then attention over every slot with the mask input.
    #[allow(clippy::too_many_arguments)] // the block's inputs, spelled out
    fn attention_ring(
        &mut self,
        i: usize,
        l: &LayerLeaves,
        kv: (TensorId, TensorId),
        cur: TensorId,
        pos: TensorId,
        idx: TensorId,
        mask: TensorId,
    ) -> Result<TensorId> {
        let n = self.n;
        let Qkv { q, k, v } = self.qkv(i, l, cur, pos, n)?;
        let (k_all, v_all) = self.write_rows(kv, k, v, idx)?;
        let merged = self.attend(q, k_all, v_all, self.ctx, n, Mask::Input(mask))?;
        self.attn_output(i, l, merged)
    }

    /// Prefill attention: writes K/V of positions `n_past..n_past + n` with `cpy` into
    /// views of the cache, then attends over all `n_past + n` positions.
    #[allow(clippy::too_many_arguments)] // the block's inputs, spelled out
    fn attention_prefill(
        &mut self,
        i: usize,
        l: &LayerLeaves,
        (k_cache, v_cache): (TensorId, TensorId),
        cur: TensorId,
        pos: TensorId,
        n_past: usize,
        mask: Mask,
    ) -> Result<TensorId> {
        let n = self.n;
        let Qkv { q, k, v } = self.qkv(i, l, cur, pos, n)?;
        let n_kv_dim = self.cfg.n_kv_dim();
        let rb = self.cache.k.row_bytes(n_kv_dim);
        let g = &mut self.g;
        // K rows n_past..n_past + n of the cache [n_kv_dim, ctx]
        let k_rows = g.reshape(k, &[n_kv_dim, n])?;
        let k_dst = g.view_2d(k_cache, n_kv_dim, n, rb, n_past * rb)?;
        let k_write = g.cpy(k_rows, k_dst)?;
        let v_write = self.write_v_prefill(v, v_cache, n, n_past)?;
        // read the caches after the writes
        let g = &mut self.g;
        let k_all = g.after(k_cache, &[k_write])?;
        let v_all = g.after(v_cache, &[v_write])?;
        let merged = self.attend(q, k_all, v_all, n_past + n, n, mask)?;
        self.attn_output(i, l, merged)
    }

    /// Decode attention for one token at position `pos` (an input): writes K/V with
    /// `set_rows` at slot `idx` (the position itself, or its ring slot), attends over
    /// `n_kv` slots with the mask input.
    #[allow(clippy::too_many_arguments)] // the block's inputs, spelled out
    fn attention_decode(
        &mut self,
        i: usize,
        l: &LayerLeaves,
        kv: (TensorId, TensorId),
        cur: TensorId,
        (pos, idx): (TensorId, TensorId),
        mask: TensorId,
        n_kv: usize,
    ) -> Result<TensorId> {
        let Qkv { q, k, v } = self.qkv(i, l, cur, pos, 1)?;
        let (k_all, v_all) = self.write_rows(kv, k, v, idx)?;
        let merged = self.attend(q, k_all, v_all, n_kv, 1, Mask::Input(mask))?;
        self.attn_output(i, l, merged)
    }

    /// The MLP: SwiGLU `down(silu(gate(x)) * up(x))` with gate|up in one mul_mat (two
    /// when their weights differ in dtype), GELU `down(gelu(up(x) + b)) + b`, or a
    /// mixture of SwiGLU experts ([`Builder::experts`]).
    fn mlp(&mut self, l: &LayerLeaves, cur: TensorId) -> Result<TensorId> {
        let (gate_up, up_b, down, down_b) = match l.ffn {
            FfnLeaves::Dense {
                ref gate_up,
                up_b,
                down,
                down_b,
            } => (gate_up, up_b, down, down_b),
            FfnLeaves::Experts {
                router,
                gate,
                up,
                down,
            } => return self.experts(cur, router, [gate, up, down]),
        };
        let (n, n_ff) = (self.n, self.cfg.intermediate_size);
        let h = match (self.cfg.arch.spec().mlp, gate_up) {
            (MlpKind::Gelu, &GateUpLeaves::Up(up)) => {
                let u = self.linear(up, up_b, cur)?;
                self.g.gelu(u)?
            }
            (MlpKind::SwiGlu, gate_up) => {
                let g = &mut self.g;
                // gate, up: [n_ff, n]
                let (gate, up) = match *gate_up {
                    GateUpLeaves::Fused(w) => {
                        // gu: [2 * n_ff, n]; gate and up are the halves of each column
                        let gu = g.mul_mat(w, cur)?;
                        let row = g.tensor(gu).nb[1];
                        let gate = g.view_2d(gu, n_ff, n, row, 0)?;
                        let up = g.view_2d(gu, n_ff, n, row, n_ff * F32_BYTES)?;
                        (gate, up)
                    }
                    GateUpLeaves::Split { gate, up } => {
                        (g.mul_mat(gate, cur)?, g.mul_mat(up, cur)?)
                    }
                    GateUpLeaves::Up(_) => {
                        return Err(Error::model("internal: a SwiGLU MLP without gate"))
                    }
                };
                let h = g.silu(gate)?;
                g.mul(h, up)?
            }
            (MlpKind::Gelu, GateUpLeaves::Fused(_) | GateUpLeaves::Split { .. }) => {
                return Err(Error::model("internal: a GELU MLP with a gate"))
            }
        };
        // down: [n_embd, n]
        self.linear_summed(down, down_b, h)
    }

    /// A mixture of SwiGLU experts: the router picks each token's `n_used` experts
    /// ([`route`]), each runs `down(silu(gate(x)) * up(x))` with its own matrices
    /// (mul_mat_id), and the outputs are summed with the router's weights.
    fn experts(
        &mut self,
        cur: TensorId,
        router: TensorId,
        [gate, up, down]: [TensorId; 3],
    ) -> Result<TensorId> {
        let moe = self
            .cfg
            .moe
            .ok_or_else(|| Error::model("internal: experts without a mixture of experts"))?;
        let (n, n_embd) = (self.n, self.cfg.hidden_size);
        let g = &mut self.g;
        // logits: [n_expert, n]
        let logits = g.mul_mat(router, cur)?;
        // ids: I32 [n_used, n]; weights: [1, n_used, n]
        let (ids, weights) = route(g, logits, moe)?;
        // every expert of a token reads the token's input: [n_embd, 1, n]
        let x = g.reshape(cur, &[n_embd, 1, n])?;
        // gate, up: [n_ff, n_used, n]
        let gate = g.mul_mat_id(gate, x, ids)?;
        let up = g.mul_mat_id(up, x, ids)?;
        // up first: the plan then runs both products before the silu, which the mul
        // follows at once (one fused SwiGLU launch on the CUDA backend)
        let h = g.silu(gate)?;
        let h = g.mul(up, h)?;
        // each expert's output: [n_embd, n_used, n], scaled by its weight
        let y = g.mul_mat_id(down, h, ids)?;
        // the weighted sum over the experts: [n_embd, n]
        moe::weighted_sum(g, y, weights)
    }

    /// The rest of a block after attention: `x += attn; x += mlp(norm(x))`.
    fn residual_mlp(
        &mut self,
        i: usize,
        l: &LayerLeaves,
        x: TensorId,
        attn: TensorId,
    ) -> Result<TensorId> {
        let n_embd = self.cfg.hidden_size;
        let x = self.g.add(x, attn)?;
        self.mark("blk.{i}.ffn_inp", i, x, &[n_embd])?;
        let cur = self.norm(x, l.ffn_norm)?;
        self.mark("blk.{i}.ffn_norm", i, cur, &[n_embd])?;
        let m = self.mlp(l, cur)?;
        self.mark("blk.{i}.ffn_out", i, m, &[n_embd])?;
        let out = self.g.add(x, m)?;
        self.mark("blk.{i}.out", i, out, &[n_embd])?;
        Ok(out)
    }

    /// The attention norm of block `i` (traced).
    fn attn_norm(&mut self, i: usize, l: &LayerLeaves, x: TensorId) -> Result<TensorId> {
        let cur = self.norm(x, l.attn_norm)?;
        self.mark("blk.{i}.attn_norm", i, cur, &[self.cfg.hidden_size])?;
        Ok(cur)
    }

    /// Final norm and output projection of the last position (or of all `n`), and the
    /// argmax of the last logits.
    fn finish(
        mut self,
        leaves: &Leaves,
        x: TensorId,
        all: bool,
        n_kv: usize,
        (tokens, pos, kq_mask, kv_idx): Inputs,
    ) -> Result<ModelGraph> {
        let (n_embd, vocab, n) = (self.cfg.hidden_size, self.cfg.vocab_size, self.n);
        let n_out = if all { n } else { 1 };
        // x: [n_embd, n_out]
        let x = if all || n == 1 {
            x
        } else {
            let nb1 = self.g.tensor(x).nb[1];
            self.g.view_2d(x, n_embd, 1, nb1, (n - 1) * nb1)?
        };
        let cur = self.norm(x, leaves.out_norm)?;
        self.mark("output_norm", 0, cur, &[n_embd])?;
        let g = &mut self.g;
        // logits: [vocab, n_out]
        let logits = g.mul_mat(leaves.output, cur)?;
        let logits = g.set_name(logits, "logits")?;
        let last = if n_out == 1 {
            logits
        } else {
            let nb1 = g.tensor(logits).nb[1];
            g.view_2d(logits, vocab, 1, nb1, (n_out - 1) * nb1)?
        };
        // argmax: I32 [1]
        let argmax = g.argmax(last)?;
        let argmax = g.set_name(argmax, "argmax")?;
        self.mark("logits", 0, logits, &[vocab])?;
        Ok(ModelGraph {
            graph: self.g,
            tokens,
            pos,
            kq_mask,
            kv_idx,
            logits,
            argmax,
            n_out,
            n_kv,
            traced: self.trace.unwrap_or_default(),
        })
    }
}

/// The prefill graph of `n` tokens at positions `n_past..n_past + n`, with the logits
/// of every position (`all`) or of the last one.
pub fn build_prefill(
    cfg: &Config,
    weights: &Weights,
    cache: &KvCache,
    n: usize,
    n_past: usize,
    all: bool,
) -> Result<ModelGraph> {
    prefill_graph(cfg, weights, cache, (n, n_past), all, false)
}

/// The prefill graph of `n` tokens from position 0 with all logits and every
/// intermediate of [`TRACE_NAMES`] kept as an output ([`ModelGraph::traced`]).
pub fn build_trace(
    cfg: &Config,
    weights: &Weights,
    cache: &KvCache,
    n: usize,
) -> Result<ModelGraph> {
    prefill_graph(cfg, weights, cache, (n, 0), true, true)
}

/// Whether a prefill graph takes its mask as an input: for the fused attention, and for
/// a sliding window (which `diag_mask_inf` cannot express; a ring cache has one).
fn prefill_mask_input(cfg: &Config, cache: &KvCache) -> bool {
    cache.types.flash_attn || cfg.sliding_window.is_some()
}

fn prefill_graph(
    cfg: &Config,
    weights: &Weights,
    cache: &KvCache,
    (n, n_past): (usize, usize),
    all: bool,
    trace: bool,
) -> Result<ModelGraph> {
    if n == 0 || n > prefill_room(cfg, cache, n_past) {
        return Err(Error::model(format!(
            "prefill of {n} tokens after {n_past} does not fit the context of {} tokens ({} stored)",
            cache.ctx, cache.slots
        )));
    }
    let mut b = Builder::new(cfg, cache, n, trace);
    let leaves = weights.leaves(&mut b.g, cfg)?;
    let tokens = b.g.input("tokens", DType::I32, &[n])?;
    let pos = b.g.input("pos", DType::I32, &[n])?;
    // kv_idx (ring): the slot of each token
    let kv_idx = match cache.is_ring() {
        true => Some(b.g.input("kv_idx", DType::I32, &[n])?),
        false => None,
    };
    // kq_mask: [n_kv, n], query i sees keys 0..=n_past + i (within the window)
    let n_kv = if cache.is_ring() {
        cache.slots
    } else {
        n_past + n
    };
    let kq_mask = match prefill_mask_input(cfg, cache) {
        true => Some(b.g.input("kq_mask", DType::F32, &[n_kv, n])?),
        false => None,
    };
    let mask = kq_mask.map_or(Mask::Causal { n_past }, Mask::Input);
    // x: [n_embd, n]
    let mut x = b.embed(&leaves, tokens, pos)?;
    for (i, l) in leaves.layers.iter().enumerate() {
        let kv = cache.leaves(&mut b.g, i)?;
        let cur = b.attn_norm(i, l, x)?;
        let attn = match (kv_idx, kq_mask) {
            (Some(idx), Some(m)) => b.attention_ring(i, l, kv, cur, pos, idx, m)?,
            (_, _) => b.attention_prefill(i, l, kv, cur, pos, n_past, mask)?,
        };
        x = b.residual_mlp(i, l, x, attn)?;
    }
    b.finish(&leaves, x, all, n_kv, (tokens, pos, kq_mask, kv_idx))
}

/// The decode graph of one token attending over `n_kv` cache positions (a bucket);
/// the position is an input, so one graph serves every position below `n_kv`.
pub fn build_decode(
    cfg: &Config,
    weights: &Weights,
    cache: &KvCache,
    n_kv: usize,
) -> Result<ModelGraph> {
    if n_kv == 0 || n_kv > cache.slots {
        return Err(Error::model(format!(
            "decode over {n_kv} positions does not fit the cache of {} positions",
            cache.slots
        )));
    }
    let mut b = Builder::new(cfg, cache, 1, false);
    let leaves = weights.leaves(&mut b.g, cfg)?;
    let tokens = b.g.input("tokens", DType::I32, &[1])?;
    let pos = b.g.input("pos", DType::I32, &[1])?;
    // kq_mask: [n_kv, 1], 0 for visible positions, -inf beyond
    let mask = b.g.input("kq_mask", DType::F32, &[n_kv, 1])?;
    // kv_idx (ring): the token's slot; else the position itself is the row written
    let kv_idx = match cache.is_ring() {
        true => Some(b.g.input("kv_idx", DType::I32, &[1])?),
        false => None,
    };
    // x: [n_embd, 1]
    let mut x = b.embed(&leaves, tokens, pos)?;
    for (i, l) in leaves.layers.iter().enumerate() {
        let kv = cache.leaves(&mut b.g, i)?;
        let cur = b.attn_norm(i, l, x)?;
        let idx = kv_idx.unwrap_or(pos);
        let attn = b.attention_decode(i, l, kv, cur, (pos, idx), mask, n_kv)?;
        x = b.residual_mlp(i, l, x, attn)?;
    }
    b.finish(&leaves, x, false, n_kv, (tokens, pos, Some(mask), kv_idx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::BufferId;
    use crate::models::arch::presets;
    use crate::models::arch::role::Role;
    use crate::models::load::quant_plan::QuantPlan;
    use crate::models::load::weights::uniform;

    #[test]
    fn buckets() {
        assert_eq!(decode_bucket(0, 4096), 256);
        assert_eq!(decode_bucket(255, 4096), 256);
        assert_eq!(decode_bucket(256, 4096), 512);
        assert_eq!(decode_bucket(256, 300), 300);
        assert_eq!(decode_bucket(10, 100), 100);
    }

    /// The row-run fill gives exactly the per-element definition: key j visible to the
    /// query at p when j <= p and, with a window w, p - j < w.
    #[test]
    fn attention_mask_matches_its_definition() {
        for (start, n, n_kv, window) in [
            (0, 5, 5, None),
            (3, 4, 9, None),
            (0, 7, 7, Some(3)),
            (10, 6, 20, Some(4)),
            (2, 3, 3, Some(100)),
            (0, 2, 0, None),
            // past PARALLEL_MASK_ELEMENTS: rows filled on the thread pool
            (700, 600, 1800, Some(900)),
            (0, 1100, 1100, None),
        ] {
            let m = attention_mask(start..start + n, n_kv, window);
            assert_eq!(m.len(), n * n_kv);
            for (i, p) in (start..start + n).enumerate() {
                for j in 0..n_kv {
                    let seen = j <= p && window.is_none_or(|w| p - j < w);
                    let want = if seen { 0.0 } else { f32::NEG_INFINITY };
                    assert_eq!(m[i * n_kv + j], want, "query {p} key {j} window {window:?}");
                }
            }
        }
    }

    /// The graphs plan for every preset without touching a backend, and use exactly the
    /// ops the decode and prefill designs call for.
    #[test]
    fn graphs_plan_from_the_layout_alone() {
        for name in presets::NAMES {
            let cfg = presets::preset(name).unwrap();
            let w = Weights::layout(&cfg, &uniform(DType::F16), BufferId::fresh());
            let classic = CacheTypes {
                flash_attn: false,
                ..CacheTypes::default()
            };
            let kv = KvCache::layout(&cfg, 1024, classic, BufferId::fresh());
            let pre = build_prefill(&cfg, &w, &kv, 7, 3, false).unwrap();
            let plan = pre.plan().unwrap();
            let ops: Vec<&str> = plan.steps.iter().map(|s| s.op.name()).collect();
            let l = cfg.num_hidden_layers;
            let count = |op: &str| ops.iter().filter(|o| **o == op).count();
            // a mixture of experts: the router's product, then top_k and three
            // mul_mat_id in place of the MLP's two products
            let experts = cfg.moe.is_some() as usize;
            let products = (6 - experts) * l + 1;
            assert_eq!(count("mul_mat"), products, "{name}: {ops:?}");
            assert_eq!(count("mul_mat_id"), 3 * experts * l);
            assert_eq!(count("top_k"), experts * l);
            assert_eq!(count("cpy"), 2 * l);
            // a sliding window comes in as a mask input, the causal mask is an op
            let windowed = cfg.sliding_window.is_some();
            assert_eq!(count("diag_mask_inf"), if windowed { 0 } else { l });
            assert_eq!(pre.kq_mask.is_some(), windowed);
            // attention's, and the router's over the selected experts
            assert_eq!(count("soft_max"), (1 + experts) * l);
            assert_eq!(count("set_rows"), 0);
            let dec = build_decode(&cfg, &w, &kv, 512).unwrap();
            let plan = dec.plan().unwrap();
            let ops: Vec<&str> = plan.steps.iter().map(|s| s.op.name()).collect();
            let count = |op: &str| ops.iter().filter(|o| **o == op).count();
            assert_eq!(count("set_rows"), 2 * l);
            assert_eq!(count("diag_mask_inf"), 0);
            assert_eq!(count("cont"), 0, "n == 1 needs no cont of the merged heads");
            assert_eq!(count("mul_mat"), products);
            assert_eq!(count("mul_mat_id"), 3 * experts * l);

            // The fused attention: one op per layer instead of two products, a scale, a
            // mask and a softmax; K and V both written by position.
            let kv = KvCache::layout(&cfg, 1024, CacheTypes::default(), BufferId::fresh());
            for mg in [
                build_prefill(&cfg, &w, &kv, 7, 3, false).unwrap(),
                build_decode(&cfg, &w, &kv, 512).unwrap(),
            ] {
                let plan = mg.plan().unwrap();
                let ops: Vec<&str> = plan.steps.iter().map(|s| s.op.name()).collect();
                let count = |op: &str| ops.iter().filter(|o| **o == op).count();
                assert_eq!(count("flash_attn_ext"), l, "{name}: {ops:?}");
                assert_eq!(count("mul_mat"), (4 - experts) * l + 1);
                assert_eq!(count("soft_max"), experts * l);
                assert_eq!(count("diag_mask_inf"), 0);
                assert_eq!(count("cpy") + count("set_rows"), 2 * l);
                assert!(mg.kq_mask.is_some());
            }
        }
    }

    /// With Q4_K_M, the layers whose attn_v is Q6_K run q, k and v as three mul_mats;
    /// the others keep the fused q|k|v (gate|up share Q4_K everywhere).
    #[test]
    fn mixed_dtypes_split_the_fused_mul_mats() {
        let cfg = presets::preset("llama2-7b").unwrap();
        let pick = |r, l| QuantPlan::Q4_K_M.pick(r, l, &cfg).dtype;
        let w = Weights::layout(&cfg, &pick, BufferId::fresh());
        let split = (0..cfg.num_hidden_layers)
            .filter(|&l| {
                let dt = |r| w.get(r, Some(l)).unwrap().dtype;
                dt(Role::AttnQ) != dt(Role::AttnV)
            })
            .count();
        assert_eq!(split, 16);
        let classic = CacheTypes {
            flash_attn: false,
            ..CacheTypes::default()
        };
        let kv = KvCache::layout(&cfg, 1024, classic, BufferId::fresh());
        let l = cfg.num_hidden_layers;
        for mg in [
            build_prefill(&cfg, &w, &kv, 7, 3, false).unwrap(),
            build_decode(&cfg, &w, &kv, 256).unwrap(),
        ] {
            let plan = mg.plan().unwrap();
            let mm = plan
                .steps
                .iter()
                .filter(|s| s.op.name() == "mul_mat")
                .count();
            assert_eq!(mm, 6 * l + 1 + 2 * split);
        }
    }

    #[test]
    fn graphs_reject_what_does_not_fit() {
        let cfg = presets::preset("tiny").unwrap();
        let w = Weights::layout(&cfg, &uniform(DType::F32), BufferId::fresh());
        let kv = KvCache::layout(&cfg, 64, CacheTypes::default(), BufferId::fresh());
        assert!(build_prefill(&cfg, &w, &kv, 60, 5, false).is_err());
        assert!(build_prefill(&cfg, &w, &kv, 0, 0, false).is_err());
        assert!(build_decode(&cfg, &w, &kv, 65).is_err());
    }
}
