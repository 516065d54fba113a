//! The workers' KV events in: the durable pull consumer, decoding, and the
//! in-order pipeline of delta publishes after which KV messages are acked.
//!
//! # Where the consumer resumes
//!
//! A KV message is acked only once the delta it produced is in the delta
//! stream, so every message up to the consumer's ack floor is covered by
//! the recovered state. At startup the consumer is recreated to deliver from
//! the ack floor + 1, in stream order: messages whose deltas were published
//! (but whose acks were lost) come back as duplicates, the others are
//! applied. Relying on redelivery instead would hand the unacked messages
//! back only after the ack wait, behind newer ones: the core would see gaps
//! and ask workers to resync for nothing.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::ConsumerInfoErrorKind;
use async_nats::jetstream::message::{AckKind, Acker};
use bus::{Bus, BusError, DeltaPublisher, DeltaSent};
use futures::stream::FuturesOrdered;
use futures::StreamExt;
use protocol::{subjects, IndexDelta, KvEventBatch, Message};

use super::config::Config;

/// Why the KV consumer could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    #[error("KV event stream {stream}: {message}")]
    Stream {
        stream: &'static str,
        message: String,
    },
    #[error("durable consumer {name}: {message}")]
    Consumer { name: String, message: String },
}

/// Where the recreated consumer delivers from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    /// The first KV stream message it delivers.
    pub start: u64,
    /// Whether the consumer existed (with an ack floor to resume after).
    pub existed: bool,
}

/// The durable consumer over every worker's KV events, recreated to
/// deliver from the first message not known to be covered by the deltas
/// (see the module docs): after its ack floor, or from the first retained
/// message when it did not exist. `no_deltas`: nothing was recovered, so
/// every retained KV event is read again whatever the floor.
///
/// It does not depend on the recovered state otherwise, so a takeover sets
/// it up while the index is recovered ([`Opened::start`] then tells
/// whether the state asks for another start).
///
/// `floor` carries the ack floor over tries ([`open_patiently`]): a try
/// that deleted the consumer and failed to create it again leaves the next
/// one no consumer to read it from.
pub async fn open(
    bus: &Bus,
    config: &Config,
    no_deltas: bool,
    floor: &mut Option<u64>,
) -> Result<(PullConsumer, Opened), ConsumerError> {
    let name = config.consumer.clone();
    let consumer_error = |message: String| ConsumerError::Consumer {
        name: name.clone(),
        message,
    };
    let stream = bus
        .jetstream()
        .get_stream(subjects::KV_EVENTS_STREAM)
        .await
        .map_err(|e| ConsumerError::Stream {
            stream: subjects::KV_EVENTS_STREAM,
            message: e.to_string(),
        })?;
    let found = match stream.consumer_info(&name).await {
        Ok(info) => Some(info.ack_floor.stream_sequence),
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => None,
        Err(e) => return Err(consumer_error(e.to_string())),
    };
    if found.is_some() {
        *floor = found;
    }
    let ack_floor = found.or(*floor);
    let start = match ack_floor {
        Some(floor) if !no_deltas => floor + 1,
        _ => 1,
    };
    if found.is_some() {
        stream
            .delete_consumer(&name)
            .await
            .map_err(|e| consumer_error(format!("deleting it to resume at {start}: {e}")))?;
    }
    let in_flight = config.max_in_flight + 2 * config.fetch_batch;
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(name.clone()),
            description: Some("Switchyard kv-indexer: every worker's KV events".into()),
            filter_subject: subjects::KV_EVENTS_ALL.into(),
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            ack_policy: AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_ack_pending: (4 * in_flight).max(10_000) as i64,
            ..Default::default()
        })
        .await
        .map_err(|e| consumer_error(e.to_string()))?;
    let opened = Opened {
        start,
        existed: ack_floor.is_some(),
    };
    Ok((consumer, opened))
}

