//! Engine events to canonical events: the dual-key translation. Pure: no
//! IO, no clock.
//!
//! An engine names blocks with hashes nobody else can recompute (vLLM
//! seeds its hash per process; SGLang uses its own SHA-256 chain). Every
//! `BlockStored` carries the tokens of its blocks, so the translator
//! computes Switchyard's own chained hash ([`BlockHasher`] under the
//! deployment's contract) from the tokens and the parent's already-mapped
//! hash, and keeps a map engine hash -> own hash. A `BlockRemoved`
//! carries engine hashes only and is resolved through the map.
//!
//! - A `BlockStored` whose parent is not in the map cannot be placed: its
//!   blocks are not reported, and it is counted ([`Outcome::unknown_parents`])
//!   so that the caller can ask the engine for a replay or resynchronise.
//! - Tiers come from `medium`: `GPU` (or none) is [`Tier::Device`], `CPU` /
//!   `CPU_PINNED` [`Tier::Host`], `DISK` [`Tier::Disk`], anything else
//!   [`Tier::Host`], counted.
//! - A block's own hash is seeded like the router's prompts: the model's
//!   [`HashSalt`], with the LoRA name and cache salt when the event has
//!   them, and the block's extra keys (multimodal ids...) folded in; so a
//!   LoRA, salted or multimodal block never matches a plain prompt.
//! - Only one KV-cache group is tracked: the first full-attention group
//!   seen (hybrid models publish one event per group); others are counted
//!   and skipped.
//! - A `BlockStored` whose `block_size` is not the deployment's is fatal:
//!   every overlap would be zero ([`Outcome::fatal`]).
//! - Canonical events are emitted only when a (block, tier) appears or
//!   disappears, so duplicates and replays are harmless.

use std::collections::HashMap;

use protocol::{BlockHash, BlockHasher, HashSalt, KvEvent, Tier, TierSet};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::wire::{BlockStored, EngineHash, WireBatch, WireEvent};
use crate::block_set::BlockMirror;

/// The tier of a `medium`, and whether the medium was one we know.
pub fn tier_of(medium: Option<&str>) -> (Tier, bool) {
    match medium {
        None => (Tier::Device, true),
        Some(m) => match m.to_ascii_uppercase().as_str() {
            "GPU" | "CUDA" | "DEVICE" => (Tier::Device, true),
            "CPU" | "CPU_PINNED" | "HOST" => (Tier::Host, true),
            "DISK" | "SSD" => (Tier::Disk, true),
            _ => (Tier::Host, false),
        },
    }
}

/// Counts of what one call did beyond emitting events (all zero when the
/// input was clean).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Canonical events, in the engine's order.
    pub events: Vec<KvEvent>,
    /// `BlockStored` events whose parent is not known: skipped.
    pub unknown_parents: u64,
    /// `BlockRemoved` hashes that were not held (already removed, or never
    /// placed).
    pub unknown_removed: u64,
    /// `BlockStored` events whose tokens do not fill their blocks exactly.
    pub token_mismatches: u64,
    /// Events with a medium we do not know (mapped to the host tier).
    pub unknown_media: u64,
    /// Events of another KV-cache group (skipped).
    pub other_groups: u64,
    /// `BlockStored` events of another block size (skipped): a hybrid
    /// model's partial tails, once the engine has stored blocks of the
    /// deployment's size.
    pub other_block_sizes: u64,
    /// The engine's block size when it is not the deployment's: a batch of
    /// another size before any block of the deployment's.
    pub fatal: Option<BlockSizeMismatch>,
}

/// The engine's blocks are not the deployment's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the engine publishes blocks of {engine} tokens but the deployment's block size is {deployment}: every overlap would be zero (set the engine's block size to {deployment}, e.g. vLLM --block-size / SGLang --page-size)")]
pub struct BlockSizeMismatch {
    pub engine: u32,
    pub deployment: u32,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    own: BlockHash,
    tiers: TierSet,
}

/// One engine's (one data-parallel rank's) translation state.
#[derive(Debug, Clone)]
pub struct Translator {
    model: String,
    hasher: BlockHasher,
    held: HashMap<EngineHash, Held>,
    /// Engine blocks per (own hash, tier): an own hash leaves a tier when
    /// the last engine block naming it leaves.
    refs: HashMap<(BlockHash, Tier), u32>,
    mirror: BlockMirror,
    group: Option<Option<i64>>,
    /// Whether the engine ever stored a block of the deployment's size:
    /// after that, a block of another size is a partial tail, not a
    /// misconfigured engine. Kept across engine restarts.
    seen_deployment_size: bool,
}

