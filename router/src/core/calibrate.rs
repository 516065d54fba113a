//! Online calibration of the SLA policy's predictions: correction factors
//! learnt from what requests were observed to take, against what the
//! policy predicted for them when it decided.
//!
//! Plain state fed by explicit inputs (sans-IO): [`Calibration::expect`]
//! when a decision is made, [`Calibration::prefill_done`] when its prefill
//! is done (the first token of a bypass, the end of a remote prefill), and
//! [`Calibration::decoded`] when its decode finished, with its time and
//! token count. Each factor is `sum(observed) / sum(predicted)` over the
//! observations so far, every older one weighing `1 - 1 / WINDOW` less per
//! newer one: the same inputs in the same order give the same factors.
//! The factors a decision used are recorded with it, so that replay
//! re-decides with them ([`Calibration::set_factors`]).

use std::collections::{HashMap, VecDeque};

use protocol::{DecisionId, Path};

/// Observations that make up a factor: one `WINDOW` observations old weighs
/// `1/e` of a new one.
pub const WINDOW: f64 = 64.0;

/// Decisions whose observations are awaited, at most (the oldest are
/// dropped: a shell that never reports an observation loses nothing else).
pub const MAX_PENDING: usize = 65_536;

/// The correction factors the SLA policy multiplies its predictions by
/// (1 when nothing was observed yet).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Factors {
    /// Observed / predicted time to a local prefill's first token on the
    /// decode worker (its queue and prefill).
    pub local_ttft: f64,
    /// Observed / predicted time to the end of a remote prefill on the
    /// prefill worker (its queue and prefill; the transfer is not scaled).
    pub remote_ttft: f64,
    /// Observed / predicted mean inter-token latency on the decode worker:
    /// the model's step time at the decision against the request's whole
    /// decode (batch growth and the prefills mixed in later included).
    pub itl: f64,
}

impl Default for Factors {
    fn default() -> Self {
        Self {
            local_ttft: 1.0,
            remote_ttft: 1.0,
            itl: 1.0,
        }
    }
}

impl Factors {
    /// The names they are recorded under, in order.
    pub const NAMES: [&'static str; 3] = ["local_ttft", "remote_ttft", "itl"];

    /// As `(name, value)`, recorded with each decision.
    pub fn named(&self) -> [(&'static str, f64); 3] {
        [
            (Self::NAMES[0], self.local_ttft),
            (Self::NAMES[1], self.remote_ttft),
            (Self::NAMES[2], self.itl),
        ]
    }

    /// From recorded `(name, value)` pairs (missing ones stay 1, unknown
    /// names are ignored: a record of an older release).
    pub fn from_named<'a>(pairs: impl IntoIterator<Item = (&'a str, f64)>) -> Self {
        let mut f = Self::default();
        for (name, value) in pairs {
            match name {
                "local_ttft" => f.local_ttft = value,
                "remote_ttft" => f.remote_ttft = value,
                "itl" => f.itl = value,
                _ => {}
            }
        }
        f
    }
}

/// What the SLA policy predicted for one decision, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Expected {
    /// The path taken.
    pub path: Path,
    /// Uncorrected time from the decision to the end of the prefill on the
    /// path taken.
    pub prefill_ms: f64,
    /// Uncorrected decode step time on the decode worker.
    pub itl_ms: f64,
}

/// A decayed sum of observations and of their predictions.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Ratio {
    observed: f64,
    predicted: f64,
}

impl Ratio {
    fn add(&mut self, observed: f64, predicted: f64) {
        if !(observed.is_finite() && predicted.is_finite() && predicted > 0.0 && observed >= 0.0) {
            return;
        }
        let keep = 1.0 - 1.0 / WINDOW;
        self.observed = self.observed * keep + observed;
        self.predicted = self.predicted * keep + predicted;
    }

    fn factor(&self) -> f64 {
        if self.predicted > 0.0 {
            self.observed / self.predicted
        } else {
            1.0
        }
    }

    fn set(&mut self, factor: f64) {
        *self = Ratio {
            observed: factor,
            predicted: 1.0,
        };
    }
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    at_ms: u64,
    expected: Expected,
    prefill_seen: bool,
}

/// The calibration state (see the module's documentation).
#[derive(Debug, Default, Clone)]
pub struct Calibration {
    local: Ratio,
    remote: Ratio,
    itl: Ratio,
    pending: HashMap<DecisionId, Pending>,
    order: VecDeque<DecisionId>,
}

impl Calibration {
    /// The current factors.
    pub fn factors(&self) -> Factors {
        Factors {
            local_ttft: self.local.factor(),
            remote_ttft: self.remote.factor(),
            itl: self.itl.factor(),
        }
    }

    /// Starts from `factors` as if they had been observed (replay of a
    /// recorded decision).
    pub fn set_factors(&mut self, factors: Factors) {
        self.local.set(factors.local_ttft);
        self.remote.set(factors.remote_ttft);
        self.itl.set(factors.itl);
    }

