//! Startup: the indexer's state is the latest snapshot plus the deltas
//! published after it (the delta stream is the write-ahead log).

use std::time::Duration;

use bus::{Bus, BusError};
use futures::StreamExt;

use crate::index::{OwnershipIndex, RestoreError};
use crate::indexer::KvIndexer;
use crate::replica::DeltaError;

/// A delta feed that gives nothing for this long while the log holds more
/// is opened again from where the replay is ([`FEED_REOPENS`] times, then
/// [`RecoveryError::LogTimeout`], retryable: the recovery is tried again).
/// Seen in the chaos suite: a standby elected after the full-store fault,
/// whose delta feed (its stream's leader just elected) gave nothing for
/// 30 s, the old bound. A live feed gives the next delta in milliseconds.
const DELTA_READ_TIMEOUT: Duration = Duration::from_secs(2);
/// How many times in a row a standing feed is opened again from where the
/// replay is before the recovery gives up (and is tried again from the
/// start).
const FEED_REOPENS: u32 = 5;

/// Why the state could not be recovered.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("the latest snapshot does not restore: {0}")]
    Restore(#[from] RestoreError),
    #[error(
        "the latest snapshot covers delta {snapshot} but the delta stream ends at {last}: \
         the delta stream was lost or reset"
    )]
    SnapshotAhead { snapshot: u64, last: u64 },
    #[error("replaying the delta log: {0} (were deltas trimmed past the latest snapshot?)")]
    Replay(#[from] DeltaError),
    #[error("the delta log ended at {at}, before its last delta {last}")]
    LogEnded { at: u64, last: u64 },
    #[error("no delta after {at} within {DELTA_READ_TIMEOUT:?} (the log ends at {last})")]
    LogTimeout { at: u64, last: u64 },
}

impl RecoveryError {
    /// Whether recovering again may succeed: JetStream did not answer (a
    /// stream's or the snapshot store's leader being elected after a NATS
    /// node's death), or the delta log's read stalled. A snapshot that
    /// does not restore, or a log that does not continue it, stays so.
    pub fn retryable(&self) -> bool {
        match self {
            RecoveryError::Bus(e) => e.is_unanswered(),
            RecoveryError::LogTimeout { .. } => true,
            _ => false,
        }
    }
}

/// The recovered state.
#[derive(Debug)]
pub struct Recovered {
    pub indexer: KvIndexer,
    /// The delta the snapshot covered (0 without one).
    pub snapshot_seq: u64,
    /// Deltas replayed after the snapshot.
    pub replayed: u64,
}

/// Loads the latest snapshot into `index` (or starts from it empty), then
/// replays the published deltas after the snapshot up to the last one.
pub async fn recover(bus: &Bus, index: OwnershipIndex) -> Result<Recovered, RecoveryError> {
    let snapshot = bus.latest_snapshot().await?;
    let last = bus.last_delta_seq().await?;
    let mut indexer = match snapshot {
        Some(snapshot) if snapshot.delta_seq > last => {
            return Err(RecoveryError::SnapshotAhead {
                snapshot: snapshot.delta_seq,
                last,
            })
        }
        Some(snapshot) => KvIndexer::restore(index, snapshot)?,
        None => KvIndexer::new(index),
    };
    let snapshot_seq = indexer.delta_seq();
    if snapshot_seq < last {
        // The consumer follows the stream forever: stop at `last`.
        let mut deltas = bus.deltas_from(snapshot_seq + 1).await?;
        let mut reopened = 0;
        while indexer.delta_seq() < last {
            let at = indexer.delta_seq();
            let delta = match tokio::time::timeout(DELTA_READ_TIMEOUT, deltas.next()).await {
                Ok(Some(delta)) => delta?,
                Ok(None) => return Err(RecoveryError::LogEnded { at, last }),
                // A feed standing still: a new one from here, keeping what
                // was replayed.
                Err(_) if reopened < FEED_REOPENS => {
                    reopened += 1;
                    tracing::warn!(at, last, reopened, "the delta log's feed gave nothing for {DELTA_READ_TIMEOUT:?}; opening it again from here");
                    deltas = bus.deltas_from(at + 1).await?;
                    continue;
                }
                Err(_) => return Err(RecoveryError::LogTimeout { at, last }),
            };
            indexer.replay(&delta)?;
            reopened = 0;
        }
    }
    Ok(Recovered {
        replayed: indexer.delta_seq() - snapshot_seq,
        indexer,
        snapshot_seq,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unanswered_store_or_a_stalled_log_is_recovered_again_a_broken_one_is_not() {
        let snapshot_timeout = RecoveryError::Bus(BusError::Snapshot {
            bucket: "sy-index-snapshots",
            message: "timed out".into(),
        });
        assert!(snapshot_timeout.retryable());
        assert!(RecoveryError::LogTimeout { at: 3, last: 9 }.retryable());
        assert!(!RecoveryError::SnapshotAhead {
            snapshot: 9,
            last: 3
        }
        .retryable());
        assert!(!RecoveryError::LogEnded { at: 3, last: 9 }.retryable());
        let fenced = RecoveryError::Bus(BusError::Fenced { seq: 4 });
        assert!(!fenced.retryable());
    }
}
