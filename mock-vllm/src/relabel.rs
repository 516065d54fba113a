//! Canonical events re-expressed as a real engine would publish them.
//! Pure.
//!
//! engine-sim names blocks with Switchyard's canonical hashes; a real
//! engine names them with hashes of its own that nobody can recompute, and
//! publishes with each `BlockStored` the tokens of its blocks, the
//! parent's engine hash, the block size and the medium. The [`Relabeler`]
//! keeps the tokens of the blocks requests may store (registered when a
//! request is submitted: its prompt and its output), a map canonical hash
//! -> engine hash, and hashes blocks privately:
//!
//! - `vllm`: the low 64 bits of SHA-256 over a per-process random seed,
//!   the parent's hash and the block's tokens (vLLM seeds its hash per
//!   process unless `PYTHONHASHSEED` is set);
//! - `sglang`: SGLang's chain, SHA-256 over the parent's digest and the
//!   tokens as u32 little-endian, published as the signed i64 of the first
//!   8 digest bytes.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use protocol::{BlockHash, BlockHasher, KvEvent, TierSet};
use sha2::{Digest, Sha256};

use crate::wire::{EngineEvent, Flavour};

#[derive(Debug, Clone)]
struct Held {
    engine: u64,
    /// SGLang chains over whole digests.
    digest: [u8; 32],
    tiers: TierSet,
}

/// What went wrong relabeling (counted by the caller; never expected).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelabelErrors {
    /// Blocks whose tokens were never registered.
    pub unknown_tokens: u64,
    /// Stored events whose parent has no engine hash.
    pub unknown_parents: u64,
}

/// Canonical -> engine naming for one engine.
#[derive(Debug)]
pub struct Relabeler {
    hasher: BlockHasher,
    flavour: Flavour,
    seed: u64,
    /// Tokens of each block a request may store, by canonical hash.
    tokens: HashMap<BlockHash, Arc<[u32]>>,
    /// The latest registrations, oldest first, to bound `tokens`: a
    /// block's tokens are kept while it is held or among them.
    registered: VecDeque<BlockHash>,
    /// How often each block is in `registered`.
    registrations: HashMap<BlockHash, u32>,
    max_tokens_entries: usize,
    held: HashMap<BlockHash, Held>,
    pub errors: RelabelErrors,
}

impl Relabeler {
    /// `hasher`: the engine model's canonical hasher (engine-sim's);
    /// `seed`: the vLLM flavour's per-process seed; the token store keeps
    /// at least `max_tokens_entries` registrations besides held blocks.
    pub fn new(
        hasher: BlockHasher,
        flavour: Flavour,
        seed: u64,
        max_tokens_entries: usize,
    ) -> Self {
        Self {
            hasher,
            flavour,
            seed,
            tokens: HashMap::new(),
            registered: VecDeque::new(),
            registrations: HashMap::new(),
            max_tokens_entries: max_tokens_entries.max(1),
            held: HashMap::new(),
            errors: RelabelErrors::default(),
        }
    }

    /// Remembers the tokens of every full block of `tokens` (a request's
    /// prompt, then its output), before the engine may store them.
    pub fn register(&mut self, tokens: &[u32]) {
        let bs = self.hasher.block_size() as usize;
        let mut parent = None;
        for block in tokens.chunks_exact(bs) {
            let hash = BlockHasher::chain(parent, self.hasher.content_hash(block));
            parent = Some(hash);
            self.tokens.entry(hash).or_insert_with(|| Arc::from(block));
            self.registered.push_back(hash);
            *self.registrations.entry(hash).or_insert(0) += 1;
        }
        while self.registered.len() > self.max_tokens_entries {
            let Some(old) = self.registered.pop_front() else {
                break;
            };
            if let Some(n) = self.registrations.get_mut(&old) {
                *n -= 1;
                if *n == 0 {
                    self.registrations.remove(&old);
                    if !self.held.contains_key(&old) {
                        self.tokens.remove(&old);
                    }
                }
            }
        }
    }

