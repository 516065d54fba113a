//! Admission at the door: while every decode worker is busy, a request
//! waits in the bounded queue; past the bound (or its longest wait) it is
//! turned away with 429, `Retry-After` and OpenAI's error shape, and
//! nothing was reserved for it. A freed worker lets the queue through.

mod service_support;

use std::time::{Duration, Instant};

use anyhow::Result;
use protocol::{subjects, LoadReport, Message, Role};
use service_support::*;

/// Publishes a load report of `worker` with `waiting` requests queued in
/// its engine (busy from `busy_waiting`, 16 by default).
async fn report(cluster: &Cluster, worker: &str, waiting: u32) -> Result<()> {
    let report = LoadReport {
        waiting,
        ..LoadReport::idle(id(worker), 100_000, 0)
    };
    let client = cluster.bus.client();
    client
        .publish(subjects::load(&id(worker)), report.encode().into())
        .await?;
    client.flush().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_router_queues_then_turns_away_with_429() -> Result<()> {
    let cluster = Cluster::start().await?;
    let mut worker =
        FakeWorker::start(&cluster, record("d0", Role::Decode), Behavior::Serve).await?;
    let mut config = cluster.config("r1");
    config.admission.max_queued = 1;
    config.admission.max_wait_ms = 1_500;
    config.admission.retry_after_s = 3;
    let router = RouterHandle::ready(config).await?;
    router.wait_workers(1).await?;
    let body = serde_json::json!({"prompt": tokens(3, 40), "max_tokens": 2});

    // d0 says 40 requests wait in its engine: every decode worker is busy.
    report(&cluster, "d0", 40).await?;
    wait_for("d0 to look busy", || async {
        let ledger = router.ledger().await.ok()?;
        (ledger["workers"][0]["effective_kv_blocks_used"].is_number()).then_some(())
    })
    .await?;
    let metrics = router.get_text("/metrics").await?;
    assert!(metrics.contains("router_admission_queued 0"), "{metrics}");

    // The first request waits at the door...
    let queued = tokio::spawn({
        let (http, url, body) = (
            router.http.clone(),
            router.url("/v1/completions"),
            body.clone(),
        );
        async move { http.post(url).json(&body).send().await }
    });
    wait_for("a request in the queue", || async {
        let m = router.get_text("/metrics").await.ok()?;
        m.contains("router_admission_queued 1").then_some(())
    })
    .await?;
    // ...and nothing is reserved for it.
    assert_eq!(router.ledger().await?["in_flight"], 0);

    // The queue holds one: the next is turned away at once.
    let started = Instant::now();
    let r = router.post("/v1/completions", body.clone()).await?;
    assert_eq!(r.status(), 429);
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(r.headers()["retry-after"], "3");
    let error: serde_json::Value = r.json().await?;
    assert_eq!(error["error"]["type"], "rate_limit_error", "{error}");
    assert_eq!(error["error"]["code"], 429);
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("busy")),
        "{error}"
    );
    assert!(
        worker.no_request(),
        "a turned-away request reached a worker"
    );

    // d0 frees up: the queued request goes through.
    report(&cluster, "d0", 0).await?;
    let r = queued.await??;
    assert_eq!(r.status(), 200);
    worker.next_request().await?;
    let metrics = router.get_text("/metrics").await?;
    for series in [
        r#"router_admission_total{outcome="queued"} 1"#,
        r#"router_admission_total{outcome="rejected"} 1"#,
        r#"router_route_errors_total{reason="saturated"} 1"#,
        "router_admission_queued 0",
    ] {
        assert!(metrics.contains(series), "no {series}:\n{metrics}");
    }

    // Busy again, and it stays busy: the queued request is turned away
    // after its longest wait (1.5 s, expired on the 100 ms tick).
    report(&cluster, "d0", 40).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let r = router.post("/v1/completions", body.clone()).await?;
    let waited = started.elapsed();
    assert_eq!(r.status(), 429);
    assert!(
        waited >= Duration::from_millis(1_400) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
    let metrics = router.get_text("/metrics").await?;
    assert!(
        metrics.contains(r#"router_admission_total{outcome="timed_out"} 1"#),
        "{metrics}"
    );
    assert_eq!(router.ledger().await?["in_flight"], 0);
    router.stop().await
}
