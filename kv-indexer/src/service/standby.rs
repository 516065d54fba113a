//! The indexer before it leads: bound and serving HTTP, connected to NATS
//! and etcd, campaigning in the leader election
//! ([`protocol::subjects::ETCD_INDEXER_ELECTION`]). While it waits it is a
//! standby: `/healthz` says ok, `/readyz` says 503 "standby", `/status`
//! names the role and the leader, `kv_indexer_leader` is 0. It consumes no
//! KV event and publishes nothing: once elected it recovers from the
//! latest snapshot and the delta log ([`super::recovery`]) like a
//! restarted indexer, and leads.

use std::time::Duration;

use bus::{Leadership, Registry, RegistryError};
use protocol::subjects;
use tokio::sync::mpsc;

use super::http::StatusRequest;

/// The role an indexer plays, shown by `/status`, `/readyz` and the
/// `kv_indexer_leader` gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Campaigning: a standby.
    Standby,
    /// Elected, recovering the index before it consumes.
    Recovering,
    /// Consuming KV events and publishing deltas.
    Leader,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Standby => "standby",
            Role::Recovering => "recovering",
            Role::Leader => "leader",
        }
    }
}

/// Campaigns as `candidate` under a lease of `ttl` until elected,
/// answering `/status` requests as a standby meanwhile.
pub async fn campaign(
    registry: &Registry,
    candidate: &str,
    ttl: Duration,
    status_rx: &mut mpsc::Receiver<StatusRequest>,
) -> Result<Leadership, RegistryError> {
    let election = registry.campaign(subjects::ETCD_INDEXER_ELECTION, candidate, ttl);
    let mut election = std::pin::pin!(election);
    tracing::info!(candidate, ?ttl, "campaigning for the indexer's leadership");
    loop {
        tokio::select! {
            elected = &mut election => return elected,
            Some(reply) = status_rx.recv() => {
                let leader = registry
                    .leader(subjects::ETCD_INDEXER_ELECTION)
                    .await
                    .unwrap_or_else(|e| Some(format!("unknown ({e})")));
                let _ = reply.send(serde_json::json!({
                    "role": Role::Standby.as_str(),
                    "candidate": candidate,
                    "leader": leader,
                }));
            }
        }
    }
}
