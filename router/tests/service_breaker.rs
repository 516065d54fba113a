//! The circuit breaker: a worker that fails dispatches in a row is taken
//! out of rotation (the decision avoids it, and its record says so, which
//! is what replay re-decides with), then tried again once its time is up.

mod service_support;

use std::time::Duration;

use anyhow::{Context, Result};
use async_nats::jetstream::consumer::pull::OrderedConfig;
use futures::StreamExt;
use protocol::{subjects, LogEntry, LoggedDecision, Message, Role};
use service_support::*;

/// The logged decision with id `decision` (hex), from the decision log.
async fn logged(cluster: &Cluster, decision: &str) -> Result<Option<LoggedDecision>> {
    let stream = cluster
        .bus
        .jetstream()
        .get_stream(subjects::DECISIONS_STREAM)
        .await?;
    let mut messages = stream
        .create_consumer(OrderedConfig::default())
        .await?
        .messages()
        .await?;
    while let Ok(Some(message)) =
        tokio::time::timeout(Duration::from_millis(300), messages.next()).await
    {
        if let LogEntry::Decision(d) = LogEntry::decode(&message?.payload)? {
            if d.decision.id.to_string() == decision {
                return Ok(Some(d));
            }
        }
    }
    Ok(None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_worker_is_taken_out_of_rotation_and_tried_again() -> Result<()> {
    let cluster = Cluster::start().await?;
    let mut failing = FakeWorker::start(
        &cluster,
        record("d0", Role::Decode),
        Behavior::Fail { retryable: true },
    )
    .await?;
    let mut good = FakeWorker::start(&cluster, record("d1", Role::Decode), Behavior::Serve).await?;
    // d0 holds the prompt: every decision prefers it.
    let prompt = tokens(5, 300);
    Indexer::new(&cluster).store("d0", &prompt).await?;
    let mut config = cluster.config("r1");
    config.breaker.failures = 2;
    config.breaker.open_for_ms = 800;
    let router = RouterHandle::ready(config).await?;
    router.wait_workers(2).await?;
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 2});
    let breaker = |ledger: &serde_json::Value| -> String {
        ledger["workers"]
            .as_array()
            .and_then(|w| w.iter().find(|w| w["worker"] == "d0"))
            .map(|w| w["breaker"].as_str().unwrap_or("").to_owned())
            .unwrap_or_default()
    };

    // Two failures in a row on d0 (each retried on d1): its breaker opens.
    for _ in 0..2 {
        let r = router.post("/v1/completions", body.clone()).await?;
        assert_eq!(r.status(), 200);
        let answer: serde_json::Value = r.json().await?;
        assert_eq!(answer["switchyard"]["decode"], "d1");
        assert!(answer["switchyard"]["retry_of"].is_string(), "{answer}");
        failing.next_request().await?;
        good.next_request().await?;
    }
    wait_for("d0's breaker to open", || async {
        let ledger = router.ledger().await.ok()?;
        (breaker(&ledger) == "open").then_some(())
    })
    .await?;

    // Out of rotation: the next request goes to d1 at once, and its
    // decision record avoids d0.
    let r = router.post("/v1/completions", body.clone()).await?;
    assert_eq!(r.status(), 200);
    let answer: serde_json::Value = r.json().await?;
    assert_eq!(answer["switchyard"]["decode"], "d1");
    assert!(answer["switchyard"].get("retry_of").is_none(), "{answer}");
    assert!(
        failing.no_request(),
        "d0 got a request while out of rotation"
    );
    good.next_request().await?;
    let decision = answer["switchyard"]["decision"]
        .as_str()
        .context("decision id")?
        .to_owned();
    let record = wait_for("the decision in the log", || async {
        logged(&cluster, &decision).await.ok().flatten()
    })
    .await?;
    assert_eq!(record.avoid, vec![id("d0")]);

    // Its time is up: half-open, and the next request is d0's trial; it
    // fails, so the breaker opens again (and the request is served by d1).
    wait_for("d0's breaker to half-open", || async {
        let ledger = router.ledger().await.ok()?;
        (breaker(&ledger) == "half_open").then_some(())
    })
    .await?;
    let r = router.post("/v1/completions", body.clone()).await?;
    assert_eq!(r.status(), 200);
    let answer: serde_json::Value = r.json().await?;
    assert!(answer["switchyard"]["retry_of"].is_string(), "{answer}");
    failing.next_request().await?;
    good.next_request().await?;
    wait_for("d0's breaker to open again", || async {
        let ledger = router.ledger().await.ok()?;
        (breaker(&ledger) == "open").then_some(())
    })
    .await?;
    let metrics = router.get_text("/metrics").await?;
    for series in [
        r#"router_breaker_transitions_total{to="open"} 2"#,
        r#"router_breaker_transitions_total{to="half_open"} 1"#,
        "router_breaker_open 1",
    ] {
        assert!(metrics.contains(series), "no {series}:\n{metrics}");
    }
    router.stop().await
}
