//! [`KvCore`]: one worker's KV batches from the engine's events to
//! acknowledged JetStream messages, without IO. The shell feeds it
//! [`Input`]s with the time ([`KvCore::step`]) and carries out the
//! [`Effect`]s it returns, in order.
//!
//! - Batches are formed and numbered by the [`KvOutbox`]: `seq` gap-free
//!   from 0 within an epoch, every epoch's first batch starting with
//!   `Cleared`, a resync's first batch holding the whole block set.
//! - Every batch is announced on core NATS as it is formed
//!   ([`Effect::Announce`]): the indexer may apply it before JetStream
//!   stores it, so a stream without a leader (an election, a full store)
//!   does not leave the index behind the engine. The stream stays the
//!   record.
//! - One publish is in flight at a time. An unacknowledged batch is
//!   published again unchanged (the same message id) after a backoff
//!   ([`Backoff`]), until acknowledged or superseded by a new epoch.
//! - Batches are formed when there is none to publish (events that come
//!   while one is in flight join the next batch), or at every step while
//!   the stream does not take them (a publish failed, or has been in
//!   flight for [`stall_after`]: four times the usual acknowledgement,
//!   within [`MIN_STALL`]..[`MAX_STALL`]) or while a backlog of formed
//!   batches drains: then they are announced as they are formed and queue
//!   behind, in order, one batch per [`linger`] at most (the usual
//!   acknowledgement, within [`MIN_LINGER`]..[`MAX_LINGER`]): a stream that
//!   is only slow gets batches as large as before, one per round trip, not
//!   one per engine message, which one publish at a time would not drain.
//! - A resync (asked for on the resync subject, or forced by a queue
//!   overflow) asks the engine for its block set once, however many ask
//!   meanwhile; the block set starts a new epoch, and whoever asked gets a
//!   [`ResyncReply`] once that epoch's first batch is acknowledged.
//!
//! The shell's clock is a parameter: `now` is the time since the shell's
//! origin, and the first epoch is the shell's: its wall clock (ms) at that
//! origin, raised above every epoch etcd recorded for the worker (a clock
//! that went back), so that a later epoch (the first epoch plus `now`, or
//! one more than the current epoch) is also later than any epoch of an
//! earlier run of the agent.

use std::mem;
use std::time::Duration;

use protocol::{subjects, KvEvent, KvEventBatch, ResyncReply, WorkerId};

use super::backoff::Backoff;
use super::outbox::{KvOutbox, OutboxLimits, Pushed};

/// A publish in flight for [`stall_after`] means the stream is not taking
/// batches for now: new events are formed into batches and announced at
/// once instead of waiting for its acknowledgement. At least this long...
pub const MIN_STALL: Duration = Duration::from_millis(100);
/// ...and at most this long.
pub const MAX_STALL: Duration = Duration::from_secs(1);

/// While batches are formed ahead of the publish in flight, at least this
/// long between two...
pub const MIN_LINGER: Duration = Duration::from_millis(20);
/// ...and at most this long.
pub const MAX_LINGER: Duration = Duration::from_millis(250);

/// How long events wait to join a batch formed ahead of the publish in
/// flight: the usual acknowledgement (`ack_ms`), within
/// [`MIN_LINGER`]..[`MAX_LINGER`].
pub fn linger(ack_ms: Option<f64>) -> Duration {
    usual_ack(ack_ms).clamp(MIN_LINGER, MAX_LINGER)
}

/// The usual acknowledgement (`ack_ms`; none yet: zero).
fn usual_ack(ack_ms: Option<f64>) -> Duration {
    Duration::from_secs_f64(ack_ms.unwrap_or(0.0).max(0.0) / 1000.0)
}

/// Acknowledged batches of the current epoch kept to be announced again
/// ([`Input::ReannounceRequested`]): an indexer that missed announcements
/// while its connection moved (a second or two) gets them from the agents
/// rather than waiting for a stream that may be electing its leader.
/// (Epochs' first batches are not kept: an announced new epoch is left to
/// the stream anyway.)
pub const RECENT_BATCHES: usize = 256;

/// Batches announced again for one request at most (the oldest the indexer
/// lacks first): the shell's announce queue takes 1024, and the indexer
/// asks again for what follows.
pub const REANNOUNCE_MAX: usize = 512;

