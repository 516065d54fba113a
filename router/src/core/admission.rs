//! Admission at the door: when every decode candidate is busy (the
//! router is *saturated*: [`DecodeSelection::is_busy`] for each), a new
//! request waits in a bounded FIFO queue instead of piling onto a worker
//! that cannot admit it; when the queue is full, or a request waited its
//! longest, it is turned away (the service answers 429 with
//! `Retry-After`). Nothing is reserved in the ledger until a request
//! leaves the queue to be decided.
//!
//! Pure: time is an argument, and the caller says when the saturation may
//! have changed (a load report, a finish, a tick) by asking for
//! [`Admission::next`].

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::select::DecodeSelection;
use super::workers::Workers;
use protocol::WorkerId;

/// The admission queue's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Requests that may wait while the router is saturated; one more is
    /// turned away at once. 0: none waits. Default 256.
    pub max_queued: usize,
    /// Longest a request waits in the queue before it is turned away (ms).
    /// Default 10 000.
    #[serde(rename = "max_wait", with = "settings::duration_ms")]
    pub max_wait_ms: u64,
    /// What a turned-away client is told to wait before retrying
    /// (`Retry-After`, s). Default 1.
    pub retry_after_s: u32,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            max_queued: 256,
            max_wait_ms: 10_000,
            retry_after_s: 1,
        }
    }
}

/// What became of an offered request.
#[derive(Debug, PartialEq, Eq)]
pub enum Offer<T> {
    /// Decide it now.
    Admit(T),
    /// It waits in the queue (at this position, from 1).
    Queued(usize),
    /// The queue is full: turn it away.
    Rejected(T),
}

#[derive(Debug)]
struct Waiting<T> {
    item: T,
    since_ms: u64,
}

/// The queue of requests waiting for a free decode worker.
#[derive(Debug)]
pub struct Admission<T> {
    config: AdmissionConfig,
    queue: VecDeque<Waiting<T>>,
}

impl<T> Admission<T> {
    pub fn new(config: AdmissionConfig) -> Self {
        Self {
            config,
            queue: VecDeque::new(),
        }
    }

    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    /// A new request at `now_ms`: admitted when the router is not
    /// saturated and no one waits before it (first come, first served),
    /// else queued while there is room, else rejected.
    pub fn offer(&mut self, item: T, saturated: bool, now_ms: u64) -> Offer<T> {
        if !saturated && self.queue.is_empty() {
            return Offer::Admit(item);
        }
        if self.queue.len() >= self.config.max_queued {
            return Offer::Rejected(item);
        }
        self.queue.push_back(Waiting {
            item,
            since_ms: now_ms,
        });
        Offer::Queued(self.queue.len())
    }

    /// The next request to decide, when the router is not saturated.
    pub fn next(&mut self, saturated: bool) -> Option<T> {
        if saturated {
            return None;
        }
        self.queue.pop_front().map(|w| w.item)
    }

    /// The requests that waited longer than `max_wait` by `now_ms`, in
    /// queue order, with how long each waited (ms).
    pub fn expire(&mut self, now_ms: u64) -> Vec<(T, u64)> {
        let mut expired = Vec::new();
        while let Some(front) = self.queue.front() {
            let waited = now_ms.saturating_sub(front.since_ms);
            if waited <= self.config.max_wait_ms {
                break;
            }
            let w = self.queue.pop_front().expect("front exists");
            expired.push((w.item, waited));
        }
        expired
    }

    /// Drops the waiting requests `keep` refuses (their clients left).
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        self.queue.retain(|w| keep(&w.item));
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// Whether every registered decode candidate not in `avoid` is busy (and
/// there is one): a request decided now would land on a worker that
/// cannot admit it.
pub fn saturated(workers: &Workers, selection: &DecodeSelection, avoid: &[WorkerId]) -> bool {
    let mut any = false;
    for &slot in workers.decode_slots() {
        let s = workers.slot(slot);
        if avoid.contains(&s.id) {
            continue;
        }
        any = true;
        if !selection.is_busy(&s.effective()) {
            return false;
        }
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max_queued: usize) -> Admission<u32> {
        Admission::new(AdmissionConfig {
            max_queued,
            max_wait_ms: 1_000,
            retry_after_s: 1,
        })
    }

    #[test]
    fn admits_while_free_queues_while_saturated_and_rejects_past_the_bound() {
        let mut a = admission(2);
        assert_eq!(a.offer(1, false, 0), Offer::Admit(1));
        assert_eq!(a.offer(2, true, 0), Offer::Queued(1));
        assert_eq!(a.offer(3, true, 0), Offer::Queued(2));
        assert_eq!(a.offer(4, true, 0), Offer::Rejected(4));
        // Free again, but two wait: a newcomer queues behind them.
        assert_eq!(a.offer(5, false, 0), Offer::Rejected(5));
        assert_eq!(a.next(true), None);
        assert_eq!(a.next(false), Some(2));
        assert_eq!(a.offer(6, false, 0), Offer::Queued(2));
        assert_eq!(a.next(false), Some(3));
        assert_eq!(a.next(false), Some(6));
        assert_eq!(a.next(false), None);
        assert_eq!(a.offer(7, false, 0), Offer::Admit(7));
    }

    #[test]
    fn no_queue_rejects_at_once_when_saturated() {
        let mut a = admission(0);
        assert_eq!(a.offer(1, true, 0), Offer::Rejected(1));
        assert_eq!(a.offer(2, false, 0), Offer::Admit(2));
    }

    #[test]
    fn waiting_too_long_expires_in_order() {
        let mut a = admission(8);
        a.offer(1, true, 0);
        a.offer(2, true, 500);
        a.offer(3, true, 900);
        assert!(a.expire(1_000).is_empty());
        assert_eq!(a.expire(1_501), vec![(1, 1_501), (2, 1_001)]);
        a.retain(|&i| i != 3);
        assert!(a.is_empty());
    }
}
