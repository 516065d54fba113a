//! The agent's service: a thin shell that connects the engine to NATS and
//! etcd. One loop owns the state; everything that happens to it is one
//! `Event`, awaited in one `select!` (`Agent::next_event`).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::connection::State;
use async_nats::{Client, Message as NatsMessage, Subject, Subscriber};
use bus::{Bus, BusError, Registry, StreamLimits};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::StreamExt;
use metrics::{counter, gauge};
use protocol::{
    subjects, CancelRequest, DecisionId, GenerateChunk, GenerateEvent, GenerateRequest, KvEvent,
    LoadReport, Message, ResyncReply, Role, Stage, WorkerId, WorkerRecord, WorkerSubjects,
};
use tokio::task::{AbortHandle, JoinError, JoinSet};
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tracing::{debug, error, info, warn, Instrument};

use crate::config::{Config, Settings};
use crate::engine::{Engine, EngineLoad, KvUpdate};
use crate::error::AgentError;
use crate::metrics as m;
use crate::publisher::{KvOutbox, Pushed};
use crate::sim_engine::{SimEngine, SimEngineConfig};
use crate::vllm::{VllmEngine, VllmError};

/// How long in-flight streams get to send their last chunk at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// A core NATS publish from the loop waits at most this long.
const LOAD_PUBLISH_TIMEOUT: Duration = Duration::from_millis(50);
/// Backoff of KV batch retries: doubles from the first to the last.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// Runs the agent with the built-in simulated engine until `shutdown`
/// completes, then revokes the registration and stops.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AgentError> {
    let settings = config.validate()?;
    let engine: Arc<dyn Engine> = match settings.real_engine.clone() {
        None => Arc::new(SimEngine::start(SimEngineConfig {
            worker: settings.worker.clone(),
            role: settings.role,
            preset: settings.preset,
            block_size: settings.contract.block_size,
            kv_capacity_blocks: settings.kv_capacity_blocks,
            speedup: settings.speedup,
            link: settings.link,
        })?),
        Some(real) => {
            if config.http_addr.is_some() {
                // Installed before the engine's first events are counted.
                let _ = crate::metrics::prometheus();
            }
            let span = tracing::info_span!("worker_agent", worker = %settings.worker);
            let connect = VllmEngine::connect(real).instrument(span);
            // The engine may take long to come up (its own timeout); an
            // early shutdown stops the wait.
            let mut shutdown = std::pin::pin!(shutdown);
            let engine = tokio::select! {
                engine = connect => match engine {
                    Ok(engine) => engine,
                    Err(VllmError::Contract { configured, source }) => {
                        counter!(m::CONTRACT_REFUSALS, "reason" => source.label()).increment(1);
                        error!(
                            worker = %settings.worker,
                            error = %source,
                            "REFUSING the engine: it names blocks differently from the deployment"
                        );
                        return Err(AgentError::Contract { configured, source });
                    }
                    Err(e) => return Err(e.into()),
                },
                () = shutdown.as_mut() => return Ok(()),
            };
            return run_with_engine(config, Arc::new(engine), shutdown).await;
        }
    };
    run_with_engine(config, engine, shutdown).await
}

