//! Two replicas: every decision reaches the other replica's in-flight
//! ledger through the decision log, and its release through the progress
//! notices.

mod service_support;

use std::sync::Arc;

use anyhow::Result;
use protocol::Role;
use service_support::*;
use tokio::sync::Notify;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_of_one_replica_is_in_the_other_replicas_ledger() -> Result<()> {
    let cluster = Cluster::start().await?;
    let release = Arc::new(Notify::new());
    let mut worker = FakeWorker::start(
        &cluster,
        record("d0", Role::Decode),
        Behavior::Hold(release.clone()),
    )
    .await?;
    let a = RouterHandle::ready(cluster.config("ra")).await?;
    let b = RouterHandle::ready(cluster.config("rb")).await?;
    a.wait_workers(1).await?;
    b.wait_workers(1).await?;

    let url = a.url("/v1/completions");
    let http = a.http.clone();
    let request = tokio::spawn(async move {
        http.post(url)
            .json(&serde_json::json!({"prompt": tokens(1, 100), "max_tokens": 4}))
            .send()
            .await
    });
    let decision = worker.next_request().await?.annotation.decision;

    // In flight: charged on both replicas.
    for replica in [&a, &b] {
        wait_for("the decision charged", || async {
            let ledger = replica.ledger().await.ok()?;
            let d0 = &ledger["workers"][0];
            (ledger["in_flight"] == 1
                && d0["charged_requests"] == 1
                && d0["charged_decode_blocks"] == 7
                && d0["charged_cache_blocks"] == 7)
                .then_some(())
        })
        .await?;
    }
    let known: serde_json::Value = b
        .http
        .get(b.url(&format!("/debug/ledger?decision={decision}")))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(known["knows_decision"], true);

    // Finished: released on both.
    release.notify_one();
    let r = request.await??;
    assert_eq!(r.status(), 200);
    for replica in [&a, &b] {
        wait_for("the decision released", || async {
            let ledger = replica.ledger().await.ok()?;
            (ledger["in_flight"] == 0 && ledger["workers"][0]["charged_requests"] == 0)
                .then_some(())
        })
        .await?;
    }
    let metrics = b.get_text("/metrics").await?;
    assert!(
        metrics.contains("router_peer_messages_total{kind=\"decision\",outcome=\"applied\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("router_decision_log_lag_seconds_count 1"));
    a.stop().await?;
    b.stop().await
}
