//! Leader election through etcd (its election API), for services of which
//! one instance must act at a time (the kv-indexer): each candidate holds
//! a lease of `ttl`, kept alive by a task, and campaigns with it; etcd
//! elects the candidate whose key is oldest. A leader considers itself
//! deposed ([`Leadership::lost`]) when etcd says its lease expired, or when
//! it could not renew it for [`UNREACHABLE_TTLS`] TTLs (etcd unreachable):
//! not after one TTL, since an etcd member's death or a raft election can
//! stall renewals for about a second (a new etcd leader extends every
//! lease, so the lease itself survives that).
//!
//! So an old leader cut off from etcd may act for up to that long after a
//! standby was elected: the election is the first guard, the second is the
//! resource's own fencing (the delta stream's expected last sequence),
//! which stops whichever of the two publishes second.

use std::time::{Duration, Instant};

use etcd_client::{Client, LeaderKey};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::registry::{Registry, RegistryError};

/// Pause between attempts after an etcd error.
const RETRY: Duration = Duration::from_millis(100);

/// A lease not renewed for this many TTLs (etcd unreachable) is presumed
/// lost.
pub const UNREACHABLE_TTLS: u32 = 3;

/// The elected candidate's hold on the election: the lease is kept alive
/// until this is resigned or dropped.
pub struct Leadership {
    client: Client,
    key: LeaderKey,
    lease: i64,
    lost: watch::Receiver<bool>,
    _keeper: Keeper,
}

/// The lease's keep-alive task, stopped with its handle (also when a
/// campaign is abandoned half-way).
struct Keeper(JoinHandle<()>);

impl Drop for Keeper {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl Registry {
    /// Campaigns in election `name` as `candidate` (a value the other
    /// candidates and operators can read: `Registry::leader`) under a
    /// lease of `ttl` (etcd counts whole seconds and raises a TTL below its
    /// minimum, 1.5 election timeouts), and waits until elected. etcd
    /// errors (a member gone) are retried; a lease lost while waiting is
    /// replaced.
    pub async fn campaign(
        &self,
        name: &str,
        candidate: &str,
        ttl: Duration,
    ) -> Result<Leadership, RegistryError> {
        let ttl_s = ttl.as_secs().max(1) as i64;
        let mut client = self.client().clone();
        loop {
            let grant = tokio::time::timeout(ttl.max(RETRY), client.lease_grant(ttl_s, None));
            let lease = match grant.await {
                Ok(Ok(granted)) => granted.id(),
                Err(_) => {
                    tracing::warn!(
                        election = name,
                        "granting the election lease timed out; retrying"
                    );
                    continue;
                }
                Ok(Err(e)) => {
                    tracing::warn!(election = name, error = %e, "granting the election lease failed; retrying");
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            };
            let (lost_tx, mut lost) = watch::channel(false);
            let keeper = Keeper(tokio::spawn(keep_alive(
                client.clone(),
                lease,
                ttl_s,
                lost_tx,
            )));
            let elected = loop {
                let campaign = client.campaign(name, candidate, lease);
                tokio::select! {
                    result = campaign => match result {
                        Ok(response) => match response.leader() {
                            Some(key) => break Some(key.clone()),
                            None => tokio::time::sleep(RETRY).await,
                        },
                        Err(e) => {
                            tracing::warn!(election = name, lease, error = %e, "campaign interrupted; campaigning again");
                            tokio::time::sleep(RETRY).await;
                        }
                    },
                    () = async { let _ = lost.wait_for(|lost| *lost).await; } => break None,
                }
                if *lost.borrow() {
                    break None;
                }
            };
            match elected {
                Some(key) => {
                    return Ok(Leadership {
                        client,
                        key,
                        lease,
                        lost,
                        _keeper: keeper,
                    })
                }
                None => {
                    drop(keeper);
                    tracing::warn!(
                        election = name,
                        lease,
                        "the election lease was lost while campaigning; campaigning with a new one"
                    );
                }
            }
        }
    }

    /// The value of the current leader of election `name`, if any.
    pub async fn leader(&self, name: &str) -> Result<Option<String>, RegistryError> {
        Ok(self.leader_entry(name).await?.map(|entry| entry.value))
    }

    /// The current leader of election `name`, if any, with its lease.
    pub async fn leader_entry(&self, name: &str) -> Result<Option<LeaderEntry>, RegistryError> {
        let name = name.to_owned();
        let asked = crate::registry::reaching(self.client(), |mut c| {
            let name = name.clone();
            async move { c.leader(name).await }
        });
        match asked.await {
            Ok(response) => Ok(response.kv().map(|kv| LeaderEntry {
                value: String::from_utf8_lossy(kv.value()).into_owned(),
                lease: kv.lease(),
            })),
            // etcd answers "election: no leader" as an error.
            Err(e) if e.to_string().contains("no leader") => Ok(None),
            Err(source) => Err(RegistryError::Etcd {
                operation: "read the election's leader",
                source,
            }),
        }
    }

    /// Revokes a leader's lease (one found dead by other means than its
    /// lease, which would take its TTL): its key goes, and the next
    /// candidate is elected at once. A live leader whose lease this was
    /// notices on its next renewal ([`Leadership::lost`]) and the
    /// resource's fencing stops it before that.
    pub async fn revoke_lease(&self, lease: i64) -> Result<(), RegistryError> {
        match crate::registry::reaching(self.client(), |mut c| async move {
            c.lease_revoke(lease).await
        })
        .await
        {
            Ok(_) => Ok(()),
            // It ran out meanwhile.
            Err(e) if expired(&e) => Ok(()),
            Err(source) => Err(RegistryError::Etcd {
                operation: "revoke the leader's lease",
                source,
            }),
        }
    }
}

/// An election's current leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderEntry {
    /// What it campaigned with.
    pub value: String,
    pub lease: i64,
}

impl Leadership {
    /// The lease the leadership is held under.
    pub fn lease(&self) -> i64 {
        self.lease
    }