/// How long a publish may be in flight before the stream counts as
/// stalled: four times the usual acknowledgement (`ack_ms`, a moving
/// average; none yet: [`MIN_STALL`]), within [`MIN_STALL`]..[`MAX_STALL`].
pub fn stall_after(ack_ms: Option<f64>) -> Duration {
    (usual_ack(ack_ms) * 4).clamp(MIN_STALL, MAX_STALL)
}

/// What happens to the KV pipeline. `R` names where a resync reply goes
/// (the shell's reply subject).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input<R> {
    /// The engine's canonical KV events, in its order.
    EngineEvents(Vec<KvEvent>),
    /// The engine's whole block set (`Stored` events only, each parent
    /// before its children), asked for with [`Effect::RequestBlockSet`] or
    /// not: a new epoch starts from it.
    BlockSet(Vec<KvEvent>),
    /// JetStream acknowledged batch `(epoch, seq)`; `duplicate`: it had
    /// stored it already (a publish again after a lost acknowledgement).
    Acked {
        /// The batch's epoch.
        epoch: u64,
        /// The batch's seq.
        seq: u64,
        /// JetStream had the message id already.
        duplicate: bool,
    },
    /// Publishing batch `(epoch, seq)` failed.
    PublishFailed {
        /// The batch's epoch.
        epoch: u64,
        /// The batch's seq.
        seq: u64,
        /// Why, for the log.
        error: String,
    },
    /// Someone asked for a resync; `reply`: where to answer.
    ResyncRequested {
        /// Where the [`ResyncReply`] goes, if anywhere.
        reply: Option<R>,
    },
    /// The indexer missed announcements (it saw a gap after `after_seq` of
    /// `epoch`): announce the batches of that epoch after it again,
    /// acknowledged ([`RECENT_BATCHES`] kept) or not, in order, at most
    /// [`REANNOUNCE_MAX`].
    ReannounceRequested {
        /// The epoch the indexer holds.
        epoch: u64,
        /// Its last seq of that epoch.
        after_seq: u64,
    },
    /// Time passed: a retry asked for with [`Effect::RetryAt`] may be due.
    Tick,
}

/// What the shell does for the core, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect<R> {
    /// Publish `batch` under `message_id` (JetStream drops a second message
    /// with the same id) and report [`Input::Acked`] or
    /// [`Input::PublishFailed`]. Never given while another publish is in
    /// flight (one ended, or [`Effect::CancelPublish`] came first).
    Publish {
        /// The batch, numbered.
        batch: KvEventBatch,
        /// Its JetStream message id ([`subjects::kv_batch_msg_id`]).
        message_id: String,
    },
    /// Announce `batch` on core NATS, fire and forget (before its
    /// [`Effect::Publish`]): the indexer may apply it ahead of the stream.
    Announce(KvEventBatch),
    /// Drop the publish in flight: a new epoch or an overflow superseded
    /// its batch, and its outcome no longer matters.
    CancelPublish,
    /// Step the core ([`Input::Tick`]) at this time: a retry is due then.
    RetryAt(Duration),
    /// Ask the engine for its block set ([`Input::BlockSet`] when it comes).
    RequestBlockSet,
    /// Send `reply` to `to`: the resync it asked for is in the stream.
    Reply {
        /// Who asked.
        to: R,
        /// The new epoch and the size of its block set.
        reply: ResyncReply,
    },
    /// Something to count and log.
    Note(Note),
}

/// What the shell counts and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// A batch was acknowledged.
    Published {
        /// The batch's epoch.
        epoch: u64,
        /// The batch's seq.
        seq: u64,
        /// Events in the batch.
        events: usize,
        /// Block events in it ([`KvEventBatch::block_events`]).
        blocks: u64,
        /// JetStream had stored it already.
        duplicate: bool,
        /// Failed publishes before this one (0: the first try).
        after_failures: u32,
    },
    /// A publish failed: the same batch goes again after a backoff.
    PublishFailed {
        /// The batch's epoch.
        epoch: u64,
        /// The batch's seq.
        seq: u64,
        /// Failures in a row, this one included.
        failures: u32,
        /// Events held for publishing.
        held_events: usize,
        /// Why.
        error: String,
    },
    /// The queue passed half of its bound (noted once until it drains).
    QueueFilling {
        /// Events held for publishing.
        held_events: usize,
        /// The bound.
        max_queued_events: usize,
        /// Failures in a row of the batch in flight.
        failures: u32,
    },
    /// The queue is below a quarter of its bound again.
    QueueDrained {
        /// Events held for publishing.
        held_events: usize,
    },
    /// The queue overflowed and was dropped; a resync follows.
    Overflowed {
        /// The epoch whose events were dropped.
        epoch: u64,
        /// Failures in a row of the batch that was in flight.
        failures: u32,
    },
    /// A new epoch started from the engine's block set.
    NewEpoch {
        /// The new epoch.
        epoch: u64,
        /// Blocks in the block set.
        blocks: u64,
        /// Why.
        reason: ResyncReason,
    },
}

