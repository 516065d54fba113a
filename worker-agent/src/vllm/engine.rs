//! [`VllmEngine`]: a real engine (vLLM, or SGLang) behind the agent's
//! [`Engine`] trait. The IO shell around the pure parts: one task owns the
//! ZMQ sockets and the [`RankCore`] (one event enum, one `select!`), one
//! task scrapes `/metrics`, and each generation request is one HTTP call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use engine_sim::Preset;
use futures::stream::{self, BoxStream};
use futures::StreamExt;
use metrics::counter;
use protocol::{
    BlockHasher, FinishReason, GenerateEvent, GenerateRequest, HashingContract, KvTransferParams,
    Role, Stage, WorkerId,
};
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, error, info, warn, Instrument};
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket};

use super::openai::{self, Kind};
use super::prom::{self, ScrapedLoad};
use super::sequence::{Action, RankCore, Stats};
use super::translate::Translator;
use super::wire::parse_live;
use super::zmq::{self as z, ReplayLimits, ReplayMsg};
use crate::engine::{Engine, EngineFacts, EngineLoad, KvUpdate};
use crate::metrics as m;

/// Which engine is behind the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    Vllm,
    Sglang,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        }
    }
}

/// How to reach the engine and what the deployment expects of it.
#[derive(Debug, Clone)]
pub struct VllmConfig {
    pub kind: EngineKind,
    /// The worker (its data-parallel rank offsets the ZMQ ports).
    pub worker: WorkerId,
    pub role: Role,
    /// The deployment's model: the engine must serve it.
    pub model: String,
    /// The deployment's block size: the engine's blocks must have it.
    pub block_size: u32,
    /// The OpenAI API's base URL, e.g. `http://127.0.0.1:8000`.
    pub api_url: String,
    /// The KV-event publisher of rank 0, e.g. `tcp://127.0.0.1:5557`.
    pub kv_events: String,
    /// The replay socket of rank 0, if the engine has one.
    pub kv_replay: Option<String>,
    pub topic: String,
    /// Data-parallel ranks behind one API server: requests are pinned to
    /// this worker's rank (`X-data-parallel-rank`) when above 1.
    pub dp_size: u32,
    /// Hardware facts for the registration (GPUs, KV bytes per token,
    /// step budget) and the KV capacity when the engine does not say.
    pub preset: Preset,
    pub kv_capacity_blocks: Option<u32>,
    /// How long to wait for the engine to come up.
    pub startup_timeout: Duration,
    /// A request that makes no progress for this long fails (retryable).
    pub request_timeout: Duration,
    pub metrics_interval: Duration,
    /// Ask for generated token ids (`return_token_ids`).
    pub return_token_ids: bool,
    /// Limits of one replay request.
    pub replay: ReplayLimits,
    /// When nothing came on the SUB socket for this long, ask the replay
    /// socket for anything after the last batch seen; `None`: never.
    pub idle_check: Option<Duration>,
}

/// Why the adapter cannot start.
#[derive(Debug, thiserror::Error)]
pub enum VllmError {
    #[error("the {kind} engine's API at {url} did not answer within {waited:?}: {last}")]
    Unreachable {
        kind: &'static str,
        url: String,
        waited: Duration,
        last: String,
    },
    #[error("the engine at {url} serves no model")]
    NoModel { url: String },
    #[error("the engine's KV events: {0}")]
    Zmq(String),
    #[error("the HTTP client: {0}")]
    Http(String),
    #[error("the engine names blocks differently from the deployment (model {:?}, block size {}): {source}", configured.model, configured.block_size)]
    Contract {
        configured: HashingContract,
        #[source]
        source: protocol::ContractMismatch,
    },
}

/// Facts learned at start, and how.
#[derive(Debug, Clone)]
struct Learned {
    served_model: String,
    block_size: u32,
    block_size_from: &'static str,
    capacity: u64,
}

