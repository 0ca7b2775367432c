//! Runs a planned step on the backend: the step's tokens laid out as the batch graph's
//! inputs (padded to a shape bucket), the graph of that shape built and loaded on first
//! use (a capturing backend captures it once and replays it after), the block copies of
//! the prefix cache enqueued before it, and the outputs read back: the argmax of every
//! sequence, and where a sequence samples, the device's top candidates of each row or
//! the whole rows of logits.
//!
//! Shapes come in buckets so that a few graphs serve every step: tokens and sequences in
//! powers of two up to 64, then tokens in multiples of 64; sampling candidates in powers
//! of two from [`MIN_CANDIDATES`]; the table always has the context's blocks per
//! sequence. Padding tokens belong to sequence -1 (zero attention,
//! no key read) and write their K/V into block 0, which no sequence holds; padding
//! sequences have empty tables and take the logits of token 0, which nobody reads.

use crate::backend::{Backend, BackendExt, ExecId, PendingRead};
use crate::error::Result;
use crate::graph::TensorId;
use crate::models::arch::config::Config;
use crate::models::blocks::batch::{build_batch, BatchGraph, BatchShape};
use crate::models::blocks::kv_cache::KvCache;
use crate::models::load::weights::Weights;
use crate::models::runtime::sampling::Row;
use crate::ops::topk::MAX_K;

use super::pool::NULL_BLOCK;
use super::scheduler::{Copy, StepPlan};
use super::sequence::Sequence;

/// Batch graphs kept loaded; the least recently used one is unloaded first.
pub const MAX_BATCH_PLANS: usize = 16;

/// Token counts up to which buckets are powers of two; above, multiples of it.
const POW2_UP_TO: usize = 64;

/// The fewest sampling candidates a graph selects (a smaller need takes this many).
pub const MIN_CANDIDATES: usize = 16;

/// The bucket of `n` tokens or sequences.
pub fn bucket(n: usize) -> usize {
    match n {
        0..=POW2_UP_TO => n.max(1).next_power_of_two(),
        _ => n.next_multiple_of(POW2_UP_TO),
    }
}

/// The candidates a graph selects for a step whose samplers need `k` (0: none) over a
/// vocabulary of `vocab`: the next power of two from [`MIN_CANDIDATES`], at most the
/// vocabulary and [`MAX_K`] (the samplers ask for no more than either).
pub fn candidate_bucket(k: usize, vocab: usize) -> usize {
    match k {
        0 => 0,
        _ => k
            .next_power_of_two()
            .clamp(MIN_CANDIDATES, MAX_K)
            .min(vocab),
    }
}

/// A loaded batch graph: its plan and the ids of its inputs and outputs.
#[derive(Clone, Copy, Debug)]
struct Loaded {
    exec: ExecId,
    tokens: TensorId,
    step: TensorId,
    logits: TensorId,
    argmax: TensorId,
    /// The candidates' ids and values, when the graph selects them.
    top: Option<(TensorId, TensorId)>,
}

impl Loaded {
    fn load(be: &mut dyn Backend, g: &BatchGraph) -> Result<Loaded> {
        Ok(Loaded {
            exec: be.load(&g.plan()?)?,
            tokens: g.tokens,
            step: g.step,
            logits: g.logits,
            argmax: g.argmax,
            top: g.top,
        })
    }
}

/// The inputs of one step, padded to its shape.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct StepInputs {
    pub(crate) tokens: Vec<i32>,
    pub(crate) pos: Vec<i32>,
    pub(crate) slots: Vec<i32>,
    /// `[2, n_tokens]`.
    pub(crate) seqs: Vec<i32>,
    /// `[max_blocks, n_seqs]`.
    pub(crate) table: Vec<i32>,
    pub(crate) out_rows: Vec<i32>,
    /// The running sequence of each column (not an input: where the table rows come
    /// from).
    pub(crate) cols: Vec<usize>,
}

