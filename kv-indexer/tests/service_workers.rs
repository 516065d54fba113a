//! The service and the workers' lifecycle: resync after a gap, removal on
//! lease expiry, removal of workers that never registered.

#![cfg(feature = "service")]

mod common;

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use bus::Registry;
use common::*;
use futures::{FutureExt, StreamExt};
use protocol::{subjects, KvEventBatch, Message, ResyncReply};
use tests::fixtures::worker_record as record;

/// The resync requests the indexer sends `worker`'s agent.
async fn resync_requests(
    servers: &Servers,
    worker: &protocol::WorkerId,
) -> Result<async_nats::Subscriber> {
    Ok(servers
        .bus
        .client()
        .subscribe(subjects::resync(worker))
        .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_triggers_a_resync_request() -> Result<()> {
    let servers = Servers::start().await?;
    let d0 = worker("d0");
    let mut requests = resync_requests(&servers, &d0).await?;
    let service = Running::start(servers.config()).await?;

    let mut workload = Workload::new(std::slice::from_ref(&d0), 3);
    let batches: Vec<KvEventBatch> = (0..4).map(|_| workload.batch()).collect();
    servers.bus.publish_kv_batch(&batches[0]).await?;
    servers.bus.publish_kv_batch(&batches[1]).await?;
    // Batch 2 is lost: 3 is a gap.
    servers.bus.publish_kv_batch(&batches[3]).await?;

    let request = tokio::time::timeout(Duration::from_secs(10), requests.next())
        .await
        .context("no resync request")?
        .context("subscription ended")?;
    let reply = ResyncReply {
        worker: d0.clone(),
        epoch: 2,
        blocks: 0,
    };
    servers
        .bus
        .client()
        .publish(
            request.reply.context("no reply subject")?,
            reply.encode().into(),
        )
        .await?;
    // The gap is logged (its cursor move is a delta): 3 deltas.
    wait_for_delta(service.http, 3, Duration::from_secs(10)).await?;
    ensure!(
        service
            .metric("kv_indexer_batches_total{status=\"gap\"}")
            .await?
            == 1.0
    );
    wait_for("the resync reply", Duration::from_secs(10), || async {
        let ok = service
            .metric("kv_indexer_resync_replies_total{result=\"ok\"}")
            .await?;
        Ok((ok == 1.0).then_some(()))
    })
    .await?;
    ensure!(service.metric("kv_indexer_resync_requests_total").await? == 1.0);
    let (_, metrics) = http_get(service.http, "/metrics").await?;
    tests::promtool::check_metrics(&metrics, &[])?;

    // The agent resyncs: a new epoch from Cleared, applied.
    let mut resynced = Workload::new(std::slice::from_ref(&d0), 4).batch();
    resynced.epoch = 2;
    servers.bus.publish_kv_batch(&resynced).await?;
    let status = wait_for_delta(service.http, 4, Duration::from_secs(10)).await?;
    let mut local = local_indexer(&[batches[0].clone(), batches[1].clone(), batches[3].clone()]);
    local.apply(resynced);
    ensure!(status["digest"] == digest_hex(local.index().digest()));
    service.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_and_unregistered_workers_leave_the_index() -> Result<()> {
    let servers = Servers::start().await?;
    let registry = Registry::connect(&[servers.etcd.endpoint()]).await?;
    let alive = registry
        .register(&record("alive"), Duration::from_secs(5))
        .await?;
    let mortal = registry
        .register(&record("mortal"), Duration::from_secs(1))
        .await?;
    let mut config = servers.config();
    config.worker_grace = Duration::from_secs(1);
    let service = Running::start(config).await?;

    let workers = [worker("alive"), worker("mortal"), worker("ghost")];
    let mut workload = Workload::new(&workers, 5);
    let batches: Vec<KvEventBatch> = (0..9).map(|_| workload.batch()).collect();
    for batch in &batches {
        servers.bus.publish_kv_batch(batch).await?;
    }
    let status = wait_for_delta(service.http, 9, Duration::from_secs(10)).await?;
    ensure!(status["workers"] == 3, "{status}");

    // "ghost" never registered: gone after the grace. The lease of
    // "mortal" expires once its keep-alive stops.
    drop(mortal);
    let status = wait_for(
        "ghost and mortal to leave",
        Duration::from_secs(10),
        || async {
            let s = service.status().await?;
            Ok((s["workers"] == 1).then_some(s))
        },
    )
    .await?;
    let blocks = &status["worker_blocks"];
    ensure!(blocks.get("alive").is_some(), "{status}");
    ensure!(
        status["pairs"] == blocks["alive"],
        "only alive's blocks are left: {status}"
    );
    ensure!(
        service
            .metric("kv_indexer_workers_removed_total{reason=\"lease_expired\"}")
            .await?
            == 1.0
    );
    ensure!(
        service
            .metric("kv_indexer_workers_removed_total{reason=\"unregistered\"}")
            .await?
            == 1.0
    );
    // The removals are deltas: a replica agrees.
    let seq = status["delta_seq"].as_u64().unwrap();
    wait_for_delta(service.http, seq, Duration::from_secs(10)).await?;
    let replica = replica_at(&servers.bus, seq).await?;
    ensure!(digest_hex(replica.index().digest()) == status["digest"]);
    alive.revoke().await?;
    service.stop().await
}

/// An agent alive all along whose lease lapsed (etcd unreachable for
/// longer than its TTL) registers again under a new lease: the index
/// dropped its blocks, so it is asked for them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_lease_lapsed_is_asked_to_resync_when_it_registers_again() -> Result<()> {
    let servers = Servers::start().await?;
    let registry = Registry::connect(&[servers.etcd.endpoint()]).await?;
    let d0 = worker("d0");
    let lapsing = registry
        .register(&record("d0"), Duration::from_secs(1))
        .await?;
    let mut requests = resync_requests(&servers, &d0).await?;
    let service = Running::start(servers.config()).await?;
    let mut workload = Workload::new(std::slice::from_ref(&d0), 9);
    for _ in 0..3 {
        servers.bus.publish_kv_batch(&workload.batch()).await?;
    }
    wait_for_delta(service.http, 3, Duration::from_secs(10)).await?;

    drop(lapsing);
    wait_for("d0 to leave", Duration::from_secs(10), || async {
        let s = service.status().await?;
        Ok((s["workers"] == 0).then_some(()))
    })
    .await?;
    ensure!(
        requests.next().now_or_never().is_none(),
        "asked to resync before it registered again"
    );
    let again = registry
        .register(&record("d0"), Duration::from_secs(5))
        .await?;
    let request = tokio::time::timeout(Duration::from_secs(10), requests.next())
        .await
        .context("no resync request after it registered again")?
        .context("subscription ended")?;
    ensure!(request.reply.is_some());
    ensure!(service.metric("kv_indexer_workers_returned_total").await? == 1.0);
    again.revoke().await?;
    service.stop().await
}
