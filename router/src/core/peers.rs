//! The peer replicas this router hears of, and which of their decisions it
//! holds in its ledger: so that a peer that stops (it says it is leaving)
//! or crashes (its heartbeats stop) has its reservations released within
//! seconds, not after the ledger's TTL.
//!
//! Pure bookkeeping: time is an argument (the receiving replica's clock,
//! never the peer's), and releasing is the caller's (it hands the returned
//! ids to [`super::Workers::on_finished`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use protocol::{DecisionId, Presence, RouterHeartbeat};
use serde::{Deserialize, Serialize};

/// How replicas tell each other they are alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PeerConfig {
    /// How often this replica says it is alive (ms). Default 1 000.
    #[serde(rename = "heartbeat", with = "settings::duration_ms")]
    pub heartbeat_ms: u64,
    /// A peer not heard of for this long (ms; at least three of its own
    /// periods) is taken for dead and its reservations are released.
    /// Default 5 000.
    #[serde(rename = "timeout", with = "settings::duration_ms")]
    pub timeout_ms: u64,
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            heartbeat_ms: 1_000,
            timeout_ms: 5_000,
        }
    }
}

#[derive(Debug)]
struct Peer {
    /// When this replica last heard of it (a heartbeat or a decision).
    heard_ms: u64,
    /// Its announced period (0: unknown, no heartbeat yet).
    every_ms: u64,
    /// Its decisions charged to this replica's ledger, not known finished.
    decisions: HashSet<DecisionId>,
}

/// A peer whose reservations are to be released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerGone {
    pub replica: Arc<str>,
    /// It said it was leaving (else: it fell silent).
    pub left: bool,
    /// Silence before it was taken for dead (ms; 0 when it left).
    pub silent_ms: u64,
    /// Its decisions still held, in id order.
    pub decisions: Vec<DecisionId>,
}

/// What a heartbeat changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heard {
    /// A replica not known before (or back after it was taken for dead).
    Joined,
    /// A known replica, still alive.
    Alive,
    /// It left: release these.
    Left(PeerGone),
    /// A beat the replica sent no later than its leaving notice (by its
    /// own clock), which overtook it on the way: it is gone, not back.
    Stale,
}

/// The peers and their held decisions.
#[derive(Debug, Default)]
pub struct Peers {
    config: PeerConfig,
    peers: HashMap<Arc<str>, Peer>,
    owner: HashMap<DecisionId, Arc<str>>,
    /// Replicas that said they leave: their notice's time on their clock
    /// and its receipt on ours, kept for one timeout.
    left: HashMap<Arc<str>, (u64, u64)>,
}

impl Peers {
    pub fn new(config: PeerConfig) -> Self {
        Self {
            config,
            ..Default::default()
        }
    }

    pub fn config(&self) -> &PeerConfig {
        &self.config
    }

    /// A peer's heartbeat, received at `now_ms`.
    pub fn on_heartbeat(&mut self, heartbeat: &RouterHeartbeat, now_ms: u64) -> Heard {
        let replica = heartbeat.replica.as_str();
        match heartbeat.state {
            Presence::Leaving => {
                self.left.insert(replica.into(), (heartbeat.at_ms, now_ms));
                match self.remove(replica, true, 0) {
                    Some(gone) => Heard::Left(gone),
                    None => Heard::Left(PeerGone {
                        replica: replica.into(),
                        left: true,
                        silent_ms: 0,
                        decisions: Vec::new(),
                    }),
                }
            }
            Presence::Alive => {
                if let Some(&(left_at, _)) = self.left.get(replica) {
                    if heartbeat.at_ms <= left_at {
                        return Heard::Stale;
                    }
                    self.left.remove(replica);
                }
                let (peer, joined) = self.peer(replica, now_ms);
                peer.heard_ms = peer.heard_ms.max(now_ms);
                peer.every_ms = heartbeat.every_ms;
                if joined {
                    Heard::Joined
                } else {
                    Heard::Alive
                }
            }
        }
    }

    /// A peer's decision, charged to the ledger at `now_ms`. A replica
    /// first heard of by a decision gets a full timeout from it to send a
    /// heartbeat.
    pub fn on_decision(&mut self, replica: &str, id: DecisionId, now_ms: u64) {
        let (peer, _) = self.peer(replica, now_ms);
        peer.decisions.insert(id);
        let key = self
            .peers
            .get_key_value(replica)
            .map(|(k, _)| k.clone())
            .expect("inserted above");
        self.owner.insert(id, key);
    }

    /// A decision finished (or its ledger entry expired): no longer held.
    pub fn on_finished(&mut self, id: DecisionId) {
        if let Some(replica) = self.owner.remove(&id) {
            if let Some(peer) = self.peers.get_mut(&replica) {
                peer.decisions.remove(&id);
            }
        }
    }

    /// The peers not heard of within their timeout by `now_ms`, removed
    /// with their held decisions (in replica order).
    pub fn expire(&mut self, now_ms: u64) -> Vec<PeerGone> {
        let timeout = self.config.timeout_ms;
        self.left
            .retain(|_, &mut (_, heard_ms)| now_ms.saturating_sub(heard_ms) <= timeout);
        let mut silent: Vec<(Arc<str>, u64)> = self
            .peers
            .iter()
            .filter_map(|(replica, peer)| {
                let silence = now_ms.saturating_sub(peer.heard_ms);
                (silence > self.timeout_of(peer)).then(|| (replica.clone(), silence))
            })
            .collect();
        silent.sort();
        silent
            .into_iter()
            .filter_map(|(replica, silence)| self.remove(&replica, false, silence))
            .collect()
    }

