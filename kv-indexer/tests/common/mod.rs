//! Shared by the service tests: real nats-server and etcd, the service in a
//! task, a deterministic workload, and small HTTP and delta-log readers.

#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bus::Bus;
use futures::StreamExt;
use kv_indexer::service::{Config, Service, ServiceError};
use kv_indexer::{IndexReplica, KvIndexer, OwnershipIndex};
use protocol::{BlockHash, BlockHasher, IndexDelta, KvEvent, KvEventBatch, Tier, WorkerId};
use tests::{EtcdServer, NatsServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A NATS server, an etcd server and a bus connection.
pub struct Servers {
    pub nats: NatsServer,
    pub etcd: EtcdServer,
    pub bus: Bus,
}

/// Logs to the test's output (`RUST_LOG` filters; default `info`).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .try_init();
}

impl Servers {
    pub async fn start() -> Result<Self> {
        init_tracing();
        let nats = NatsServer::start()?;
        let etcd = EtcdServer::start()?;
        let bus = Bus::connect(&nats.url(), "kv-indexer-test").await?;
        bus.ensure_streams(&bus::StreamLimits::default()).await?;
        Ok(Self { nats, etcd, bus })
    }

    /// A configuration for tests: ephemeral HTTP port, short periods.
    pub fn config(&self) -> Config {
        let mut config = Config::new(self.nats.url(), vec![self.etcd.endpoint()]);
        config.http_addr = "127.0.0.1:0".parse().unwrap();
        config.resync_timeout = Duration::from_secs(2);
        config.resync_interval = Duration::from_millis(500);
        // JetStream reserves capped bytes: small caps for small stores.
        config.kv_events_max_bytes = 64 << 20;
        config.decisions_max_bytes = 64 << 20;
        config
    }
}

/// The service running in a task.
pub struct Running {
    pub http: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    handle: JoinHandle<Result<(), ServiceError>>,
}

impl Running {
    pub async fn start(config: Config) -> Result<Self> {
        let service = Service::start(config).await?;
        let http = service.http_addr();
        let (stop, stopped) = oneshot::channel::<()>();
        let handle = tokio::spawn(service.run(async {
            let _ = stopped.await;
        }));
        Ok(Self {
            http,
            stop: Some(stop),
            handle,
        })
    }

    /// Graceful shutdown; the service's result.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(30), &mut self.handle)
            .await
            .context("the service did not stop")??
            .context("the service failed")
    }

    /// No shutdown: the task is dropped wherever it is.
    pub async fn abort(self) {
        self.handle.abort();
        let _ = self.handle.await;
    }

    /// Waits for the service to stop on its own; its result.
    pub async fn join(self) -> Result<Result<(), ServiceError>> {
        Ok(tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .context("the service did not stop")??)
    }

    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    pub async fn status(&self) -> Result<serde_json::Value> {
        status(self.http).await
    }

    pub async fn metric(&self, name: &str) -> Result<f64> {
        metric(self.http, name).await
    }
}

/// A minimal HTTP/1.0 GET: (status code, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        stream.read_to_string(&mut response),
    )
    .await
    .context("HTTP response timed out")??;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow!("malformed HTTP response {response:?}"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("no status in {head:?}"))?;
    Ok((code, body.to_owned()))
}

pub async fn status(addr: SocketAddr) -> Result<serde_json::Value> {
    let (code, body) = http_get(addr, "/status").await?;
    if code != 200 {
        bail!("/status answered {code}: {body}");
    }
    Ok(serde_json::from_str(&body)?)
}

/// A metric's value from `/metrics` (`name` with its labels, as rendered,
/// e.g. `kv_indexer_batches_total{status="gap"}`); 0 when absent.
pub async fn metric(addr: SocketAddr, name: &str) -> Result<f64> {
    let (code, body) = http_get(addr, "/metrics").await?;
    if code != 200 {
        bail!("/metrics answered {code}");
    }
    for line in body.lines() {
        if let Some(value) = line
            .strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(' '))
        {
            return Ok(value.trim().parse()?);
        }
    }
    Ok(0.0)
}

