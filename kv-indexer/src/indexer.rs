//! Sequencing of the workers' event streams into canonical deltas: the pure
//! core of the kv-indexer service.
//!
//! Each worker numbers its batches per epoch from 0 without gaps. The
//! indexer applies a batch only in order; a duplicate is dropped, a gap puts
//! the worker on hold until it resynchronises (a new epoch whose first
//! batch is `Cleared` followed by its whole block set), and a new epoch
//! drops the worker's old blocks first. What was applied comes out as an
//! [`IndexDelta`] with the next global sequence number, which router
//! replicas apply in order to reach exactly the same index.

use std::collections::BTreeMap;

use protocol::{
    IndexChange, IndexDelta, IndexSnapshot, KvEvent, KvEventBatch, WorkerCursor, WorkerId,
};

use crate::index::{OwnershipIndex, RestoreError};
use crate::replica::{apply_change, DeltaError};

/// What happened to one batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchStatus {
    /// Applied in order.
    Applied,
    /// The first batch of a newer epoch: the worker's old blocks were
    /// dropped, then the batch applied.
    NewEpoch { previous: Option<u64> },
    /// Already applied (seq at or below the last one); dropped.
    Duplicate { last_seq: u64 },
    /// Batches are missing before this one: the worker must resynchronise.
    /// Its batches of this epoch are ignored until it does.
    Gap { expected: u64, got: u64 },
    /// The worker is waiting to resynchronise; dropped.
    AwaitingResync,
    /// From an epoch older than the current one (a previous instance's late
    /// batch); dropped.
    StaleEpoch { current: u64 },
}

impl BatchStatus {
    /// Whether the worker must be asked to resynchronise.
    pub fn needs_resync(&self) -> bool {
        matches!(self, BatchStatus::Gap { .. })
    }

    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            BatchStatus::Applied => "applied",
            BatchStatus::NewEpoch { .. } => "new_epoch",
            BatchStatus::Duplicate { .. } => "duplicate",
            BatchStatus::Gap { .. } => "gap",
            BatchStatus::AwaitingResync => "awaiting_resync",
            BatchStatus::StaleEpoch { .. } => "stale_epoch",
        }
    }
}

/// The outcome of one batch: its status, and the delta to publish (if the
/// index changed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchOutcome {
    pub status: BatchStatus,
    pub delta: Option<IndexDelta>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cursor {
    epoch: u64,
    last_seq: u64,
    resync_pending: bool,
}

impl Cursor {
    fn from_wire(c: &WorkerCursor) -> Self {
        Self {
            epoch: c.epoch,
            last_seq: c.last_seq,
            resync_pending: c.resync_pending,
        }
    }

    fn to_wire(self, worker: &WorkerId) -> WorkerCursor {
        WorkerCursor {
            worker: worker.clone(),
            epoch: self.epoch,
            last_seq: self.last_seq,
            resync_pending: self.resync_pending,
        }
    }
}

/// The index plus every worker's stream position and the global delta
/// sequence.
#[derive(Debug)]
pub struct KvIndexer {
    index: OwnershipIndex,
    cursors: BTreeMap<WorkerId, Cursor>,
    /// The last delta produced.
    delta_seq: u64,
}

impl KvIndexer {
    pub fn new(index: OwnershipIndex) -> Self {
        Self {
            index,
            cursors: BTreeMap::new(),
            delta_seq: 0,
        }
    }

    pub fn index(&self) -> &OwnershipIndex {
        &self.index
    }

    /// The last delta sequence produced (0 before the first).
    pub fn delta_seq(&self) -> u64 {
        self.delta_seq
    }

    /// The epoch the index holds for `worker`, if it knows its stream.
    pub fn cursor_epoch(&self, worker: &WorkerId) -> Option<u64> {
        self.cursors.get(worker).map(|c| c.epoch)
    }

    /// The seq [`KvIndexer::apply`] would apply next in `worker`'s current
    /// epoch `epoch`: `None` when the index does not know the worker, holds
    /// another epoch of it, or waits for its resync. (An announced batch is
    /// applied ahead of the stream only when it is this one; a later one
    /// shows announcements were missed; anything else, a new epoch
    /// included, is left to the stream's order.)
    pub fn next_seq(&self, worker: &WorkerId, epoch: u64) -> Option<u64> {
        self.cursors
            .get(worker)
            .filter(|c| c.epoch == epoch && !c.resync_pending)
            .map(|c| c.last_seq + 1)
    }

