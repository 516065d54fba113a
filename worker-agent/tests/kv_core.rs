//! Property tests of the agent's KV core: random interleavings of engine
//! events, acknowledgements, failures, time, overflows, resync requests
//! and block sets, driven by a model shell that checks every effect, then
//! drained. Invariants: one publish in flight; within an epoch the stream
//! holds seqs 0, 1, 2, ... and each epoch's first batch starts with
//! `Cleared`; a resync's first batch is `Cleared` plus the whole block
//! set; an unacknowledged batch goes again unchanged (same message id),
//! never before its backoff; the block set is asked for once at a time;
//! every resync reply is sent exactly once, after the epoch it names is
//! acknowledged, for a block set that came after the request; every batch
//! is announced once, before its first publish and as it is published,
//! the announcements of an epoch numbered 0, 1, 2, ...; and the
//! acknowledged stream replays to exactly the engine's blocks.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use proptest::prelude::*;
use protocol::{subjects, BlockHash, KvEvent, KvEventBatch, Tier, WorkerId};
use worker_agent::core::{Backoff, Effect, Input, KvCore, Note, OutboxLimits};

const FIRST_EPOCH: u64 = 1_000;

#[derive(Debug, Clone)]
enum Op {
    /// The engine stores `stores` new blocks and evicts up to `removes`.
    Events { stores: u8, removes: u8 },
    /// JetStream acknowledges the publish in flight.
    Ack { duplicate: bool },
    /// The publish in flight fails.
    Fail,
    /// Time passes; a retry that falls due fires.
    Advance { ms: u16 },
    /// A step with nothing new (and no retry due, perhaps).
    Tick,
    /// A resync request, answered or not.
    Resync { reply: bool },
    /// The engine answers the block-set request it owes, if any.
    DeliverBlockSet,
    /// The engine sends its block set unasked.
    UnaskedBlockSet,
    /// An acknowledgement of a batch not in flight (a superseded one).
    StaleAck { back: u8 },
    /// The indexer asks for the batches after `after` again.
    Reannounce { after: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..4, 0u8..3).prop_map(|(stores, removes)| Op::Events { stores, removes }),
        5 => any::<bool>().prop_map(|duplicate| Op::Ack { duplicate }),
        3 => Just(Op::Fail),
        3 => (0u16..3_000).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Tick),
        2 => any::<bool>().prop_map(|reply| Op::Resync { reply }),
        3 => Just(Op::DeliverBlockSet),
        1 => Just(Op::UnaskedBlockSet),
        1 => (0u8..4).prop_map(|back| Op::StaleAck { back }),
        1 => (0u8..6).prop_map(|after| Op::Reannounce { after }),
    ]
}

fn stored(b: u64) -> KvEvent {
    KvEvent::Stored {
        parent: None,
        blocks: vec![BlockHash(b)],
        tier: Tier::Device,
    }
}

/// The model shell: the engine's blocks, JetStream's stream, and what the
/// core asked for.
struct Shell {
    core: KvCore<u32>,
    worker: WorkerId,
    backoff: Backoff,
    now: Duration,
    /// The engine's blocks (what its block set lists).
    engine: BTreeSet<u64>,
    next_block: u64,
    in_flight: Option<KvEventBatch>,
    /// Every batch ever published, by message id.
    published: HashMap<String, KvEventBatch>,
    /// Every batch ever announced, by message id.
    announced: HashMap<String, KvEventBatch>,
    /// The last batch announced: (epoch, seq).
    last_announced: Option<(u64, u64)>,
    /// A reannounce request is being stepped: announcements repeat.
    reannouncing: bool,
    /// The batch whose publish failed last, until the next publish.
    failed: Option<KvEventBatch>,
    /// The shell's retry timer.
    retry_at: Option<Duration>,
    /// When the last retry the core asked for was due.
    retry_due: Option<Duration>,
    /// Acknowledged batches, in order: the stream.
    stream: Vec<KvEventBatch>,
    epoch: u64,
    /// The core waits for a block set (asked, none came yet).
    core_waits_for_block_set: bool,
    /// The engine owes a block set it was asked for.
    engine_owes_block_set: bool,
    /// Block sets delivered so far.
    block_sets: usize,
    /// Per epoch started from a block set: the delivery's index and size.
    block_set_epochs: HashMap<u64, (usize, u64)>,
    /// The first batch the next new epoch must publish.
    expected_first: Option<Vec<KvEvent>>,
    /// Requesters, with the number of block sets delivered when asking.
    requesters: HashMap<u32, usize>,
    next_requester: u32,
    replied: HashSet<u32>,
}