impl Translator {
    /// A translator for `model` with the deployment's `hasher` (block size
    /// and the model's salt).
    pub fn new(model: &str, hasher: BlockHasher) -> Self {
        Self {
            model: model.to_owned(),
            hasher,
            held: HashMap::new(),
            refs: HashMap::new(),
            mirror: BlockMirror::new(),
            group: None,
            seen_deployment_size: false,
        }
    }

    /// Forgets everything (the engine restarted: its cache is empty).
    pub fn reset(&mut self) {
        self.held.clear();
        self.refs.clear();
        self.mirror = BlockMirror::new();
        self.group = None;
    }

    /// Blocks held (engine hashes mapped).
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The own hash of an engine block, when held.
    pub fn own_hash(&self, engine: &EngineHash) -> Option<BlockHash> {
        self.held.get(engine).map(|h| h.own)
    }

    /// Every block reported and not removed, as `Stored` chains (for a
    /// [`crate::KvUpdate::BlockSet`]).
    pub fn block_set(&self) -> Vec<KvEvent> {
        self.mirror.stored_events()
    }

    /// The mirror of what was emitted.
    pub fn mirror(&self) -> &BlockMirror {
        &self.mirror
    }

    /// How many leading whole blocks of `tokens` (a prompt with its LoRA
    /// adapter and cache salt, hashed as the engine's `BlockStored` events
    /// for it are) the engine holds in any tier, by the events it sent.
    /// The query has tokens only, so a block the engine stored with extra
    /// keys (multimodal) never matches: the count stops before it.
    pub fn held_prefix_blocks(
        &self,
        tokens: &[u32],
        lora: Option<&str>,
        cache_salt: Option<&str>,
    ) -> usize {
        let mut hashes = Vec::new();
        self.hasher_for(lora, cache_salt)
            .extend(None, tokens, &mut hashes);
        hashes
            .iter()
            .take_while(|&&h| self.mirror.contains(h))
            .count()
    }

    /// The hasher of blocks stored for a request with `lora` and
    /// `cache_salt`: the deployment's, salted with them when it has either.
    fn hasher_for(&self, lora: Option<&str>, cache_salt: Option<&str>) -> BlockHasher {
        if lora.is_none() && cache_salt.is_none() {
            return self.hasher;
        }
        BlockHasher::new(
            self.hasher.block_size(),
            HashSalt::new(&self.model, lora, cache_salt),
        )
        .expect("the deployment's block size is valid")
    }

    /// Translates one batch.
    pub fn apply(&mut self, batch: &WireBatch) -> Outcome {
        let mut out = Outcome::default();
        let mut first_other_size = None;
        for event in &batch.events {
            match event {
                WireEvent::Stored(stored) if stored.block_size != self.hasher.block_size() => {
                    out.other_block_sizes += 1;
                    first_other_size.get_or_insert(stored.block_size);
                }
                WireEvent::Stored(stored) => {
                    self.seen_deployment_size = true;
                    self.stored(stored, &mut out);
                }
                WireEvent::Removed {
                    block_hashes,
                    medium,
                    group_idx,
                } => {
                    if !self.tracks_group(*group_idx, None, false) {
                        out.other_groups += 1;
                        continue;
                    }
                    let (tier, known) = tier_of(medium.as_deref());
                    if !known {
                        out.unknown_media += 1;
                    }
                    self.removed(block_hashes, tier, &mut out);
                }
                WireEvent::AllCleared => {
                    self.reset();
                    out.events.push(KvEvent::Cleared);
                }
            }
        }
        self.mirror.apply(&out.events);
        if let Some(engine) = first_other_size.filter(|_| !self.seen_deployment_size) {
            out.fatal = Some(BlockSizeMismatch {
                engine,
                deployment: self.hasher.block_size(),
            });
        }
        out
    }

    /// Whether events of `group` (of `kind`, for stored events) are the
    /// ones tracked; the first full-attention group seen is.
    fn tracks_group(&mut self, group: Option<i64>, kind: Option<&str>, store: bool) -> bool {
        let full = kind.is_none_or(|k| k == "full_attention");
        match self.group {
            Some(g) => g == group && full,
            None if full => {
                // A removal before any store holds nothing to remove.
                if store {
                    self.group = Some(group);
                }
                true
            }
            None => false,
        }
    }