    fn engine_hash(&self, parent: Option<&Held>, tokens: &[u32]) -> ([u8; 32], u64) {
        let mut h = Sha256::new();
        match self.flavour {
            Flavour::Vllm => {
                h.update(self.seed.to_le_bytes());
                h.update(parent.map_or(0, |p| p.engine).to_le_bytes());
            }
            Flavour::Sglang => {
                if let Some(p) = parent {
                    h.update(p.digest);
                }
            }
        }
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        let digest: [u8; 32] = h.finalize().into();
        let value = match self.flavour {
            Flavour::Vllm => u64::from_le_bytes(digest[24..].try_into().expect("8 bytes")),
            Flavour::Sglang => i64::from_be_bytes(digest[..8].try_into().expect("8 bytes")) as u64,
        };
        (digest, value)
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The engine events for engine-sim's canonical events.
    pub fn relabel(&mut self, events: &[KvEvent]) -> Vec<EngineEvent> {
        let bs = self.hasher.block_size();
        let mut out = Vec::new();
        for event in events {
            match event {
                KvEvent::Stored {
                    parent,
                    blocks,
                    tier,
                } => {
                    let mut parent_held = match parent {
                        None => None,
                        Some(p) => match self.held.get(p) {
                            Some(h) => Some(h.clone()),
                            None => {
                                self.errors.unknown_parents += 1;
                                continue;
                            }
                        },
                    };
                    let first_parent = parent_held.as_ref().map(|h| h.engine);
                    let mut hashes = Vec::with_capacity(blocks.len());
                    let mut tokens = Vec::with_capacity(blocks.len() * bs as usize);
                    for block in blocks {
                        let Some(block_tokens) = self.tokens.get(block).cloned() else {
                            self.errors.unknown_tokens += 1;
                            break;
                        };
                        let (digest, engine) =
                            self.engine_hash(parent_held.as_ref(), &block_tokens);
                        let held = self.held.entry(*block).or_insert(Held {
                            engine,
                            digest,
                            tiers: TierSet::EMPTY,
                        });
                        held.tiers = held.tiers.with(*tier);
                        let held = held.clone();
                        hashes.push(held.engine);
                        tokens.extend_from_slice(&block_tokens);
                        parent_held = Some(held);
                    }
                    if !hashes.is_empty() {
                        out.push(EngineEvent::Stored {
                            hashes,
                            parent: first_parent,
                            tokens,
                            block_size: bs,
                            tier: *tier,
                        });
                    }
                }
                KvEvent::Removed { blocks, tier } => {
                    let mut hashes = Vec::with_capacity(blocks.len());
                    for block in blocks {
                        if let Some(held) = self.held.get_mut(block) {
                            hashes.push(held.engine);
                            held.tiers = held.tiers.without(*tier);
                            if held.tiers.is_empty() {
                                self.held.remove(block);
                                if !self.registrations.contains_key(block) {
                                    self.tokens.remove(block);
                                }
                            }
                        }
                    }
                    if !hashes.is_empty() {
                        out.push(EngineEvent::Removed {
                            hashes,
                            tier: *tier,
                        });
                    }
                }
                KvEvent::Cleared => {
                    self.held.clear();
                    let registrations = &self.registrations;
                    self.tokens.retain(|h, _| registrations.contains_key(h));
                    out.push(EngineEvent::AllCleared);
                }
            }
        }
        out
    }

    /// The engine hash of a canonical block, when held.
    pub fn engine_hash_of(&self, block: BlockHash) -> Option<u64> {
        self.held.get(&block).map(|h| h.engine)
    }
}

#[cfg(test)]
mod tests {
    use protocol::{HashSalt, Tier};
    use worker_agent::vllm::translate::Translator;
    use worker_agent::vllm::wire::decode_batch;

    use super::*;
    use crate::wire::{encode_batch, Encoding};

    const BS: u32 = 4;

    fn engine_hasher() -> BlockHasher {
        // engine-sim hashes with the preset's model...
        BlockHasher::new(BS, HashSalt::new("engine-model", None, None)).unwrap()
    }

