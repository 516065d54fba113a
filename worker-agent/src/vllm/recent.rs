//! The engine's recent inter-token latency, from the cumulative totals of
//! its latency histogram ([`super::prom::LatencyTotals`]) scraped over
//! time: the mean of the observations of about the last [`WINDOW_MS`].
//! What the load report says as `recent_itl_us`. Pure: the scrape loop
//! feeds it the totals and its clock.

use std::collections::VecDeque;

use super::prom::LatencyTotals;

/// How far back the mean reaches: a request's ITL target is a mean over
/// its whole answer, so one step with a long prefill chunk mixed in should
/// not swing it; long enough for tens of decode steps.
pub const WINDOW_MS: u64 = 2_000;

/// Scrapes kept (a bound for a scrape interval far below the window).
const MAX_POINTS: usize = 256;

/// Scraped totals within the window (see the module documentation).
#[derive(Debug, Default)]
pub struct RecentLatency {
    points: VecDeque<(u64, LatencyTotals)>,
}

impl RecentLatency {
    /// Takes the totals scraped at `at_ms` (a monotonic clock). Totals
    /// going backwards (the engine restarted) start the window over; an
    /// engine without the histogram (`None`) leaves it as it is.
    pub fn observe(&mut self, at_ms: u64, totals: Option<LatencyTotals>) {
        let Some(t) = totals else {
            return;
        };
        if !(t.sum_s.is_finite() && t.count.is_finite()) {
            return;
        }
        if let Some((_, last)) = self.points.back() {
            if t.count < last.count || t.sum_s < last.sum_s {
                self.points.clear();
            }
        }
        self.points.push_back((at_ms, t));
        // Keep the newest point at or before the window's start: the mean
        // covers the whole window; but not one from before a gap in the
        // scrapes of more than a window (the mean would reach back across
        // it).
        let start = at_ms.saturating_sub(WINDOW_MS);
        while self.points.len() > 2 && self.points[1].0 <= start {
            self.points.pop_front();
        }
        if self.points.len() > 1 && self.points[0].0 < start.saturating_sub(WINDOW_MS) {
            self.points.pop_front();
        }
        if self.points.len() > MAX_POINTS {
            self.points.pop_front();
        }
    }

    /// The mean latency of the observations in the window, µs; 0 when
    /// there were none (nothing decoded lately, or one scrape so far).
    pub fn mean_us(&self) -> u32 {
        let (Some((_, first)), Some((_, last))) = (self.points.front(), self.points.back()) else {
            return 0;
        };
        let count = last.count - first.count;
        if count < 1.0 {
            return 0;
        }
        let mean_us = (last.sum_s - first.sum_s) / count * 1e6;
        // `as` saturates.
        mean_us.round().max(0.0) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(sum_s: f64, count: f64) -> Option<LatencyTotals> {
        Some(LatencyTotals { sum_s, count })
    }

    #[test]
    fn the_mean_of_the_tokens_within_the_window() {
        let mut r = RecentLatency::default();
        r.observe(0, totals(10.0, 100.0));
        assert_eq!(r.mean_us(), 0, "one scrape says nothing of lately");
        // 50 tokens at 40 ms.
        r.observe(1_000, totals(12.0, 150.0));
        assert_eq!(r.mean_us(), 40_000);
        // 50 more at 60 ms: the window holds both.
        r.observe(2_000, totals(15.0, 200.0));
        assert_eq!(r.mean_us(), 50_000);
        // The first second left the window.
        r.observe(3_000, totals(18.0, 250.0));
        assert_eq!(r.mean_us(), 60_000);
        // Nothing decoded for a whole window.
        r.observe(4_000, totals(18.0, 250.0));
        r.observe(5_000, totals(18.0, 250.0));
        assert_eq!(r.mean_us(), 0);
    }

    #[test]
    fn restarts_missing_histograms_and_gaps_in_the_scrapes() {
        let mut r = RecentLatency::default();
        r.observe(0, totals(10.0, 100.0));
        r.observe(500, totals(12.0, 150.0));
        r.observe(600, None);
        assert_eq!(r.mean_us(), 40_000);
        r.observe(1_000, totals(0.5, 10.0));
        assert_eq!(r.mean_us(), 0);
        r.observe(1_500, totals(1.5, 30.0));
        assert_eq!(r.mean_us(), 50_000);
        r.observe(2_000, totals(f64::NAN, 40.0));
        assert_eq!(r.mean_us(), 50_000);
        // Scrapes failed for 10 s: the next one says nothing of lately yet,
        // the one after it does.
        r.observe(12_000, totals(100.0, 1_030.0));
        assert_eq!(r.mean_us(), 0);
        r.observe(12_500, totals(101.0, 1_050.0));
        assert_eq!(r.mean_us(), 50_000);
    }

    #[test]
    fn frequent_scrapes_keep_a_bounded_window() {
        let mut r = RecentLatency::default();
        for i in 0..10_000u64 {
            r.observe(i, totals(i as f64 * 0.03, i as f64));
        }
        assert!(r.points.len() <= MAX_POINTS);
        assert_eq!(r.mean_us(), 30_000);
    }
}