impl Shell {
    fn new(limits: OutboxLimits) -> Self {
        let worker = WorkerId::new("w", 0).unwrap();
        let backoff = Backoff::AGENT;
        Self {
            core: KvCore::new(worker.clone(), FIRST_EPOCH, limits, backoff),
            worker,
            backoff,
            now: Duration::ZERO,
            engine: BTreeSet::new(),
            next_block: 1,
            in_flight: None,
            published: HashMap::new(),
            announced: HashMap::new(),
            last_announced: None,
            reannouncing: false,
            failed: None,
            retry_at: None,
            retry_due: None,
            stream: Vec::new(),
            epoch: FIRST_EPOCH,
            core_waits_for_block_set: false,
            engine_owes_block_set: false,
            block_sets: 0,
            block_set_epochs: HashMap::new(),
            expected_first: None,
            requesters: HashMap::new(),
            next_requester: 0,
            replied: HashSet::new(),
        }
    }

    fn step(&mut self, input: Input<u32>) {
        let effects = self.core.step(input, self.now);
        for effect in effects {
            self.check(effect);
        }
        assert_eq!(self.core.epoch(), self.epoch);
    }

    fn check(&mut self, effect: Effect<u32>) {
        match effect {
            Effect::Announce(batch)
                if self.reannouncing
                    && self.announced.contains_key(&subjects::kv_batch_msg_id(
                        &self.worker,
                        batch.epoch,
                        batch.seq,
                    )) =>
            {
                // Batches of the epoch announced before, unchanged (the
                // step may also form and announce new ones).
                assert_eq!(batch.epoch, self.epoch);
                assert!(
                    batch.seq > 0,
                    "an epoch's first batch is not announced again"
                );
                let id = subjects::kv_batch_msg_id(&self.worker, batch.epoch, batch.seq);
                assert_eq!(
                    self.announced.get(&id),
                    Some(&batch),
                    "announced again unchanged"
                );
            }
            Effect::Announce(batch) => {
                assert_eq!(batch.worker, self.worker);
                assert_eq!(batch.epoch, self.epoch, "announced in the current epoch");
                match self.last_announced {
                    Some((epoch, seq)) if epoch == batch.epoch => {
                        assert_eq!(batch.seq, seq + 1, "announcements in order, gap-free")
                    }
                    _ => assert_eq!(batch.seq, 0, "an epoch's announcements start at 0"),
                }
                self.last_announced = Some((batch.epoch, batch.seq));
                let id = subjects::kv_batch_msg_id(&self.worker, batch.epoch, batch.seq);
                assert!(
                    self.announced.insert(id, batch).is_none(),
                    "announced twice"
                );
            }
            Effect::Publish { batch, message_id } => {
                assert!(self.in_flight.is_none(), "two publishes in flight");
                assert_eq!(
                    self.announced.get(&message_id),
                    Some(&batch),
                    "published as announced, after its announcement"
                );
                assert_eq!(
                    message_id,
                    subjects::kv_batch_msg_id(&self.worker, batch.epoch, batch.seq)
                );
                assert_eq!(batch.worker, self.worker);
                if let Some(earlier) = self.published.get(&message_id) {
                    assert_eq!(earlier, &batch, "one message id, one batch");
                }
                if let Some(failed) = self.failed.take() {
                    // After a failure: the same batch, no sooner than its
                    // backoff, or the first batch of a new epoch.
                    if batch.epoch == failed.epoch {
                        assert_eq!(
                            batch, failed,
                            "an unacknowledged batch goes again unchanged"
                        );
                        let due = self.retry_due.expect("a retry was scheduled");
                        assert!(self.now >= due, "retried at {:?}, due {due:?}", self.now);
                    } else {
                        assert!(batch.epoch > failed.epoch && batch.seq == 0);
                    }
                }
                assert_eq!(batch.epoch, self.epoch, "batches of the current epoch only");
                if batch.seq == 0 {
                    assert_eq!(batch.events.first(), Some(&KvEvent::Cleared));
                    if let Some(first) = self.expected_first.take() {
                        assert_eq!(batch.events, first, "a resync's first batch: the block set");
                    }
                }
                self.retry_at = None;
                self.published.insert(message_id, batch.clone());
                self.in_flight = Some(batch);
            }
            Effect::CancelPublish => {
                assert!(self.in_flight.is_some(), "nothing to cancel");
                self.in_flight = None;
            }
            Effect::RetryAt(at) => {
                assert_eq!(at, self.now + self.backoff.delay(self.core.failures()));
                assert!(at > self.now, "a retry in the past");
                assert!(self.in_flight.is_none());
                self.retry_at = Some(at);
                self.retry_due = Some(at);
            }
            Effect::RequestBlockSet => {
                assert!(
                    !self.core_waits_for_block_set,
                    "a block set asked for twice"
                );
                self.core_waits_for_block_set = true;
                self.engine_owes_block_set = true;
            }
            Effect::Reply { to, reply } => {
                let asked_at = *self.requesters.get(&to).expect("a requester");
                assert!(self.replied.insert(to), "requester {to} answered twice");
                assert_eq!(reply.worker, self.worker);
                let (delivery, blocks) = self.block_set_epochs[&reply.epoch];
                assert!(
                    delivery >= asked_at,
                    "answered by a block set from before the request"
                );
                assert_eq!(reply.blocks, blocks);
                assert!(
                    self.stream
                        .iter()
                        .any(|b| b.epoch == reply.epoch && b.seq == 0),
                    "answered before the epoch's first batch was acknowledged"
                );
            }
            Effect::Note(Note::NewEpoch { epoch, .. }) => {
                let now_ms = self.now.as_millis() as u64;
                assert_eq!(epoch, (FIRST_EPOCH + now_ms).max(self.epoch + 1));
                self.epoch = epoch;
            }
            Effect::Note(_) => {}
        }
    }