/// Runs the agent in front of `engine` until `shutdown` completes.
pub async fn run_with_engine(
    config: Config,
    engine: Arc<dyn Engine>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AgentError> {
    let settings = config.validate()?;
    let facts = engine.facts();
    if let Err(source) = settings.contract.check(&facts.contract) {
        counter!(m::CONTRACT_REFUSALS, "reason" => source.label()).increment(1);
        error!(
            worker = %settings.worker,
            error = %source,
            "REFUSING the engine: it names blocks differently from the deployment"
        );
        return Err(AgentError::Contract {
            configured: settings.contract.clone(),
            source,
        });
    }
    let kv_updates = engine.take_kv_updates().ok_or(AgentError::KvStreamTaken)?;
    let span = tracing::info_span!("worker_agent", worker = %settings.worker);
    serve_worker(config, settings, engine, kv_updates, shutdown)
        .instrument(span)
        .await
}

/// Connects, registers, serves until `shutdown`, then stops.
async fn serve_worker(
    config: Config,
    settings: Settings,
    engine: Arc<dyn Engine>,
    kv_updates: BoxStream<'static, KvUpdate>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AgentError> {
    let facts = engine.facts();
    let worker = settings.worker.clone();
    let bus = Bus::connect(&config.nats_url, &format!("worker-agent {worker}")).await?;
    bus.ensure_streams(&StreamLimits::default()).await?;
    let client = bus.client().clone();
    let generate = subscribe(&client, subjects::generate(&worker)).await?;
    let resync = subscribe(&client, subjects::resync(&worker)).await?;
    let cancel = subscribe(&client, subjects::cancel(&worker)).await?;

    let (http_stop, http_task) = match config.http_addr {
        Some(addr) => {
            // Installed before anything is counted.
            let metrics = crate::metrics::prometheus();
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| AgentError::Http { addr, source })?;
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(crate::http::serve(
                listener,
                metrics,
                client.clone(),
                async {
                    let _ = stopped.await;
                },
            ));
            info!(%addr, "serving /metrics and /healthz");
            (Some(stop), Some(task))
        }
        None => (None, None),
    };

    let record = WorkerRecord {
        id: worker.clone(),
        role: settings.role,
        contract: settings.contract.clone(),
        kv_capacity_blocks: facts.kv_capacity_blocks,
        max_batched_tokens: facts.max_batched_tokens,
        kv_bytes_per_token: facts.kv_bytes_per_token,
        gpus: facts.gpus,
        subjects: WorkerSubjects::for_worker(&worker),
    };
    let registry = Registry::connect(&config.etcd_endpoints).await?;
    let registration = registry.register(&record, settings.lease_ttl).await?;

    let subscriptions = Subscriptions {
        generate,
        resync,
        cancel,
    };
    let mut agent = Agent::new(&settings, engine.clone(), bus, kv_updates, subscriptions);
    info!(
        role = %settings.role,
        epoch = agent.outbox.epoch(),
        lease = registration.lease(),
        model = %settings.contract.model,
        "worker registered; serving"
    );
    let result = agent.serve(shutdown).await;

    // Stop: leave the registry first (no new requests are routed here),
    // then end what is in flight; each open stream gets its last chunk.
    let revoked = registration.revoke().await;
    drop(agent.generate);
    drop(agent.resync);
    engine.stop();
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while agent.tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!("in-flight streams did not end in time");
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), client.flush()).await;
    if let Some(stop) = http_stop {
        let _ = stop.send(());
    }
    if let Some(task) = http_task {
        let _ = tokio::time::timeout(Duration::from_secs(1), task).await;
    }
    info!(unpublished_events = agent.outbox.held_events(), "stopped");
    result?;
    revoked?;
    Ok(())
}

async fn subscribe(client: &Client, subject: String) -> Result<Subscriber, AgentError> {
    client
        .subscribe(subject.clone())
        .await
        .map_err(|e| AgentError::Subscribe {
            subject,
            message: e.to_string(),
        })
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Everything that happens to the agent.
#[derive(Debug)]
enum Event {
    Shutdown,
    /// From the engine's KV stream; `None` when it ended.
    Kv(Option<KvUpdate>),
    /// A KV batch publish finished.
    Published(PublishDone),
    /// A message on the generate subject; `None` when the subscription ended.
    Generate(Option<NatsMessage>),
    /// A message on the resync subject; `None` when the subscription ended.
    Resync(Option<NatsMessage>),
    /// A message on the cancel subject; `None` when the subscription ended.
    Cancel(Option<NatsMessage>),
    /// Time to check the load.
    LoadTick,
    /// A stream forwarder or a reply task ended.
    TaskEnded(Result<(), JoinError>),
}

#[derive(Debug)]
struct PublishDone {
    epoch: u64,
    seq: u64,
    result: Result<bool, BusError>,
}

/// Why a new epoch was started from the full block set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResyncReason {
    /// Someone asked on the resync subject.
    Request,
    /// The KV queue overflowed while NATS did not acknowledge.
    Overflow,
}

