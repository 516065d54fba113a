//! Helpers of the router service's tests: real NATS and etcd servers, a
//! router replica on an ephemeral port, fake workers answering generate
//! requests, and an indexer stand-in publishing real deltas.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bus::{Bus, Registration, Registry, StreamLimits};
use futures::StreamExt;
use kv_indexer::{KvIndexer, OwnershipIndex};
use protocol::{
    BlockHasher, FinishReason, GenerateChunk, GenerateEvent, GenerateRequest, HashingContract,
    IndexDelta, IndexSnapshot, KvEvent, KvEventBatch, KvTransferParams, Message, Role, Stage, Tier,
    WorkerId, WorkerRecord,
};
use router::service::{self, Config, ServiceError, Timeouts};
use router::IslBased;
pub use tests::tokens;
use tests::{EtcdServer, NatsServer};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;

pub const MODEL: &str = "test-model";
pub const BLOCK: u32 = 16;
/// Bounds every wait of a test.
pub const WAIT: Duration = Duration::from_secs(10);

pub fn contract() -> HashingContract {
    HashingContract::for_model(MODEL, BLOCK)
}

pub fn hasher() -> BlockHasher {
    BlockHasher::new(BLOCK, contract().salt).unwrap()
}

pub fn id(name: &str) -> WorkerId {
    name.parse().unwrap()
}

pub fn record(name: &str, role: Role) -> WorkerRecord {
    WorkerRecord {
        kv_capacity_blocks: 100_000,
        kv_bytes_per_token: 1024,
        ..tests::fixtures::registration(name, role, contract())
    }
}

/// Real servers and clients to them.
pub struct Cluster {
    pub nats: NatsServer,
    pub etcd: EtcdServer,
    pub bus: Bus,
    pub registry: Registry,
    /// The NATS server's configuration file, when it has one.
    _nats_config: Option<tempfile::TempDir>,
}

impl Cluster {
    pub async fn start() -> Result<Self> {
        Self::start_inner(None).await
    }

    /// With a NATS server whose payload limit is `max_payload` bytes.
    pub async fn start_with_max_payload(max_payload: usize) -> Result<Self> {
        Self::start_inner(Some(max_payload)).await
    }

    async fn start_inner(max_payload: Option<usize>) -> Result<Self> {
        let config = match max_payload {
            Some(n) => {
                let dir = tempfile::tempdir()?;
                std::fs::write(dir.path().join("nats.conf"), format!("max_payload: {n}\n"))?;
                Some(dir)
            }
            None => None,
        };
        let path = config.as_ref().map(|d| d.path().join("nats.conf"));
        let (nats, etcd) = tokio::task::spawn_blocking(move || -> Result<_> {
            let nats = match &path {
                Some(p) => NatsServer::start_with_config(p)?,
                None => NatsServer::start()?,
            };
            Ok((nats, EtcdServer::start()?))
        })
        .await??;
        let bus = Bus::connect(&nats.url(), "test").await?;
        bus.ensure_streams(&StreamLimits::default()).await?;
        let registry = Registry::connect(&[etcd.endpoint()]).await?;
        Ok(Self {
            nats,
            etcd,
            bus,
            registry,
            _nats_config: config,
        })
    }

    /// A router config for these servers, with short timeouts.
    pub fn config(&self, replica: &str) -> Config {
        Config {
            nats_url: self.nats.url(),
            etcd_endpoints: vec![self.etcd.endpoint()],
            model: MODEL.into(),
            block_size: BLOCK,
            replica_id: replica.into(),
            policy: IslBased::default().into(),
            timeouts: Timeouts {
                first_chunk: Duration::from_secs(1),
                idle: Duration::from_secs(1),
                tick: Duration::from_millis(100),
                drain: Duration::from_secs(1),
                ..Timeouts::default()
            },
            seed: 7,
            // No kv-indexer runs in these tests (a stand-in publishes the
            // deltas): readiness must not fail for it.
            readiness: service::health::ReadinessConfig {
                max_quiet: Duration::from_secs(3600),
                ..Default::default()
            },
            ..Config::default()
        }
        .validate()
        .unwrap()
    }
}