    /// Whether etcd said the lease expired, or it could not be renewed for
    /// [`UNREACHABLE_TTLS`] TTLs: the leadership is presumed gone.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Resolves once the leadership is presumed lost ([`Self::is_lost`]).
    pub async fn lost(&mut self) {
        let _ = self.lost.wait_for(|lost| *lost).await;
    }

    /// Gives the leadership up at once (a standby is elected without
    /// waiting for the TTL): resigns and revokes the lease.
    pub async fn resign(self) -> Result<(), RegistryError> {
        let resign = etcd_client::ResignOptions::new().with_leader(self.key.clone());
        let lease = self.lease;
        let resigned = crate::registry::reaching(&self.client, |mut c| {
            let resign = resign.clone();
            async move { c.resign(Some(resign)).await }
        })
        .await;
        let revoked =
            crate::registry::reaching(
                &self.client,
                |mut c| async move { c.lease_revoke(lease).await },
            )
            .await;
        resigned.map_err(|source| RegistryError::Etcd {
            operation: "resign the election",
            source,
        })?;
        revoked.map_err(|source| RegistryError::Etcd {
            operation: "revoke the election lease",
            source,
        })?;
        Ok(())
    }
}

/// Renews `lease` every third of its TTL; sets `lost` once etcd says it
/// expired, or no renewal succeeded for [`UNREACHABLE_TTLS`] TTLs.
async fn keep_alive(mut client: Client, lease: i64, ttl_s: i64, lost: watch::Sender<bool>) {
    let ttl = Duration::from_secs(ttl_s as u64);
    let period = ttl / 3;
    let deadline = ttl * UNREACHABLE_TTLS;
    let mut renewed = Instant::now();
    loop {
        let remaining = deadline.saturating_sub(renewed.elapsed());
        let attempt = async {
            let (mut keeper, mut responses) = client.lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            let first = responses.message().await?;
            Ok::<_, etcd_client::Error>((keeper, responses, first))
        };
        let mut stream = match tokio::time::timeout(remaining, attempt).await {
            Ok(Ok((keeper, responses, Some(r)))) if r.ttl() > 0 => {
                renewed = Instant::now();
                Some((keeper, responses))
            }
            Ok(Ok(_)) => {
                tracing::warn!(lease, "the election lease expired");
                let _ = lost.send(true);
                return;
            }
            Ok(Err(e)) if expired(&e) => {
                tracing::warn!(lease, error = %e, "the election lease expired");
                let _ = lost.send(true);
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(lease, error = %e, "election lease keep-alive failed; retrying");
                None
            }
            Err(_) => None,
        };
        // Renew on the same stream while it works.
        while let Some((keeper, responses)) = &mut stream {
            tokio::time::sleep(period).await;
            let remaining = deadline.saturating_sub(renewed.elapsed());
            let renewal = async {
                keeper.keep_alive().await?;
                responses.message().await
            };
            match tokio::time::timeout(remaining, renewal).await {
                Ok(Ok(Some(r))) if r.ttl() > 0 => renewed = Instant::now(),
                Ok(Ok(_)) => {
                    tracing::warn!(lease, "the election lease expired");
                    let _ = lost.send(true);
                    return;
                }
                Ok(Err(e)) if expired(&e) => {
                    tracing::warn!(lease, error = %e, "the election lease expired");
                    let _ = lost.send(true);
                    return;
                }
                Ok(Err(e)) => {
                    tracing::warn!(lease, error = %e, "election lease keep-alive failed; retrying");
                    stream = None;
                }
                Err(_) => stream = None,
            }
        }
        if renewed.elapsed() >= deadline {
            tracing::warn!(
                lease,
                ?ttl,
                "the election lease could not be renewed for {UNREACHABLE_TTLS} TTLs; leadership presumed lost"
            );
            let _ = lost.send(true);
            return;
        }
        tokio::time::sleep(RETRY.min(period)).await;
    }
}

/// Whether etcd's error says the lease is gone.
fn expired(error: &etcd_client::Error) -> bool {
    error.to_string().contains("requested lease not found")
}
