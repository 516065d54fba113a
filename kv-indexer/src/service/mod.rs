//! The kv-indexer service: a thin shell around [`KvIndexer`] on NATS
//! JetStream and etcd.
//!
//! - [`Candidate::bind`] binds and serves HTTP and connects to NATS and
//!   etcd; [`Candidate::lead`] campaigns in the leader election (a standby
//!   until elected, see [`standby`]), then sets the streams' limits,
//!   recovers the state (latest snapshot + the delta log after it, see
//!   [`recovery`]) and opens the durable KV consumer where the recovered
//!   state ends (see [`consumer`]). [`Service::start`] is both.
//! - [`Service::run`] is one loop over one [`Event`] enum in one `select!`:
//!   KV messages are decoded and applied to the core; each resulting delta
//!   is announced to the routers on core NATS and published to the delta
//!   stream (pipelined, in order), and only once the stream confirms it is
//!   its KV message acked; worker removals from etcd, resync requests,
//!   overlap queries, `/status`, periodic snapshots and trimming happen in
//!   the same loop.
//!
//! A refused delta ([`bus::BusError::Fenced`]: another indexer writes the
//! delta stream) stops the service with [`ServiceError::Fenced`]; a lease
//! that could not be renewed ([`bus::Leadership::lost`]: a standby may lead
//! by now) with [`ServiceError::LostLeadership`]. On shutdown the leader
//! resigns, and a standby takes over at once.

pub mod config;
pub mod consumer;
pub mod guard;
pub mod http;
pub mod metrics;
pub mod overlap;
pub mod recovery;
pub mod resync;
pub mod snapshots;
pub mod standby;
pub mod workers;

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::pull::{MessagesError, MessagesErrorKind};
use async_nats::jetstream::message::AckKind;
use bus::{Bus, BusError, Leadership, Registry, RegistryError, StreamLimits, WorkerChange};
use futures::StreamExt;
use protocol::{subjects, IndexDelta, KvEventBatch, Message, WorkerId};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};

pub use self::config::Config;
use self::consumer::{Confirmed, ConsumerError, Pipeline, PipelineError};
use self::http::StatusRequest;
use self::metrics::Metrics;
use self::recovery::RecoveryError;
use self::resync::{ResyncLimiter, ResyncOutcome};
use self::snapshots::{SnapshotPolicy, Stored};
use self::standby::Role;
use self::workers::{Liveness, RegistryEvent};
use crate::index::OwnershipIndex;
use crate::indexer::{BatchStatus, KvIndexer};

/// The queue group of the overlap-query subscription.
const OVERLAP_QUEUE_GROUP: &str = "kv-indexer";
/// Wait between attempts to list and watch etcd after a failure.
const REGISTRY_RETRY: Duration = Duration::from_secs(1);
/// How refused delta publishes are retried in place: 100 ms, doubling up
/// to 0.5 s, for at most 5 minutes (then the service stops, as before, and
/// a standby or a restart takes over). An unanswered try has itself waited
/// [`bus::STREAM_ASK_WAIT`]-long already: a longer pause only delays the
/// first try after a stream leader's election.
const DELTA_RETRY: consumer::RetryPolicy = consumer::RetryPolicy {
    backoff: Duration::from_millis(100),
    max_backoff: Duration::from_millis(500),
    give_up: Duration::from_secs(300),
};

/// Requests to announce the unconfirmed deltas again are served at most
/// this often.
const REANNOUNCE_EVERY: Duration = Duration::from_millis(100);

/// A worker's agent is asked to announce its KV batches again at most this
/// often.
const KV_REANNOUNCE_EVERY: Duration = Duration::from_millis(250);

/// On shutdown, how long in-flight delta publishes may take to complete.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the service stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("recovering the index: {0}")]
    Recovery(#[from] RecoveryError),
    #[error(transparent)]
    Consumer(#[from] ConsumerError),
    #[error(
        "delta {seq} was refused: another indexer is writing the delta stream \
         (or this one fell behind it); stopping"
    )]
    Fenced { seq: u64 },
    #[error(transparent)]
    Pipeline(PipelineError),
    #[error("the KV event consumer failed: {0}")]
    KvConsumer(String),
    #[error("NATS: {0}")]
    Nats(String),
    #[error(
        "the leader election's lease could not be renewed: a standby may lead by now; stopping \
         (restarted, this indexer campaigns again as a standby)"
    )]
    LostLeadership,
    #[error("HTTP on {addr}: {source}")]
    Http {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

impl From<PipelineError> for ServiceError {
    fn from(e: PipelineError) -> Self {
        match e {
            PipelineError::Publish {
                source: BusError::Fenced { seq },
                ..
            } => ServiceError::Fenced { seq },
            other => ServiceError::Pipeline(other),
        }
    }
}

/// Starts the service (a standby until elected) and runs it until
/// `shutdown` completes (then drains the in-flight publishes, resigns and
/// returns).
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), ServiceError> {
    let mut shutdown = std::pin::pin!(shutdown);
    let candidate = Candidate::bind(config).await?;
    let service = tokio::select! {
        service = candidate.lead() => service?,
        () = &mut shutdown => {
            tracing::info!("kv-indexer stopped (a standby)");
            return Ok(());
        }
    };
    service.run(shutdown).await
}

/// The HTTP server, running from [`Candidate::bind`] until the service
/// stops.
struct HttpServer {
    task: AbortOnDrop<std::io::Result<()>>,
    stop: oneshot::Sender<()>,
    addr: SocketAddr,
    status_rx: mpsc::Receiver<StatusRequest>,
    role: watch::Sender<Role>,
}

/// A task that stops with its handle (a standby shut down while
/// campaigning leaves no HTTP server behind).
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An indexer bound and connected, not yet leading: a standby once
/// [`Candidate::lead`] campaigns.
pub struct Candidate {
    config: Config,
    bus: Bus,
    registry: Registry,
    http: HttpServer,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Candidate")
            .field("http_addr", &self.http.addr)
            .finish_non_exhaustive()
    }
}

