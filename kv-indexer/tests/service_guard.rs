//! Defence in depth against forged KV batches, on a real nats-server: a
//! far-future epoch and a batch on another worker's subject are rejected
//! and counted; a worker dropping stale batches shows as frozen; an epoch
//! beyond the bound already held (accepted by an indexer without the
//! bound) is reset on the worker's next batch.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Result};
use common::{
    digest_hex, local_indexer, wait_for, wait_for_delta, worker, Running, Servers, Workload,
};
use protocol::{BlockHash, BlockHasher, KvEvent, KvEventBatch, Message, Tier};

/// 187 fake blocks under an epoch of 2^62, as in the issue.
fn forged(worker_name: &str) -> KvEventBatch {
    let mut last = None;
    let blocks: Vec<BlockHash> = (0..187u64)
        .map(|i| {
            let b = BlockHasher::chain(last, 0xF0F0 + i);
            last = Some(b);
            b
        })
        .collect();
    KvEventBatch {
        worker: worker(worker_name),
        epoch: 1 << 62,
        seq: 0,
        events: vec![
            KvEvent::Cleared,
            KvEvent::Stored {
                parent: None,
                blocks,
                tier: Tier::Device,
            },
        ],
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_batches_are_rejected_and_a_frozen_worker_shows() -> Result<()> {
    let servers = Servers::start().await?;
    let service = Running::start(servers.config()).await?;
    let mut workload = Workload::new(&[worker("d0"), worker("d1")], 3);
    let mut batches: Vec<KvEventBatch> = (0..6).map(|_| workload.batch()).collect();
    for batch in &batches {
        servers.bus.publish_kv_batch(batch).await?;
    }
    // The forgeries: a far-future epoch on d0's own subject, and d0's next
    // batch on d1's subject.
    servers.bus.publish_kv_batch(&forged("d0")).await?;
    let next_d0 = workload.batch_of(0);
    servers
        .bus
        .jetstream()
        .publish("sy.kv.events.d1.0", next_d0.encode().into())
        .await?
        .await?;
    // d0's real stream goes on: its next batch still applies.
    servers.bus.publish_kv_batch(&next_d0).await?;
    batches.push(next_d0);
    let local = local_indexer(&batches);
    let status = wait_for_delta(service.http, local.delta_seq(), Duration::from_secs(20)).await?;
    ensure!(
        status["digest"] == digest_hex(local.index().digest()),
        "{status}"
    );
    ensure!(
        service
            .metric("kv_indexer_batches_rejected_total{reason=\"future_epoch\"}")
            .await?
            == 1.0
    );
    ensure!(
        service
            .metric("kv_indexer_batches_rejected_total{reason=\"wrong_subject\"}")
            .await?
            == 1.0
    );

    // A batch of an older epoch than d0's (a previous instance's): stale,
    // and d0 is frozen until a batch of its applies.
    let stale = KvEventBatch {
        epoch: 0,
        ..batches[0].clone()
    };
    servers.bus.publish_kv_batch(&stale).await?;
    let frozen = wait_for("d0 to show as frozen", Duration::from_secs(10), || async {
        let status = service.status().await?;
        Ok(status["frozen_workers"]["d0"]["dropped"]
            .as_u64()
            .filter(|n| *n == 1)
            .map(|_| status))
    })
    .await?;
    ensure!(
        frozen["frozen_workers"]["d0"]["current_epoch"] == 1,
        "{frozen}"
    );
    ensure!(service.metric("kv_indexer_frozen_workers").await? == 1.0);
    let next = workload.batch_of(0);
    servers.bus.publish_kv_batch(&next).await?;
    wait_for("d0 to thaw", Duration::from_secs(10), || async {
        let status = service.status().await?;
        Ok(status["frozen_workers"]
            .as_object()
            .is_some_and(|m| m.is_empty())
            .then_some(()))
    })
    .await?;
    ensure!(service.metric("kv_indexer_frozen_workers").await? == 0.0);
    service.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epoch_held_beyond_the_bound_is_reset() -> Result<()> {
    let servers = Servers::start().await?;
    // An indexer without a useful bound accepts the forged epoch...
    let mut lax = servers.config();
    lax.max_epoch_ahead = Duration::MAX;
    let service = Running::start(lax).await?;
    let mut workload = Workload::new(&[worker("d0")], 4);
    let real: Vec<KvEventBatch> = (0..3).map(|_| workload.batch()).collect();
    for batch in &real {
        servers.bus.publish_kv_batch(batch).await?;
    }
    servers.bus.publish_kv_batch(&forged("d0")).await?;
    let status = wait_for_delta(service.http, 4, Duration::from_secs(20)).await?;
    ensure!(status["worker_blocks"]["d0"] == 187, "{status}");
    // ...and d0's restarted agent (a new epoch from the wall clock) is
    // stale behind it: frozen.
    let restarted = KvEventBatch {
        worker: worker("d0"),
        epoch: now_ms(),
        seq: 0,
        events: vec![
            KvEvent::Cleared,
            KvEvent::Stored {
                parent: None,
                blocks: vec![BlockHasher::chain(None, 42)],
                tier: Tier::Device,
            },
        ],
    };
    servers.bus.publish_kv_batch(&restarted).await?;
    wait_for("d0 to freeze", Duration::from_secs(10), || async {
        let status = service.status().await?;
        Ok(status["frozen_workers"]["d0"].is_object().then_some(()))
    })
    .await?;
    service.stop().await?;

    // Restarted with the default bound, the indexer resets d0 on its next
    // batch: the real blocks are back, the forged ones gone.
    let service = Running::start(servers.config()).await?;
    let again = KvEventBatch {
        epoch: now_ms(),
        ..restarted
    };
    servers.bus.publish_kv_batch(&again).await?;
    let status = wait_for("d0's real blocks", Duration::from_secs(20), || async {
        let status = service.status().await?;
        Ok((status["worker_blocks"]["d0"] == 1).then_some(status))
    })
    .await?;
    ensure!(
        status["frozen_workers"]
            .as_object()
            .is_some_and(|m| m.is_empty()),
        "{status}"
    );
    ensure!(service.metric("kv_indexer_epochs_reset_total").await? == 1.0);
    service.stop().await
}
