//! The event pipeline, measured from the outside: simulated agents publish
//! KV batches to JetStream; a running kv-indexer turns them into deltas; a
//! replica here follows the deltas exactly as a router does. Reports the
//! delay from publishing a batch to its delta being applied in the replica
//! (one clock: both ends are in this process), the part of it spent before
//! JetStream acknowledged the batch, and the sustained rate of block events
//! through the whole pipeline. Publishing starts once the replica has
//! caught up with the delta stream.
//!
//! The delay is also split in three stages, timed by plain NATS
//! subscriptions to the KV-event and delta subjects (which the server
//! serves as it takes a message in): publish -> the batch on the bus;
//! -> its delta on the bus (the indexer's share: JetStream's delivery to
//! it, applying, publishing); -> applied in the replica (the delta stream's
//! delivery to a router).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use bus::{Bus, Registry, StreamLimits};
use futures::StreamExt;
use kv_indexer::IndexReplica;
use protocol::{
    subjects, BlockHash, BlockHasher, HashingContract, IndexDelta, KvEvent, KvEventBatch,
    Message as _, Role, Tier, WorkerId, WorkerRecord, WorkerSubjects,
};

use crate::stats::{round3, Samples};

#[derive(Debug, Clone)]
pub struct EventsBench {
    pub nats: String,
    /// The simulated workers register here, so that the indexer keeps them.
    pub etcd: Vec<String>,
    /// Credentials and TLS.
    pub auth: bus::AuthArgs,
    pub workers: usize,
    pub blocks_per_batch: usize,
    /// Target block events per second over all workers.
    pub block_events_per_s: f64,
    pub duration: Duration,
}

type Key = (WorkerId, u64, u64);

/// When one published batch reached each point of the pipeline.
#[derive(Debug, Clone, Copy)]
struct Timeline {
    published: Instant,
    on_bus: Option<Instant>,
    delta_on_bus: Option<Instant>,
}

type Timelines = Arc<std::sync::Mutex<HashMap<Key, Timeline>>>;

/// The three stages' delays.
#[derive(Debug, Default)]
struct Stages {
    to_bus: Samples,
    indexer: Samples,
    to_view: Samples,
}

impl Stages {
    fn push(&mut self, timeline: &Timeline, applied: Instant) {
        if let (Some(on_bus), Some(delta_on_bus)) = (timeline.on_bus, timeline.delta_on_bus) {
            self.to_bus.push(on_bus - timeline.published);
            self.indexer
                .push(delta_on_bus.saturating_duration_since(on_bus));
            self.to_view
                .push(applied.saturating_duration_since(delta_on_bus));
        }
    }

    fn summary(&mut self) -> serde_json::Value {
        serde_json::json!({
            "publish_to_bus": self.to_bus.summary(),
            "bus_to_delta_on_bus": self.indexer.summary(),
            "delta_on_bus_to_view": self.to_view.summary(),
        })
    }
}

/// Notes when each batch and each delta passes on the bus.
async fn tap(bus: &Bus, timelines: &Timelines) -> anyhow::Result<()> {
    let client = bus.client();
    let batches = client.subscribe(subjects::KV_EVENTS_ALL).await?;
    let deltas = client.subscribe(subjects::INDEX_DELTAS).await?;
    client.flush().await?;
    tokio::spawn(note_passes(batches, timelines.clone(), |payload| {
        let b = KvEventBatch::decode(payload).ok()?;
        Some(((b.worker, b.epoch, b.seq), |t: &mut Timeline| &mut t.on_bus))
    }));
    tokio::spawn(note_passes(deltas, timelines.clone(), |payload| {
        let s = IndexDelta::decode(payload).ok()?.source?;
        Some(((s.worker, s.epoch, s.last_seq), |t: &mut Timeline| {
            &mut t.delta_on_bus
        }))
    }));
    Ok(())
}

/// Which point of which batch's timeline a message marks.
type Mark = fn(&mut Timeline) -> &mut Option<Instant>;