/// State shared by the engine's tasks and its handle.
#[derive(Debug, Default)]
struct Shared {
    scraped: Mutex<ScrapedLoad>,
    inflight: Mutex<Inflight>,
    failure: Mutex<Option<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The requests this agent has in flight on the engine: what the
/// engine's metrics do not say (prompt tokens still to prefill, blocks of
/// decoding requests).
#[derive(Debug, Default)]
struct Inflight {
    next: u64,
    requests: HashMap<u64, InflightRequest>,
}

#[derive(Debug, Clone, Copy)]
struct InflightRequest {
    prompt_tokens: u64,
    produced: u64,
    decoding: bool,
}

/// Removes its request from the in-flight set when dropped.
struct InflightGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl InflightGuard {
    fn new(shared: &Arc<Shared>, prompt_tokens: usize) -> Self {
        let mut inflight = lock(&shared.inflight);
        let id = inflight.next;
        inflight.next += 1;
        inflight.requests.insert(
            id,
            InflightRequest {
                prompt_tokens: prompt_tokens as u64,
                produced: 0,
                decoding: false,
            },
        );
        Self {
            shared: shared.clone(),
            id,
        }
    }

    fn produced(&self, tokens: usize) {
        if let Some(r) = lock(&self.shared.inflight).requests.get_mut(&self.id) {
            r.decoding = true;
            r.produced += tokens as u64;
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        lock(&self.shared.inflight).requests.remove(&self.id);
    }
}

/// A commands to the KV task.
#[derive(Debug)]
enum KvCommand {
    BlockSet,
}

/// A real engine behind the agent. See the module documentation of
/// [`crate::vllm`].
#[derive(Debug)]
pub struct VllmEngine {
    facts: EngineFacts,
    ctx: Arc<RequestContext>,
    shared: Arc<Shared>,
    kv_updates: Mutex<Option<mpsc::UnboundedReceiver<KvUpdate>>>,
    commands: mpsc::UnboundedSender<KvCommand>,
    stop: watch::Sender<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// What every generation request needs.
#[derive(Debug)]
struct RequestContext {
    kind: EngineKind,
    http: reqwest::Client,
    completions_url: String,
    model: String,
    worker: WorkerId,
    dp_size: u32,
    block_size: u32,
    return_token_ids: bool,
    timeout: Duration,
    stop: watch::Receiver<bool>,
}

impl VllmEngine {
    /// Waits for the engine's API (up to the startup timeout), learns its
    /// model, block size and capacity, subscribes to its KV events and
    /// starts reading them and its metrics. Call inside a tokio runtime.
    pub async fn connect(config: VllmConfig) -> Result<Self, VllmError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| VllmError::Http(e.to_string()))?;
        let base = config.api_url.trim_end_matches('/').to_owned();
        let started = Instant::now();
        let deadline = started + config.startup_timeout;
        let rank = config.worker.dp_rank();

