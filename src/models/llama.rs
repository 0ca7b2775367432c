//! Llama 2 / Llama 3: the model graphs and the inference API.
//!
//! A block is `x += attn(norm(x)); x += mlp(norm(x))` with RMSNorm, rotary position
//! embeddings (NeoX pairing, as HF stores Llama), grouped-query attention and a SwiGLU
//! MLP. The weights live in one buffer ([`Weights`]): q|k|v and gate|up are fused, so a
//! block runs four weight mul_mats. Keys and values go to an F16 [`KvCache`].
//!
//! Two graphs run the model:
//! - **prefill** of `n` tokens at positions `n_past..n_past + n` (built per `(n, n_past)`
//!   and cached): K/V are written with `cpy` into views of the cache at `n_past`, and
//!   attention is `mul_mat` + `scale` + `diag_mask_inf(n_past)` + `soft_max` + `mul_mat`
//!   over exactly the `n_past + n` filled positions;
//! - **decode** of one token, built once per KV-length bucket ([`DECODE_BUCKET`]
//!   positions) and replayed every step, so a backend that captures a plan (CUDA graphs)
//!   captures once per bucket. Nothing in the graph depends on the position: it comes in
//!   as data (`pos`), K/V are written with `set_rows` at row `pos`, and attention reads
//!   the whole bucket with an additive mask input (0 up to `pos`, -inf beyond) through
//!   `soft_max_ext`. The masked positions are inert because the cache is zero-initialised
//!   and only ever written with finite values: their scores become -inf, their weights
//!   exactly 0, and 0 times a finite V is 0.
//!
//! The model code uses graft's public graph API only and runs on any
//! [`Backend`].

use std::path::Path;
use std::time::Instant;

use crate::backend::{Backend, BackendExt, ExecId};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::graph::{DType, FlashAttnParams, Graph, Plan, TensorId};
use crate::ops::RopeParams;

use super::config::Config;
use super::gguf_model;
use super::kv_cache::{CacheTypes, KvCache};
use super::loader;
use super::memory;
use super::output::{Logits, Output};
use super::quant_plan::QuantPlan;
use super::sampler::Sampler;
use super::weights::{GateUpLeaves, LayerLeaves, Leaves, QkvLeaves, Weights};

/// Positions per decode KV-length bucket (ggml pads the KV length the same way).
pub const DECODE_BUCKET: usize = 256;

/// Prefill plans kept loaded; the least recently used one is unloaded first.
const MAX_PREFILL_PLANS: usize = 4;

/// Decode plans (one per KV-length bucket) kept loaded; the least recently used one is
/// unloaded first, so a long run holds a bounded number of captured graphs.
pub const MAX_DECODE_PLANS: usize = 8;

/// Bytes of an F32 element (every mul_mat result is F32).
const F32_BYTES: usize = 4;