/// Why a new epoch started from the engine's block set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncReason {
    /// Someone asked on the resync subject.
    Request,
    /// The queue overflowed while NATS did not acknowledge.
    Overflow,
    /// The engine sent its block set unasked (its own new epoch).
    Engine,
}

impl ResyncReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ResyncReason::Request => "request",
            ResyncReason::Overflow => "overflow",
            ResyncReason::Engine => "engine",
        }
    }
}

/// Where the batch being published is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sending {
    /// Nothing in flight: the next batch goes at once.
    Idle,
    /// Batch `(epoch, seq)` is being published, since `since`.
    InFlight {
        epoch: u64,
        seq: u64,
        since: Duration,
    },
    /// The last publish failed: the batch goes again at this time.
    RetryAt(Duration),
}

/// The resync replies owed for `epoch`, sent once its first batch (the
/// block set) is acknowledged.
#[derive(Debug)]
struct Owed<R> {
    epoch: u64,
    blocks: u64,
    to: Vec<R>,
}

/// One worker's KV pipeline. See the module documentation.
#[derive(Debug)]
pub struct KvCore<R> {
    outbox: KvOutbox,
    limits: OutboxLimits,
    first_epoch: u64,
    backoff: Backoff,
    sending: Sending,
    /// Failed publishes in a row of the current batch.
    failures: u32,
    /// A block set was asked of the engine, for this reason.
    resync_requested: Option<ResyncReason>,
    /// Who asked for a resync whose block set has not come yet.
    waiting: Vec<R>,
    owed: Option<Owed<R>>,
    /// The queue passed half of its bound (noted once).
    queue_filling: bool,
    /// Moving average of the time to an acknowledgement (ms).
    ack_ms: Option<f64>,
    /// When the last batch was formed.
    last_formed: Duration,
    /// The last acknowledged batches of the epoch ([`RECENT_BATCHES`]).
    recent: std::collections::VecDeque<KvEventBatch>,
    effects: Vec<Effect<R>>,
}

impl<R> KvCore<R> {
    /// A pipeline starting `first_epoch` (the shell's wall clock in ms at
    /// its time origin); its first batch starts with `Cleared` and goes at
    /// the first step.
    pub fn new(worker: WorkerId, first_epoch: u64, limits: OutboxLimits, backoff: Backoff) -> Self {
        Self {
            outbox: KvOutbox::new(worker, first_epoch, limits),
            limits,
            first_epoch,
            backoff,
            sending: Sending::Idle,
            failures: 0,
            resync_requested: None,
            waiting: Vec::new(),
            owed: None,
            queue_filling: false,
            ack_ms: None,
            last_formed: Duration::ZERO,
            recent: std::collections::VecDeque::new(),
            effects: Vec::new(),
        }
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.outbox.epoch()
    }

    /// Events held for publishing (queued and in the batch in flight).
    pub fn held_events(&self) -> usize {
        self.outbox.held_events()
    }

    /// Failed publishes in a row of the current batch.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Takes `input` at time `now` (since the shell's origin, never going
    /// back) and returns what to do, in order.
    pub fn step(&mut self, input: Input<R>, now: Duration) -> Vec<Effect<R>> {
        match input {
            Input::EngineEvents(events) => self.on_events(events),
            Input::BlockSet(set) => self.on_block_set(set, now),
            Input::Acked {
                epoch,
                seq,
                duplicate,
            } => self.on_acked(epoch, seq, duplicate, now),
            Input::PublishFailed { epoch, seq, error } => self.on_failed(epoch, seq, error, now),
            Input::ReannounceRequested { epoch, after_seq } => self.reannounce(epoch, after_seq),
            Input::ResyncRequested { reply } => {
                self.waiting.extend(reply);
                self.request_resync(ResyncReason::Request);
            }
            Input::Tick => {}
        }
        self.pump(now);
        mem::take(&mut self.effects)
    }

