//! Index replication: canonical deltas and snapshots produced by the
//! kv-indexer and followed by router replicas.

use serde::{Deserialize, Serialize};

use crate::events::{Tier, TierSet};
use crate::ids::{BlockHash, WorkerId};

/// One canonical change to block ownership. Applying the same changes in the
/// same order gives the same index on every replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum IndexChange {
    Stored {
        worker: WorkerId,
        parent: Option<BlockHash>,
        blocks: Vec<BlockHash>,
        tier: Tier,
    },
    Removed {
        worker: WorkerId,
        blocks: Vec<BlockHash>,
        tier: Tier,
    },
    /// All of the worker's blocks are gone; the worker stays known.
    WorkerCleared { worker: WorkerId },
    /// The worker left (lease expired); its blocks are gone.
    WorkerRemoved { worker: WorkerId },
    /// The indexer's memory cap evicted these blocks from every owner.
    Evicted { blocks: Vec<BlockHash> },
}

/// Changes with their place in the indexer's global sequence (from 1,
/// without gaps). The delta stream is also the indexer's write-ahead log:
/// `source` names the worker batch a delta applied, so that an indexer
/// restarting from a snapshot and the deltas after it knows every worker's
/// stream position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexDelta {
    pub seq: u64,
    pub changes: Vec<IndexChange>,
    pub source: Option<WorkerCursor>,
}

/// Where the indexer stands with one worker's event stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerCursor {
    pub worker: WorkerId,
    pub epoch: u64,
    /// The last batch applied in this epoch.
    pub last_seq: u64,
    /// A gap was seen: batches of this epoch are ignored until the worker
    /// starts a new one.
    pub resync_pending: bool,
}

/// One owner of a run of blocks: an index into [`IndexSnapshot::workers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunOwner {
    pub worker: u32,
    pub tiers: TierSet,
}

/// Consecutive blocks (each the child of the one before) with the same
/// owners.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnedRun {
    pub blocks: Vec<BlockHash>,
    pub owners: Vec<RunOwner>,
}

/// The whole index at one point of the delta sequence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexSnapshot {
    /// The last delta whose changes are included.
    pub delta_seq: u64,
    /// Workers referred to by [`RunOwner::worker`].
    pub workers: Vec<WorkerId>,
    /// Per-worker event-stream positions (used by an indexer resuming).
    pub cursors: Vec<WorkerCursor>,
    pub runs: Vec<OwnedRun>,
    /// The index digest at `delta_seq`, to check a restore against.
    pub digest: u64,
}