/// The additive causal mask of `n` queries at positions `n_past..`: `[n_past + n, n]`,
/// query `i` sees keys `0..=n_past + i` (0) and not the later ones (-inf).
fn causal_mask(n_past: usize, n: usize) -> Vec<f32> {
    let n_kv = n_past + n;
    (0..n)
        .flat_map(|i| {
            (0..n_kv).map(move |j| {
                if j <= n_past + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect()
}

/// The context length used when none is given: the model's own, at most 4096.
pub fn default_ctx(cfg: &Config) -> usize {
    cfg.max_position_embeddings.min(4096)
}

/// The KV length a decode step at `pos` attends over: `pos + 1` rounded up to a
/// multiple of [`DECODE_BUCKET`], at most `ctx`.
pub fn decode_bucket(pos: usize, ctx: usize) -> usize {
    ((pos + 1).div_ceil(DECODE_BUCKET) * DECODE_BUCKET).min(ctx)
}

/// One graph of the model with its named inputs and outputs.
pub struct ModelGraph {
    /// The graph.
    pub graph: Graph,
    /// Input: token ids, I32 `[n]`.
    pub tokens: TensorId,
    /// Input: positions, I32 `[n]`.
    pub pos: TensorId,
    /// Input (decode only): the additive attention mask, F32 `[n_kv]`.
    pub kq_mask: Option<TensorId>,
    /// Output: logits, F32 `[vocab, n_out]`.
    pub logits: TensorId,
    /// Output: argmax of the last logits, I32 `[1]`.
    pub argmax: TensorId,
    /// Positions whose logits are computed (1, or `n` for all).
    pub n_out: usize,
}

impl ModelGraph {
    /// Plans the graph (logits and argmax as outputs).
    pub fn plan(&self) -> Result<Plan> {
        self.graph.plan(&[self.logits, self.argmax])
    }
}

/// How attention scores are masked.
#[derive(Clone, Copy)]
enum Mask {
    /// Causal mask for queries at positions `n_past..` (prefill).
    Causal { n_past: usize },
    /// An additive mask input broadcast over queries and heads (decode).
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

/// Builds one graph of a model.
struct Builder<'a> {
    g: Graph,
    cfg: &'a Config,
    ctx: usize,
    rope: RopeParams,
    /// The cache's types; `cache.flash_attn` picks the fused attention op.
    cache: CacheTypes,
}

impl<'a> Builder<'a> {
    fn new(cfg: &'a Config, cache: &KvCache) -> Self {
        Builder {
            g: Graph::new(),
            cfg,
            ctx: cache.ctx,
            rope: cfg.rope(),
            cache: cache.types,
        }
    }

    /// `rms_norm(x) * w`.
    fn norm(&mut self, x: TensorId, w: TensorId) -> Result<TensorId> {
        let cur = self.g.rms_norm(x, self.cfg.rms_norm_eps)?;
        self.g.mul(cur, w)
    }

    /// q, k and v of `n` tokens (one fused mul_mat, or three when their weights differ
    /// in dtype); q and k roped at `pos`.
    fn qkv(&mut self, l: &LayerLeaves, cur: TensorId, pos: TensorId, n: usize) -> Result<Qkv> {
        let c = self.cfg;
        let (hd, n_q, n_kv_dim) = (c.head_dim, c.n_q(), c.n_kv_dim());
        let (n_head, n_kv_head) = (c.num_attention_heads, c.num_key_value_heads);
        let g = &mut self.g;
        let (q, k, v) = match l.qkv {
            QkvLeaves::Fused(w) => {
                // qkv: [n_q + 2 * n_kv_dim, n]
                let qkv = g.mul_mat(w, cur)?;
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
                // q: [n_q, n] -> [hd, n_head, n]; k: [n_kv_dim, n] -> [hd, n_kv_head, n]
                let q = g.mul_mat(q, cur)?;
                let q = g.reshape(q, &[hd, n_head, n])?;
                let k = g.mul_mat(k, cur)?;
                let k = g.reshape(k, &[hd, n_kv_head, n])?;
                // v: [n_kv_dim, n]
                let v = g.mul_mat(v, cur)?;
                (q, k, v)
            }
        };
        let q = g.rope(q, pos, self.rope)?;
        let k = g.rope(k, pos, self.rope)?;
        Ok(Qkv { q, k, v })
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
        let merged = if g.tensor(merged).is_contiguous() {
            merged
        } else {
            g.cont(merged)?
        };
        g.reshape(merged, &[c.n_q(), n])
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

    /// Prefill attention: writes K/V of positions `n_past..n_past + n` with `cpy` into
    /// views of the cache, then attends over all `n_past + n` positions.
    #[allow(clippy::too_many_arguments)] // the block's inputs, spelled out
    fn attention_prefill(
        &mut self,
        l: &LayerLeaves,
        (k_cache, v_cache): (TensorId, TensorId),
        cur: TensorId,
        pos: TensorId,
        n: usize,
        n_past: usize,
        mask: Mask,
    ) -> Result<TensorId> {
        let Qkv { q, k, v } = self.qkv(l, cur, pos, n)?;
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
        // o: [n_embd, n]
        self.g.mul_mat(l.attn_out, merged)
    }

    /// Decode attention for one token at position `pos` (an input): writes K/V with
    /// `set_rows` at row `pos`, attends over `n_kv` positions with the mask input.
    fn attention_decode(
        &mut self,
        l: &LayerLeaves,
        (k_cache, v_cache): (TensorId, TensorId),
        cur: TensorId,
        pos: TensorId,
        mask: TensorId,
        n_kv: usize,
    ) -> Result<TensorId> {
        let Qkv { q, k, v } = self.qkv(l, cur, pos, 1)?;
        let (n_kv_dim, ctx) = (self.cfg.n_kv_dim(), self.ctx);
        let by_position = self.cache.flash_attn;
        let vb = self.cache.v.block_bytes();
        let g = &mut self.g;
        // K: row `pos` of [n_kv_dim, ctx]
        let k_row = g.reshape(k, &[n_kv_dim, 1])?;
        let k_all = g.set_rows(k_cache, k_row, pos)?;
        let v_write = if by_position {
            // V: row `pos` of [n_kv_dim, ctx], like K
            g.set_rows(v_cache, v, pos)?
        } else {
            // V: the transposed cache seen as [1, ctx, n_kv_dim] (row p of matrix c is
            // the element (p, c)), so writing row `pos` of every matrix writes column
            // `pos`; the source is v as [1, 1, n_kv_dim] and the id broadcasts over dim 2
            let v_dst = g.view_3d(v_cache, 1, ctx, n_kv_dim, vb, ctx * vb, 0)?;
            let row = g.tensor(v).nb[1];
            let v_src = g.view_3d(v, 1, 1, n_kv_dim, row, F32_BYTES, 0)?;
            g.set_rows(v_dst, v_src, pos)?
        };
        let v_all = g.after(v_cache, &[v_write])?;
        let merged = self.attend(q, k_all, v_all, n_kv, 1, Mask::Input(mask))?;
        // o: [n_embd, 1]
        self.g.mul_mat(l.attn_out, merged)
    }

    /// SwiGLU: `down(silu(gate(x)) * up(x))`, gate|up in one mul_mat (two when their
    /// weights differ in dtype).
    fn mlp(&mut self, l: &LayerLeaves, cur: TensorId, n: usize) -> Result<TensorId> {
        let n_ff = self.cfg.intermediate_size;
        let g = &mut self.g;
        // gate, up: [n_ff, n]
        let (gate, up) = match l.gate_up {
            GateUpLeaves::Fused(w) => {
                // gu: [2 * n_ff, n]; gate and up are the halves of each column
                let gu = g.mul_mat(w, cur)?;
                let row = g.tensor(gu).nb[1];
                let gate = g.view_2d(gu, n_ff, n, row, 0)?;
                let up = g.view_2d(gu, n_ff, n, row, n_ff * F32_BYTES)?;
                (gate, up)
            }
            GateUpLeaves::Split { gate, up } => (g.mul_mat(gate, cur)?, g.mul_mat(up, cur)?),
        };
        let h = g.silu(gate)?;
        let h = g.mul(h, up)?;
        // down: [n_embd, n]
        g.mul_mat(l.ffn_down, h)
    }

    /// The rest of a block after attention: `x += attn; x += mlp(norm(x))`.
    fn residual_mlp(
        &mut self,
        l: &LayerLeaves,
        x: TensorId,
        attn: TensorId,
        n: usize,
    ) -> Result<TensorId> {
        let x = self.g.add(x, attn)?;
        let cur = self.norm(x, l.ffn_norm)?;
        let m = self.mlp(l, cur, n)?;
        self.g.add(x, m)
    }

    /// Final norm and output projection of the last position (or of all `n`), and the
    /// argmax of the last logits.
    #[allow(clippy::too_many_arguments)] // the graph's full interface, spelled out
    fn finish(
        mut self,
        leaves: &Leaves,
        x: TensorId,
        n: usize,
        all: bool,
        tokens: TensorId,
        pos: TensorId,
        kq_mask: Option<TensorId>,
    ) -> Result<ModelGraph> {
        let (n_embd, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let g = &mut self.g;
        let n_out = if all { n } else { 1 };
        // x: [n_embd, n_out]
        let x = if all || n == 1 {
            x
        } else {
            let nb1 = g.tensor(x).nb[1];
            g.view_2d(x, n_embd, 1, nb1, (n - 1) * nb1)?
        };
        let cur = g.rms_norm(x, self.cfg.rms_norm_eps)?;
        let cur = g.mul(cur, leaves.out_norm)?;
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
        Ok(ModelGraph {
            graph: self.g,
            tokens,
            pos,
            kq_mask,
            logits,
            argmax,
            n_out,
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
    if n == 0 || n_past + n > cache.ctx {
        return Err(Error::model(format!(
            "prefill of {n} tokens after {n_past} does not fit the context of {} tokens",
            cache.ctx
        )));
    }
    let mut b = Builder::new(cfg, cache);
    let leaves = weights.leaves(&mut b.g, cfg)?;
    let tokens = b.g.input("tokens", DType::I32, &[n])?;
    let pos = b.g.input("pos", DType::I32, &[n])?;
    // kq_mask (fused attention): [n_past + n, n], query i sees keys 0..=n_past + i
    let kq_mask = match cache.types.flash_attn {
        true => Some(b.g.input("kq_mask", DType::F32, &[n_past + n, n])?),
        false => None,
    };
    let mask = kq_mask.map_or(Mask::Causal { n_past }, Mask::Input);
    // x: [n_embd, n]
    let mut x = b.g.get_rows(leaves.tok_embd, tokens)?;
    for (i, l) in leaves.layers.iter().enumerate() {
        let kv = cache.leaves(&mut b.g, i)?;
        let cur = b.norm(x, l.attn_norm)?;
        let attn = b.attention_prefill(l, kv, cur, pos, n, n_past, mask)?;
        x = b.residual_mlp(l, x, attn, n)?;
    }
    b.finish(&leaves, x, n, all, tokens, pos, kq_mask)
}

/// The decode graph of one token attending over `n_kv` cache positions (a bucket);
/// the position is an input, so one graph serves every position below `n_kv`.
pub fn build_decode(
    cfg: &Config,
    weights: &Weights,
    cache: &KvCache,
    n_kv: usize,
) -> Result<ModelGraph> {
    if n_kv == 0 || n_kv > cache.ctx {
        return Err(Error::model(format!(
            "decode over {n_kv} positions does not fit the context of {} tokens",
            cache.ctx
        )));
    }
    let mut b = Builder::new(cfg, cache);
    let leaves = weights.leaves(&mut b.g, cfg)?;
    let tokens = b.g.input("tokens", DType::I32, &[1])?;
    let pos = b.g.input("pos", DType::I32, &[1])?;
    // kq_mask: [n_kv, 1], 0 for positions <= pos, -inf beyond
    let mask = b.g.input("kq_mask", DType::F32, &[n_kv, 1])?;
    // x: [n_embd, 1]
    let mut x = b.g.get_rows(leaves.tok_embd, tokens)?;
    for (i, l) in leaves.layers.iter().enumerate() {
        let kv = cache.leaves(&mut b.g, i)?;
        let cur = b.norm(x, l.attn_norm)?;
        let attn = b.attention_decode(l, kv, cur, pos, mask, n_kv)?;
        x = b.residual_mlp(l, x, attn, 1)?;
    }
    b.finish(&leaves, x, 1, false, tokens, pos, Some(mask))
}

/// A model graph loaded into a backend.
#[derive(Clone, Copy, Debug)]
struct Compiled {
    exec: ExecId,
    tokens: TensorId,
    pos: TensorId,
    kq_mask: Option<TensorId>,
    logits: TensorId,
    argmax: TensorId,
    n_out: usize,
}

impl Compiled {
    fn load(be: &mut dyn Backend, mg: &ModelGraph) -> Result<Compiled> {
        let exec = be.load(&mg.plan()?)?;
        Ok(Compiled {
            exec,
            tokens: mg.tokens,
            pos: mg.pos,
            kq_mask: mg.kq_mask,
            logits: mg.logits,
            argmax: mg.argmax,
            n_out: mg.n_out,
        })
    }
}

/// Loaded plans by key, least recently used first, at most `cap` of them: the least
/// recently used one is unloaded to make room, so a long run holds a bounded number of
/// plans (and of captured CUDA graphs).
struct PlanCache<K> {
    cap: usize,
    plans: Vec<(K, Compiled)>,
}

impl<K: PartialEq> PlanCache<K> {
    fn new(cap: usize) -> Self {
        PlanCache {
            cap,
            plans: Vec::new(),
        }
    }

    /// The plan of `key`, and whether it was built now (with `build`) and loaded.
    fn get_or_load(
        &mut self,
        key: K,
        be: &mut dyn Backend,
        build: impl FnOnce() -> Result<ModelGraph>,
    ) -> Result<(Compiled, bool)> {
        if let Some(i) = self.plans.iter().position(|(k, _)| *k == key) {
            let entry = self.plans.remove(i);
            let c = entry.1;
            self.plans.push(entry);
            return Ok((c, false));
        }
        if self.plans.len() == self.cap {
            let (_, old) = self.plans.remove(0);
            be.unload(old.exec)?;
        }
        let c = Compiled::load(be, &build()?)?;
        self.plans.push((key, c));
        Ok((c, true))
    }

    /// Unloads every plan.
    fn release(&mut self, be: &mut dyn Backend) -> Result<()> {
        for (_, c) in self.plans.drain(..) {
            be.unload(c.exec)?;
        }
        Ok(())
    }
}

/// How many plans a model has built (each built plan is loaded once and replayed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanCounts {
    /// Prefill plans (one per `(n, n_past, all logits)` seen).
    pub prefill: usize,
    /// Decode plans (one per KV-length bucket reached).
    pub decode: usize,
}

/// Options of [`Llama::load`].
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Convert the matrices on the host while loading ([`QuantPlan`]: one type, or one
    /// of ggml's K-quant mixes); `None` keeps each tensor's own dtype (norms become F32).
    pub quantize: Option<QuantPlan>,
    /// KV-cache positions ([`default_ctx`] when `None`). A context longer than the
    /// model's `max_position_embeddings` is allowed (the caller may warn): nothing in
    /// graft limits it, but the model was not trained for it.
    pub ctx: Option<usize>,
    /// Whether to show a progress bar on stderr (only drawn on a terminal).
    pub progress: bool,
    /// The KV cache's types and the attention the model runs (fused by default).
    pub cache: CacheTypes,
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// An end-of-sequence token was sampled (not included in the output).
    Eos,
    /// The requested number of tokens was generated.
    Length,
}

/// The result of [`Llama::generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated tokens (without the prompt and without a final EOS).
    pub tokens: Vec<u32>,
    /// Why generation stopped.
    pub stop: Stop,
    /// Prompt tokens processed by the prefill.
    pub prompt_tokens: usize,
    /// Seconds spent in the prefill (including reading back its result).
    pub prompt_secs: f64,
    /// Decode steps run.
    pub decode_steps: usize,
    /// Seconds spent in decode steps.
    pub decode_secs: f64,
}

impl Generation {
    /// Prompt-processing speed.
    pub fn prompt_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_secs
    }

    /// Generation speed (decode steps per second), if any step ran.
    pub fn gen_tokens_per_s(&self) -> Option<f64> {
        (self.decode_steps > 0).then(|| self.decode_steps as f64 / self.decode_secs)
    }
}

/// A Llama model on a backend: weights, KV cache and the loaded plans.
///
/// Every method takes the backend the model was created on; passing another one is an
/// error (its buffers are unknown there) or, for plans, undefined.
pub struct Llama {
    config: Config,
    weights: Weights,
    cache: KvCache,
    n_past: usize,
    /// Loaded prefill plans by `(n, n_past, all logits)`.
    prefill: PlanCache<(usize, usize, bool)>,
    /// Loaded decode plans by KV-length bucket.
    decode: PlanCache<usize>,
    counts: PlanCounts,
    /// Whether [`Llama::generate`] goes on past a full context (see
    /// [`Llama::set_context_shift`]).
    context_shift: bool,
    /// Whether [`Llama::generate`] goes on past end-of-sequence tokens.
    ignore_eos: bool,
}

impl Llama {
    /// A model from its parts (weights uploaded, cache allocated on the same backend).
    pub fn new(config: Config, weights: Weights, cache: KvCache) -> Llama {
        Llama {
            config,
            weights,
            cache,
            n_past: 0,
            prefill: PlanCache::new(MAX_PREFILL_PLANS),
            decode: PlanCache::new(MAX_DECODE_PLANS),
            counts: PlanCounts::default(),
            context_shift: false,
            ignore_eos: false,
        }
    }

    /// With `on`, [`Llama::generate`] treats end-of-sequence tokens as any other and runs
    /// to its length (benchmarks and long runs).
    pub fn set_ignore_eos(&mut self, on: bool) {
        self.ignore_eos = on;
    }

    /// With `on`, [`Llama::generate`] may run past the context: when the cache is full it
    /// keeps the last half of the context's tokens (prompt and generated), prefills them
    /// again from an empty cache and goes on, so a generation of any length runs in the
    /// memory of one context (llama.cpp's context shift, by recomputation). Off (the
    /// default), prompt plus generation must fit the context.
    pub fn set_context_shift(&mut self, on: bool) {
        self.context_shift = on;
    }

    /// Loads a model onto `be`: a Hugging Face folder (config.json and safetensors
    /// weights) or a GGUF file of architecture `llama` (see [`gguf_model`]).
    pub fn load(path: &Path, be: &mut dyn Backend, opts: &LoadOptions) -> Result<Llama> {
        let gguf = gguf_model::is_gguf_path(path);
        if !gguf && !path.is_dir() {
            return Err(Error::model(format!(
                "model {} does not exist or is neither a folder nor a GGUF file",
                path.display()
            )));
        }
        let (config, file) = if gguf {
            let f = GgufFile::open(path)?;
            (gguf_model::config_from_gguf(&f)?, Some(f))
        } else {
            (Config::from_file(&path.join("config.json"))?, None)
        };
        let ctx = opts.ctx.unwrap_or_else(|| default_ctx(&config));
        KvCache::check_ctx(&config, ctx, opts.cache)?;
        let weights = match &file {
            Some(f) => gguf_model::load_gguf_weights(f, &config, be, opts)?,
            None => loader::load_weights(path, &config, be, opts)?,
        };
        opts.cache.check(&config)?;
        memory::check_backend(&config, &weights, ctx, opts.cache, be)?;
        let cache = KvCache::alloc(&config, ctx, opts.cache, be)?;
        Ok(Llama::new(config, weights, cache))
    }

    /// A model with seeded random weights made on the device (benchmarks), in the
    /// dtypes of `plan` (block types are quantized on the device from F32 values).
    pub fn random(
        config: Config,
        plan: QuantPlan,
        ctx: usize,
        cache: CacheTypes,
        seed: u64,
        be: &mut dyn Backend,
    ) -> Result<Llama> {
        let pick = |role, layer| plan.pick(role, layer, &config).dtype;
        let weights = Weights::alloc(&config, &pick, be)?;
        weights.fill_random(&config, be, seed)?;
        cache.check(&config)?;
        memory::check_backend(&config, &weights, ctx, cache, be)?;
        let cache = KvCache::alloc(&config, ctx, cache, be)?;
        Ok(Llama::new(config, weights, cache))
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The weight layout.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The KV cache.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Positions held in the KV cache.
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Plans built so far.
    pub fn plan_counts(&self) -> PlanCounts {
        self.counts
    }

    /// Plans loaded now: (prefill, decode), each bounded ([`MAX_DECODE_PLANS`]).
    pub fn loaded_plans(&self) -> (usize, usize) {
        (self.prefill.plans.len(), self.decode.plans.len())
    }

    /// Forgets the cached positions (the next prefill starts at position 0).
    pub fn reset(&mut self) {
        self.n_past = 0;
    }

    /// Rewinds the cache to its first `n` positions (no effect if it holds fewer).
    pub fn truncate(&mut self, n: usize) {
        self.n_past = self.n_past.min(n);
    }

    /// Releases the plans and buffers of this model on `be`.
    pub fn release(mut self, be: &mut dyn Backend) -> Result<()> {
        self.prefill.release(be)?;
        self.decode.release(be)?;
        be.free_buffer(self.weights.buffer)?;
        be.free_buffer(self.cache.buffer)
    }

    /// Checks token ids on the host before they reach the device.
    fn check_tokens(&self, what: &'static str, tokens: &[u32]) -> Result<()> {
        let vocab = self.config.vocab_size;
        match tokens.iter().position(|&t| t as usize >= vocab) {
            None => Ok(()),
            Some(i) => Err(Error::IndexOutOfRange {
                op: what,
                node: "token ids".into(),
                index: tokens[i] as i64,
                position: i,
                limit: vocab,
            }),
        }
    }

    /// Checks that `n` more positions fit in the cache.
    fn check_room(&self, n: usize) -> Result<()> {
        if self
            .n_past
            .checked_add(n)
            .is_none_or(|t| t > self.cache.ctx)
        {
            return Err(Error::model(format!(
                "context full: {} cached + {n} new tokens exceed the context of {} tokens (--ctx)",
                self.n_past, self.cache.ctx
            )));
        }
        Ok(())
    }

    /// Runs `tokens` through the model at positions `n_past..`, appending them to the
    /// cache. Returns the argmax of the last position and the logits asked for.
    pub fn prefill(
        &mut self,
        be: &mut dyn Backend,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Output> {
        if tokens.is_empty() {
            return Err(Error::model(
                "prefill needs at least one token (empty prompt)",
            ));
        }
        self.check_tokens("prefill", tokens)?;
        self.check_room(tokens.len())?;
        let (n, p) = (tokens.len(), self.n_past);
        let c = self.prefill_plan(be, n, p, logits == Logits::All)?;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let pos: Vec<i32> = (p..p + n).map(|i| i as i32).collect();
        be.set_input_i32(c.exec, c.tokens, &ids)?;
        be.set_input_i32(c.exec, c.pos, &pos)?;
        if let Some(m) = c.kq_mask {
            be.set_input_f32(c.exec, m, &causal_mask(p, n))?;
        }
        be.compute(c.exec)?;
        self.n_past += n;
        self.read(be, &c, logits != Logits::None, "prefill")
    }

    /// Runs one token at position `n_past` with the decode plan of its bucket.
    pub fn decode_step(
        &mut self,
        be: &mut dyn Backend,
        token: u32,
        logits: bool,
    ) -> Result<Output> {
        self.check_tokens("decode", &[token])?;
        self.check_room(1)?;
        let pos = self.n_past;
        let n_kv = decode_bucket(pos, self.cache.ctx);
        let c = self.decode_plan(be, n_kv)?;
        let mask: Vec<f32> = (0..n_kv)
            .map(|i| if i <= pos { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        be.set_input_i32(c.exec, c.tokens, &[token as i32])?;
        be.set_input_i32(c.exec, c.pos, &[pos as i32])?;
        if let Some(m) = c.kq_mask {
            be.set_input_f32(c.exec, m, &mask)?;
        }
        be.compute(c.exec)?;
        self.n_past += 1;
        self.read(be, &c, logits, "decode")
    }

    /// The decode plan of the bucket `n_kv`, built and loaded on first use.
    fn decode_plan(&mut self, be: &mut dyn Backend, n_kv: usize) -> Result<Compiled> {
        let (cfg, w, kv) = (&self.config, &self.weights, &self.cache);
        let (c, built) = self
            .decode
            .get_or_load(n_kv, be, || build_decode(cfg, w, kv, n_kv))?;
        self.counts.decode += usize::from(built);
        Ok(c)
    }

    /// The prefill plan for `(n, n_past, all)`, built and loaded on first use.
    fn prefill_plan(
        &mut self,
        be: &mut dyn Backend,
        n: usize,
        n_past: usize,
        all: bool,
    ) -> Result<Compiled> {
        let (cfg, w, kv) = (&self.config, &self.weights, &self.cache);
        let (c, built) = self.prefill.get_or_load((n, n_past, all), be, || {
            build_prefill(cfg, w, kv, n, n_past, all)
        })?;
        self.counts.prefill += usize::from(built);
        Ok(c)
    }

    /// Reads back the argmax and, if asked, the logits of a run of `step` that ended at
    /// position `n_past - 1`; non-finite logits are an [`Error::NonFinite`] naming the
    /// first such position (the device argmax says so for the last one, which is all
    /// greedy decoding reads).
    fn read(
        &self,
        be: &mut dyn Backend,
        c: &Compiled,
        logits: bool,
        step: &'static str,
    ) -> Result<Output> {
        let last = self.n_past - 1;
        let argmax = be.get_output_i32(c.exec, c.argmax, 1)?[0];
        let logits = if logits {
            let v = be.get_output_f32(c.exec, c.logits, self.config.vocab_size * c.n_out)?;
            let mut rows = v.chunks(self.config.vocab_size.max(1));
            if let Some(row) = rows.position(|r| r.iter().any(|x| !x.is_finite())) {
                let position = last + 1 - c.n_out + row;
                return Err(Error::NonFinite { position, step });
            }
            v
        } else {
            Vec::new()
        };
        let argmax = u32::try_from(argmax).map_err(|_| Error::NonFinite {
            position: last,
            step,
        })?;
        Ok(Output { argmax, logits })
    }

    /// Checks, without running anything, that [`Llama::generate`] can take `prompt` and
    /// `n` new tokens: a non-empty prompt of ids inside the vocabulary, and prompt plus
    /// generation within the context.
    pub fn check_generation(&self, prompt: &[u32], n: usize) -> Result<()> {
        if prompt.is_empty() {
            return Err(Error::model("empty prompt: give at least one token"));
        }
        if self.context_shift && prompt.len() < self.cache.ctx {
            return self.check_tokens("prompt", prompt);
        }
        if prompt
            .len()
            .checked_add(n)
            .is_none_or(|t| t > self.cache.ctx)
        {
            return Err(Error::model(format!(
                "prompt ({} tokens) + generation ({n} tokens, -n) exceeds the context of {} tokens (--ctx)",
                prompt.len(),
                self.cache.ctx
            )));
        }
        self.check_tokens("prompt", prompt)
    }

    /// The context shift of [`Llama::set_context_shift`]: the last half of the context's
    /// tokens of `prompt` + `tokens` (whose last one is about to be decoded) prefilled
    /// again into an empty cache, all but that last one.
    fn shift(&mut self, be: &mut dyn Backend, prompt: &[u32], tokens: &[u32]) -> Result<()> {
        let keep = (self.cache.ctx / 2).max(1);
        let total = prompt.len() + tokens.len();
        let from = total - keep.min(total);
        let kept: Vec<u32> = prompt.iter().chain(tokens).skip(from).copied().collect();
        self.reset();
        if kept.len() > 1 {
            self.prefill(be, &kept[..kept.len() - 1], Logits::None)?;
        }
        Ok(())
    }

    /// Generates up to `n` tokens after `prompt` (from an empty cache), calling
    /// `on_token` with each one as soon as it is known; stops early at an EOS token.
    /// Greedy sampling reads back only the on-device argmax; other samplers read the
    /// last logits.
    pub fn generate(
        &mut self,
        be: &mut dyn Backend,
        prompt: &[u32],
        n: usize,
        sampler: &mut Sampler,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<Generation> {
        self.check_generation(prompt, n)?;
        self.reset();
        let greedy = sampler.is_greedy();
        let mode = if greedy { Logits::None } else { Logits::Last };
        let t0 = Instant::now();
        let out = self.prefill(be, prompt, mode)?;
        let prompt_secs = t0.elapsed().as_secs_f64();
        let mut next = sampler.pick(&out);
        let mut tokens = Vec::new();
        let mut stop = Stop::Length;
        let (mut decode_steps, mut decode_secs) = (0, 0.0);
        while tokens.len() < n {
            if !self.ignore_eos && self.config.is_eos(next) {
                stop = Stop::Eos;
                break;
            }
            tokens.push(next);
            on_token(next)?;
            if tokens.len() == n {
                break;
            }
            let t = Instant::now();
            if self.n_past == self.cache.ctx {
                self.shift(be, prompt, &tokens)?;
            }
            let out = self.decode_step(be, next, !greedy)?;
            decode_secs += t.elapsed().as_secs_f64();
            decode_steps += 1;
            next = sampler.pick(&out);
        }
        Ok(Generation {
            tokens,
            stop,
            prompt_tokens: prompt.len(),
            prompt_secs,
            decode_steps,
            decode_secs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::BufferId;
    use crate::models::presets;
    use crate::models::weights::uniform;

    #[test]
    fn buckets() {
        assert_eq!(decode_bucket(0, 4096), 256);
        assert_eq!(decode_bucket(255, 4096), 256);
        assert_eq!(decode_bucket(256, 4096), 512);
        assert_eq!(decode_bucket(256, 300), 300);
        assert_eq!(decode_bucket(10, 100), 100);
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
            assert_eq!(count("mul_mat"), 6 * l + 1, "{name}: {ops:?}");
            assert_eq!(count("cpy"), 2 * l);
            assert_eq!(count("diag_mask_inf"), l);
            assert_eq!(count("set_rows"), 0);
            let dec = build_decode(&cfg, &w, &kv, 512).unwrap();
            let plan = dec.plan().unwrap();
            let ops: Vec<&str> = plan.steps.iter().map(|s| s.op.name()).collect();
            let count = |op: &str| ops.iter().filter(|o| **o == op).count();
            assert_eq!(count("set_rows"), 2 * l);
            assert_eq!(count("diag_mask_inf"), 0);
            assert_eq!(count("cont"), 0, "n == 1 needs no cont of the merged heads");
            assert_eq!(count("mul_mat"), 6 * l + 1);

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
                assert_eq!(count("mul_mat"), 4 * l + 1);
                assert_eq!(count("soft_max") + count("diag_mask_inf"), 0);
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
        let split = w.layers.iter().filter(|l| !l.qkv_fused()).count();
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