    fn note(&mut self, note: Note) {
        self.effects.push(Effect::Note(note));
    }

    fn on_events(&mut self, events: Vec<KvEvent>) {
        match self.outbox.push(events) {
            Pushed::Queued => self.watch_queue(),
            Pushed::AwaitingResync => {}
            Pushed::Overflowed => {
                self.note(Note::Overflowed {
                    epoch: self.outbox.epoch(),
                    failures: self.failures,
                });
                self.drop_publish();
                self.queue_filling = false;
                self.request_resync(ResyncReason::Overflow);
            }
        }
    }

    /// Notes once when the queue fills past half of its bound.
    fn watch_queue(&mut self) {
        let held = self.outbox.held_events();
        let max = self.limits.max_queued_events;
        if !self.queue_filling && held >= max / 2 {
            self.queue_filling = true;
            self.note(Note::QueueFilling {
                held_events: held,
                max_queued_events: max,
                failures: self.failures,
            });
        }
    }

    fn request_resync(&mut self, reason: ResyncReason) {
        if self.resync_requested.is_none() {
            self.resync_requested = Some(reason);
            self.effects.push(Effect::RequestBlockSet);
        }
    }

    /// The batch in flight, or waiting for its retry, is superseded.
    fn drop_publish(&mut self) {
        if matches!(self.sending, Sending::InFlight { .. }) {
            self.effects.push(Effect::CancelPublish);
        }
        self.sending = Sending::Idle;
    }

    /// The engine's block set came: a new epoch starts from it, and it
    /// answers every resync asked for until now.
    fn on_block_set(&mut self, set: Vec<KvEvent>, now: Duration) {
        let reason = self.resync_requested.take().unwrap_or(ResyncReason::Engine);
        let blocks = stored_blocks(&set);
        let now_ms = u64::try_from(now.as_millis()).unwrap_or(u64::MAX);
        let epoch = self
            .outbox
            .start_next_epoch(self.first_epoch.saturating_add(now_ms), set);
        self.drop_publish();
        self.failures = 0;
        self.note(Note::NewEpoch {
            epoch,
            blocks,
            reason,
        });
        if let Some(first) = self.outbox.front() {
            self.effects.push(Effect::Announce(first.clone()));
        }
        // Replies owed for an older epoch are answered by this one.
        let mut to = mem::take(&mut self.waiting);
        if let Some(older) = self.owed.take() {
            to.extend(older.to);
        }
        self.owed = Some(Owed { epoch, blocks, to });
    }

    /// Whether batch `(epoch, seq)` is the one in flight.
    fn in_flight(&self, epoch: u64, seq: u64) -> bool {
        matches!(self.sending, Sending::InFlight { epoch: e, seq: s, .. } if (e, s) == (epoch, seq))
    }

    fn on_acked(&mut self, epoch: u64, seq: u64, duplicate: bool, now: Duration) {
        if !self.in_flight(epoch, seq) {
            // A superseded publish: its batch is gone.
            return;
        }
        if let Sending::InFlight { since, .. } = self.sending {
            let took = now.saturating_sub(since).as_secs_f64() * 1000.0;
            self.ack_ms = Some(self.ack_ms.map_or(took, |avg| 0.8 * avg + 0.2 * took));
        }
        self.sending = Sending::Idle;
        let Some(batch) = self.outbox.acked(epoch, seq) else {
            return;
        };
        let (events, blocks) = (batch.events.len(), batch.block_events() as u64);
        self.keep_recent(batch);
        let after_failures = mem::take(&mut self.failures);
        self.note(Note::Published {
            epoch,
            seq,
            events,
            blocks,
            duplicate,
            after_failures,
        });
        let held = self.outbox.held_events();
        if self.queue_filling && held < self.limits.max_queued_events / 4 {
            self.queue_filling = false;
            self.note(Note::QueueDrained { held_events: held });
        }
        if seq == 0 {
            self.send_owed_replies(epoch);
        }
    }

