//! The batch graph: one forward pass over the tokens of many sequences at once, the
//! graph the engine runs every step. Its tokens are any mix of decode tokens (one per
//! sequence) and prefill chunks (a run of a sequence's prompt), each with its own
//! position; K/V live in a pool of blocks ([`KvCache::pool`]) that each sequence reaches
//! through its row of a block table.
//!
//! Shapes are fixed per graph (`n_tokens`, `n_seqs`, `max_blocks`), everything else comes
//! in as data, so a backend that captures a plan captures it once per shape and replays it
//! with new tokens, positions and tables. Two inputs: `tokens` (I32 `[n_tokens]`, the
//! token ids, which a decode step may take on the device from the step before) and
//! `step`, every other per-step number in one I32 vector (one upload a step), which the
//! graph reads through views at the offsets of [`StepLayout`]:
//!
//! | part | shape | what |
//! | --- | --- | --- |
//! | `pos` | `[n_tokens]` | each token's position in its sequence (rope, learned positions) |
//! | `slots` | `[n_tokens]` | the pool row each token's K and V are written to |
//! | `seqs` | `[2, n_tokens]` | each token's sequence (a column of `table`; -1: padding) and position |
//! | `table` | `[max_blocks, n_seqs]` | each sequence's physical blocks |
//! | `out_rows` | `[n_seqs]` | the token whose logits each sequence gets (its last); absent in a decode graph |
//!
//! Per layer: q, k, v of every token; K and V written into the pool with `set_rows` at
//! `slots`; [`paged_attn`](crate::graph::Graph::paged_attn) over each token's visible
//! positions; the MLP. Then the hidden states of the `out_rows` tokens are gathered
//! (`get_rows`; a decode graph, [`BatchShape::decode`], whose token `i` is sequence `i`'s
//! only one, takes them as they are) and only those `n_seqs` rows go through the final
//! norm and the output head: logits `[vocab, n_seqs]` and their argmax `[n_seqs]`. A graph built with
//! `candidates` (the engine's graph of a step where a sequence samples) also selects
//! each row's sampling candidates on the device ([`sample_outputs`]): the ids and
//! values of its `candidates` largest logits, `[candidates, n_seqs]` each, so that the
//! host reads `8 * candidates` bytes a sequence instead of the vocabulary.

use crate::error::{Error, Result};
use crate::graph::{DType, PagedAttnParams, Plan, TensorId};
use crate::models::arch::config::Config;
use crate::models::load::weights::{LayerLeaves, Weights};

use super::kv_cache::KvCache;
use super::{sample_outputs, Builder, Qkv};

/// The batch graph with its named inputs and outputs.
pub struct BatchGraph {
    /// The graph.
    pub graph: crate::graph::Graph,
    /// Inputs (see the module docs): the token ids and the step's other numbers.
    pub tokens: TensorId,
    pub step: TensorId,
    /// Output: logits, F32 `[vocab, n_seqs]`.
    pub logits: TensorId,
    /// Output: the argmax of each column of the logits, I32 `[n_seqs]` (-1 for a column
    /// that is not finite).
    pub argmax: TensorId,
    /// Output (with [`BatchShape::candidates`]): the ids of the largest logits of each
    /// column, largest first (ties: lower id first), I32 `[candidates, n_seqs]`, and
    /// their values, F32 `[candidates, n_seqs]`.
    pub top: Option<(TensorId, TensorId)>,
    /// The shape the graph was built for.
    pub shape: BatchShape,
}

impl BatchGraph {
    /// Plans the graph (logits, argmax and the candidates as outputs).
    pub fn plan(&self) -> Result<Plan> {
        let mut outputs = vec![self.logits, self.argmax];
        outputs.extend(self.top.iter().flat_map(|&(ids, vals)| [ids, vals]));
        self.graph.plan(&outputs)
    }
}

/// The fixed sizes of a batch graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BatchShape {
    /// Tokens of the step (padding included).
    pub n_tokens: usize,
    /// Sequences of the step (padding included): columns of the table, rows of logits.
    pub n_seqs: usize,
    /// Logical blocks per sequence: rows of the table.
    pub max_blocks: usize,
    /// Sampling candidates selected per sequence (`top_k` of its logits; 0: none).
    pub candidates: usize,
    /// Every sequence has one token, token `i` sequence `i`'s (`n_tokens == n_seqs`):
    /// the logits are the tokens' own, with no `out_rows` gather.
    pub decode: bool,
}

