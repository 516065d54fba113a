//! Which workers are alive: the registry in etcd, followed by a task, and
//! the bookkeeping that decides when a worker leaves the index.
//!
//! A worker whose key is deleted (lease expired, deregistered) is removed at
//! once. A worker the index holds but etcd does not list (after a restart
//! of the indexer, or a late batch of a worker that left) is removed once it
//! has stayed unregistered for a grace period, so that restarting agents
//! can register again first.
//!
//! A removed worker may come back: its lease lapsed while etcd was
//! unreachable, and its agent, alive all along, registered again under a
//! new lease. Its blocks are gone from the index, and it has no reason to
//! send them again: the worker is remembered (for an hour), and when it
//! registers again it is asked to resync.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bus::{Registry, WorkerChange};
use protocol::{subjects, WorkerId};
use tokio::sync::mpsc;

/// What the registry follower reports.
#[derive(Debug)]
pub enum RegistryEvent {
    /// Every registered worker now (at start, and after a lost watch).
    Listed(Vec<WorkerChange>),
    /// A change after the listing.
    Changed(WorkerChange),
    /// The list or the watch failed; the follower retries.
    Lost(String),
}

/// Lists the registered workers, then follows the changes; lists again
/// after any failure. Ends when the receiver is gone.
pub async fn follow(registry: Registry, tx: mpsc::Sender<RegistryEvent>, retry: Duration) {
    loop {
        let lost = match registry.workers().await {
            Ok((workers, revision)) => {
                if tx.send(RegistryEvent::Listed(workers)).await.is_err() {
                    return;
                }
                match registry.watch_workers(revision).await {
                    Ok(mut watch) => loop {
                        match watch.next().await {
                            Ok(changes) => {
                                for change in changes {
                                    if tx.send(RegistryEvent::Changed(change)).await.is_err() {
                                        return;
                                    }
                                }
                            }
                            Err(e) => break e.to_string(),
                        }
                    },
                    Err(e) => e.to_string(),
                }
            }
            Err(e) => e.to_string(),
        };
        if tx.send(RegistryEvent::Lost(lost)).await.is_err() {
            return;
        }
        tokio::time::sleep(retry).await;
    }
}

/// The worker a change is about; a malformed record's worker is read from
/// its key (the key exists, so the worker's lease is alive).
pub fn worker_of(change: &WorkerChange) -> Option<WorkerId> {
    match change {
        WorkerChange::Up(record) => Some(record.id.clone()),
        WorkerChange::Down(id) => Some(id.clone()),
        WorkerChange::Malformed { key, .. } => key
            .strip_prefix(subjects::ETCD_WORKERS_PREFIX)
            .and_then(|id| id.parse().ok()),
    }
}

/// Registered workers and how long the index's other workers have been
/// unregistered. Time is an argument.
#[derive(Debug)]
pub struct Liveness {
    grace: Duration,
    /// `None` until etcd has been listed (and while the watch is lost):
    /// nobody is swept then.
    registered: Option<HashSet<WorkerId>>,
    unregistered_since: HashMap<WorkerId, Instant>,
    /// Workers removed from the index, and when: one that registers again
    /// is asked to resync.
    removed: HashMap<WorkerId, Instant>,
}

/// How long a removed worker is remembered (see the module docs).
const REMEMBER_REMOVED: Duration = Duration::from_secs(3600);

impl Liveness {
    pub fn new(grace: Duration) -> Self {
        Self {
            grace,
            registered: None,
            unregistered_since: HashMap::new(),
            removed: HashMap::new(),
        }
    }

    /// Whether etcd's view is known.
    pub fn is_known(&self) -> bool {
        self.registered.is_some()
    }

    pub fn is_registered(&self, worker: &WorkerId) -> bool {
        self.registered
            .as_ref()
            .is_some_and(|set| set.contains(worker))
    }

    /// The full list of registered workers; returns those of them that
    /// were removed from the index (to ask for a resync).
    pub fn listed(&mut self, workers: impl IntoIterator<Item = WorkerId>) -> Vec<WorkerId> {
        let set: HashSet<WorkerId> = workers.into_iter().collect();
        self.unregistered_since.retain(|w, _| !set.contains(w));
        let mut back: Vec<WorkerId> = set
            .iter()
            .filter(|w| self.removed.remove(*w).is_some())
            .cloned()
            .collect();
        back.sort();
        self.registered = Some(set);
        back
    }

    /// The worker registered; returns whether it was removed from the
    /// index before (to ask for a resync).
    pub fn up(&mut self, worker: WorkerId) -> bool {
        self.unregistered_since.remove(&worker);
        let back = self.removed.remove(&worker).is_some();
        if let Some(set) = &mut self.registered {
            set.insert(worker);
        }
        back
    }

