//! Session affinity: a conversation's turns bound to one decode worker on
//! every replica. Pure: time is an argument.
//!
//! - A request with a session id whose binding is live goes to the bound
//!   worker, unless that worker left, is avoided, cannot serve a decode or
//!   is saturated (the selection's busy filter): then the binding is
//!   released and the request chooses anew.
//! - A session without a live binding (its first turn) chooses
//!   deterministically from what every replica shares: among the eligible
//!   decode candidates with the longest weighted cached prefix (the index
//!   state), the one with the highest rendezvous hash of (session id,
//!   worker id). Two first turns of one session racing on two replicas at
//!   the same index state land on the same worker, whatever their ledgers
//!   say. (The busy filter reads the effective load; replicas whose views
//!   of a worker's saturation differ can still differ.)
//! - Every decision with a session binds it to the decision's decode
//!   worker for `ttl` from the decision; peers bind it when the decision
//!   reaches them through the decision log ([`Sessions::bind`]).
//! - Bindings expire after `ttl` ([`Sessions::expire`]) and are released
//!   when their worker deregisters ([`Sessions::release_worker`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use protocol::{SessionId, WorkerId};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Session affinity's settings (the router's `[session]` section).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    /// Whether a session id binds turns to a worker. Default true.
    pub enabled: bool,
    /// A binding lasts this long after the session's last decision (ms).
    /// Default 1 800 000 (30 minutes): longer than an agent's think time
    /// between turns.
    #[serde(rename = "ttl", with = "settings::duration_ms")]
    pub ttl_ms: u64,
    /// Most sessions bound at once; past it the oldest binding is dropped
    /// first. Default 1 000 000.
    pub max_sessions: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            ttl_ms: 1_800_000,
            max_sessions: 1_000_000,
        }
    }
}

#[derive(Debug, Clone)]
struct Binding {
    worker: WorkerId,
    expires_ms: u64,
}

/// The live bindings, session → decode worker.
#[derive(Debug, Default)]
pub struct Sessions {
    bindings: HashMap<SessionId, Binding>,
    /// (expiry, session) of every binding written; stale pairs (the
    /// binding was refreshed or released) are skipped when popped.
    deadlines: BinaryHeap<Reverse<(u64, SessionId)>>,
}

impl Sessions {
    pub fn new() -> Self {
        Self::default()
    }

    /// The worker `session` is bound to at `now_ms`, if the binding is live.
    pub fn bound(&self, session: &SessionId, now_ms: u64) -> Option<&WorkerId> {
        self.bindings
            .get(session)
            .filter(|b| b.expires_ms > now_ms)
            .map(|b| &b.worker)
    }

    /// Binds `session` to `worker` until `now_ms + config.ttl_ms`.
    pub fn bind(
        &mut self,
        config: &SessionConfig,
        session: &SessionId,
        worker: &WorkerId,
        now_ms: u64,
    ) {
        let expires_ms = now_ms.saturating_add(config.ttl_ms);
        match self.bindings.get_mut(session) {
            Some(b) => {
                if b.worker == *worker && b.expires_ms >= expires_ms {
                    return;
                }
                b.worker = worker.clone();
                b.expires_ms = b.expires_ms.max(expires_ms);
            }
            None => {
                self.bindings.insert(
                    session.clone(),
                    Binding {
                        worker: worker.clone(),
                        expires_ms,
                    },
                );
            }
        }
        let expires_ms = self.bindings[session].expires_ms;
        self.deadlines.push(Reverse((expires_ms, session.clone())));
        while self.bindings.len() > config.max_sessions.max(1) {
            if !self.pop_oldest() {
                break;
            }
        }
    }

    /// Releases `session`'s binding.
    pub fn release(&mut self, session: &SessionId) -> bool {
        self.bindings.remove(session).is_some()
    }

    /// Releases every binding to `worker` (it left); their count.
    pub fn release_worker(&mut self, worker: &WorkerId) -> usize {
        let before = self.bindings.len();
        self.bindings.retain(|_, b| b.worker != *worker);
        before - self.bindings.len()
    }

