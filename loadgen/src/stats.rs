//! Latency samples and their percentiles.

use std::time::Duration;

/// Latencies of one kind, in microseconds.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    us: Vec<u64>,
}

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.us.push(d.as_micros() as u64);
    }

    pub fn len(&self) -> usize {
        self.us.len()
    }

    /// Nearest-rank percentile in milliseconds (0 when empty).
    pub fn percentile_ms(&mut self, p: f64) -> f64 {
        if self.us.is_empty() {
            return 0.0;
        }
        self.us.sort_unstable();
        let rank = ((p * self.us.len() as f64).ceil() as usize).clamp(1, self.us.len());
        self.us[rank - 1] as f64 / 1e3
    }

    /// `{"p50": .., "p90": .., "p99": .., "max": ..}` in milliseconds.
    pub fn summary(&mut self) -> serde_json::Value {
        serde_json::json!({
            "p50": round3(self.percentile_ms(0.50)),
            "p90": round3(self.percentile_ms(0.90)),
            "p99": round3(self.percentile_ms(0.99)),
            "max": round3(self.percentile_ms(1.0)),
        })
    }
}

pub fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let mut s = Samples::default();
        for ms in 1..=100 {
            s.push(Duration::from_millis(ms));
        }
        assert_eq!(s.percentile_ms(0.5), 50.0);
        assert_eq!(s.percentile_ms(0.99), 99.0);
        assert_eq!(s.percentile_ms(1.0), 100.0);
        assert_eq!(Samples::default().percentile_ms(0.5), 0.0);
    }
}