    fn block_set(&self) -> Vec<KvEvent> {
        self.engine.iter().copied().map(stored).collect()
    }

    fn deliver_block_set(&mut self) {
        let set = self.block_set();
        let mut first = vec![KvEvent::Cleared];
        first.extend(set.iter().cloned());
        self.expected_first = Some(first);
        let index = self.block_sets;
        self.block_sets += 1;
        self.core_waits_for_block_set = false;
        let blocks = set.len() as u64;
        let before = self.epoch;
        self.step(Input::BlockSet(set));
        assert!(self.epoch > before, "a block set starts a new epoch");
        assert!(
            self.expected_first.is_none(),
            "its first batch went at once"
        );
        self.block_set_epochs.insert(self.epoch, (index, blocks));
    }

    fn ack(&mut self, duplicate: bool) {
        if let Some(batch) = self.in_flight.take() {
            self.stream.push(batch.clone());
            self.step(Input::Acked {
                epoch: batch.epoch,
                seq: batch.seq,
                duplicate,
            });
        }
    }

    /// The shell's retry timer fires if it is due.
    fn fire_due_retry(&mut self) {
        if self.retry_at.is_some_and(|at| at <= self.now) {
            self.retry_at = None;
            self.step(Input::Tick);
        }
    }

    fn run(&mut self, op: &Op) {
        match *op {
            Op::Events { stores, removes } => {
                let mut events = Vec::new();
                for _ in 0..stores {
                    let b = self.next_block;
                    self.next_block += 1;
                    self.engine.insert(b);
                    events.push(stored(b));
                }
                let gone: Vec<u64> = self.engine.iter().copied().take(removes.into()).collect();
                for b in &gone {
                    self.engine.remove(b);
                }
                if !gone.is_empty() {
                    events.push(KvEvent::Removed {
                        blocks: gone.into_iter().map(BlockHash).collect(),
                        tier: Tier::Device,
                    });
                }
                self.step(Input::EngineEvents(events));
            }
            Op::Ack { duplicate } => self.ack(duplicate),
            Op::Fail => {
                if let Some(batch) = self.in_flight.take() {
                    self.failed = Some(batch.clone());
                    self.step(Input::PublishFailed {
                        epoch: batch.epoch,
                        seq: batch.seq,
                        error: "no responders".into(),
                    });
                    assert!(self.retry_at.is_some(), "a failure schedules a retry");
                }
            }
            Op::Advance { ms } => {
                let to = self.now + Duration::from_millis(ms.into());
                // The shell's timer fires at the retry's time.
                if let Some(at) = self.retry_at.filter(|at| *at <= to) {
                    self.now = at;
                    self.fire_due_retry();
                }
                self.now = to;
            }
            Op::Tick => self.step(Input::Tick),
            Op::Resync { reply } => {
                let to = reply.then(|| {
                    let id = self.next_requester;
                    self.next_requester += 1;
                    self.requesters.insert(id, self.block_sets);
                    id
                });
                self.step(Input::ResyncRequested { reply: to });
            }
            Op::DeliverBlockSet => {
                if std::mem::take(&mut self.engine_owes_block_set) {
                    self.deliver_block_set();
                }
            }
            Op::UnaskedBlockSet => self.deliver_block_set(),
            Op::Reannounce { after } => {
                self.reannouncing = true;
                self.step(Input::ReannounceRequested {
                    epoch: self.epoch,
                    after_seq: u64::from(after),
                });
                self.reannouncing = false;
            }
            Op::StaleAck { back } => {
                // A batch not in flight: ignored.
                let (epoch, seq) = match &self.in_flight {
                    Some(b) => (b.epoch, b.seq + 1 + u64::from(back)),
                    None => (self.epoch.saturating_sub(1 + u64::from(back)), 0),
                };
                let effects = self.core.step(
                    Input::Acked {
                        epoch,
                        seq,
                        duplicate: false,
                    },
                    self.now,
                );
                // Only what any step may do: announce batches formed
                // while the publish in flight is stalled.
                let (announced, other): (Vec<_>, Vec<_>) = effects
                    .into_iter()
                    .partition(|e| matches!(e, Effect::Announce(_)));
                assert!(
                    other.is_empty(),
                    "a stale acknowledgement does nothing: {other:?}"
                );
                for effect in announced {
                    self.check(effect);
                }
            }
        }
    }

