//! The circuit breaker: a worker that failed `failures` dispatches in a
//! row is taken out of rotation (*open*) for `open_for`; then one trial
//! request may go to it (*half-open*): its success closes the breaker, its
//! failure opens it again.
//!
//! Pure: time is an argument, outcomes are told by the caller. The workers
//! a breaker keeps out are passed to the decision as workers to avoid
//! ([`super::RouteOptions::avoid`]), which the decision record keeps: a
//! replay re-decides with the same workers left out, without knowing the
//! breaker. When every decode-capable worker would be left out, the caller
//! leaves none out (a failing worker beats no worker).

use std::collections::HashMap;

use protocol::WorkerId;
use serde::{Deserialize, Serialize};

/// When a worker is taken out of rotation, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive failed dispatches that open a worker's breaker. 0 turns
    /// the breaker off. Default 3.
    pub failures: u32,
    /// How long an open breaker keeps the worker out before a trial
    /// request (ms). Default 10 000.
    #[serde(rename = "open_for", with = "settings::duration_ms")]
    pub open_for_ms: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failures: 3,
            open_for_ms: 10_000,
        }
    }
}

/// One worker's breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// In rotation; failures in a row so far.
    Closed { failures: u32 },
    /// Out of rotation until `until_ms`.
    Open { until_ms: u64 },
    /// One trial request may go; `trial`: it is on its way.
    HalfOpen { trial: bool },
}

impl BreakerState {
    /// `closed`, `open`, `half_open`.
    pub fn label(&self) -> &'static str {
        match self {
            BreakerState::Closed { .. } => "closed",
            BreakerState::Open { .. } => "open",
            BreakerState::HalfOpen { .. } => "half_open",
        }
    }
}

/// A change of a breaker, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Taken out of rotation (after `failures` in a row, or a failed trial).
    Opened { failures: u32 },
    /// A trial request may go.
    HalfOpened,
    /// Back in rotation (a trial succeeded).
    Closed,
}

impl Transition {
    /// The state entered: `open`, `half_open`, `closed`.
    pub fn label(&self) -> &'static str {
        match self {
            Transition::Opened { .. } => "open",
            Transition::HalfOpened => "half_open",
            Transition::Closed => "closed",
        }
    }
}

/// Every worker's breaker (absent: closed, no failure).
#[derive(Debug, Default)]
pub struct Breakers {
    config: BreakerConfig,
    states: HashMap<WorkerId, BreakerState>,
}