    /// Workers whose streams are known, with their positions.
    pub fn cursors(&self) -> impl Iterator<Item = WorkerCursor> + '_ {
        self.cursors.iter().map(|(worker, c)| c.to_wire(worker))
    }

    /// Applies one worker batch; see [`BatchStatus`].
    pub fn apply(&mut self, batch: KvEventBatch) -> BatchOutcome {
        let (status, epoch_changed) = self.admit(&batch);
        let mut changes = Vec::new();
        if epoch_changed && self.index.worker_blocks(&batch.worker) > 0 {
            // The previous epoch's blocks are stale, whether or not this
            // batch can be applied.
            self.index.clear_worker(&batch.worker);
            changes.push(IndexChange::WorkerCleared {
                worker: batch.worker.clone(),
            });
        }
        if matches!(status, BatchStatus::Applied | BatchStatus::NewEpoch { .. }) {
            for event in batch.events {
                changes.push(self.apply_event(&batch.worker, event));
            }
        }
        let evicted = self.index.evict_to_cap();
        if !evicted.is_empty() {
            changes.push(IndexChange::Evicted { blocks: evicted });
        }
        // Every batch that moved the worker's cursor is logged, changes or
        // not, so that replaying the deltas restores the cursors too.
        let moved = matches!(
            status,
            BatchStatus::Applied | BatchStatus::NewEpoch { .. } | BatchStatus::Gap { .. }
        );
        let delta = if moved || !changes.is_empty() {
            let source = self.cursor(&batch.worker);
            Some(self.seal(changes, source))
        } else {
            None
        };
        BatchOutcome { status, delta }
    }

    fn cursor(&self, worker: &WorkerId) -> Option<WorkerCursor> {
        self.cursors.get(worker).map(|c| c.to_wire(worker))
    }

    /// Decides what to do with a batch and moves the worker's cursor; also
    /// says whether the batch moved a known worker to a newer epoch.
    fn admit(&mut self, batch: &KvEventBatch) -> (BatchStatus, bool) {
        let fresh = Cursor {
            epoch: batch.epoch,
            last_seq: batch.seq,
            resync_pending: batch.seq != 0,
        };
        let gap = BatchStatus::Gap {
            expected: 0,
            got: batch.seq,
        };
        let Some(cursor) = self.cursors.get_mut(&batch.worker) else {
            self.cursors.insert(batch.worker.clone(), fresh);
            return match batch.seq {
                0 => (BatchStatus::NewEpoch { previous: None }, false),
                _ => (gap, false),
            };
        };
        if batch.epoch > cursor.epoch {
            let previous = Some(cursor.epoch);
            *cursor = fresh;
            return match batch.seq {
                0 => (BatchStatus::NewEpoch { previous }, true),
                _ => (gap, true),
            };
        }
        let status = if batch.epoch < cursor.epoch {
            BatchStatus::StaleEpoch {
                current: cursor.epoch,
            }
        } else if cursor.resync_pending {
            BatchStatus::AwaitingResync
        } else if batch.seq <= cursor.last_seq {
            BatchStatus::Duplicate {
                last_seq: cursor.last_seq,
            }
        } else if batch.seq > cursor.last_seq + 1 {
            cursor.resync_pending = true;
            BatchStatus::Gap {
                expected: cursor.last_seq + 1,
                got: batch.seq,
            }
        } else {
            cursor.last_seq = batch.seq;
            BatchStatus::Applied
        };
        (status, false)
    }

    fn apply_event(&mut self, worker: &WorkerId, event: KvEvent) -> IndexChange {
        match event {
            KvEvent::Stored {
                parent,
                blocks,
                tier,
            } => {
                self.index.store(worker, parent, &blocks, tier);
                IndexChange::Stored {
                    worker: worker.clone(),
                    parent,
                    blocks,
                    tier,
                }
            }
            KvEvent::Removed { blocks, tier } => {
                self.index.remove(worker, &blocks, tier);
                IndexChange::Removed {
                    worker: worker.clone(),
                    blocks,
                    tier,
                }
            }
            KvEvent::Cleared => {
                self.index.clear_worker(worker);
                IndexChange::WorkerCleared {
                    worker: worker.clone(),
                }
            }
        }
    }

    /// The worker left (its lease expired): its blocks and its stream
    /// position are dropped.
    pub fn remove_worker(&mut self, worker: &WorkerId) -> Option<IndexDelta> {
        let known = self.cursors.remove(worker).is_some() | self.index.slot(worker).is_some();
        if !known {
            return None;
        }
        self.index.remove_worker(worker);
        let change = IndexChange::WorkerRemoved {
            worker: worker.clone(),
        };
        Some(self.seal(vec![change], None))
    }

    fn seal(&mut self, changes: Vec<IndexChange>, source: Option<WorkerCursor>) -> IndexDelta {
        self.delta_seq += 1;
        IndexDelta {
            seq: self.delta_seq,
            changes,
            source,
        }
    }

    /// Re-applies a delta this indexer published earlier (its write-ahead
    /// log), after [`KvIndexer::restore`] from an older snapshot: the index
    /// changes and the source worker's cursor.
    pub fn replay(&mut self, delta: &IndexDelta) -> Result<(), DeltaError> {
        if delta.seq <= self.delta_seq {
            return Err(DeltaError::AlreadyApplied {
                at: self.delta_seq,
                got: delta.seq,
            });
        }
        if delta.seq > self.delta_seq + 1 {
            return Err(DeltaError::Gap {
                at: self.delta_seq,
                got: delta.seq,
            });
        }
        for change in &delta.changes {
            apply_change(&mut self.index, change);
            if let IndexChange::WorkerRemoved { worker } = change {
                self.cursors.remove(worker);
            }
        }
        if let Some(c) = &delta.source {
            self.cursors.insert(c.worker.clone(), Cursor::from_wire(c));
        }
        self.delta_seq = delta.seq;
        Ok(())
    }

    /// The whole state, at the current delta sequence.
    pub fn snapshot(&self) -> IndexSnapshot {
        let (workers, runs) = self.index.export();
        IndexSnapshot {
            delta_seq: self.delta_seq,
            workers,
            cursors: self.cursors().collect(),
            runs,
            digest: self.index.digest(),
        }
    }

    /// Resumes from a snapshot, into `index` (which keeps its settings:
    /// memory cap and reservation).
    pub fn restore(
        mut index: OwnershipIndex,
        snapshot: IndexSnapshot,
    ) -> Result<Self, RestoreError> {
        let IndexSnapshot {
            delta_seq,
            workers,
            cursors,
            runs,
            digest,
        } = snapshot;
        index.import(workers, runs, digest)?;
        let cursors = cursors
            .iter()
            .map(|c| (c.worker.clone(), Cursor::from_wire(c)))
            .collect();
        Ok(Self {
            index,
            cursors,
            delta_seq,
        })
    }
}
