//! Following the indexer's deltas on two feeds: announced on core NATS as
//! they are made ([`LiveDeltas::heard`]), and read back from the delta
//! stream, the record ([`LiveDeltas::logged`]).
//!
//! The stream takes writes only through its leader: when the NATS node
//! leading it dies, no delta is stored until the others elect a new one
//! (4-9 s on nats-server). The announcements go on meanwhile, so a replica
//! applies a delta as soon as it is made. Such a delta is *tentative*
//! until the stream gives the same delta at the same place; one that
//! differs (an indexer died after announcing a delta the stream never
//! stored, and its successor made another one there) means the replica
//! holds what the record does not: it must load the index again.
//!
//! Core NATS drops what a reconnect misses, so announcements may come with
//! gaps (held as *early* until the deltas before them come, from either
//! feed) and repeats (the indexer announces its unconfirmed deltas again
//! while the stream refuses them). Both buffers are bounded: past them a
//! delta is left to the stream.

use std::collections::{BTreeMap, VecDeque};

use protocol::IndexDelta;

use crate::replica::{DeltaError, IndexReplica};

/// Deltas applied from announcements and not yet read back from the
/// stream, at most: past it announcements wait for the stream.
pub const MAX_TENTATIVE: usize = 65_536;
/// How far ahead of the replica an announcement is held.
pub const MAX_EARLY: u64 = 4_096;

/// What an announced delta did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Announced {
    /// Applied, with the early ones it made consecutive: the replica is
    /// now at `through`.
    Applied { through: u64 },
    /// Held until the deltas before it come.
    Early,
    /// At or before the replica's position, the same as the one applied
    /// there (or one read from the stream, which is the record).
    Duplicate,
    /// Left to the stream: too far ahead, or too many unconfirmed.
    Skipped,
    /// Differs from the tentative delta applied at its place: the index
    /// must be loaded again.
    Superseded { seq: u64 },
}

/// What a delta read from the stream did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Logged {
    /// Applied (it had not been announced, or not heard), with the early
    /// announcements it made consecutive: the replica is now at `through`.
    Applied { through: u64 },
    /// The same as the tentative delta applied at its place: now confirmed.
    Confirmed,
    /// Read from the stream before.
    Duplicate,
    /// Differs from the tentative delta applied at its place: the replica
    /// holds a delta the record does not, and must load the index again.
    Superseded { seq: u64 },
}

/// The tentative and early deltas of one replica (see the module docs).
///
/// Invariants: the tentative deltas are consecutive and end at the
/// replica's position; every early delta is beyond it.
#[derive(Debug, Default)]
pub struct LiveDeltas {
    tentative: VecDeque<IndexDelta>,
    early: BTreeMap<u64, IndexDelta>,
}

impl LiveDeltas {
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets both buffers: the replica was replaced (a load).
    pub fn reset(&mut self) {
        self.tentative.clear();
        self.early.clear();
    }

    /// Deltas applied from announcements and not confirmed by the stream.
    pub fn tentative(&self) -> usize {
        self.tentative.len()
    }

    /// Announcements held for the deltas before them.
    pub fn early(&self) -> usize {
        self.early.len()
    }

    /// An announced delta.
    pub fn heard(&mut self, replica: &mut IndexReplica, delta: IndexDelta) -> Announced {
        let at = replica.applied();
        if delta.seq <= at {
            return match self.tentative_at(delta.seq) {
                Some(held) if *held != delta => Announced::Superseded { seq: delta.seq },
                _ => Announced::Duplicate,
            };
        }
        if self.tentative.len() >= MAX_TENTATIVE || delta.seq - at > MAX_EARLY {
            return Announced::Skipped;
        }
        if delta.seq > at + 1 {
            self.early.insert(delta.seq, delta);
            return Announced::Early;
        }
        self.apply_tentative(replica, delta);
        Announced::Applied {
            through: self.drain_early(replica),
        }
    }

