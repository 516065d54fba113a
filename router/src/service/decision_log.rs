//! The decision log's writer: one task that turns this replica's decision
//! records into log entries ([`protocol::LogWriter`]: settings and
//! candidates' registrations once per context, a conversation's repeated
//! block hashes once) and sends them in order, many unacknowledged at a
//! time, off the event loop.
//!
//! The writer refers only to entries JetStream confirmed: one sent but
//! unconfirmed may be lost with a NATS node, and the entries referring to it
//! would be unreadable (`replay` found such a window after a node's kill).
//! Until its confirmation a context is written again with each decision
//! naming it, and a prompt is not referred to (a conversation's next turn
//! comes long after). The other replicas' prompts, which the event loop sees
//! on the log, may be referred to as well.
//!
//! An entry JetStream did not take (no confirmation, or "no stream found"
//! while a stream's leader is elected after a NATS node's death) is held
//! and sent again in the order it was first sent, for up to
//! [`RESEND_FOR`]; a decision's entry carries its decision id as message
//! id, so one sent again after a lost confirmation is stored once. Only
//! then, or at a refusal for room, is it lost (logged, counted).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bus::{Bus, BusError};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use protocol::{BlockHash, DecisionRecord, LogEntry, LogWriter, WriterLimits};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::event_loop::now_ms;
use super::metrics::Metrics;

/// Records waiting to be written before new ones are dropped (counted).
const QUEUE: usize = 16_384;
/// Entries sent and not yet acknowledged, at most.
const IN_FLIGHT: usize = 4_096;
/// At shutdown, acknowledgements are awaited this long.
const DRAIN: Duration = Duration::from_secs(2);
/// An entry JetStream did not take is sent again for this long after its
/// first failure (a stream's leader election takes 4 to 9 s).
const RESEND_FOR: Duration = Duration::from_secs(60);
/// The first pause before sending held entries again; it doubles while
/// they keep failing, up to [`RESEND_PAUSE_MAX`].
const RESEND_PAUSE: Duration = Duration::from_millis(250);
const RESEND_PAUSE_MAX: Duration = Duration::from_secs(2);
/// Entries held at most; beyond, a failed entry is lost (bounded memory
/// through a long outage: about 20 MB of 1.3 KB entries).
const HELD_MAX: usize = 16_384;

enum LogCommand {
    Write(Box<DecisionRecord>),
    PeerPrompt { last: BlockHash, blocks: u32 },
}

/// The handle the event loop writes through; cheap to clone.
#[derive(Debug, Clone)]
pub struct DecisionLog {
    tx: mpsc::Sender<LogCommand>,
    metrics: Metrics,
    /// JetStream refused the last write for want of room in its store.
    store_full: Arc<AtomicBool>,
}

type Ack = Pin<Box<dyn Future<Output = (Sent, Result<(), BusError>)> + Send>>;

/// An entry on its way, with its place in the order of first sends and
/// when it first failed.
struct Sent {
    order: u64,
    entry: LogEntry,
    failed_at: Option<Instant>,
}

impl DecisionLog {
    /// Starts the writer; it stops when every handle is dropped, after
    /// waiting (a little) for what it sent.
    pub fn start(bus: Bus, replica: Arc<str>, metrics: Metrics) -> (DecisionLog, JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        let store_full = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(run(rx, bus, replica, metrics.clone(), store_full.clone()));
        (
            DecisionLog {
                tx,
                metrics,
                store_full,
            },
            task,
        )
    }

    /// Whether JetStream's store refused the last write for want of room
    /// (readiness fails meanwhile).
    pub fn store_full(&self) -> bool {
        self.store_full.load(Ordering::Relaxed)
    }

    /// Writes a dispatched decision's record.
    pub fn write(&self, record: DecisionRecord) {
        if self
            .tx
            .try_send(LogCommand::Write(Box::new(record)))
            .is_err()
        {
            // A log that cannot keep up loses entries, never the request.
            self.metrics.dispatch("decision_log_dropped");
        }
    }