impl BatchShape {
    /// Where the parts of the `step` input lie.
    pub fn layout(&self) -> StepLayout {
        // each part starts on a 16-byte boundary
        let part = |n: usize| n.next_multiple_of(4);
        let n = self.n_tokens;
        let slots = part(n);
        let seqs = slots + part(n);
        let table = seqs + part(2 * n);
        let end = table + part(self.max_blocks * self.n_seqs);
        let (out_rows, len) = match self.decode {
            true => (None, end),
            false => (Some(end), end + part(self.n_seqs)),
        };
        StepLayout {
            pos: 0,
            slots,
            seqs,
            table,
            out_rows,
            len,
        }
    }
}

/// The offsets (in I32 elements) of the parts of a batch graph's `step` input, and its
/// length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLayout {
    /// `pos`, `[n_tokens]`.
    pub pos: usize,
    /// `slots`, `[n_tokens]`.
    pub slots: usize,
    /// `seqs`, `[2, n_tokens]`.
    pub seqs: usize,
    /// `table`, `[max_blocks, n_seqs]`.
    pub table: usize,
    /// `out_rows`, `[n_seqs]`; `None` in a decode graph.
    pub out_rows: Option<usize>,
    /// Elements of the input.
    pub len: usize,
}

/// The batch graph of `shape` over the pool `pool` (blocks of `block_size` positions).
pub fn build_batch(
    cfg: &Config,
    weights: &Weights,
    pool: &KvCache,
    block_size: usize,
    shape: BatchShape,
) -> Result<BatchGraph> {
    let BatchShape {
        n_tokens: n,
        n_seqs,
        max_blocks,
        candidates,
        decode,
    } = shape;
    if n == 0 || n_seqs == 0 || max_blocks == 0 || (decode && n != n_seqs) {
        return Err(Error::model(format!(
            "internal: a batch graph needs tokens, sequences and blocks: {shape:?}"
        )));
    }
    if !pool.types.flash_attn {
        return Err(Error::model(
            "the batch graph reads V by position: its pool needs the fused attention",
        ));
    }
    let mut b = Builder::new(cfg, pool, n, false);
    let leaves = weights.leaves(&mut b.g, cfg)?;
    let g = &mut b.g;
    let tokens = g.input("tokens", DType::I32, &[n])?;
    let at = shape.layout();
    let step = g.input("step", DType::I32, &[at.len])?;
    let pos = g.view_1d(step, n, 4 * at.pos)?;
    let slots = g.view_1d(step, n, 4 * at.slots)?;
    let seqs = g.view_2d(step, 2, n, 8, 4 * at.seqs)?;
    let table = g.view_2d(step, max_blocks, n_seqs, 4 * max_blocks, 4 * at.table)?;
    let p = PagedAttnParams {
        scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        softcap: 0.0,
        block_size,
        window: cfg.sliding_window.unwrap_or(0),
    };
    let paged = Paged {
        slots,
        seqs,
        table,
        p,
    };
    // x: [n_embd, n]
    let mut x = b.embed(&leaves, tokens, pos)?;
    for (i, l) in leaves.layers.iter().enumerate() {
        let kv = pool.leaves(&mut b.g, i)?;
        let cur = b.attn_norm(i, l, x)?;
        let attn = b.attention_paged(i, l, kv, cur, pos, &paged)?;
        x = b.residual_mlp(i, l, x, attn)?;
    }
    let g = &mut b.g;
    // last: [n_embd, n_seqs], the hidden state of each sequence's output token
    let last = match at.out_rows {
        Some(off) => {
            let out_rows = g.view_1d(step, n_seqs, 4 * off)?;
            g.get_rows(x, out_rows)?
        }
        None => x,
    };
    let cur = b.norm(last, leaves.out_norm)?;
    let g = &mut b.g;
    // logits: [vocab, n_seqs]
    let logits = g.mul_mat(leaves.output, cur)?;
    let logits = g.set_name(logits, "logits")?;
    let argmax = g.argmax(logits)?;
    let argmax = g.set_name(argmax, "argmax")?;
    // ids, vals: [candidates, n_seqs]
    let top = match candidates {
        0 => None,
        k => Some(sample_outputs(g, logits, k)?),
    };
    Ok(BatchGraph {
        graph: b.g,
        tokens,
        step,
        logits,
        argmax,
        top,
        shape,
    })
}

