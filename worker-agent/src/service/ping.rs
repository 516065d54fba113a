//! Answers routers' liveness probes (`subjects::ping`), from its own task:
//! from registration until the agent has drained, so that a router waiting
//! on a quiet leg can tell an agent that is busy (it answers) from one that
//! is gone (NATS says "no responders"). A probe that names a leg
//! (`LegProbe`) is answered with whether this agent still generates it
//! ([`InFlight`]): a leg it does not hold was lost on the bus, and the
//! router retries it. Any other probe gets an empty answer.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use async_nats::{Client, Subscriber};
use futures::StreamExt;
use protocol::{DecisionId, LegProbe, LegProbeReply, Message};
use tokio::task::JoinHandle;
use tracing::debug;

/// The decisions whose streams this agent is generating, shared by the
/// loop (which adds them) and the probe task (which reads them).
#[derive(Debug, Clone, Default)]
pub(super) struct InFlight(Arc<Mutex<HashSet<DecisionId>>>);

/// A stream's place in [`InFlight`]: removed when dropped (the stream
/// ended, failed or was aborted).
#[derive(Debug)]
pub(super) struct Held {
    set: InFlight,
    decision: DecisionId,
}

impl InFlight {
    /// Marks `decision` as being generated until the returned guard drops.
    pub(super) fn hold(&self, decision: DecisionId) -> Held {
        self.lock().insert(decision);
        Held {
            set: self.clone(),
            decision,
        }
    }

    pub(super) fn contains(&self, decision: DecisionId) -> bool {
        self.lock().contains(&decision)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<DecisionId>> {
        self.0.lock().expect("no panic while held")
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.set.lock().remove(&self.decision);
    }
}

/// Answers every probe on `probes` until aborted.
pub(super) fn answer(client: Client, mut probes: Subscriber, legs: InFlight) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(probe) = probes.next().await {
            let Some(reply) = probe.reply else { continue };
            let answer = match LegProbe::decode(&probe.payload) {
                Ok(LegProbe { decision }) => LegProbeReply {
                    decision,
                    in_flight: legs.contains(decision),
                }
                .encode()
                .into(),
                Err(_) => Default::default(),
            };
            if let Err(e) = client.publish(reply, answer).await {
                debug!(error = %e, "answering a probe failed");
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_decision_is_in_flight_until_its_guard_drops() {
        let legs = InFlight::default();
        let held = legs.hold(DecisionId(7));
        assert!(legs.contains(DecisionId(7)));
        assert!(!legs.contains(DecisionId(8)));
        drop(held);
        assert!(!legs.contains(DecisionId(7)));
    }
}