impl ResyncReason {
    fn as_str(self) -> &'static str {
        match self {
            ResyncReason::Request => "request",
            ResyncReason::Overflow => "overflow",
        }
    }
}

/// The resync replies owed for a new epoch, sent when its first batch
/// (the full block set) is acknowledged.
#[derive(Debug)]
struct OwedReplies {
    epoch: u64,
    blocks: u64,
    to: Vec<Subject>,
}

/// The agent's state, owned by its loop.
struct Agent {
    worker: WorkerId,
    role: Role,
    engine: Arc<dyn Engine>,
    bus: Bus,
    client: Client,
    kv_updates: BoxStream<'static, KvUpdate>,
    generate: Subscriber,
    resync: Subscriber,
    cancel: Subscriber,
    /// The generation streams being forwarded, by decision: a cancel
    /// aborts the forwarder, which drops the engine's stream.
    streams: HashMap<DecisionId, AbortHandle>,
    outbox: KvOutbox,
    /// The KV batch publish in flight.
    publishing: Option<BoxFuture<'static, PublishDone>>,
    /// Consecutive failed publishes of the current batch.
    failures: u32,
    /// A block set was asked of the engine for this reason.
    resync_requested: Option<ResyncReason>,
    /// Who asked for a resync whose block set has not come yet.
    resync_waiting: Vec<Subject>,
    owed_replies: Option<OwedReplies>,
    max_queued_events: usize,
    /// The queue passed half of its bound (said once).
    queue_filling: bool,
    load_tick: Interval,
    load_interval: Duration,
    load_poll: Duration,
    /// The last load checked for publishing, and when.
    last_load: Option<(EngineLoad, Instant)>,
    /// Stream forwarders and reply senders.
    tasks: JoinSet<()>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("worker", &self.worker)
            .field("epoch", &self.outbox.epoch())
            .finish_non_exhaustive()
    }
}

impl Agent {
    fn new(
        settings: &Settings,
        engine: Arc<dyn Engine>,
        bus: Bus,
        kv_updates: BoxStream<'static, KvUpdate>,
        subscriptions: Subscriptions,
    ) -> Self {
        let Subscriptions {
            generate,
            resync,
            cancel,
        } = subscriptions;
        let mut load_tick = tokio::time::interval(settings.load_poll);
        load_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // A fresh epoch at every start: later than any earlier one.
        let outbox = KvOutbox::new(settings.worker.clone(), unix_ms(), settings.outbox);
        gauge!(m::KV_EPOCH).set(outbox.epoch() as f64);
        Self {
            worker: settings.worker.clone(),
            role: settings.role,
            engine,
            client: bus.client().clone(),
            bus,
            kv_updates,
            generate,
            resync,
            cancel,
            streams: HashMap::new(),
            outbox,
            publishing: None,
            failures: 0,
            resync_requested: None,
            resync_waiting: Vec::new(),
            owed_replies: None,
            max_queued_events: settings.outbox.max_queued_events,
            queue_filling: false,
            load_tick,
            load_interval: settings.load_interval,
            load_poll: settings.load_poll,
            last_load: None,
            tasks: JoinSet::new(),
        }
    }