/// Polls `check` until it gives `Some`, or fails after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_error = None;
    loop {
        match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(e) => last_error = Some(e),
        }
        if Instant::now() >= deadline {
            return Err(anyhow!("timed out after {timeout:?} waiting for {what}")
                .context(format!("last error: {last_error:?}")));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Waits until the service's index reaches `delta_seq` (produced and
/// confirmed); returns its status.
pub async fn wait_for_delta(
    http: SocketAddr,
    delta_seq: u64,
    timeout: Duration,
) -> Result<serde_json::Value> {
    wait_for(&format!("delta {delta_seq}"), timeout, || async move {
        let s = status(http).await?;
        Ok((s["delta_seq_published"].as_u64() >= Some(delta_seq)).then_some(s))
    })
    .await
}

/// Deltas `from..=to` from the delta stream.
pub async fn read_deltas(bus: &Bus, from: u64, to: u64) -> Result<Vec<IndexDelta>> {
    let mut deltas = Vec::new();
    if from > to {
        return Ok(deltas);
    }
    let mut stream = bus.deltas_from(from).await?;
    while deltas.last().map_or(from - 1, |d: &IndexDelta| d.seq) < to {
        let delta = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .context("reading the delta stream")?
            .ok_or_else(|| anyhow!("the delta stream ended"))??;
        deltas.push(delta);
    }
    Ok(deltas)
}

/// Deltas from the stream applied to a replica, from the latest snapshot
/// (if any) to `to`.
pub async fn replica_at(bus: &Bus, to: u64) -> Result<IndexReplica> {
    let mut replica = IndexReplica::new();
    if let Some(snapshot) = bus.latest_snapshot().await? {
        replica.restore(snapshot)?;
    }
    for delta in read_deltas(bus, replica.applied() + 1, to).await? {
        replica.apply(&delta)?;
    }
    Ok(replica)
}

pub fn digest_hex(digest: u64) -> String {
    format!("{digest:016x}")
}

pub fn worker(name: &str) -> WorkerId {
    WorkerId::new(name, 0).unwrap()
}

/// Deterministic KV traffic of a few workers: each starts an epoch with
/// `Cleared`, then stores chains (extending earlier ones or new) and
/// sometimes removes blocks it holds.
pub struct Workload {
    workers: Vec<WorkerState>,
    rng: u64,
    next: usize,
}

struct WorkerState {
    id: WorkerId,
    epoch: u64,
    seq: u64,
    started: bool,
    /// Chains this worker stored, by their last block.
    chains: Vec<Vec<BlockHash>>,
}

impl Workload {
    pub fn new(workers: &[WorkerId], seed: u64) -> Self {
        Self {
            workers: workers
                .iter()
                .map(|id| WorkerState {
                    id: id.clone(),
                    epoch: 1,
                    seq: 0,
                    started: false,
                    chains: Vec::new(),
                })
                .collect(),
            rng: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            next: 0,
        }
    }

    fn random(&mut self) -> u64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// The next batch, workers in turn.
    pub fn batch(&mut self) -> KvEventBatch {
        let i = self.next;
        self.next = (self.next + 1) % self.workers.len();
        self.batch_of(i)
    }

    /// The next batch of worker `i`.
    pub fn batch_of(&mut self, i: usize) -> KvEventBatch {
        let r1 = self.random();
        let r2 = self.random();
        let w = &mut self.workers[i];
        let mut events = Vec::new();
        if !w.started {
            w.started = true;
            events.push(KvEvent::Cleared);
        }
        if r1 % 5 == 0 && !w.chains.is_empty() {
            // Remove the tail of one chain.
            let c = (r2 as usize) % w.chains.len();
            let chain = &mut w.chains[c];
            let keep = chain.len() / 2;
            let removed = chain.split_off(keep);
            if chain.is_empty() {
                w.chains.swap_remove(c);
            }
            events.push(KvEvent::Removed {
                blocks: removed,
                tier: Tier::Device,
            });
        } else {
            // Extend a chain (shared prefixes across workers come from the
            // shared roots) or start one.
            let len = 4 + (r2 % 13) as usize;
            let (parent, mut chain) = if r1 % 3 == 0 && !w.chains.is_empty() {
                let c = (r2 as usize) % w.chains.len();
                let chain = w.chains.swap_remove(c);
                (chain.last().copied(), chain)
            } else {
                (None, Vec::new())
            };
            let root_group = r1 % 7;
            let mut blocks = Vec::with_capacity(len);
            let mut last = parent;
            for k in 0..len {
                let content = if parent.is_none() && k < 2 {
                    root_group * 100 + k as u64
                } else {
                    r1 ^ (k as u64) << 32
                };
                let block = BlockHasher::chain(last, content);
                blocks.push(block);
                last = Some(block);
            }
            chain.extend_from_slice(&blocks);
            w.chains.push(chain);
            events.push(KvEvent::Stored {
                parent,
                blocks,
                tier: Tier::Device,
            });
        }
        let batch = KvEventBatch {
            worker: w.id.clone(),
            epoch: w.epoch,
            seq: w.seq,
            events,
        };
        w.seq += 1;
        batch
    }
}

/// The indexer core fed the same batches, for comparison.
pub fn local_indexer(batches: &[KvEventBatch]) -> KvIndexer {
    let mut indexer = KvIndexer::new(OwnershipIndex::new());
    for batch in batches {
        indexer.apply(batch.clone());
    }
    indexer
}

/// Checks that deltas carry each worker batch at most once and in order.
pub fn check_sources(deltas: &[IndexDelta]) -> Result<()> {
    let mut last: HashMap<WorkerId, (u64, u64)> = HashMap::new();
    for (i, delta) in deltas.iter().enumerate() {
        if i > 0 && delta.seq != deltas[i - 1].seq + 1 {
            bail!("delta {} follows delta {}", delta.seq, deltas[i - 1].seq);
        }
        if let Some(c) = &delta.source {
            let position = (c.epoch, c.last_seq);
            if let Some(previous) = last.insert(c.worker.clone(), position) {
                if position <= previous && !c.resync_pending {
                    bail!(
                        "delta {} applies batch {position:?} of {} again (after {previous:?})",
                        delta.seq,
                        c.worker
                    );
                }
            }
        }
    }
    Ok(())
}
