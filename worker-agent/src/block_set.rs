//! A worker's block set rebuilt from its own KV events, listed again as
//! compact `Stored` chains for a resync. Pure: no IO, no clock.
//!
//! An engine adapter keeps one beside its engine (the simulated engine
//! here; a vLLM adapter, which cannot ask vLLM for its blocks, the same
//! way): every event the engine emits is applied, so the mirror holds
//! exactly the blocks the engine reported.

use std::collections::{HashMap, HashSet};

use protocol::{BlockHash, KvEvent, Tier, TierSet};

#[derive(Debug, Clone, Copy)]
struct Entry {
    parent: Option<BlockHash>,
    tiers: TierSet,
}

/// The blocks a worker holds, with their parents and tiers.
#[derive(Debug, Default, Clone)]
pub struct BlockMirror {
    blocks: HashMap<BlockHash, Entry>,
}

impl BlockMirror {
    /// An empty mirror.
    pub fn new() -> Self {
        Self::default()
    }

    /// The blocks of an engine that lists them with their parents (in any
    /// order; engine-sim's `Engine::cached_block_links`), all in `tier`.
    pub fn from_links(
        links: impl IntoIterator<Item = (BlockHash, Option<BlockHash>)>,
        tier: Tier,
    ) -> Self {
        let mut mirror = Self::new();
        for (hash, parent) in links {
            mirror.store(hash, parent, tier);
        }
        mirror
    }

    fn store(&mut self, hash: BlockHash, parent: Option<BlockHash>, tier: Tier) {
        let entry = self.blocks.entry(hash).or_insert(Entry {
            parent,
            tiers: TierSet::EMPTY,
        });
        entry.parent = parent;
        entry.tiers = entry.tiers.with(tier);
    }

    /// Applies events in order.
    pub fn apply(&mut self, events: &[KvEvent]) {
        for event in events {
            match event {
                KvEvent::Stored {
                    parent,
                    blocks,
                    tier,
                } => {
                    let mut parent = *parent;
                    for &hash in blocks {
                        self.store(hash, parent, *tier);
                        parent = Some(hash);
                    }
                }
                KvEvent::Removed { blocks, tier } => {
                    for hash in blocks {
                        if let Some(entry) = self.blocks.get_mut(hash) {
                            entry.tiers = entry.tiers.without(*tier);
                            if entry.tiers.is_empty() {
                                self.blocks.remove(hash);
                            }
                        }
                    }
                }
                KvEvent::Cleared => self.blocks.clear(),
            }
        }
    }

    /// Blocks held in any tier.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Whether `hash` is held in any tier.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Every held block as `Stored` events, tier by tier: chains as long as
    /// possible (a chain breaks where a block has several children), each
    /// parent before its children, in a deterministic order.
    pub fn stored_events(&self) -> Vec<KvEvent> {
        let mut out = Vec::new();
        for tier in Tier::ALL {
            self.chains_of(tier, &mut out);
        }
        out
    }