    /// The worker was removed from the index (its key deleted, or swept).
    pub fn removed(&mut self, worker: WorkerId, now: Instant) {
        self.removed
            .retain(|_, at| now.duration_since(*at) < REMEMBER_REMOVED);
        self.removed.insert(worker, now);
    }

    /// The worker's key is gone: the caller removes it from the index now.
    pub fn down(&mut self, worker: &WorkerId) {
        self.unregistered_since.remove(worker);
        if let Some(set) = &mut self.registered {
            set.remove(worker);
        }
    }

    /// etcd's view is lost until the next listing; grace periods restart.
    pub fn lost(&mut self) {
        self.registered = None;
        self.unregistered_since.clear();
    }

    /// Of the workers the index knows, those unregistered for the grace
    /// period or longer (to remove now).
    pub fn sweep<'a>(
        &mut self,
        known: impl IntoIterator<Item = &'a WorkerId>,
        now: Instant,
    ) -> Vec<WorkerId> {
        let Some(registered) = &self.registered else {
            return Vec::new();
        };
        let mut seen = HashSet::new();
        let mut due = Vec::new();
        for worker in known {
            if registered.contains(worker) || !seen.insert(worker.clone()) {
                continue;
            }
            let since = *self.unregistered_since.entry(worker.clone()).or_insert(now);
            if now.duration_since(since) >= self.grace {
                due.push(worker.clone());
            }
        }
        self.unregistered_since
            .retain(|w, _| seen.contains(w) && !due.contains(w));
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(name: &str) -> WorkerId {
        WorkerId::new(name, 0).unwrap()
    }

    #[test]
    fn unregistered_workers_leave_after_the_grace() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(10);
        let mut live = Liveness::new(grace);
        let known = [w("a"), w("b"), w("c")];
        // Before etcd is listed, nobody is swept.
        assert!(live.sweep(&known, t0 + grace * 5).is_empty());
        live.listed([w("a")]);
        assert!(live.sweep(&known, t0).is_empty());
        // b registers within the grace; c does not.
        live.up(w("b"));
        assert_eq!(live.sweep(&known, t0 + grace), vec![w("c")]);
        // Removed workers are forgotten; a is still registered.
        assert!(live.sweep(&known[..2], t0 + grace * 2).is_empty());
        // a's key is deleted: the caller removes it at once; if a batch
        // brings it back unregistered, it goes after a new grace.
        live.down(&w("a"));
        assert!(!live.is_registered(&w("a")));
        assert!(live.sweep(&known[..1], t0 + grace * 3).is_empty());
        assert_eq!(live.sweep(&known[..1], t0 + grace * 4), vec![w("a")]);
    }

    #[test]
    fn a_removed_worker_that_registers_again_is_named_once() {
        let t0 = Instant::now();
        let mut live = Liveness::new(Duration::from_secs(10));
        live.listed([w("a"), w("b")]);
        // a's lease lapsed: removed; it registers again under a new lease.
        live.down(&w("a"));
        live.removed(w("a"), t0);
        assert!(live.up(w("a")));
        assert!(!live.up(w("a")), "named once");
        // b was swept; the next listing (a watch lost meanwhile) has it.
        live.removed(w("b"), t0);
        live.lost();
        assert_eq!(live.listed([w("a"), w("b")]), vec![w("b")]);
        assert!(live.listed([w("a"), w("b")]).is_empty());
        // A worker that never registered before is not asked.
        assert!(!live.up(w("c")));
        // Removed workers are forgotten after an hour.
        live.removed(w("d"), t0);
        live.removed(w("e"), t0 + REMEMBER_REMOVED);
        assert!(!live.up(w("d")));
        assert!(live.up(w("e")));
    }

    #[test]
    fn a_lost_watch_suspends_and_restarts_the_grace() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(10);
        let mut live = Liveness::new(grace);
        live.listed([]);
        assert!(live.sweep(&[w("x")], t0).is_empty());
        live.lost();
        assert!(live.sweep(&[w("x")], t0 + grace).is_empty());
        live.listed([]);
        assert!(live.sweep(&[w("x")], t0 + grace).is_empty());
        assert_eq!(live.sweep(&[w("x")], t0 + grace * 2), vec![w("x")]);
    }

    #[test]
    fn malformed_records_name_their_worker_by_key() {
        let change = WorkerChange::Malformed {
            key: format!("{}d3.1", subjects::ETCD_WORKERS_PREFIX),
            error: "garbage".into(),
        };
        assert_eq!(worker_of(&change), Some(WorkerId::new("d3", 1).unwrap()));
        let bad = WorkerChange::Malformed {
            key: "/elsewhere".into(),
            error: "garbage".into(),
        };
        assert_eq!(worker_of(&bad), None);
    }
}
