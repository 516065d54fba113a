use std::time::Duration;

use etcd_client::{
    Certificate, Client, ConnectOptions, EventType, GetOptions, Identity, PutOptions, TlsOptions,
    WatchOptions,
};
use protocol::{subjects, Message, WorkerId, WorkerRecord};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::auth::{read, redact_url, AuthError, EtcdAuth};

/// What went wrong talking to etcd.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("connecting to etcd at {endpoints}: {source}")]
    Connect {
        endpoints: String,
        #[source]
        source: etcd_client::Error,
    },
    #[error("etcd at {endpoints}: {source}")]
    Settings {
        endpoints: String,
        #[source]
        source: AuthError,
    },
    #[error("etcd {operation}: {source}")]
    Etcd {
        operation: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    #[error("the worker watch ended (etcd closed it)")]
    WatchClosed,
}

/// The client's options for `auth` (reads the PEM files); `None` for
/// none of them.
fn etcd_options(auth: &EtcdAuth) -> Result<Option<ConnectOptions>, AuthError> {
    let mut options = ConnectOptions::new();
    let mut any = false;
    if let (Some(user), Some(password)) = (&auth.user, &auth.password) {
        options = options.with_user(user.clone(), password.expose());
        any = true;
    }
    if let Some(ca) = &auth.tls_ca {
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(read("etcd", ca)?));
        if let (Some(cert), Some(key)) = (&auth.tls_cert, &auth.tls_key) {
            tls = tls.identity(Identity::from_pem(read("etcd", cert)?, read("etcd", key)?));
        }
        if let Some(domain) = &auth.tls_domain {
            tls = tls.domain_name(domain.clone());
        }
        options = options.with_tls(tls);
        any = true;
    }
    Ok(any.then_some(options))
}

fn etcd(operation: &'static str) -> impl FnOnce(etcd_client::Error) -> RegistryError {
    move |source| RegistryError::Etcd { operation, source }
}

/// Tries of an etcd call that failed on its way ([`connection_failed`]).
const REACH_ATTEMPTS: u32 = 8;

/// Runs an etcd call, again (after 20 ms, 40 ms, ..., 0.56 s in all)
/// while it fails on its way. The client spreads its calls over every
/// endpoint, a dead member's too: its balanced channel keeps a member it
/// cannot connect to and fails the calls sent there at once ("tcp connect
/// error"; the calls in flight when a member dies end with a reset), so
/// with one member of three down a share of all calls failed, and a watch
/// opened again failed for seconds in a row; and the calls sent while the
/// members elect a new leader are refused. The next try most likely goes
/// to a live member. Trying again is safe for every call made here: reads
/// and watches; puts of the same value; a compare-and-put, whose second
/// try, if the first did land, only fails its compare (the caller reads
/// again); a lease grant, whose lost twin expires with no key under it.
pub(crate) async fn reaching<T, F, Fut>(
    client: &Client,
    mut call: F,
) -> Result<T, etcd_client::Error>
where
    F: FnMut(Client) -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let mut attempt = 1;
    loop {
        match call(client.clone()).await {
            Err(e) if attempt < REACH_ATTEMPTS && connection_failed(&e) => {
                tracing::debug!(error = %e, attempt, "an etcd call's connection failed; trying again");
                tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
                attempt += 1;
            }
            result => return result,
        }
    }
}

/// Whether an etcd call failed on its way, not with etcd's answer to it:
/// its connection could not be made or was reset, or closed under the call
/// (gRPC "cancelled": a member killed while the call was in flight), or
/// the member it reached could not serve it (gRPC "unavailable": "leader
/// changed", "no leader" while the members elect a new leader, after the
/// old one died).
pub(crate) fn connection_failed(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(status) => {
            matches!(
                status.code(),
                tonic::Code::Unavailable | tonic::Code::Cancelled
            ) || e.to_string().contains("transport error")
        }
        _ => false,
    }
}

/// A change of the registered workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerChange {
    /// Registered, or its record changed.
    Up(WorkerRecord),
    /// Its key is gone: deregistered, or its lease expired.
    Down(WorkerId),
    /// A key under the workers' prefix that is not a valid record: counted
    /// and skipped by the caller, never fatal.
    Malformed { key: String, error: String },
}

fn worker_from_key(key: &[u8]) -> Result<WorkerId, String> {
    let key = String::from_utf8_lossy(key);
    let id = key
        .strip_prefix(subjects::ETCD_WORKERS_PREFIX)
        .ok_or_else(|| format!("key {key:?} is not under {}", subjects::ETCD_WORKERS_PREFIX))?;
    id.parse().map_err(|e| format!("key {key:?}: {e}"))
}

