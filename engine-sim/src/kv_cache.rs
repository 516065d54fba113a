//! Paged KV cache with prefix caching, LRU eviction and event emission.
//!
//! Every block is in exactly one state:
//! - **free**: holds nothing;
//! - **in use**: held by one or more running requests (`refs > 0`); it may
//!   be registered under its chained hash (a full, computed block) or not (a
//!   partial block being filled);
//! - **evictable**: registered, held by nobody, kept for prefix hits in an
//!   LRU list. Allocation takes a free block first, then evicts the least
//!   recently released evictable one.
//!
//! Requests release their blocks last block first, so a sequence's tail is
//! evicted before its prefix. Since a request holding a block also holds all
//! of the block's ancestors, the cached blocks are always prefix-closed:
//! every cached block's parent is cached. Storing and evicting emit
//! [`KvEvent`]s, merged while consecutive.
//!
//! With a host tier ([`HostTier`], G2), an evicted block is written to host
//! (`Removed` from the device, then `Stored` on host), and the union of
//! device and host blocks is prefix-closed too: every host block's parent
//! is on the device or on host.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use protocol::{BlockHash, KvEvent, Tier};

use crate::config::HostOffload;
use crate::host_tier::HostTier;

/// Index of a block in the pool.
pub(crate) type BlockId = u32;

const NIL: u32 = u32::MAX;

/// A fast hasher for keys that are `u64`s (block hashes, request ids).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Builds [`MixHasher`]s.
pub(crate) type Mix = BuildHasherDefault<MixHasher>;

#[derive(Debug, Clone)]
struct Block {
    /// Meaningful only when `registered`.
    hash: BlockHash,
    /// The block before it in its chain; meaningful only when `registered`.
    parent: Option<BlockHash>,
    registered: bool,
    refs: u32,
    /// LRU links; meaningful only while evictable.
    prev: u32,
    next: u32,
}

impl Block {
    const EMPTY: Block = Block {
        hash: BlockHash(0),
        parent: None,
        registered: false,
        refs: 0,
        prev: NIL,
        next: NIL,
    };
}

/// How the blocks of a cache are used right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCounts {
    /// Blocks holding nothing.
    pub free: u32,
    /// Cached blocks no request holds (reusable by a prefix hit, evicted
    /// least-recently-used first).
    pub evictable: u32,
    /// Blocks held by requests.
    pub in_use: u32,
    /// The capacity.
    pub total: u32,
}

/// The block pool, the prefix cache and the events they produce.
#[derive(Debug)]
pub(crate) struct KvCache {
    blocks: Vec<Block>,
    free: Vec<BlockId>,
    by_hash: HashMap<BlockHash, BlockId, Mix>,
    lru_head: u32,
    lru_tail: u32,
    lru_len: u32,
    in_use: u32,
    events: Vec<KvEvent>,
    pub(crate) stored_blocks: u64,
    pub(crate) evicted_blocks: u64,
    /// The host tier (off unless configured).
    pub(crate) host: HostTier,
    /// The time evictions happen at (the step being planned).
    pub(crate) now_us: u64,
}

impl KvCache {
    /// A cache of `capacity` free blocks (`capacity < u32::MAX`).
    #[cfg(test)]
    pub(crate) fn new(capacity: u32) -> Self {
        Self::with_host(capacity, HostOffload::default(), 0)
    }

    /// A cache of `capacity` free blocks with a host tier behind it
    /// (blocks of `block_bytes`).
    pub(crate) fn with_host(capacity: u32, host: HostOffload, block_bytes: u64) -> Self {
        let mut cache = Self {
            blocks: vec![Block::EMPTY; capacity as usize],
            free: Vec::with_capacity(capacity as usize),
            by_hash: HashMap::default(),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            in_use: 0,
            events: Vec::new(),
            stored_blocks: 0,
            evicted_blocks: 0,
            host: HostTier::new(host, block_bytes),
            now_us: 0,
        };
        cache.reset_free_list();
        cache
    }

    fn reset_free_list(&mut self) {
        self.free.clear();
        // Popped from the end: block 0 is handed out first.
        self.free.extend((0..self.blocks.len() as u32).rev());
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks an allocation can get (free or evictable).
    pub(crate) fn available(&self) -> u32 {
        self.free.len() as u32 + self.lru_len
    }

    pub(crate) fn counts(&self) -> BlockCounts {
        BlockCounts {
            free: self.free.len() as u32,
            evictable: self.lru_len,
            in_use: self.in_use,
            total: self.capacity(),
        }
    }

    /// The block cached under `hash`.
    pub(crate) fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.by_hash.get(&hash).copied()
    }

    pub(crate) fn contains(&self, hash: BlockHash) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Whether acquiring this cached block takes it out of the evictable
    /// pool.
    pub(crate) fn is_evictable(&self, block: BlockId) -> bool {
        let b = &self.blocks[block as usize];
        b.registered && b.refs == 0
    }