    async fn serve(&mut self, shutdown: impl Future<Output = ()>) -> Result<(), AgentError> {
        let mut shutdown = std::pin::pin!(shutdown);
        self.pump_kv();
        loop {
            match self.next_event(shutdown.as_mut()).await {
                Event::Shutdown => {
                    info!("shutting down");
                    return Ok(());
                }
                Event::Kv(update) => self.on_kv(update)?,
                Event::Published(done) => self.on_published(done),
                Event::Generate(Some(message)) => self.on_generate(message),
                Event::Generate(None) => {
                    return Err(AgentError::SubscriptionClosed {
                        subject: subjects::generate(&self.worker),
                    })
                }
                Event::Resync(Some(message)) => self.on_resync(message),
                Event::Resync(None) => {
                    return Err(AgentError::SubscriptionClosed {
                        subject: subjects::resync(&self.worker),
                    })
                }
                Event::Cancel(Some(message)) => self.on_cancel(&message),
                Event::Cancel(None) => {
                    return Err(AgentError::SubscriptionClosed {
                        subject: subjects::cancel(&self.worker),
                    })
                }
                Event::LoadTick => self.on_load_tick().await,
                Event::TaskEnded(ended) => {
                    if let Err(e) = ended {
                        if !e.is_cancelled() {
                            error!(error = %e, "a stream task failed");
                        }
                    }
                    self.streams.retain(|_, task| !task.is_finished());
                }
            }
            self.pump_kv();
        }
    }

    /// The one place the loop waits.
    async fn next_event(&mut self, shutdown: Pin<&mut impl Future<Output = ()>>) -> Event {
        let publishing = self.publishing.is_some();
        let tasks = !self.tasks.is_empty();
        let Self {
            kv_updates,
            publishing: publish,
            generate,
            resync,
            cancel,
            load_tick,
            tasks: task_set,
            ..
        } = self;
        tokio::select! {
            () = shutdown => Event::Shutdown,
            update = kv_updates.next() => Event::Kv(update),
            done = async { publish.as_mut().expect("guarded by the precondition").await }, if publishing => {
                Event::Published(done)
            }
            message = generate.next() => Event::Generate(message),
            message = resync.next() => Event::Resync(message),
            message = cancel.next() => Event::Cancel(message),
            _ = load_tick.tick() => Event::LoadTick,
            Some(ended) = task_set.join_next(), if tasks => Event::TaskEnded(ended),
        }
    }

    // --- KV events -------------------------------------------------------

    fn on_kv(&mut self, update: Option<KvUpdate>) -> Result<(), AgentError> {
        match update {
            None => {
                return Err(match self.engine.failure() {
                    Some(why) => AgentError::EngineFailed(why),
                    None => AgentError::EngineStopped,
                })
            }
            Some(KvUpdate::Events(events)) => match self.outbox.push(events) {
                Pushed::Queued => self.watch_queue(),
                Pushed::AwaitingResync => {}
                Pushed::Overflowed => {
                    counter!(m::KV_QUEUE_OVERFLOWS).increment(1);
                    warn!(
                        epoch = self.outbox.epoch(),
                        failures = self.failures,
                        "KV queue overflowed while NATS did not acknowledge; dropping it and resynchronising (new epoch with the full block set)"
                    );
                    self.publishing = None;
                    self.queue_filling = false;
                    self.request_resync(ResyncReason::Overflow);
                }
            },
            Some(KvUpdate::BlockSet(set)) => self.start_epoch(set),
        }
        Ok(())
    }

    /// Says once when the queue fills past half of its bound (NATS is not
    /// acknowledging), and again once it drained.
    fn watch_queue(&mut self) {
        let held = self.outbox.held_events();
        if !self.queue_filling && held >= self.max_queued_events / 2 {
            self.queue_filling = true;
            warn!(
                held_events = held,
                max_queued_events = self.max_queued_events,
                failures = self.failures,
                "KV events are piling up while NATS does not acknowledge; at the bound the agent resynchronises"
            );
        }
    }

    fn request_resync(&mut self, reason: ResyncReason) {
        if self.resync_requested.is_none() {
            self.resync_requested = Some(reason);
            self.engine.request_block_set();
        }
    }

