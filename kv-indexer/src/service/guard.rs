//! Defence in depth at the indexer's door: what the bus's permissions
//! should already prevent, refused again here.
//!
//! - A batch whose epoch is further in the future than
//!   [`crate::service::Config::max_epoch_ahead`] is rejected (an agent's
//!   first epoch is its wall clock in milliseconds, raised above the
//!   worker's epochs recorded in etcd; a forged epoch of 2^62 would
//!   otherwise make every later real batch stale, for good).
//! - A worker whose cursor already holds such an epoch (accepted before
//!   this check, restored from a snapshot) is reset on its next batch.
//! - Workers whose batches are dropped as stale since their last applied
//!   one are *frozen*: listed in `/status` and counted in a gauge.
//!
//! Pure: the caller passes the clock.

use std::collections::BTreeMap;
use std::time::Duration;

use protocol::WorkerId;

/// The latest epoch a batch may carry at `now_ms`.
pub fn epoch_limit(now_ms: u64, max_ahead: Duration) -> u64 {
    now_ms.saturating_add(u64::try_from(max_ahead.as_millis()).unwrap_or(u64::MAX))
}

/// A worker dropping stale batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrozenWorker {
    /// The epoch the index holds for it.
    pub current_epoch: u64,
    /// The newest stale epoch its batches carried.
    pub batch_epoch: u64,
    /// Batches dropped since its last applied one.
    pub dropped: u64,
}

/// The frozen workers.
#[derive(Debug, Clone, Default)]
pub struct Frozen {
    workers: BTreeMap<WorkerId, FrozenWorker>,
}

impl Frozen {
    /// A batch of `worker` dropped as stale.
    pub fn stale(&mut self, worker: &WorkerId, batch_epoch: u64, current_epoch: u64) {
        let entry = self.workers.entry(worker.clone()).or_insert(FrozenWorker {
            current_epoch,
            batch_epoch,
            dropped: 0,
        });
        entry.current_epoch = current_epoch;
        entry.batch_epoch = entry.batch_epoch.max(batch_epoch);
        entry.dropped += 1;
    }

    /// A batch of `worker` moved its stream: it is not frozen.
    pub fn thawed(&mut self, worker: &WorkerId) {
        self.workers.remove(worker);
    }

    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&WorkerId, &FrozenWorker)> {
        self.workers.iter()
    }

    /// As `/status` shows them.
    pub fn to_json(&self) -> serde_json::Value {
        self.workers
            .iter()
            .map(|(w, f)| {
                (
                    w.to_string(),
                    serde_json::json!({
                        "current_epoch": f.current_epoch,
                        "batch_epoch": f.batch_epoch,
                        "dropped": f.dropped,
                    }),
                )
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_now_plus_the_bound() {
        assert_eq!(epoch_limit(1_000, Duration::from_secs(1)), 2_000);
        assert_eq!(epoch_limit(u64::MAX - 1, Duration::from_secs(1)), u64::MAX);
    }

    #[test]
    fn a_worker_is_frozen_until_a_batch_of_it_applies() {
        let w: WorkerId = "d0".parse().unwrap();
        let mut frozen = Frozen::default();
        frozen.stale(&w, 5, 9);
        frozen.stale(&w, 7, 9);
        assert_eq!(
            frozen.iter().next(),
            Some((
                &w,
                &FrozenWorker {
                    current_epoch: 9,
                    batch_epoch: 7,
                    dropped: 2
                }
            ))
        );
        assert_eq!(frozen.to_json()["d0"]["dropped"], 2);
        frozen.thawed(&w);
        assert!(frozen.is_empty());
    }
}