    /// Another replica's prompt is on the log: this replica's records may
    /// refer to it.
    pub fn peer_prompt(&self, last: BlockHash, blocks: u32) {
        // Only an opportunity to write less: dropped when busy.
        let _ = self.tx.try_send(LogCommand::PeerPrompt { last, blocks });
    }
}

async fn run(
    mut rx: mpsc::Receiver<LogCommand>,
    bus: Bus,
    replica: Arc<str>,
    metrics: Metrics,
    store_full: Arc<AtomicBool>,
) {
    let mut task = Task {
        bus,
        replica,
        metrics,
        full: Full(store_full, None),
        writer: LogWriter::awaiting_acks(WriterLimits::default()),
        acks: FuturesUnordered::new(),
        held: Held::default(),
        order: 0,
    };
    let mut expiry = tokio::time::interval(Duration::from_secs(1));
    loop {
        let resend_at = task.held.resend_at();
        tokio::select! {
            command = rx.recv(), if task.acks.len() < IN_FLIGHT => match command {
                None => break,
                Some(LogCommand::PeerPrompt { last, blocks }) => {
                    task.writer.saw_prompt_end(last, blocks, now_ms());
                }
                Some(LogCommand::Write(record)) => task.write(&record).await,
            },
            Some((sent, acked)) = task.acks.next() => match acked {
                Err(error) => task.failed(sent, error),
                Ok(()) => {
                    task.full.cleared();
                    task.held.took_one();
                    task.writer.acked(&sent.entry, now_ms());
                }
            },
            _ = tokio::time::sleep_until(resend_at.unwrap_or_else(far_future).into()), if resend_at.is_some() => {
                task.resend().await;
            }
            _ = expiry.tick() => task.full.expire(),
        }
    }
    task.drain().await;
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(3600)
}

/// The writer task's state: what it sent and awaits, what it holds to send
/// again.
struct Task {
    bus: Bus,
    replica: Arc<str>,
    metrics: Metrics,
    full: Full,
    writer: LogWriter,
    acks: FuturesUnordered<Ack>,
    held: Held,
    /// The last entry's place in the order of first sends.
    order: u64,
}

impl Task {
    /// Sends a record's entries.
    async fn write(&mut self, record: &DecisionRecord) {
        for entry in self.writer.write(record, now_ms()) {
            self.order += 1;
            let sent = Sent {
                order: self.order,
                entry,
                failed_at: None,
            };
            self.send(sent).await;
        }
    }

    /// Sends the held entries again, in order.
    async fn resend(&mut self) {
        let entries = self.held.take();
        self.metrics
            .dispatch_by("decision_log_resent", entries.len() as u64);
        for sent in entries {
            self.send(sent).await;
        }
    }

    /// Sends an entry (first or again); a send that fails at once is
    /// handled as a failed acknowledgement.
    async fn send(&mut self, sent: Sent) {
        match self.bus.send_log_entry(&self.replica, &sent.entry).await {
            Ok(ack) => self.acks.push(Box::pin(async move { (sent, ack.await) })),
            Err(error) => self.failed(sent, error),
        }
    }

    /// An entry JetStream did not take: held to be sent again while it did
    /// not answer (for [`RESEND_FOR`], [`HELD_MAX`] at most), lost when it
    /// refused for room or after that.
    fn failed(&mut self, mut sent: Sent, error: BusError) {
        self.full.saw(&error);
        let failed_at = *sent.failed_at.get_or_insert_with(Instant::now);
        let resend = error.is_unaccepted()
            && !error.is_store_full()
            && failed_at.elapsed() < RESEND_FOR
            && self.held.entries.len() < HELD_MAX;
        if resend {
            self.held.hold(sent, &error);
        } else {
            lost(&mut self.writer, &self.metrics, &sent.entry, &error);
        }
    }

