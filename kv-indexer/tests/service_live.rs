//! KV batches announced on core NATS, on a real nats-server: the next
//! batch of a worker's epoch is applied ahead of the KV-event stream, and
//! its stream copy is then a duplicate; a batch that is not next (a gap, a
//! new epoch) is left to the stream, which applies it in order, with no
//! resync asked (after a gap the agents are asked to announce their recent
//! batches again); a batch announced on another worker's subject is
//! rejected.

mod common;

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use common::{digest_hex, local_indexer, wait_for, wait_for_delta, worker, Running, Servers};
use futures::StreamExt;
use protocol::{subjects, KvEventBatch, Message};

async fn announce(servers: &Servers, subject: String, batch: &KvEventBatch) -> Result<()> {
    servers
        .bus
        .client()
        .publish(subject, batch.encode().into())
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_batches_are_applied_ahead_of_the_stream_when_next() -> Result<()> {
    let servers = Servers::start().await?;
    let service = Running::start(servers.config()).await?;
    let mut workload = common::Workload::new(&[worker("d0"), worker("d1")], 7);
    let mut batches: Vec<KvEventBatch> = (0..10).map(|_| workload.batch()).collect();
    // The loop answers /status once it has subscribed.
    service.status().await?;
    // Each worker's first batch (a new epoch) goes to the stream only: an
    // announced new epoch is left to the stream's order.
    announce(
        &servers,
        subjects::kv_events_live(&batches[0].worker),
        &batches[0],
    )
    .await?;
    wait_for(
        "the new epoch left to the stream",
        Duration::from_secs(10),
        || async {
            let left = service
                .metric("kv_indexer_live_batches_total{outcome=\"left_to_stream\"}")
                .await?;
            Ok((left == 1.0).then_some(()))
        },
    )
    .await?;
    ensure!(
        service.status().await?["delta_seq"] == 0,
        "a new epoch waits for the stream"
    );
    for batch in &batches[..2] {
        servers.bus.publish_kv_batch(batch).await?;
    }
    wait_for_delta(service.http, 2, Duration::from_secs(10)).await?;

    // The next eight announced only: applied without the stream.
    for batch in &batches[2..10] {
        announce(&servers, subjects::kv_events_live(&batch.worker), batch).await?;
    }
    let local = local_indexer(&batches[..10]);
    let status = wait_for(
        "the announced batches applied",
        Duration::from_secs(10),
        || async {
            let status = service.status().await?;
            Ok((status["delta_seq"].as_u64() == Some(local.delta_seq())).then_some(status))
        },
    )
    .await?;
    ensure!(
        status["digest"] == digest_hex(local.index().digest()),
        "{status}"
    );
    ensure!(
        status["kv_stream_seq"] == 2,
        "read from the stream: {status}"
    );
    ensure!(
        status["worker_cursors"]["d1"]["last_seq"] == 4,
        "d1 at its fifth batch: {status}"
    );
    ensure!(
        service
            .metric("kv_indexer_live_batches_total{outcome=\"applied\"}")
            .await?
            == 8.0
    );

    // Their stream copies: duplicates, no new delta.
    for batch in &batches[2..10] {
        servers.bus.publish_kv_batch(batch).await?;
    }
    let status = wait_for(
        "the stream copies read",
        Duration::from_secs(10),
        || async {
            let status = service.status().await?;
            Ok((status["kv_stream_seq"] == 10).then_some(status))
        },
    )
    .await?;
    ensure!(
        status["delta_seq"].as_u64() == Some(local.delta_seq()),
        "{status}"
    );
    ensure!(
        service
            .metric("kv_indexer_batches_total{status=\"duplicate\"}")
            .await?
            == 8.0
    );

    // d0's next two batches announced out of order: the second is not
    // next (left to the stream, no resync), the first is.
    let (ten, eleven) = (workload.batch_of(0), workload.batch_of(0));
    batches.extend([ten.clone(), eleven.clone()]);
    let d0 = subjects::kv_events_live(&ten.worker);
    let mut asked = servers
        .bus
        .client()
        .subscribe(subjects::kv_reannounce(&ten.worker))
        .await?;
    servers.bus.client().flush().await?;
    announce(&servers, d0.clone(), &eleven).await?;
    // The gap makes the indexer ask d0's agent to announce again what
    // follows its position (d0's fifth batch, seq 4).
    let request = tokio::time::timeout(Duration::from_secs(5), asked.next())
        .await
        .context("no request to announce again after a gap")?
        .context("the subscription ended")?;
    ensure!(
        subjects::parse_kv_reannounce_body(&request.payload) == Some((ten.epoch, 4)),
        "{:?}",
        request.payload
    );
    // d0's batch on d1's subject: rejected.
    announce(&servers, subjects::kv_events_live(&worker("d1")), &ten).await?;
    announce(&servers, d0, &ten).await?;
    let local = local_indexer(&batches[..11]);
    wait_for("batch 10 applied", Duration::from_secs(10), || async {
        let status = service.status().await?;
        Ok((status["delta_seq"].as_u64() == Some(local.delta_seq())).then_some(()))
    })
    .await?;
    ensure!(
        service
            .metric("kv_indexer_batches_rejected_total{reason=\"wrong_subject\"}")
            .await?
            == 1.0
    );
    ensure!(service.metric("kv_indexer_resync_requests_total").await? == 0.0);
    for batch in [&ten, &eleven] {
        servers.bus.publish_kv_batch(batch).await?;
    }
    let local = local_indexer(&batches);
    let status = wait_for_delta(service.http, local.delta_seq(), Duration::from_secs(10)).await?;
    ensure!(
        status["digest"] == digest_hex(local.index().digest()),
        "{status}"
    );
    let left = service
        .metric("kv_indexer_live_batches_total{outcome=\"left_to_stream\"}")
        .await?;
    ensure!(
        left == 2.0,
        "left to the stream: {left}, not the new epoch and batch 11"
    );
    service.stop().await
}