/// A started service: elected, connected, recovered, serving HTTP.
pub struct Service {
    config: Config,
    bus: Bus,
    registry: Registry,
    indexer: KvIndexer,
    snapshot_seq: u64,
    consumer: async_nats::jetstream::consumer::PullConsumer,
    http: HttpServer,
    metrics: Arc<Metrics>,
    leadership: Leadership,
    /// Answers the standbys' probes while this indexer leads.
    presence: standby::Presence,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("http_addr", &self.http.addr)
            .field("delta_seq", &self.indexer.delta_seq())
            .finish_non_exhaustive()
    }
}

/// Sets the streams' retention. JetStream reserves a capped stream's bytes
/// in its store, and refuses caps it has no room for: then the caps are
/// lowered until they fit, with a warning naming what was set (an indexer
/// that would not start on a small disk helps nobody). Another refusal is
/// logged as an error and the streams keep their limits.
/// How long an elected indexer goes on recovering while JetStream does not
/// answer (a stream leader's election takes 4 to 9 s on nats-server).
const RECOVERY_PATIENCE: Duration = Duration::from_secs(120);

/// Recovers the index from the latest snapshot and the delta log, again
/// (after 0.2 s, doubling to 2 s) while JetStream does not answer, for
/// [`RECOVERY_PATIENCE`]: an indexer elected just after a NATS node's death
/// must not exit because the snapshot store's leader is still being
/// elected. Other failures end the indexer at once.
async fn recover_patiently(
    bus: &Bus,
    config: &Config,
) -> Result<recovery::Recovered, RecoveryError> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(200);
    let mut attempt = 1u32;
    loop {
        let mut index = match config.max_blocks {
            Some(max) => OwnershipIndex::with_max_blocks(max),
            None => OwnershipIndex::new(),
        };
        let cap = config.max_blocks.map_or(usize::MAX, |m| m as usize);
        index.reserve(config.reserve_blocks.min(cap));
        match recovery::recover(bus, index).await {
            Err(error) if error.retryable() && started.elapsed() < RECOVERY_PATIENCE => {
                tracing::warn!(
                    %error,
                    attempt,
                    retry_in_ms = pause.as_millis() as u64,
                    "recovering the index failed (JetStream did not answer); trying again"
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
                attempt += 1;
            }
            result => return result,
        }
    }
}

async fn set_retention(bus: &Bus, retention: &StreamLimits) -> Result<(), ServiceError> {
    match bus.fit_stream_limits(retention).await {
        Ok((set, changed)) => {
            let lowered = set.kv_events_max_bytes != retention.kv_events_max_bytes
                || set.decisions_max_bytes != retention.decisions_max_bytes;
            if lowered {
                tracing::warn!(
                    asked_kv_events_max_bytes = ?retention.kv_events_max_bytes,
                    asked_decisions_max_bytes = ?retention.decisions_max_bytes,
                    kv_events_max_bytes = ?set.kv_events_max_bytes,
                    decisions_max_bytes = ?set.decisions_max_bytes,
                    "JetStream's store has no room for the streams' byte caps: they were \
                     lowered to fit (give nats-server a larger max_file_store, or set \
                     --kv-events-max-bytes and --decisions-max-bytes to these)"
                );
            } else if !changed.is_empty() {
                tracing::info!(streams = ?changed, ?retention, "stream retention set");
            }
        }
        Err(error) => {
            tracing::error!(
                %error,
                ?retention,
                "the streams' retention could not be set; they keep their current limits \
                 (lower --kv-events-max-bytes and --decisions-max-bytes to what JetStream's \
                 store can reserve, 0 for no cap)"
            );
            bus.ensure_streams(&StreamLimits::with_replicas(retention.replicas))
                .await?;
        }
    }
    Ok(())
}

impl Candidate {
    /// Binds the HTTP address and serves it, connects to NATS and etcd.
    pub async fn bind(config: Config) -> Result<Self, ServiceError> {
        let listener = TcpListener::bind(config.http_addr)
            .await
            .map_err(|source| ServiceError::Http {
                addr: config.http_addr,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| ServiceError::Http {
            addr: config.http_addr,
            source,
        })?;
        let metrics = Arc::new(Metrics::new());
        let (status_tx, status_rx) = mpsc::channel::<StatusRequest>(16);
        let (role, role_rx) = watch::channel(Role::Standby);
        let (stop, stopped) = oneshot::channel();
        let task = AbortOnDrop(tokio::spawn(http::serve(
            listener,
            http::router(
                metrics.clone(),
                status_tx,
                config.admin_token.clone(),
                role_rx,
            ),
            stopped,
        )));
        let http = HttpServer {
            task,
            stop,
            addr,
            status_rx,
            role,
        };
        let bus = Bus::connect_with(&config.nats_url, "kv-indexer", &config.nats).await?;
        let registry = Registry::connect_with(&config.etcd_endpoints, &config.etcd).await?;
        Ok(Self {
            config,
            bus,
            registry,
            http,
            metrics,
        })
    }

    /// Where `/metrics`, `/healthz`, `/readyz` and `/status` are served.
    pub fn http_addr(&self) -> SocketAddr {
        self.http.addr
    }

    /// Campaigns until elected (a standby meanwhile), then sets the
    /// streams' limits, recovers the state and opens the KV consumer.
    pub async fn lead(self) -> Result<Service, ServiceError> {
        let Candidate {
            config,
            bus,
            registry,
            mut http,
            metrics,
        } = self;
        metrics.leader.set(0.0);
        let candidate = format!("kv-indexer pid {} http {}", std::process::id(), http.addr);
        let leadership = standby::campaign(
            &registry,
            bus.client(),
            &candidate,
            config.leader_ttl,
            &mut http.status_rx,
        )
        .await?;
        let elected = Instant::now();
        let presence = standby::Presence::start(bus.client(), &candidate)
            .await
            .map_err(ServiceError::Nats)?;
        let _ = http.role.send(Role::Recovering);
        tracing::info!(
            lease = leadership.lease(),
            "elected the indexer's leader; recovering"
        );
        // The KV consumer is set up while the index is recovered: a
        // durable consumer's deletion and creation on a replicated stream
        // take hundreds of milliseconds of a takeover.
        set_retention(&bus, &config.stream_limits()).await?;
        let (recovered, opened) = tokio::join!(
            recover_patiently(&bus, &config),
            consumer::open_patiently(&bus, &config, false)
        );
        let recovered = recovered?;
        let (mut consumer, mut opened) = opened?;
        let indexer = recovered.indexer;
        metrics.recovery_replayed.set(recovered.replayed as f64);
        metrics.snapshot_seq.set(recovered.snapshot_seq as f64);
        let stats = indexer.index().stats();
        tracing::info!(
            snapshot_seq = recovered.snapshot_seq,
            replayed = recovered.replayed,
            delta_seq = indexer.delta_seq(),
            blocks = stats.blocks,
            pairs = stats.pairs,
            workers = indexer.cursors().count(),
            elapsed_ms = elected.elapsed().as_millis() as u64,
            "recovered the index"
        );
        if indexer.delta_seq() == 0 && opened.start != 1 {
            // No delta covers any KV event: all of them again.
            (consumer, opened) = consumer::open_patiently(&bus, &config, true).await?;
        }
        if indexer.delta_seq() > 0 && !opened.existed {
            tracing::warn!(
                consumer = %config.consumer,
                recovered_seq = indexer.delta_seq(),
                "the KV consumer did not exist but deltas do: reading every retained KV event again \
                 (already applied batches are duplicates)"
            );
        }
        let start = opened.start;
        metrics
            .takeover_seconds
            .set(elected.elapsed().as_secs_f64());
        tracing::info!(
            consumer = %config.consumer,
            start_stream_seq = start,
            http = %http.addr,
            takeover_ms = elected.elapsed().as_millis() as u64,
            "KV consumer ready"
        );
        Ok(Service {
            config,
            bus,
            registry,
            snapshot_seq: recovered.snapshot_seq,
            indexer,
            consumer,
            http,
            metrics,
            leadership,
            presence,
        })
    }
}

impl Service {
    /// Binds, connects, waits to be elected, recovers the state and opens
    /// the KV consumer ([`Candidate::bind`], [`Candidate::lead`]).
    pub async fn start(config: Config) -> Result<Self, ServiceError> {
        Candidate::bind(config).await?.lead().await
    }