    fn on_failed(&mut self, epoch: u64, seq: u64, error: String, now: Duration) {
        if !self.in_flight(epoch, seq) {
            return;
        }
        self.failures += 1;
        let at = now.saturating_add(self.backoff.delay(self.failures));
        self.sending = Sending::RetryAt(at);
        self.note(Note::PublishFailed {
            epoch,
            seq,
            failures: self.failures,
            held_events: self.outbox.held_events(),
            error,
        });
        self.effects.push(Effect::RetryAt(at));
    }

    /// Keeps an acknowledged batch to announce again on request (not an
    /// epoch's first: see [`RECENT_BATCHES`]).
    fn keep_recent(&mut self, batch: KvEventBatch) {
        if self.recent.back().is_some_and(|b| b.epoch != batch.epoch) {
            self.recent.clear();
        }
        if batch.seq == 0 {
            return;
        }
        if self.recent.len() == RECENT_BATCHES {
            self.recent.pop_front();
        }
        self.recent.push_back(batch);
    }

    /// Announces again the batches of `epoch` after `after_seq`,
    /// acknowledged (the recent ones) and formed, in order, at most
    /// [`REANNOUNCE_MAX`] (none when `epoch` is not the current one).
    fn reannounce(&mut self, epoch: u64, after_seq: u64) {
        if epoch != self.outbox.epoch() {
            return;
        }
        let batches = self
            .recent
            .iter()
            .chain(self.outbox.formed_batches())
            .filter(|b| b.epoch == epoch && b.seq > after_seq)
            .take(REANNOUNCE_MAX)
            .cloned()
            .collect::<Vec<_>>();
        self.effects
            .extend(batches.into_iter().map(Effect::Announce));
    }

    /// The first batch of `epoch` is in the stream: answer who asked.
    fn send_owed_replies(&mut self, epoch: u64) {
        let Some(owed) = self.owed.take_if(|o| o.epoch == epoch) else {
            return;
        };
        for to in owed.to {
            let reply = ResyncReply {
                worker: self.outbox.worker().clone(),
                epoch,
                blocks: owed.blocks,
            };
            self.effects.push(Effect::Reply { to, reply });
        }
    }

    /// Forms (and announces) batches when due, then publishes the front
    /// one if nothing is in flight and no retry is still waiting.
    fn pump(&mut self, now: Duration) {
        let stall = stall_after(self.ack_ms);
        let ahead = self.failures > 0
            || self.outbox.formed() > 1
            || matches!(self.sending, Sending::InFlight { since, .. } if now.saturating_sub(since) >= stall);
        let due = now.saturating_sub(self.last_formed) >= linger(self.ack_ms);
        if self.outbox.front().is_none() || (ahead && due) {
            while let Some(batch) = self.outbox.form() {
                self.effects.push(Effect::Announce(batch.clone()));
                self.last_formed = now;
            }
        }
        match self.sending {
            Sending::InFlight { .. } => return,
            Sending::RetryAt(at) if now < at => return,
            Sending::RetryAt(_) | Sending::Idle => {}
        }
        let Some(batch) = self.outbox.front() else {
            self.sending = Sending::Idle;
            return;
        };
        let batch = batch.clone();
        self.sending = Sending::InFlight {
            epoch: batch.epoch,
            seq: batch.seq,
            since: now,
        };
        let message_id = subjects::kv_batch_msg_id(&batch.worker, batch.epoch, batch.seq);
        self.effects.push(Effect::Publish { batch, message_id });
    }
}