impl StepInputs {
    /// The batch graph's `step` input of `shape` (see [`BatchShape::layout`]): the
    /// inputs but the tokens, padded as they are.
    pub(crate) fn pack(&self, shape: BatchShape) -> Vec<i32> {
        let at = shape.layout();
        let mut v = vec![0; at.len];
        let mut put = |off: usize, part: &[i32]| v[off..off + part.len()].copy_from_slice(part);
        put(at.pos, &self.pos);
        put(at.slots, &self.slots);
        put(at.seqs, &self.seqs);
        put(at.table, &self.table);
        if let Some(off) = at.out_rows {
            put(off, &self.out_rows);
        }
        v
    }
}

/// The token ids of a step: from the host (padded to the shape), or the argmax of a step
/// still on the device, forwarded there.
pub(crate) enum Tokens<'a> {
    Host(&'a [i32]),
    Forwarded(&'a Enqueued),
}

/// A step enqueued on the backend, its argmax (and its candidates) being read.
pub(crate) struct Enqueued {
    c: Loaded,
    shape: BatchShape,
    /// Its real (unpadded) sequences.
    n_seqs: usize,
    read: PendingRead,
    /// The reads of the candidates' ids and values.
    top: Option<(PendingRead, PendingRead)>,
}

/// The sampling candidates of a step: the `k` largest logits of each sequence's row
/// with their ids, largest first (ties: lower id first).
pub(crate) struct Candidates {
    k: usize,
    ids: Vec<u32>,
    logits: Vec<f32>,
}

impl Candidates {
    /// The candidates of the sequence in column `col`.
    pub(crate) fn row(&self, col: usize) -> Row<'_> {
        let at = col * self.k..(col + 1) * self.k;
        Row::Top {
            ids: &self.ids[at.clone()],
            logits: &self.logits[at],
        }
    }
}

/// What a step gives back for its real (unpadded) sequences, in plan order.
pub(crate) struct StepOutputs {
    /// The argmax of each sequence's logits (-1: not finite).
    pub(crate) argmax: Vec<i32>,
    /// All logits `[vocab, n_seqs]` (the padded count), when asked for.
    pub(crate) logits: Option<Vec<f32>>,
    /// The candidates, when the step's graph selected them.
    pub(crate) top: Option<Candidates>,
}

/// The model side of the engine: weights, pool and loaded batch graphs.
pub(crate) struct Runner {
    /// One device's share of the model (the whole model on one device).
    pub(crate) shard: Config,
    pub(crate) weights: Weights,
    pub(crate) pool: KvCache,
    pub(crate) block_size: usize,
    /// Table rows per sequence: the context's blocks.
    pub(crate) max_blocks: usize,
    /// Loaded plans, least recently used first.
    plans: Vec<(BatchShape, Loaded)>,
    /// Plans built so far.
    pub(crate) built: usize,
}

impl Runner {
    pub(crate) fn new(
        shard: Config,
        weights: Weights,
        pool: KvCache,
        block_size: usize,
        ctx: usize,
    ) -> Runner {
        Runner {
            shard,
            weights,
            pool,
            block_size,
            max_blocks: ctx.div_ceil(block_size),
            plans: Vec::new(),
            built: 0,
        }
    }

    /// The shape a plan with `n_tokens` tokens of `n_seqs` sequences runs in, whose
    /// samplers need `k` candidates (0: none). As many tokens as sequences is a decode
    /// step: each sequence has at least one token, so each has exactly one.
    pub(crate) fn shape(&self, n_tokens: usize, n_seqs: usize, k: usize) -> BatchShape {
        BatchShape {
            n_tokens: bucket(n_tokens),
            n_seqs: bucket(n_seqs),
            max_blocks: self.max_blocks,
            candidates: candidate_bucket(k, self.shard.vocab_size),
            decode: n_tokens == n_seqs,
        }
    }

