//! One request inside the engine: its tokens (prompt, then what was generated), how many
//! of them have K/V in the pool, the blocks holding them, its sampler and its stop state.

use crate::models::runtime::sampling::SamplerChain;

use super::pool::{BlockId, BlockPool, NULL_BLOCK};
use super::request::{RequestId, Stop, Usage};
use super::text::TextState;

/// A request's sequence.
pub(crate) struct Sequence {
    pub(crate) id: RequestId,
    /// Arrival order: first come, first served; the youngest is preempted first.
    pub(crate) order: u64,
    /// Prompt, then the generated tokens (the last one not computed yet while decoding).
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    /// Tokens whose K/V are in the pool (the first `computed` of `tokens`).
    pub(crate) computed: usize,
    /// The physical block of each logical block (`NULL_BLOCK` where a sliding window
    /// dropped one).
    pub(crate) blocks: Vec<BlockId>,
    /// The key hashes of the leading full blocks keyed so far (each the parent of the
    /// next).
    pub(crate) keyed: Vec<u64>,
    pub(crate) sampler: SamplerChain,
    /// Generation ends at this many generated tokens.
    pub(crate) max_tokens: usize,
    pub(crate) stop: Stop,
    pub(crate) logprobs: Option<usize>,
    pub(crate) text: TextState,
    /// Prompt tokens taken from the prefix cache at the first admission.
    pub(crate) cached_tokens: Option<usize>,
    /// Tokens dropped from the front by context shifts.
    pub(crate) dropped: usize,
}

impl Sequence {
    /// Generated tokens so far.
    pub(crate) fn generated(&self) -> usize {
        self.tokens.len() + self.dropped - self.prompt_len
    }

    /// A context shift: keeps the last `keep` tokens (the newest, not yet computed, among
    /// them) and lets go of every block, so that they are computed again from position 0.
    pub(crate) fn shift(&mut self, keep: usize, pool: &mut BlockPool) {
        self.free_blocks(pool);
        let drop = self.tokens.len().saturating_sub(keep.max(1));
        self.tokens.drain(..drop);
        self.dropped += drop;
        self.text.shift(drop);
    }

    /// Tokens still to compute before the next token can be sampled.
    pub(crate) fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// The token counts to report.
    pub(crate) fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            cached_tokens: self.cached_tokens.unwrap_or(0),
            completion_tokens: self.generated(),
        }
    }

    /// Blocks needed to hold the first `positions` positions.
    pub(crate) fn blocks_for(&self, positions: usize, block_size: usize) -> usize {
        positions
            .div_ceil(block_size)
            .saturating_sub(self.blocks.len())
    }

    /// The pool row of position `pos`.
    pub(crate) fn slot(&self, pos: usize, block_size: usize) -> usize {
        self.blocks[pos / block_size] as usize * block_size + pos % block_size
    }

    /// Keys every full block computed since the last call (the prefix cache can hand
    /// them to other sequences from now on).
    pub(crate) fn key_full_blocks(&mut self, pool: &mut BlockPool) {
        let bs = pool.block_size();
        while (self.keyed.len() + 1) * bs <= self.computed {
            let b = self.keyed.len();
            let parent = self.keyed.last().copied().unwrap_or(0);
            let hash = pool.register(self.blocks[b], parent, &self.tokens[b * bs..(b + 1) * bs]);
            self.keyed.push(hash);
        }
    }

    /// Lets go of every block: full computed blocks stay keyed, and the last partly
    /// filled one is keyed by the tokens it holds, so a later request (or this one,
    /// recomputed) can start from them. The sequence holds no blocks after.
    pub(crate) fn free_blocks(&mut self, pool: &mut BlockPool) {
        self.key_full_blocks(pool);
        let bs = pool.block_size();
        let full = self.keyed.len();
        let rest = self.computed.saturating_sub(full * bs);
        if rest > 0 && full < self.blocks.len() && !self.dropped_by_window(full) {
            let parent = self.keyed.last().copied().unwrap_or(0);
            pool.register(
                self.blocks[full],
                parent,
                &self.tokens[full * bs..full * bs + rest],
            );
        }
        for b in self.blocks.drain(..) {
            pool.release(b);
        }
        self.keyed.clear();
        self.computed = 0;
    }

    /// Lets go of every block without keying any (blocks taken for a step that did not
    /// run hold nothing yet). The sequence holds no blocks after.
    pub(crate) fn abandon_blocks(&mut self, pool: &mut BlockPool) {
        for b in self.blocks.drain(..) {
            pool.release(b);
        }
        self.keyed.clear();
        self.computed = 0;
    }

    /// Whether logical block `b` was dropped by a sliding window.
    fn dropped_by_window(&self, b: usize) -> bool {
        self.blocks[b] == NULL_BLOCK
    }

    /// Drops the blocks no later query can see through a sliding window of `window`
    /// positions (the next query is at position `computed`).
    pub(crate) fn drop_out_of_window(&mut self, window: usize, pool: &mut BlockPool) {
        let bs = pool.block_size();
        let first_seen = (self.computed + 1).saturating_sub(window);
        for b in 0..(first_seen / bs).min(self.blocks.len()) {
            if self.blocks[b] != NULL_BLOCK {
                pool.release(self.blocks[b]);
                self.blocks[b] = NULL_BLOCK;
            }
        }
    }
}
