//! Start-up: the snapshot, the deltas after it, a gap in the delta stream,
//! readiness, health, shutdown, configuration errors.

mod service_support;

use std::time::{Duration, Instant};

use anyhow::Result;
use protocol::Role;
use router::service::{self, Args, Config, ServiceError};
use service_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_after_catching_up_from_snapshot_and_deltas_across_a_gap() -> Result<()> {
    let cluster = Cluster::start().await?;
    let mut indexer = Indexer::new(&cluster);
    for i in 0..4 {
        indexer.store("d0", &tokens(i, 64)).await?;
    }
    let early = indexer.snapshot();
    for i in 4..8 {
        indexer.store("d0", &tokens(i, 64)).await?;
    }
    let late = indexer.snapshot();
    for i in 8..10 {
        indexer.store("d0", &tokens(i, 64)).await?;
    }
    assert_eq!((early.delta_seq, late.delta_seq), (4, 8));
    // Deltas 1..=6 are trimmed: the early snapshot cannot be followed.
    cluster.bus.put_snapshot(&early).await?;
    cluster.bus.trim_deltas(6).await?;
    let _worker = FakeWorker::start(&cluster, record("d0", Role::Decode), Behavior::Serve).await?;

    let mut config = cluster.config("r1");
    config.admission.max_wait_ms = 1_500;
    config.admission.retry_after_s = 2;
    let router = RouterHandle::start(config).await?;
    let health = router.http.get(router.url("/healthz")).send().await?;
    assert_eq!(health.status(), 200);
    // Not ready: the gap makes it reload the (same) early snapshot.
    let reason = wait_for("a 503 from /readyz", || async {
        let r = router.http.get(router.url("/readyz")).send().await.ok()?;
        (r.status() == 503).then_some(())?;
        let body: serde_json::Value = r.json().await.ok()?;
        Some(body["status"].as_str()?.to_owned())
    })
    .await?;
    assert!(
        reason.contains("snapshot") || reason.contains("catching up"),
        "{reason}"
    );
    wait_for("a reload after the gap", || async {
        let m = router.get_text("/metrics").await.ok()?;
        m.contains("router_index_reloads_total{reason=\"gap\"}")
            .then_some(())
    })
    .await?;
    let r = router.http.get(router.url("/readyz")).send().await?;
    assert_eq!(r.status(), 503, "still not ready while the gap lasts");

    // A request to a replica still starting waits at the door (it would
    // find no worker yet); after its longest wait it is told to come back.
    let body = serde_json::json!({"prompt": tokens(3, 40), "max_tokens": 2});
    let started = Instant::now();
    let r = router.post("/v1/completions", body.clone()).await?;
    let waited = started.elapsed();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "2");
    assert!(waited >= Duration::from_millis(1_400), "{waited:?}");
    let error: serde_json::Value = r.json().await?;
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("still starting")),
        "{error}"
    );
    // The next one waits, and is served once the replica has started.
    let held = tokio::spawn({
        let (http, url) = (router.http.clone(), router.url("/v1/completions"));
        async move { http.post(url).json(&body).send().await }
    });
    wait_for("a request held at the door", || async {
        let m = router.get_text("/metrics").await.ok()?;
        m.contains("router_admission_queued 1").then_some(())
    })
    .await?;

    // The indexer writes a snapshot that covers the trimmed deltas.
    cluster.bus.put_snapshot(&late).await?;
    router.wait_ready().await?;
    assert_eq!(held.await??.status(), 200);
    let ledger = router.ledger().await?;
    assert_eq!(ledger["applied_delta"], 10);
    let metrics = router.get_text("/metrics").await?;
    assert!(
        metrics.contains("router_deltas_total{outcome=\"applied\"} 2"),
        "{metrics}"
    );
    tests::promtool::check_metrics(&metrics, &[])?;
    let body: serde_json::Value = router
        .http
        .get(router.url("/readyz"))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(body["ready"], true);

    let started = Instant::now();
    router.stop().await?;
    assert!(started.elapsed() < Duration::from_secs(5));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_deployment_is_not_ready_and_catches_up_on_new_deltas() -> Result<()> {
    let cluster = Cluster::start().await?;
    let router = RouterHandle::loaded(cluster.config("r1")).await?;
    let readyz = router.http.get(router.url("/readyz")).send().await?;
    assert_eq!(readyz.status(), 503);
    assert!(readyz
        .text()
        .await?
        .contains("no decode-capable worker accepted"));
    assert_eq!(router.ledger().await?["applied_delta"], 0);
    // No snapshot ever: the replica follows the deltas from 1.
    let mut indexer = Indexer::new(&cluster);
    indexer.store("d0", &tokens(1, 64)).await?;
    indexer.store("d1", &tokens(2, 64)).await?;
    wait_for("the deltas applied", || async {
        (router.ledger().await.ok()?["applied_delta"] == 2).then_some(())
    })
    .await?;
    router.stop().await
}

#[tokio::test]
async fn start_up_errors_are_clear() -> Result<()> {
    // A tokenizer that does not exist: refused before anything else.
    // (An unreachable NATS is waited for: `bus::CONNECT_PATIENCE`.)
    let mut config = Config::new("nats://127.0.0.1:1", &["http://127.0.0.1:1".into()], MODEL)?;
    config.tokenizer = Some("/nonexistent/tokenizer.json".into());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let e = service::run(config, listener, std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(e, ServiceError::Tokenizer(_)), "{e}");
    assert!(e.to_string().contains("/nonexistent/tokenizer.json"), "{e}");

    // Invalid settings name the key.
    let mut args = Args::from_file(None);
    args.set("model", MODEL).set("gate.budget_fraction", -1.0);
    let e = Config::from_args(&args).unwrap_err();
    assert!(
        e.to_string().starts_with("gate.budget_fraction = -1"),
        "{e}"
    );
    Ok(())
}

/// SIGTERM with a drain notice: `/readyz` says "draining" at once while
/// requests are still served, so a load balancer can stop sending; then
/// the listener closes and the replica stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_replica_says_so_and_serves_through_its_notice() -> Result<()> {
    let cluster = Cluster::start().await?;
    let _worker = FakeWorker::start(&cluster, record("d0", Role::Decode), Behavior::Serve).await?;
    let mut config = cluster.config("r1");
    config.timeouts.drain_notice = Duration::from_millis(1500);
    let router = RouterHandle::ready(config).await?;
    router.wait_workers(1).await?;
    let (http, readyz, completions) = (
        router.http.clone(),
        router.url("/readyz"),
        router.url("/v1/completions"),
    );
    let started = Instant::now();
    let stopping = tokio::spawn(router.stop());
    let body = wait_for("/readyz to say draining", || async {
        let r = http.get(&readyz).send().await.ok()?;
        (r.status() == 503).then_some(())?;
        r.text().await.ok().filter(|b| b.contains("draining"))
    })
    .await?;
    assert!(body.contains("\"ready\":false"), "{body}");
    let served = http
        .post(&completions)
        .json(&serde_json::json!({"prompt": tokens(4, 40), "max_tokens": 2}))
        .send()
        .await?;
    assert_eq!(served.status(), 200, "still served during the notice");
    stopping.await??;
    assert!(
        started.elapsed() >= Duration::from_millis(1400),
        "stopped before its notice: {:?}",
        started.elapsed()
    );
    assert!(
        http.get(&readyz).send().await.is_err(),
        "still accepting after the drain"
    );
    Ok(())
}