        // 1. The API is up and serves a model.
        let models_url = format!("{base}/v1/models");
        let mut said = false;
        let models = loop {
            match get_json(&http, &models_url, Duration::from_secs(5)).await {
                Ok(v) => break v,
                Err(e) => {
                    if Instant::now() >= deadline {
                        return Err(VllmError::Unreachable {
                            kind: config.kind.as_str(),
                            url: models_url,
                            waited: config.startup_timeout,
                            last: e,
                        });
                    }
                    if !said {
                        info!(url = %models_url, error = %e, "waiting for the engine's API");
                        said = true;
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        };
        let served: Vec<String> = models["data"]
            .as_array()
            .map(|d| {
                d.iter()
                    .filter_map(|m| m["id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let served_model = if served.contains(&config.model) {
            config.model.clone()
        } else {
            served
                .first()
                .cloned()
                .ok_or(VllmError::NoModel { url: base.clone() })?
        };

        // 2. Block size and capacity: mock-vllm says at /switchyard/config;
        // vLLM exports its cache configuration as metric labels; otherwise
        // the deployment's block size, checked against the first
        // BlockStored.
        let sy = get_json(
            &http,
            &format!("{base}/switchyard/config"),
            Duration::from_secs(2),
        )
        .await
        .ok();
        let scraped = scrape(&http, &format!("{base}/metrics"), &served_model, rank)
            .await
            .ok();
        let (block_size, block_size_from) = match (
            sy.as_ref()
                .and_then(|c| c["block_size"].as_u64())
                .and_then(|b| u32::try_from(b).ok()),
            scraped.and_then(|s| s.block_size),
        ) {
            (Some(b), _) => (b, "/switchyard/config"),
            (None, Some(b)) => (b, "vllm:cache_config_info"),
            (None, None) => (
                config.block_size,
                "configuration (checked against the first BlockStored)",
            ),
        };
        let capacity = config
            .kv_capacity_blocks
            .map(u64::from)
            .or_else(|| sy.as_ref().and_then(|c| c["kv_capacity_blocks"].as_u64()))
            .or_else(|| scraped.and_then(|s| s.num_gpu_blocks))
            .unwrap_or_else(|| u64::from(config.preset.kv_capacity_blocks(block_size.max(1))));
        let learned = Learned {
            served_model,
            block_size,
            block_size_from,
            capacity,
        };
        info!(
            engine = config.kind.as_str(),
            url = %base,
            model = %learned.served_model,
            block_size = learned.block_size,
            block_size_from = learned.block_size_from,
            kv_capacity_blocks = learned.capacity,
            "engine API up"
        );
        let facts = EngineFacts {
            contract: HashingContract::for_model(&learned.served_model, learned.block_size),
            kv_capacity_blocks: learned.capacity,
            max_batched_tokens: config.preset.max_batched_tokens,
            kv_bytes_per_token: config.preset.kv_bytes_per_token,
            gpus: config.preset.gpus,
        };

        // A model or block size the deployment does not use is refused
        // before anything else.
        let configured = HashingContract::for_model(&config.model, config.block_size);
        if let Err(source) = configured.check(&facts.contract) {
            return Err(VllmError::Contract { configured, source });
        }

        // 3. KV events: subscribe now; the history comes from the replay.
        let events_endpoint =
            z::offset_endpoint(&config.kv_events, rank).map_err(VllmError::Zmq)?;
        let replay_endpoint = config
            .kv_replay
            .as_deref()
            .map(|e| z::offset_endpoint(e, rank))
            .transpose()
            .map_err(VllmError::Zmq)?;
        let sub = z::connect_sub(&events_endpoint, &config.topic, deadline)
            .await
            .map_err(VllmError::Zmq)?;
        info!(
            endpoint = %events_endpoint,
            replay = replay_endpoint.as_deref().unwrap_or("none"),
            topic = %config.topic,
            "subscribed to the engine's KV events"
        );

        let shared = Arc::new(Shared::default());
        *lock(&shared.scraped) = scraped.unwrap_or_default();
        let (stop, stop_rx) = watch::channel(false);
        let (updates_tx, updates_rx) = mpsc::unbounded_channel();
        let (commands_tx, commands_rx) = mpsc::unbounded_channel();
        // The deployment's hasher: the translator names blocks the way the
        // router does (the block size is checked event by event).
        let hasher = BlockHasher::new(
            config.block_size,
            HashingContract::for_model(&config.model, config.block_size).salt,
        )
        .map_err(|e| VllmError::Zmq(e.to_string()))?;
        let core = RankCore::new(
            Translator::new(&config.model, hasher),
            rank,
            replay_endpoint.is_some(),
            100_000,
        );
        let span = tracing::Span::current();
        let kv_task = tokio::spawn(
            KvTask {
                core,
                sub,
                topic: Bytes::from(config.topic.clone().into_bytes()),
                replay_endpoint,
                replay_limits: config.replay,
                idle_check: config.idle_check,
                updates: updates_tx,
                commands: commands_rx,
                stop: stop_rx.clone(),
                shared: shared.clone(),
                exported: Stats::default(),
            }
            .run()
            .instrument(span.clone()),
        );
        let scrape_task = tokio::spawn(
            scrape_loop(
                http.clone(),
                format!("{base}/metrics"),
                learned.served_model.clone(),
                rank,
                config.metrics_interval,
                shared.clone(),
                stop_rx.clone(),
            )
            .instrument(span),
        );
        let ctx = Arc::new(RequestContext {
            kind: config.kind,
            http,
            completions_url: format!("{base}/v1/completions"),
            model: learned.served_model.clone(),
            worker: config.worker.clone(),
            dp_size: config.dp_size,
            block_size: learned.block_size,
            return_token_ids: config.return_token_ids,
            timeout: config.request_timeout,
            stop: stop_rx,
        });
        Ok(Self {
            facts,
            ctx,
            shared,
            kv_updates: Mutex::new(Some(updates_rx)),
            commands: commands_tx,
            stop,
            tasks: Mutex::new(vec![kv_task, scrape_task]),
        })
    }
}

impl Drop for VllmEngine {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}

impl Engine for VllmEngine {
    fn facts(&self) -> EngineFacts {
        self.facts.clone()
    }

    fn take_kv_updates(&self) -> Option<BoxStream<'static, KvUpdate>> {
        let mut rx = lock(&self.kv_updates).take()?;
        Some(stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed())
    }

    fn request_block_set(&self) {
        let _ = self.commands.send(KvCommand::BlockSet);
    }

    fn load(&self) -> EngineLoad {
        let scraped = *lock(&self.shared.scraped);
        let bs = u64::from(self.ctx.block_size.max(1));
        let (mut running, mut waiting, mut queued, mut decode_blocks) = (0u32, 0u32, 0u64, 0u64);
        for r in lock(&self.shared.inflight).requests.values() {
            if r.decoding {
                running += 1;
                decode_blocks += (r.prompt_tokens + r.produced).div_ceil(bs);
            } else {
                waiting += 1;
                queued += r.prompt_tokens;
            }
        }
        let total = self.facts.kv_capacity_blocks;
        let as_u32 = |v: f64| {
            if v.is_finite() && v > 0.0 {
                v.round().min(f64::from(u32::MAX)) as u32
            } else {
                0
            }
        };
        EngineLoad {
            // The engine's own counts include requests from others; before
            // the first scrape, this agent's requests.
            running: scraped.running.map_or(running, as_u32),
            waiting: scraped.waiting.map_or(waiting, as_u32),
            queued_prefill_tokens: queued,
            active_decode_blocks: decode_blocks,
            kv_blocks_used: scraped
                .kv_usage
                .map_or(0, |u| (u * total as f64).round() as u64)
                .min(total),
            kv_blocks_total: total,
        }
    }

    fn generate(&self, request: GenerateRequest) -> BoxStream<'static, GenerateEvent> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let ctx = self.ctx.clone();
        let guard = InflightGuard::new(&self.shared, request.prompt.len());
        tokio::spawn(
            async move {
                // A dropped stream (the router cancelled the request) drops
                // the HTTP response, and vLLM aborts a request whose
                // connection closed. The stream also stops at the next
                // token it cannot pass on; this covers a silent engine
                // (queued, or in a long prefill).
                tokio::select! {
                    () = ctx.serve(request, &tx, &guard) => {}
                    () = tx.closed() => {}
                }
            }
            .in_current_span(),
        );
        stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
    }

    fn stop(&self) {
        let _ = self.stop.send(true);
    }

    fn failure(&self) -> Option<String> {
        lock(&self.shared.failure).clone()
    }
}

async fn get_json(http: &reqwest::Client, url: &str, timeout: Duration) -> Result<Value, String> {
    let response = tokio::time::timeout(timeout, http.get(url).send())
        .await
        .map_err(|_| format!("GET {url} timed out"))?
        .map_err(|e| format!("GET {url}: {e}"))?;
    let status = response.status();
    if !status.is_success() {
        return Err(format!("GET {url}: HTTP {status}"));
    }
    tokio::time::timeout(timeout, response.json::<Value>())
        .await
        .map_err(|_| format!("GET {url}: body timed out"))?
        .map_err(|e| format!("GET {url}: {e}"))
}

async fn scrape(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    rank: u32,
) -> Result<ScrapedLoad, String> {
    let timeout = Duration::from_secs(2);
    let response = tokio::time::timeout(timeout, http.get(url).send())
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("HTTP {}", response.status()));
    }
    let text = tokio::time::timeout(timeout, response.text())
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    let (samples, bad) = prom::parse(&text);
    if bad > 0 {
        counter!(m::ENGINE_SCRAPE_ERRORS, "reason" => "bad_line").increment(bad as u64);
    }
    Ok(prom::load(&samples, Some(model), rank))
}

async fn scrape_loop(
    http: reqwest::Client,
    url: String,
    model: String,
    rank: u32,
    interval: Duration,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        match scrape(&http, &url, &model, rank).await {
            Ok(load) => {
                if failing {
                    info!(url, "engine metrics scraped again");
                    failing = false;
                }
                *lock(&shared.scraped) = load;
            }
            Err(e) => {
                counter!(m::ENGINE_SCRAPE_ERRORS, "reason" => "request").increment(1);
                if !failing {
                    warn!(url, error = %e, "engine metrics not scraped; the load keeps its last values");
                    failing = true;
                }
            }
        }
    }
}

/// The KV task: the SUB socket, replays and block-set requests, around
/// the [`RankCore`].
struct KvTask {
    core: RankCore,
    sub: SubSocket,
    topic: Bytes,
    replay_endpoint: Option<String>,
    replay_limits: ReplayLimits,
    idle_check: Option<Duration>,
    updates: mpsc::UnboundedSender<KvUpdate>,
    commands: mpsc::UnboundedReceiver<KvCommand>,
    stop: watch::Receiver<bool>,
    shared: Arc<Shared>,
    /// Stats already exported as metrics.
    exported: Stats,
}

/// Everything that happens to the KV task.
enum KvTaskEvent {
    Stop,
    Live(zeromq::ZmqResult<zeromq::ZmqMessage>),
    Socket(Option<SocketEvent>),
    Replay(Option<ReplayMsg>),
    Command(Option<KvCommand>),
    IdleTick,
}

impl KvTask {
    async fn run(mut self) {
        let mut monitor = self.sub.monitor();
        let mut monitor_open = true;
        let mut socket_errors = 0u32;
        let (replay_tx, mut replay_rx) = mpsc::unbounded_channel();
        let mut replay_task: Option<JoinHandle<()>> = None;
        let idle_period = self.idle_check.unwrap_or(Duration::from_secs(3600));
        let mut idle = tokio::time::interval_at(Instant::now() + idle_period, idle_period);
        idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heard = false;
        let actions = self.core.start();
        if self.execute(actions, &replay_tx, &mut replay_task).is_err() {
            return;
        }
        loop {
            let event = tokio::select! {
                _ = self.stop.changed() => KvTaskEvent::Stop,
                message = self.sub.recv() => KvTaskEvent::Live(message),
                e = monitor.next(), if monitor_open => KvTaskEvent::Socket(e),
                r = replay_rx.recv() => KvTaskEvent::Replay(r),
                c = self.commands.recv() => KvTaskEvent::Command(c),
                _ = idle.tick(), if self.idle_check.is_some() => KvTaskEvent::IdleTick,
            };
            let actions = match event {
                KvTaskEvent::Stop | KvTaskEvent::Command(None) => break,
                KvTaskEvent::IdleTick => {
                    if std::mem::take(&mut heard) {
                        Vec::new()
                    } else {
                        self.core.on_idle()
                    }
                }
                KvTaskEvent::Live(Ok(message)) => {
                    socket_errors = 0;
                    heard = true;
                    let frames = message.into_vec();
                    match parse_live(&frames) {
                        Ok((topic, seq, payload)) if topic == self.topic.as_ref() => {
                            let payload = frames[2].slice_ref(payload);
                            self.core.on_live(seq, payload)
                        }
                        Ok((topic, ..)) => {
                            counter!(m::ENGINE_KV_SKIPPED, "reason" => "other_topic").increment(1);
                            debug!(topic = %String::from_utf8_lossy(topic), "a message on another topic");
                            Vec::new()
                        }
                        Err(e) => {
                            counter!(m::ENGINE_KV_SKIPPED, "reason" => "bad_frames").increment(1);
                            warn!(error = %e, "a malformed KV event message: skipped");
                            Vec::new()
                        }
                    }
                }
                KvTaskEvent::Live(Err(e)) => {
                    // The SUB socket reconnects by itself; errors in a row
                    // slow the loop down rather than spin it.
                    socket_errors += 1;
                    debug!(error = %e, "KV event socket error");
                    if socket_errors > 1 {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Vec::new()
                }
                KvTaskEvent::Socket(Some(SocketEvent::Disconnected(_))) => {
                    warn!("the engine's KV event publisher disconnected; reconnecting (the next batch rebuilds from the engine's history)");
                    self.core.on_reconnected();
                    Vec::new()
                }
                KvTaskEvent::Socket(None) => {
                    monitor_open = false;
                    Vec::new()
                }
                KvTaskEvent::Socket(Some(_)) => Vec::new(),
                KvTaskEvent::Replay(Some(ReplayMsg::Batch { seq, payload })) => {
                    self.core.on_replay(seq, payload)
                }
                KvTaskEvent::Replay(Some(ReplayMsg::End)) => {
                    replay_task = None;
                    self.core.on_replay_end()
                }
                KvTaskEvent::Replay(Some(ReplayMsg::Failed(e))) => {
                    replay_task = None;
                    warn!(error = %e, "KV event replay failed");
                    self.core.on_replay_failed()
                }
                KvTaskEvent::Replay(None) => Vec::new(),
                KvTaskEvent::Command(Some(KvCommand::BlockSet)) => {
                    if self
                        .updates
                        .send(KvUpdate::BlockSet(self.core.block_set()))
                        .is_err()
                    {
                        break;
                    }
                    Vec::new()
                }
            };
            if self.execute(actions, &replay_tx, &mut replay_task).is_err() {
                break;
            }
        }
        if let Some(task) = replay_task {
            task.abort();
        }
    }

    /// Carries out the core's actions; `Err` when the task must end.
    fn execute(
        &mut self,
        actions: Vec<Action>,
        replay_tx: &mpsc::UnboundedSender<ReplayMsg>,
        replay_task: &mut Option<JoinHandle<()>>,
    ) -> Result<(), ()> {
        let mut result = Ok(());
        for action in actions {
            match action {
                Action::Events(events) => {
                    if self.updates.send(KvUpdate::Events(events)).is_err() {
                        result = Err(());
                    }
                }
                Action::NewEpoch { set, reason } => {
                    counter!(m::ENGINE_KV_NEW_EPOCHS, "reason" => reason.as_str()).increment(1);
                    info!(
                        reason = reason.as_str(),
                        blocks = set.len(),
                        "the engine's block set starts a new epoch"
                    );
                    if self.updates.send(KvUpdate::BlockSet(set)).is_err() {
                        result = Err(());
                    }
                }
                Action::Replay { from } => {
                    let Some(endpoint) = self.replay_endpoint.clone() else {
                        // The core asks only when there is a replay socket.
                        continue;
                    };
                    debug!(from, "asking the engine for a replay");
                    if let Some(old) = replay_task.take() {
                        old.abort();
                    }
                    *replay_task = Some(tokio::spawn(
                        z::replay(endpoint, from, self.replay_limits, replay_tx.clone())
                            .in_current_span(),
                    ));
                }
                Action::Fatal(mismatch) => {
                    counter!(m::CONTRACT_REFUSALS, "reason" => "block_size").increment(1);
                    error!(
                        engine_block_size = mismatch.engine,
                        deployment_block_size = mismatch.deployment,
                        "REFUSING the engine: {mismatch}"
                    );
                    *lock(&self.shared.failure) = Some(mismatch.to_string());
                    result = Err(());
                }
            }
        }
        self.export_stats();
        result
    }

    /// Adds the core's new counts to the metrics.
    fn export_stats(&mut self) {
        let now = self.core.stats().clone();
        let old = &self.exported;
        for ((what, new), (_, was)) in now.counters().into_iter().zip(old.counters()) {
            if new > was {
                counter!(m::ENGINE_KV, "what" => what).increment(new - was);
            }
        }
        for (reason, n) in &now.skipped_events {
            let was = old.skipped_events.get(reason).copied().unwrap_or(0);
            if *n > was {
                counter!(m::ENGINE_KV_SKIPPED, "reason" => *reason).increment(n - was);
            }
        }
        if now.unknown_parents > old.unknown_parents {
            warn!(
                total = now.unknown_parents,
                "BlockStored events whose parent is unknown: their blocks are not reported (rebuilding from the engine's history when it has it)"
            );
        }
        if now.malformed_batches > old.malformed_batches {
            warn!(
                total = now.malformed_batches,
                "malformed KV event batches skipped"
            );
        }
        self.exported = now;
    }
}

impl RequestContext {
    /// Serves one request, sending its events to `out`.
    async fn serve(
        &self,
        request: GenerateRequest,
        out: &mpsc::UnboundedSender<GenerateEvent>,
        guard: &InflightGuard,
    ) {
        let mut stop = self.stop.clone();
        if *stop.borrow() {
            let _ = out.send(GenerateEvent::Failed {
                error: "the engine adapter stopped".into(),
                retryable: true,
            });
            return;
        }
        tokio::select! {
            // The stream just ends: the agent reports a retryable failure.
            _ = stop.changed() => {}
            () = self.serve_inner(request, out, guard) => {}
        }
    }

