//! Answers routers' liveness probes (`subjects::ping`) with an empty
//! message, from its own task: from registration until the agent has
//! drained, so that a router waiting on a quiet leg can tell an agent that
//! is busy (it answers) from one that is gone (NATS says "no responders").

use async_nats::{Client, Subscriber};
use futures::StreamExt;
use tokio::task::JoinHandle;
use tracing::debug;

/// Answers every probe on `probes` until aborted.
pub(super) fn answer(client: Client, mut probes: Subscriber) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(probe) = probes.next().await {
            let Some(reply) = probe.reply else { continue };
            if let Err(e) = client.publish(reply, Default::default()).await {
                debug!(error = %e, "answering a probe failed");
            }
        }
    })
}
