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

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

type Ack = Pin<Box<dyn Future<Output = (LogEntry, Result<(), BusError>)> + Send>>;

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
    let mut full = Full(store_full, None);
    let mut expiry = tokio::time::interval(Duration::from_secs(1));
    let mut writer = LogWriter::awaiting_acks(WriterLimits::default());
    let mut acks: FuturesUnordered<Ack> = FuturesUnordered::new();
    loop {
        tokio::select! {
            command = rx.recv(), if acks.len() < IN_FLIGHT => match command {
                None => break,
                Some(LogCommand::PeerPrompt { last, blocks }) => {
                    writer.saw_prompt_end(last, blocks, now_ms());
                }
                Some(LogCommand::Write(record)) => {
                    for entry in writer.write(&record, now_ms()) {
                        match bus.send_log_entry(&replica, &entry).await {
                            Ok(ack) => acks.push(Box::pin(async move { (entry, ack.await) })),
                            Err(error) => {
                                full.saw(&error);
                                lost(&mut writer, &metrics, &entry, &error)
                            }
                        }
                    }
                }
            },
            Some((entry, acked)) = acks.next() => match acked {
                Err(error) => {
                    full.saw(&error);
                    lost(&mut writer, &metrics, &entry, &error);
                }
                Ok(()) => {
                    full.cleared();
                    writer.acked(&entry, now_ms());
                }
            },
            _ = expiry.tick() => full.expire(),
        }
    }
    let drained = tokio::time::timeout(DRAIN, async {
        while let Some((entry, acked)) = acks.next().await {
            if let Err(error) = acked {
                lost(&mut writer, &metrics, &entry, &error);
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            unacknowledged = acks.len(),
            "decision-log entries still unacknowledged at shutdown"
        );
    }
}

/// Whether JetStream takes the writes, as they saw: logged once when it
/// stops and once when it takes them again (a write accepted, or no write
/// refused for [`FULL_FOR`]: an idle replica writes nothing that would
/// show room again).
struct Full(Arc<AtomicBool>, Option<std::time::Instant>);

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
        self.1 = Some(std::time::Instant::now());
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