    /// The engine's block set came: a new epoch starts from it.
    fn start_epoch(&mut self, set: Vec<KvEvent>) {
        let reason = self
            .resync_requested
            .take()
            .map_or("engine", ResyncReason::as_str);
        let blocks: u64 = set
            .iter()
            .map(|e| match e {
                KvEvent::Stored { blocks, .. } => blocks.len() as u64,
                _ => 0,
            })
            .sum();
        let epoch = unix_ms().max(self.outbox.epoch() + 1);
        if let Err(e) = self.outbox.start_epoch(epoch, set) {
            error!(error = %e, "cannot start a new KV epoch");
            return;
        }
        self.publishing = None;
        self.failures = 0;
        counter!(m::RESYNCS, "reason" => reason).increment(1);
        gauge!(m::KV_EPOCH).set(epoch as f64);
        info!(
            epoch,
            blocks, reason, "new KV epoch from the full block set"
        );
        // Replies owed for an older epoch are answered by this one.
        let mut to = std::mem::take(&mut self.resync_waiting);
        if let Some(older) = self.owed_replies.take() {
            to.extend(older.to);
        }
        self.owed_replies = Some(OwedReplies { epoch, blocks, to });
    }

    /// Starts publishing the next batch if none is in flight.
    fn pump_kv(&mut self) {
        if self.publishing.is_none() {
            if let Some(batch) = self.outbox.next_batch() {
                let batch = batch.clone();
                let bus = self.bus.clone();
                let delay = retry_delay(self.failures);
                self.publishing = Some(Box::pin(async move {
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    let result = bus.publish_kv_batch(&batch).await;
                    PublishDone {
                        epoch: batch.epoch,
                        seq: batch.seq,
                        result,
                    }
                }));
            }
        }
        gauge!(m::KV_QUEUE_EVENTS).set(self.outbox.held_events() as f64);
    }

    fn on_published(&mut self, done: PublishDone) {
        self.publishing = None;
        let PublishDone { epoch, seq, result } = done;
        match result {
            Ok(duplicate) => {
                let Some(batch) = self.outbox.acked(epoch, seq) else {
                    return;
                };
                if self.failures > 0 {
                    info!(
                        epoch,
                        seq,
                        retries = self.failures,
                        "KV batch published: NATS acknowledges again"
                    );
                }
                self.failures = 0;
                if self.queue_filling && self.outbox.held_events() < self.max_queued_events / 4 {
                    self.queue_filling = false;
                    info!(held_events = self.outbox.held_events(), "KV queue drained");
                }
                counter!(m::KV_BATCHES_PUBLISHED).increment(1);
                counter!(m::KV_BLOCKS_PUBLISHED).increment(batch.block_events() as u64);
                if duplicate {
                    counter!(m::KV_BATCHES_DUPLICATE).increment(1);
                }
                debug!(
                    epoch,
                    seq,
                    events = batch.events.len(),
                    duplicate,
                    "KV batch published"
                );
                if seq == 0 {
                    self.send_owed_replies(epoch);
                }
            }
            Err(e) => {
                self.failures += 1;
                counter!(m::KV_PUBLISH_RETRIES).increment(1);
                if self.failures == 1 || self.failures % 20 == 0 {
                    warn!(
                        epoch,
                        seq,
                        failures = self.failures,
                        held_events = self.outbox.held_events(),
                        error = %e,
                        "KV batch not acknowledged; events stay queued and the batch is retried with the same message id"
                    );
                }
            }
        }
    }

    // --- Resync ----------------------------------------------------------

    fn on_resync(&mut self, message: NatsMessage) {
        info!(has_reply = message.reply.is_some(), "resync requested");
        if let Some(reply) = message.reply {
            self.resync_waiting.push(reply);
        }
        self.request_resync(ResyncReason::Request);
    }

