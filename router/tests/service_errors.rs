//! What goes wrong: bad requests, no worker, workers that fail, stay
//! silent or lose chunks, workers that hash differently.

mod service_support;

use std::time::{Duration, Instant};

use anyhow::Result;
use protocol::Role;
use service_support::*;

async fn error_of(r: reqwest::Response) -> Result<(u16, serde_json::Value)> {
    let status = r.status().as_u16();
    let body: serde_json::Value = r.json().await?;
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    Ok((status, body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_a_4xx_with_a_message_and_no_worker_a_503() -> Result<()> {
    let cluster = Cluster::start().await?;
    let mut config = cluster.config("r1");
    config.max_body_bytes = 4096;
    let router = RouterHandle::loaded(config).await?;
    let post_raw = |path: &'static str, body: &'static str| {
        router
            .http
            .post(router.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    for (path, body, needle) in [
        (
            "/v1/completions",
            "{\"prompt\": [1, 2",
            "invalid request body",
        ),
        ("/v1/route", "not json", "invalid request body"),
        ("/v1/completions", "", "empty"),
        ("/v1/completions", "{\"prompt\": []}", "prompt is empty"),
        ("/v1/completions", "{\"prompt\": \"hello\"}", "no tokenizer"),
        (
            "/v1/route",
            "{\"prompt\": [1], \"max_tokens\": 0}",
            "max_tokens",
        ),
        (
            "/v1/completions",
            "{\"prompt\": [[1], [[2]]]}",
            "nest one level",
        ),
        ("/v1/completions", "{\"prompt\": [1, -1]}", "negative"),
        ("/v1/completions", "{\"max_tokens\": 3}", "prompt"),
    ] {
        let (status, body) = error_of(post_raw(path, body).await?).await?;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
    let (status, _) = error_of(
        router
            .http
            .get(router.url("/v1/completions"))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, 405);
    let (status, _) = error_of(router.http.get(router.url("/nowhere")).send().await?).await?;
    assert_eq!(status, 404);

    // No worker registered: 503 with the reason.
    let (status, body) = error_of(
        router
            .post("/v1/completions", serde_json::json!({"prompt": [1, 2, 3]}))
            .await?,
    )
    .await?;
    assert_eq!(status, 503);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("no decode-capable worker"), "{message}");
    let metrics = router.get_text("/metrics").await?;
    assert!(metrics.contains("router_route_errors_total{reason=\"no_decode_worker\"} 1"));
    assert!(
        metrics.contains("router_http_requests_total{route=\"/v1/completions\",status=\"400\"}")
    );
    router.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_times_out_and_a_broken_stream_is_a_502() -> Result<()> {
    let cluster = Cluster::start().await?;
    let mut silent =
        FakeWorker::start(&cluster, record("d0", Role::Decode), Behavior::Silent).await?;
    let router = RouterHandle::ready(cluster.config("r1")).await?;
    router.wait_workers(1).await?;

    // First-chunk timeout 1 s; no other worker to retry on: 504.
    let started = Instant::now();
    let (status, body) = error_of(
        router
            .post(
                "/v1/completions",
                serde_json::json!({"prompt": [1, 2, 3], "max_tokens": 2}),
            )
            .await?,
    )
    .await?;
    assert_eq!(status, 504, "{body}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("d0") && message.contains("no retry"),
        "{message}"
    );
    assert_eq!(body["switchyard"]["decode"], "d0");
    silent.next_request().await?;
    // Streamed: the same status, before any event.
    let r = router
        .post(
            "/v1/completions",
            serde_json::json!({"prompt": [1, 2, 3], "max_tokens": 2, "stream": true}),
        )
        .await?;
    assert_eq!(r.status(), 504);
    assert!(r.headers().contains_key("x-switchyard-decision"));
    silent.deregister().await?;
    router.wait_workers(0).await?;

    // A stream that skips a chunk: 502, not retried (tokens may be lost).
    let _skipper =
        FakeWorker::start(&cluster, record("d1", Role::Decode), Behavior::SkipChunk).await?;
    router.wait_workers(1).await?;
    let (status, body) = error_of(
        router
            .post(
                "/v1/completions",
                serde_json::json!({"prompt": [1, 2, 3], "max_tokens": 6}),
            )
            .await?,
    )
    .await?;
    assert_eq!(status, 502, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("lost chunk 1"),
        "{body}"
    );

    let metrics = router.get_text("/metrics").await?;
    assert!(
        metrics.contains("router_dispatch_total{outcome=\"first_chunk_timeout\"} 2"),
        "{metrics}"
    );
    assert!(metrics.contains("router_dispatch_total{outcome=\"missing_chunk\"} 1"));
    wait_for("the ledger emptied", || async {
        (router.ledger().await.ok()?["in_flight"] == 0).then_some(())
    })
    .await?;
    router.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_failure_is_retried_once_on_another_worker() -> Result<()> {
    let cluster = Cluster::start().await?;
    let mut failing = FakeWorker::start(
        &cluster,
        record("d0", Role::Decode),
        Behavior::Fail { retryable: true },
    )
    .await?;
    let mut good = FakeWorker::start(&cluster, record("d1", Role::Decode), Behavior::Serve).await?;
    // d0 holds the prompt: the first decision goes there.
    let prompt = tokens(5, 300);
    Indexer::new(&cluster).store("d0", &prompt).await?;
    let router = RouterHandle::ready(cluster.config("r1")).await?;
    router.wait_workers(2).await?;

    let r = router
        .post(
            "/v1/completions",
            serde_json::json!({"prompt": prompt, "max_tokens": 2}),
        )
        .await?;
    assert_eq!(r.status(), 200);
    let header = r.headers()["x-switchyard-decision"].to_str()?.to_owned();
    let body: serde_json::Value = r.json().await?;
    assert_eq!(body["switchyard"]["decode"], "d1");
    assert_eq!(body["switchyard"]["decision"], header.as_str());
    let first = failing.next_request().await?;
    assert_eq!(
        body["switchyard"]["retry_of"],
        first.annotation.decision.to_string()
    );
    assert_eq!(
        good.next_request().await?.annotation.decision.to_string(),
        header
    );

    // A failure that is not retryable is a 502 at once: d2 holds the
    // prompt and fails it; d1 is not tried.
    failing.deregister().await?;
    let other = tokens(6, 300);
    Indexer::new_from(&cluster, 1).store("d2", &other).await?;
    let _bad = FakeWorker::start(
        &cluster,
        record("d2", Role::Decode),
        Behavior::Fail { retryable: false },
    )
    .await?;
    router.wait_workers(2).await?;
    let (status, body) = error_of(
        router
            .post(
                "/v1/completions",
                serde_json::json!({"prompt": other, "max_tokens": 2}),
            )
            .await?,
    )
    .await?;
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["switchyard"]["decode"], "d2");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("engine overloaded"));
    assert!(body["switchyard"].get("retry_of").is_none());
    assert!(good.no_request());
    let metrics = router.get_text("/metrics").await?;
    assert!(
        metrics.contains("router_dispatch_total{outcome=\"retried\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("router_dispatch_total{outcome=\"worker_failed\"} 1"));
    router.stop().await
}

/// A leg the bus lost (a NATS node died with the request, or with its
/// first chunk) is retried on another worker within a few probe periods,
/// not failed at the first-chunk timeout: the agent says, when probed, that
/// it does not hold the leg; a stream that lost its first chunk is retried
/// since nothing streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leg_lost_on_the_bus_is_retried_before_its_timeout() -> Result<()> {
    let cluster = Cluster::start().await?;
    let mut config = cluster.config("r1");
    config.timeouts.first_chunk = Duration::from_secs(30);
    config.timeouts.idle = Duration::from_secs(30);
    // Each failing worker holds its prompt: the first decision goes there.
    let prompts = [tokens(7, 300), tokens(8, 300)];
    let mut indexer = Indexer::new(&cluster);
    indexer.store("d0", &prompts[0]).await?;
    indexer.store("d2", &prompts[1]).await?;
    let mut good = FakeWorker::start(&cluster, record("d1", Role::Decode), Behavior::Serve).await?;
    let router = RouterHandle::ready(config).await?;
    for ((name, behavior, retried), prompt) in
        [("d0", Behavior::Forget, 1), ("d2", Behavior::SkipFirst, 2)]
            .into_iter()
            .zip(prompts)
    {
        let mut bad = FakeWorker::start(&cluster, record(name, Role::Decode), behavior).await?;
        router.wait_workers(2).await?;
        let started = Instant::now();
        let r = router
            .post(
                "/v1/completions",
                serde_json::json!({"prompt": prompt, "max_tokens": 4}),
            )
            .await?;
        let took = started.elapsed();
        let status = r.status();
        let body: serde_json::Value = r.json().await?;
        assert_eq!(status, 200, "{name}: {body}");
        assert_eq!(body["switchyard"]["decode"], "d1", "{name}: {body}");
        let first = bad.next_request().await?;
        assert_eq!(
            body["switchyard"]["retry_of"],
            first.annotation.decision.to_string(),
            "{name}"
        );
        good.next_request().await?;
        // Two probe periods (1 s each) and their probes, not 30 s.
        assert!(took < Duration::from_secs(8), "{name}: took {took:?}");
        let metrics = router.get_text("/metrics").await?;
        assert!(
            metrics.contains(&format!(
                "router_dispatch_total{{outcome=\"retried\"}} {retried}"
            )),
            "{name}: {metrics}"
        );
        bad.deregister().await?;
        router.wait_workers(1).await?;
    }
    let metrics = router.get_text("/metrics").await?;
    assert!(metrics.contains("router_worker_probes_total{outcome=\"not_held\"} 2"));
    router.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_another_block_size_is_refused_and_never_routed_to() -> Result<()> {
    let cluster = Cluster::start().await?;
    let mut bad = record("d9", Role::Decode);
    bad.contract.block_size = 32;
    let mut refused = FakeWorker::start(&cluster, bad, Behavior::Serve).await?;
    // A refused worker does not make the replica ready.
    let router = RouterHandle::loaded(cluster.config("r1")).await?;
    wait_for("the refusal counted", || async {
        let m = router.get_text("/metrics").await.ok()?;
        m.contains("router_workers_refused_total{reason=\"block_size\"} 1")
            .then_some(())
    })
    .await?;
    assert_eq!(router.ledger().await?["workers"], serde_json::json!([]));
    let (status, body) = error_of(
        router
            .post("/v1/completions", serde_json::json!({"prompt": [1, 2, 3]}))
            .await?,
    )
    .await?;
    assert_eq!(status, 503, "{body}");

    // A good worker next to it gets everything.
    let mut good = FakeWorker::start(&cluster, record("d0", Role::Decode), Behavior::Serve).await?;
    router.wait_workers(1).await?;
    router.wait_ready().await?;
    for _ in 0..3 {
        let r = router
            .post(
                "/v1/completions",
                serde_json::json!({"prompt": [1, 2, 3], "max_tokens": 1}),
            )
            .await?;
        assert_eq!(r.status(), 200);
        good.next_request().await?;
    }
    assert!(refused.no_request());
    router.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_worker_without_an_agent_is_a_502_at_once() -> Result<()> {
    let cluster = Cluster::start().await?;
    // In etcd, but nobody subscribed to its generate subject.
    let _registration = cluster
        .registry
        .register(&record("d0", Role::Decode), Duration::from_secs(5))
        .await?;
    let router = RouterHandle::ready(cluster.config("r1")).await?;
    router.wait_workers(1).await?;
    let started = Instant::now();
    let (status, body) = error_of(
        router
            .post("/v1/completions", serde_json::json!({"prompt": [1, 2, 3]}))
            .await?,
    )
    .await?;
    assert_eq!(status, 502, "{body}");
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "no-responders comes before the first-chunk timeout"
    );
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("no agent listens"), "{message}");
    router.stop().await
}
