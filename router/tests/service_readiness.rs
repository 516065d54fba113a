//! `/readyz` tells the truth: it fails while NATS is disconnected, while
//! no kv-indexer pulls the KV events and no delta came for longer than the
//! bound, and while no decode-capable worker is accepted; its text carries
//! the live delta position.

mod service_support;

use std::time::Duration;

use anyhow::Result;
use async_nats::jetstream::consumer::pull;
use futures::StreamExt;
use protocol::{subjects, Role};
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