    /// The first batch of `epoch` is in the stream: answer who asked.
    fn send_owed_replies(&mut self, epoch: u64) {
        let Some(owed) = self.owed_replies.take_if(|o| o.epoch == epoch) else {
            return;
        };
        let payload: bytes::Bytes = ResyncReply {
            worker: self.worker.clone(),
            epoch,
            blocks: owed.blocks,
        }
        .encode()
        .into();
        for subject in owed.to {
            let client = self.client.clone();
            let payload = payload.clone();
            self.tasks.spawn(
                async move {
                    if let Err(e) = client.publish(subject, payload).await {
                        counter!(m::PUBLISH_ERRORS, "kind" => "resync_reply").increment(1);
                        warn!(error = %e, "resync reply not sent");
                    }
                }
                .in_current_span(),
            );
        }
    }

    // --- Load ------------------------------------------------------------

    /// Publishes the load when it changed, or when the last report is
    /// about to be `load_interval` old.
    async fn on_load_tick(&mut self) {
        let load = self.engine.load();
        let now = Instant::now();
        let due = match self.last_load {
            None => true,
            Some((last, at)) => {
                last != load || now.duration_since(at) + self.load_poll >= self.load_interval
            }
        };
        if !due {
            return;
        }
        self.last_load = Some((load, now));
        if self.client.connection_state() != State::Connected {
            counter!(m::PUBLISH_ERRORS, "kind" => "load").increment(1);
            return;
        }
        let report: LoadReport = load.report(self.worker.clone(), unix_ms());
        let publish = self
            .client
            .publish(subjects::load(&self.worker), report.encode().into());
        match tokio::time::timeout(LOAD_PUBLISH_TIMEOUT, publish).await {
            Ok(Ok(())) => counter!(m::LOAD_REPORTS).increment(1),
            Ok(Err(e)) => {
                counter!(m::PUBLISH_ERRORS, "kind" => "load").increment(1);
                debug!(error = %e, "load report not published");
            }
            Err(_) => {
                counter!(m::PUBLISH_ERRORS, "kind" => "load").increment(1);
                debug!("load report not published in time");
            }
        }
    }

    // --- Generation ------------------------------------------------------

    fn on_generate(&mut self, message: NatsMessage) {
        let decoded = GenerateRequest::decode(&message.payload);
        let Some(reply) = message.reply else {
            counter!(m::MALFORMED_REQUESTS, "reason" => "no_reply").increment(1);
            match &decoded {
                Ok(r) => warn!(
                    request_id = %r.request_id,
                    decision = %r.annotation.decision,
                    "generate request without a reply subject: dropped"
                ),
                Err(e) => warn!(
                    error = %e,
                    "generate message without a reply subject (and not a GenerateRequest): dropped"
                ),
            }
            return;
        };
        let request = match decoded {
            Ok(request) => request,
            Err(e) => {
                counter!(m::MALFORMED_REQUESTS, "reason" => "decode").increment(1);
                warn!(bytes = message.payload.len(), error = %e, "malformed generate request");
                let out = ChunkSender {
                    client: self.client.clone(),
                    subject: reply,
                    request_id: None,
                    decision: None,
                    stage: "unknown",
                };
                let failure = GenerateEvent::Failed {
                    error: format!("malformed GenerateRequest: {e}"),
                    retryable: false,
                };
                self.tasks
                    .spawn(async move { out.send(0, failure).await }.in_current_span());
                return;
            }
        };
        let stage = request.stage.as_str();
        let out = ChunkSender {
            client: self.client.clone(),
            subject: reply,
            request_id: Some(request.request_id.clone()),
            decision: Some(request.annotation.decision),
            stage,
        };
        if let Err(why) = check_request(self.role, &self.worker, &request) {
            counter!(m::GENERATE_REQUESTS, "stage" => stage, "outcome" => "refused").increment(1);
            warn!(
                request_id = %request.request_id,
                decision = %request.annotation.decision,
                stage,
                error = %why,
                "generate request refused"
            );
            let failure = GenerateEvent::Failed {
                error: why,
                retryable: false,
            };
            self.tasks
                .spawn(async move { out.send(0, failure).await }.in_current_span());
            return;
        }
        info!(
            request_id = %request.request_id,
            decision = %request.annotation.decision,
            stage,
            prompt_tokens = request.prompt.len(),
            max_tokens = request.max_tokens,
            "generate"
        );
        let decision = request.annotation.decision;
        let events = self.engine.generate(request);
        let task = self.tasks.spawn(forward(out, events).in_current_span());
        self.streams.insert(decision, task);
    }

