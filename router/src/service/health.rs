//! Whether a replica is ready to route, from what its loop observed: an
//! index loaded and caught up is not enough. It is not ready while NATS is
//! disconnected, while its index is more than `max_delta_lag` deltas behind
//! the delta stream, while no delta came for longer than `max_quiet` and
//! no indexer is pulling KV events (its index is frozen with nothing
//! saying so), while JetStream's store refuses its decision log for want
//! of room, or while no decode-capable worker is accepted. The text
//! says why, with the live delta position.
//!
//! Pure: the loop passes the observations and the time since the last
//! delta.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::event_loop::Readiness;

/// The bounds of readiness (`[readiness]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReadinessConfig {
    /// Not ready while the index is more deltas than this behind the
    /// delta stream's head.
    pub max_delta_lag: u64,
    /// Not ready when no delta came for this long and no indexer is
    /// pulling the KV events.
    #[serde(with = "settings::duration")]
    pub max_quiet: Duration,
    /// The delta feed is opened again from the next delta when the
    /// stream's head is ahead of the index and no delta came for this long
    /// (its JetStream consumer died with a NATS node: the client would
    /// notice only after 10 s of missed heartbeats).
    #[serde(with = "settings::duration")]
    pub max_delta_stall: Duration,
}

impl Default for ReadinessConfig {
    fn default() -> Self {
        Self {
            max_delta_lag: 10_000,
            max_quiet: Duration::from_secs(30),
            max_delta_stall: Duration::from_millis(1500),
        }
    }
}

/// Whether an indexer is pulling the KV events, as last polled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Indexer {
    /// Not polled yet (or the poll failed): no verdict.
    Unknown,
    Pulling,
    Gone,
}

/// What the loop observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    pub nats_connected: bool,
    /// The last delta the index applied.
    pub applied: u64,
    /// The delta stream's head, as last polled.
    pub head: u64,
    /// Since the last delta applied (or the index loaded).
    pub quiet: Duration,
    pub indexer: Indexer,
    /// Accepted workers that can decode (decode or both).
    pub decode_workers: usize,
    /// JetStream's store refused the last decision-log write for want of
    /// room (decisions are not logged: no replay, no peer sees them).
    pub store_full: bool,
}

/// The readiness of a replica whose index is loaded and caught up.
pub fn readiness(observed: &Observed, config: &ReadinessConfig) -> Readiness {
    let Observed {
        nats_connected,
        applied,
        head,
        quiet,
        indexer,
        decode_workers,
        store_full,
    } = *observed;
    let position = format!("index at delta {applied} of {head}");
    if !nats_connected {
        return Readiness::not_ready(format!("NATS is disconnected ({position})"));
    }
    let lag = head.saturating_sub(applied);
    if lag > config.max_delta_lag {
        return Readiness::not_ready(format!(
            "{position}: {lag} deltas behind (bound {})",
            config.max_delta_lag
        ));
    }
    if indexer == Indexer::Gone && quiet > config.max_quiet {
        return Readiness::not_ready(format!(
            "{position}: no delta for {}s and no kv-indexer is pulling the KV events (the index may be stale)",
            quiet.as_secs()
        ));
    }
    if store_full {
        return Readiness::not_ready(format!(
            "{position}: JetStream's store is full: the decision log refuses this replica's decisions"
        ));
    }
    if decode_workers == 0 {
        return Readiness::not_ready(format!("{position}: no decode-capable worker accepted"));
    }
    Readiness {
        ready: true,
        status: format!("ready: {position}, {decode_workers} decode-capable workers"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy() -> Observed {
        Observed {
            nats_connected: true,
            applied: 40,
            head: 42,
            quiet: Duration::from_secs(1),
            indexer: Indexer::Pulling,
            decode_workers: 2,
            store_full: false,
        }
    }

    fn check(observed: Observed) -> Readiness {
        readiness(&observed, &ReadinessConfig::default())
    }

    #[test]
    fn ready_says_where_the_index_is() {
        let r = check(healthy());
        assert!(r.ready);
        assert_eq!(
            r.status,
            "ready: index at delta 40 of 42, 2 decode-capable workers"
        );
    }

    #[test]
    fn each_cause_is_named() {
        let cases = [
            (
                Observed {
                    nats_connected: false,
                    ..healthy()
                },
                "NATS is disconnected",
            ),
            (
                Observed {
                    head: 20_041,
                    ..healthy()
                },
                "20001 deltas behind (bound 10000)",
            ),
            (
                Observed {
                    indexer: Indexer::Gone,
                    quiet: Duration::from_secs(31),
                    ..healthy()
                },
                "no delta for 31s and no kv-indexer",
            ),
            (
                Observed {
                    decode_workers: 0,
                    ..healthy()
                },
                "no decode-capable worker",
            ),
            (
                Observed {
                    store_full: true,
                    ..healthy()
                },
                "JetStream's store is full",
            ),
        ];
        for (observed, why) in cases {
            let r = check(observed);
            assert!(
                !r.ready && r.status.contains(why),
                "{observed:?}: {}",
                r.status
            );
            assert!(r.status.contains("index at delta"), "{}", r.status);
        }
    }

    #[test]
    fn a_quiet_index_is_fine_while_an_indexer_pulls() {
        let quiet = Duration::from_secs(3600);
        assert!(check(Observed { quiet, ..healthy() }).ready);
        assert!(
            check(Observed {
                quiet,
                indexer: Indexer::Unknown,
                ..healthy()
            })
            .ready
        );
        // Gone, but a delta came recently: not yet.
        assert!(
            check(Observed {
                indexer: Indexer::Gone,
                ..healthy()
            })
            .ready
        );
    }
}
