//! `/readyz` tells the truth: it fails while NATS is disconnected, while
//! no kv-indexer pulls the KV events and no delta came for longer than the
//! bound, and while no decode-capable worker is accepted; its text carries
//! the live delta position.

mod service_support;

use std::time::Duration;

use anyhow::{Context, Result};
use async_nats::jetstream::consumer::pull;
use futures::StreamExt;
use protocol::{subjects, Message, Role};
use service_support::*;

async fn readyz(router: &RouterHandle) -> Result<(u16, String)> {
    let r = router.http.get(router.url("/readyz")).send().await?;
    let status = r.status().as_u16();
    let body: serde_json::Value = r.json().await?;
    Ok((
        status,
        body["status"].as_str().unwrap_or_default().to_owned(),
    ))
}

/// Waits until `/readyz` answers `status` with a text containing `text`.
async fn wait_readyz(router: &RouterHandle, status: u16, text: &str) -> Result<String> {
    wait_for(&format!("/readyz {status} with {text:?}"), || async {
        let (s, body) = readyz(router).await.ok()?;
        (s == status && body.contains(text)).then_some(body)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_nats_the_indexer_and_the_workers() -> Result<()> {
    let mut cluster = Cluster::start().await?;
    let mut config = cluster.config("r1");
    config.readiness.max_quiet = Duration::from_secs(1);
    config.timeouts.tick = Duration::from_millis(100);

    // An indexer's KV consumer with a pull request waiting: what a running
    // kv-indexer looks like to the routers.
    let indexer_client = async_nats::connect(cluster.nats.url()).await?;
    let js = async_nats::jetstream::new(indexer_client.clone());
    let consumer = js
        .get_stream(subjects::KV_EVENTS_STREAM)
        .await?
        .create_consumer(pull::Config {
            durable_name: Some(subjects::KV_INDEXER_CONSUMER.into()),
            ..Default::default()
        })
        .await?;
    let mut pulling = consumer
        .stream()
        .expires(Duration::from_secs(30))
        .messages()
        .await?;
    let puller = tokio::spawn(async move { while pulling.next().await.is_some() {} });

    // No decode-capable worker: not ready, and the text says so.
    let router = RouterHandle::loaded(config).await?;
    let body = wait_readyz(&router, 503, "no decode-capable worker accepted").await?;
    assert!(body.contains("index at delta 0 of 0"), "{body}");
    let prefill = FakeWorker::start(&cluster, record("p0", Role::Prefill), Behavior::Serve).await?;
    router.wait_workers(1).await?;
    wait_readyz(&router, 503, "no decode-capable worker accepted").await?;
    let _decode = FakeWorker::start(&cluster, record("d0", Role::Decode), Behavior::Serve).await?;
    wait_readyz(&router, 200, "1 decode-capable workers").await?;

    // The live delta position.
    let mut indexer = Indexer::new(&cluster);
    indexer.store("d0", &tokens(1, 64)).await?;
    indexer.store("d0", &tokens(2, 64)).await?;
    wait_readyz(&router, 200, "index at delta 2 of 2").await?;
    // Quiet for longer than the bound, but an indexer pulls: ready.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(readyz(&router).await?.0, 200);

    // The indexer gone (its connection and pull request with it) and no
    // delta for longer than the bound: not ready.
    puller.abort();
    drop(indexer_client);
    drop(js);
    let body = wait_readyz(&router, 503, "no kv-indexer is pulling").await?;
    assert!(body.contains("index at delta 2 of 2"), "{body}");
    // A delta arrives (an indexer is back): ready again.
    indexer.store("d0", &tokens(3, 64)).await?;
    wait_readyz(&router, 200, "index at delta 3 of 3").await?;

    // NATS down: not ready, saying why; back: ready.
    tokio::task::block_in_place(|| cluster.nats.stop())?;
    wait_readyz(&router, 503, "NATS is disconnected").await?;
    tokio::task::block_in_place(|| cluster.nats.restart())?;
    wait_readyz(&router, 200, "ready").await?;
    drop(prefill);
    router.stop().await
}

/// A router's delta feed is an ordered consumer, which lives on one NATS
/// node: when that node dies the feed stands still while the router's own
/// connection (to another node) is fine, and the client would notice only
/// after 10 s of missed heartbeats. Deleting the consumer on the server
/// does the same here: the router sees the stream's head move ahead of its
/// index with no delta coming and opens the feed again within about
/// `max_delta_stall` plus a tick, not 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_feed_whose_consumer_died_is_opened_again() -> Result<()> {
    let cluster = Cluster::start().await?;
    let mut config = cluster.config("r1");
    config.readiness.max_delta_stall = Duration::from_millis(500);
    config.timeouts.tick = Duration::from_millis(100);
    let _decode = FakeWorker::start(&cluster, record("d0", Role::Decode), Behavior::Serve).await?;
    let router = RouterHandle::ready(config).await?;
    let mut indexer = Indexer::new(&cluster);
    indexer.store("d0", &tokens(1, 64)).await?;
    wait_readyz(&router, 200, "index at delta 1 of 1").await?;

    // The router's consumers of the delta stream vanish (their node died).
    let js = async_nats::jetstream::new(async_nats::connect(cluster.nats.url()).await?);
    let mut stream = js.get_stream(subjects::INDEX_DELTAS_STREAM).await?;
    let mut names = stream.consumer_names();
    let mut deleted = 0;
    while let Some(name) = names.next().await {
        stream.delete_consumer(&name?).await?;
        deleted += 1;
    }
    assert!(deleted > 0, "the router follows deltas through a consumer");
    let started = std::time::Instant::now();
    indexer.store("d0", &tokens(2, 64)).await?;
    indexer.store("d0", &tokens(3, 64)).await?;
    wait_readyz(&router, 200, "index at delta 3 of 3").await?;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(5), "caught up after {took:?}");
    let metrics = router.get_text("/metrics").await?;
    assert!(
        metrics.contains("router_deltas_total{outcome=\"stalled\"} 1"),
        "{metrics}"
    );
    let _ = stream.info().await?;
    router.stop().await
}

/// The indexer announces each delta on core NATS as it makes it: a router
/// applies it before the stream holds it (the stream takes no write while
/// it elects a leader), checks it when the stream gives it, and loads the
/// index again when the stream's delta at that place is another one (the
/// announcing indexer died before the stream stored it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_deltas_are_applied_ahead_of_the_stream_and_checked_against_it() -> Result<()> {
    let cluster = Cluster::start().await?;
    let _decode = FakeWorker::start(&cluster, record("d0", Role::Decode), Behavior::Serve).await?;
    let router = RouterHandle::ready(cluster.config("r1")).await?;
    let mut indexer = Indexer::new(&cluster);
    let first = indexer.next_delta("d0", &tokens(1, 64))?;
    cluster.bus.publish_delta(&first).await?;
    wait_readyz(&router, 200, "index at delta 1 of 1").await?;
    let client = cluster.bus.client();
    let announce = |delta: &protocol::IndexDelta| {
        client.publish(subjects::INDEX_DELTAS_LIVE, delta.encode().into())
    };
    // Deltas 2 and 3 announced only, 3 first (2's announcement came late):
    // both applied, the stream still ending at 1.
    let second = indexer.next_delta("d0", &tokens(2, 64))?;
    let third = indexer.next_delta("d0", &tokens(3, 64))?;
    let mut asks = client.subscribe(subjects::INDEX_REANNOUNCE).await?;
    announce(&third).await?;
    // Held early: the router asks the indexer to announce its unconfirmed
    // deltas again.
    tokio::time::timeout(Duration::from_secs(10), asks.next())
        .await?
        .context("the router did not ask for the missed announcements")?;
    announce(&second).await?;
    let ledger = at_delta(&router, 3).await?;
    assert_eq!(
        ledger["index_digest"],
        format!("{:016x}", indexer.snapshot().digest),
        "the index the indexer holds"
    );
    assert_eq!(cluster.bus.last_delta_seq().await?, 1);
    // The stream then holds them: confirmed, nothing applied twice.
    cluster.bus.publish_delta(&second).await?;
    cluster.bus.publish_delta(&third).await?;
    counted(&router, "confirmed", 2).await?;

    // Delta 4 announced, but the stream's delta 4 is another one: the
    // router holds what the record does not, and loads the index again.
    let announced = indexer.next_delta("d0", &tokens(4, 64))?;
    announce(&announced).await?;
    at_delta(&router, 4).await?;
    let mut recorded = announced.clone();
    for change in &mut recorded.changes {
        if let protocol::IndexChange::Stored { blocks, .. } = change {
            blocks.truncate(1);
        }
    }
    assert_ne!(recorded, announced);
    cluster.bus.publish_delta(&recorded).await?;
    counted(&router, "superseded", 1).await?;
    let mut expected = kv_indexer::IndexReplica::new();
    for delta in [&first, &second, &third, &recorded] {
        expected.apply(delta)?;
    }
    wait_for("the stream's index", || async {
        let ledger = router.ledger().await.ok()?;
        (ledger["applied_delta"].as_u64() == Some(4)
            && ledger["index_digest"] == format!("{:016x}", expected.index().digest()))
        .then_some(())
    })
    .await?;
    router.stop().await
}

/// Waits for the router's index at delta `seq`; its ledger view.
async fn at_delta(router: &RouterHandle, seq: u64) -> Result<serde_json::Value> {
    wait_for(&format!("the router at delta {seq}"), || async {
        let ledger = router.ledger().await.ok()?;
        (ledger["applied_delta"].as_u64() == Some(seq)).then_some(ledger)
    })
    .await
}

/// Waits for `n` deltas counted with `outcome`.
async fn counted(router: &RouterHandle, outcome: &str, n: u64) -> Result<()> {
    let line = format!("router_deltas_total{{outcome=\"{outcome}\"}} {n}");
    wait_for(&line, || async {
        let metrics = router.get_text("/metrics").await.ok()?;
        metrics.contains(&line).then_some(())
    })
    .await
}
