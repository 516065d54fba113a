//! What the event loop listens to besides its HTTP commands and the delta
//! stream: load reports, progress notices, the replicas' heartbeats and
//! the indexer's delta announcements (core NATS), the other
//! replicas' decisions (the decision-log stream, new messages only) and
//! the worker registry (etcd).

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use bus::{Bus, BusError, Registry, RegistryError, WorkerChange, WorkerWatch};
use futures::stream::{self, BoxStream};
use futures::StreamExt;
use protocol::{subjects, IndexDelta};

/// Why an input could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("subscribing to {subject}: {message}")]
    Subscribe {
        subject: &'static str,
        message: String,
    },
    #[error("following the decision log {stream}: {message}")]
    DecisionLog {
        stream: &'static str,
        message: String,
    },
    /// The indexer's delta announcements (`Bus::live_deltas`, whose error
    /// names the subject).
    #[error(transparent)]
    Bus(#[from] BusError),
}

/// A change of the registered workers, as the event loop takes it.
#[derive(Debug)]
pub enum WorkerEvent {
    /// Every registered worker (at start, and after the watch was lost):
    /// workers not in the list are gone.
    Listed(Vec<WorkerChange>),
    /// Changes since the last event.
    Changed(Vec<WorkerChange>),
    /// The watch or the listing failed; it is retried.
    Lost(String),
}

/// The subscriptions, opened before the loop starts.
pub struct Inputs {
    pub loads: BoxStream<'static, async_nats::Message>,
    pub progress: BoxStream<'static, async_nats::Message>,
    /// The replicas' heartbeats (this one's included).
    pub heartbeats: BoxStream<'static, async_nats::Message>,
    /// The indexer's deltas as it makes them, ahead of the delta stream
    /// (`kv_indexer::LiveDeltas`).
    pub live_deltas: BoxStream<'static, Result<IndexDelta, BusError>>,
    pub decisions: BoxStream<'static, Result<jetstream::Message, String>>,
    pub workers: BoxStream<'static, WorkerEvent>,
}

impl std::fmt::Debug for Inputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inputs").finish_non_exhaustive()
    }
}

impl Inputs {
    pub async fn open(bus: &Bus, registry: Registry) -> Result<Self, InputError> {
        let client = bus.client();
        let subscribe = |subject: &'static str| async move {
            client
                .subscribe(subject)
                .await
                .map_err(|e| InputError::Subscribe {
                    subject,
                    message: e.to_string(),
                })
        };
        let loads = subscribe(subjects::LOAD_ALL).await?.boxed();
        let progress = subscribe(subjects::PROGRESS_ALL).await?.boxed();
        let heartbeats = subscribe(subjects::ROUTER_HEARTBEATS_ALL).await?.boxed();
        let live_deltas = bus.live_deltas().await?;
        let decisions = decision_log(bus).await?;
        Ok(Self {
            loads,
            progress,
            heartbeats,
            live_deltas,
            decisions,
            workers: worker_events(registry),
        })
    }
}

/// New messages of the decision log (an ordered consumer: nothing to ack,
/// restarted by the client after a reconnect).
async fn decision_log(
    bus: &Bus,
) -> Result<BoxStream<'static, Result<jetstream::Message, String>>, InputError> {
    let error = |e: &dyn std::fmt::Display| InputError::DecisionLog {
        stream: subjects::DECISIONS_STREAM,
        message: e.to_string(),
    };
    let stream = bus
        .jetstream()
        .get_stream(subjects::DECISIONS_STREAM)
        .await
        .map_err(|e| error(&e))?;
    let consumer = bus::create_consumer_patiently(|| {
        stream.create_consumer(consumer::push::OrderedConfig {
            deliver_subject: bus.client().new_inbox(),
            deliver_policy: consumer::DeliverPolicy::New,
            filter_subject: subjects::DECISIONS_ALL.into(),
            ..Default::default()
        })
    })
    .await
    .map_err(|e| error(&e))?;
    let messages = consumer.messages().await.map_err(|e| error(&e))?;
    Ok(messages.map(|m| m.map_err(|e| e.to_string())).boxed())
}

enum WatchState {
    List { after_error: bool },
    Watch(WorkerWatch),
}

/// The registry as a stream: the full list first, then the watch; a lost
/// watch is followed by a fresh list and a new watch.
fn worker_events(registry: Registry) -> BoxStream<'static, WorkerEvent> {
    let state = WatchState::List { after_error: false };
    stream::unfold((registry, state), |(registry, state)| async move {
        match state {
            WatchState::List { after_error } => {
                if after_error {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                let listed: Result<_, RegistryError> = async {
                    let (workers, revision) = registry.workers().await?;
                    let watch = registry.watch_workers(revision).await?;
                    Ok((workers, watch))
                }
                .await;
                match listed {
                    Ok((workers, watch)) => Some((
                        WorkerEvent::Listed(workers),
                        (registry, WatchState::Watch(watch)),
                    )),
                    Err(e) => Some((
                        WorkerEvent::Lost(e.to_string()),
                        (registry, WatchState::List { after_error: true }),
                    )),
                }
            }
            WatchState::Watch(mut watch) => match watch.next().await {
                Ok(changes) => Some((
                    WorkerEvent::Changed(changes),
                    (registry, WatchState::Watch(watch)),
                )),
                Err(e) => Some((
                    WorkerEvent::Lost(e.to_string()),
                    (registry, WatchState::List { after_error: true }),
                )),
            },
        }
    })
    .boxed()
}