    async fn serve_inner(
        &self,
        request: GenerateRequest,
        out: &mpsc::UnboundedSender<GenerateEvent>,
        guard: &InflightGuard,
    ) {
        let kind = match &request.stage {
            Stage::Local => Kind::Local,
            Stage::Prefill | Stage::Decode { .. } if self.kind == EngineKind::Sglang => {
                let _ = out.send(GenerateEvent::Failed {
                    error: "remote prefill on SGLang needs its bootstrap handshake, which this adapter does not implement: serve SGLang workers aggregated (bypass only)".into(),
                    retryable: false,
                });
                return;
            }
            Stage::Prefill => Kind::Prefill,
            Stage::Decode { transfer } => match transfer
                .engine
                .as_deref()
                .map(serde_json::from_str::<Value>)
            {
                Some(Ok(Value::Object(params))) => Kind::Decode(params),
                other => {
                    counter!(m::ENGINE_DECODE_WITHOUT_PARAMS).increment(1);
                    warn!(
                        request_id = %request.request_id,
                        source = %transfer.source,
                        params = ?other.map(|r| r.map_err(|e| e.to_string())),
                        "a decode without the prefill engine's kv_transfer_params: served as a local prefill"
                    );
                    Kind::Local
                }
            },
        };
        let body = openai::completion_body(
            &self.model,
            &request.prompt,
            request.max_tokens,
            &kind,
            self.return_token_ids,
        );
        let mut call = self
            .http
            .post(&self.completions_url)
            .header("x-request-id", request.request_id.as_str())
            .json(&body);
        if self.dp_size > 1 {
            call = call.header("x-data-parallel-rank", self.worker.dp_rank().to_string());
        }
        let response = match tokio::time::timeout(self.timeout, call.send()).await {
            Err(_) => {
                return fail(
                    out,
                    true,
                    format!("the engine did not answer within {:?}", self.timeout),
                );
            }
            Ok(Err(e)) => {
                let error = if e.is_connect() {
                    format!("the engine at {} is unreachable: {e}", self.completions_url)
                } else {
                    format!(
                        "the request to the engine at {} failed: {e}",
                        self.completions_url
                    )
                };
                return fail(out, true, error);
            }
            Ok(Ok(r)) => r,
        };
        let status = response.status();
        if !status.is_success() {
            let text = tokio::time::timeout(Duration::from_secs(5), response.text())
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
            return fail(
                out,
                openai::retryable_status(status.as_u16()),
                format!(
                    "the engine answered HTTP {status}: {}",
                    openai::error_message(&text)
                ),
            );
        }
        if kind == Kind::Prefill {
            return self.prefilled(request, response, out).await;
        }
        self.stream(response, out, guard).await;
    }