fn record_change(key: &[u8], value: &[u8]) -> WorkerChange {
    match WorkerRecord::decode(value) {
        Ok(record) => WorkerChange::Up(record),
        Err(e) => WorkerChange::Malformed {
            key: String::from_utf8_lossy(key).into_owned(),
            error: e.to_string(),
        },
    }
}

/// The worker registry in etcd.
#[derive(Clone)]
pub struct Registry {
    client: Client,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

impl Registry {
    /// The etcd client (for [`crate::election`]).
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// Connects without credentials ([`Registry::connect_with`]).
    pub async fn connect(endpoints: &[String]) -> Result<Self, RegistryError> {
        Self::connect_with(endpoints, &EtcdAuth::default()).await
    }

    /// Connects with `auth`'s user/password and TLS (`https://`
    /// endpoints need its CA).
    pub async fn connect_with(
        endpoints: &[String],
        auth: &EtcdAuth,
    ) -> Result<Self, RegistryError> {
        let shown = endpoints
            .iter()
            .map(|e| redact_url(e))
            .collect::<Vec<_>>()
            .join(",");
        auth.check(endpoints)
            .map_err(|source| RegistryError::Settings {
                endpoints: shown.clone(),
                source,
            })?;
        let options = etcd_options(auth).map_err(|source| RegistryError::Settings {
            endpoints: shown.clone(),
            source,
        })?;
        let client = Client::connect(endpoints, options)
            .await
            .map_err(|source| RegistryError::Connect {
                endpoints: shown,
                source,
            })?;
        Ok(Self { client })
    }

    /// The first KV epoch of a (re)starting agent of `worker`: later than
    /// every epoch recorded for it, and at least `floor` (the wall clock in
    /// ms: epochs stay near it, which the indexer's bound on future epochs
    /// relies on). Recorded before it is returned, so that concurrent
    /// callers get different epochs.
    pub async fn next_epoch(&self, worker: &WorkerId, floor: u64) -> Result<u64, RegistryError> {
        let key = subjects::etcd_epoch_key(worker);
        let mut client = self.client.clone();
        loop {
            let (recorded, revision) = recorded_epoch(&mut client, &key).await?;
            let next = floor.max(recorded.map_or(0, |e| e.saturating_add(1)));
            if put_if_unchanged(&mut client, &key, next, revision).await? {
                return Ok(next);
            }
        }
    }

    /// Records that `worker`'s agent uses `epoch` (a later recorded epoch
    /// stays).
    pub async fn record_epoch(&self, worker: &WorkerId, epoch: u64) -> Result<(), RegistryError> {
        let key = subjects::etcd_epoch_key(worker);
        let mut client = self.client.clone();
        loop {
            let (recorded, revision) = recorded_epoch(&mut client, &key).await?;
            if recorded.is_some_and(|r| r >= epoch) {
                return Ok(());
            }
            if put_if_unchanged(&mut client, &key, epoch, revision).await? {
                return Ok(());
            }
        }
    }

    /// Registers the worker under a lease of `ttl` and keeps the lease
    /// alive until the [`Registration`] is revoked or dropped. If the lease
    /// is lost (etcd unreachable for longer than the TTL), the record is
    /// registered again under a new lease as soon as etcd answers.
    pub async fn register(
        &self,
        record: &WorkerRecord,
        ttl: Duration,
    ) -> Result<Registration, RegistryError> {
        let ttl_s = ttl.as_secs().max(1) as i64;
        let mut client = self.client.clone();
        let lease = put_under_lease(&mut client, record, ttl_s).await?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let (lease_tx, lease_rx) = watch::channel(lease);
        let task = tokio::spawn(keep_alive(client, record.clone(), ttl_s, lease_tx, stop_rx));
        Ok(Registration {
            client: self.client.clone(),
            lease: lease_rx,
            stop: stop_tx,
            task,
        })
    }

    /// Every registered worker now, and the etcd revision of that view
    /// (watch from the next one).
    pub async fn workers(&self) -> Result<(Vec<WorkerChange>, i64), RegistryError> {
        let response = reaching(&self.client, |mut c| async move {
            c.get(
                subjects::ETCD_WORKERS_PREFIX,
                Some(GetOptions::new().with_prefix()),
            )
            .await
        })
        .await
        .map_err(etcd("list workers"))?;
        let revision = response.header().map_or(0, |h| h.revision());
        let changes = response
            .kvs()
            .iter()
            .map(|kv| record_change(kv.key(), kv.value()))
            .collect();
        Ok((changes, revision))
    }

