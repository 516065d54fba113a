//! The KV outbox: numbers the engine's events into [`KvEventBatch`]es and
//! holds them until JetStream acknowledges them. Pure: no IO, no clock
//! ([`super::KvCore`] drives it: when to form batches, publishing,
//! retries, resyncs).
//!
//! - Within an epoch, `seq` counts from 0 without gaps. A batch, once
//!   formed, never changes: it is announced as it is, and published again
//!   unchanged until acknowledged (the same message id, so that a batch
//!   that did land is dropped as a duplicate). Formed batches are
//!   published in order, the front one first: never skipped, never
//!   reordered.
//! - Every epoch's first batch starts with [`KvEvent::Cleared`]; a resync's
//!   first batch also holds the whole block set.
//! - Events wait in a bounded queue while NATS does not acknowledge. When
//!   it overflows, the queue is dropped and the outbox refuses events until
//!   the service starts a new epoch from the engine's block set: the honest
//!   recovery, never a silent gap.

use std::collections::VecDeque;

use protocol::{KvEvent, KvEventBatch, WorkerId};

/// Bounds of the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxLimits {
    /// Events queued behind the batch being published (unformed, or in
    /// batches formed behind it) before the outbox overflows. (The batch
    /// being published is bounded on its own: by `max_batch_events`, or by
    /// the block set for a resync's first batch; counting it here would
    /// make a large block set overflow at once.)
    pub max_queued_events: usize,
    /// Most events in one batch (a resync's first batch excepted).
    pub max_batch_events: usize,
}

impl Default for OutboxLimits {
    /// The agent's defaults (`--kv-queue-events`, `--kv-batch-events`).
    fn default() -> Self {
        Self {
            max_queued_events: 65_536,
            max_batch_events: 256,
        }
    }
}

/// What became of events given to [`KvOutbox::push`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Held for publishing.
    Queued,
    /// The queue overflowed just now: everything held was dropped; start a
    /// new epoch from the engine's block set.
    Overflowed,
    /// Dropped: the outbox overflowed earlier and waits for the new epoch
    /// (whose block set covers these events).
    AwaitingResync,
}

/// A new epoch must be greater than the current one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("new epoch {requested} is not greater than the current epoch {current}")]
pub struct StaleEpoch {
    /// The outbox's epoch.
    pub current: u64,
    /// The epoch asked for.
    pub requested: u64,
}

/// One worker's KV batches on their way to JetStream.
#[derive(Debug)]
pub struct KvOutbox {
    worker: WorkerId,
    limits: OutboxLimits,
    epoch: u64,
    next_seq: u64,
    /// Events not yet in a batch.
    pending: VecDeque<KvEvent>,
    /// Batches formed, not acknowledged, in order: the front one is being
    /// published.
    formed: VecDeque<KvEventBatch>,
    /// Events in the formed batches behind the front one.
    formed_behind: usize,
    overflowed: bool,
}

impl KvOutbox {
    /// An outbox starting `epoch`; its first batch starts with `Cleared`.
    pub fn new(worker: WorkerId, epoch: u64, limits: OutboxLimits) -> Self {
        Self {
            worker,
            limits,
            epoch,
            next_seq: 0,
            pending: VecDeque::from([KvEvent::Cleared]),
            formed: VecDeque::new(),
            formed_behind: 0,
            overflowed: false,
        }
    }