    /// A prefill's non-streamed response: its `kv_transfer_params`.
    async fn prefilled(
        &self,
        request: GenerateRequest,
        response: reqwest::Response,
        out: &mpsc::UnboundedSender<GenerateEvent>,
    ) {
        let body = match tokio::time::timeout(self.timeout, response.json::<Value>()).await {
            Err(_) => {
                return fail(
                    out,
                    true,
                    "the prefill response did not complete in time".into(),
                )
            }
            Ok(Err(e)) => return fail(out, true, format!("the prefill response is not JSON: {e}")),
            Ok(Ok(v)) => v,
        };
        let chunk = match openai::parse_chunk(&body) {
            Ok(c) => c,
            Err(e) => return fail(out, false, format!("the prefill response: {e}")),
        };
        if let Some((error, code)) = chunk.error {
            return fail(
                out,
                code.is_none_or(openai::retryable_status),
                format!("the engine failed the prefill: {error}"),
            );
        }
        let Some(params) = chunk.kv_transfer_params else {
            return fail(
                out,
                false,
                "the prefill engine returned no kv_transfer_params: is it started with a KV connector (e.g. --kv-transfer-config with NixlConnector, kv_role kv_producer or kv_both)?".into(),
            );
        };
        let cached = chunk.usage.map_or(0, |u| u.cached_tokens);
        let _ = out.send(GenerateEvent::Prefilled {
            transfer: KvTransferParams {
                source: self.worker.clone(),
                prompt_tokens: request.prompt.len() as u32,
                engine: Some(params.to_string()),
            },
            cached_tokens: cached,
        });
        let _ = out.send(GenerateEvent::Finished {
            output_tokens: 0,
            cached_tokens: cached,
            reason: FinishReason::Prefilled,
        });
    }