    /// The router gave up on a request (its client went away): stop
    /// generating it. Late cancels (the stream already ended) are ignored.
    fn on_cancel(&mut self, message: &NatsMessage) {
        let cancel = match CancelRequest::decode(&message.payload) {
            Ok(cancel) => cancel,
            Err(e) => {
                counter!(m::MALFORMED_REQUESTS, "reason" => "cancel").increment(1);
                warn!(bytes = message.payload.len(), error = %e, "malformed cancel request");
                return;
            }
        };
        let outcome = match self.streams.remove(&cancel.decision) {
            Some(task) if !task.is_finished() => {
                task.abort();
                info!(
                    request_id = %cancel.request_id,
                    decision = %cancel.decision,
                    reason = %cancel.reason,
                    "generation cancelled"
                );
                "cancelled"
            }
            _ => {
                debug!(request_id = %cancel.request_id, decision = %cancel.decision, "cancel for a stream that already ended");
                "already_ended"
            }
        };
        counter!(m::CANCELS, "outcome" => outcome).increment(1);
    }
}

/// The subjects an agent serves.
struct Subscriptions {
    generate: Subscriber,
    resync: Subscriber,
    cancel: Subscriber,
}

/// The delay before publishing a batch again after `failures` failures.
fn retry_delay(failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    RETRY_FIRST
        .saturating_mul(1 << (failures - 1).min(16))
        .min(RETRY_MAX)
}

/// Whether this worker can serve `request`, else a clear reason.
fn check_request(role: Role, worker: &WorkerId, request: &GenerateRequest) -> Result<(), String> {
    let served = match &request.stage {
        Stage::Local | Stage::Decode { .. } => role.decodes(),
        Stage::Prefill => role.prefills_for_others(),
    };
    if !served {
        return Err(format!(
            "worker {worker} has role {role} and does not serve {} requests",
            request.stage.as_str()
        ));
    }
    if request.prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    match &request.stage {
        Stage::Local | Stage::Decode { .. } if request.max_tokens == 0 => {
            return Err(format!(
                "max_tokens must be at least 1 for a {} request",
                request.stage.as_str()
            ));
        }
        Stage::Decode { transfer } if transfer.prompt_tokens as usize != request.prompt.len() => {
            return Err(format!(
                "the KV transfer from {} covers {} prompt tokens but the prompt has {}",
                transfer.source,
                transfer.prompt_tokens,
                request.prompt.len()
            ));
        }
        _ => {}
    }
    Ok(())
}

/// Sends one request's chunks to its reply subject.
#[derive(Debug)]
struct ChunkSender {
    client: Client,
    subject: Subject,
    request_id: Option<String>,
    decision: Option<DecisionId>,
    stage: &'static str,
}

impl ChunkSender {
    async fn send(&self, index: u32, event: GenerateEvent) {
        let chunk = GenerateChunk { index, event };
        if let Err(e) = self
            .client
            .publish(self.subject.clone(), chunk.encode().into())
            .await
        {
            counter!(m::PUBLISH_ERRORS, "kind" => "chunk").increment(1);
            warn!(
                request_id = self.request_id.as_deref().unwrap_or("-"),
                decision = %self.decision.map(|d| d.to_string()).unwrap_or_default(),
                index,
                error = %e,
                "generate chunk not sent"
            );
        }
    }
}