/// [`open`], tried again for up to a minute while it fails (a takeover
/// sets the consumer up while a stream may still be electing its leader,
/// after a NATS node died).
pub async fn open_patiently(
    bus: &Bus,
    config: &Config,
    no_deltas: bool,
) -> Result<(PullConsumer, Opened), ConsumerError> {
    let started = Instant::now();
    let mut floor = None;
    loop {
        match open(bus, config, no_deltas, &mut floor).await {
            Ok(opened) => return Ok(opened),
            Err(e) if started.elapsed() < OPEN_PATIENCE => {
                tracing::warn!(error = %e, "setting up the KV consumer failed; trying again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// How long [`open_patiently`] tries.
const OPEN_PATIENCE: Duration = Duration::from_secs(60);

/// How long one pull request waits for messages before the client sends
/// another, and how often the server says it is still there while it has
/// none. Without the heartbeat (async-nats 0.51's default is none) a pull
/// whose consumer leader died with its NATS node waits out the whole
/// request (30 s by default) before a new one reaches the new leader, and
/// the index stands still that long; with it a silent leader is noticed
/// after two missed beats and the next pull is sent.
const PULL_EXPIRES: Duration = Duration::from_secs(5);
const PULL_HEARTBEAT: Duration = Duration::from_secs(1);

/// The consumer's messages, pulled `fetch_batch` at a time.
pub async fn messages(
    consumer: &PullConsumer,
    config: &Config,
) -> Result<pull::Stream, ConsumerError> {
    consumer
        .stream()
        .max_messages_per_batch(config.fetch_batch.max(1))
        .expires(PULL_EXPIRES)
        .heartbeat(PULL_HEARTBEAT)
        .messages()
        .await
        .map_err(|e| ConsumerError::Consumer {
            name: config.consumer.clone(),
            message: e.to_string(),
        })
}

/// A KV message that is not a worker's batch.
#[derive(Debug, thiserror::Error)]
pub enum Malformed {
    #[error(transparent)]
    Decode(#[from] protocol::DecodeError),
    #[error("batch of worker {worker} on subject {subject} (expected {expected})")]
    WrongSubject {
        worker: String,
        subject: String,
        expected: String,
    },
}

/// Decodes a KV message of the stream, checking that the batch came on
/// its worker's subject.
pub fn decode(message: &async_nats::Message) -> Result<KvEventBatch, Malformed> {
    decode_on(message, subjects::kv_events)
}

/// Decodes a KV batch announced on core NATS, checking that it came on its
/// worker's live subject.
pub fn decode_live(message: &async_nats::Message) -> Result<KvEventBatch, Malformed> {
    decode_on(message, subjects::kv_events_live)
}

fn decode_on(
    message: &async_nats::Message,
    subject_of: fn(&protocol::WorkerId) -> String,
) -> Result<KvEventBatch, Malformed> {
    let batch = KvEventBatch::decode(&message.payload)?;
    let expected = subject_of(&batch.worker);
    if message.subject.as_str() != expected {
        return Err(Malformed::WrongSubject {
            worker: batch.worker.to_string(),
            subject: message.subject.to_string(),
            expected,
        });
    }
    Ok(batch)
}

/// What one pipeline entry did, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Confirmed {
    /// The delta now in the stream, if the entry had one.
    pub seq: Option<u64>,
}

/// Why the pipeline stopped.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("publishing delta {seq}: {source}")]
    Publish {
        seq: u64,
        #[source]
        source: BusError,
    },
    #[error("injected crash after delta {seq} was published, before its KV message was acked")]
    InjectedCrash { seq: u64 },
    #[error("the delta stream ends at {last}, but this indexer holds deltas {first} on only: another writer, or deltas lost")]
    Diverged { last: u64, first: u64 },
    #[error("the delta stream's delta {seq} is not the one this indexer made there: another indexer writes the stream")]
    Overwritten { seq: u64 },
    #[error("delta {seq} still refused after retrying for {after:?}: {source}")]
    GaveUp {
        seq: u64,
        after: Duration,
        #[source]
        source: BusError,
    },
}

impl PipelineError {
    /// Whether sending the deltas again may succeed: JetStream refused or
    /// did not confirm (a full store, no stream leader during an election,
    /// a timeout), or did not answer the read of the stream's end that a
    /// resend starts with (its leader being elected), not a rival writer's
    /// fence.
    pub fn retryable(&self) -> bool {
        match self {
            PipelineError::Publish { source, .. } => {
                matches!(source, BusError::Publish { .. }) || source.is_unanswered()
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unanswered_read_of_the_streams_end_is_retried_a_fence_is_not() {
        let publish = |source| PipelineError::Publish { seq: 3, source };
        let unanswered = BusError::Stream {
            stream: "SY_INDEX_DELTAS",
            message: "request error: timed out: request timed out: deadline has elapsed".into(),
        };
        assert!(publish(unanswered).retryable());
        let refused = BusError::Publish {
            subject: "sy.index.deltas".into(),
            message: "timed out: didn't receive ack in time".into(),
        };
        assert!(publish(refused).retryable());
        let missing = BusError::Stream {
            stream: "SY_INDEX_DELTAS",
            message: "stream not found".into(),
        };
        assert!(!publish(missing).retryable());
        assert!(!publish(BusError::Fenced { seq: 3 }).retryable());
    }
}

/// How the pipeline sends refused deltas again: the wait after a refused
/// try, doubled after each next one up to `max_backoff`, for at most
/// `give_up` of refusals in a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub backoff: Duration,
    pub max_backoff: Duration,
    pub give_up: Duration,
}

type Entry = Pin<Box<dyn Future<Output = Result<Confirmed, PipelineError>> + Send>>;
type Resend = Pin<Box<dyn Future<Output = Result<u64, PipelineError>> + Send>>;

/// How long the stream may take to confirm a delta: past it, the deltas
/// it does not hold are sent again in place. A
/// delta sent to a stream leader that died is never confirmed: 30 s here
/// stalled the index for 23 s after a NATS node was killed, and 5 s
/// delayed the resend past the new leader's election (which takes 4-9 s
/// on nats-server 2.9). A false timeout costs only a resend that the
/// stream drops as a duplicate.
const DELTA_ACK_TIMEOUT: Duration = Duration::from_secs(2);
/// Confirmations awaited at once beyond the configured in-flight limit
/// (removals, a fetched chunk's overshoot) before `push` waits for the
/// oldest one.
const IN_FLIGHT_SLACK: usize = 1024;
/// Deltas a try sends before it awaits their confirmations (each holds a
/// permit of the publisher's while unconfirmed).
const RESEND_WINDOW: usize = 256;
/// After a try that went through with deltas left, how long the pipeline
/// waits for a push to send them as it goes before another try does.
const RESUME_WAIT: Duration = Duration::from_millis(20);

/// Delta publishes in flight, confirmed in order; each entry acks its KV
/// message once its delta is confirmed.
///
/// Deltas must reach the server in sequence (each is published expecting
/// the stream to end at the one before), so each is *sent* in turn
/// ([`Pipeline::push`] awaits the send, which only queues the message on
/// the connection) and only the confirmations are awaited concurrently.
/// (Running [`Bus::publish_delta`] futures concurrently does not keep the
/// order: a future woken with a send permit can be overtaken by a newer one
/// that finds capacity free.) A refused delta makes every later one refused
/// too; the first error, in order, is the one reported.
///
/// # Refused deltas
///
/// After a retryable refusal ([`PipelineError::retryable`]: a full store,
/// no stream leader during an election, no confirmation in time) the
/// caller calls [`Pipeline::refuse`], and the pipeline goes on without
/// stopping its caller: the entries in flight complete (their KV messages
/// are acked when their deltas were confirmed; the others' are redelivered
/// later, and the core drops them as duplicates), then [`Pipeline::next`]
/// sends the deltas the stream does not hold again, in order, each
/// expecting the one before (no gap, no delta twice: a delta already stored
/// is also a duplicate by its message id), after a pause that doubles with
/// each refused try. Deltas pushed meanwhile are announced at once and
/// join the next try, and their KV messages' acks wait for it. Once a try
/// leaves nothing unconfirmed, the pipeline is back to sending as it goes.
/// A stream that diverged from this indexer's deltas, a fence (a rival
/// writer), or refusals for longer than `give_up` end it.
pub struct Pipeline {
    bus: Bus,
    publisher: DeltaPublisher,
    entries: FuturesOrdered<Entry>,
    /// The deltas made and not confirmed yet, in order.
    unconfirmed: VecDeque<IndexDelta>,
    capacity: usize,
    crash_after_delta: Option<u64>,
    policy: RetryPolicy,
    refused: Option<Refused>,
    /// The acks of KV messages that made no delta (a duplicate, most often
    /// the stream's copy of a batch applied from its announcement; a
    /// malformed message), pushed while deltas were unconfirmed: each waits
    /// for the last delta made before it (the announced batch's among
    /// them), in order. (An entry of its own would ack at once: the
    /// entries are polled together, only yielded in order.)
    after_deltas: VecDeque<HeldAck>,
}

/// A KV message's ack (if any) waiting for the delta its message made
/// (if any).
struct HeldAck {
    delta: Option<u64>,
    ack: Option<(Acker, AckKind)>,
}

/// A pipeline sending refused deltas again.
struct Refused {
    /// When the first of the refusals in a row came.
    since: Instant,
    /// Whether the last try was refused (not ready), or went through and
    /// its followers are being sent.
    failing: bool,
    backoff: Duration,
    /// The acks of the KV messages pushed meanwhile, in order.
    held: VecDeque<HeldAck>,
    /// The try under way (it owns what it sends: the pipeline takes pushes
    /// meanwhile), or the pause before the next one.
    resend: Option<Resend>,
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Refused {
    /// The last try went through and none is under way: the deltas left
    /// may be sent as they go again ([`Pipeline::resume`]).
    fn resumable(&self) -> bool {
        !self.failing && self.resend.is_none()
    }
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("in_flight", &self.entries.len())
            .field("unconfirmed", &self.unconfirmed.len())
            .field("refused", &self.refused.is_some())
            .finish_non_exhaustive()
    }
}

impl Pipeline {
    /// A pipeline on its own JetStream context over the bus's connection,
    /// with room for `max_in_flight` confirmations (plus some slack).
    pub fn new(
        bus: &Bus,
        max_in_flight: usize,
        crash_after_delta: Option<u64>,
        policy: RetryPolicy,
    ) -> Self {
        let capacity = max_in_flight.max(1) + IN_FLIGHT_SLACK;
        // One permit more than entries can hold: a send never waits for a
        // confirmation only this pipeline would poll.
        let publisher = bus.delta_publisher(capacity + 1, DELTA_ACK_TIMEOUT);
        Self {
            bus: bus.clone(),
            publisher,
            entries: FuturesOrdered::new(),
            unconfirmed: VecDeque::new(),
            capacity,
            crash_after_delta,
            policy,
            refused: None,
            after_deltas: VecDeque::new(),
        }
    }

    /// KV messages waiting for their deltas' confirmation (or to be
    /// acked), or while refused deltas are sent again the unconfirmed
    /// deltas if more: what bounds the intake.
    pub fn len(&self) -> usize {
        let refused = self
            .refused
            .as_ref()
            .map_or(0, |r| r.held.len().max(self.unconfirmed.len()));
        self.entries.len() + refused + self.after_deltas.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0 && self.unconfirmed.is_empty()
    }

    /// Whether the stream refused the last try ([`Pipeline::refuse`]).
    pub fn is_refused(&self) -> bool {
        self.refused.as_ref().is_some_and(|r| r.failing)
    }

    /// Sends `delta` (if any) to the delta stream now, and queues the wait
    /// for its confirmation, after which the KV message (if any) is acked
    /// (`AckKind::Ack`) or terminated (`AckKind::Term`). While refused
    /// deltas are sent again, the delta is announced only and joins the
    /// next try, and the ack waits for it.
    ///
    /// When the pipeline is full, the oldest entry is awaited first and
    /// returned (the caller handles it like one from [`Pipeline::next`]).
    pub async fn push(
        &mut self,
        delta: Option<IndexDelta>,
        ack: Option<(Acker, AckKind)>,
    ) -> Result<Option<Result<Confirmed, PipelineError>>, PipelineError> {
        let resumed = if self.refused.as_ref().is_some_and(Refused::resumable) {
            self.resume().await
        } else {
            Ok(())
        };
        // Refused (again, maybe by the resume just tried): this delta and
        // its ack join the next try all the same.
        if let Some(refused) = &mut self.refused {
            let seq = delta.as_ref().map(|d| d.seq);
            if let Some(delta) = delta {
                self.publisher.announce(&delta).await;
                self.unconfirmed.push_back(delta);
            }
            refused.held.push_back(HeldAck { delta: seq, ack });
            return resumed.map(|()| None);
        }
        resumed?;
        let oldest = if self.entries.len() >= self.capacity {
            self.next().await
        } else {
            None
        };
        let sent = match delta {
            Some(delta) => {
                let sent = self.publisher.send(&delta).await;
                // Held (also when refused at once) to be sent again.
                self.unconfirmed.push_back(delta.clone());
                Some(sent.map_err(|source| PipelineError::Publish {
                    seq: delta.seq,
                    source,
                })?)
            }
            None => None,
        };
        self.push_entry(sent, ack);
        Ok(oldest)
    }

    /// Queues the wait for a sent delta's confirmation (if any), then the
    /// ack of its KV message (if any). An ack without a delta while deltas
    /// are unconfirmed waits for the last of them ([`Pipeline`]'s
    /// `after_deltas`): an entry of its own would ack at once.
    fn push_entry(&mut self, sent: Option<DeltaSent>, ack: Option<(Acker, AckKind)>) {
        if let (None, Some(last)) = (&sent, self.unconfirmed.back()) {
            self.after_deltas.push_back(HeldAck {
                delta: Some(last.seq),
                ack,
            });
            return;
        }
        let crash_after = self.crash_after_delta;
        self.entries.push_back(Box::pin(async move {
            let seq = sent.as_ref().map(DeltaSent::seq);
            if let Some(sent) = sent {
                let seq = sent.seq();
                sent.confirmed()
                    .await
                    .map_err(|source| PipelineError::Publish { seq, source })?;
                if crash_after == Some(seq) {
                    return Err(PipelineError::InjectedCrash { seq });
                }
            }
            if let Some((acker, kind)) = ack {
                ack_one(acker, kind, seq).await;
            }
            Ok(Confirmed { seq })
        }));
    }

    /// After a try went through with deltas left (made while it ran):
    /// sends those as it goes again, each with its held ack, and leaves
    /// the refused state. A send refused at once puts the pipeline back in
    /// it, with the acks not yet moved still held.
    async fn resume(&mut self) -> Result<(), PipelineError> {
        let Some(refused) = self.refused.take() else {
            return Ok(());
        };
        let mut held = refused.held;
        while let Some(next) = held.front() {
            let sent = match next.delta {
                Some(seq) => {
                    let delta = crate::live::delta_at(&self.unconfirmed, seq)
                        .expect("a held delta is unconfirmed");
                    match self.publisher.store(delta).await {
                        Ok(sent) => Some(sent),
                        Err(source) => {
                            self.refuse();
                            if let Some(refused) = &mut self.refused {
                                refused.held = held;
                            }
                            return Err(PipelineError::Publish { seq, source });
                        }
                    }
                }
                None => None,
            };
            let next = held.pop_front().expect("looked at");
            self.push_entry(sent, next.ack);
        }
        Ok(())
    }

    /// Announces every delta the stream has not confirmed again (a router
    /// asked: it missed some); how many.
    pub async fn announce_unconfirmed(&mut self) -> usize {
        self.publisher.announce_all(&self.unconfirmed).await;
        self.unconfirmed.len()
    }

    /// After a retryable refusal: from now on the deltas the stream does
    /// not hold are sent again (see the type's docs). Again while already
    /// doing so: nothing more.
    pub fn refuse(&mut self) {
        if self.refused.is_none() {
            self.refused = Some(Refused {
                since: Instant::now(),
                failing: true,
                backoff: self.policy.backoff,
                held: VecDeque::new(),
                resend: None,
                pause: None,
            });
        }
    }

    /// The next entry to complete, in push order, or the next try at
    /// sending refused deltas: its last confirmed delta, or its refusal
    /// (retryable: the pipeline tries again after a pause); `None` when
    /// there is nothing to wait for. Cancel-safe: a try under way is kept.
    pub async fn next(&mut self) -> Option<Result<Confirmed, PipelineError>> {
        if self.refused.is_none() {
            let done = self.entries.next().await;
            self.confirmed(&done);
            return done;
        }
        // The entries sent before the refusal complete first; their errors
        // (the refusal again, or a later delta refused for not following
        // it) are the refusal's, and the try below finds a real fence.
        while !self.entries.is_empty() {
            let done = self.entries.next().await;
            self.confirmed(&done);
            if let Some(Ok(confirmed)) = done {
                return Some(Ok(confirmed));
            }
        }
        let Self {
            bus,
            publisher,
            unconfirmed,
            policy,
            refused,
            after_deltas,
            ..
        } = self;
        let state = refused.as_mut()?;
        if let Some(pause) = &mut state.pause {
            pause.as_mut().await;
            state.pause = None;
        }
        let announce = state.failing;
        let resend = state.resend.get_or_insert_with(|| {
            Box::pin(send_again(
                bus.clone(),
                publisher.clone(),
                unconfirmed.iter().cloned().collect(),
                announce,
            ))
        });
        let tried = resend.await;
        state.resend = None;
        match tried {
            Ok(last) => {
                forget_through(unconfirmed, last);
                release_acks(after_deltas, last);
                // Give-up counts refusals in a row.
                state.since = Instant::now();
                state.failing = false;
                state.backoff = policy.backoff;
                release_acks(&mut state.held, last);
                if unconfirmed.is_empty() {
                    release_acks(&mut state.held, u64::MAX);
                    *refused = None;
                } else {
                    // Deltas made while the try ran: the next push sends
                    // them as it goes (`resume`); with none, a try does.
                    state.pause = Some(Box::pin(tokio::time::sleep(RESUME_WAIT)));
                }
                Some(Ok(Confirmed { seq: Some(last) }))
            }
            Err(e) if e.retryable() => {
                if state.since.elapsed() >= policy.give_up {
                    let PipelineError::Publish { seq, source } = e else {
                        return Some(Err(e));
                    };
                    return Some(Err(PipelineError::GaveUp {
                        seq,
                        after: state.since.elapsed(),
                        source,
                    }));
                }
                state.failing = true;
                state.pause = Some(Box::pin(tokio::time::sleep(state.backoff)));
                state.backoff = (state.backoff * 2).min(policy.max_backoff);
                Some(Err(e))
            }
            Err(e) => Some(Err(e)),
        }
    }

    /// The next completed entry if it is ready now.
    pub fn try_next(&mut self) -> Option<Result<Confirmed, PipelineError>> {
        futures::FutureExt::now_or_never(self.next()).flatten()
    }

    /// Forgets the deltas a completed entry confirmed, and acks the KV
    /// messages that waited for them.
    fn confirmed(&mut self, done: &Option<Result<Confirmed, PipelineError>>) {
        if let Some(Ok(Confirmed { seq: Some(seq) })) = done {
            forget_through(&mut self.unconfirmed, *seq);
            release_acks(&mut self.after_deltas, *seq);
        }
    }
}

/// Drops the unconfirmed deltas up to `seq`, which the stream now holds.
fn forget_through(unconfirmed: &mut VecDeque<IndexDelta>, seq: u64) {
    while unconfirmed.front().is_some_and(|d| d.seq <= seq) {
        unconfirmed.pop_front();
    }
}

/// Acks a KV message. A lost ack only means a redelivery, which the core
/// drops as a duplicate.
async fn ack_one(acker: Acker, kind: AckKind, delta_seq: Option<u64>) {
    if let Err(e) = acker.ack_with(kind).await {
        tracing::warn!(error = %e, ?delta_seq, "acking a KV message failed");
    }
}

/// Acks, in a task of their own, the held KV messages whose deltas the
/// stream now holds (up to `last`), up to the first whose delta it does
/// not.
fn release_acks(held: &mut VecDeque<HeldAck>, last: u64) {
    let mut acks = Vec::new();
    while held
        .front()
        .is_some_and(|h| h.delta.is_none_or(|seq| seq <= last))
    {
        if let Some(HeldAck {
            delta,
            ack: Some(ack),
        }) = held.pop_front()
        {
            acks.push((delta, ack));
        }
    }
    if !acks.is_empty() {
        tokio::spawn(async move {
            for (seq, (acker, kind)) in acks {
                ack_one(acker, kind, seq).await;
            }
        });
    }
}

/// One try at sending refused deltas again: each announced again first
/// when the try before was refused (for routers that missed an
/// announcement, while the stream cannot give it to them), then the
/// stream's end, checked to be this indexer's own delta when the stream
/// holds some of these, then the deltas after it, in order, each
/// expecting the one before, [`RESEND_WINDOW`] at a time, their
/// confirmations awaited in order (the first error is the cause; those
/// after it only did not follow). Returns the last delta the stream
/// holds.
async fn send_again(
    bus: Bus,
    publisher: DeltaPublisher,
    deltas: Vec<IndexDelta>,
    announce: bool,
) -> Result<u64, PipelineError> {
    if announce {
        publisher.announce_all(&deltas).await;
    }
    let first = deltas.first().map_or(0, |d| d.seq);
    let last = bus
        .last_delta_seq()
        .await
        .map_err(|source| PipelineError::Publish { seq: first, source })?;
    if let (Some(front), Some(back)) = (deltas.first(), deltas.last()) {
        if last > back.seq {
            return Err(PipelineError::Overwritten { seq: back.seq + 1 });
        }
        if last >= front.seq {
            // Stored with a lost confirmation, or another indexer's.
            let ours = &deltas[(last - front.seq) as usize];
            let stored = bus
                .stored_delta(last)
                .await
                .map_err(|source| PipelineError::Publish { seq: last, source })?;
            if stored != ours.encode() {
                return Err(PipelineError::Overwritten { seq: last });
            }
        } else if front.seq != last + 1 {
            return Err(PipelineError::Diverged {
                last,
                first: front.seq,
            });
        }
    }
    let after: Vec<&IndexDelta> = deltas.iter().filter(|d| d.seq > last).collect();
    let mut confirmed = last;
    for window in after.chunks(RESEND_WINDOW) {
        let mut sent = Vec::with_capacity(window.len());
        for delta in window {
            let seq = delta.seq;
            sent.push(
                publisher
                    .store(delta)
                    .await
                    .map_err(|source| PipelineError::Publish { seq, source })?,
            );
        }
        for sent in sent {
            let seq = sent.seq();
            sent.confirmed()
                .await
                .map_err(|source| PipelineError::Publish { seq, source })?;
            confirmed = seq;
        }
    }
    Ok(confirmed)
}