    /// Every hash currently cached (in use or evictable).
    pub(crate) fn cached_hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.by_hash.keys().copied()
    }

    /// Every hash currently cached, with its parent's (in no particular
    /// order; the cache is prefix-closed, so every parent is cached too).
    pub(crate) fn cached_links(&self) -> impl Iterator<Item = (BlockHash, Option<BlockHash>)> + '_ {
        self.by_hash
            .iter()
            .map(|(&hash, &block)| (hash, self.blocks[block as usize].parent))
    }

    /// Number of cached (registered) blocks.
    pub(crate) fn cached_len(&self) -> usize {
        self.by_hash.len()
    }

    /// Takes one more reference on a cached block (a prefix hit).
    pub(crate) fn acquire(&mut self, block: BlockId) {
        let b = &mut self.blocks[block as usize];
        b.refs += 1;
        if b.refs == 1 {
            self.in_use += 1;
            if b.registered {
                self.lru_unlink(block);
            }
        }
    }

    /// A block for new KV, evicting the least recently used cached block
    /// when nothing is free. `None` when every block is in use.
    pub(crate) fn allocate(&mut self) -> Option<BlockId> {
        let block = match self.free.pop() {
            Some(b) => b,
            None => {
                let victim = self.lru_head;
                if victim == NIL {
                    return None;
                }
                self.lru_unlink(victim);
                let b = &mut self.blocks[victim as usize];
                b.registered = false;
                let (hash, parent) = (b.hash, b.parent);
                self.by_hash.remove(&hash);
                self.evicted_blocks += 1;
                self.push_removed(hash);
                self.host.write(hash, parent, self.now_us, &mut self.events);
                victim
            }
        };
        self.blocks[block as usize].refs = 1;
        self.in_use += 1;
        Some(block)
    }

    /// Drops one reference. A cached block nobody holds becomes evictable
    /// (most recently used end); an uncached one becomes free.
    pub(crate) fn release(&mut self, block: BlockId) {
        let b = &mut self.blocks[block as usize];
        debug_assert!(b.refs > 0, "release of an unheld block");
        if b.refs == 0 {
            return;
        }
        b.refs -= 1;
        if b.refs == 0 {
            self.in_use -= 1;
            if b.registered {
                self.lru_push_back(block);
            } else {
                self.free.push(block);
            }
        }
    }

    /// Registers a held, full, computed block under `hash` (child of
    /// `parent`) and returns the block the holder should keep: `block`
    /// itself, or the block already cached under that hash (another request
    /// computed the same content first; `block` is then released and
    /// nothing is stored).
    pub(crate) fn register(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
    ) -> BlockId {
        if let Some(existing) = self.lookup(hash) {
            if existing != block {
                self.acquire(existing);
                self.release(block);
            }
            return existing;
        }
        let b = &mut self.blocks[block as usize];
        b.hash = hash;
        b.parent = parent;
        b.registered = true;
        self.by_hash.insert(hash, block);
        self.stored_blocks += 1;
        self.push_stored(parent, hash);
        block
    }

    /// Empties the cache (engine restart): every block free, no event
    /// pending but [`KvEvent::Cleared`] (the events not yet taken are lost,
    /// as they would be with a real engine).
    pub(crate) fn clear(&mut self) {
        self.blocks.fill(Block::EMPTY);
        self.reset_free_list();
        self.by_hash.clear();
        self.lru_head = NIL;
        self.lru_tail = NIL;
        self.lru_len = 0;
        self.in_use = 0;
        self.host.clear();
        self.events.clear();
        self.events.push(KvEvent::Cleared);
    }

    /// Events since the last take.
    pub(crate) fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Appends to the previous Stored event when the block continues its
    /// chain, else starts a new event.
    fn push_stored(&mut self, parent: Option<BlockHash>, hash: BlockHash) {
        if let (
            Some(p),
            Some(KvEvent::Stored {
                blocks,
                tier: Tier::Device,
                ..
            }),
        ) = (parent, self.events.last_mut())
        {
            if blocks.last() == Some(&p) {
                blocks.push(hash);
                return;
            }
        }
        self.events.push(KvEvent::Stored {
            parent,
            blocks: vec![hash],
            tier: Tier::Device,
        });
    }

    fn push_removed(&mut self, hash: BlockHash) {
        if let Some(KvEvent::Removed {
            blocks,
            tier: Tier::Device,
        }) = self.events.last_mut()
        {
            blocks.push(hash);
            return;
        }
        self.events.push(KvEvent::Removed {
            blocks: vec![hash],
            tier: Tier::Device,
        });
    }

    fn lru_unlink(&mut self, block: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[block as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[block as usize];
        b.prev = NIL;
        b.next = NIL;
        self.lru_len -= 1;
    }

    fn lru_push_back(&mut self, block: BlockId) {
        let tail = self.lru_tail;
        {
            let b = &mut self.blocks[block as usize];
            b.prev = tail;
            b.next = NIL;
        }
        if tail == NIL {
            self.lru_head = block;
        } else {
            self.blocks[tail as usize].next = block;
        }
        self.lru_tail = block;
        self.lru_len += 1;
    }

    /// Checks the pool's internal consistency against `holders` (how many
    /// requests hold each block). O(capacity).
    pub(crate) fn check(&self, holders: &[u32]) -> Result<(), String> {
        let cap = self.blocks.len();
        if holders.len() != cap {
            return Err("holder table has the wrong length".into());
        }
        let mut seen_free = vec![false; cap];
        for &f in &self.free {
            let b = &self.blocks[f as usize];
            if seen_free[f as usize] || b.refs != 0 || b.registered {
                return Err(format!("free list entry {f} is not a free block"));
            }
            seen_free[f as usize] = true;
        }
        // Walk the LRU list.
        let mut in_lru = vec![false; cap];
        let mut n = 0u32;
        let mut prev = NIL;
        let mut cur = self.lru_head;
        while cur != NIL {
            let b = &self.blocks[cur as usize];
            if in_lru[cur as usize] || b.refs != 0 || !b.registered || b.prev != prev {
                return Err(format!("LRU entry {cur} is inconsistent"));
            }
            in_lru[cur as usize] = true;
            n += 1;
            prev = cur;
            cur = b.next;
        }
        if prev != self.lru_tail || n != self.lru_len {
            return Err("LRU tail or length is wrong".into());
        }
        let mut in_use = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            if b.refs != holders[i] {
                return Err(format!(
                    "block {i} has {} refs but {} holders",
                    b.refs, holders[i]
                ));
            }
            if b.refs > 0 {
                in_use += 1;
            } else if !(seen_free[i] || in_lru[i]) {
                return Err(format!("unheld block {i} is neither free nor evictable"));
            }
            if b.registered && self.by_hash.get(&b.hash) != Some(&(i as u32)) {
                return Err(format!("block {i} is registered but not in the map"));
            }
        }
        if in_use != self.in_use {
            return Err("in-use count is wrong".into());
        }
        for (&h, &b) in &self.by_hash {
            let blk = &self.blocks[b as usize];
            if !blk.registered || blk.hash != h {
                return Err(format!("map entry {h} points to a block not holding it"));
            }
            if let Some(p) = blk.parent {
                if !self.by_hash.contains_key(&p) {
                    return Err(format!(
                        "device block {h}'s parent {p} is not on the device"
                    ));
                }
            }
        }
        self.host.check()?;
        for (h, parent) in self.host.links() {
            if let Some(p) = parent {
                if !self.by_hash.contains_key(&p) && !self.host.contains(p) {
                    return Err(format!("host block {h}'s parent {p} is on no tier"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: u64) -> BlockHash {
        BlockHash(v)
    }

    #[test]
    fn release_makes_cached_blocks_evictable_and_others_free() {
        let mut c = KvCache::new(3);
        let a = c.allocate().unwrap();
        let b = c.allocate().unwrap();
        assert_eq!(c.register(a, h(1), None), a);
        c.release(b);
        c.release(a);
        let k = c.counts();
        assert_eq!((k.free, k.evictable, k.in_use), (2, 1, 0));
        assert_eq!(c.lookup(h(1)), Some(a));
    }

    #[test]
    fn eviction_is_lru_and_emits_removed() {
        let mut c = KvCache::new(2);
        let a = c.allocate().unwrap();
        let b = c.allocate().unwrap();
        c.register(a, h(1), None);
        c.register(b, h(2), Some(h(1)));
        // Tail first, like a finishing request.
        c.release(b);
        c.release(a);
        c.take_events();
        let got = c.allocate().unwrap();
        assert_eq!(got, b, "the tail block is evicted first");
        assert!(!c.contains(h(2)) && c.contains(h(1)));
        assert_eq!(
            c.take_events(),
            vec![KvEvent::Removed {
                blocks: vec![h(2)],
                tier: Tier::Device
            }]
        );
        c.acquire(a); // a prefix hit protects the block
        assert_eq!(c.allocate(), None);
    }

    #[test]
    fn consecutive_stores_merge_into_one_event() {
        let mut c = KvCache::new(4);
        let ids: Vec<_> = (0..3).map(|_| c.allocate().unwrap()).collect();
        c.register(ids[0], h(10), None);
        c.register(ids[1], h(11), Some(h(10)));
        c.register(ids[2], h(20), Some(h(99)));
        assert_eq!(
            c.take_events(),
            vec![
                KvEvent::Stored {
                    parent: None,
                    blocks: vec![h(10), h(11)],
                    tier: Tier::Device
                },
                KvEvent::Stored {
                    parent: Some(h(99)),
                    blocks: vec![h(20)],
                    tier: Tier::Device
                },
            ]
        );
    }

    #[test]
    fn registering_known_content_shares_the_cached_block() {
        let mut c = KvCache::new(2);
        let a = c.allocate().unwrap();
        let b = c.allocate().unwrap();
        c.register(a, h(5), None);
        c.take_events();
        assert_eq!(c.register(b, h(5), None), a);
        assert!(c.take_events().is_empty());
        let k = c.counts();
        assert_eq!((k.free, k.in_use), (1, 1));
        let mut holders = vec![0; 2];
        holders[a as usize] = 2;
        assert!(c.check(&holders).is_ok());
    }
}