impl Breakers {
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            states: HashMap::new(),
        }
    }

    pub fn config(&self) -> &BreakerConfig {
        &self.config
    }

    /// A dispatch to `worker` failed (the worker's fault) at `now_ms`.
    pub fn on_failure(&mut self, worker: &WorkerId, now_ms: u64) -> Option<Transition> {
        if self.config.failures == 0 {
            return None;
        }
        let open = BreakerState::Open {
            until_ms: now_ms.saturating_add(self.config.open_for_ms),
        };
        let state = self
            .states
            .entry(worker.clone())
            .or_insert(BreakerState::Closed { failures: 0 });
        match *state {
            BreakerState::Closed { failures } => {
                let failures = failures + 1;
                if failures >= self.config.failures {
                    *state = open;
                    Some(Transition::Opened { failures })
                } else {
                    *state = BreakerState::Closed { failures };
                    None
                }
            }
            BreakerState::HalfOpen { .. } => {
                *state = open;
                Some(Transition::Opened { failures: 1 })
            }
            // A request routed before it opened: already out.
            BreakerState::Open { .. } => None,
        }
    }

    /// A dispatch to `worker` succeeded.
    pub fn on_success(&mut self, worker: &WorkerId) -> Option<Transition> {
        match self.states.remove(worker) {
            Some(BreakerState::HalfOpen { .. } | BreakerState::Open { .. }) => {
                Some(Transition::Closed)
            }
            _ => None,
        }
    }

    /// A decision chose `worker`: a half-open breaker's trial is on its way.
    pub fn on_routed(&mut self, worker: &WorkerId) {
        if let Some(state @ BreakerState::HalfOpen { trial: false }) = self.states.get_mut(worker) {
            *state = BreakerState::HalfOpen { trial: true };
        }
    }

    /// Moves the open breakers whose time is up by `now_ms` to half-open;
    /// returns them, in id order.
    pub fn tick(&mut self, now_ms: u64) -> Vec<WorkerId> {
        let mut due: Vec<WorkerId> = self
            .states
            .iter_mut()
            .filter_map(|(worker, state)| match *state {
                BreakerState::Open { until_ms } if until_ms <= now_ms => {
                    *state = BreakerState::HalfOpen { trial: false };
                    Some(worker.clone())
                }
                _ => None,
            })
            .collect();
        due.sort();
        due
    }

    /// The workers out of rotation at `now_ms` (open, or half-open with
    /// their trial on its way), in id order.
    pub fn excluded(&self, now_ms: u64) -> Vec<WorkerId> {
        let mut out: Vec<WorkerId> = self
            .states
            .iter()
            .filter(|(_, state)| match state {
                BreakerState::Open { until_ms } => *until_ms > now_ms,
                BreakerState::HalfOpen { trial } => *trial,
                BreakerState::Closed { .. } => false,
            })
            .map(|(worker, _)| worker.clone())
            .collect();
        out.sort();
        out
    }

    /// A worker's breaker.
    pub fn state(&self, worker: &WorkerId) -> BreakerState {
        self.states
            .get(worker)
            .copied()
            .unwrap_or(BreakerState::Closed { failures: 0 })
    }

    /// A worker that left the registry: its breaker goes with it.
    pub fn forget(&mut self, worker: &WorkerId) {
        self.states.remove(worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(name: &str) -> WorkerId {
        name.parse().unwrap()
    }

    fn breakers() -> Breakers {
        Breakers::new(BreakerConfig {
            failures: 3,
            open_for_ms: 1_000,
        })
    }

    #[test]
    fn opens_after_failures_in_a_row_and_a_success_resets_the_count() {
        let mut b = breakers();
        let d0 = w("d0");
        assert_eq!(b.on_failure(&d0, 0), None);
        assert_eq!(b.on_failure(&d0, 0), None);
        assert_eq!(b.on_success(&d0), None);
        assert_eq!(b.state(&d0), BreakerState::Closed { failures: 0 });
        assert_eq!(b.on_failure(&d0, 10), None);
        assert_eq!(b.on_failure(&d0, 10), None);
        assert!(b.excluded(10).is_empty());
        assert_eq!(
            b.on_failure(&d0, 10),
            Some(Transition::Opened { failures: 3 })
        );
        assert_eq!(b.excluded(10), vec![d0.clone()]);
        assert_eq!(b.excluded(1_009), vec![d0.clone()]);
        assert!(b.tick(1_009).is_empty());
    }

    #[test]
    fn a_trial_closes_or_reopens_it() {
        let mut b = breakers();
        let d0 = w("d0");
        for _ in 0..3 {
            b.on_failure(&d0, 0);
        }
        // Time is up: half-open, back in the candidates for one trial.
        assert_eq!(b.tick(1_000), vec![d0.clone()]);
        assert!(b.excluded(1_000).is_empty());
        b.on_routed(&d0);
        assert_eq!(b.excluded(1_000), vec![d0.clone()], "one trial at a time");
        // The trial fails: open again, for another period.
        assert_eq!(
            b.on_failure(&d0, 1_200),
            Some(Transition::Opened { failures: 1 })
        );
        assert_eq!(b.excluded(2_199), vec![d0.clone()]);
        assert_eq!(b.tick(2_200), vec![d0.clone()]);
        b.on_routed(&d0);
        assert_eq!(b.on_success(&d0), Some(Transition::Closed));
        assert!(b.excluded(2_200).is_empty());
        assert_eq!(b.state(&d0), BreakerState::Closed { failures: 0 });
    }

    #[test]
    fn off_with_zero_failures_and_forgotten_with_the_worker() {
        let mut off = Breakers::new(BreakerConfig {
            failures: 0,
            open_for_ms: 1_000,
        });
        for _ in 0..10 {
            assert_eq!(off.on_failure(&w("d0"), 0), None);
        }
        assert!(off.excluded(0).is_empty());
        let mut b = breakers();
        for _ in 0..3 {
            b.on_failure(&w("d1"), 0);
        }
        b.forget(&w("d1"));
        assert!(b.excluded(0).is_empty());
    }
}