    /// Where `/metrics`, `/healthz`, `/readyz` and `/status` are served.
    pub fn http_addr(&self) -> SocketAddr {
        self.http.addr
    }

    /// The recovered delta sequence.
    pub fn delta_seq(&self) -> u64 {
        self.indexer.delta_seq()
    }

    /// Runs until `shutdown` completes or an error stops it.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ServiceError> {
        let Service {
            config,
            bus,
            registry,
            indexer,
            snapshot_seq,
            consumer,
            http,
            metrics,
            leadership,
            presence,
        } = self;
        let client = bus.client().clone();
        let HttpServer {
            task: mut http_task,
            stop: http_stop,
            addr: http_addr,
            status_rx,
            role,
        } = http;
        let (registry_tx, registry_rx) = mpsc::channel(256);
        let follower = tokio::spawn(workers::follow(registry, registry_tx, REGISTRY_RETRY));
        let overlap = client
            .queue_subscribe(subjects::INDEX_OVERLAP, OVERLAP_QUEUE_GROUP.into())
            .await
            .map_err(|e| ServiceError::Nats(format!("subscribing to overlap queries: {e}")))?;
        let status_queries = client
            .queue_subscribe(subjects::INDEX_STATUS, OVERLAP_QUEUE_GROUP.into())
            .await
            .map_err(|e| ServiceError::Nats(format!("subscribing to status queries: {e}")))?;
        let reannounce = client
            .subscribe(subjects::INDEX_REANNOUNCE)
            .await
            .map_err(|e| ServiceError::Nats(format!("subscribing to reannounce requests: {e}")))?;
        let queries =
            futures::stream::select(futures::stream::select(overlap, status_queries), reannounce);
        let live_kv = client
            .subscribe(subjects::KV_EVENTS_LIVE_ALL)
            .await
            .map_err(|e| ServiceError::Nats(format!("subscribing to announced KV batches: {e}")))?;
        // The server has the subscriptions before the loop says it runs.
        client
            .flush()
            .await
            .map_err(|e| ServiceError::Nats(format!("flushing the subscriptions: {e}")))?;
        let kv_messages = consumer::messages(&consumer, &config)
            .await?
            .ready_chunks(config.fetch_batch.max(1));

        let now = Instant::now();
        let mut state = Loop {
            pipeline: Pipeline::new(
                &bus,
                config.max_in_flight,
                config.crash_after_delta,
                DELTA_RETRY,
            ),
            confirmed_seq: indexer.delta_seq(),
            snapshots: SnapshotPolicy::new(
                config.snapshot_interval,
                config.snapshot_every_deltas,
                snapshot_seq,
                now,
            ),
            pending_snapshot: None,
            trimmed_to: 0,
            liveness: Liveness::new(config.worker_grace),
            resync: ResyncLimiter::new(config.resync_interval),
            tasks: JoinSet::new(),
            last_kv_stream_seq: 0,
            frozen: guard::Frozen::default(),
            indexer,
            bus,
            client: client.clone(),
            metrics,
            config,
            leadership: Some(leadership),
            _presence: presence,
            role: Role::Leader,
            refused: None,
            reannounced: None,
            kv_reannounce_asked: std::collections::HashMap::new(),
        };
        state.update_gauges();
        state.metrics.leader.set(1.0);
        let _ = role.send(Role::Leader);
        tracing::info!(http = %http_addr, delta_seq = state.indexer.delta_seq(), "kv-indexer running (the leader)");

        let result = state
            .run(
                shutdown,
                kv_messages,
                live_kv,
                queries,
                status_rx,
                registry_rx,
            )
            .await;
        state.metrics.leader.set(0.0);
        let _ = role.send(Role::Standby);