/// Forwards the engine's events as numbered chunks; a stream that ends
/// without a last event gets a retryable failure.
async fn forward(out: ChunkSender, mut events: BoxStream<'static, GenerateEvent>) {
    let request_id = out.request_id.clone().unwrap_or_default();
    let decision = out.decision.map(|d| d.to_string()).unwrap_or_default();
    let mut index = 0u32;
    let mut outcome = "interrupted";
    while let Some(event) = events.next().await {
        let last = event.is_last();
        match &event {
            GenerateEvent::Finished {
                output_tokens,
                cached_tokens,
                reason,
            } => {
                outcome = "finished";
                info!(
                    request_id,
                    decision,
                    stage = out.stage,
                    output_tokens,
                    cached_tokens,
                    reason = reason.as_str(),
                    "generate finished"
                );
            }
            GenerateEvent::Failed { error, retryable } => {
                outcome = "failed";
                warn!(
                    request_id,
                    decision,
                    stage = out.stage,
                    error,
                    retryable,
                    "generate failed"
                );
            }
            GenerateEvent::Tokens(_) | GenerateEvent::Prefilled { .. } => {}
        }
        out.send(index, event).await;
        index += 1;
        if last {
            break;
        }
    }
    if outcome == "interrupted" {
        warn!(
            request_id,
            decision,
            stage = out.stage,
            "the engine stopped before the request finished"
        );
        let failure = GenerateEvent::Failed {
            error: "the engine stopped before the request finished".into(),
            retryable: true,
        };
        out.send(index, failure).await;
    }
    counter!(m::GENERATE_REQUESTS, "stage" => out.stage, "outcome" => outcome).increment(1);
}

#[cfg(test)]
mod tests {
    use protocol::{Annotation, KvTransferParams, Path};

    use super::*;

    fn request(stage: Stage, prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
        GenerateRequest {
            request_id: "r".into(),
            annotation: Annotation {
                decision: DecisionId(1),
                path: Path::Bypass,
                decode: "d0".parse().unwrap(),
                prefill: None,
                decode_overlap_tokens: 0,
                prefill_overlap_tokens: 0,
            },
            stage,
            prompt,
            max_tokens,
        }
    }

    #[test]
    fn roles_serve_their_stages_only() {
        let w: WorkerId = "p0".parse().unwrap();
        let err = check_request(Role::Prefill, &w, &request(Stage::Local, vec![1], 1)).unwrap_err();
        assert_eq!(
            err,
            "worker p0 has role prefill and does not serve local requests"
        );
        assert!(check_request(Role::Prefill, &w, &request(Stage::Prefill, vec![1], 0)).is_ok());
        assert!(check_request(Role::Decode, &w, &request(Stage::Prefill, vec![1], 0)).is_err());
        assert!(
            check_request(Role::Both, &w, &request(Stage::Local, vec![], 1))
                .unwrap_err()
                .contains("empty")
        );
        assert!(
            check_request(Role::Both, &w, &request(Stage::Local, vec![1], 0))
                .unwrap_err()
                .contains("max_tokens")
        );
        let transfer = KvTransferParams {
            source: w.clone(),
            prompt_tokens: 2,
            engine: None,
        };
        assert!(check_request(
            Role::Decode,
            &w,
            &request(Stage::Decode { transfer }, vec![1], 1)
        )
        .unwrap_err()
        .contains("covers 2 prompt tokens"));
    }

    #[test]
    fn retries_back_off_up_to_a_cap() {
        assert_eq!(retry_delay(0), Duration::ZERO);
        assert_eq!(retry_delay(1), Duration::from_millis(50));
        assert_eq!(retry_delay(3), Duration::from_millis(200));
        assert_eq!(retry_delay(60), RETRY_MAX);
    }
}