    /// Drops the bindings expired at `now_ms`; their count.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let mut dropped = 0;
        while let Some(Reverse((at, _))) = self.deadlines.peek() {
            if *at > now_ms {
                break;
            }
            let Some(Reverse((at, session))) = self.deadlines.pop() else {
                break;
            };
            if self
                .bindings
                .get(&session)
                .is_some_and(|b| b.expires_ms == at)
            {
                self.bindings.remove(&session);
                dropped += 1;
            }
        }
        dropped
    }

    /// Bindings held.
    pub fn len(&self) -> usize {
        self.bindings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bindings.is_empty()
    }

    fn pop_oldest(&mut self) -> bool {
        while let Some(Reverse((at, session))) = self.deadlines.pop() {
            if self
                .bindings
                .get(&session)
                .is_some_and(|b| b.expires_ms == at)
            {
                self.bindings.remove(&session);
                return true;
            }
        }
        false
    }
}

/// The rendezvous weight of `worker` for `session`: the first turn goes to
/// the highest among equally good candidates.
pub fn rendezvous(session: &SessionId, worker: &WorkerId) -> u64 {
    let s = xxh3_64_with_seed(session.as_str().as_bytes(), 0x5e55_1011);
    let name = worker.to_string();
    xxh3_64_with_seed(name.as_bytes(), s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(name: &str) -> SessionId {
        SessionId::new(name).unwrap()
    }

    fn w(name: &str) -> WorkerId {
        name.parse().unwrap()
    }

    #[test]
    fn bindings_expire_refresh_and_release() {
        let cfg = SessionConfig {
            ttl_ms: 100,
            ..SessionConfig::default()
        };
        let mut sessions = Sessions::new();
        sessions.bind(&cfg, &s("a"), &w("d0"), 0);
        sessions.bind(&cfg, &s("b"), &w("d1"), 0);
        assert_eq!(sessions.bound(&s("a"), 99), Some(&w("d0")));
        assert_eq!(sessions.bound(&s("a"), 100), None, "expired at ttl");
        // A later turn refreshes.
        sessions.bind(&cfg, &s("a"), &w("d0"), 80);
        assert_eq!(sessions.expire(100), 1, "b expired, a refreshed");
        assert_eq!(sessions.bound(&s("a"), 150), Some(&w("d0")));
        assert_eq!(sessions.bound(&s("b"), 50), None);
        // Rebinding moves it; a worker leaving releases its sessions.
        sessions.bind(&cfg, &s("a"), &w("d1"), 90);
        sessions.bind(&cfg, &s("c"), &w("d1"), 90);
        assert_eq!(sessions.release_worker(&w("d1")), 2);
        assert!(sessions.is_empty());
        assert_eq!(sessions.expire(10_000), 0);
    }

    #[test]
    fn the_cap_drops_the_oldest_first() {
        let cfg = SessionConfig {
            ttl_ms: 100,
            max_sessions: 2,
            ..SessionConfig::default()
        };
        let mut sessions = Sessions::new();
        for (i, name) in ["a", "b", "c"].iter().enumerate() {
            sessions.bind(&cfg, &s(name), &w("d0"), i as u64);
        }
        assert_eq!(sessions.len(), 2);
        assert_eq!(sessions.bound(&s("a"), 5), None);
        assert!(sessions.bound(&s("c"), 5).is_some());
    }

    #[test]
    fn rendezvous_spreads_sessions_and_is_stable() {
        let workers: Vec<WorkerId> = (0..4).map(|i| w(&format!("d{i}"))).collect();
        let mut counts = [0usize; 4];
        for i in 0..4_000 {
            let session = s(&format!("conv-{i}"));
            let best = (0..4)
                .max_by_key(|&j| rendezvous(&session, &workers[j]))
                .unwrap();
            counts[best] += 1;
            assert_eq!(
                rendezvous(&session, &workers[best]),
                rendezvous(&session, &workers[best])
            );
        }
        for c in counts {
            assert!((800..1_200).contains(&c), "{counts:?}");
        }
    }
}