/// Blocks in a block set's `Stored` events.
fn stored_blocks(set: &[KvEvent]) -> u64 {
    set.iter()
        .map(|e| match e {
            KvEvent::Stored { blocks, .. } => blocks.len() as u64,
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use protocol::{BlockHash, Tier};

    use super::*;

    const LIMITS: OutboxLimits = OutboxLimits {
        max_queued_events: 100,
        max_batch_events: 8,
    };

    fn worker() -> WorkerId {
        WorkerId::new("w", 0).unwrap()
    }

    fn core(first_epoch: u64, limits: OutboxLimits) -> KvCore<&'static str> {
        KvCore::new(worker(), first_epoch, limits, Backoff::AGENT)
    }

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn stored(v: u64) -> KvEvent {
        KvEvent::Stored {
            parent: None,
            blocks: vec![BlockHash(v)],
            tier: Tier::Device,
        }
    }

    fn publish(epoch: u64, seq: u64, events: Vec<KvEvent>) -> Effect<&'static str> {
        Effect::Publish {
            batch: KvEventBatch {
                worker: worker(),
                epoch,
                seq,
                events,
            },
            message_id: subjects::kv_batch_msg_id(&worker(), epoch, seq),
        }
    }

    /// A batch formed now: announced, then published.
    fn sent(epoch: u64, seq: u64, events: Vec<KvEvent>) -> Vec<Effect<&'static str>> {
        let Effect::Publish { batch, .. } = publish(epoch, seq, events) else {
            unreachable!()
        };
        vec![
            Effect::Announce(batch.clone()),
            publish(epoch, seq, batch.events),
        ]
    }

    fn announced(effects: &[Effect<&'static str>]) -> Vec<(u64, u64)> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Announce(batch) => Some((batch.epoch, batch.seq)),
                _ => None,
            })
            .collect()
    }

    fn acked(epoch: u64, seq: u64) -> Input<&'static str> {
        Input::Acked {
            epoch,
            seq,
            duplicate: false,
        }
    }

    fn published(effects: &[Effect<&'static str>]) -> Vec<(u64, u64)> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Publish { batch, .. } => Some((batch.epoch, batch.seq)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn batches_go_one_at_a_time_numbered_from_the_cleared_one() {
        let mut c = core(7, LIMITS);
        assert_eq!(
            c.step(Input::Tick, ms(0)),
            sent(7, 0, vec![KvEvent::Cleared])
        );
        // In flight: the events wait (to join one batch).
        assert_eq!(
            c.step(Input::EngineEvents(vec![stored(1), stored(2)]), ms(1)),
            vec![]
        );
        assert_eq!(c.held_events(), 3);
        let effects = c.step(acked(7, 0), ms(2));
        let mut expected = vec![Effect::Note(Note::Published {
            epoch: 7,
            seq: 0,
            events: 1,
            blocks: 0,
            duplicate: false,
            after_failures: 0,
        })];
        expected.extend(sent(7, 1, vec![stored(1), stored(2)]));
        assert_eq!(effects, expected);
        assert_eq!(published(&c.step(acked(7, 1), ms(3))), vec![]);
        assert_eq!(c.held_events(), 0);
    }

    #[test]
    fn a_failed_batch_goes_again_unchanged_after_its_backoff() {
        let mut c = core(7, LIMITS);
        let first = c.step(Input::EngineEvents(vec![stored(1)]), ms(0));
        assert_eq!(first, sent(7, 0, vec![KvEvent::Cleared, stored(1)]));
        let failed = c.step(
            Input::PublishFailed {
                epoch: 7,
                seq: 0,
                error: "timed out".into(),
            },
            ms(10),
        );
        assert_eq!(
            failed,
            vec![
                Effect::Note(Note::PublishFailed {
                    epoch: 7,
                    seq: 0,
                    failures: 1,
                    held_events: 2,
                    error: "timed out".into(),
                }),
                Effect::RetryAt(ms(60)),
            ]
        );
        // Not before its time, whatever else happens; meanwhile new
        // events are formed and announced at once (the stream does not
        // take them).
        assert_eq!(
            c.step(Input::EngineEvents(vec![stored(2)]), ms(59)),
            sent(7, 1, vec![stored(2)])[..1]
        );
        assert_eq!(
            c.step(Input::Tick, ms(60)),
            first[1..],
            "the same batch, the same id, not announced again"
        );
        let again = c.step(
            Input::PublishFailed {
                epoch: 7,
                seq: 0,
                error: "timed out".into(),
            },
            ms(70),
        );
        assert_eq!(again.last(), Some(&Effect::RetryAt(ms(170))), "doubled");
        assert_eq!(published(&c.step(Input::Tick, ms(170))), vec![(7, 0)]);
        let effects = c.step(acked(7, 0), ms(171));
        assert!(matches!(
            effects[0],
            Effect::Note(Note::Published {
                after_failures: 2,
                ..
            })
        ));
        assert_eq!(published(&effects), vec![(7, 1)]);
        assert_eq!(c.failures(), 0);
    }

    #[test]
    fn resyncs_share_one_block_set_and_are_answered_after_its_first_batch() {
        let mut c = core(1_000, LIMITS);
        c.step(Input::EngineEvents(vec![stored(1)]), ms(0));
        assert_eq!(
            c.step(Input::ResyncRequested { reply: Some("a") }, ms(1)),
            vec![Effect::RequestBlockSet]
        );
        assert_eq!(
            c.step(Input::ResyncRequested { reply: Some("b") }, ms(2)),
            vec![],
            "asked once"
        );
        c.step(Input::ResyncRequested { reply: None }, ms(3));
        let set = vec![stored(1), stored(2)];
        let effects = c.step(Input::BlockSet(set.clone()), ms(5));
        let mut expected = vec![
            Effect::CancelPublish,
            Effect::Note(Note::NewEpoch {
                epoch: 1_005,
                blocks: 2,
                reason: ResyncReason::Request,
            }),
        ];
        expected.extend(sent(1_005, 0, vec![KvEvent::Cleared, stored(1), stored(2)]));
        assert_eq!(effects, expected);
        // The old epoch's acknowledgement comes late: ignored.
        assert_eq!(c.step(acked(1_000, 0), ms(6)), vec![]);
        c.step(Input::EngineEvents(vec![stored(3)]), ms(7));
        let effects = c.step(acked(1_005, 0), ms(8));
        let replies: Vec<_> = effects
            .iter()
            .filter_map(|e| match e {
                Effect::Reply { to, reply } => Some((*to, reply.epoch, reply.blocks)),
                _ => None,
            })
            .collect();
        assert_eq!(replies, vec![("a", 1_005, 2), ("b", 1_005, 2)]);
        assert_eq!(published(&effects), vec![(1_005, 1)]);
        let later = c.step(acked(1_005, 1), ms(9));
        assert!(
            !later.iter().any(|e| matches!(e, Effect::Reply { .. })),
            "answered once"
        );
    }

    #[test]
    fn an_overflow_drops_the_queue_and_resyncs_from_the_block_set() {
        let mut c = core(
            1_000,
            OutboxLimits {
                max_queued_events: 2,
                max_batch_events: 8,
            },
        );
        c.step(Input::Tick, ms(0));
        let effects = c.step(
            Input::EngineEvents(vec![stored(1), stored(2), stored(3)]),
            ms(1),
        );
        assert_eq!(
            effects,
            vec![
                Effect::Note(Note::Overflowed {
                    epoch: 1_000,
                    failures: 0,
                }),
                Effect::CancelPublish,
                Effect::RequestBlockSet,
            ]
        );
        assert_eq!(c.held_events(), 0);
        // Covered by the block set to come.
        assert_eq!(c.step(Input::EngineEvents(vec![stored(4)]), ms(2)), vec![]);
        assert_eq!(
            c.step(Input::ResyncRequested { reply: None }, ms(2)),
            vec![]
        );
        let set: Vec<KvEvent> = (1..=4).map(stored).collect();
        let effects = c.step(Input::BlockSet(set), ms(3));
        assert_eq!(
            effects[0],
            Effect::Note(Note::NewEpoch {
                epoch: 1_003,
                blocks: 4,
                reason: ResyncReason::Overflow,
            })
        );
        assert_eq!(published(&effects), vec![(1_003, 0)]);
    }

    #[test]
    fn a_new_epoch_is_the_clock_or_one_more_than_the_last() {
        let mut c = core(1_000, LIMITS);
        let epochs: Vec<u64> = [ms(0), ms(0), ms(40)]
            .into_iter()
            .map(|now| {
                c.step(Input::BlockSet(vec![]), now);
                c.epoch()
            })
            .collect();
        assert_eq!(epochs, vec![1_001, 1_002, 1_040]);
        // The first batch of the last epoch was in flight.
        let effects = c.step(Input::BlockSet(vec![]), ms(41));
        assert_eq!(effects[0], Effect::CancelPublish);
        assert!(matches!(
            effects[1],
            Effect::Note(Note::NewEpoch {
                reason: ResyncReason::Engine,
                ..
            })
        ));
    }

    #[test]
    fn a_publish_in_flight_too_long_lets_new_batches_be_announced_in_order() {
        let mut c = core(7, LIMITS);
        c.step(Input::Tick, ms(0));
        // In flight for less than MIN_STALL (no acknowledgement yet to
        // learn from): the events wait.
        assert_eq!(c.step(Input::EngineEvents(vec![stored(1)]), ms(50)), vec![]);
        let at = ms(0) + MIN_STALL;
        assert_eq!(
            c.step(Input::EngineEvents(vec![stored(2)]), at),
            sent(7, 1, vec![stored(1), stored(2)])[..1],
            "formed and announced, not published: one publish in flight"
        );
        // Within MIN_LINGER of that batch, events wait to join the next.
        assert_eq!(
            c.step(Input::EngineEvents(vec![stored(3)]), at + ms(1)),
            vec![]
        );
        let third = c.step(Input::EngineEvents(vec![stored(4)]), at + MIN_LINGER);
        assert_eq!(announced(&third), vec![(7, 2)]);
        assert_eq!(c.held_events(), 5);
        // The stream takes them again: published in order, not announced
        // again.
        let at = at + MIN_LINGER;
        let effects = c.step(acked(7, 0), at + ms(1));
        assert_eq!(
            (published(&effects), announced(&effects)),
            (vec![(7, 1)], vec![])
        );
        let effects = c.step(acked(7, 1), at + ms(2));
        assert_eq!(published(&effects), vec![(7, 2)]);
        c.step(acked(7, 2), at + ms(3));
        assert_eq!(c.held_events(), 0);
        // Quick again: events wait for the publish in flight.
        assert_eq!(
            announced(&c.step(Input::EngineEvents(vec![stored(5)]), at + ms(4))),
            vec![(7, 3)]
        );
        assert_eq!(
            c.step(Input::EngineEvents(vec![stored(6)]), at + ms(5)),
            vec![]
        );
    }

    #[test]
    fn a_slow_stream_keeps_its_batches_large() {
        let mut c = core(7, LIMITS);
        let mut now = ms(0);
        c.step(Input::Tick, now);
        // Every acknowledgement takes 150 ms, an engine message comes
        // every 30 ms: the agent learns the round trip, and forms about
        // one batch per round trip, which one publish at a time drains.
        let mut next = (7, 0);
        let mut sizes = Vec::new();
        for round in 0..40u64 {
            for k in 0..5 {
                now += ms(30);
                let effects = c.step(Input::EngineEvents(vec![stored(round * 5 + k)]), now);
                for effect in effects {
                    if let Effect::Announce(batch) = effect {
                        sizes.push(batch.events.len());
                    }
                }
            }
            let effects = c.step(acked(next.0, next.1), now);
            let sent = published(&effects);
            assert_eq!(sent.len(), 1, "round {round}");
            next = sent[0];
        }
        assert!(stall_after(c.ack_ms) >= ms(600), "{:?}", c.ack_ms);
        assert!(
            sizes[4..].iter().all(|n| *n >= 4),
            "batches of a round trip's events: {sizes:?}"
        );
        assert!(
            c.held_events() <= 15,
            "the backlog stays bounded: {}",
            c.held_events()
        );
    }

    #[test]
    fn a_reannounce_request_announces_the_recent_batches_again_in_order() {
        let mut c = core(7, LIMITS);
        c.step(Input::Tick, ms(0));
        c.step(Input::EngineEvents(vec![stored(1)]), ms(1));
        c.step(acked(7, 0), ms(2));
        c.step(acked(7, 1), ms(3));
        c.step(Input::EngineEvents(vec![stored(2)]), ms(4));
        // (7, 2) in flight; more waits.
        c.step(Input::EngineEvents(vec![stored(3)]), ms(5));
        let again = |epoch, after_seq| Input::ReannounceRequested { epoch, after_seq };
        assert_eq!(
            announced(&c.step(again(7, 0), ms(6))),
            vec![(7, 1), (7, 2)],
            "the acknowledged and the formed, not the unformed"
        );
        assert_eq!(
            announced(&c.step(again(7, 1), ms(6))),
            vec![(7, 2)],
            "after 1"
        );
        assert_eq!(
            announced(&c.step(again(6, 0), ms(6))),
            vec![],
            "another epoch"
        );
        // A new epoch forgets the old one's.
        c.step(Input::BlockSet(vec![stored(1)]), ms(7));
        let epoch = c.epoch();
        assert_eq!(announced(&c.step(again(7, 0), ms(8))), vec![]);
        assert_eq!(announced(&c.step(again(epoch, 0), ms(8))), vec![]);
    }
}