/// A router replica running in this process.
pub struct RouterHandle {
    pub addr: SocketAddr,
    pub http: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), ServiceError>>>,
}

impl RouterHandle {
    pub async fn start(config: Config) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(service::run(config, listener, async move {
            let _ = stopped.await;
        }));
        Ok(Self {
            addr,
            http: reqwest::Client::builder().timeout(WAIT).build()?,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Starts a replica and waits until `/readyz` says 200.
    pub async fn ready(config: Config) -> Result<Self> {
        let router = Self::start(config).await?;
        router.wait_ready().await?;
        Ok(router)
    }

    /// Starts a replica and waits until its index is loaded and its
    /// workers listed: ready, or not ready only for want of a
    /// decode-capable worker.
    pub async fn loaded(config: Config) -> Result<Self> {
        let router = Self::start(config).await?;
        wait_for("the index loaded and the workers listed", || async {
            let r = router.http.get(router.url("/readyz")).send().await.ok()?;
            let ready = r.status() == 200;
            let body = r.text().await.ok()?;
            (ready || body.contains("no decode-capable worker")).then_some(())
        })
        .await?;
        Ok(router)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub async fn wait_ready(&self) -> Result<()> {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Ok(r) = self.http.get(self.url("/readyz")).send().await {
                if r.status() == 200 {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                let body = self.get_text("/readyz").await.unwrap_or_default();
                bail!("the router is not ready after {WAIT:?}: {body}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn get_text(&self, path: &str) -> Result<String> {
        Ok(self.http.get(self.url(path)).send().await?.text().await?)
    }

    pub async fn post(&self, path: &str, body: serde_json::Value) -> Result<reqwest::Response> {
        Ok(self.http.post(self.url(path)).json(&body).send().await?)
    }

    pub async fn ledger(&self) -> Result<serde_json::Value> {
        Ok(self
            .http
            .get(self.url("/debug/ledger"))
            .send()
            .await?
            .json()
            .await?)
    }

    /// Waits until the replica knows `n` workers (registered, refused ones
    /// excluded).
    pub async fn wait_workers(&self, n: usize) -> Result<()> {
        wait_for("the router's worker list", || async {
            let ledger = self.ledger().await.ok()?;
            (ledger["workers"].as_array()?.len() == n).then_some(())
        })
        .await
    }

    /// Stops the replica gracefully; its result.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let task = self.task.take().unwrap();
        tokio::time::timeout(WAIT, task)
            .await
            .context("the router did not stop in time")???;
        Ok(())
    }
}

impl Drop for RouterHandle {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Polls `check` until it gives `Some`, for at most [`WAIT`].
pub async fn wait_for<T, F, Fut>(what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What a fake worker does with a request.
#[derive(Clone)]
pub enum Behavior {
    /// Prefill legs: `Prefilled` then `Finished`; other legs: `max_tokens`
    /// tokens `1000, 1001, ...` in chunks of two (with made-up
    /// log-probabilities when asked for), then `Finished`.
    Serve,
    /// Serve, but hold the last chunk until notified.
    Hold(Arc<Notify>),
    /// Never answer.
    Silent,
    /// Answer with a failure.
    Fail { retryable: bool },
    /// Skip a chunk index.
    SkipChunk,
    /// Lose the first chunk (index 0) and send the rest.
    SkipFirst,
    /// Never answer, and answer liveness probes that the leg is not held
    /// (as an agent whose request a dying NATS node lost).
    Forget,
}

/// The engine handle a prefill worker hands to the decode leg.
pub const ENGINE_PARAMS: &str = r#"{"remote_block_ids":[1,2,3]}"#;

/// A worker agent stand-in: registered in etcd, answering its generate
/// subject.
pub struct FakeWorker {
    pub id: WorkerId,
    pub requests: mpsc::UnboundedReceiver<GenerateRequest>,
    registration: Option<Registration>,
    task: JoinHandle<()>,
}

impl FakeWorker {
    pub async fn start(
        cluster: &Cluster,
        record: WorkerRecord,
        behavior: Behavior,
    ) -> Result<Self> {
        let client = cluster.bus.client().clone();
        let mut subscription = client.subscribe(record.subjects.generate.clone()).await?;
        client.flush().await?;
        let (tx, requests) = mpsc::unbounded_channel();
        let me = record.id.clone();
        let probes = match behavior {
            Behavior::Forget => Some(answer_probes_not_held(&client, &record.id).await?),
            _ => None,
        };
        let task = tokio::spawn(async move {
            let _probes = probes.map(AbortOnDrop);
            // Requests larger than the bus's payload limit come in
            // fragments, as the agent takes them.
            let mut fragments = protocol::Reassembly::new(1 << 30, 60_000);
            while let Some(message) = subscription.next().await {
                let request = match GenerateRequest::decode(&message.payload) {
                    Ok(request) => request,
                    Err(_) => {
                        let (Ok(f), Some(reply)) = (
                            protocol::RequestFragment::decode(&message.payload),
                            message.reply.as_ref(),
                        ) else {
                            continue;
                        };
                        match fragments.push(reply.as_str(), f, 0) {
                            Ok(Some(whole)) => match GenerateRequest::decode(&whole) {
                                Ok(request) => request,
                                Err(_) => continue,
                            },
                            _ => continue,
                        }
                    }
                };
                let Some(reply) = message.reply.clone() else {
                    continue;
                };
                let _ = tx.send(request.clone());
                let client = client.clone();
                let me = me.clone();
                let behavior = behavior.clone();
                tokio::spawn(async move {
                    let events = answer(&me, &request, &behavior).await;
                    let skip = match behavior {
                        Behavior::SkipChunk => Some(1),
                        Behavior::SkipFirst => Some(0),
                        _ => None,
                    };
                    let hold = match &behavior {
                        Behavior::Hold(n) => Some(n.clone()),
                        _ => None,
                    };
                    let last = events.len().saturating_sub(1);
                    for (i, event) in events.into_iter().enumerate() {
                        if skip == Some(i) {
                            continue;
                        }
                        if i == last {
                            if let Some(n) = &hold {
                                n.notified().await;
                            }
                        }
                        let chunk = GenerateChunk {
                            index: i as u32,
                            event,
                        };
                        let _ = client.publish(reply.clone(), chunk.encode().into()).await;
                    }
                    let _ = client.flush().await;
                });
            }
        });
        let registration = cluster
            .registry
            .register(&record, Duration::from_secs(5))
            .await?;
        Ok(Self {
            id: record.id,
            requests,
            registration: Some(registration),
            task,
        })
    }

    /// The next request this worker received.
    pub async fn next_request(&mut self) -> Result<GenerateRequest> {
        tokio::time::timeout(WAIT, self.requests.recv())
            .await
            .context("no request reached the worker")?
            .context("worker stopped")
    }

    pub fn no_request(&mut self) -> bool {
        self.requests.try_recv().is_err()
    }

    pub async fn deregister(&mut self) -> Result<()> {
        if let Some(r) = self.registration.take() {
            r.revoke().await?;
        }
        Ok(())
    }
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Aborts its task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Answers every `LegProbe` on the worker's ping subject: not held.
async fn answer_probes_not_held(
    client: &async_nats::Client,
    worker: &WorkerId,
) -> Result<JoinHandle<()>> {
    let mut probes = client.subscribe(protocol::subjects::ping(worker)).await?;
    client.flush().await?;
    let client = client.clone();
    Ok(tokio::spawn(async move {
        while let Some(probe) = probes.next().await {
            let Some(reply) = probe.reply else { continue };
            let answer = match protocol::LegProbe::decode(&probe.payload) {
                Ok(p) => protocol::LegProbeReply {
                    decision: p.decision,
                    in_flight: false,
                }
                .encode(),
                Err(_) => Vec::new(),
            };
            let _ = client.publish(reply, answer.into()).await;
        }
    }))
}

async fn answer(
    me: &WorkerId,
    request: &GenerateRequest,
    behavior: &Behavior,
) -> Vec<GenerateEvent> {
    match behavior {
        Behavior::Silent | Behavior::Forget => return Vec::new(),
        Behavior::Fail { retryable } => {
            return vec![GenerateEvent::Failed {
                error: "engine overloaded".into(),
                retryable: *retryable,
            }]
        }
        _ => {}
    }
    if request.stage == Stage::Prefill {
        return vec![
            GenerateEvent::Prefilled {
                transfer: KvTransferParams {
                    source: me.clone(),
                    prompt_tokens: request.prompt.len() as u32,
                    engine: Some(ENGINE_PARAMS.into()),
                },
                cached_tokens: Some(0),
            },
            GenerateEvent::Finished {
                output_tokens: 0,
                cached_tokens: Some(0),
                reason: FinishReason::Prefilled,
            },
        ];
    }
    let output: Vec<u32> = (0..request.max_tokens).map(|i| 1000 + i).collect();
    // With logprobs asked for: made-up ones, each token's `-t % 10 / 10`
    // and its `k` most likely the token itself and the next ids.
    let scored = |c: &[u32], k: u32| {
        let logprobs = c
            .iter()
            .map(|&t| {
                let lp = -((t % 10) as f32) / 10.0;
                protocol::TokenLogprob {
                    logprob: lp,
                    top: (0..k).map(|j| (t + j, lp - j as f32)).collect(),
                }
            })
            .collect();
        GenerateEvent::Scored {
            tokens: c.to_vec(),
            logprobs,
        }
    };
    let mut events: Vec<GenerateEvent> = output
        .chunks(2)
        .map(|c| match request.sampling.logprobs {
            Some(k) => scored(c, k),
            None => GenerateEvent::Tokens(c.to_vec()),
        })
        .collect();
    // An engine that does not say what it found cached.
    events.push(GenerateEvent::Finished {
        output_tokens: request.max_tokens,
        cached_tokens: None,
        reason: FinishReason::Length,
    });
    events
}

/// The kv-indexer's part: real deltas from worker KV events, published to
/// the delta stream, and snapshots.
pub struct Indexer {
    pub indexer: KvIndexer,
    seqs: HashMap<WorkerId, u64>,
    bus: Bus,
    pub published: Mutex<u64>,
}

impl Indexer {
    pub fn new(cluster: &Cluster) -> Self {
        Self {
            indexer: KvIndexer::new(OwnershipIndex::new()),
            seqs: HashMap::new(),
            bus: cluster.bus.clone(),
            published: Mutex::new(0),
        }
    }

    /// An indexer whose deltas continue the stream after `seq` (the
    /// stream's numbering is global: a second indexer in a test must
    /// start where the first stopped).
    pub fn new_from(cluster: &Cluster, seq: u64) -> Self {
        let mut indexer = Self::new(cluster);
        let snapshot = IndexSnapshot {
            delta_seq: seq,
            workers: Vec::new(),
            cursors: Vec::new(),
            runs: Vec::new(),
            digest: OwnershipIndex::new().digest(),
        };
        indexer.indexer =
            KvIndexer::restore(OwnershipIndex::new(), snapshot).expect("an empty snapshot");
        indexer
    }

    /// `worker` now holds the full blocks of `prompt` (on the device);
    /// the delta is published to the stream.
    pub async fn store(&mut self, worker: &str, prompt: &[u32]) -> Result<u64> {
        let delta = self.next_delta(worker, prompt)?;
        self.bus.publish_delta(&delta).await?;
        Ok(delta.seq)
    }

    /// The next delta: `worker` now holds the full blocks of `prompt` (on
    /// the device); published nowhere.
    pub fn next_delta(&mut self, worker: &str, prompt: &[u32]) -> Result<IndexDelta> {
        let worker = id(worker);
        let hashes = hasher().hash_prompt(prompt);
        let seq = self.seqs.entry(worker.clone()).or_insert(0);
        let mut events = Vec::new();
        if *seq == 0 {
            events.push(KvEvent::Cleared);
        }
        events.push(KvEvent::Stored {
            parent: None,
            blocks: hashes,
            tier: Tier::Device,
        });
        let batch = KvEventBatch {
            worker,
            epoch: 1,
            seq: *seq,
            events,
        };
        *seq += 1;
        self.indexer
            .apply(batch)
            .delta
            .context("the batch gave no delta")
    }

    pub fn snapshot(&self) -> IndexSnapshot {
        self.indexer.snapshot()
    }
}
