//! The KV side of the loop: feeds the [`crate::core::KvCore`] and carries
//! out its effects (JetStream publishes, the retry timer, block-set
//! requests, resync replies, metrics and logs).

use async_nats::Subject;
use bus::BusError;
use metrics::{counter, gauge};
use protocol::{KvEventBatch, Message, ResyncReply};
use std::sync::atomic::Ordering;

use tracing::{debug, error, info, warn, Instrument};

use super::event_loop::Agent;
use crate::core::{Effect, Input, Note};
use crate::metrics as m;

/// Batches waiting to be announced: past it, an announcement is dropped
/// (and counted): the stream still gets the batch.
pub(super) const ANNOUNCE_QUEUE: usize = 1024;

/// Announces the batches in order as they come, until the agent drops its
/// end of the channel. Best effort: the stream is the record.
pub(super) async fn announce(
    bus: bus::Bus,
    mut batches: tokio::sync::mpsc::Receiver<KvEventBatch>,
) {
    while let Some(batch) = batches.recv().await {
        match bus.announce_kv_batch(&batch).await {
            Ok(()) => counter!(m::KV_BATCHES_ANNOUNCED).increment(1),
            Err(e) => {
                counter!(m::PUBLISH_ERRORS, "kind" => "kv_announce").increment(1);
                debug!(epoch = batch.epoch, seq = batch.seq, error = %e, "announcing a KV batch failed (the stream still gets it)");
            }
        }
    }
}

/// The outcome of one KV batch publish.
#[derive(Debug)]
pub(super) struct PublishDone {
    epoch: u64,
    seq: u64,
    result: Result<bool, BusError>,
}

impl Agent {
    /// Steps the KV core now and carries out its effects.
    pub(super) fn kv_step(&mut self, input: Input<Subject>) {
        let now = self.origin.elapsed();
        for effect in self.kv.step(input, now) {
            match effect {
                Effect::Announce(batch) => {
                    // The newest batch formed (not one announced again).
                    if self.newest_formed < Some((batch.epoch, batch.seq)) {
                        self.newest_formed = Some((batch.epoch, batch.seq));
                        gauge!(m::KV_BATCH_SEQ).set(batch.seq as f64);
                    }
                    if self.announcer.try_send(batch).is_err() {
                        counter!(m::PUBLISH_ERRORS, "kind" => "kv_announce").increment(1);
                    }
                }
                Effect::Publish { batch, message_id } => self.publish(batch, &message_id),
                Effect::CancelPublish => self.publishing = None,
                Effect::RetryAt(at) => self.retry_at = Some(self.origin + at),
                Effect::RequestBlockSet => self.engine.request_block_set(),
                Effect::Reply { to, reply } => self.send_resync_reply(to, &reply),
                Effect::Note(note) => {
                    if let Note::NewEpoch { epoch, .. } = &note {
                        self.record_epoch(*epoch);
                    }
                    record(&note)
                }
            }
        }
        gauge!(m::KV_QUEUE_EVENTS).set(self.kv.held_events() as f64);
    }

    /// Records a new epoch in etcd (in the background): a restart starts
    /// after it.
    fn record_epoch(&mut self, epoch: u64) {
        let (registry, worker) = (self.registry.clone(), self.worker.clone());
        self.tasks.spawn(async move {
            if let Err(e) = registry.record_epoch(&worker, epoch).await {
                warn!(epoch, error = %e, "recording the KV epoch in etcd failed");
            }
        });
    }

