//! Periodic snapshots in the object store, and trimming the deltas they
//! cover.
//!
//! A snapshot is taken (copied out of the index) when due, but stored only
//! once every delta it covers is confirmed by the delta stream: a snapshot
//! must never get ahead of the log. After it is stored, the deltas it covers
//! are trimmed but for a margin of recent ones, for routers catching up.

use std::time::{Duration, Instant};

use bus::{Bus, BusError};
use protocol::{subjects, IndexSnapshot};

/// When the next snapshot is due. Time is an argument.
#[derive(Debug)]
pub struct SnapshotPolicy {
    interval: Duration,
    every_deltas: u64,
    /// The delta the last stored (or, while one is under way, taken)
    /// snapshot covers.
    last_seq: u64,
    last_at: Instant,
    /// After a failure, no new attempt before this.
    not_before: Instant,
    in_progress: bool,
}

impl SnapshotPolicy {
    /// `covered` is the delta the latest stored snapshot covers.
    pub fn new(interval: Duration, every_deltas: u64, covered: u64, now: Instant) -> Self {
        Self {
            interval,
            every_deltas: every_deltas.max(1),
            last_seq: covered,
            last_at: now,
            not_before: now,
            in_progress: false,
        }
    }

    /// Whether a snapshot should be taken at `delta_seq` now: the index
    /// changed since the last one, none is under way, and the interval
    /// elapsed or enough deltas accumulated.
    pub fn due(&self, delta_seq: u64, now: Instant) -> bool {
        !self.in_progress
            && now >= self.not_before
            && delta_seq > self.last_seq
            && (now.duration_since(self.last_at) >= self.interval
                || delta_seq - self.last_seq >= self.every_deltas)
    }

    pub fn started(&mut self) {
        self.in_progress = true;
    }

    /// The snapshot of `seq`, taken at `taken_at`, is stored.
    pub fn stored(&mut self, seq: u64, taken_at: Instant) {
        self.in_progress = false;
        self.last_seq = seq;
        self.last_at = taken_at;
    }

    /// Storing failed: try again after an interval.
    pub fn failed(&mut self, now: Instant) {
        self.in_progress = false;
        self.not_before = now + self.interval;
    }

    pub fn covered(&self) -> u64 {
        self.last_seq
    }

    /// Whether a snapshot is under way (taken, not yet stored).
    pub fn storing(&self) -> bool {
        self.in_progress
    }
}

/// A stored snapshot.
#[derive(Debug, Clone, Copy)]
pub struct Stored {
    pub seq: u64,
    /// Its size in the object store, when it could be read back.
    pub bytes: Option<usize>,
    /// Deltas up to this one are trimmed now.
    pub trimmed_to: u64,
    pub purged: u64,
}

/// Stores the snapshot as the latest one, then trims the deltas it covers
/// except the last `margin` (and none at or below `trimmed_to`, already
/// gone).
pub async fn store(
    bus: Bus,
    snapshot: IndexSnapshot,
    margin: u64,
    trimmed_to: u64,
) -> Result<Stored, BusError> {
    let seq = snapshot.delta_seq;
    bus.put_snapshot(&snapshot).await?;
    drop(snapshot);
    let bytes = match bus
        .jetstream()
        .get_object_store(subjects::SNAPSHOT_BUCKET)
        .await
    {
        Ok(store) => store
            .info(subjects::SNAPSHOT_LATEST)
            .await
            .ok()
            .map(|i| i.size),
        Err(_) => None,
    };
    let target = seq.saturating_sub(margin);
    let (trimmed_to, purged) = if target > trimmed_to {
        (target, bus.trim_deltas(target).await?)
    } else {
        (trimmed_to, 0)
    };
    Ok(Stored {
        seq,
        bytes,
        trimmed_to,
        purged,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_by_time_or_by_count_and_only_after_a_change() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut policy = SnapshotPolicy::new(s * 10, 100, 5, t0);
        assert!(!policy.due(5, t0 + s * 60), "nothing changed");
        assert!(!policy.due(6, t0 + s));
        assert!(policy.due(6, t0 + s * 10), "by time");
        assert!(policy.due(105, t0 + s), "by count");
        policy.started();
        assert!(!policy.due(500, t0 + s * 60), "one at a time");
        policy.stored(105, t0 + s);
        assert_eq!(policy.covered(), 105);
        assert!(!policy.due(106, t0 + s * 5));
        assert!(policy.due(106, t0 + s * 11));
        policy.started();
        policy.failed(t0 + s * 11);
        assert!(!policy.due(106, t0 + s * 12));
        assert!(!policy.due(500, t0 + s * 12), "no retry before an interval");
        assert!(policy.due(106, t0 + s * 21));
    }
}
