//! The event pipeline, measured from the outside: simulated agents publish
//! KV batches to JetStream; a running kv-indexer turns them into deltas; a
//! replica here follows the deltas exactly as a router does. Reports the
//! delay from publishing a batch to its delta being applied in the replica
//! (one clock: both ends are in this process), the part of it spent before
//! JetStream acknowledged the batch, and the sustained rate of block events
//! through the whole pipeline. Publishing starts once the replica has
//! caught up with the delta stream.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use bus::{Bus, Registry, StreamLimits};
use futures::StreamExt;
use kv_indexer::IndexReplica;
use protocol::{
    BlockHash, BlockHasher, HashingContract, KvEvent, KvEventBatch, Role, Tier, WorkerId,
    WorkerRecord, WorkerSubjects,
};
use tokio::sync::Mutex;

use crate::stats::{round3, Samples};

#[derive(Debug, Clone)]
pub struct EventsBench {
    pub nats: String,
    /// The simulated workers register here, so that the indexer keeps them.
    pub etcd: String,
    pub workers: usize,
    pub blocks_per_batch: usize,
    /// Target block events per second over all workers.
    pub block_events_per_s: f64,
    pub duration: Duration,
}

type Key = (WorkerId, u64, u64);

pub async fn run(bench: EventsBench) -> anyhow::Result<serde_json::Value> {
    let bus = Bus::connect(&bench.nats, "loadgen-events").await?;
    bus.ensure_streams(&StreamLimits::default()).await?;
    // Registered like real agents (the indexer drops unregistered workers).
    let registry = Registry::connect(std::slice::from_ref(&bench.etcd)).await?;
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
        };
        registrations.push(registry.register(&record, Duration::from_secs(10)).await?);
    }
    let published: Arc<Mutex<HashMap<Key, Instant>>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));

    // The follower: a router's view of the index, built as a router builds
    // it (the latest snapshot, then the deltas after it).
    let (caught_up_tx, caught_up_rx) = tokio::sync::oneshot::channel();
    let follower = {
        let mut replica = IndexReplica::new();
        let from = match bus.latest_snapshot().await? {
            Some(snapshot) => {
                let seq = snapshot.delta_seq;
                replica.restore(snapshot)?;
                seq + 1
            }
            None => 1,
        };
        let mut deltas = bus.deltas_from(from).await?;
        let (published, done) = (published.clone(), done.clone());
        // Publishing starts once the follower holds every delta there was:
        // catching up on an earlier history is not a delay to measure.
        let head = bus.last_delta_seq().await?;
        let mut caught_up = Some(caught_up_tx);
        if replica.applied() >= head {
            let _ = caught_up.take().map(|tx| tx.send(()));
        }
        tokio::spawn(async move {
            let mut delays = Samples::default();
            let mut blocks = 0u64;
            let mut first: Option<Instant> = None;
            let mut last = Instant::now();
            let mut applied = 0u64;
            while let Some(delta) = deltas.next().await {
                let delta = delta?;
                replica.apply(&delta)?;
                let now = Instant::now();
                applied += 1;
                if replica.applied() >= head {
                    let _ = caught_up.take().map(|tx| tx.send(()));
                }
                if let Some(source) = &delta.source {
                    let key = (source.worker.clone(), source.epoch, source.last_seq);
                    if let Some(sent) = published.lock().await.remove(&key) {
                        delays.push(now - sent);
                        first.get_or_insert(sent);
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
                if done.load(Ordering::Relaxed) && published.lock().await.is_empty() {
                    break;
                }
            }
            let seconds = first.map_or(0.0, |f| (last - f).as_secs_f64());
            anyhow::Ok((delays, blocks, seconds, applied))
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
        let (bus, published, acks) = (bus.clone(), published.clone(), acks.clone());
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
                published
                    .lock()
                    .await
                    .insert((worker.clone(), epoch, seq), sent);
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
    done.store(true, Ordering::Relaxed);
    let (mut delays, blocks, seconds, applied) =
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
    }))
}
