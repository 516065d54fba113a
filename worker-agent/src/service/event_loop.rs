//! The agent's loop: one owner of the state; everything that happens to
//! it is one [`Event`], awaited in one `select!` ([`Agent::next_event`]).
//! KV batches are the [`KvCore`]'s business (`kv.rs` carries out its
//! effects), generation is `generate.rs`'s; load reports are here.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::connection::State;
use async_nats::{Client, Message as NatsMessage, Subject, Subscriber};
use bus::Bus;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::StreamExt;
use metrics::{counter, gauge};
use protocol::{subjects, DecisionId, KvEventBatch, LoadReport, Message, Role, WorkerId};
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinError, JoinSet};
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tracing::{debug, error, info, warn};

use super::kv::PublishDone;
use super::ping::InFlight;
use crate::config::Config;
use crate::core::{Backoff, Input, KvCore};
use crate::engine::{Engine, EngineLoad, KvUpdate};
use crate::error::AgentError;
use crate::metrics as m;

/// How long in-flight streams get to send their last chunk at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// A core NATS publish from the loop waits at most this long.
const LOAD_PUBLISH_TIMEOUT: Duration = Duration::from_millis(50);

/// Milliseconds since the Unix epoch.
pub(super) fn unix_ms() -> u64 {
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
    /// The retry the KV core asked for is due.
    RetryDue,
    /// A message on the generate subject; `None` when the subscription ended.
    Generate(Option<NatsMessage>),
    /// A message on the resync subject; `None` when the subscription ended.
    Resync(Option<NatsMessage>),
    /// A message on the cancel subject; `None` when the subscription ended.
    Cancel(Option<NatsMessage>),
    /// The indexer asks for the recent KV batches again; `None` when the
    /// subscription ended.
    Reannounce(Option<NatsMessage>),
    /// Time to check the load.
    LoadTick,
    /// A stream forwarder or a reply task ended.
    TaskEnded(Result<(), JoinError>),
}

/// The subjects an agent serves.
pub(super) struct Subscriptions {
    pub(super) generate: Subscriber,
    pub(super) resync: Subscriber,
    pub(super) cancel: Subscriber,
    pub(super) reannounce: Subscriber,
}

/// The agent's KV epochs in etcd: the first one was taken from there
/// (later than any recorded, [`bus::Registry::next_epoch`]), later ones
/// are recorded there.
pub(super) struct Epochs {
    pub(super) registry: bus::Registry,
    pub(super) first: u64,
}

/// The agent's state, owned by its loop.
pub(super) struct Agent {
    pub(super) worker: WorkerId,
    pub(super) role: Role,
    /// The worker's block size (a pulling leg asks for whole blocks).
    pub(super) block_size: u32,
    pub(super) engine: Arc<dyn Engine>,
    pub(super) bus: Bus,
    pub(super) client: Client,
    kv_updates: BoxStream<'static, KvUpdate>,
    generate: Subscriber,
    /// False once draining: the generate subscription is gone.
    accepting: bool,
    resync: Subscriber,
    cancel: Subscriber,
    reannounce: Subscriber,
    /// The generation streams being forwarded, by decision: a cancel
    /// aborts the forwarder, which drops the engine's stream.
    pub(super) streams: HashMap<DecisionId, AbortHandle>,
    /// The same decisions, for the probe task's answers (each stream's
    /// forwarder holds its place).
    pub(super) in_flight: InFlight,
    /// Numbering, retries, resyncs and owed replies of the KV batches.
    pub(super) kv: KvCore<Subject>,
    /// The KV core's time origin.
    pub(super) origin: Instant,
    /// The KV batch publish in flight.
    pub(super) publishing: Option<BoxFuture<'static, PublishDone>>,
    /// KV batches to announce on core NATS, in order (a task of their own
    /// sends them).
    pub(super) announcer: mpsc::Sender<KvEventBatch>,
    /// The newest batch formed: (epoch, seq) (`worker_agent_kv_batch_seq`).
    pub(super) newest_formed: Option<(u64, u64)>,
    /// When the KV core wants to be stepped again (a retry).
    pub(super) retry_at: Option<Instant>,
    load_tick: Interval,
    load_interval: Duration,
    load_poll: Duration,
    /// The last load checked for publishing, and when.
    last_load: Option<(EngineLoad, Instant)>,
    /// Stream forwarders and reply senders.
    pub(super) tasks: JoinSet<()>,
    /// Where new epochs are recorded.
    pub(super) registry: bus::Registry,
    /// Whether JetStream's store refuses KV batches for want of room (the
    /// HTTP health reads it).
    pub(super) store_full: Arc<AtomicBool>,
    /// Generation requests larger than the bus's payload limit, arriving
    /// in fragments (by reply subject; `origin`'s milliseconds).
    pub(super) fragments: protocol::Reassembly,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("worker", &self.worker)
            .field("epoch", &self.kv.epoch())
            .finish_non_exhaustive()
    }
}