    /// Changes of the registered workers after `revision`.
    pub async fn watch_workers(&self, revision: i64) -> Result<WorkerWatch, RegistryError> {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let stream = reaching(&self.client, |mut c| {
            let options = options.clone();
            async move { c.watch(subjects::ETCD_WORKERS_PREFIX, Some(options)).await }
        })
        .await
        .map_err(etcd("watch workers"))?;
        Ok(WorkerWatch { stream })
    }
}

/// The epoch recorded under `key` (a decimal number) and the key's
/// modification revision (0: absent).
async fn recorded_epoch(
    client: &mut Client,
    key: &str,
) -> Result<(Option<u64>, i64), RegistryError> {
    let response = reaching(client, |mut c| async move { c.get(key, None).await })
        .await
        .map_err(etcd("read epoch"))?;
    Ok(match response.kvs().first() {
        Some(kv) => (
            std::str::from_utf8(kv.value())
                .ok()
                .and_then(|v| v.trim().parse().ok()),
            kv.mod_revision(),
        ),
        None => (None, 0),
    })
}

/// Puts `epoch` under `key` if the key is still at `revision` (0: still
/// absent); whether it did.
async fn put_if_unchanged(
    client: &mut Client,
    key: &str,
    epoch: u64,
    revision: i64,
) -> Result<bool, RegistryError> {
    use etcd_client::{Compare, CompareOp, Txn, TxnOp};
    let unchanged = Compare::mod_revision(key, CompareOp::Equal, revision);
    let txn = Txn::new()
        .when([unchanged])
        .and_then([TxnOp::put(key, epoch.to_string(), None)]);
    Ok(reaching(client, |mut c| {
        let txn = txn.clone();
        async move { c.txn(txn).await }
    })
    .await
    .map_err(etcd("record epoch"))?
    .succeeded())
}

async fn put_under_lease(
    client: &mut Client,
    record: &WorkerRecord,
    ttl_s: i64,
) -> Result<i64, RegistryError> {
    let lease = reaching(
        client,
        |mut c| async move { c.lease_grant(ttl_s, None).await },
    )
    .await
    .map_err(etcd("grant lease"))?
    .id();
    let (key, value) = (subjects::etcd_worker_key(&record.id), record.encode());
    reaching(client, |mut c| {
        let (key, value) = (key.clone(), value.clone());
        async move {
            c.put(key, value, Some(PutOptions::new().with_lease(lease)))
                .await
        }
    })
    .await
    .map_err(etcd("register worker"))?;
    Ok(lease)
}

async fn keep_alive(
    mut client: Client,
    record: WorkerRecord,
    ttl_s: i64,
    lease_tx: watch::Sender<i64>,
    mut stop: watch::Receiver<bool>,
) {
    let period = Duration::from_millis((ttl_s as u64 * 1000 / 3).max(100));
    loop {
        let lease = *lease_tx.borrow();
        match keep_lease(&mut client, &record, lease, period, &mut stop).await {
            Kept::Stopped => return,
            Kept::Expired => {
                tracing::warn!(worker = %record.id, lease, "registration lease expired; registering again");
            }
        }
        // Re-register under a new lease once etcd answers.
        loop {
            if *stop.borrow() {
                return;
            }
            match put_under_lease(&mut client, &record, ttl_s).await {
                Ok(lease) => {
                    tracing::info!(worker = %record.id, lease, "registered again");
                    let _ = lease_tx.send(lease);
                    break;
                }
                Err(e) => {
                    tracing::warn!(worker = %record.id, error = %e, "registration failed; retrying");
                    tokio::select! {
                        _ = stop.changed() => return,
                        _ = tokio::time::sleep(period) => {}
                    }
                }
            }
        }
    }
}

/// How keeping a lease alive ended.
enum Kept {
    /// etcd says it expired (TTL 0): register again.
    Expired,
    Stopped,
}

/// Keeps `lease` alive every `period`. A failed keep-alive (the member it
/// went to died, a leader election, no answer within two periods) is
/// tried again at once on the same lease, which another member may renew:
/// only a lease etcd says expired is given up, so a brief etcd outage
/// never deregisters the worker (its key would be deleted, and routers and
/// the indexer would drop it).
async fn keep_lease(
    client: &mut Client,
    record: &WorkerRecord,
    lease: i64,
    period: Duration,
    stop: &mut watch::Receiver<bool>,
) -> Kept {
    let answer_within = period * 2;
    let mut failures = 0u32;
    loop {
        let alive = async {
            let (mut keeper, mut responses) = client.lease_keep_alive(lease).await?;
            loop {
                keeper.keep_alive().await?;
                let answer = tokio::time::timeout(answer_within, responses.message())
                    .await
                    .map_err(|_| KeepAliveError::Silent(answer_within))??;
                match answer {
                    Some(r) if r.ttl() > 0 => {}
                    // TTL 0: the lease expired while we were away.
                    _ => return Ok::<(), KeepAliveError>(()),
                }
                tokio::time::sleep(period).await;
            }
        };
        tokio::select! {
            _ = stop.changed() => return Kept::Stopped,
            result = alive => match result {
                Ok(()) => return Kept::Expired,
                Err(e) => {
                    failures += 1;
                    // Tried every 100 ms: said at the first failure, then
                    // every 50th.
                    if failures % 50 == 1 {
                        tracing::warn!(worker = %record.id, lease, failures, error = %e, "lease keep-alive failed; trying the same lease again");
                    } else {
                        tracing::debug!(worker = %record.id, lease, failures, error = %e, "lease keep-alive failed again");
                    }
                }
            },
        }
        tokio::select! {
            _ = stop.changed() => return Kept::Stopped,
            _ = tokio::time::sleep(KEEP_ALIVE_RETRY.min(period)) => {}
        }
    }
}

/// The wait before a failed keep-alive is tried again.
const KEEP_ALIVE_RETRY: Duration = Duration::from_millis(100);

/// Why a keep-alive failed.
#[derive(Debug, thiserror::Error)]
enum KeepAliveError {
    #[error(transparent)]
    Etcd(#[from] etcd_client::Error),
    #[error("no answer within {0:?}")]
    Silent(Duration),
}

/// A worker's registration; the lease is kept alive until this is revoked
/// or dropped (then it expires after its TTL).
pub struct Registration {
    client: Client,
    lease: watch::Receiver<i64>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("lease", &self.lease())
            .finish_non_exhaustive()
    }
}

impl Registration {
    /// The current lease id.
    pub fn lease(&self) -> i64 {
        *self.lease.borrow()
    }