    fn stored(&mut self, e: &BlockStored, out: &mut Outcome) {
        if !self.tracks_group(e.group_idx, e.kv_cache_spec_kind.as_deref(), true) {
            out.other_groups += 1;
            return;
        }
        let bs = e.block_size as usize;
        if e.token_ids.len() != e.block_hashes.len() * bs {
            out.token_mismatches += 1;
            return;
        }
        let mut parent = match &e.parent {
            None => None,
            Some(p) => match self.held.get(p) {
                Some(h) => Some(h.own),
                None => {
                    out.unknown_parents += 1;
                    return;
                }
            },
        };
        let (tier, known) = tier_of(e.medium.as_deref());
        if !known {
            out.unknown_media += 1;
        }
        let hasher = self.hasher_for(e.lora_name.as_deref(), e.cache_salt.as_deref());
        // Runs of blocks new to the tier, each with its parent.
        let mut run_parent = parent;
        let mut run: Vec<BlockHash> = Vec::new();
        for (i, (engine, tokens)) in e
            .block_hashes
            .iter()
            .zip(e.token_ids.chunks_exact(bs))
            .enumerate()
        {
            let mut content = hasher.content_hash(tokens);
            if let Some(Some(extra)) = e.extra_keys.as_ref().and_then(|k| k.get(i)) {
                content = xxh3_64_with_seed(extra, content);
            }
            let own = BlockHasher::chain(parent, content);
            if let Some(old) = self.held.get(engine).copied() {
                if old.own != own {
                    // The engine reused a hash for other content: the old
                    // block is gone from every tier.
                    if !run.is_empty() {
                        out.events.push(KvEvent::Stored {
                            parent: run_parent,
                            blocks: std::mem::take(&mut run),
                            tier,
                        });
                    }
                    self.held.remove(engine);
                    for t in old.tiers.iter() {
                        if self.release(old.own, t) {
                            out.events.push(KvEvent::Removed {
                                blocks: vec![old.own],
                                tier: t,
                            });
                        }
                    }
                }
            }
            let entry = self.held.entry(engine.clone()).or_insert(Held {
                own,
                tiers: TierSet::EMPTY,
            });
            let new_here = !entry.tiers.contains(tier);
            entry.tiers = entry.tiers.with(tier);
            let appears = new_here && {
                let r = self.refs.entry((own, tier)).or_insert(0);
                *r += 1;
                *r == 1
            };
            if appears {
                if run.is_empty() {
                    run_parent = parent;
                }
                run.push(own);
            } else if !run.is_empty() {
                out.events.push(KvEvent::Stored {
                    parent: run_parent,
                    blocks: std::mem::take(&mut run),
                    tier,
                });
            }
            parent = Some(own);
        }
        if !run.is_empty() {
            out.events.push(KvEvent::Stored {
                parent: run_parent,
                blocks: run,
                tier,
            });
        }
    }

    /// Drops one engine block's reference to `(own, tier)`; true when it
    /// was the last.
    fn release(&mut self, own: BlockHash, tier: Tier) -> bool {
        match self.refs.get_mut(&(own, tier)) {
            Some(r) if *r > 1 => {
                *r -= 1;
                false
            }
            Some(_) => {
                self.refs.remove(&(own, tier));
                true
            }
            None => false,
        }
    }