impl Agent {
    pub(super) fn new(
        settings: &Config,
        engine: Arc<dyn Engine>,
        bus: Bus,
        kv_updates: BoxStream<'static, KvUpdate>,
        subscriptions: Subscriptions,
        epochs: Epochs,
        in_flight: InFlight,
    ) -> Self {
        let Subscriptions {
            generate,
            resync,
            cancel,
            reannounce,
        } = subscriptions;
        let mut load_tick = tokio::time::interval(settings.load_poll);
        load_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // A fresh epoch at every start: later than any earlier one (etcd
        // keeps the highest, in case the clock went back).
        let kv = KvCore::new(
            settings.worker.clone(),
            epochs.first,
            settings.outbox,
            Backoff::AGENT,
        );
        gauge!(m::KV_EPOCH).set(kv.epoch() as f64);
        let (announcer, announcements) = mpsc::channel(super::kv::ANNOUNCE_QUEUE);
        tokio::spawn(super::kv::announce(bus.clone(), announcements));
        Self {
            worker: settings.worker.clone(),
            role: settings.role,
            block_size: settings.contract.block_size,
            engine,
            client: bus.client().clone(),
            bus,
            kv_updates,
            generate,
            accepting: true,
            resync,
            cancel,
            reannounce,
            streams: HashMap::new(),
            in_flight,
            kv,
            origin: Instant::now(),
            publishing: None,
            announcer,
            newest_formed: None,
            retry_at: None,
            load_tick,
            load_interval: settings.load_interval,
            load_poll: settings.load_poll,
            last_load: None,
            tasks: JoinSet::new(),
            registry: epochs.registry,
            store_full: Arc::default(),
            fragments: protocol::Reassembly::new(
                super::generate::FRAGMENTS_MAX_BYTES,
                super::generate::FRAGMENTS_MAX_AGE_MS,
            ),
        }
    }

    /// The current KV epoch.
    pub(super) fn epoch(&self) -> u64 {
        self.kv.epoch()
    }

    pub(super) async fn serve(
        &mut self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), AgentError> {
        // The first batch (`Cleared`) goes at once.
        self.kv_step(Input::Tick);
        self.run_loop(shutdown).await
    }

    /// After [`Agent::serve`] (and the registration's revoke): takes no new
    /// request (the generate subscription goes, so routers get "no
    /// responders" and go elsewhere) and runs the loop until every stream
    /// in flight ended, or `timeout`. Returns the streams still open.
    pub(super) async fn drain(&mut self, timeout: Duration) -> usize {
        self.streams.retain(|_, task| !task.is_finished());
        if let Err(e) = self.generate.unsubscribe().await {
            warn!(error = %e, "unsubscribing from the generate subject failed");
        }
        self.accepting = false;
        if self.streams.is_empty() {
            return 0;
        }
        info!(
            in_flight = self.streams.len(),
            ?timeout,
            "draining: no new requests; waiting for the ones in flight"
        );
        if let Err(e) = self.run_loop(tokio::time::sleep(timeout)).await {
            warn!(error = %e, "the loop failed while draining");
        }
        self.streams.retain(|_, task| !task.is_finished());
        if self.streams.is_empty() {
            info!("drained: every request in flight finished");
        } else {
            warn!(
                in_flight = self.streams.len(),
                ?timeout,
                "requests still in flight after the drain timeout"
            );
        }
        self.streams.len()
    }