    /// At shutdown: waits (a little) for what was sent; what is still held
    /// is lost, counted.
    async fn drain(mut self) {
        let drained = tokio::time::timeout(DRAIN, async {
            while let Some((sent, acked)) = self.acks.next().await {
                if let Err(error) = acked {
                    lost(&mut self.writer, &self.metrics, &sent.entry, &error);
                }
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                unacknowledged = self.acks.len(),
                "decision-log entries still unacknowledged at shutdown"
            );
        }
        if !self.held.entries.is_empty() {
            self.metrics
                .dispatch_by("decision_log_error", self.held.entries.len() as u64);
            tracing::warn!(
                held = self.held.entries.len(),
                "decision-log entries JetStream did not take are lost at shutdown"
            );
        }
    }
}

/// The entries waiting to be sent again, in the order of their first send
/// (a decision's context before the decision), and when.
#[derive(Default)]
struct Held {
    entries: BTreeMap<u64, Sent>,
    pause: Option<Duration>,
    at: Option<Instant>,
}

impl Held {
    fn hold(&mut self, sent: Sent, error: &BusError) {
        if self.entries.is_empty() && self.at.is_none() {
            tracing::warn!(
                %error,
                "JetStream did not take a decision-log entry; holding this replica's entries and sending them again (for up to 60 s)"
            );
        }
        self.entries.insert(sent.order, sent);
        if self.at.is_none() {
            let pause = self
                .pause
                .map_or(RESEND_PAUSE, |p| (p * 2).min(RESEND_PAUSE_MAX));
            self.pause = Some(pause);
            self.at = Some(Instant::now() + pause);
        }
    }

    fn resend_at(&self) -> Option<Instant> {
        self.at.filter(|_| !self.entries.is_empty())
    }

    /// The held entries, in order, to send now.
    fn take(&mut self) -> Vec<Sent> {
        self.at = None;
        std::mem::take(&mut self.entries).into_values().collect()
    }

    /// JetStream took an entry: the next hold starts with a short pause.
    fn took_one(&mut self) {
        if self.pause.is_some() && self.entries.is_empty() && self.at.is_none() {
            tracing::info!("JetStream takes the decision log's entries again");
            self.pause = None;
        }
    }
}

/// Whether JetStream takes the writes, as they saw: logged once when it
/// stops and once when it takes them again (a write accepted, or no write
/// refused for [`FULL_FOR`]: an idle replica writes nothing that would
/// show room again).
struct Full(Arc<AtomicBool>, Option<Instant>);

/// How long a refusal keeps the replica not ready with no later write.
const FULL_FOR: Duration = Duration::from_secs(2);

impl Full {
    /// Only a refusal for want of room counts: a write JetStream does not
    /// confirm (a stream re-electing its leader, seconds) is logged as
    /// lost, but routing needs no decision log, and every router not ready
    /// at once during a re-election would leave nothing to route.
    fn saw(&mut self, error: &BusError) {
        if !error.is_store_full() {
            return;
        }
        self.1 = Some(Instant::now());
        if !self.0.swap(true, Ordering::Relaxed) {
            tracing::error!(%error, "JetStream's store is full: the decision log refuses this replica's decisions (not ready until it has room, or no refusal for 2 s)");
        }
    }

    /// Clears a refusal older than [`FULL_FOR`].
    fn expire(&mut self) {
        if self.1.is_some_and(|at| at.elapsed() >= FULL_FOR) {
            self.cleared();
        }
    }

    fn cleared(&mut self) {
        self.1 = None;
        if self.0.swap(false, Ordering::Relaxed) {
            tracing::info!("JetStream's store has room again: decisions are logged");
        }
    }
}

fn lost(writer: &mut LogWriter, metrics: &Metrics, entry: &LogEntry, error: &BusError) {
    writer.lost(entry);
    metrics.dispatch("decision_log_error");
    match entry.decision() {
        Some(d) => tracing::warn!(
            decision = %d.decision.id,
            request_id = %d.decision.request_id,
            %error,
            "writing the decision to the decision log failed"
        ),
        None => tracing::warn!(%error, "writing a decision context to the decision log failed"),
    }
}
