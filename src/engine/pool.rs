//! The host's bookkeeping of the KV pool's blocks: which are free, who holds each (a
//! reference count), and which hold known tokens (the prefix cache).
//!
//! Block 0 is never handed out: padding tokens write their K/V there and table entries
//! that point nowhere (blocks a sliding window has dropped) name it.
//!
//! **Prefix cache.** A block is keyed by the tokens it holds and by the key of the
//! block before it (a hash chain, so equal keys mean equal prefixes): full blocks as soon
//! as they are computed, and a sequence's last, partly filled block when the sequence
//! lets go of it. A new sequence whose tokens start with a chain of keyed blocks takes
//! those blocks (a reference each) instead of computing them again; a partly filled block
//! is copied into a block of its own first (copy on write), since the sequence goes on
//! writing after its tokens; it may share only the first positions of the cached block
//! (the longest common beginning of its tokens and the block's), so a later turn of a
//! chat reuses the last block of the turn before even where it diverges inside it. Blocks
//! nobody holds stay keyed, in least-recently-used order,
//! until a block is needed and no free one is left: then the least recently used is
//! evicted (its key forgotten) and handed out.
//!
//! Keys are compared by their tokens and parent key, not by hash alone.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash, Hasher};

/// A physical block of the pool.
pub type BlockId = u32;

/// The block padding writes into and empty table entries point to.
pub const NULL_BLOCK: BlockId = 0;

/// What a keyed block holds: its tokens after the prefix its parent key stands for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    parent: u64,
    tokens: Vec<u32>,
}

/// One block's state.
#[derive(Clone, Debug, Default)]
struct Block {
    /// Sequences holding it.
    refs: u32,
    /// Its key and hash while it is in the prefix cache.
    key: Option<(u64, Key)>,
    /// When it was last released (the LRU order of unheld keyed blocks).
    released: u64,
}

/// A prefix of a sequence's tokens found in the cache ([`BlockPool::lookup`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prefix {
    /// Full blocks, in order, with the key hash of each (the parent of the next).
    pub full: Vec<(BlockId, u64)>,
    /// A partly filled block after them and how many of its positions match.
    pub partial: Option<(BlockId, usize)>,
}

impl Prefix {
    /// Tokens the prefix covers.
    pub fn tokens(&self, block_size: usize) -> usize {
        self.full.len() * block_size + self.partial.map_or(0, |(_, n)| n)
    }
}

/// Counters of the pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks a sequence can be given (block 0 excluded).
    pub total: usize,
    /// Blocks held by at least one sequence.
    pub used: usize,
    /// Blocks nobody holds that keep known tokens (reusable, evictable).
    pub cached: usize,
    /// Keyed blocks evicted so far.
    pub evictions: u64,
}

/// The host's view of the pool's blocks.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    /// Unkeyed blocks nobody holds.
    free: Vec<BlockId>,
    /// Keyed blocks nobody holds, by release time (oldest first).
    lru: BTreeMap<u64, BlockId>,
    /// Keyed blocks by key hash.
    by_hash: HashMap<u64, BlockId>,
    /// Keyed blocks by the hash of their parent (the blocks that may follow a prefix).
    children: HashMap<u64, Vec<BlockId>>,
    clock: u64,
    evictions: u64,
    hasher: ahash::RandomState,
}