    fn removed(&mut self, hashes: &[EngineHash], tier: Tier, out: &mut Outcome) {
        let mut gone = Vec::new();
        for engine in hashes {
            let Some(entry) = self.held.get_mut(engine) else {
                out.unknown_removed += 1;
                continue;
            };
            if !entry.tiers.contains(tier) {
                out.unknown_removed += 1;
                continue;
            }
            entry.tiers = entry.tiers.without(tier);
            let own = entry.own;
            if entry.tiers.is_empty() {
                self.held.remove(engine);
            }
            if self.release(own, tier) {
                gone.push(own);
            }
        }
        if !gone.is_empty() {
            out.events.push(KvEvent::Removed { blocks: gone, tier });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;

    const BS: u32 = 4;
    const MODEL: &str = "m";

    fn hasher() -> BlockHasher {
        BlockHasher::new(BS, HashSalt::new(MODEL, None, None)).unwrap()
    }

    fn translator() -> Translator {
        Translator::new(MODEL, hasher())
    }

    fn h(v: u64) -> EngineHash {
        EngineHash::Int(v)
    }

    fn stored(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        medium: Option<&str>,
    ) -> WireEvent {
        WireEvent::Stored(BlockStored {
            block_hashes: hashes.iter().map(|&v| h(v)).collect(),
            parent: parent.map(h),
            token_ids: tokens.to_vec(),
            block_size: BS,
            medium: medium.map(str::to_owned),
            lora_name: None,
            extra_keys: None,
            cache_salt: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        })
    }

    fn removed(hashes: &[u64], medium: Option<&str>) -> WireEvent {
        WireEvent::Removed {
            block_hashes: hashes.iter().map(|&v| h(v)).collect(),
            medium: medium.map(str::to_owned),
            group_idx: None,
        }
    }

    fn batch(events: Vec<WireEvent>) -> WireBatch {
        WireBatch {
            ts: None,
            events,
            dp_rank: None,
            skipped: Vec::new(),
        }
    }

    fn tokens(n: u32, seed: u32) -> Vec<u32> {
        (0..n).map(|i| seed * 1000 + i).collect()
    }

    #[test]
    fn own_hashes_are_the_routers_chained_hashes() {
        let mut t = translator();
        let prompt = tokens(12, 1);
        let want = hasher().hash_prompt(&prompt);
        // Stored in two events: the second chained on the first's last block.
        let out = t.apply(&batch(vec![
            stored(&[101, 102], None, &prompt[..8], Some("GPU")),
            stored(&[103], Some(102), &prompt[8..], None),
        ]));
        assert_eq!(
            out.events,
            vec![
                KvEvent::Stored {
                    parent: None,
                    blocks: want[..2].to_vec(),
                    tier: Tier::Device
                },
                KvEvent::Stored {
                    parent: Some(want[1]),
                    blocks: vec![want[2]],
                    tier: Tier::Device
                },
            ]
        );
        assert_eq!(out.unknown_parents, 0);
        assert_eq!(t.own_hash(&h(103)), Some(want[2]));

        // Removal goes through the map; unknown hashes are counted.
        let out = t.apply(&batch(vec![removed(&[103, 999], Some("GPU"))]));
        assert_eq!(
            out.events,
            vec![KvEvent::Removed {
                blocks: vec![want[2]],
                tier: Tier::Device
            }]
        );
        assert_eq!(out.unknown_removed, 1);
        assert_eq!(t.len(), 2);
        assert_eq!(
            t.block_set(),
            vec![KvEvent::Stored {
                parent: None,
                blocks: want[..2].to_vec(),
                tier: Tier::Device
            }]
        );
    }

    #[test]
    fn an_unknown_parent_is_counted_not_placed() {
        let mut t = translator();
        let out = t.apply(&batch(vec![stored(&[5], Some(4), &tokens(4, 2), None)]));
        assert!(out.events.is_empty());
        assert_eq!(out.unknown_parents, 1);
        assert!(t.is_empty());
        // Its children cannot be placed either.
        let out = t.apply(&batch(vec![stored(&[6], Some(5), &tokens(4, 3), None)]));
        assert_eq!(out.unknown_parents, 1);
    }

    #[test]
    fn tiers_media_groups_and_clears() {
        let mut t = translator();
        let p = tokens(4, 1);
        let own = hasher().hash_prompt(&p)[0];
        let out = t.apply(&batch(vec![
            stored(&[1], None, &p, Some("GPU")),
            stored(&[1], None, &p, Some("CPU_PINNED")),
            stored(&[1], None, &p, Some("DISK")),
            stored(&[1], None, &p, Some("EXTERNAL")),
            removed(&[1], Some("GPU")),
        ]));
        assert_eq!(out.unknown_media, 1);
        let tiers: Vec<Tier> = out
            .events
            .iter()
            .filter_map(|e| match e {
                KvEvent::Stored { tier, .. } => Some(*tier),
                _ => None,
            })
            .collect();
        assert_eq!(tiers, vec![Tier::Device, Tier::Host, Tier::Disk]);
        assert_eq!(
            out.events.last(),
            Some(&KvEvent::Removed {
                blocks: vec![own],
                tier: Tier::Device
            })
        );
        assert_eq!(t.len(), 1, "still held on host and disk");

        // Another group's events are skipped.
        let mut other = stored(&[9], None, &tokens(4, 9), None);
        if let WireEvent::Stored(s) = &mut other {
            s.group_idx = Some(1);
        }
        assert_eq!(t.apply(&batch(vec![other])).other_groups, 1);

        let out = t.apply(&batch(vec![WireEvent::AllCleared]));
        assert_eq!(out.events, vec![KvEvent::Cleared]);
        assert!(t.is_empty() && t.block_set().is_empty());
    }

    #[test]
    fn a_wrong_block_size_is_fatal_and_bad_tokens_counted() {
        let mut t = translator();
        let mut e = stored(&[1], None, &tokens(16, 1), None);
        if let WireEvent::Stored(s) = &mut e {
            s.block_size = 16;
        }
        let out = t.apply(&batch(vec![e]));
        assert_eq!(
            out.fatal,
            Some(BlockSizeMismatch {
                engine: 16,
                deployment: BS
            })
        );
        let out = t.apply(&batch(vec![stored(&[1, 2], None, &tokens(5, 1), None)]));
        assert_eq!(out.token_mismatches, 1);
        assert!(out.events.is_empty());
    }

    #[test]
    fn partial_tails_of_another_size_are_skipped_once_the_deployments_size_was_seen() {
        // vLLM 0.33 with hash_block_size != block_size (hybrid models):
        // full blocks of the deployment's size, and a tail of another size,
        // in one batch and in either order.
        let mut tail = stored(&[9], Some(1), &tokens(2, 9), None);
        if let WireEvent::Stored(s) = &mut tail {
            s.block_size = 2;
        }
        let mut t = translator();
        let out = t.apply(&batch(vec![
            tail.clone(),
            stored(&[1], None, &tokens(BS, 1), None),
        ]));
        assert_eq!(out.fatal, None);
        assert_eq!(out.other_block_sizes, 1);
        assert_eq!(out.events.len(), 1, "{:?}", out.events);
        assert_eq!(t.len(), 1);
        // Later tails alone are skipped too.
        let out = t.apply(&batch(vec![tail]));
        assert_eq!((out.fatal, out.other_block_sizes), (None, 1));
        assert!(out.events.is_empty());
    }

    #[test]
    fn lora_salt_and_extra_keys_change_the_own_hash() {
        let p = tokens(4, 1);
        let plain = hasher().hash_prompt(&p)[0];
        let variants = [
            |s: &mut BlockStored| s.lora_name = Some("adapter".into()),
            |s: &mut BlockStored| s.cache_salt = Some("tenant".into()),
            |s: &mut BlockStored| s.extra_keys = Some(vec![Some(vec![0x91, 0x01])]),
        ];
        let mut seen = HashSet::from([plain]);
        for variant in variants {
            let mut t = translator();
            let mut e = stored(&[1], None, &p, None);
            if let WireEvent::Stored(s) = &mut e {
                variant(s);
            }
            t.apply(&batch(vec![e]));
            let own = t.own_hash(&h(1)).unwrap();
            assert!(seen.insert(own), "{own:?} collides");
        }
    }

    /// What an export may be made of: the leading blocks of a prompt the
    /// engine holds, salted as its events for that prompt are; none once
    /// the first is gone.
    #[test]
    fn the_held_prefix_is_the_leading_blocks_held_with_their_salt() {
        let mut t = translator();
        let p = tokens(12, 1);
        t.apply(&batch(vec![stored(&[1, 2, 3], None, &p, None)]));
        let mut longer = p.clone();
        longer.extend(tokens(6, 2));
        assert_eq!(t.held_prefix_blocks(&longer, None, None), 3);
        assert_eq!(t.held_prefix_blocks(&p[..7], None, None), 1, "whole blocks");
        assert_eq!(t.held_prefix_blocks(&tokens(12, 3), None, None), 0);
        assert_eq!(t.held_prefix_blocks(&p, Some("adapter"), None), 0);
        assert_eq!(t.held_prefix_blocks(&p, None, Some("tenant")), 0);
        t.apply(&batch(vec![removed(&[2], None)]));
        assert_eq!(t.held_prefix_blocks(&p, None, None), 1, "up to the gap");
        t.apply(&batch(vec![removed(&[1], None)]));
        assert_eq!(t.held_prefix_blocks(&p, None, None), 0);
        // A salted prompt's blocks, asked for with its salt.
        let mut salted = stored(&[7], None, &p[..4], None);
        if let WireEvent::Stored(s) = &mut salted {
            s.cache_salt = Some("tenant".into());
        }
        t.apply(&batch(vec![salted]));
        assert_eq!(t.held_prefix_blocks(&p, None, Some("tenant")), 1);
        assert_eq!(t.held_prefix_blocks(&p, None, None), 0);
    }

    #[test]
    fn duplicates_and_replays_emit_nothing_new() {
        let mut t = translator();
        let p = tokens(8, 1);
        let b = batch(vec![stored(&[1, 2], None, &p, None)]);
        assert_eq!(t.apply(&b).events.len(), 1);
        assert!(t.apply(&b).events.is_empty(), "already held");
        // A re-store of a prefix plus one new block: only the new one.
        let mut p3 = p.clone();
        p3.extend(tokens(4, 2));
        let out = t.apply(&batch(vec![stored(&[1, 2, 3], None, &p3, None)]));
        let want = hasher().hash_prompt(&p3);
        assert_eq!(
            out.events,
            vec![KvEvent::Stored {
                parent: Some(want[1]),
                blocks: vec![want[2]],
                tier: Tier::Device
            }]
        );
    }

    /// A model of an engine: random prompts stored as chains (sharing
    /// prefixes), random evictions of leaves, engine hashes that are a
    /// private function of the chain. Whatever the order, the translator's
    /// mirror holds exactly the canonical hashes of the engine's blocks.
    #[derive(Debug, Clone)]
    enum Op {
        Store { prompt: u8, blocks: u8 },
        EvictLeaf { pick: u16 },
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u8..6, 1u8..5).prop_map(|(prompt, blocks)| Op::Store { prompt, blocks }),
            3 => any::<u16>().prop_map(|pick| Op::EvictLeaf { pick }),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        #[test]
        fn the_mirror_tracks_the_engine(ops in proptest::collection::vec(op(), 1..60), salt in any::<u64>()) {
            let prompts: Vec<Vec<u32>> = (0..6u32)
                .map(|p| {
                    // Prompts share their first block in pairs.
                    let mut t = tokens(4, p / 2);
                    t.extend(tokens(16, 100 + p));
                    t
                })
                .collect();
            let engine_hash = |tokens: &[u32]| -> u64 {
                xxh3_64_with_seed(bytemuck_free(tokens).as_slice(), salt)
            };
            // The engine's cache: engine hash -> (tokens prefix length, parent).
            let mut cache: HashMap<u64, (Vec<u32>, Option<u64>)> = HashMap::new();
            let mut t = translator();
            for op in ops {
                let mut events = Vec::new();
                match op {
                    Op::Store { prompt, blocks } => {
                        let p = &prompts[prompt as usize];
                        let n = (blocks as usize).min(p.len() / BS as usize);
                        // The engine stores the blocks it does not hold.
                        let mut parent = None;
                        let mut new_hashes = Vec::new();
                        let mut new_tokens = Vec::new();
                        let mut new_parent = None;
                        for i in 0..n {
                            let prefix = &p[..(i + 1) * BS as usize];
                            let eh = engine_hash(prefix);
                            if let std::collections::hash_map::Entry::Vacant(slot) = cache.entry(eh) {
                                if new_hashes.is_empty() {
                                    new_parent = parent;
                                }
                                slot.insert((prefix.to_vec(), parent));
                                new_hashes.push(eh);
                                new_tokens.extend_from_slice(&prefix[i * BS as usize..]);
                            } else if !new_hashes.is_empty() {
                                break;
                            }
                            parent = Some(eh);
                        }
                        if !new_hashes.is_empty() {
                            events.push(stored(&new_hashes, new_parent, &new_tokens, None));
                        }
                    }
                    Op::EvictLeaf { pick } => {
                        let parents: HashSet<u64> = cache.values().filter_map(|(_, p)| *p).collect();
                        let mut leaves: Vec<u64> = cache.keys().copied().filter(|k| !parents.contains(k)).collect();
                        leaves.sort_unstable();
                        if !leaves.is_empty() {
                            let leaf = leaves[pick as usize % leaves.len()];
                            cache.remove(&leaf);
                            events.push(removed(&[leaf], None));
                        }
                    }
                    Op::Clear => {
                        cache.clear();
                        events.push(WireEvent::AllCleared);
                    }
                }
                let out = t.apply(&batch(events));
                prop_assert_eq!(out.unknown_parents, 0);
                prop_assert_eq!(out.unknown_removed, 0);
            }
            let want: HashSet<BlockHash> = cache
                .values()
                .map(|(prefix, _)| *hasher().hash_prompt(prefix).last().unwrap())
                .collect();
            let mut mirror = BlockMirror::new();
            mirror.apply(&t.block_set());
            prop_assert_eq!(mirror.len(), want.len());
            for hash in want {
                prop_assert!(mirror.contains(hash));
            }
        }
    }

    fn bytemuck_free(tokens: &[u32]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }
}