    /// Lays out the inputs of `plan` over `running` in `shape`.
    pub(crate) fn inputs(
        &self,
        plan: &StepPlan,
        running: &[Sequence],
        shape: BatchShape,
    ) -> StepInputs {
        let bs = self.block_size;
        let mut x = StepInputs::default();
        for (col, sl) in plan.slices.iter().enumerate() {
            let s = &running[sl.seq];
            for p in s.computed..s.computed + sl.n {
                x.tokens.push(s.tokens[p] as i32);
                x.pos.push(p as i32);
                x.slots.push(s.slot(p, bs) as i32);
                x.seqs.extend([col as i32, p as i32]);
            }
            x.out_rows.push(x.tokens.len() as i32 - 1);
            x.cols.push(sl.seq);
        }
        self.pad(&mut x, running, shape);
        x
    }

    /// Pads the inputs to `shape` (tokens only when the host gives them) and fills the
    /// block table of each column's sequence (`x.cols`, indices into `running`).
    pub(crate) fn pad(&self, x: &mut StepInputs, running: &[Sequence], shape: BatchShape) {
        let pad = shape.n_tokens - x.pos.len();
        if !x.tokens.is_empty() {
            x.tokens.resize(shape.n_tokens, 0);
        }
        x.pos.extend(std::iter::repeat_n(0, pad));
        x.slots.extend(std::iter::repeat_n(NULL_BLOCK as i32, pad));
        x.seqs.extend(std::iter::repeat_n([-1, 0], pad).flatten());
        x.out_rows.resize(shape.n_seqs, 0);
        x.table = vec![NULL_BLOCK as i32; shape.max_blocks * shape.n_seqs];
        for (col, s) in x.cols.iter().map(|&i| &running[i]).enumerate() {
            let row = &mut x.table[col * shape.max_blocks..][..shape.max_blocks];
            for (dst, &b) in row.iter_mut().zip(&s.blocks) {
                *dst = b as i32;
            }
        }
    }

    /// Enqueues the prefix cache's block copies (every layer's K and V rows).
    pub(crate) fn copy_blocks(&self, be: &mut dyn Backend, copies: &[Copy]) -> Result<()> {
        let bs = self.block_size;
        for c in copies {
            let src = self.pool.row_ranges(c.src as usize * bs, c.rows);
            let dst = self.pool.row_ranges(c.dst as usize * bs, c.rows);
            for ((s, len), (d, _)) in src.into_iter().zip(dst) {
                be.copy_within(self.pool.buffer, s, d, len)?;
            }
        }
        Ok(())
    }

    /// Enqueues one step of `shape` with inputs `x`, its tokens forwarded on the device
    /// from the argmax of the step `from` (of the same decode shape) when given, and
    /// starts reading the argmax and the candidates.
    pub(crate) fn enqueue(
        &mut self,
        be: &mut dyn Backend,
        shape: BatchShape,
        x: &StepInputs,
        from: Option<&Enqueued>,
    ) -> Result<Enqueued> {
        self.stage(be, shape, x)?;
        let tokens = match from {
            Some(prev) => Tokens::Forwarded(prev),
            None => Tokens::Host(&x.tokens),
        };
        self.launch(be, shape, tokens, x.cols.len())
    }

    /// Writes the inputs of a step of `shape` from `x` but its tokens, after the runs
    /// enqueued so far (a step still on the device reads its own first).
    pub(crate) fn stage(
        &mut self,
        be: &mut dyn Backend,
        shape: BatchShape,
        x: &StepInputs,
    ) -> Result<()> {
        let c = self.plan(be, shape)?;
        be.set_input_i32(c.exec, c.step, &x.pack(shape))
    }