    /// The worker whose batches these are.
    pub fn worker(&self) -> &WorkerId {
        &self.worker
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Events held: queued and in the unacknowledged batches.
    pub fn held_events(&self) -> usize {
        self.pending.len() + self.formed_behind + self.formed.front().map_or(0, |b| b.events.len())
    }

    /// Batches formed and not acknowledged.
    pub fn formed(&self) -> usize {
        self.formed.len()
    }

    /// Whether the outbox overflowed and waits for a new epoch.
    pub fn is_overflowed(&self) -> bool {
        self.overflowed
    }

    /// Queues the engine's events.
    pub fn push(&mut self, events: Vec<KvEvent>) -> Pushed {
        if self.overflowed {
            return Pushed::AwaitingResync;
        }
        if self.pending.len() + self.formed_behind + events.len() > self.limits.max_queued_events {
            self.overflowed = true;
            self.pending.clear();
            self.formed.clear();
            self.formed_behind = 0;
            return Pushed::Overflowed;
        }
        self.pending.extend(events);
        Pushed::Queued
    }

    /// Starts `epoch` from the engine's block set (`Stored` events): its
    /// first batch is `[Cleared, ..block_set]`, whatever its size. Anything
    /// held for the old epoch is dropped (the new epoch supersedes it).
    pub fn start_epoch(&mut self, epoch: u64, block_set: Vec<KvEvent>) -> Result<(), StaleEpoch> {
        if epoch <= self.epoch {
            return Err(StaleEpoch {
                current: self.epoch,
                requested: epoch,
            });
        }
        self.begin_epoch(epoch, block_set);
        Ok(())
    }

    /// Starts the epoch `not_before`, or the one after the current epoch if
    /// that is later, from the engine's block set (as
    /// [`KvOutbox::start_epoch`]); returns it.
    pub fn start_next_epoch(&mut self, not_before: u64, block_set: Vec<KvEvent>) -> u64 {
        let epoch = not_before.max(self.epoch + 1);
        self.begin_epoch(epoch, block_set);
        epoch
    }

    fn begin_epoch(&mut self, epoch: u64, block_set: Vec<KvEvent>) {
        let mut events = Vec::with_capacity(block_set.len() + 1);
        events.push(KvEvent::Cleared);
        events.extend(block_set);
        self.epoch = epoch;
        self.pending.clear();
        self.overflowed = false;
        self.formed = VecDeque::from([KvEventBatch {
            worker: self.worker.clone(),
            epoch,
            seq: 0,
            events,
        }]);
        self.formed_behind = 0;
        self.next_seq = 1;
    }

    /// Forms the next batch from the queue (at most `max_batch_events`)
    /// behind those formed already, and returns it. `None` when nothing
    /// is queued (or the outbox waits for a new epoch).
    pub fn form(&mut self) -> Option<&KvEventBatch> {
        if self.overflowed || self.pending.is_empty() {
            return None;
        }
        let n = self.pending.len().min(self.limits.max_batch_events);
        if !self.formed.is_empty() {
            self.formed_behind += n;
        }
        self.formed.push_back(KvEventBatch {
            worker: self.worker.clone(),
            epoch: self.epoch,
            seq: self.next_seq,
            events: self.pending.drain(..n).collect(),
        });
        self.next_seq += 1;
        self.formed.back()
    }

    /// The batches formed and not acknowledged, oldest first.
    pub fn formed_batches(&self) -> impl Iterator<Item = &KvEventBatch> {
        self.formed.iter()
    }

    /// The batch to publish now: the oldest one formed and not
    /// acknowledged.
    pub fn front(&self) -> Option<&KvEventBatch> {
        self.formed.front()
    }

    /// JetStream acknowledged batch `(epoch, seq)`: returns it, or `None`
    /// when it is not the batch being published (a superseded epoch).
    pub fn acked(&mut self, epoch: u64, seq: u64) -> Option<KvEventBatch> {
        match self.formed.front() {
            Some(b) if b.epoch == epoch && b.seq == seq => {
                let batch = self.formed.pop_front();
                self.formed_behind -= self.formed.front().map_or(0, |b| b.events.len());
                batch
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use protocol::{BlockHash, Tier};

    use super::*;

    fn outbox(max_queued_events: usize, max_batch_events: usize) -> KvOutbox {
        KvOutbox::new(
            WorkerId::new("w", 0).unwrap(),
            100,
            OutboxLimits {
                max_queued_events,
                max_batch_events,
            },
        )
    }

    fn stored(v: u64) -> KvEvent {
        KvEvent::Stored {
            parent: None,
            blocks: vec![BlockHash(v)],
            tier: Tier::Device,
        }
    }

    /// The batch to publish: the front one, else one formed now.
    fn next(o: &mut KvOutbox) -> Option<KvEventBatch> {
        if o.front().is_none() {
            o.form();
        }
        o.front().cloned()
    }

    fn publish(o: &mut KvOutbox) -> KvEventBatch {
        let b = next(o).expect("a batch");
        assert_eq!(o.acked(b.epoch, b.seq).as_ref(), Some(&b));
        b
    }

    #[test]
    fn seqs_are_gap_free_and_the_epoch_starts_cleared() {
        let mut o = outbox(100, 2);
        assert_eq!(
            o.push(vec![stored(1), stored(2), stored(3)]),
            Pushed::Queued
        );
        let a = publish(&mut o);
        assert_eq!((a.epoch, a.seq), (100, 0));
        assert_eq!(a.events, vec![KvEvent::Cleared, stored(1)]);
        let b = publish(&mut o);
        assert_eq!((b.seq, b.events.clone()), (1, vec![stored(2), stored(3)]));
        assert!(next(&mut o).is_none());
        o.push(vec![stored(4)]);
        assert_eq!(publish(&mut o).seq, 2);
    }

    #[test]
    fn an_unacknowledged_batch_is_repeated_unchanged() {
        let mut o = outbox(100, 8);
        o.push(vec![stored(1)]);
        let first = next(&mut o).unwrap();
        // The publish failed; more events come meanwhile.
        o.push(vec![stored(2)]);
        assert_eq!(next(&mut o).as_ref(), Some(&first));
        assert_eq!(o.acked(first.epoch, first.seq + 1), None, "not this one");
        assert!(o.acked(first.epoch, first.seq).is_some());
        let second = publish(&mut o);
        assert_eq!((second.seq, second.events), (1, vec![stored(2)]));
    }

    #[test]
    fn overflow_waits_for_a_new_epoch_with_the_block_set() {
        let mut o = outbox(3, 8);
        assert_eq!(o.push(vec![stored(1)]), Pushed::Queued);
        let _in_flight = next(&mut o).unwrap();
        assert_eq!(o.held_events(), 2);
        assert_eq!(o.push(vec![stored(2), stored(3)]), Pushed::Queued);
        assert_eq!(o.held_events(), 4, "the batch in flight is not counted");
        assert_eq!(o.push(vec![stored(4), stored(5)]), Pushed::Overflowed);
        assert!(o.is_overflowed());
        assert_eq!(o.held_events(), 0);
        assert_eq!(next(&mut o), None);
        assert_eq!(o.push(vec![stored(6)]), Pushed::AwaitingResync);
        assert_eq!(o.acked(100, 0), None, "the old batch was dropped");

        assert_eq!(
            o.start_epoch(100, vec![]),
            Err(StaleEpoch {
                current: 100,
                requested: 100
            })
        );
        let set: Vec<KvEvent> = (1..=6).map(stored).collect();
        o.start_epoch(101, set.clone()).unwrap();
        // A block set larger than the queue does not overflow it.
        assert_eq!(o.push(vec![stored(7)]), Pushed::Queued);
        let first = publish(&mut o);
        assert_eq!((first.epoch, first.seq), (101, 0));
        assert_eq!(first.events[0], KvEvent::Cleared);
        assert_eq!(
            &first.events[1..],
            &set[..],
            "the whole set, beyond the batch limit"
        );
        let second = publish(&mut o);
        assert_eq!((second.seq, second.events), (1, vec![stored(7)]));
    }

    #[test]
    fn a_resync_supersedes_what_was_held() {
        let mut o = outbox(100, 8);
        o.push(vec![stored(1)]);
        let old = next(&mut o).unwrap();
        o.push(vec![stored(2)]);
        o.start_epoch(200, vec![stored(1), stored(2)]).unwrap();
        assert_eq!(o.acked(old.epoch, old.seq), None);
        let first = publish(&mut o);
        assert_eq!(first.events, vec![KvEvent::Cleared, stored(1), stored(2)]);
        assert!(next(&mut o).is_none());
    }

    #[test]
    fn batches_formed_behind_the_front_keep_their_order_and_count_to_the_bound() {
        let mut o = outbox(4, 2);
        let first = next(&mut o).unwrap();
        assert_eq!(first.events, vec![KvEvent::Cleared]);
        o.push(vec![stored(1), stored(2), stored(3)]);
        let second = o.form().unwrap().clone();
        let third = o.form().unwrap().clone();
        assert!(o.form().is_none(), "nothing left to form");
        assert_eq!((second.seq, third.seq), (1, 2));
        assert_eq!(third.events, vec![stored(3)]);
        assert_eq!(o.held_events(), 4);
        assert_eq!(o.front(), Some(&first), "the oldest goes first");
        assert_eq!(o.acked(second.epoch, second.seq), None, "not in flight");
        // Three events wait behind the front: one more fits, two do not.
        assert_eq!(o.push(vec![stored(4)]), Pushed::Queued);
        assert!(o.acked(first.epoch, first.seq).is_some());
        assert_eq!(o.front(), Some(&second));
        assert_eq!(o.held_events(), 4);
        assert_eq!(
            o.push(vec![stored(5)]),
            Pushed::Queued,
            "2 queued, 1 behind"
        );
        assert_eq!(o.push(vec![stored(6), stored(7)]), Pushed::Overflowed);
        assert_eq!((o.formed(), o.held_events()), (0, 0));
    }
}
