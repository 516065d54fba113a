//! Helpers shared by the router's integration tests.
#![allow(dead_code)]

use std::collections::HashMap;

use kv_indexer::{KvIndexer, OwnershipIndex};
use protocol::{
    BlockHash, DecisionId, HashingContract, KvEvent, KvEventBatch, LoadReport, Role, RouteDecision,
    SessionId, Tier, WorkerId, WorkerRecord,
};
use rand::Rng;
use router::{
    Explanation, Policy, RouteError, RouteOptions, RouteRequest, Routed, RouterConfig, RouterCore,
};
pub use tests::tokens;

pub const BLOCK: u32 = 16;

pub fn contract() -> HashingContract {
    HashingContract::for_model("test-model", BLOCK)
}

pub fn id(name: &str) -> WorkerId {
    name.parse().unwrap()
}

pub fn record(name: &str, role: Role, capacity: u64) -> WorkerRecord {
    WorkerRecord {
        kv_capacity_blocks: capacity,
        kv_bytes_per_token: 163_840,
        gpus: 2,
        max_model_len: 0,
        ..tests::fixtures::registration(name, role, contract())
    }
}

pub fn core_with(config: RouterConfig, policy: impl Into<Policy>) -> RouterCore {
    RouterCore::new(config, policy).unwrap()
}

/// Routing a prompt of token ids as request "r": hashed with the core's
/// hasher, then [`RouterCore::route`] with its explanation.
pub trait RoutePrompt {
    fn route_prompt<R: Rng>(
        &mut self,
        prompt: &[u32],
        expected_output_tokens: u32,
        id: DecisionId,
        now_ms: u64,
        rng: &mut R,
    ) -> Result<Routed, RouteError>;
}

impl RoutePrompt for RouterCore {
    fn route_prompt<R: Rng>(
        &mut self,
        prompt: &[u32],
        expected_output_tokens: u32,
        id: DecisionId,
        now_ms: u64,
        rng: &mut R,
    ) -> Result<Routed, RouteError> {
        route_session_prompt(self, prompt, None, expected_output_tokens, id, now_ms, rng)
    }
}

/// [`RoutePrompt::route_prompt`] as a turn of `session` (none: outside
/// any).
pub fn route_session_prompt<R: Rng>(
    core: &mut RouterCore,
    prompt: &[u32],
    session: Option<&SessionId>,
    expected_output_tokens: u32,
    id: DecisionId,
    now_ms: u64,
    rng: &mut R,
) -> Result<Routed, RouteError> {
    let hashes = core.hasher().hash_prompt(prompt);
    let request = RouteRequest {
        request_id: "r",
        isl_tokens: prompt.len() as u32,
        block_hashes: &hashes,
        expected_output_tokens,
        session,
    };
    let options = RouteOptions {
        avoid: &[],
        explain: true,
    };
    core.route(&request, options, id, now_ms, rng)
}

/// A routed decision and its explanation.
pub fn explained(routed: Routed) -> (RouteDecision, Explanation) {
    (routed.decision, routed.explanation.unwrap_or_default())
}

pub fn report(worker: &str, active: u64, used: u64, total: u64, at_ms: u64) -> LoadReport {
    LoadReport {
        worker: id(worker),
        running: (active / 64) as u32,
        waiting: 0,
        queued_prefill_tokens: 0,
        active_decode_blocks: active,
        kv_blocks_used: used,
        kv_blocks_total: total,
        at_ms,
        recent_itl_us: 0,
    }
}

/// The real event pipeline: worker event batches through a `KvIndexer`,
/// its deltas applied to the router's replica.
pub struct Pipeline {
    pub indexer: KvIndexer,
    seqs: HashMap<WorkerId, u64>,
}

impl Default for Pipeline {
    fn default() -> Self {
        Self {
            indexer: KvIndexer::new(OwnershipIndex::new()),
            seqs: HashMap::new(),
        }
    }
}

impl Pipeline {
    /// `worker` now holds `hashes[from..]` (it held `hashes[..from]`).
    pub fn store(
        &mut self,
        core: &mut RouterCore,
        worker: &WorkerId,
        hashes: &[BlockHash],
        from: usize,
        tier: Tier,
    ) {
        if from >= hashes.len() {
            return;
        }
        let seq = self.seqs.entry(worker.clone()).or_insert(0);
        let batch = KvEventBatch {
            worker: worker.clone(),
            epoch: 1,
            seq: *seq,
            events: vec![KvEvent::Stored {
                parent: from.checked_sub(1).map(|i| hashes[i]),
                blocks: hashes[from..].to_vec(),
                tier,
            }],
        };
        *seq += 1;
        let outcome = self.indexer.apply(batch);
        if let Some(delta) = outcome.delta {
            core.apply_delta(&delta).unwrap();
        }
    }
}