    /// A delta read from the stream, which gives them in order.
    pub fn logged(
        &mut self,
        replica: &mut IndexReplica,
        delta: &IndexDelta,
    ) -> Result<Logged, DeltaError> {
        if let Some(first) = self.tentative.front() {
            if delta.seq < first.seq {
                return Ok(Logged::Duplicate);
            }
            // The stream's feed starts at or before the first tentative
            // delta and skips none, so it reaches this one first: one it
            // passed by could not be checked, and counts as differing.
            let same = delta.seq == first.seq && first == delta;
            let seq = first.seq;
            self.tentative.pop_front();
            return Ok(if same {
                Logged::Confirmed
            } else {
                Logged::Superseded { seq }
            });
        }
        match replica.apply(delta) {
            Ok(()) => Ok(Logged::Applied {
                through: self.drain_early(replica),
            }),
            Err(DeltaError::AlreadyApplied { .. }) => Ok(Logged::Duplicate),
            Err(gap) => Err(gap),
        }
    }

    /// The tentative delta at `seq`, if there is one.
    fn tentative_at(&self, seq: u64) -> Option<&IndexDelta> {
        delta_at(&self.tentative, seq)
    }

    /// Applies the delta after the replica's position, as tentative.
    fn apply_tentative(&mut self, replica: &mut IndexReplica, delta: IndexDelta) {
        let applied = replica.apply(&delta);
        debug_assert!(applied.is_ok(), "the delta after the replica's position");
        if applied.is_ok() {
            self.tentative.push_back(delta);
        }
    }

    /// Applies the early deltas that now follow the replica's position,
    /// drops those it has passed, and returns its position.
    fn drain_early(&mut self, replica: &mut IndexReplica) -> u64 {
        loop {
            let at = replica.applied();
            let Some(entry) = self.early.first_entry() else {
                return at;
            };
            if *entry.key() <= at {
                entry.remove();
                continue;
            }
            if *entry.key() > at + 1 || self.tentative.len() >= MAX_TENTATIVE {
                return at;
            }
            let delta = entry.remove();
            self.apply_tentative(replica, delta);
        }
    }
}

/// Delta `seq` of a run of consecutive deltas, if the run holds it.
pub(crate) fn delta_at(run: &VecDeque<IndexDelta>, seq: u64) -> Option<&IndexDelta> {
    let first = run.front()?.seq;
    run.get(usize::try_from(seq.checked_sub(first)?).ok()?)
}

#[cfg(test)]
mod tests {
    use protocol::{BlockHash, IndexChange, Tier, WorkerId};

    use super::*;

    fn worker() -> WorkerId {
        WorkerId::new("d0", 0).unwrap()
    }

    /// Delta `seq` storing block `block` (a root block of its own).
    fn delta(seq: u64, block: u64) -> IndexDelta {
        IndexDelta {
            seq,
            changes: vec![IndexChange::Stored {
                worker: worker(),
                parent: None,
                blocks: vec![BlockHash(block)],
                tier: Tier::Device,
            }],
            source: None,
        }
    }

    /// A replica given deltas 1..=n by the stream alone.
    fn logged_only(n: u64) -> IndexReplica {
        let mut replica = IndexReplica::new();
        for seq in 1..=n {
            replica.apply(&delta(seq, seq)).unwrap();
        }
        replica
    }

    #[test]
    fn announcements_run_ahead_and_the_stream_confirms_them() {
        let mut replica = IndexReplica::new();
        let mut live = LiveDeltas::new();
        for seq in 1..=3 {
            assert_eq!(
                live.heard(&mut replica, delta(seq, seq)),
                Announced::Applied { through: seq }
            );
        }
        assert_eq!(live.tentative(), 3);
        assert_eq!(
            replica.index().digest(),
            logged_only(3).index().digest(),
            "the same index as from the stream"
        );
        for seq in 1..=3 {
            let logged = live.logged(&mut replica, &delta(seq, seq)).unwrap();
            assert_eq!(logged, Logged::Confirmed);
        }
        assert_eq!(live.tentative(), 0);
        // Then the stream leads again.
        let logged = live.logged(&mut replica, &delta(4, 4)).unwrap();
        assert_eq!(logged, Logged::Applied { through: 4 });
        assert_eq!(live.heard(&mut replica, delta(4, 4)), Announced::Duplicate);
        assert_eq!(replica.applied(), 4);
    }

