//! The indexer before it leads: bound and serving HTTP, connected to NATS
//! and etcd, campaigning in the leader election
//! ([`protocol::subjects::ETCD_INDEXER_ELECTION`]). While it waits it is a
//! standby: `/healthz` says ok, `/readyz` says 503 "standby", `/status`
//! names the role and the leader, `kv_indexer_leader` is 0. It consumes no
//! KV event and publishes nothing but its probes of the leader (see
//! [`campaign`]): once elected it recovers from the latest snapshot and the
//! delta log ([`super::recovery`]) like a restarted indexer, and leads.

use std::time::Duration;

use async_nats::RequestErrorKind;
use bus::{LeaderEntry, Leadership, Registry, RegistryError};
use futures::StreamExt;
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

/// How often a standby asks the leader whether it is there
/// ([`subjects::INDEX_LEADER`]).
const PROBE_EVERY: Duration = Duration::from_millis(200);
/// Answers of "no responders" in a row, with the same leader (one that
/// answered this standby before) in the election throughout, after which
/// the leader is taken for dead and its lease revoked: 0.4-0.6 s, where
/// the lease's TTL would take 1-1.5 s. A leader whose NATS connection
/// moves to another node usually answers again well within that.
const SILENT_PROBES: u32 = 3;

/// Campaigns as `candidate` under a lease of `ttl` until elected,
/// answering `/status` requests as a standby meanwhile. It also asks the
/// leader over NATS whether it is there, and revokes the lease of a leader
/// that answered before and then nobody answers for ([`SILENT_PROBES`]):
/// a killed leader is replaced before its lease would run out.
pub async fn campaign(
    registry: &Registry,
    client: &async_nats::Client,
    candidate: &str,
    ttl: Duration,
    status_rx: &mut mpsc::Receiver<StatusRequest>,
) -> Result<Leadership, RegistryError> {
    let election = registry.campaign(subjects::ETCD_INDEXER_ELECTION, candidate, ttl);
    let mut election = std::pin::pin!(election);
    let mut probe = tokio::time::interval(PROBE_EVERY);
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut silence = Silence::default();
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
            _ = probe.tick() => silence.probe(registry, client, candidate).await,
        }
    }
}

/// The leader's silence, as a standby counts it. Only a leader that has
/// answered this standby before is counted silent: "no responders" says
/// what this standby's NATS server knows, and a server that has just
/// (re)joined the cluster may not know of the leader's subscription yet.
#[derive(Debug, Default)]
struct Silence {
    /// The leader that last answered, as the election names it.
    heard: Option<LeaderEntry>,
    /// Probes in a row that nobody answered, that leader still elected.
    probes: u32,
}

impl Silence {
    async fn probe(&mut self, registry: &Registry, client: &async_nats::Client, candidate: &str) {
        let asked = tokio::time::timeout(
            PROBE_EVERY,
            client.request(subjects::INDEX_LEADER, bytes::Bytes::new()),
        )
        .await;
        match asked {
            Ok(Ok(reply)) => {
                self.probes = 0;
                let value = String::from_utf8_lossy(&reply.payload);
                if self.heard.as_ref().is_none_or(|h| h.value != value) {
                    self.heard = match registry.leader_entry(subjects::ETCD_INDEXER_ELECTION).await
                    {
                        Ok(Some(leader)) if leader.value == value => Some(leader),
                        _ => None,
                    };
                }
            }
            Ok(Err(e)) if e.kind() == RequestErrorKind::NoResponders => {
                self.silent(registry, candidate).await;
            }
            // No answer in time, or no NATS: not proof of anything.
            _ => self.probes = 0,
        }
    }

    async fn silent(&mut self, registry: &Registry, candidate: &str) {
        let Some(heard) = &self.heard else {
            return;
        };
        match registry.leader_entry(subjects::ETCD_INDEXER_ELECTION).await {
            Ok(Some(leader)) if leader == *heard && leader.value != candidate => {}
            // Another leader (or none: the election is deciding), or etcd
            // did not answer.
            _ => {
                self.probes = 0;
                return;
            }
        }
        self.probes += 1;
        if self.probes < SILENT_PROBES {
            return;
        }
        let lease = heard.lease;
        tracing::warn!(
            leader = %heard.value,
            lease,
            probes = SILENT_PROBES,
            "the leading indexer answers nobody on NATS: revoking its lease to take over"
        );
        *self = Self::default();
        if let Err(e) = registry.revoke_lease(lease).await {
            tracing::warn!(error = %e, "revoking the silent leader's lease failed; its TTL will");
        }
    }
}

/// The leader's answer to the standbys' probes: a task of its own, from
/// the election until dropped.
#[derive(Debug)]
pub struct Presence(tokio::task::JoinHandle<()>);

impl Presence {
    pub async fn start(client: &async_nats::Client, candidate: &str) -> Result<Self, String> {
        let mut probes = client
            .subscribe(subjects::INDEX_LEADER)
            .await
            .map_err(|e| format!("subscribing to {}: {e}", subjects::INDEX_LEADER))?;
        let (client, candidate) = (client.clone(), bytes::Bytes::from(candidate.to_owned()));
        Ok(Self(tokio::spawn(async move {
            while let Some(probe) = probes.next().await {
                if let Some(reply) = probe.reply {
                    let _ = client.publish(reply, candidate.clone()).await;
                }
            }
        })))
    }
}

impl Drop for Presence {
    fn drop(&mut self) {
        self.0.abort();
    }
}
