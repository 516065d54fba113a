//! The inter-token latency histogram vLLM exports
//! (`vllm:inter_token_latency_seconds`; before 0.10
//! `vllm:time_per_output_token_seconds`): one observation per output token
//! after a request's first, the time since the token before it. What the
//! agent's vLLM adapter reads its recent ITL from.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// The histogram's name.
pub const NAME: &str = "vllm:inter_token_latency_seconds";
/// Its name before vLLM 0.10.
pub const OLD_NAME: &str = "vllm:time_per_output_token_seconds";

/// Upper bounds of the buckets, seconds (`+Inf` besides).
const BUCKETS: [f64; 8] = [0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0];

/// Observations so far.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ItlHistogram {
    /// Observations at or under each bound (not cumulative).
    buckets: [u64; BUCKETS.len()],
    sum_s: f64,
    count: u64,
}

impl ItlHistogram {
    /// `tokens` that arrived together `interval` after the request's
    /// previous token: each observed at its share of the interval.
    pub fn observe(&mut self, interval: Duration, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let each = interval.as_secs_f64() / tokens as f64;
        if let Some(i) = BUCKETS.iter().position(|&b| each <= b) {
            self.buckets[i] += tokens;
        }
        self.sum_s += interval.as_secs_f64();
        self.count += tokens;
    }

    /// The histogram's samples as `name` under `labels` (without braces).
    pub fn write(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (bound, n) in BUCKETS.iter().zip(self.buckets) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", self.sum_s);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// When one request's last tokens came.
#[derive(Debug, Default)]
pub struct TokenClock {
    last: Option<Instant>,
}

impl TokenClock {
    /// `tokens` came at `now`: the interval since the request's previous
    /// ones (`None` for its first).
    pub fn tick(&mut self, now: Instant, tokens: usize) -> Option<(Duration, u64)> {
        if tokens == 0 {
            return None;
        }
        let since = self.last.map(|last| (now - last, tokens as u64));
        self.last = Some(now);
        since
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_after_the_first_are_observed_at_their_share_of_the_interval() {
        let mut clock = TokenClock::default();
        let mut h = ItlHistogram::default();
        let t0 = Instant::now();
        assert_eq!(clock.tick(t0, 1), None, "the first token has no interval");
        for (ms, tokens) in [(40, 1), (160, 2), (2_000, 1)] {
            let t = t0 + Duration::from_millis(ms);
            if let Some((interval, n)) = clock.tick(t, tokens) {
                h.observe(interval, n);
            }
        }
        // 40 ms, then two at 60 ms each, then 1.84 s.
        assert_eq!(h.count, 4);
        assert!((h.sum_s - 2.0).abs() < 1e-9);
        let mut out = String::new();
        h.write(&mut out, NAME, "engine=\"0\"");
        assert!(
            out.contains("_bucket{engine=\"0\",le=\"0.05\"} 1\n"),
            "{out}"
        );
        assert!(
            out.contains("_bucket{engine=\"0\",le=\"0.075\"} 3\n"),
            "{out}"
        );
        assert!(out.contains("_bucket{engine=\"0\",le=\"1\"} 3\n"), "{out}");
        assert!(
            out.contains("_bucket{engine=\"0\",le=\"+Inf\"} 4\n"),
            "{out}"
        );
        assert!(out.contains("_count{engine=\"0\"} 4\n"), "{out}");
    }
}
