//! The host-memory tier (G2): blocks the device cache evicted, kept in
//! host memory least-recently-used, with the host link's two directions
//! (device to host for writes, host to device for read-backs) as
//! timelines. See [`crate::config::HostOffload`] for the model.
//!
//! A block is on host when it was written there (evicted from the device)
//! and not evicted from host since; it may be on the device too (read back,
//! or written again later: then it is only marked used). Eviction order
//! keeps the union of both tiers prefix-closed: the device evicts a chain's
//! tail before its prefix, so a block reaches host (or is marked used
//! there) after its descendants, and host evicts the least recently used
//! first, children before their parents.

use std::collections::{BTreeMap, HashMap};

use protocol::{BlockHash, KvEvent, Tier};

use crate::config::HostOffload;
use crate::kv_cache::Mix;

#[derive(Debug, Clone, Copy)]
struct HostBlock {
    parent: Option<BlockHash>,
    /// Key in the LRU map.
    stamp: u64,
    /// When its write to host ends (it can be read back from then).
    written_us: u64,
}

/// Host blocks, their LRU order and the link's timelines.
#[derive(Debug)]
pub(crate) struct HostTier {
    config: HostOffload,
    block_bytes: u64,
    blocks: HashMap<BlockHash, HostBlock, Mix>,
    lru: BTreeMap<u64, BlockHash>,
    next_stamp: u64,
    /// When the device-to-host direction is free.
    write_free_us: u64,
    /// When the host-to-device direction is free.
    read_free_us: u64,
    pub(crate) written_blocks: u64,
    pub(crate) read_blocks: u64,
    pub(crate) evicted_blocks: u64,
    pub(crate) write_us: u64,
    pub(crate) read_us: u64,
}

impl HostTier {
    pub(crate) fn new(config: HostOffload, block_bytes: u64) -> Self {
        Self {
            config,
            block_bytes,
            blocks: HashMap::default(),
            lru: BTreeMap::new(),
            next_stamp: 0,
            write_free_us: 0,
            read_free_us: 0,
            written_blocks: 0,
            read_blocks: 0,
            evicted_blocks: 0,
            write_us: 0,
            read_us: 0,
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.config.enabled()
    }

    pub(crate) fn len(&self) -> u32 {
        self.blocks.len() as u32
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.config.capacity_blocks
    }

    pub(crate) fn contains(&self, hash: BlockHash) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Every host block with its parent's, in no particular order.
    pub(crate) fn links(&self) -> impl Iterator<Item = (BlockHash, Option<BlockHash>)> + '_ {
        self.blocks.iter().map(|(&h, b)| (h, b.parent))
    }

    fn stamp(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    /// Marks a host block most recently used.
    pub(crate) fn touch(&mut self, hash: BlockHash) {
        let stamp = self.stamp();
        if let Some(b) = self.blocks.get_mut(&hash) {
            self.lru.remove(&b.stamp);
            b.stamp = stamp;
            self.lru.insert(stamp, hash);
        }
    }

    /// A block the device evicted at `now_us`: written to host (its
    /// `Stored` event pushed to `events`, after the host's least recently
    /// used block is evicted if the tier is full: its `Removed`), or only
    /// marked used when already there. Nothing when the tier is off.
    pub(crate) fn write(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        now_us: u64,
        events: &mut Vec<KvEvent>,
    ) {
        if !self.enabled() {
            return;
        }
        if self.contains(hash) {
            self.touch(hash);
            return;
        }
        if self.len() >= self.capacity() {
            if let Some((_, victim)) = self.lru.pop_first() {
                self.blocks.remove(&victim);
                self.evicted_blocks += 1;
                push(
                    events,
                    KvEvent::Removed {
                        blocks: vec![victim],
                        tier: Tier::Host,
                    },
                );
            }
        }
        let cost = self.config.link.duration_us(self.block_bytes) - self.config.link.setup_us;
        let start = self.write_free_us.max(now_us);
        self.write_free_us = start.saturating_add(cost);
        self.write_us += cost;
        self.written_blocks += 1;
        let stamp = self.stamp();
        self.blocks.insert(
            hash,
            HostBlock {
                parent,
                stamp,
                written_us: self.write_free_us,
            },
        );
        self.lru.insert(stamp, hash);
        push(
            events,
            KvEvent::Stored {
                parent,
                blocks: vec![hash],
                tier: Tier::Host,
            },
        );
    }

    /// Reads `hashes` (host blocks) back to the device, starting no earlier
    /// than `now_us`, after the reads queued before and after their writes:
    /// returns when the read ends (one transfer: the link's latency once,
    /// then the bytes). The blocks stay on host, marked used (tail first,
    /// so a parent is more recent than its children).
    pub(crate) fn read(&mut self, hashes: &[BlockHash], now_us: u64) -> u64 {
        let mut start = self.read_free_us.max(now_us);
        for h in hashes {
            if let Some(b) = self.blocks.get(h) {
                start = start.max(b.written_us);
            }
        }
        for &h in hashes.iter().rev() {
            self.touch(h);
        }
        let bytes = self.block_bytes.saturating_mul(hashes.len() as u64);
        let cost = self.config.link.duration_us(bytes);
        self.read_free_us = start.saturating_add(cost);
        self.read_us += cost;
        self.read_blocks += hashes.len() as u64;
        self.read_free_us
    }

    /// Empties the tier (engine restart; the caller emits `Cleared`).
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.lru.clear();
        self.write_free_us = 0;
        self.read_free_us = 0;
    }

