//! How long to wait before publishing a batch again: doubling delays up to
//! a cap. Time is a value here; the shell owns the clock.

use std::time::Duration;

/// Delays between failed publishes of the same batch: `first` after the
/// first failure, doubling after each further one, at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The delay after the first failure.
    pub first: Duration,
    /// The longest delay.
    pub max: Duration,
}

impl Backoff {
    /// The agent's backoff: 50 ms, doubling, at most 2 s.
    pub const AGENT: Backoff = Backoff {
        first: Duration::from_millis(50),
        max: Duration::from_secs(2),
    };

    /// The delay before publishing again after `failures` failures in a
    /// row (none after none).
    pub fn delay(&self, failures: u32) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        self.first
            .saturating_mul(1 << (failures - 1).min(16))
            .min(self.max)
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::AGENT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_up_to_a_cap() {
        let b = Backoff::AGENT;
        assert_eq!(b.delay(0), Duration::ZERO);
        assert_eq!(b.delay(1), Duration::from_millis(50));
        assert_eq!(b.delay(3), Duration::from_millis(200));
        assert_eq!(b.delay(60), b.max);
    }
}