        follower.abort();
        let _ = http_stop.send(());
        match tokio::time::timeout(Duration::from_secs(5), &mut http_task.0).await {
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "HTTP server failed"),
            Err(_) => tracing::warn!("HTTP server did not stop in time"),
            _ => {}
        }
        // A snapshot being stored finishes with its trim (bounded), so the
        // stored snapshot and the trimmed log agree; other tasks stop.
        if state.pending_snapshot_task() {
            let finish = async {
                while let Some(done) = state.tasks.join_next().await {
                    let snapshot = matches!(&done, Ok(TaskDone::Snapshot { .. }));
                    state.on_task(done);
                    if snapshot {
                        break;
                    }
                }
            };
            if tokio::time::timeout(Duration::from_secs(2), finish)
                .await
                .is_err()
            {
                tracing::warn!("the snapshot being stored did not finish in time");
            }
        }
        state.tasks.abort_all();
        // Bounded: with NATS gone, a flush would wait for a reconnection.
        match tokio::time::timeout(Duration::from_secs(2), client.flush()).await {
            Ok(Err(e)) => tracing::warn!(error = %e, "flushing the NATS connection"),
            Err(_) => tracing::warn!("the NATS connection did not flush in time"),
            Ok(Ok(())) => {}
        }
        // A standby takes over at once rather than after the lease's TTL
        // (not when the lease is gone: then another may lead already).
        if !matches!(result, Err(ServiceError::LostLeadership)) {
            let leadership = state.leadership_handoff();
            match tokio::time::timeout(Duration::from_secs(2), leadership.resign()).await {
                Ok(Ok(())) => tracing::info!("resigned the indexer's leadership"),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "resigning the leadership failed; it lapses with its lease")
                }
                Err(_) => {
                    tracing::warn!("resigning the leadership timed out; it lapses with its lease")
                }
            }
        }
        match &result {
            Ok(()) => tracing::info!(delta_seq = state.confirmed_seq, "kv-indexer stopped"),
            Err(e) => tracing::error!(
                error = %e,
                delta_seq = state.confirmed_seq,
                "kv-indexer stopped on an error"
            ),
        }
        result
    }
}

/// KV messages pulled at once (or the consumer's errors), in order.
type KvChunk = Vec<Result<async_nats::jetstream::Message, MessagesError>>;

/// Everything the loop reacts to.
#[derive(Debug)]
enum Event {
    Shutdown,
    /// Messages pulled from the KV consumer (or its errors), in order.
    Kv(KvChunk),
    /// A KV batch announced on core NATS.
    LiveKv(async_nats::Message),
    LiveKvEnded,
    KvEnded,
    /// The oldest in-flight delta publish completed.
    Published(Result<Confirmed, PipelineError>),
    /// A request/reply query: overlap or status.
    Query(async_nats::Message),
    QueriesEnded,
    Status(StatusRequest),
    Registry(RegistryEvent),
    Task(Result<TaskDone, tokio::task::JoinError>),
    Tick,
    /// The election's lease could not be renewed.
    LeadershipLost,
}

/// Background work the loop started.
#[derive(Debug)]
enum TaskDone {
    Snapshot {
        result: Result<Stored, BusError>,
        taken_at: Instant,
        seq: u64,
    },
    Resync {
        worker: WorkerId,
        outcome: ResyncOutcome,
    },
}

/// Where a KV batch came from (for the logs).
#[derive(Debug, Clone, Copy)]
enum Via {
    /// The KV-event stream, at this stream sequence.
    Stream(u64),
    /// Announced on core NATS.
    Live,
}

impl std::fmt::Display for Via {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Via::Stream(seq) => write!(f, "stream seq {seq}"),
            Via::Live => f.write_str("announced"),
        }
    }
}

/// The loop's state; the event sources are the loop's locals.
struct Loop {
    config: Config,
    bus: Bus,
    client: async_nats::Client,
    indexer: KvIndexer,
    metrics: Arc<Metrics>,
    pipeline: Pipeline,
    /// The last delta the stream confirmed.
    confirmed_seq: u64,
    snapshots: SnapshotPolicy,
    /// A snapshot taken, waiting for its deltas to be confirmed.
    pending_snapshot: Option<(protocol::IndexSnapshot, Instant)>,
    trimmed_to: u64,
    liveness: Liveness,
    resync: ResyncLimiter,
    tasks: JoinSet<TaskDone>,
    last_kv_stream_seq: u64,
    /// Workers dropping stale batches (`/status`, a gauge).
    frozen: guard::Frozen,
    /// This indexer's hold on the leader election (taken by
    /// [`Loop::leadership_handoff`] to resign).
    leadership: Option<Leadership>,
    /// Answers the standbys' probes until the loop is dropped.
    _presence: standby::Presence,
    role: Role,
    /// Since when JetStream refuses the deltas, and how many times in a
    /// row (the pipeline sends them again meanwhile).
    refused: Option<(Instant, u32)>,
    /// When the unconfirmed deltas were last announced again on request.
    reannounced: Option<Instant>,
    /// When each worker's agent was last asked to announce its batches
    /// again.
    kv_reannounce_asked: std::collections::HashMap<WorkerId, Option<Instant>>,
}

impl Loop {
    async fn run<K, Q>(
        &mut self,
        shutdown: impl Future<Output = ()>,
        mut kv_messages: K,
        mut live_kv: async_nats::Subscriber,
        mut queries: Q,
        mut status_rx: mpsc::Receiver<StatusRequest>,
        mut registry_rx: mpsc::Receiver<RegistryEvent>,
    ) -> Result<(), ServiceError>
    where
        K: futures::Stream<Item = KvChunk> + Unpin,
        Q: futures::Stream<Item = async_nats::Message> + Unpin,
    {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut tick = tokio::time::interval(self.tick_period());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let max_in_flight = self.config.max_in_flight.max(1);
        loop {
            let event = tokio::select! {
                biased;
                () = &mut shutdown => Event::Shutdown,
                message = queries.next() => match message {
                    Some(message) => Event::Query(message),
                    None => Event::QueriesEnded,
                },
                Some(request) = status_rx.recv() => Event::Status(request),
                Some(done) = self.pipeline.next() => Event::Published(done),
                Some(done) = self.tasks.join_next() => Event::Task(done),
                Some(change) = registry_rx.recv() => Event::Registry(change),
                _ = tick.tick() => Event::Tick,
                () = lost(&mut self.leadership) => Event::LeadershipLost,
                chunk = kv_messages.next(), if self.pipeline.len() < max_in_flight => match chunk {
                    Some(chunk) => Event::Kv(chunk),
                    None => Event::KvEnded,
                },
                message = live_kv.next(), if self.pipeline.len() < max_in_flight => match message {
                    Some(message) => Event::LiveKv(message),
                    None => Event::LiveKvEnded,
                },
            };
            match event {
                Event::Shutdown => break,
                Event::Kv(chunk) => self.on_kv(chunk).await?,
                Event::LiveKv(message) => self.on_live_kv(message).await?,
                Event::LiveKvEnded => {
                    return Err(ServiceError::Nats(
                        "the announced KV batches' subscription ended".into(),
                    ))
                }
                Event::KvEnded => {
                    return Err(ServiceError::KvConsumer("the message stream ended".into()))
                }
                Event::Published(done) => {
                    self.on_published(done).await?;
                    while let Some(done) = self.pipeline.try_next() {
                        self.on_published(done).await?;
                    }
                    self.store_pending_snapshot();
                }
                Event::Query(message) => self.on_query(message).await,
                Event::QueriesEnded => {
                    return Err(ServiceError::Nats("the query subscriptions ended".into()))
                }
                Event::Status(reply) => {
                    let _ = reply.send(self.status());
                }
                Event::Registry(change) => self.on_registry(change).await?,
                Event::Task(done) => self.on_task(done),
                Event::Tick => self.on_tick().await?,
                Event::LeadershipLost => return Err(ServiceError::LostLeadership),
            }
        }
        self.drain().await
    }

