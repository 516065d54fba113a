//! The service against real NATS and etcd: KV batches in, deltas out,
//! malformed messages skipped, overlap queries answered.

#![cfg(feature = "service")]

mod common;

use std::time::Duration;

use anyhow::{ensure, Result};
use common::*;
use kv_indexer::{KvIndexer, OwnershipIndex};
use protocol::{
    subjects, BlockHash, BlockHasher, KvEvent, KvEventBatch, Message, OverlapQuery, OverlapReply,
    Tier,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_batches_come_out_as_deltas_a_replica_follows() -> Result<()> {
    let servers = Servers::start().await?;
    let service = Running::start(servers.config()).await?;
    let (code, body) = http_get(service.http, "/healthz").await?;
    ensure!(code == 200, "healthz: {code} {body}");

    let workers = [worker("d0"), worker("d1"), worker("p0")];
    let mut workload = Workload::new(&workers, 1);
    let batches: Vec<KvEventBatch> = (0..150).map(|_| workload.batch()).collect();
    for batch in &batches {
        servers.bus.publish_kv_batch(batch).await?;
    }
    let local = local_indexer(&batches);
    // Every batch applies in order: one delta each.
    ensure!(local.delta_seq() == batches.len() as u64);
    let status = wait_for_delta(service.http, local.delta_seq(), Duration::from_secs(20)).await?;
    let digest = digest_hex(local.index().digest());
    ensure!(
        status["digest"] == digest,
        "status {status} vs local {digest}"
    );
    ensure!(status["pairs"] == local.index().stats().pairs);

    let deltas = read_deltas(&servers.bus, 1, local.delta_seq()).await?;
    check_sources(&deltas)?;
    // The service's deltas carry bus's message ids: republished through
    // `Bus::publish_delta`, the last one is a no-op.
    servers.bus.publish_delta(deltas.last().unwrap()).await?;
    ensure!(servers.bus.last_delta_seq().await? == local.delta_seq());
    let replica = replica_at(&servers.bus, local.delta_seq()).await?;
    ensure!(replica.index().digest() == local.index().digest());

    ensure!(
        service
            .metric("kv_indexer_batches_total{status=\"new_epoch\"}")
            .await?
            == 3.0
    );
    ensure!(
        service
            .metric("kv_indexer_batches_total{status=\"applied\"}")
            .await?
            == 147.0
    );
    let events: usize = batches.iter().map(KvEventBatch::block_events).sum();
    ensure!(service.metric("kv_indexer_block_events_total").await? == events as f64);
    ensure!(service.metric("kv_indexer_deltas_published_total").await? == 150.0);
    ensure!(service.metric("kv_indexer_index_pairs").await? == local.index().stats().pairs as f64);

    // A republished batch (the agent retrying) is a duplicate: no delta.
    let again = KvEventBatch {
        seq: 149 / 3,
        ..batches[149].clone()
    };
    servers
        .bus
        .jetstream()
        .publish(subjects::kv_events(&again.worker), again.encode().into())
        .await?
        .await?;
    wait_for("the duplicate", Duration::from_secs(10), || async {
        let n = service
            .metric("kv_indexer_batches_total{status=\"duplicate\"}")
            .await?;
        Ok((n == 1.0).then_some(()))
    })
    .await?;
    ensure!(service.status().await?["delta_seq"] == local.delta_seq());
    service.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_counted_and_skipped() -> Result<()> {
    let servers = Servers::start().await?;
    let service = Running::start(servers.config()).await?;
    let workers = [worker("d0")];
    let mut workload = Workload::new(&workers, 2);
    let batches: Vec<KvEventBatch> = (0..10).map(|_| workload.batch()).collect();
    let js = servers.bus.jetstream();
    servers.bus.publish_kv_batch(&batches[0]).await?;
    // Garbage, a valid batch of another version, and a batch on another
    // worker's subject.
    js.publish("sy.kv.events.x.0", b"\x00garbage"[..].into())
        .await?
        .await?;
    js.publish("sy.kv.events.x.0", b"\x92\x07\x90"[..].into())
        .await?
        .await?;
    js.publish("sy.kv.events.x.0", batches[1].encode().into())
        .await?
        .await?;
    for batch in &batches[1..] {
        servers.bus.publish_kv_batch(batch).await?;
    }
    let local = local_indexer(&batches);
    let status = wait_for_delta(service.http, local.delta_seq(), Duration::from_secs(20)).await?;
    ensure!(status["digest"] == digest_hex(local.index().digest()));
    ensure!(
        service
            .metric("kv_indexer_malformed_messages_total")
            .await?
            == 3.0
    );
    service.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_cap_evicts_through_deltas() -> Result<()> {
    let servers = Servers::start().await?;
    let mut config = servers.config();
    config.max_blocks = Some(60);
    let service = Running::start(config).await?;
    let workers = [worker("d0"), worker("d1")];
    let mut workload = Workload::new(&workers, 9);
    let batches: Vec<KvEventBatch> = (0..80).map(|_| workload.batch()).collect();
    for batch in &batches {
        servers.bus.publish_kv_batch(batch).await?;
    }
    let mut local = KvIndexer::new(OwnershipIndex::with_max_blocks(60));
    for batch in &batches {
        local.apply(batch.clone());
    }
    let status = wait_for_delta(service.http, local.delta_seq(), Duration::from_secs(20)).await?;
    ensure!(status["blocks"].as_u64() <= Some(60), "{status}");
    ensure!(status["evicted_blocks"].as_u64() > Some(0), "{status}");
    ensure!(
        status["digest"] == digest_hex(local.index().digest()),
        "{status}"
    );
    // Evictions are deltas: a replica without a cap agrees.
    let replica = replica_at(&servers.bus, local.delta_seq()).await?;
    ensure!(replica.index().digest() == local.index().digest());
    service.stop().await
}

fn chain(len: u64) -> Vec<BlockHash> {
    let mut chain = Vec::new();
    for i in 0..len {
        chain.push(BlockHasher::chain(chain.last().copied(), 1000 + i));
    }
    chain
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlap_queries_give_per_worker_depths() -> Result<()> {
    let servers = Servers::start().await?;
    let service = Running::start(servers.config()).await?;
    let blocks = chain(8);
    let store = |name: &str, len: usize, tier: Tier| KvEventBatch {
        worker: worker(name),
        epoch: 1,
        seq: 0,
        events: vec![
            KvEvent::Cleared,
            KvEvent::Stored {
                parent: None,
                blocks: blocks[..len].to_vec(),
                tier,
            },
        ],
    };
    let batches = [
        store("a", 8, Tier::Device),
        store("b", 3, Tier::Device),
        store("c", 5, Tier::Host),
    ];
    for batch in &batches {
        servers.bus.publish_kv_batch(batch).await?;
    }
    wait_for_delta(service.http, 3, Duration::from_secs(20)).await?;

    let client = servers.bus.client();
    let query = OverlapQuery {
        block_hashes: blocks[..6].to_vec(),
    };
    let reply = client
        .request(subjects::INDEX_OVERLAP, query.encode().into())
        .await?;
    ensure!(reply.headers.is_none(), "{:?}", reply.headers);
    let reply = OverlapReply::decode(&reply.payload)?;
    ensure!(reply.delta_seq == 3);
    let depths: Vec<(String, u32, u32, u32)> = reply
        .workers
        .iter()
        .map(|w| (w.worker.to_string(), w.device, w.host, w.disk))
        .collect();
    ensure!(
        depths
            == vec![
                ("a".into(), 6, 6, 6),
                ("b".into(), 3, 3, 3),
                ("c".into(), 0, 5, 5)
            ],
        "{depths:?}"
    );

    // A query nobody holds: no worker. A malformed one: an error header.
    let miss = OverlapQuery {
        block_hashes: vec![BlockHash(42)],
    };
    let reply = client
        .request(subjects::INDEX_OVERLAP, miss.encode().into())
        .await?;
    ensure!(OverlapReply::decode(&reply.payload)?.workers.is_empty());
    let reply = client
        .request(subjects::INDEX_OVERLAP, b"nonsense"[..].into())
        .await?;
    let error = reply
        .headers
        .as_ref()
        .and_then(|h| h.get("Switchyard-Error"))
        .map(|v| v.to_string());
    ensure!(reply.payload.is_empty());
    ensure!(
        error.as_deref().is_some_and(|e| e.contains("OverlapQuery")),
        "{error:?}"
    );
    ensure!(
        service
            .metric("kv_indexer_overlap_queries_total{result=\"malformed\"}")
            .await?
            == 1.0
    );
    ensure!(
        service
            .metric("kv_indexer_overlap_queries_total{result=\"ok\"}")
            .await?
            == 2.0
    );
    service.stop().await
}

/// A stream's byte cap, as the server reports it.
async fn max_bytes(servers: &Servers, stream: &str) -> Result<i64> {
    let mut stream = servers.bus.jetstream().get_stream(stream).await?;
    Ok(stream.info().await?.config.max_bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_indexer_sets_the_streams_retention_or_lowers_it_to_fit() -> Result<()> {
    let servers = Servers::start().await?;
    ensure!(max_bytes(&servers, subjects::DECISIONS_STREAM).await? == -1);

    // Caps the store can reserve are set...
    let service = Running::start(servers.config()).await?;
    ensure!(max_bytes(&servers, subjects::KV_EVENTS_STREAM).await? == 64 << 20);
    ensure!(max_bytes(&servers, subjects::DECISIONS_STREAM).await? == 64 << 20);
    service.stop().await?;

    // ... caps it cannot are refused by JetStream: the indexer lowers them
    // until they fit (halving), and runs; the streams stay capped.
    let mut config = servers.config();
    config.kv_events_max_bytes = 1 << 50;
    config.decisions_max_bytes = 1 << 50;
    let service = Running::start(config).await?;
    let (code, body) = http_get(service.http, "/healthz").await?;
    ensure!(code == 200, "healthz: {code} {body}");
    for stream in [subjects::KV_EVENTS_STREAM, subjects::DECISIONS_STREAM] {
        let cap = max_bytes(&servers, stream).await?;
        ensure!(
            cap >= bus::MIN_FITTED_BYTES as i64 && cap < 1 << 50,
            "{stream}: {cap}"
        );
    }
    service.stop().await?;
    Ok(())
}