impl BlockPool {
    /// A pool of `n_blocks` blocks of `block_size` positions (block 0 reserved).
    pub fn new(n_blocks: usize, block_size: usize) -> BlockPool {
        let n = n_blocks.max(1);
        BlockPool {
            block_size,
            blocks: vec![Block::default(); n],
            // handed out lowest first
            free: (1..n as BlockId).rev().collect(),
            lru: BTreeMap::new(),
            by_hash: HashMap::new(),
            children: HashMap::new(),
            clock: 0,
            evictions: 0,
            hasher: ahash::RandomState::with_seeds(1, 2, 3, 4),
        }
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks a sequence can hold (all but block 0).
    pub fn capacity(&self) -> usize {
        self.blocks.len() - 1
    }

    /// Blocks that can be handed out now: free ones and unheld keyed ones.
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// The counters.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            total: self.capacity(),
            used: self.capacity() - self.available(),
            cached: self.lru.len(),
            evictions: self.evictions,
        }
    }

    /// The hash of the block holding `tokens` after the prefix hashed `parent`.
    pub fn hash(&self, parent: u64, tokens: &[u32]) -> u64 {
        let mut h = self.hasher.build_hasher();
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    /// The keyed block holding exactly `tokens` after the prefix `parent`, if any.
    fn find(&self, parent: u64, tokens: &[u32]) -> Option<(BlockId, u64)> {
        let hash = self.hash(parent, tokens);
        let id = *self.by_hash.get(&hash)?;
        let (_, key) = self.blocks[id as usize].key.as_ref()?;
        (key.parent == parent && key.tokens == tokens).then_some((id, hash))
    }

    /// The longest cached prefix of `tokens`, at most `max` tokens of it: full blocks,
    /// then the keyed block after them whose tokens begin like what follows, for as many
    /// positions as they agree. Takes nothing.
    pub fn lookup(&self, tokens: &[u32], max: usize) -> Prefix {
        let bs = self.block_size;
        let tokens = &tokens[..max.min(tokens.len())];
        let mut out = Prefix::default();
        let mut parent = 0u64;
        for chunk in tokens.chunks_exact(bs) {
            match self.find(parent, chunk) {
                Some((id, hash)) => {
                    out.full.push((id, hash));
                    parent = hash;
                }
                None => break,
            }
        }
        let rest = &tokens[out.full.len() * bs..];
        let agree = |id: &BlockId| {
            let (_, key) = self.blocks[*id as usize].key.as_ref()?;
            let n = key
                .tokens
                .iter()
                .zip(rest)
                .take_while(|(a, b)| a == b)
                .count();
            (n > 0).then_some((*id, n.min(bs - 1)))
        };
        out.partial = self
            .children
            .get(&parent)
            .and_then(|ids| ids.iter().filter_map(agree).max_by_key(|&(id, n)| (n, id)));
        out
    }

    /// Takes a reference to `id` (a block from [`BlockPool::lookup`] or a fresh one).
    pub fn acquire(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if b.refs == 0 && b.key.is_some() {
            self.lru.remove(&b.released);
        }
        b.refs += 1;
    }

    /// A block of one's own (one reference), evicting the least recently used unheld
    /// keyed block when no free one is left; `None` when every block is held.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.lru.pop_first()?;
                if let Some((hash, key)) = self.blocks[id as usize].key.take() {
                    self.by_hash.remove(&hash);
                    if let Some(ids) = self.children.get_mut(&key.parent) {
                        ids.retain(|&c| c != id);
                        if ids.is_empty() {
                            self.children.remove(&key.parent);
                        }
                    }
                }
                self.evictions += 1;
                id
            }
        };
        self.blocks[id as usize].refs = 1;
        Some(id)
    }

    /// Drops a reference to `id`; a block nobody holds any more is free again, or, when
    /// keyed, kept in the cache as the most recently used.
    pub fn release(&mut self, id: BlockId) {
        if id == NULL_BLOCK {
            return;
        }
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.refs > 0, "block {id} released more often than held");
        b.refs = b.refs.saturating_sub(1);
        if b.refs > 0 {
            return;
        }
        if b.key.is_some() {
            self.clock += 1;
            b.released = self.clock;
            self.lru.insert(self.clock, id);
        } else {
            self.free.push(id);
        }
    }

    /// Keys `id` (held by the caller) as holding `tokens` after the prefix `parent`:
    /// a full block once computed, or a sequence's last partly filled block when it lets
    /// go of it. Returns the key's hash (the parent of the next block). When another block
    /// already holds that key, or `id` is keyed already, nothing changes.
    pub fn register(&mut self, id: BlockId, parent: u64, tokens: &[u32]) -> u64 {
        let hash = self.hash(parent, tokens);
        if id == NULL_BLOCK || self.by_hash.contains_key(&hash) {
            return hash;
        }
        let b = &mut self.blocks[id as usize];
        if b.key.is_none() {
            b.key = Some((
                hash,
                Key {
                    parent,
                    tokens: tokens.to_vec(),
                },
            ));
            self.by_hash.insert(hash, id);
            self.children.entry(parent).or_default().push(id);
        }
        hash
    }

    /// References held on `id` (tests and statistics).
    pub fn refs(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].refs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_out_released_and_block_zero_never() {
        let mut p = BlockPool::new(4, 16);
        let got: Vec<_> = (0..3).map(|_| p.allocate().unwrap()).collect();
        assert_eq!(got, vec![1, 2, 3]);
        assert_eq!(p.allocate(), None);
        assert_eq!(p.stats().used, 3);
        p.release(2);
        assert_eq!(p.allocate(), Some(2));
        p.release(NULL_BLOCK);
        assert_eq!(p.available(), 0);
    }

    #[test]
    fn prefixes_are_found_by_tokens_and_parent() {
        let mut p = BlockPool::new(8, 4);
        let toks: Vec<u32> = (0..11).collect();
        let a = p.allocate().unwrap();
        let h0 = p.register(a, 0, &toks[0..4]);
        let b = p.allocate().unwrap();
        let h1 = p.register(b, h0, &toks[4..8]);
        let c = p.allocate().unwrap();
        p.register(c, h1, &toks[8..10]);
        // all of it, then less of it
        let f = p.lookup(&toks, 11);
        assert_eq!(f.full, vec![(a, h0), (b, h1)]);
        assert_eq!(f.partial, Some((c, 2)));
        assert_eq!(f.tokens(4), 10);
        // a prefix of the partly filled block's tokens
        let f = p.lookup(&toks, 9);
        assert_eq!((f.full.len(), f.partial), (2, Some((c, 1))));
        // the first positions of a full block
        let f = p.lookup(&toks, 6);
        assert_eq!((f.full.len(), f.partial), (1, Some((b, 2))));
        // the same tokens after another prefix are not a match
        let other: Vec<u32> = [99, 1, 2, 3, 4, 5, 6, 7].to_vec();
        assert_eq!(p.lookup(&other, 8), Prefix::default());
        // tokens that diverge inside a keyed block share its first positions
        let diverge: Vec<u32> = [0, 1, 2, 3, 4, 5, 6, 7, 8, 77, 5].to_vec();
        assert_eq!(p.lookup(&diverge, 11).partial, Some((c, 1)));
        let diverge: Vec<u32> = [0, 1, 2, 3, 4, 5, 9, 9].to_vec();
        let f = p.lookup(&diverge, 8);
        assert_eq!((f.full.len(), f.partial), (1, Some((b, 2))));
        let diverge: Vec<u32> = [0, 1, 2, 3, 66].to_vec();
        assert_eq!(p.lookup(&diverge, 5).partial, None);
    }

    #[test]
    fn unheld_keyed_blocks_are_reused_then_evicted_oldest_first() {
        let mut p = BlockPool::new(4, 2);
        let (a, b, c) = (
            p.allocate().unwrap(),
            p.allocate().unwrap(),
            p.allocate().unwrap(),
        );
        let ha = p.register(a, 0, &[1, 2]);
        p.register(b, 0, &[3, 4]);
        p.release(a);
        p.release(b);
        assert_eq!(p.stats().cached, 2);
        // a cache hit takes a block back out of the LRU
        let hit = p.lookup(&[1, 2, 9], 3);
        assert_eq!(hit.full, vec![(a, ha)]);
        p.acquire(a);
        assert_eq!((p.refs(a), p.stats().cached), (1, 1));
        // no free block: the least recently released keyed block (b) is evicted
        assert_eq!(p.allocate(), Some(b));
        assert_eq!(p.stats().evictions, 1);
        assert_eq!(p.lookup(&[3, 4], 2), Prefix::default());
        assert_eq!(p.allocate(), None);
        p.release(c);
        assert_eq!(p.allocate(), Some(c));
    }

    #[test]
    fn a_key_held_by_another_block_is_not_taken_twice() {
        let mut p = BlockPool::new(4, 2);
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        let h = p.register(a, 0, &[5, 6]);
        assert_eq!(p.register(b, 0, &[5, 6]), h);
        assert_eq!(p.lookup(&[5, 6], 2).full, vec![(a, h)]);
        p.release(b);
        // b was never keyed: it is free, not cached
        assert_eq!(p.stats().cached, 0);
    }
}