    /// Whether a snapshot is being stored.
    fn pending_snapshot_task(&self) -> bool {
        self.snapshots.storing()
    }

    /// The leadership, to resign it once the loop is done.
    fn leadership_handoff(&mut self) -> Leadership {
        self.leadership
            .take()
            .expect("the leadership is taken once, when the service stops")
    }

    fn tick_period(&self) -> Duration {
        let c = &self.config;
        (c.snapshot_interval / 2)
            .min(c.worker_grace / 2)
            .min(Duration::from_secs(1))
            .max(Duration::from_millis(20))
    }

    /// Lets the in-flight publishes complete (and their messages be acked).
    async fn drain(&mut self) -> Result<(), ServiceError> {
        let in_flight = self.pipeline.len();
        let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
            while let Some(done) = self.pipeline.next().await {
                self.on_published(done).await?;
            }
            Ok::<(), ServiceError>(())
        })
        .await;
        match drained {
            Ok(result) => result,
            Err(_) => {
                tracing::warn!(
                    in_flight,
                    left = self.pipeline.len(),
                    "in-flight delta publishes did not complete in time; their KV messages will be redelivered"
                );
                Ok(())
            }
        }
    }

    async fn on_kv(&mut self, chunk: KvChunk) -> Result<(), ServiceError> {
        let now = Instant::now();
        for message in chunk {
            let message = match message {
                Ok(message) => message,
                Err(e) => match e.kind() {
                    MessagesErrorKind::MissingHeartbeat
                    | MessagesErrorKind::Pull
                    | MessagesErrorKind::NoResponders
                    | MessagesErrorKind::Other => {
                        tracing::warn!(error = %e, "KV consumer hiccup; continuing");
                        continue;
                    }
                    _ => return Err(ServiceError::KvConsumer(e.to_string())),
                },
            };
            let (stream_seq, pending) = message
                .info()
                .map(|i| (i.stream_sequence, i.pending))
                .unwrap_or((0, 0));
            self.last_kv_stream_seq = stream_seq;
            self.metrics.consumer_pending.set(pending as f64);
            let (message, acker) = message.split();
            let via = Via::Stream(stream_seq);
            let Some(batch) = self.decoded(&message, via) else {
                self.push(None, Some((acker, AckKind::Term))).await?;
                continue;
            };
            let (worker, epoch, seq) = (batch.worker.clone(), batch.epoch, batch.seq);
            let limit = guard::epoch_limit(wall_clock_ms(), self.config.max_epoch_ahead);
            if epoch > limit {
                self.metrics.rejected_future_epoch.increment(1);
                tracing::warn!(
                    %worker,
                    epoch,
                    limit,
                    seq,
                    stream_seq,
                    "batch rejected: its epoch is further in the future than --max-epoch-ahead"
                );
                self.push(None, Some((acker, AckKind::Term))).await?;
                continue;
            }
            if let Some(held) = self.indexer.cursor_epoch(&worker).filter(|e| *e > limit) {
                // Accepted before this check (or restored from such a
                // snapshot): it would make every real batch stale.
                self.metrics.epochs_reset.increment(1);
                tracing::warn!(%worker, held, limit, "the index holds an epoch of this worker beyond --max-epoch-ahead; resetting the worker");
                self.remove_worker(&worker, "its epoch is beyond --max-epoch-ahead")
                    .await?;
            }
            let delta = self.apply(batch, via, now);
            self.push(delta, Some((acker, AckKind::Ack))).await?;
        }
        self.update_gauges();
        self.maybe_snapshot(now);
        Ok(())
    }

    /// A KV batch announced on core NATS: applied ahead of the stream when
    /// it is next in its worker's order (its stream copy is then a
    /// duplicate), else left to the stream, which has every batch in
    /// order. Nothing to ack.
    async fn on_live_kv(&mut self, message: async_nats::Message) -> Result<(), ServiceError> {
        let Some(batch) = self.decoded(&message, Via::Live) else {
            return Ok(());
        };
        let next = self.indexer.next_seq(&batch.worker, batch.epoch);
        if next != Some(batch.seq) {
            self.metrics.live_left_to_stream.increment(1);
            if let Some(next) = next.filter(|n| batch.seq > *n) {
                self.ask_kv_reannounce(&batch, next - 1).await;
            }
            return Ok(());
        }
        self.metrics.live_applied.increment(1);
        let now = Instant::now();
        let delta = self.apply(batch, Via::Live, now);
        self.push(delta, None).await?;
        self.update_gauges();
        self.maybe_snapshot(now);
        Ok(())
    }

    /// Announcements of `batch`'s worker were missed (this indexer's
    /// connection moved, most often): its agent is asked to announce its
    /// batches after `last_seq`, the index's position in the batch's epoch,
    /// again (at most every [`KV_REANNOUNCE_EVERY`] per worker), rather
    /// than the index waiting for a stream that may be electing its leader.
    async fn ask_kv_reannounce(&mut self, batch: &KvEventBatch, last_seq: u64) {
        let epoch = batch.epoch;
        let asked = self
            .kv_reannounce_asked
            .entry(batch.worker.clone())
            .or_default();
        if !at_most_every(asked, KV_REANNOUNCE_EVERY) {
            return;
        }
        self.metrics.kv_reannounce_requests.increment(1);
        tracing::info!(worker = %batch.worker, epoch, last_seq, got = batch.seq, "announced KV batches were missed; asking the agent to announce those after the index's position again");
        let body = subjects::kv_reannounce_body(epoch, last_seq);
        if let Err(e) = self
            .client
            .publish(subjects::kv_reannounce(&batch.worker), body.into())
            .await
        {
            tracing::warn!(error = %e, "asking the agent to announce again failed");
        }
    }

    /// The batch in `message`, or `None` (counted, logged) when it is
    /// malformed or came on another worker's subject.
    fn decoded(&self, message: &async_nats::Message, via: Via) -> Option<KvEventBatch> {
        let decoded = match via {
            Via::Stream(_) => consumer::decode(message),
            Via::Live => consumer::decode_live(message),
        };
        match decoded {
            Ok(batch) => Some(batch),
            Err(consumer::Malformed::WrongSubject { worker, .. }) => {
                // Counted as malformed too (it is not a batch of the
                // worker whose subject it came on).
                self.metrics.malformed_messages.increment(1);
                self.metrics.rejected_wrong_subject.increment(1);
                tracing::warn!(
                    %worker,
                    %via,
                    subject = %message.subject,
                    "batch rejected: its worker is not its subject's"
                );
                None
            }
            Err(e) => {
                self.metrics.malformed_messages.increment(1);
                tracing::warn!(
                    %via,
                    subject = %message.subject,
                    bytes = message.payload.len(),
                    error = %e,
                    "malformed KV message; skipped"
                );
                None
            }
        }
    }

    /// Applies a checked batch to the index: counted, logged, a resync
    /// asked for after a gap. Returns its delta.
    fn apply(&mut self, batch: KvEventBatch, via: Via, now: Instant) -> Option<IndexDelta> {
        let (worker, epoch, seq) = (batch.worker.clone(), batch.epoch, batch.seq);
        let block_events = batch.block_events() as u64;
        let outcome = self.indexer.apply(batch);
        self.metrics.batches(&outcome.status).increment(1);
        match &outcome.status {
            BatchStatus::Applied => self.metrics.block_events.increment(block_events),
            BatchStatus::NewEpoch { previous } => {
                self.metrics.block_events.increment(block_events);
                tracing::info!(%worker, epoch, ?previous, %via, delta_seq = ?outcome.delta.as_ref().map(|d| d.seq), "worker started a new epoch");
            }
            BatchStatus::Duplicate { last_seq } => {
                tracing::debug!(%worker, epoch, seq, last_seq, %via, "duplicate batch dropped");
            }
            BatchStatus::Gap { expected, got } => {
                tracing::warn!(%worker, epoch, expected, got, %via, "gap in the worker's batches");
                self.request_resync(&worker, now);
            }
            BatchStatus::AwaitingResync => {
                tracing::debug!(%worker, epoch, seq, %via, "batch dropped: awaiting the worker's resync");
                self.request_resync(&worker, now);
            }
            BatchStatus::StaleEpoch { current } => {
                self.frozen.stale(&worker, epoch, *current);
                tracing::warn!(%worker, epoch, seq, current, %via, "batch of a stale epoch dropped");
            }
        }
        if matches!(
            outcome.status,
            BatchStatus::Applied | BatchStatus::NewEpoch { .. } | BatchStatus::Gap { .. }
        ) {
            self.frozen.thawed(&worker);
        }
        outcome.delta
    }

    /// Sends the delta (if any) and queues the ack of its KV message (if
    /// any) after its confirmation.
    async fn push(
        &mut self,
        delta: Option<IndexDelta>,
        ack: Option<(async_nats::jetstream::message::Acker, AckKind)>,
    ) -> Result<(), ServiceError> {
        if let Some(delta) = &delta {
            self.metrics.delta_seq.set(delta.seq as f64);
        }
        match self.pipeline.push(delta, ack).await {
            Ok(Some(oldest)) => self.on_published(oldest).await,
            Ok(None) => Ok(()),
            Err(e) => self.on_published(Err(e)).await,
        }
    }

    async fn on_published(
        &mut self,
        done: Result<Confirmed, PipelineError>,
    ) -> Result<(), ServiceError> {
        match done {
            Ok(Confirmed { seq: Some(seq) }) => {
                self.confirmed(seq);
                self.metrics.deltas_published.increment(1);
                self.taken_again();
                Ok(())
            }
            Ok(Confirmed { seq: None }) => Ok(()),
            Err(e) if e.retryable() => {
                self.refused(&e);
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    fn confirmed(&mut self, seq: u64) {
        self.confirmed_seq = self.confirmed_seq.max(seq);
        self.metrics
            .delta_seq_published
            .set(self.confirmed_seq as f64);
    }

    /// JetStream refused a delta or did not confirm it (a full store, no
    /// stream leader during an election): the pipeline sends the deltas it
    /// does not hold again, in place, after a bounded backoff
    /// ([`DELTA_RETRY`]), while the loop goes on applying KV events and
    /// announcing their deltas; not ready meanwhile.
    fn refused(&mut self, error: &PipelineError) {
        self.pipeline.refuse();
        self.metrics.delta_publish_retries.increment(1);
        self.metrics.set_refused(Some(error.to_string()));
        let (since, times) = self.refused.get_or_insert((Instant::now(), 0));
        *times += 1;
        if *times == 1 {
            tracing::warn!(
                error = %error,
                store_full = matches!(error, PipelineError::Publish { source, .. } if source.is_store_full()),
                "JetStream refused a delta; sending the unconfirmed deltas again in place (KV events are still applied, their deltas announced)"
            );
        } else if times.is_power_of_two() {
            tracing::warn!(
                error = %error,
                retries = *times,
                refused_ms = since.elapsed().as_millis() as u64,
                "JetStream still refuses the deltas; retrying"
            );
        }
    }

    /// A try at sending refused deltas went through: ready again.
    fn taken_again(&mut self) {
        if self.pipeline.is_refused() {
            return;
        }
        if let Some((since, times)) = self.refused.take() {
            self.metrics.set_refused(None);
            tracing::info!(
                delta_seq = self.confirmed_seq,
                refusals = times,
                took_ms = since.elapsed().as_millis() as u64,
                "the delta stream takes deltas again"
            );
        }
    }

    /// A router missed announcements: the deltas the stream has not
    /// confirmed are announced again (at most every [`REANNOUNCE_EVERY`]:
    /// every router that missed them asks).
    async fn reannounce(&mut self) {
        if !at_most_every(&mut self.reannounced, REANNOUNCE_EVERY) {
            return;
        }
        let announced = self.pipeline.announce_unconfirmed().await;
        self.metrics.reannounced.increment(announced as u64);
    }

    /// A worker removed from the index registered again (its lease had
    /// lapsed, its agent lived on): its blocks are asked for again.
    fn resync_returned(&mut self, worker: &WorkerId) {
        tracing::info!(%worker, "a worker removed from the index registered again; asking for its blocks");
        self.metrics.workers_returned.increment(1);
        self.request_resync(worker, Instant::now());
    }

    fn request_resync(&mut self, worker: &WorkerId, now: Instant) {
        if !self.resync.allow(worker, now) {
            self.metrics.resync_rate_limited.increment(1);
            return;
        }
        self.metrics.resync_requests.increment(1);
        tracing::info!(%worker, "asking the worker to resync");
        let client = self.client.clone();
        let worker = worker.clone();
        let timeout = self.config.resync_timeout;
        self.tasks.spawn(async move {
            let outcome = resync::request(client, &worker, timeout).await;
            TaskDone::Resync { worker, outcome }
        });
    }

    async fn on_query(&mut self, message: async_nats::Message) {
        if message.subject.as_str() == subjects::INDEX_REANNOUNCE {
            self.reannounce().await;
            return;
        }
        let Some(reply) = message.reply.clone() else {
            self.metrics.overlap_malformed.increment(1);
            tracing::warn!(subject = %message.subject, "query without a reply subject; dropped");
            return;
        };
        if message.subject.as_str() == subjects::INDEX_STATUS {
            let index = self.indexer.index();
            let status = protocol::IndexStatus {
                delta_seq: self.indexer.delta_seq(),
                digest: index.digest(),
                blocks: index.stats().blocks,
                pairs: index.stats().pairs,
            };
            if let Err(e) = self.client.publish(reply, status.encode().into()).await {
                tracing::warn!(error = %e, "replying to a status query");
            }
            return;
        }
        let sent = match overlap::answer(&self.indexer, &message.payload) {
            Ok(answer) => {
                self.metrics.overlap_ok.increment(1);
                self.client.publish(reply, answer.encode().into()).await
            }
            Err(e) => {
                self.metrics.overlap_malformed.increment(1);
                tracing::warn!(error = %e, bytes = message.payload.len(), "malformed overlap query");
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(overlap::ERROR_HEADER, overlap::header_text(&e).as_str());
                self.client
                    .publish_with_headers(reply, headers, bytes::Bytes::new())
                    .await
            }
        };
        if let Err(e) = sent {
            tracing::warn!(error = %e, "replying to an overlap query");
        }
    }

    async fn on_registry(&mut self, event: RegistryEvent) -> Result<(), ServiceError> {
        match event {
            RegistryEvent::Listed(changes) => {
                let mut workers = Vec::new();
                for change in &changes {
                    if let WorkerChange::Malformed { key, error } = change {
                        self.metrics.registry_malformed.increment(1);
                        tracing::warn!(key, error, "malformed worker record in etcd");
                    }
                    match workers::worker_of(change) {
                        Some(worker) => workers.push(worker),
                        None => tracing::warn!(?change, "etcd key names no worker"),
                    }
                }
                tracing::info!(registered = workers.len(), "listed the registered workers");
                for worker in self.liveness.listed(workers) {
                    self.resync_returned(&worker);
                }
            }
            RegistryEvent::Changed(change) => match change {
                WorkerChange::Up(record) => {
                    tracing::info!(worker = %record.id, role = %record.role, "worker registered");
                    let worker = record.id;
                    if self.liveness.up(worker.clone()) {
                        self.resync_returned(&worker);
                    }
                }
                WorkerChange::Down(worker) => {
                    self.liveness.down(&worker);
                    if self
                        .remove_worker(&worker, "lease expired or deregistered")
                        .await?
                    {
                        self.metrics.workers_removed_lease.increment(1);
                    }
                }
                WorkerChange::Malformed { ref key, ref error } => {
                    self.metrics.registry_malformed.increment(1);
                    tracing::warn!(key, error, "malformed worker record in etcd; skipped");
                    if let Some(worker) = workers::worker_of(&change) {
                        if self.liveness.up(worker.clone()) {
                            self.resync_returned(&worker);
                        }
                    }
                }
            },
            RegistryEvent::Lost(error) => {
                self.metrics.registry_errors.increment(1);
                tracing::warn!(error, "lost the etcd worker watch; listing again shortly");
                self.liveness.lost();
            }
        }
        Ok(())
    }

    /// Removes the worker from the index (a delta); whether it was there.
    async fn remove_worker(
        &mut self,
        worker: &WorkerId,
        reason: &str,
    ) -> Result<bool, ServiceError> {
        self.resync.forget(worker);
        self.kv_reannounce_asked.remove(worker);
        self.frozen.thawed(worker);
        let Some(delta) = self.indexer.remove_worker(worker) else {
            tracing::debug!(%worker, reason, "worker left; the index did not hold it");
            return Ok(false);
        };
        tracing::info!(%worker, delta_seq = delta.seq, reason, "worker removed from the index");
        self.liveness.removed(worker.clone(), Instant::now());
        self.push(Some(delta), None).await?;
        self.update_gauges();
        Ok(true)
    }

    fn on_task(&mut self, done: Result<TaskDone, tokio::task::JoinError>) {
        let done = match done {
            Ok(done) => done,
            Err(e) if e.is_cancelled() => return,
            Err(e) => {
                tracing::error!(error = %e, "a background task panicked");
                return;
            }
        };
        match done {
            TaskDone::Snapshot {
                result,
                taken_at,
                seq,
            } => match result {
                Ok(stored) => {
                    self.snapshots.stored(stored.seq, taken_at);
                    let elapsed = taken_at.elapsed();
                    self.metrics.snapshots_ok.increment(1);
                    self.metrics.snapshot_seconds.record(elapsed.as_secs_f64());
                    self.metrics.snapshot_seq.set(stored.seq as f64);
                    if let Some(bytes) = stored.bytes {
                        self.metrics.snapshot_bytes.set(bytes as f64);
                    }
                    self.metrics.deltas_trimmed.increment(stored.purged);
                    self.trimmed_to = stored.trimmed_to;
                    tracing::info!(
                        delta_seq = stored.seq,
                        bytes = ?stored.bytes,
                        elapsed_ms = elapsed.as_millis() as u64,
                        trimmed_to = stored.trimmed_to,
                        purged = stored.purged,
                        "snapshot stored"
                    );
                }
                Err(e) => {
                    self.snapshots.failed(Instant::now());
                    self.metrics.snapshots_failed.increment(1);
                    tracing::error!(delta_seq = seq, error = %e, "storing a snapshot failed; retrying later");
                }
            },
            TaskDone::Resync { worker, outcome } => match outcome {
                ResyncOutcome::Replied(reply) => {
                    self.metrics.resync_ok.increment(1);
                    tracing::info!(%worker, epoch = reply.epoch, blocks = reply.blocks, "worker resynced");
                }
                ResyncOutcome::Failed(error) => {
                    self.metrics.resync_failed.increment(1);
                    tracing::warn!(%worker, error, "resync request failed");
                }
                ResyncOutcome::TimedOut => {
                    self.metrics.resync_timeout.increment(1);
                    tracing::warn!(%worker, timeout = ?self.config.resync_timeout, "resync request timed out");
                }
            },
        }
    }

    async fn on_tick(&mut self) -> Result<(), ServiceError> {
        let now = Instant::now();
        self.maybe_snapshot(now);
        // Workers the index knows but etcd does not list, past the grace.
        let known: HashSet<WorkerId> = self
            .indexer
            .cursors()
            .map(|c| c.worker)
            .chain(self.indexer.index().workers().map(|(w, _)| w.clone()))
            .collect();
        for worker in self.liveness.sweep(&known, now) {
            if self
                .remove_worker(&worker, "not registered in etcd")
                .await?
            {
                self.metrics.workers_removed_unregistered.increment(1);
            }
        }
        Ok(())
    }

    fn maybe_snapshot(&mut self, now: Instant) {
        if !self.snapshots.due(self.indexer.delta_seq(), now) {
            return;
        }
        self.snapshots.started();
        let snapshot = self.indexer.snapshot();
        tracing::debug!(
            delta_seq = snapshot.delta_seq,
            copy_ms = now.elapsed().as_millis() as u64,
            "snapshot taken"
        );
        self.pending_snapshot = Some((snapshot, now));
        self.store_pending_snapshot();
    }

    /// Stores the pending snapshot once the stream holds every delta it
    /// covers.
    fn store_pending_snapshot(&mut self) {
        let ready =
            matches!(&self.pending_snapshot, Some((s, _)) if s.delta_seq <= self.confirmed_seq);
        if !ready {
            return;
        }
        let Some((snapshot, taken_at)) = self.pending_snapshot.take() else {
            return;
        };
        let bus = self.bus.clone();
        let (margin, trimmed_to, seq) = (
            self.config.delta_margin,
            self.trimmed_to,
            snapshot.delta_seq,
        );
        self.tasks.spawn(async move {
            let result = snapshots::store(bus, snapshot, margin, trimmed_to).await;
            TaskDone::Snapshot {
                result,
                taken_at,
                seq,
            }
        });
    }

    fn update_gauges(&self) {
        let index = self.indexer.index();
        self.metrics
            .set_index(index.stats(), index.workers().count());
        self.metrics.delta_seq.set(self.indexer.delta_seq() as f64);
        self.metrics.frozen_workers.set(self.frozen.len() as f64);
    }

    fn status(&self) -> serde_json::Value {
        let index = self.indexer.index();
        let stats = index.stats();
        let workers: serde_json::Map<String, serde_json::Value> = index
            .workers()
            .map(|(w, blocks)| (w.to_string(), blocks.into()))
            .collect();
        serde_json::json!({
            "role": self.role.as_str(),
            "delta_seq": self.indexer.delta_seq(),
            "delta_seq_published": self.confirmed_seq,
            "snapshot_seq": self.snapshots.covered(),
            "kv_stream_seq": self.last_kv_stream_seq,
            "in_flight": self.pipeline.len(),
            "deltas_refused": self.pipeline.is_refused(),
            "blocks": stats.blocks,
            "pairs": stats.pairs,
            "runs": stats.runs,
            "evicted_blocks": stats.evicted_blocks,
            "workers": workers.len(),
            "worker_blocks": workers,
            "cursors": self.indexer.cursors().count(),
            "worker_cursors": worker_cursors(&self.indexer),
            "frozen_workers": self.frozen.to_json(),
            "digest": format!("{:016x}", index.digest()),
        })
    }
}

/// Whether something done at most every `period` may be done now (then
/// `last` becomes now).
fn at_most_every(last: &mut Option<Instant>, period: Duration) -> bool {
    let now = Instant::now();
    if last.is_some_and(|at| now - at < period) {
        return false;
    }
    *last = Some(now);
    true
}

/// Every worker's position in its batches: `{"worker": {"epoch", "last_seq",
/// "resync_pending"}}` (compare with its agent's `worker_agent_kv_epoch`
/// and `worker_agent_kv_batch_seq`).
fn worker_cursors(indexer: &KvIndexer) -> serde_json::Map<String, serde_json::Value> {
    indexer
        .cursors()
        .map(|c| {
            (
                c.worker.to_string(),
                serde_json::json!({
                    "epoch": c.epoch,
                    "last_seq": c.last_seq,
                    "resync_pending": c.resync_pending,
                }),
            )
        })
        .collect()
}

/// Resolves when the leadership is presumed lost (never without one).
async fn lost(leadership: &mut Option<Leadership>) {
    match leadership {
        Some(leadership) => leadership.lost().await,
        None => std::future::pending().await,
    }
}

/// Milliseconds since the Unix epoch: the agents' epochs are numbered by
/// it, so it bounds how far ahead an epoch may be.
fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