    /// Lets everything through: acknowledgements, block sets, retries.
    fn drain(&mut self) {
        for _ in 0..10_000 {
            if self.in_flight.is_some() {
                self.ack(false);
            } else if std::mem::take(&mut self.engine_owes_block_set) {
                self.deliver_block_set();
            } else if let Some(at) = self.retry_at {
                self.now = self.now.max(at);
                self.fire_due_retry();
            } else {
                return;
            }
        }
        panic!("the core never went quiet");
    }

    /// The stream's checks, and what it replays to.
    fn replay_stream(&self) -> BTreeSet<u64> {
        let mut blocks = BTreeSet::new();
        let mut epoch = None;
        let mut next_seq = 0;
        for batch in &self.stream {
            if epoch != Some(batch.epoch) {
                assert!(epoch.is_none_or(|e| batch.epoch > e), "epochs go forward");
                assert_eq!(batch.seq, 0, "an epoch starts at seq 0");
                assert_eq!(batch.events.first(), Some(&KvEvent::Cleared));
                epoch = Some(batch.epoch);
                next_seq = 0;
            }
            assert_eq!(batch.seq, next_seq, "a gap in epoch {}", batch.epoch);
            next_seq += 1;
            for event in &batch.events {
                match event {
                    KvEvent::Cleared => blocks.clear(),
                    KvEvent::Stored { blocks: b, .. } => {
                        for h in b {
                            assert!(blocks.insert(h.0), "block {} stored twice", h.0);
                        }
                    }
                    KvEvent::Removed { blocks: b, .. } => {
                        for h in b {
                            assert!(blocks.remove(&h.0), "block {} removed unknown", h.0);
                        }
                    }
                }
            }
        }
        blocks
    }
}

fn limits() -> impl Strategy<Value = OutboxLimits> {
    (1usize..10, 1usize..5).prop_map(|(max_queued_events, max_batch_events)| OutboxLimits {
        max_queued_events,
        max_batch_events,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_interleaving_keeps_the_stream_whole(
        limits in limits(),
        ops in prop::collection::vec(op(), 0..80),
    ) {
        let mut shell = Shell::new(limits);
        shell.step(Input::Tick);
        for op in &ops {
            shell.run(op);
        }
        shell.drain();
        assert_eq!(shell.core.held_events(), 0, "everything was published");
        assert_eq!(shell.replay_stream(), shell.engine, "the stream replays to the engine's blocks");
        let owed: HashSet<u32> = shell.requesters.keys().copied().collect();
        assert_eq!(shell.replied, owed, "every requester answered");
    }
}

#[test]
fn the_shell_sees_a_whole_resync() {
    let mut shell = Shell::new(OutboxLimits {
        max_queued_events: 4,
        max_batch_events: 2,
    });
    shell.step(Input::Tick);
    for op in [
        Op::Events {
            stores: 3,
            removes: 0,
        },
        Op::Fail,
        Op::Resync { reply: true },
        Op::Events {
            stores: 1,
            removes: 1,
        },
        Op::Advance { ms: 60 },
        Op::Resync { reply: true },
        Op::DeliverBlockSet,
        Op::Ack { duplicate: false },
    ] {
        shell.run(&op);
    }
    assert_eq!(shell.replied.len(), 2, "both answered by one epoch");
    assert_eq!(shell.block_sets, 1);
    shell.drain();
    assert_eq!(shell.replay_stream(), shell.engine);
}