    fn deployment_hasher() -> BlockHasher {
        // ...the agent with the deployment's (here another salt: the
        // translation recomputes from tokens, whatever the engine's names).
        BlockHasher::new(BS, HashSalt::new("served-model", None, None)).unwrap()
    }

    /// engine-sim's canonical events, relabeled, encoded, decoded and
    /// translated by the agent, give the agent's canonical hashes of the
    /// same tokens; the engine hashes are not those.
    #[test]
    fn the_agent_recovers_canonical_hashes_from_the_relabeled_stream() {
        let prompt: Vec<u32> = (0..14).collect();
        let canon = engine_hasher().hash_prompt(&prompt);
        for flavour in [Flavour::Vllm, Flavour::Sglang] {
            for encoding in [Encoding::Array, Encoding::Map, Encoding::Tagged] {
                let mut r = Relabeler::new(engine_hasher(), flavour, 42, 100);
                r.register(&prompt);
                let events = r.relabel(&[
                    KvEvent::Stored {
                        parent: None,
                        blocks: canon[..2].to_vec(),
                        tier: Tier::Device,
                    },
                    KvEvent::Stored {
                        parent: Some(canon[1]),
                        blocks: vec![canon[2]],
                        tier: Tier::Device,
                    },
                    KvEvent::Removed {
                        blocks: vec![canon[2]],
                        tier: Tier::Device,
                    },
                ]);
                assert_eq!(r.errors, RelabelErrors::default());
                let engine_hashes: Vec<u64> =
                    canon.iter().filter_map(|c| r.engine_hash_of(*c)).collect();
                assert_eq!(engine_hashes.len(), 2);
                for (e, c) in engine_hashes.iter().zip(&canon) {
                    assert_ne!(*e, c.0, "engine hashes are private");
                }
                let bytes = encode_batch(0.0, &events, 0, encoding, flavour);
                let mut t = Translator::new("served-model", deployment_hasher());
                let out = t.apply(&decode_batch(&bytes).unwrap());
                assert_eq!(out.unknown_parents, 0);
                assert_eq!(out.unknown_removed, 0);
                let want = deployment_hasher().hash_prompt(&prompt);
                assert!(t.mirror().contains(want[0]) && t.mirror().contains(want[1]));
                assert!(!t.mirror().contains(want[2]));
                assert_eq!(t.mirror().len(), 2);
            }
        }
    }

    #[test]
    fn seeds_and_flavours_name_blocks_differently() {
        let prompt: Vec<u32> = (0..4).collect();
        let canon = engine_hasher().hash_prompt(&prompt);
        let name = |flavour, seed| {
            let mut r = Relabeler::new(engine_hasher(), flavour, seed, 10);
            r.register(&prompt);
            r.relabel(&[KvEvent::Stored {
                parent: None,
                blocks: canon.clone(),
                tier: Tier::Device,
            }]);
            r.engine_hash_of(canon[0]).unwrap()
        };
        assert_ne!(name(Flavour::Vllm, 1), name(Flavour::Vllm, 2));
        assert_eq!(
            name(Flavour::Sglang, 1),
            name(Flavour::Sglang, 2),
            "SGLang's chain is unseeded"
        );
        assert_ne!(name(Flavour::Vllm, 1), name(Flavour::Sglang, 1));
    }

    #[test]
    fn unregistered_tokens_are_counted_and_the_store_is_bounded() {
        let mut r = Relabeler::new(engine_hasher(), Flavour::Vllm, 0, 3);
        let out = r.relabel(&[KvEvent::Stored {
            parent: None,
            blocks: vec![BlockHash(1)],
            tier: Tier::Device,
        }]);
        assert!(out.is_empty());
        assert_eq!(r.errors.unknown_tokens, 1);
        for seed in 0..10u32 {
            r.register(&[seed, 1, 2, 3, seed, 5, 6, 7]);
        }
        assert!(r.tokens.len() <= 3, "{}", r.tokens.len());
    }
}
