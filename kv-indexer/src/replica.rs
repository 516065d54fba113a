//! A router's copy of the index, followed from the indexer's snapshot and
//! deltas. Pure: the caller brings the bytes in.

use protocol::{IndexChange, IndexDelta, IndexSnapshot};

use crate::index::{OwnershipIndex, RestoreError};

/// Why a delta was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeltaError {
    #[error("delta {got} is already applied (replica at {at})")]
    AlreadyApplied { at: u64, got: u64 },
    #[error("delta {got} skips ahead of the replica at {at}: deltas {} to {} are missing", at + 1, got - 1)]
    Gap { at: u64, got: u64 },
}

/// The index as of delta `applied`.
#[derive(Debug, Default)]
pub struct IndexReplica {
    index: OwnershipIndex,
    applied: u64,
}

impl IndexReplica {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn index(&self) -> &OwnershipIndex {
        &self.index
    }

    /// The last delta applied.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// Sizes the index for `blocks` blocks, also after a restore (see
    /// [`OwnershipIndex::reserve`]).
    pub fn reserve(&mut self, blocks: usize) {
        self.index.reserve(blocks);
    }

    /// Replaces the state with a snapshot's and checks its digest.
    pub fn restore(&mut self, snapshot: IndexSnapshot) -> Result<(), RestoreError> {
        let mut index = OwnershipIndex::new();
        index.reserve(self.index.reserved());
        index.import(snapshot.workers, snapshot.runs, snapshot.digest)?;
        self.index = index;
        self.applied = snapshot.delta_seq;
        Ok(())
    }

    /// Applies the next delta. Deltas must come in sequence: an old one is
    /// refused as already applied, a later one as a gap (restore from a
    /// snapshot, or fetch the missing deltas).
    pub fn apply(&mut self, delta: &IndexDelta) -> Result<(), DeltaError> {
        if delta.seq <= self.applied {
            return Err(DeltaError::AlreadyApplied {
                at: self.applied,
                got: delta.seq,
            });
        }
        if delta.seq > self.applied + 1 {
            return Err(DeltaError::Gap {
                at: self.applied,
                got: delta.seq,
            });
        }
        for change in &delta.changes {
            apply_change(&mut self.index, change);
        }
        self.applied = delta.seq;
        Ok(())
    }
}

/// Applies one canonical change to an index.
pub fn apply_change(index: &mut OwnershipIndex, change: &IndexChange) {
    match change {
        IndexChange::Stored {
            worker,
            parent,
            blocks,
            tier,
        } => index.store(worker, *parent, blocks, *tier),
        IndexChange::Removed {
            worker,
            blocks,
            tier,
        } => index.remove(worker, blocks, *tier),
        IndexChange::WorkerCleared { worker } => index.clear_worker(worker),
        IndexChange::WorkerRemoved { worker } => index.remove_worker(worker),
        IndexChange::Evicted { blocks } => index.evict_blocks(blocks),
    }
}
