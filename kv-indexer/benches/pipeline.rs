//! End-to-end throughput of the service against a real nats-server:
//!
//! ```text
//! cargo bench -p kv-indexer --bench pipeline
//! ```
//!
//! A backlog of KV batches is loaded into the KV stream, then the service
//! starts and works through it: consume, decode, apply, publish each delta,
//! ack. Knobs (environment): `BENCH_BATCHES` (default 100000),
//! `BENCH_BLOCKS` (blocks stored per batch, default 32), `BENCH_WORKERS`
//! (16), `BENCH_FETCH` and `BENCH_IN_FLIGHT` (the service's settings).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use async_nats::jetstream::message::PublishMessage;
use common::*;
use protocol::{subjects, BlockHash, BlockHasher, KvEvent, KvEventBatch, Message, Tier};

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Each worker stores chains of `blocks` new blocks and, beyond 64
/// chains, removes its oldest chain in the same batch.
fn batches(count: usize, workers: usize, blocks: usize) -> Vec<KvEventBatch> {
    let ids: Vec<_> = (0..workers).map(|i| worker(&format!("w{i}"))).collect();
    let mut held: Vec<VecDeque<Vec<BlockHash>>> = vec![VecDeque::new(); workers];
    let mut seqs = vec![0u64; workers];
    (0..count)
        .map(|n| {
            let w = n % workers;
            let mut events = Vec::new();
            if seqs[w] == 0 {
                events.push(KvEvent::Cleared);
            }
            let mut chain = Vec::with_capacity(blocks);
            for k in 0..blocks {
                chain.push(BlockHasher::chain(
                    chain.last().copied(),
                    ((n as u64) << 16) | k as u64,
                ));
            }
            events.push(KvEvent::Stored {
                parent: None,
                blocks: chain.clone(),
                tier: Tier::Device,
            });
            held[w].push_back(chain);
            if held[w].len() > 64 {
                events.push(KvEvent::Removed {
                    blocks: held[w].pop_front().unwrap(),
                    tier: Tier::Device,
                });
            }
            let batch = KvEventBatch {
                worker: ids[w].clone(),
                epoch: 1,
                seq: seqs[w],
                events,
            };
            seqs[w] += 1;
            batch
        })
        .collect()
}

fn main() -> Result<()> {
    tokio::runtime::Runtime::new()?.block_on(throughput())
}

async fn throughput() -> Result<()> {
    let count = knob("BENCH_BATCHES", 100_000);
    let blocks = knob("BENCH_BLOCKS", 32);
    let workers = knob("BENCH_WORKERS", 16);
    let servers = Servers::start().await?;
    let batches = batches(count, workers, blocks);
    let block_events: usize = batches.iter().map(KvEventBatch::block_events).sum();

    // Load the backlog: sends in order, confirmations awaited behind.
    let started = Instant::now();
    let js = servers.bus.jetstream();
    let mut acks = VecDeque::new();
    for batch in &batches {
        let message = PublishMessage::build().payload(batch.encode().into());
        acks.push_back(
            js.send_publish(subjects::kv_events(&batch.worker), message)
                .await?,
        );
        if acks.len() >= 2000 {
            acks.pop_front().unwrap().await?;
        }
    }
    for ack in acks {
        ack.await?;
    }
    let load = started.elapsed();

    let mut config = servers.config();
    config.worker_grace = Duration::from_secs(3600);
    config.snapshot_interval = Duration::from_secs(3600);
    config.snapshot_every_deltas = u64::MAX;
    config.fetch_batch = knob("BENCH_FETCH", config.fetch_batch);
    config.max_in_flight = knob("BENCH_IN_FLIGHT", config.max_in_flight);
    let service = Running::start(config).await?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(600);
    loop {
        let published = service.metric("kv_indexer_delta_seq_published").await?;
        if published >= count as f64 {
            break;
        }
        if Instant::now() > deadline {
            return Err(anyhow!("only {published} of {count} deltas after 600 s"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let status = service.status().await?;
    println!(
        "{{\"batches\":{count},\"blocks_per_batch\":{blocks},\"workers\":{workers},\
         \"block_events\":{block_events},\"load_s\":{:.2},\"publish_batches_per_s\":{:.0},\
         \"index_s\":{elapsed:.2},\"batches_per_s\":{:.0},\"block_events_per_s\":{:.0},\
         \"pairs\":{}}}",
        load.as_secs_f64(),
        count as f64 / load.as_secs_f64(),
        count as f64 / elapsed,
        block_events as f64 / elapsed,
        status["pairs"],
    );
    service.stop().await
}
