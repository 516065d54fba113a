//! Loading the index: the latest snapshot, restored off the event loop,
//! and the delta stream from the first delta after it.
//!
//! The event loop applies the deltas, and the indexer's announcements of
//! them ahead of the stream (`kv_indexer::LiveDeltas`). When the
//! stream has a gap (the deltas after the replica's position were trimmed,
//! or one was lost), the loop calls [`load`] again and swaps the fresh
//! replica in.

use bus::{Bus, BusError};
use futures::stream::BoxStream;
use kv_indexer::{IndexReplica, RestoreError};
use protocol::IndexDelta;

/// Why the index could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("restoring the index snapshot at delta {seq}: {error}")]
    Restore { seq: u64, error: RestoreError },
    #[error("the snapshot restore task failed: {0}")]
    Task(String),
}

/// A restored replica and the deltas that follow it.
pub struct LoadedIndex {
    pub replica: IndexReplica,
    /// Deltas from `replica.applied() + 1` on, then new ones forever.
    pub deltas: BoxStream<'static, Result<IndexDelta, BusError>>,
    /// The last delta in the stream when loading (catch up to it before
    /// being ready).
    pub head: u64,
    /// The snapshot's position (`None`: there was no snapshot; the replica
    /// starts empty at 0).
    pub snapshot_seq: Option<u64>,
}

impl std::fmt::Debug for LoadedIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedIndex")
            .field("applied", &self.replica.applied())
            .field("head", &self.head)
            .field("snapshot_seq", &self.snapshot_seq)
            .finish_non_exhaustive()
    }
}

/// Loads the latest snapshot (if any) into a replica sized for
/// `reserve_blocks` blocks, and opens the delta stream after it.
pub async fn load(bus: &Bus, reserve_blocks: usize) -> Result<LoadedIndex, LoadError> {
    let snapshot = bus.latest_snapshot().await?;
    let snapshot_seq = snapshot.as_ref().map(|s| s.delta_seq);
    let sized = move || {
        let mut replica = IndexReplica::new();
        replica.reserve(reserve_blocks);
        replica
    };
    let replica = match snapshot {
        None => sized(),
        Some(snapshot) => {
            let seq = snapshot.delta_seq;
            // Importing a large snapshot takes a while: not on a runtime thread.
            tokio::task::spawn_blocking(move || {
                let mut replica = sized();
                replica.restore(snapshot).map(|()| replica)
            })
            .await
            .map_err(|e| LoadError::Task(e.to_string()))?
            .map_err(|error| LoadError::Restore { seq, error })?
        }
    };
    let deltas = bus.deltas_from(replica.applied() + 1).await?;
    let head = bus.last_delta_seq().await?;
    Ok(LoadedIndex {
        replica,
        deltas,
        head,
        snapshot_seq,
    })
}
