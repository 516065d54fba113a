//! The KV event task: the SUB socket, replays and block-set requests,
//! around the [`RankCore`] (one event enum, one `select!`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use metrics::counter;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, error, info, warn, Instrument};
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket};

use super::engine::{lock, Shared};
use super::sequence::{Action, RankCore, Stats};
use super::wire::parse_live;
use super::zmq::{self as z, ReplayLimits, ReplayMsg};
use crate::engine::KvUpdate;
use crate::metrics as m;

/// A command to the KV task.
#[derive(Debug)]
pub(super) enum KvCommand {
    /// Send the engine's block set as a [`KvUpdate::BlockSet`].
    BlockSet,
    /// How many leading whole blocks of a prompt the engine holds, by the
    /// events it sent ([`super::translate::Translator::held_prefix_blocks`]).
    HeldPrefix {
        tokens: Vec<u32>,
        lora: Option<String>,
        cache_salt: Option<String>,
        reply: oneshot::Sender<usize>,
    },
}

/// The KV task: the SUB socket, replays and block-set requests, around
/// the [`RankCore`].
pub(super) struct KvTask {
    pub(super) core: RankCore,
    pub(super) sub: SubSocket,
    pub(super) topic: Bytes,
    pub(super) replay_endpoint: Option<String>,
    pub(super) replay_limits: ReplayLimits,
    pub(super) idle_check: Option<Duration>,
    pub(super) updates: mpsc::UnboundedSender<KvUpdate>,
    pub(super) commands: mpsc::UnboundedReceiver<KvCommand>,
    pub(super) stop: watch::Receiver<bool>,
    pub(super) shared: Arc<Shared>,
    /// Stats already exported as metrics.
    pub(super) exported: Stats,
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
    pub(super) async fn run(mut self) {
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
                KvTaskEvent::Command(Some(KvCommand::HeldPrefix {
                    tokens,
                    lora,
                    cache_salt,
                    reply,
                })) => {
                    let held = self.core.translator().held_prefix_blocks(
                        &tokens,
                        lora.as_deref(),
                        cache_salt.as_deref(),
                    );
                    let _ = reply.send(held);
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
        if now.other_block_sizes > old.other_block_sizes {
            warn!(
                total = now.other_block_sizes,
                "BlockStored events of another block size than the deployment's skipped (a hybrid model's partial tails): their blocks are not indexed"
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