/// The paged-attention inputs every layer shares.
struct Paged {
    slots: TensorId,
    seqs: TensorId,
    table: TensorId,
    p: PagedAttnParams,
}

impl Builder<'_> {
    /// Attention of a batch: K/V of every token written into the pool at its slot, then
    /// paged attention over each token's visible positions; heads merged `[n_q, n]`.
    fn attention_paged(
        &mut self,
        i: usize,
        l: &LayerLeaves,
        kv: (TensorId, TensorId),
        cur: TensorId,
        pos: TensorId,
        paged: &Paged,
    ) -> Result<TensorId> {
        let n = self.n;
        let Qkv { q, k, v } = self.qkv(i, l, cur, pos, n)?;
        // k_all, v_all: the pools [n_kv_dim, n_slots], read after this step's writes
        let (k_all, v_all) = self.write_rows(kv, k, v, paged.slots)?;
        let n_slots = self.ctx;
        let k_pool = self.kv_view(k_all, self.cache.k, n_slots)?;
        let v_pool = self.kv_view(v_all, self.cache.v, n_slots)?;
        let g = &mut self.g;
        // o: [hd, n_head, n] -> [n_q, n]
        let o = g.paged_attn(q, (k_pool, v_pool), paged.table, paged.seqs, paged.p)?;
        let merged = g.reshape(o, &[self.cfg.n_q(), n])?;
        self.attn_output(i, l, merged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n_tokens: usize, n_seqs: usize, max_blocks: usize, decode: bool) -> BatchShape {
        BatchShape {
            n_tokens,
            n_seqs,
            max_blocks,
            candidates: 0,
            decode,
        }
    }

    /// The parts of the step input start on 16-byte boundaries, follow each other
    /// without overlap and fit in its length; a decode graph has no output rows.
    #[test]
    fn step_parts_are_aligned_and_disjoint() {
        for (n, s, mb, decode) in [(1, 1, 256, true), (3, 2, 5, false), (64, 64, 1, true)]
            .into_iter()
            .chain([(128, 8, 17, false), (1, 1, 1, false)])
        {
            let at = shape(n, s, mb, decode).layout();
            let mut parts = vec![(at.pos, n), (at.slots, n), (at.seqs, 2 * n)];
            parts.push((at.table, mb * s));
            parts.extend(at.out_rows.map(|o| (o, s)));
            assert_eq!(at.out_rows.is_none(), decode);
            for w in parts.windows(2) {
                assert!(w[0].0 + w[0].1 <= w[1].0, "{parts:?}");
            }
            assert!(parts.iter().all(|&(off, _)| off % 4 == 0), "{parts:?}");
            let (last, len) = parts[parts.len() - 1];
            assert!(last + len <= at.len && at.len < last + len + 4);
        }
    }

    /// A decode shape is one token a sequence: other counts are refused.
    #[test]
    fn a_decode_shape_has_a_token_a_sequence() {
        let cfg = crate::models::arch::presets::preset("tiny").unwrap();
        let w = Weights::layout(
            &cfg,
            &crate::models::load::weights::uniform(DType::F32),
            crate::graph::BufferId(1),
        );
        let types = crate::models::load::options::CacheTypes::default();
        let pool = KvCache::pool(&cfg, 64, types, crate::graph::BufferId(2));
        assert!(build_batch(&cfg, &w, &pool, 16, shape(4, 2, 4, true)).is_err());
        let g = build_batch(&cfg, &w, &pool, 16, shape(4, 4, 4, true)).unwrap();
        let plan = g.plan().unwrap();
        let gathers = plan
            .steps
            .iter()
            .filter(|s| s.op == crate::graph::Op::GetRows);
        // the embedding's alone
        assert_eq!(gathers.count(), 1);
    }
}