/// Sets, for every message, the time it came at the point it marks.
async fn note_passes(
    mut messages: async_nats::Subscriber,
    timelines: Timelines,
    point: fn(&[u8]) -> Option<(Key, Mark)>,
) {
    while let Some(message) = messages.next().await {
        let now = Instant::now();
        if let Some((key, mark)) = point(&message.payload) {
            if let Some(t) = timelines.lock().expect("not poisoned").get_mut(&key) {
                *mark(t) = Some(now);
            }
        }
    }
}

pub async fn run(bench: EventsBench) -> anyhow::Result<serde_json::Value> {
    let bus = Bus::connect_with(&bench.nats, "loadgen-events", &bench.auth.nats).await?;
    bus.ensure_streams(&StreamLimits::default()).await?;
    // Registered like real agents (the indexer drops unregistered workers).
    let registry = Registry::connect_with(&bench.etcd, &bench.auth.etcd).await?;
    let mut registrations = Vec::new();
    for w in 0..bench.workers {
        let id = WorkerId::new(&format!("bench{w}"), 0)?;
        let record = WorkerRecord {
            subjects: WorkerSubjects::for_worker(&id),
            id,
            role: Role::Decode,
            contract: HashingContract::for_model("events-bench", 16),
            kv_capacity_blocks: 1 << 30,
            max_batched_tokens: 8192,
            kv_bytes_per_token: 1,
            gpus: 1,
            max_model_len: 0,
            capabilities: Default::default(),
        };
        registrations.push(registry.register(&record, Duration::from_secs(10)).await?);
    }
    let timelines = Timelines::default();
    tap(&bus, &timelines).await?;
    // Set once every batch is published (and acknowledged).
    let (done_tx, mut done) = tokio::sync::watch::channel(false);

    // The follower: a router's view of the index, built as a router builds
    // it (the latest snapshot, then the deltas after it).
    let (caught_up_tx, caught_up_rx) = tokio::sync::oneshot::channel();
    let follower = {
        let mut replica = IndexReplica::new();
        replica.reserve(kv_indexer::DEFAULT_RESERVE_BLOCKS);
        let from = match bus.latest_snapshot().await? {
            Some(snapshot) => {
                let seq = snapshot.delta_seq;
                replica.restore(snapshot)?;
                seq + 1
            }
            None => 1,
        };
        let mut deltas = bus.deltas_from(from).await?;
        let timelines = timelines.clone();
        // Publishing starts once the follower holds every delta there was:
        // catching up on an earlier history is not a delay to measure.
        let head = bus.last_delta_seq().await?;
        let mut caught_up = Some(caught_up_tx);
        if replica.applied() >= head {
            let _ = caught_up.take().map(|tx| tx.send(()));
        }
        tokio::spawn(async move {
            let mut delays = Samples::default();
            let mut stages = Stages::default();
            let mut blocks = 0u64;
            let mut first: Option<Instant> = None;
            let mut last = Instant::now();
            let mut applied = 0u64;
            loop {
                // The last delta may come before the publishers are done:
                // their end is awaited as well as the next delta.
                if *done.borrow() && timelines.lock().expect("not poisoned").is_empty() {
                    break;
                }
                let delta = tokio::select! {
                    delta = deltas.next() => match delta {
                        Some(delta) => delta?,
                        None => break,
                    },
                    // An error: the publishing side is gone.
                    changed = done.changed() => match changed {
                        Ok(()) => continue,
                        Err(_) => break,
                    },
                };
                replica.apply(&delta)?;
                let now = Instant::now();
                applied += 1;
                if replica.applied() >= head {
                    let _ = caught_up.take().map(|tx| tx.send(()));
                }
                if let Some(source) = &delta.source {
                    let key = (source.worker.clone(), source.epoch, source.last_seq);
                    let timeline = timelines.lock().expect("not poisoned").remove(&key);
                    if let Some(timeline) = timeline {
                        delays.push(now - timeline.published);
                        stages.push(&timeline, now);
                        first.get_or_insert(timeline.published);
                        last = now;
                        blocks += delta
                            .changes
                            .iter()
                            .map(|c| match c {
                                protocol::IndexChange::Stored { blocks, .. } => blocks.len() as u64,
                                _ => 0,
                            })
                            .sum::<u64>();
                    }
                }
            }
            let seconds = first.map_or(0.0, |f| (last - f).as_secs_f64());
            anyhow::Ok((delays, stages, blocks, seconds, applied))
        })
    };

    tokio::time::timeout(Duration::from_secs(60), caught_up_rx)
        .await
        .context("the follower did not catch up with the delta stream within 60 s")?
        .context("the follower stopped before catching up")?;

    // The publishers: each a worker extending its own chains.
    let epoch = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
    let per_worker_batches_per_s =
        bench.block_events_per_s / bench.blocks_per_batch as f64 / bench.workers as f64;
    let interval = Duration::from_secs_f64(1.0 / per_worker_batches_per_s);
    let batches = (per_worker_batches_per_s * bench.duration.as_secs_f64()).ceil() as u64;
    // Publish start to JetStream's ack: the part of the delay spent before
    // the indexer can see the batch.
    let acks: Arc<std::sync::Mutex<Samples>> = Arc::default();
    let mut publishers = tokio::task::JoinSet::new();
    for w in 0..bench.workers {
        let (bus, timelines, acks) = (bus.clone(), timelines.clone(), acks.clone());
        let worker = WorkerId::new(&format!("bench{w}"), 0)?;
        let blocks_per_batch = bench.blocks_per_batch;
        publishers.spawn(async move {
            let start = Instant::now();
            let mut parent: Option<BlockHash> = None;
            for seq in 0..batches {
                tokio::time::sleep_until((start + interval.mul_f64(seq as f64)).into()).await;
                let mut blocks = Vec::with_capacity(blocks_per_batch);
                for i in 0..blocks_per_batch as u64 {
                    let hash = BlockHasher::chain(parent, epoch ^ (w as u64) << 48 ^ seq << 20 ^ i);
                    blocks.push(hash);
                    parent = Some(hash);
                }
                let mut events = Vec::with_capacity(2);
                if seq == 0 {
                    events.push(KvEvent::Cleared);
                }
                events.push(KvEvent::Stored {
                    parent: None,
                    blocks,
                    tier: Tier::Device,
                });
                // Chains restart every 64 batches so the index stays bounded.
                if seq % 64 == 63 {
                    parent = None;
                }
                let batch = KvEventBatch {
                    worker: worker.clone(),
                    epoch,
                    seq,
                    events,
                };
                let sent = Instant::now();
                let timeline = Timeline {
                    published: sent,
                    on_bus: None,
                    delta_on_bus: None,
                };
                timelines
                    .lock()
                    .expect("not poisoned")
                    .insert((worker.clone(), epoch, seq), timeline);
                bus.publish_kv_batch(&batch)
                    .await
                    .context("publishing a batch")?;
                acks.lock().expect("not poisoned").push(sent.elapsed());
            }
            anyhow::Ok(())
        });
    }
    while let Some(result) = publishers.join_next().await {
        result??;
    }
    done_tx.send_replace(true);
    let (mut delays, mut stages, blocks, seconds, applied) =
        tokio::time::timeout(Duration::from_secs(60), follower)
            .await
            .context(
                "the pipeline did not deliver every batch within 60 s (is kv-indexer running?)",
            )???;
    for registration in registrations {
        registration.revoke().await?;
    }
    Ok(serde_json::json!({
        "workers": bench.workers,
        "blocks_per_batch": bench.blocks_per_batch,
        "target_block_events_per_s": bench.block_events_per_s,
        "batches": delays.len(),
        "deltas_applied": applied,
        "block_events_per_s": round3(blocks as f64 / seconds.max(1e-9)),
        "publish_to_router_view_ms": delays.summary(),
        "publish_to_ack_ms": acks.lock().expect("not poisoned").summary(),
        "stages_ms": stages.summary(),
    }))
}