    #[test]
    fn a_missed_announcement_holds_the_later_ones_until_either_feed_gives_it() {
        let mut replica = IndexReplica::new();
        let mut live = LiveDeltas::new();
        assert_eq!(
            live.heard(&mut replica, delta(1, 1)),
            Announced::Applied { through: 1 }
        );
        // 2 was missed (a reconnect); 3 and 4 wait for it.
        assert_eq!(live.heard(&mut replica, delta(3, 3)), Announced::Early);
        assert_eq!(live.heard(&mut replica, delta(4, 4)), Announced::Early);
        assert_eq!((replica.applied(), live.early()), (1, 2));
        // The indexer announces its unconfirmed deltas again.
        assert_eq!(
            live.heard(&mut replica, delta(2, 2)),
            Announced::Applied { through: 4 }
        );
        assert_eq!((live.tentative(), live.early()), (4, 0));

        // Or the stream gives it, with the tentative ones before it
        // confirmed first.
        let mut replica = logged_only(1);
        let mut live = LiveDeltas::new();
        assert_eq!(live.heard(&mut replica, delta(3, 3)), Announced::Early);
        let logged = live.logged(&mut replica, &delta(2, 2)).unwrap();
        assert_eq!(logged, Logged::Applied { through: 3 });
        assert_eq!(live.tentative(), 1, "3 came from an announcement");
        let logged = live.logged(&mut replica, &delta(3, 3)).unwrap();
        assert_eq!(logged, Logged::Confirmed);
    }

    #[test]
    fn a_delta_the_stream_never_stored_is_found_out_on_either_feed() {
        // The old indexer announced 2 and died before the stream stored
        // it; its successor made another delta 2.
        let mut replica = logged_only(1);
        let mut live = LiveDeltas::new();
        assert_eq!(
            live.heard(&mut replica, delta(2, 20)),
            Announced::Applied { through: 2 }
        );
        assert_eq!(
            live.heard(&mut replica, delta(2, 21)),
            Announced::Superseded { seq: 2 },
            "the successor's announcement"
        );
        assert_eq!(
            live.logged(&mut replica, &delta(2, 21)).unwrap(),
            Logged::Superseded { seq: 2 },
            "the stream's record"
        );
    }

    #[test]
    fn announcements_too_far_ahead_or_beyond_the_unconfirmed_bound_are_left_to_the_stream() {
        let mut replica = IndexReplica::new();
        let mut live = LiveDeltas::new();
        assert_eq!(
            live.heard(&mut replica, delta(MAX_EARLY + 1, 1)),
            Announced::Skipped
        );
        assert_eq!(
            live.heard(&mut replica, delta(MAX_EARLY, MAX_EARLY)),
            Announced::Early
        );
        for seq in 1..=MAX_TENTATIVE as u64 {
            live.heard(&mut replica, delta(seq, seq));
        }
        assert_eq!(live.tentative(), MAX_TENTATIVE);
        let next = MAX_TENTATIVE as u64 + 1;
        assert_eq!(
            live.heard(&mut replica, delta(next, next)),
            Announced::Skipped
        );
        // The stream still applies it (after confirming the tentative ones).
        for seq in 1..=MAX_TENTATIVE as u64 {
            live.logged(&mut replica, &delta(seq, seq)).unwrap();
        }
        let logged = live.logged(&mut replica, &delta(next, next)).unwrap();
        assert_eq!(logged, Logged::Applied { through: next });
    }

    #[test]
    fn a_gap_in_the_stream_is_still_an_error() {
        let mut replica = logged_only(1);
        let mut live = LiveDeltas::new();
        let gap = live.logged(&mut replica, &delta(3, 3)).unwrap_err();
        assert_eq!(gap, DeltaError::Gap { at: 1, got: 3 });
    }
}