    /// Known peers, in id order, with their held decisions.
    pub fn list(&self) -> Vec<(Arc<str>, usize)> {
        let mut list: Vec<_> = self
            .peers
            .iter()
            .map(|(r, p)| (r.clone(), p.decisions.len()))
            .collect();
        list.sort();
        list
    }

    /// Decisions held for peers.
    pub fn held(&self) -> usize {
        self.owner.len()
    }

    fn timeout_of(&self, peer: &Peer) -> u64 {
        self.config.timeout_ms.max(peer.every_ms.saturating_mul(3))
    }

    fn peer(&mut self, replica: &str, now_ms: u64) -> (&mut Peer, bool) {
        let joined = !self.peers.contains_key(replica);
        let peer = self.peers.entry(replica.into()).or_insert_with(|| Peer {
            heard_ms: now_ms,
            every_ms: 0,
            decisions: HashSet::new(),
        });
        (peer, joined)
    }

    fn remove(&mut self, replica: &str, left: bool, silent_ms: u64) -> Option<PeerGone> {
        let (replica, peer) = self.peers.remove_entry(replica)?;
        let mut decisions: Vec<DecisionId> = peer.decisions.into_iter().collect();
        decisions.sort();
        for id in &decisions {
            self.owner.remove(id);
        }
        Some(PeerGone {
            replica,
            left,
            silent_ms,
            decisions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(replica: &str, state: Presence) -> RouterHeartbeat {
        RouterHeartbeat {
            replica: replica.into(),
            state,
            every_ms: 1_000,
            at_ms: 0,
        }
    }

    fn peers() -> Peers {
        Peers::new(PeerConfig {
            heartbeat_ms: 1_000,
            timeout_ms: 5_000,
        })
    }

    #[test]
    fn a_silent_peer_is_dropped_with_its_open_decisions_after_the_timeout() {
        let mut p = peers();
        assert_eq!(
            p.on_heartbeat(&beat("a", Presence::Alive), 0),
            Heard::Joined
        );
        p.on_decision("a", DecisionId(2), 100);
        p.on_decision("a", DecisionId(1), 200);
        p.on_decision("a", DecisionId(3), 300);
        p.on_finished(DecisionId(3));
        assert_eq!(
            p.on_heartbeat(&beat("a", Presence::Alive), 4_000),
            Heard::Alive
        );
        // Heard at 4 000: alive until 9 000.
        assert!(p.expire(9_000).is_empty());
        let gone = p.expire(9_001);
        assert_eq!(
            gone,
            vec![PeerGone {
                replica: "a".into(),
                left: false,
                silent_ms: 5_001,
                decisions: vec![DecisionId(1), DecisionId(2)],
            }]
        );
        assert_eq!(p.held(), 0);
        assert!(p.list().is_empty());
        // Back again: a new peer, holding nothing.
        assert_eq!(
            p.on_heartbeat(&beat("a", Presence::Alive), 10_000),
            Heard::Joined
        );
        assert!(p.expire(10_000).is_empty());
    }

    #[test]
    fn a_leaving_peer_releases_at_once_and_others_stay() {
        let mut p = peers();
        p.on_heartbeat(&beat("a", Presence::Alive), 0);
        p.on_heartbeat(&beat("b", Presence::Alive), 0);
        p.on_decision("a", DecisionId(7), 10);
        p.on_decision("b", DecisionId(8), 10);
        match p.on_heartbeat(&beat("a", Presence::Leaving), 20) {
            Heard::Left(gone) => {
                assert!(gone.left);
                assert_eq!(gone.decisions, vec![DecisionId(7)]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(p.list(), vec![("b".into(), 1)]);
        // A leaving notice from a replica never heard of releases nothing.
        match p.on_heartbeat(&beat("z", Presence::Leaving), 30) {
            Heard::Left(gone) => assert!(gone.decisions.is_empty()),
            other => panic!("{other:?}"),
        }
    }

    /// A beat sent before the leaving notice but received after it (the
    /// sender publishes beats from a task the notice can overtake) does not
    /// bring the replica back; a later one, from its restart, does.
    #[test]
    fn a_beat_older_than_the_leaving_notice_is_stale() {
        let mut p = peers();
        let at = |state, at_ms| RouterHeartbeat {
            at_ms,
            ..beat("a", state)
        };
        p.on_heartbeat(&at(Presence::Alive, 1_000), 0);
        assert!(matches!(
            p.on_heartbeat(&at(Presence::Leaving, 2_000), 10),
            Heard::Left(_)
        ));
        assert_eq!(
            p.on_heartbeat(&at(Presence::Alive, 2_000), 20),
            Heard::Stale
        );
        assert!(p.list().is_empty());
        assert!(p.expire(10_000).is_empty(), "nothing to time out");
        assert_eq!(
            p.on_heartbeat(&at(Presence::Alive, 9_000), 30),
            Heard::Joined
        );
        // The notice is forgotten once it has been kept for a timeout.
        p.on_heartbeat(&at(Presence::Leaving, 10_000), 100);
        p.expire(5_100);
        assert_eq!(p.left.len(), 1);
        p.expire(5_101);
        assert!(p.left.is_empty());
    }

    #[test]
    fn a_peer_known_only_by_its_decisions_gets_a_full_timeout() {
        let mut p = peers();
        p.on_decision("old", DecisionId(1), 1_000);
        assert!(p.expire(6_000).is_empty());
        let gone = p.expire(6_001);
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].decisions, vec![DecisionId(1)]);
    }

    #[test]
    fn a_slow_peer_is_given_three_of_its_periods() {
        let mut p = peers();
        let slow = RouterHeartbeat {
            every_ms: 4_000,
            ..beat("slow", Presence::Alive)
        };
        p.on_heartbeat(&slow, 0);
        assert!(p.expire(12_000).is_empty());
        assert_eq!(p.expire(12_001).len(), 1);
    }
}
