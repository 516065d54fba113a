//! The load rule: bypass while the prefill side is busy and the decode side
//! is not.

use protocol::Path;
use serde::{Deserialize, Serialize};

use super::{rules, ConditionalDisaggPolicy, PolicyInput, Verdict};

/// Bypass iff the prefill side is busy (the chosen prefill worker's queued
/// prefill tokens `> prefill_busy ×` its max batched tokens) and the decode
/// worker is not (its KV usage `< decode_busy`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadBased {
    /// Queued prefill tokens, in max-size steps, above which the prefill
    /// worker is busy. Default 2.0: a new prompt would wait more than two
    /// full prefill steps before starting.
    pub prefill_busy: f64,
    /// KV usage from which the decode worker is too busy to prefill.
    /// Default 0.8: leaves room for the prompt and for decode growth below
    /// the busy filter (0.9) and the gate (0.95).
    pub decode_busy: f64,
}

impl Default for LoadBased {
    fn default() -> Self {
        Self {
            prefill_busy: 2.0,
            decode_busy: 0.8,
        }
    }
}

pub(super) struct LoadCheck {
    queued: u64,
    limit: f64,
    usage: f64,
    prefill_busy: bool,
    decode_free: bool,
}

impl LoadBased {
    pub(super) fn check(&self, input: &PolicyInput<'_>) -> LoadCheck {
        let queued = input.prefill.load.queued_prefill_tokens;
        let limit = self.prefill_busy * f64::from(input.prefill.record.max_batched_tokens);
        let usage = input.decode.load.kv_usage();
        LoadCheck {
            queued,
            limit,
            usage,
            prefill_busy: queued as f64 > limit,
            decode_free: usage < self.decode_busy,
        }
    }

    pub(super) fn clause(
        &self,
        c: &LoadCheck,
        input: &PolicyInput<'_>,
    ) -> (Path, &'static str, String) {
        let (p, d) = (input.prefill.id, input.decode.id);
        let mbt = input.prefill.record.max_batched_tokens;
        if c.prefill_busy && c.decode_free {
            let text = format!(
                "{p} has {} queued prefill tokens > {:.2} × {mbt} and {d} KV use {:.2} < {:.2}: bypass on {d}",
                c.queued, self.prefill_busy, c.usage, self.decode_busy
            );
            (Path::Bypass, rules::LOAD_PREFILL_BUSY, text)
        } else if !c.prefill_busy {
            let text = format!(
                "{p} has {} queued prefill tokens <= {:.2} × {mbt} = {:.0}: remote prefill on {p}",
                c.queued, self.prefill_busy, c.limit
            );
            (Path::Remote, rules::LOAD_PREFILL_FREE, text)
        } else {
            let text = format!(
                "{p} is busy ({} queued prefill tokens > {:.2} × {mbt}) but {d} KV use {:.2} >= {:.2}: remote prefill on {p}",
                c.queued, self.prefill_busy, c.usage, self.decode_busy
            );
            (Path::Remote, rules::LOAD_DECODE_BUSY, text)
        }
    }
}

impl ConditionalDisaggPolicy for LoadBased {
    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        let (path, rule, reason) = self.clause(&self.check(input), input);
        Verdict::new(path, rule, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::tests::{load, Fixture};

    #[test]
    fn load_rule_at_and_around_its_thresholds() {
        let f = Fixture::new();
        let policy = LoadBased::default(); // 2.0 × 8192 = 16384 tokens, 0.8
                                           // (p queued, d used of 10 000, path, rule)
        let table = [
            (16_385, 7_999, Path::Bypass, rules::LOAD_PREFILL_BUSY),
            (16_384, 7_999, Path::Remote, rules::LOAD_PREFILL_FREE),
            (16_383, 7_999, Path::Remote, rules::LOAD_PREFILL_FREE),
            (16_385, 8_000, Path::Remote, rules::LOAD_DECODE_BUSY),
            (16_385, 8_001, Path::Remote, rules::LOAD_DECODE_BUSY),
            (0, 0, Path::Remote, rules::LOAD_PREFILL_FREE),
        ];
        for (queued, used, path, rule) in table {
            let v = policy.decide(&f.input(4_000, 0, load(0, used), load(queued, 0)));
            assert_eq!((v.path, v.rule), (path, rule), "{}", v.reason);
        }
    }
}