    /// Observations awaited.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Decision `id`, made at `at_ms`, expects `expected`.
    pub fn expect(&mut self, id: DecisionId, at_ms: u64, expected: Expected) {
        let pending = Pending {
            at_ms,
            expected,
            prefill_seen: false,
        };
        if self.pending.insert(id, pending).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > MAX_PENDING {
            if let Some(old) = self.order.pop_front() {
                self.pending.remove(&old);
            }
        }
    }

    /// Decision `id`'s prefill ended at `at_ms` (a bypass's first token, a
    /// remote prefill's end). False when it is not awaited.
    pub fn prefill_done(&mut self, id: DecisionId, at_ms: u64) -> bool {
        let Some(p) = self.pending.get_mut(&id) else {
            return false;
        };
        if p.prefill_seen {
            return false;
        }
        p.prefill_seen = true;
        let observed = at_ms.saturating_sub(p.at_ms) as f64;
        let ratio = match p.expected.path {
            Path::Bypass => &mut self.local,
            Path::Remote | Path::RemoteFetch => &mut self.remote,
        };
        ratio.add(observed, p.expected.prefill_ms);
        true
    }

    /// Decision `id` decoded `output_tokens` tokens in `decode_ms` from its
    /// first token to its last. False when it is not awaited. Ends the
    /// observations of the decision.
    pub fn decoded(&mut self, id: DecisionId, decode_ms: f64, output_tokens: u32) -> bool {
        let Some(p) = self.pending.remove(&id) else {
            return false;
        };
        if output_tokens >= 2 {
            let itl = decode_ms / f64::from(output_tokens - 1);
            self.itl.add(itl, p.expected.itl_ms);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expected(path: Path, prefill_ms: f64, itl_ms: f64) -> Expected {
        Expected {
            path,
            prefill_ms,
            itl_ms,
        }
    }

    /// Synthetic observations that are a true factor times the prediction,
    /// with zero-mean noise: the factors converge to the true ones, and the
    /// same observations give bit-identical factors.
    #[test]
    fn converges_to_the_true_factor_deterministically() {
        let run = || {
            let mut c = Calibration::default();
            assert_eq!(c.factors(), Factors::default());
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            let mut noise = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2001) as f64 / 1000.0 - 1.0 // [-1, 1]
            };
            for i in 0..2_000u64 {
                let path = if i % 2 == 0 {
                    Path::Bypass
                } else {
                    Path::Remote
                };
                let pred = 100.0 + (i % 37) as f64 * 20.0;
                let itl_pred = 20.0 + (i % 11) as f64;
                let id = DecisionId(i);
                c.expect(id, i * 10, expected(path, pred, itl_pred));
                let truth = if path == Path::Bypass { 1.8 } else { 0.6 };
                let observed = pred * truth * (1.0 + 0.1 * noise());
                assert!(c.prefill_done(id, i * 10 + observed.round() as u64));
                assert!(!c.prefill_done(id, i * 10 + 5), "counted once");
                let tokens = 101;
                let itl = itl_pred * 2.5 * (1.0 + 0.1 * noise());
                assert!(c.decoded(id, itl * 100.0, tokens));
                assert!(!c.decoded(id, 1.0, tokens), "ended");
            }
            c.factors()
        };
        let f = run();
        assert!((f.local_ttft - 1.8).abs() < 0.05, "{f:?}");
        assert!((f.remote_ttft - 0.6).abs() < 0.03, "{f:?}");
        assert!((f.itl - 2.5).abs() < 0.07, "{f:?}");
        let again = run();
        assert_eq!(f.local_ttft.to_bits(), again.local_ttft.to_bits());
        assert_eq!(f.itl.to_bits(), again.itl.to_bits());
    }

    /// A change of regime is followed within a few windows.
    #[test]
    fn follows_a_change() {
        let mut c = Calibration::default();
        for i in 0..1_000u64 {
            let truth = if i < 500 { 3.0 } else { 1.2 };
            c.expect(DecisionId(i), 0, expected(Path::Bypass, 100.0, 10.0));
            c.prefill_done(DecisionId(i), (100.0 * truth) as u64);
        }
        assert!(
            (c.factors().local_ttft - 1.2).abs() < 0.01,
            "{:?}",
            c.factors()
        );
        assert_eq!(c.factors().remote_ttft, 1.0);
    }

    #[test]
    fn recorded_factors_are_restored_exactly_and_pending_is_bounded() {
        let mut c = Calibration::default();
        let f = Factors {
            local_ttft: 1.234_567_891,
            remote_ttft: 0.7,
            itl: 2.000_000_1,
        };
        c.set_factors(f);
        assert_eq!(c.factors(), f);
        assert_eq!(Factors::from_named(f.named()), f);
        for i in 0..(MAX_PENDING as u64 + 10) {
            c.expect(DecisionId(i), 0, expected(Path::Remote, 1.0, 1.0));
        }
        assert_eq!(c.pending(), MAX_PENDING);
        assert!(!c.prefill_done(DecisionId(0), 5), "the oldest was dropped");
        assert!(c.prefill_done(DecisionId(MAX_PENDING as u64 + 9), 5));
    }
}
