//! A decision with everything it depended on, so that it can be replayed
//! and explained later. The log holds it compactly
//! ([`crate::decision_log`]: a writer turns a record into entries, a
//! reader entries back into the record).

use serde::{Deserialize, Serialize};

use crate::decision::RouteDecision;
use crate::ids::{BlockHash, SessionId, WorkerId};
use crate::registry::Role;

/// A decision and everything it depended on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionRecord {
    pub decision: RouteDecision,
    pub inputs: DecisionInputs,
}

/// Everything a decision depended on besides the index, which is rebuilt
/// from the delta log at `delta_seq` (and checked against `depth`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionInputs {
    /// The prompt's chained block hashes (not its tokens).
    pub block_hashes: Vec<BlockHash>,
    pub block_size: u32,
    pub expected_output_tokens: u32,
    /// The last index delta the router had applied.
    pub delta_seq: u64,
    /// Seed of the decision's random draws (tie breaks, softmax).
    pub seed: u64,
    /// Workers the decision was told to avoid (a retry).
    pub avoid: Vec<WorkerId>,
    /// The policy's parameters (its name is in the decision).
    pub policy_params: Vec<(String, f64)>,
    /// The router's selection and gate settings.
    pub router_params: Vec<(String, f64)>,
    /// Every worker the selection looked at.
    pub candidates: Vec<CandidateInput>,
    /// The policy's online calibration factors the decision used, by name
    /// (empty for a policy without calibration; absent in older records).
    #[serde(default)]
    pub calibration: Vec<(String, f64)>,
    /// The request's session and the binding the decision found (absent
    /// without a session id, and in older records).
    #[serde(default)]
    pub session: Option<SessionInput>,
}

/// A request's session as its decision saw it: replay restores `bound`
/// before re-deciding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInput {
    pub id: SessionId,
    /// The decode worker the session was bound to (live, not expired) when
    /// the decision was made; `None`: a first turn, or a binding released.
    pub bound: Option<WorkerId>,
}

/// One candidate worker as the decision saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CandidateInput {
    pub worker: WorkerId,
    pub role: Role,
    pub kv_capacity_blocks: u64,
    pub max_batched_tokens: u32,
    pub kv_bytes_per_token: u64,
    /// Leading prompt blocks it held: device, host-or-better, any tier.
    pub depth: [u32; 3],
    pub load: CandidateLoad,
    /// The legs it could serve (records before this field: every leg).
    #[serde(default)]
    pub capabilities: crate::Capabilities,
}

/// A candidate's effective load: its last report combined with the
/// in-flight ledger (see the router's `EffectiveLoad`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CandidateLoad {
    pub running: u32,
    pub waiting: u32,
    pub queued_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub kv_blocks_used: u64,
    /// What the last report alone said (the ledger not counted).
    pub reported_kv_blocks_used: u64,
    /// The last report's [`crate::LoadReport::recent_itl_us`] (absent in
    /// older records: 0, unknown).
    #[serde(default)]
    pub recent_itl_us: u32,
}

/// The indexer's position and digest, by request/reply (`INDEX_STATUS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexStatus {
    pub delta_seq: u64,
    pub digest: u64,
    pub blocks: u64,
    pub pairs: u64,
}