    /// Runs the step of `shape` whose other inputs are staged, with `tokens`, for
    /// `n_seqs` real sequences, and starts reading the argmax and the candidates.
    pub(crate) fn launch(
        &mut self,
        be: &mut dyn Backend,
        shape: BatchShape,
        tokens: Tokens<'_>,
        n_seqs: usize,
    ) -> Result<Enqueued> {
        let c = self.plan(be, shape)?;
        match tokens {
            Tokens::Forwarded(prev) => {
                debug_assert_eq!(shape.n_tokens, shape.n_seqs, "a forwarded step decodes");
                be.forward_output(
                    prev.c.exec,
                    prev.c.argmax,
                    c.exec,
                    c.tokens,
                    4 * shape.n_seqs,
                )?;
            }
            Tokens::Host(ids) => be.set_input_i32(c.exec, c.tokens, ids)?,
        }
        be.compute(c.exec)?;
        // begun together, finished together: one wait for all three (reads take whole
        // outputs, the padding's columns too)
        let read = be.begin_read(c.exec, c.argmax, 4 * shape.n_seqs)?;
        let bytes = 4 * shape.candidates * shape.n_seqs;
        let top = match c.top {
            Some((ids, vals)) => Some((
                be.begin_read(c.exec, ids, bytes)?,
                be.begin_read(c.exec, vals, bytes)?,
            )),
            None => None,
        };
        Ok(Enqueued {
            c,
            shape,
            n_seqs,
            read,
            top,
        })
    }

    /// Finishes a step: the argmax of its real sequences, the candidates, and the rows of
    /// logits when `logits`.
    pub(crate) fn finish(
        &self,
        be: &mut dyn Backend,
        step: Enqueued,
        logits: bool,
    ) -> Result<StepOutputs> {
        let argmax = words(&be.finish_read(step.read)?)
            .take(step.n_seqs)
            .map(|w| w as i32)
            .collect();
        let top = match step.top {
            Some((ids, vals)) => Some(Candidates {
                k: step.shape.candidates,
                ids: words(&be.finish_read(ids)?).collect(),
                logits: words(&be.finish_read(vals)?).map(f32::from_bits).collect(),
            }),
            None => None,
        };
        let logits = match logits {
            true => Some(be.get_output_f32(
                step.c.exec,
                step.c.logits,
                self.shard.vocab_size * step.shape.n_seqs,
            )?),
            false => None,
        };
        Ok(StepOutputs {
            argmax,
            logits,
            top,
        })
    }

    /// The loaded plan of `shape`, built and loaded on first use.
    fn plan(&mut self, be: &mut dyn Backend, shape: BatchShape) -> Result<Loaded> {
        if let Some(i) = self.plans.iter().position(|(s, _)| *s == shape) {
            let entry = self.plans.remove(i);
            let c = entry.1;
            self.plans.push(entry);
            return Ok(c);
        }
        if self.plans.len() == MAX_BATCH_PLANS {
            let (_, old) = self.plans.remove(0);
            be.unload(old.exec)?;
        }
        let g = build_batch(
            &self.shard,
            &self.weights,
            &self.pool,
            self.block_size,
            shape,
        )?;
        let c = Loaded::load(be, &g)?;
        self.built += 1;
        self.plans.push((shape, c));
        Ok(c)
    }

    /// Plans loaded now.
    pub(crate) fn loaded(&self) -> usize {
        self.plans.len()
    }

    /// Unloads every plan and frees the weights and the pool.
    pub(crate) fn release(&mut self, be: &mut dyn Backend) -> Result<()> {
        for (_, c) in self.plans.drain(..) {
            be.unload(c.exec)?;
        }
        be.free_buffer(self.weights.buffer)?;
        be.free_buffer(self.pool.buffer)
    }
}

/// The little-endian 32-bit words of `bytes` (a read of I32 or F32 values).
fn words(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_then_multiples_of_64() {
        let got: Vec<usize> = [0, 1, 2, 3, 5, 33, 64, 65, 128, 129, 512, 575]
            .iter()
            .map(|&n| bucket(n))
            .collect();
        assert_eq!(got, vec![1, 1, 2, 4, 8, 64, 64, 128, 128, 192, 512, 576]);
    }

    #[test]
    fn candidate_buckets_are_powers_of_two_within_the_vocabulary() {
        let got: Vec<usize> = [(0, 512), (1, 512), (16, 512), (17, 512), (104, 512)]
            .into_iter()
            .chain([(300, 512), (1000, 151_936), (1024, 4096), (5, 8)])
            .map(|(k, vocab)| candidate_bucket(k, vocab))
            .collect();
        assert_eq!(got, vec![0, 16, 16, 32, 128, 512, 1024, 1024, 8]);
    }
}