    /// Stops the keep-alive and revokes the lease: the worker's key goes
    /// away at once.
    pub async fn revoke(mut self) -> Result<(), RegistryError> {
        let _ = self.stop.send(true);
        let _ = (&mut self.task).await;
        let lease = self.lease();
        reaching(
            &self.client,
            |mut c| async move { c.lease_revoke(lease).await },
        )
        .await
        .map_err(etcd("revoke lease"))?;
        Ok(())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The stream of worker changes from etcd.
pub struct WorkerWatch {
    stream: etcd_client::WatchStream,
}

impl std::fmt::Debug for WorkerWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerWatch").finish_non_exhaustive()
    }
}

impl WorkerWatch {
    /// The next changes; an error when the watch ended.
    pub async fn next(&mut self) -> Result<Vec<WorkerChange>, RegistryError> {
        let response = self
            .stream
            .message()
            .await
            .map_err(etcd("watch workers"))?
            .ok_or(RegistryError::WatchClosed)?;
        if response.canceled() {
            return Err(RegistryError::WatchClosed);
        }
        Ok(response
            .events()
            .iter()
            .filter_map(|event| {
                let kv = event.kv()?;
                Some(match event.event_type() {
                    EventType::Put => record_change(kv.key(), kv.value()),
                    EventType::Delete => match worker_from_key(kv.key()) {
                        Ok(id) => WorkerChange::Down(id),
                        Err(error) => WorkerChange::Malformed {
                            key: String::from_utf8_lossy(kv.key()).into_owned(),
                            error,
                        },
                    },
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::connection_failed;

    #[test]
    fn a_call_cut_on_its_way_is_tried_again_and_an_answer_is_not() {
        let status = |s: tonic::Status| etcd_client::Error::GRpcStatus(s);
        // A member killed mid-call: its connection closed under the call.
        assert!(connection_failed(&status(tonic::Status::cancelled(
            "operation was canceled"
        ))));
        assert!(connection_failed(&status(tonic::Status::unavailable(
            "etcdserver: leader changed"
        ))));
        // etcd's answers.
        assert!(!connection_failed(&status(tonic::Status::not_found("key"))));
        assert!(!connection_failed(&status(
            tonic::Status::permission_denied("etcdserver: permission denied")
        )));
        assert!(!connection_failed(
            &etcd_client::Error::LeaseKeepAliveError("lease expired".into())
        ));
    }
}