    /// The map, the LRU order and the capacity agree.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.len() > self.capacity() {
            return Err(format!(
                "host tier holds {} blocks, capacity {}",
                self.len(),
                self.capacity()
            ));
        }
        if self.lru.len() != self.blocks.len() {
            return Err("host LRU and map differ in length".into());
        }
        for (stamp, h) in &self.lru {
            if self.blocks.get(h).map(|b| b.stamp) != Some(*stamp) {
                return Err(format!("host LRU entry {h} is stale"));
            }
        }
        Ok(())
    }
}

/// Appends `event`, merging it into the previous event when both remove
/// host blocks, or store host blocks of one chain.
fn push(events: &mut Vec<KvEvent>, event: KvEvent) {
    match (events.last_mut(), event) {
        (
            Some(KvEvent::Removed {
                blocks,
                tier: Tier::Host,
            }),
            KvEvent::Removed {
                blocks: new,
                tier: Tier::Host,
            },
        ) => blocks.extend(new),
        (
            Some(KvEvent::Stored {
                blocks,
                tier: Tier::Host,
                ..
            }),
            KvEvent::Stored {
                parent: Some(p),
                blocks: new,
                tier: Tier::Host,
            },
        ) if blocks.last() == Some(&p) => blocks.extend(new),
        (_, event) => events.push(event),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::KvTransfer;

    fn tier(capacity: u32) -> HostTier {
        HostTier::new(
            HostOffload {
                capacity_blocks: capacity,
                link: KvTransfer {
                    setup_us: 10,
                    bytes_per_s: 1e9,
                },
            },
            1_000,
        )
    }

    #[test]
    fn full_tier_evicts_least_recently_used_with_events() {
        let mut t = tier(2);
        let mut ev = Vec::new();
        t.write(BlockHash(1), None, 0, &mut ev);
        t.write(BlockHash(2), Some(BlockHash(1)), 0, &mut ev);
        t.touch(BlockHash(1));
        t.write(BlockHash(3), None, 0, &mut ev);
        assert!(t.contains(BlockHash(1)) && !t.contains(BlockHash(2)));
        assert_eq!(
            ev,
            vec![
                KvEvent::Stored {
                    parent: None,
                    blocks: vec![BlockHash(1), BlockHash(2)],
                    tier: Tier::Host
                },
                KvEvent::Removed {
                    blocks: vec![BlockHash(2)],
                    tier: Tier::Host
                },
                KvEvent::Stored {
                    parent: None,
                    blocks: vec![BlockHash(3)],
                    tier: Tier::Host
                },
            ]
        );
        assert!(t.check().is_ok());
    }

    #[test]
    fn reads_queue_after_writes_and_each_other() {
        let mut t = tier(8);
        let mut ev = Vec::new();
        // 1,000 B at 1 GB/s: 1 µs per block written.
        t.write(BlockHash(1), None, 100, &mut ev);
        t.write(BlockHash(2), Some(BlockHash(1)), 100, &mut ev);
        assert_eq!(t.write_us, 2);
        // Latency 10 µs + 2 µs of bytes, after the second write (102).
        assert_eq!(t.read(&[BlockHash(1), BlockHash(2)], 50), 114);
        // The next read waits for the first.
        assert_eq!(t.read(&[BlockHash(1)], 50), 125);
        assert!(t.check().is_ok());
    }

    #[test]
    fn an_off_tier_stores_nothing() {
        let mut t = tier(0);
        let mut ev = Vec::new();
        t.write(BlockHash(1), None, 0, &mut ev);
        assert!(!t.contains(BlockHash(1)) && ev.is_empty());
    }
}