    /// A streamed completion: tokens as they come, then the end.
    async fn stream(
        &self,
        response: reqwest::Response,
        out: &mpsc::UnboundedSender<GenerateEvent>,
        guard: &InflightGuard,
    ) {
        let mut body = response.bytes_stream();
        let mut sse = openai::SseParser::new();
        let mut produced = 0u32;
        let mut finish: Option<String> = None;
        let mut usage = None;
        let mut text_only = false;
        loop {
            let next = match tokio::time::timeout(self.timeout, body.next()).await {
                Err(_) => {
                    return fail(
                        out,
                        true,
                        format!("the engine sent nothing for {:?}", self.timeout),
                    );
                }
                Ok(next) => next,
            };
            let datas = match next {
                Some(Ok(bytes)) => match sse.feed(&bytes) {
                    Ok(d) => d,
                    Err(e) => return fail(out, false, format!("the engine's stream: {e}")),
                },
                Some(Err(e)) => return fail(out, true, format!("the engine's stream broke: {e}")),
                None => {
                    let rest: Vec<String> = sse.finish().into_iter().collect();
                    if rest.is_empty() {
                        return match finish {
                            // A stream without [DONE] that said it finished.
                            Some(reason) => finished(out, produced, usage, &reason),
                            None => fail(
                                out,
                                true,
                                "the engine closed the stream before the request finished".into(),
                            ),
                        };
                    }
                    rest
                }
            };
            for data in datas {
                match openai::parse_event(&data) {
                    Ok(openai::Event::Done) => {
                        return finished(
                            out,
                            produced,
                            usage,
                            finish.as_deref().unwrap_or("length"),
                        );
                    }
                    Ok(openai::Event::Chunk(c)) => {
                        if let Some((error, code)) = c.error {
                            return fail(
                                out,
                                code.is_none_or(openai::retryable_status),
                                format!("the engine failed the request: {error}"),
                            );
                        }
                        match c.token_ids {
                            Some(ids) if !ids.is_empty() => {
                                produced += ids.len() as u32;
                                guard.produced(ids.len());
                                if out.send(GenerateEvent::Tokens(ids)).is_err() {
                                    return;
                                }
                            }
                            Some(_) => {}
                            None if c.text.is_some() => {
                                guard.produced(1);
                                counter!(m::ENGINE_TEXT_ONLY_CHUNKS).increment(1);
                                if !text_only {
                                    text_only = true;
                                    warn!("the engine streams text without token ids (it ignores return_token_ids): no tokens can be reported");
                                }
                            }
                            None => {}
                        }
                        if c.finish_reason.is_some() {
                            finish = c.finish_reason;
                        }
                        if c.usage.is_some() {
                            usage = c.usage;
                        }
                    }
                    Err(e) => {
                        counter!(m::ENGINE_KV_SKIPPED, "reason" => "bad_chunk").increment(1);
                        warn!(error = %e, "an unreadable chunk from the engine: skipped");
                    }
                }
            }
        }
    }
}

fn fail(out: &mpsc::UnboundedSender<GenerateEvent>, retryable: bool, error: String) {
    let _ = out.send(GenerateEvent::Failed { error, retryable });
}

fn finished(
    out: &mpsc::UnboundedSender<GenerateEvent>,
    produced: u32,
    usage: Option<openai::Usage>,
    reason: &str,
) {
    let _ = out.send(GenerateEvent::Finished {
        output_tokens: usage.map_or(produced, |u| u.completion_tokens.max(produced)),
        cached_tokens: usage.map_or(0, |u| u.cached_tokens),
        reason: if reason == "length" {
            FinishReason::Length
        } else {
            FinishReason::Stop
        },
    });
}