    /// A publish ended: its outcome goes to the core.
    pub(super) fn on_published(&mut self, done: PublishDone) {
        self.publishing = None;
        let PublishDone { epoch, seq, result } = done;
        let result_ok = result.is_ok();
        let input = match result {
            Ok(duplicate) => Input::Acked {
                epoch,
                seq,
                duplicate,
            },
            Err(e) => {
                if e.is_unaccepted() {
                    counter!(m::STORE_FULL_ERRORS).increment(1);
                    if !self.store_full.swap(true, Ordering::Relaxed) {
                        gauge!(m::STORE_FULL).set(1.0);
                        error!(
                            epoch,
                            seq,
                            error = %e,
                            store_full = e.is_store_full(),
                            "JetStream does not accept KV events (its store is full, or it does \
                             not confirm them); they are held and retried (a resync past the queue \
                             bound) until it does again; /healthz fails meanwhile"
                        );
                    }
                }
                Input::PublishFailed {
                    epoch,
                    seq,
                    error: e.to_string(),
                }
            }
        };
        if result_ok && self.store_full.swap(false, Ordering::Relaxed) {
            gauge!(m::STORE_FULL).set(0.0);
            info!(epoch, seq, "JetStream accepts KV events again");
        }
        self.kv_step(input);
    }

    fn publish(&mut self, batch: KvEventBatch, message_id: &str) {
        debug!(
            message_id,
            events = batch.events.len(),
            "publishing a KV batch"
        );
        let bus = self.bus.clone();
        // The bus names the message by the batch's worker, epoch and seq:
        // the core's message id.
        self.publishing = Some(Box::pin(async move {
            let result = bus.publish_kv_batch(&batch).await;
            PublishDone {
                epoch: batch.epoch,
                seq: batch.seq,
                result,
            }
        }));
    }

    fn send_resync_reply(&mut self, to: Subject, reply: &ResyncReply) {
        let client = self.client.clone();
        let payload: bytes::Bytes = reply.encode().into();
        self.tasks.spawn(
            async move {
                if let Err(e) = client.publish(to, payload).await {
                    counter!(m::PUBLISH_ERRORS, "kind" => "resync_reply").increment(1);
                    warn!(error = %e, "resync reply not sent");
                }
            }
            .in_current_span(),
        );
    }
}

/// Counts and logs what the KV core noted.
fn record(note: &Note) {
    match note {
        Note::Published {
            epoch,
            seq,
            events,
            blocks,
            duplicate,
            after_failures,
        } => {
            if *after_failures > 0 {
                info!(
                    epoch,
                    seq,
                    retries = after_failures,
                    "KV batch published: NATS acknowledges again"
                );
            }
            counter!(m::KV_BATCHES_PUBLISHED).increment(1);
            counter!(m::KV_BLOCKS_PUBLISHED).increment(*blocks);
            if *duplicate {
                counter!(m::KV_BATCHES_DUPLICATE).increment(1);
            }
            debug!(epoch, seq, events, duplicate, "KV batch published");
        }
        Note::PublishFailed {
            epoch,
            seq,
            failures,
            held_events,
            error,
        } => {
            counter!(m::KV_PUBLISH_RETRIES).increment(1);
            if *failures == 1 || failures % 20 == 0 {
                warn!(
                    epoch,
                    seq,
                    failures,
                    held_events,
                    error,
                    "KV batch not acknowledged; events stay queued and the batch is retried with the same message id"
                );
            }
        }
        Note::QueueFilling {
            held_events,
            max_queued_events,
            failures,
        } => warn!(
            held_events,
            max_queued_events,
            failures,
            "KV events are piling up while NATS does not acknowledge; at the bound the agent resynchronises"
        ),
        Note::QueueDrained { held_events } => info!(held_events, "KV queue drained"),
        Note::Overflowed { epoch, failures } => {
            counter!(m::KV_QUEUE_OVERFLOWS).increment(1);
            warn!(
                epoch,
                failures,
                "KV queue overflowed while NATS did not acknowledge; dropping it and resynchronising (new epoch with the full block set)"
            );
        }
        Note::NewEpoch {
            epoch,
            blocks,
            reason,
        } => {
            counter!(m::RESYNCS, "reason" => reason.as_str()).increment(1);
            gauge!(m::KV_EPOCH).set(*epoch as f64);
            info!(
                epoch,
                blocks,
                reason = reason.as_str(),
                "new KV epoch from the full block set"
            );
        }
    }
}