    /// The loop, until `stop` completes (or, draining, until no stream is
    /// left).
    async fn run_loop(&mut self, stop: impl Future<Output = ()>) -> Result<(), AgentError> {
        let mut shutdown = std::pin::pin!(stop);
        loop {
            if !self.accepting && self.streams.is_empty() {
                return Ok(());
            }
            match self.next_event(shutdown.as_mut()).await {
                Event::Shutdown => {
                    if self.accepting {
                        info!("shutting down");
                    }
                    return Ok(());
                }
                Event::Kv(None) => {
                    return Err(match self.engine.failure() {
                        Some(why) => AgentError::EngineFailed(why),
                        None => AgentError::EngineStopped,
                    })
                }
                Event::Kv(Some(KvUpdate::Events(events))) => {
                    self.kv_step(Input::EngineEvents(events))
                }
                Event::Kv(Some(KvUpdate::BlockSet(set))) => self.kv_step(Input::BlockSet(set)),
                Event::Published(done) => self.on_published(done),
                Event::RetryDue => {
                    self.retry_at = None;
                    self.kv_step(Input::Tick);
                }
                Event::Generate(Some(message)) => self.on_generate(message),
                Event::Generate(None) => {
                    return Err(AgentError::SubscriptionClosed {
                        subject: subjects::generate(&self.worker),
                    })
                }
                Event::Resync(Some(message)) => {
                    info!(has_reply = message.reply.is_some(), "resync requested");
                    self.kv_step(Input::ResyncRequested {
                        reply: message.reply,
                    });
                }
                Event::Resync(None) => {
                    return Err(AgentError::SubscriptionClosed {
                        subject: subjects::resync(&self.worker),
                    })
                }
                Event::Reannounce(Some(message)) => {
                    match subjects::parse_kv_reannounce_body(&message.payload) {
                        Some((epoch, after_seq)) => {
                            self.kv_step(Input::ReannounceRequested { epoch, after_seq })
                        }
                        None => {
                            counter!(m::MALFORMED_REQUESTS, "reason" => "reannounce").increment(1);
                            warn!(bytes = message.payload.len(), "a request to announce KV batches again without \"EPOCH SEQ\"; ignored");
                        }
                    }
                }
                Event::Reannounce(None) => {
                    return Err(AgentError::SubscriptionClosed {
                        subject: subjects::kv_reannounce(&self.worker),
                    })
                }
                Event::Cancel(Some(message)) => self.on_cancel(&message),
                Event::Cancel(None) => {
                    return Err(AgentError::SubscriptionClosed {
                        subject: subjects::cancel(&self.worker),
                    })
                }
                Event::LoadTick => {
                    // A publish in flight may have stalled since the last
                    // step: events waiting for it are announced then.
                    if self.publishing.is_some() || self.kv.held_events() > 0 {
                        self.kv_step(Input::Tick);
                    }
                    self.on_load_tick().await
                }
                Event::TaskEnded(ended) => {
                    if let Err(e) = ended {
                        if !e.is_cancelled() {
                            error!(error = %e, "a stream task failed");
                        }
                    }
                    self.streams.retain(|_, task| !task.is_finished());
                }
            }
        }
    }

    /// The one place the loop waits.
    async fn next_event(&mut self, shutdown: Pin<&mut impl Future<Output = ()>>) -> Event {
        let publishing = self.publishing.is_some();
        let accepting = self.accepting;
        let tasks = !self.tasks.is_empty();
        let retry_at = self.retry_at;
        let Self {
            kv_updates,
            publishing: publish,
            generate,
            resync,
            cancel,
            reannounce,
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
            () = tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now)), if retry_at.is_some() => {
                Event::RetryDue
            }
            message = generate.next(), if accepting => Event::Generate(message),
            message = resync.next() => Event::Resync(message),
            message = cancel.next() => Event::Cancel(message),
            message = reannounce.next() => Event::Reannounce(message),
            _ = load_tick.tick() => Event::LoadTick,
            Some(ended) = task_set.join_next(), if tasks => Event::TaskEnded(ended),
        }
    }

    /// After the loop: stops taking requests, stops the engine, gives the
    /// open streams their last chunk (within a grace period) and flushes
    /// NATS. Returns the KV events left unpublished.
    pub(super) async fn wind_down(self) -> usize {
        let Self {
            generate,
            resync,
            engine,
            mut tasks,
            client,
            kv,
            ..
        } = self;
        drop(generate);
        drop(resync);
        engine.stop();
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            warn!("in-flight streams did not end in time");
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), client.flush()).await;
        kv.held_events()
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
}
