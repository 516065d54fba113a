//! Asking a worker's agent to resynchronise: after a gap in its batches the
//! indexer ignores the worker's epoch until the agent starts a new one with
//! its whole block set.
//!
//! The request goes to `subjects::resync(worker)` with an empty body; the
//! agent answers with a [`ResyncReply`] once it has published the new
//! epoch's first batch.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use protocol::{subjects, Message, ResyncReply, WorkerId};

/// At most one request per worker per interval. Time is an argument.
#[derive(Debug)]
pub struct ResyncLimiter {
    interval: Duration,
    last: HashMap<WorkerId, Instant>,
}

impl ResyncLimiter {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: HashMap::new(),
        }
    }

    /// Whether a request may go to `worker` now (and if so, records it).
    pub fn allow(&mut self, worker: &WorkerId, now: Instant) -> bool {
        match self.last.get_mut(worker) {
            Some(last) if now.duration_since(*last) < self.interval => false,
            Some(last) => {
                *last = now;
                true
            }
            None => {
                self.last.insert(worker.clone(), now);
                true
            }
        }
    }

    /// The worker left: forget it.
    pub fn forget(&mut self, worker: &WorkerId) {
        self.last.remove(worker);
    }
}

/// How a resync request ended.
#[derive(Debug)]
pub enum ResyncOutcome {
    Replied(ResyncReply),
    Failed(String),
    TimedOut,
}

/// Sends one resync request and waits for the reply.
pub async fn request(
    client: async_nats::Client,
    worker: &WorkerId,
    timeout: Duration,
) -> ResyncOutcome {
    let subject = subjects::resync(worker);
    match tokio::time::timeout(timeout, client.request(subject, bytes::Bytes::new())).await {
        Err(_) => ResyncOutcome::TimedOut,
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::TimedOut => ResyncOutcome::TimedOut,
        Ok(Err(e)) => ResyncOutcome::Failed(e.to_string()),
        Ok(Ok(reply)) => match ResyncReply::decode(&reply.payload) {
            Ok(reply) => ResyncOutcome::Replied(reply),
            Err(e) => ResyncOutcome::Failed(format!("malformed reply: {e}")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_request_per_worker_per_interval() {
        let t0 = Instant::now();
        let second = Duration::from_secs(1);
        let mut limiter = ResyncLimiter::new(second * 5);
        let a = WorkerId::new("a", 0).unwrap();
        let b = WorkerId::new("b", 0).unwrap();
        assert!(limiter.allow(&a, t0));
        assert!(!limiter.allow(&a, t0 + second));
        assert!(limiter.allow(&b, t0 + second));
        assert!(limiter.allow(&a, t0 + second * 5));
        assert!(!limiter.allow(&a, t0 + second * 6));
        limiter.forget(&a);
        assert!(limiter.allow(&a, t0 + second * 6));
    }
}
