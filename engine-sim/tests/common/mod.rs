//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use engine_sim::{Engine, EngineConfig, EngineRequest, Mode, Preset, StepOutput};
use protocol::{BlockHash, KvEvent, Role, Tier, WorkerId};

/// The 8B preset's cost model on a small cache.
pub fn small_config(
    block_size: u32,
    capacity: u32,
    max_batched: u32,
    max_running: u32,
) -> EngineConfig {
    let mut cfg = Preset::llama8b_h100().engine_config(block_size);
    cfg.kv_capacity_blocks = capacity;
    cfg.max_batched_tokens = max_batched;
    cfg.max_running = max_running;
    cfg
}

pub fn worker() -> WorkerId {
    WorkerId::new("w", 0).unwrap()
}

pub fn engine(role: Role, cfg: EngineConfig) -> Engine {
    Engine::new(worker(), role, cfg).unwrap()
}

/// A request whose outputs are `1_000_000 + id * 1000 + k`.
pub fn req(id: u64, prompt: &[u32], outputs: u32, mode: Mode) -> EngineRequest {
    EngineRequest {
        id,
        prompt: Arc::from(prompt),
        output_tokens: (0..outputs)
            .map(|k| 1_000_000 + id as u32 * 1000 + k)
            .collect(),
        mode,
        pull_tokens: 0,
    }
}

/// `n` tokens starting at `start`.
pub fn tokens(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

/// Steps until idle (at most `max_steps`), returning every output with the
/// time it took effect, and the final time.
pub fn run_to_idle(
    engine: &mut Engine,
    mut now: u64,
    max_steps: usize,
) -> (Vec<(u64, StepOutput)>, u64) {
    let mut outs = Vec::new();
    for _ in 0..max_steps {
        let Some(step) = engine.step(now) else {
            return (outs, now);
        };
        now = step.end_us();
        outs.extend(step.outputs.into_iter().map(|o| (now, o)));
    }
    panic!("engine not idle after {max_steps} steps");
}

/// Rebuilds a worker's cache content, device and host tiers, from its
/// events, checking the stream's contract on the way.
#[derive(Debug, Default)]
pub struct Replay {
    pub blocks: HashSet<BlockHash>,
    /// Each block's parent, as the events said.
    parents: HashMap<BlockHash, Option<BlockHash>>,
    /// The host tier's blocks with their parents.
    pub host: HashMap<BlockHash, Option<BlockHash>>,
}

impl Replay {
    /// Applies events in order; panics on a contract violation.
    pub fn apply(&mut self, events: &[KvEvent]) {
        for ev in events {
            match ev {
                KvEvent::Cleared => {
                    self.blocks.clear();
                    self.parents.clear();
                    self.host.clear();
                }
                KvEvent::Stored {
                    parent,
                    blocks,
                    tier: Tier::Host,
                } => {
                    assert!(!blocks.is_empty());
                    if let Some(p) = parent {
                        assert!(
                            self.blocks.contains(p) || self.host.contains_key(p),
                            "stored on host under a parent on no tier"
                        );
                    }
                    let mut parent = *parent;
                    for b in blocks {
                        assert!(
                            self.host.insert(*b, parent).is_none(),
                            "block stored on host twice"
                        );
                        parent = Some(*b);
                    }
                }
                KvEvent::Removed {
                    blocks,
                    tier: Tier::Host,
                } => {
                    for b in blocks {
                        assert!(
                            self.host.remove(b).is_some(),
                            "removed an unknown host block"
                        );
                    }
                }
                KvEvent::Stored {
                    parent,
                    blocks,
                    tier,
                } => {
                    assert_eq!(*tier, Tier::Device);
                    assert!(!blocks.is_empty());
                    if let Some(p) = parent {
                        assert!(self.blocks.contains(p), "stored under an unknown parent");
                    }
                    let mut parent = *parent;
                    for b in blocks {
                        assert!(self.blocks.insert(*b), "block stored twice");
                        self.parents.insert(*b, parent);
                        parent = Some(*b);
                    }
                }
                KvEvent::Removed { blocks, tier } => {
                    assert_eq!(*tier, Tier::Device);
                    for b in blocks {
                        assert!(self.blocks.remove(b), "removed an unknown block");
                        self.parents.remove(b);
                    }
                }
            }
        }
    }

    /// Takes the engine's pending events and checks the replay matches its
    /// cache, parents included.
    pub fn sync(&mut self, engine: &mut Engine) {
        self.apply(&engine.take_kv_events());
        let cached: HashSet<BlockHash> = engine.cached_blocks().collect();
        assert_eq!(self.blocks, cached, "replayed events differ from the cache");
        let links: HashMap<BlockHash, Option<BlockHash>> = engine.cached_block_links().collect();
        assert_eq!(
            self.parents, links,
            "the cache's parents differ from the events'"
        );
        let host: HashMap<BlockHash, Option<BlockHash>> = engine.host_block_links().collect();
        assert_eq!(self.host, host, "replayed events differ from the host tier");
    }
}

/// Counts tokens (first + later) per request id.
pub fn tokens_of(outs: &[(u64, StepOutput)], id: u64) -> u32 {
    outs.iter()
        .filter(|(_, o)| {
            matches!(o, StepOutput::FirstToken { id: i, .. } | StepOutput::Token { id: i } if *i == id)
        })
        .count() as u32
}

/// When the request's first token took effect.
pub fn first_token_at(outs: &[(u64, StepOutput)], id: u64) -> Option<(u64, u32)> {
    outs.iter().find_map(|(t, o)| match o {
        StepOutput::FirstToken {
            id: i,
            cached_tokens,
        } if *i == id => Some((*t, *cached_tokens)),
        _ => None,
    })
}