    fn chains_of(&self, tier: Tier, out: &mut Vec<KvEvent>) {
        let held: HashSet<BlockHash> = self
            .blocks
            .iter()
            .filter(|(_, e)| e.tiers.contains(tier))
            .map(|(h, _)| *h)
            .collect();
        if held.is_empty() {
            return;
        }
        let mut children: HashMap<BlockHash, Vec<BlockHash>> = HashMap::new();
        let mut roots = Vec::new();
        for &hash in &held {
            match self.blocks[&hash].parent {
                Some(p) if held.contains(&p) => children.entry(p).or_default().push(hash),
                // A first block, or a block whose parent is not held in
                // this tier: a chain starts here.
                _ => roots.push(hash),
            }
        }
        for kids in children.values_mut() {
            kids.sort_unstable();
        }
        // Popped from the end: smallest root first.
        roots.sort_unstable_by(|a, b| b.cmp(a));
        let mut starts = roots;
        while let Some(start) = starts.pop() {
            let mut blocks = vec![start];
            let mut cur = start;
            while let Some(kids) = children.get(&cur) {
                // The first child continues the chain; the others start
                // chains of their own, emitted after this one.
                starts.extend(kids[1..].iter().rev());
                cur = kids[0];
                blocks.push(cur);
            }
            out.push(KvEvent::Stored {
                parent: self.blocks[&start].parent,
                blocks,
                tier,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use engine_sim::{Engine, EngineRequest, Mode, Preset};
    use protocol::{Role, WorkerId};

    use super::*;

    fn h(v: u64) -> BlockHash {
        BlockHash(v)
    }

    fn stored(parent: Option<u64>, blocks: &[u64]) -> KvEvent {
        KvEvent::Stored {
            parent: parent.map(h),
            blocks: blocks.iter().copied().map(h).collect(),
            tier: Tier::Device,
        }
    }

    #[test]
    fn chains_break_only_at_forks() {
        let mut m = BlockMirror::new();
        // 1-2-3 and 1-2-4-5, then 6 alone.
        m.apply(&[
            stored(None, &[1, 2, 3]),
            stored(Some(2), &[4, 5]),
            stored(None, &[6]),
        ]);
        assert_eq!(
            m.stored_events(),
            vec![
                stored(None, &[1, 2, 3]),
                stored(Some(2), &[4, 5]),
                stored(None, &[6]),
            ]
        );
        m.apply(&[KvEvent::Removed {
            blocks: vec![h(3)],
            tier: Tier::Device,
        }]);
        assert_eq!(
            m.stored_events(),
            vec![stored(None, &[1, 2, 4, 5]), stored(None, &[6])]
        );
        m.apply(&[KvEvent::Cleared]);
        assert!(m.is_empty() && m.stored_events().is_empty());
    }

    #[test]
    fn tiers_are_listed_separately() {
        let mut m = BlockMirror::new();
        m.apply(&[
            stored(None, &[1, 2]),
            KvEvent::Stored {
                parent: Some(h(1)),
                blocks: vec![h(2)],
                tier: Tier::Host,
            },
            KvEvent::Removed {
                blocks: vec![h(2)],
                tier: Tier::Device,
            },
        ]);
        assert_eq!(
            m.stored_events(),
            vec![
                stored(None, &[1]),
                KvEvent::Stored {
                    parent: Some(h(1)),
                    blocks: vec![h(2)],
                    tier: Tier::Host,
                },
            ]
        );
        assert_eq!(m.len(), 2);
    }

    /// Rebuilt from an engine's own events, the mirror holds exactly the
    /// engine's cached blocks, also after evictions; replaying its listing
    /// into a fresh mirror gives the same set.
    #[test]
    fn mirrors_the_simulated_engine() {
        let mut config = Preset::llama8b_h100().engine_config(4);
        config.kv_capacity_blocks = 40;
        let worker = WorkerId::new("w", 0).unwrap();
        let mut engine = Engine::new(worker, Role::Both, config).unwrap();
        let mut mirror = BlockMirror::new();
        let mut now = 0;
        for id in 0..12u64 {
            // Shared system prompt, then a distinct tail.
            let mut prompt: Vec<u32> = (0..16).collect();
            prompt.extend((0..20).map(|t| (id as u32 + 1) * 1000 + t));
            engine
                .submit(EngineRequest {
                    id,
                    prompt: prompt.into(),
                    output_tokens: Arc::from(vec![7u32; 6]),
                    mode: Mode::LocalPrefill,
                    pull_tokens: 0,
                })
                .unwrap();
            while let Some(step) = engine.step(now) {
                now = step.end_us();
                mirror.apply(&engine.take_kv_events());
            }
        }
        assert!(engine.stats().blocks_evicted > 0, "the test must evict");
        let want: HashSet<BlockHash> = engine.cached_blocks().collect();
        let got: HashSet<BlockHash> = mirror.blocks.keys().copied().collect();
        assert_eq!(got, want);

        let listing = mirror.stored_events();
        let mut seen = HashSet::new();
        for event in &listing {
            let KvEvent::Stored { parent, blocks, .. } = event else {
                panic!("only Stored events");
            };
            if let Some(p) = parent {
                assert!(seen.contains(p), "parents come first");
            }
            seen.extend(blocks.iter().copied());
        }
        let mut again = BlockMirror::new();
        again.apply(&listing);
        assert_eq!(again.blocks.keys().copied().collect::<HashSet<_>>(), want);
        assert_eq!(again.stored_events(), listing);
        // The engine's own listing of its blocks and parents gives the
        // same block set.
        let links = BlockMirror::from_links(engine.cached_block_links(), Tier::Device);
        assert_eq!(links.stored_events(), listing);
    }
}
