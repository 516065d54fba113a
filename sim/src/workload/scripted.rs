//! A fixed list of requests, open loop: e.g. a window of the decision log
//! handed over by `replay what-if`.

use std::collections::VecDeque;

use super::{Arrival, RequestSpec, Workload};

/// Requests at given times, served once each.
#[derive(Debug, Default)]
pub struct Scripted {
    arrivals: VecDeque<Arrival>,
    window_us: u64,
}

impl Scripted {
    pub fn new(mut arrivals: Vec<Arrival>) -> Self {
        arrivals.sort_by_key(|a| a.at_us);
        let window_us = arrivals.last().map_or(0, |a| a.at_us + 1);
        Self {
            arrivals: arrivals.into(),
            window_us,
        }
    }
}

impl Workload for Scripted {
    fn next_arrival(&mut self) -> Option<Arrival> {
        self.arrivals.pop_front()
    }

    fn on_finished(&mut self, _request: &RequestSpec, _now_us: u64) -> Option<Arrival> {
        None
    }

    fn arrival_window_us(&self) -> u64 {
        self.window_us
    }
}
