//! Which tokens the next step computes: continuous batching with a token budget per step,
//! first come first served, chunked prefill and preemption.
//!
//! Each step takes, in arrival order, the running sequences first (a decoding sequence
//! needs one token, a sequence still in its prompt a chunk of it), then admits waiting
//! requests while the budget, the sequence cap and the pool allow. A chunk is at most
//! what is left of the budget, so a long prompt is processed over several steps, mixed
//! with the running sequences' decode tokens, and never stalls them.
//!
//! An admitted request first takes the longest prefix of its tokens the prefix cache
//! holds (full blocks by reference, a partly filled block copied into one of its own).
//! When a running sequence needs a block and none is left, the youngest running
//! sequence not yet scheduled in this step (or, if none is, the sequence itself) is
//! preempted: its blocks are let go (their tokens stay keyed in the cache) and it waits
//! to be computed again from its tokens, generated ones included.

use std::collections::BTreeMap;

use super::pool::{BlockId, BlockPool};
use super::request::EngineStats;
use super::sequence::Sequence;

/// How the scheduler fills a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences computed in one step (`--parallel`).
    pub max_seqs: usize,
    /// Most tokens computed in one step (`--ubatch`): decode tokens plus prompt chunks.
    pub step_tokens: usize,
    /// Take cached prefixes (the prefix cache).
    pub prefix_cache: bool,
    /// While any prompt is unfinished, run no decode tokens (what llama-batched-bench
    /// measures: all prompts, then all generations). Off: decode tokens go first.
    pub prefill_first: bool,
}

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slice {
    /// Index into the running sequences.
    pub(crate) seq: usize,
    /// Its tokens `computed..computed + n` run in the step.
    pub(crate) n: usize,
}

/// A block copy to run before the step: `rows` positions of block `src` into `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Copy {
    pub(crate) src: BlockId,
    pub(crate) dst: BlockId,
    pub(crate) rows: usize,
}

/// What the next step runs.
#[derive(Debug, Default)]
pub(crate) struct StepPlan {
    pub(crate) slices: Vec<Slice>,
    pub(crate) copies: Vec<Copy>,
}

/// The sequences and the pool's blocks.
pub(crate) struct Scheduler {
    pub(crate) cfg: SchedulerConfig,
    pub(crate) pool: BlockPool,
    /// Being computed, oldest first.
    pub(crate) running: Vec<Sequence>,
    /// Waiting for room, by arrival order (preempted sequences keep theirs).
    pub(crate) waiting: BTreeMap<u64, Sequence>,
    pub(crate) stats: EngineStats,
}

impl Scheduler {
    pub(crate) fn new(cfg: SchedulerConfig, pool: BlockPool) -> Scheduler {
        Scheduler {
            cfg,
            pool,
            running: Vec::new(),
            waiting: BTreeMap::new(),
            stats: EngineStats::default(),
        }
    }

    /// Whether any sequence is running or waiting.
    pub(crate) fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Plans the next step (see the module docs).
    pub(crate) fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.step_tokens;
        let prefilling = self.cfg.prefill_first
            && (!self.waiting.is_empty() || self.running.iter().any(|s| s.computed < s.prompt_len));
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            if prefilling && s.computed >= s.prompt_len {
                i += 1;
                continue;
            }
            let n = s.pending().min(budget);
            if !self.make_room(i, s.computed + n) {
                // sequence i itself was preempted: the next one moved into its place
                continue;
            }
            plan.slices.push(Slice { seq: i, n });
            budget -= n;
            i += 1;
        }
        while budget > 0 && self.running.len() < self.cfg.max_seqs {
            let Some(mut s) = self.waiting.pop_first().map(|(_, s)| s) else {
                break;
            };
            let copy = self.take_prefix(&mut s);
            let n = s.pending().min(budget);
            let need = s.blocks_for(s.computed + n, self.pool.block_size());
            if self.pool.available() < need {
                // nothing was computed into the blocks taken: let go of them unkeyed
                s.abandon_blocks(&mut self.pool);
                self.waiting.insert(s.order, s);
                break;
            }
            grow(&mut self.pool, &mut s, need);
            if s.cached_tokens.is_none() {
                let hit = s.computed.min(s.prompt_len);
                s.cached_tokens = Some(hit);
                self.stats.prefix_lookup_tokens += s.prompt_len as u64;
                self.stats.prefix_hit_tokens += hit as u64;
            }
            plan.copies.extend(copy);
            plan.slices.push(Slice {
                seq: self.running.len(),
                n,
            });
            budget -= n;
            self.running.push(s);
        }
        plan
    }

    /// Gives running sequence `i` the blocks for its first `positions` positions,
    /// preempting younger unscheduled sequences (or `i` itself) while blocks are short.
    /// False when `i` was preempted.
    fn make_room(&mut self, i: usize, positions: usize) -> bool {
        let bs = self.pool.block_size();
        loop {
            let need = self.running[i].blocks_for(positions, bs);
            if self.pool.available() >= need {
                grow(&mut self.pool, &mut self.running[i], need);
                return true;
            }
            let victim = if self.running.len() > i + 1 {
                self.running.len() - 1
            } else {
                i
            };
            let mut s = self.running.remove(victim);
            s.free_blocks(&mut self.pool);
            self.stats.preemptions += 1;
            self.waiting.insert(s.order, s);
            if victim == i {
                return false;
            }
        }
    }

    /// For a sequence with nothing computed: takes the longest cached prefix of its
    /// tokens (never its last token, whose logits are needed), full blocks by reference;
    /// a partly filled cached block is copied into a fresh block (the returned copy).
    fn take_prefix(&mut self, s: &mut Sequence) -> Option<Copy> {
        if s.computed > 0 || !s.blocks.is_empty() || !self.cfg.prefix_cache {
            return None;
        }
        let bs = self.pool.block_size();
        let found = self.pool.lookup(&s.tokens, s.tokens.len() - 1);
        for &(id, hash) in &found.full {
            self.pool.acquire(id);
            s.blocks.push(id);
            s.keyed.push(hash);
        }
        s.computed = found.full.len() * bs;
        let (src, rows) = found.partial?;
        // held while the copy's block is taken, so that it is not the one evicted; the
        // copy runs before the step, so it may be handed out again after it
        self.pool.acquire(src);
        let dst = self.pool.allocate();
        self.pool.release(src);
        let dst = dst?;
        s.blocks.push(dst);
        s.computed += rows;
        Some(Copy { src, dst, rows })
    }

    /// Removes the sequence of `id` wherever it is, its blocks let go.
    pub(crate) fn remove(&mut self, id: super::RequestId) -> Option<Sequence> {
        let mut s = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else {
            let order = self.waiting.iter().find(|(_, s)| s.id == id)?.0;
            let order = *order;
            self.waiting.remove(&order)?
        };
        s.free_blocks(&mut self.pool);
        Some(s)
    }

    /// The counters, with the current queue and pool sizes.
    pub(crate) fn stats(&self) -> EngineStats {
        let p = self.pool.stats();
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            blocks_used: p.used,
            blocks_free: p.total - p.used,
            blocks_cached: p.cached,
            ..self.stats
        }
    }
}

/// Appends `n` fresh blocks to `s` (the caller checked they are available).
fn grow(pool: &mut BlockPool, s: &mut Sequence, n: usize) {
    for _ in 0..n {
        let id = pool.allocate().expect("blocks checked available");
        s.blocks.push(id);
    }
}
