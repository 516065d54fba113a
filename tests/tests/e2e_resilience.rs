//! End-to-end, across processes: what a crash or a stop leaves behind. A
//! decode agent killed mid-stream fails its stream at once (its probe
//! subject has no responder any more), not at the 30 s idle timeout, or,
//! with another decode worker up, the stream goes on there; a
//! router killed or stopped has its reservations in its peers' ledgers
//! released within seconds, not at the ledger's 10 min TTL; SIGTERM drains
//! a router and an agent (what is in flight finishes). Run against the
//! permissioned nats-server, so the new subjects (probes, heartbeats) are
//! checked against the roles too.

mod cluster;

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use cluster::{decode, tokens, Cluster, MODEL};
use futures::{Stream, StreamExt};
use serde_json::{json, Value};

type Body = std::pin::Pin<Box<dyn Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>;

/// A streamed completion of a short prompt (a bypass) at `router`.
async fn open_stream(cluster: &Cluster, router: usize, seed: u64, max_tokens: u32) -> Result<Body> {
    let response = cluster
        .http
        .post(format!("{}/v1/completions", cluster.routers[router].url()))
        .json(&json!({
            "model": MODEL,
            "prompt": tokens(seed, 64),
            "max_tokens": max_tokens,
            "stream": true,
        }))
        .send()
        .await?;
    ensure!(response.status().is_success(), "{}", response.status());
    Ok(Box::pin(response.bytes_stream()))
}

/// A streamed completion of a short prompt (a bypass on the one decode
/// worker) at `router`, after its first `chunks` chunks.
async fn stream(cluster: &Cluster, router: usize, max_tokens: u32, chunks: usize) -> Result<Body> {
    let mut body = open_stream(cluster, router, 91 + router as u64, max_tokens).await?;
    for _ in 0..chunks {
        body.next().await.context("the stream ended")??;
    }
    Ok(body)
}

/// The rest of a stream, as text (an error of the connection ends it).
async fn rest(mut body: Body, within: Duration) -> Result<String> {
    let mut text = String::new();
    tokio::time::timeout(within, async {
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(bytes) => text.push_str(&String::from_utf8_lossy(&bytes)),
                Err(_) => break,
            }
        }
    })
    .await
    .with_context(|| format!("the stream did not end within {within:?}"))?;
    Ok(text)
}

async fn metrics(cluster: &Cluster, url: String) -> Result<String> {
    Ok(cluster.http.get(url).send().await?.text().await?)
}

/// How many decisions of `peer` router `router`'s ledger holds (`None`:
/// the peer is not listed).
async fn held_for(cluster: &Cluster, router: usize, peer: &str) -> Result<Option<u64>> {
    let state = cluster.router_state(router).await?;
    Ok(state["peers"]
        .as_array()
        .context("no peers in /debug/ledger")?
        .iter()
        .find(|p| p["replica"] == peer)
        .and_then(|p| p["held_decisions"].as_u64()))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_decode_agent_fails_its_stream_at_once() -> Result<()> {
    let mut cluster = Cluster::start_secured(&["p0"], &["d0"], 1).await?;
    let result = async {
        // 20,000 tokens take ~18 s: the agent dies in the middle.
        let body = stream(&cluster, 0, 20_000, 3).await?;
        let worker = cluster.workers.iter_mut().find(|w| w.name == "d0");
        worker.context("d0")?.agent.service.kill()?;
        let killed = Instant::now();
        let text = rest(body, Duration::from_secs(25)).await?;
        let took = killed.elapsed();
        eprintln!("the stream ended {took:?} after the agent was killed");
        ensure!(
            text.contains("\"error\"") && text.contains("gone") && !text.contains("[DONE]"),
            "the stream did not end with the worker's failure: ...{}",
            &text[text.len().saturating_sub(600)..]
        );
        // The probe period is 1 s; the idle timeout (30 s) never came.
        ensure!(took < Duration::from_secs(5), "took {took:?}");
        let m = metrics(&cluster, format!("{}/metrics", cluster.routers[0].url())).await?;
        ensure!(
            m.contains(r#"router_dispatch_total{outcome="worker_gone"} 1"#)
                && m.contains(r#"router_worker_probes_total{outcome="gone"} 1"#),
            "{m}"
        );
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

/// kill -9 of the decode agent in the middle of a stream, with another
/// decode worker up: the stream goes on there (the tokens sent are
/// appended to its prompt) and ends with every token asked for.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_whose_decode_agent_dies_goes_on_on_another_worker() -> Result<()> {
    let mut cluster = Cluster::start_secured(&["p0"], &["d0", "d1"], 1).await?;
    let result = async {
        let max_tokens: u32 = 3_000;
        let mut body = open_stream(&cluster, 0, 77, max_tokens).await?;
        // The first event names the decode worker.
        let mut text = String::new();
        while !text.contains("\n\n") {
            let chunk = body.next().await.context("the stream ended")??;
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        let first: Value = serde_json::from_str(
            text.lines()
                .find_map(|l| l.strip_prefix("data: "))
                .context("no first event")?,
        )?;
        let home = decode(&first).to_owned();
        let worker = cluster.workers.iter_mut().find(|w| w.name == home);
        worker.context("the serving worker")?.agent.service.kill()?;
        text.push_str(&rest(body, Duration::from_secs(25)).await?);
        ensure!(
            text.contains("[DONE]") && !text.contains("\"error\""),
            "the stream did not end well: ...{}",
            &text[text.len().saturating_sub(600)..]
        );
        let mut sent = 0;
        let mut finish = None;
        for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
            let Ok(event) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            let choice = &event["choices"][0];
            sent += choice["token_ids"].as_array().map_or(0, Vec::len);
            if choice["finish_reason"].is_string() {
                finish = Some(choice["finish_reason"].clone());
            }
        }
        ensure!(sent == max_tokens as usize, "{sent} tokens of {max_tokens}");
        ensure!(finish == Some(json!("length")), "finish {finish:?}");
        let m = metrics(&cluster, format!("{}/metrics", cluster.routers[0].url())).await?;
        ensure!(
            m.contains(r#"router_dispatch_total{outcome="resumed"} 1"#),
            "{m}"
        );
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

/// kill -9 of the decode agent holding a prompt, and at once (before its
/// 2 s lease expires) a request for that prompt: its leg finds no agent,
/// and the request is retried on the other decode worker before any
/// token, answered 200.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_to_a_killed_agent_is_retried_on_another_worker() -> Result<()> {
    let mut cluster = Cluster::start_secured(&["p0"], &["d0", "d1"], 1).await?;
    let result = async {
        let prompt = tokens(4242, 3000);
        let first = cluster.complete(0, "warm", &prompt, 4).await?;
        let home = decode(&first).to_owned();
        let held = prompt.len() as u64 / 16 * 16;
        let c = &cluster;
        c.eventually("the prompt's blocks to reach the router", || async {
            let d = c.route(0, &prompt).await?;
            Ok(d["decode"] == home.as_str() && d["decode_overlap_tokens"].as_u64() >= Some(held))
        })
        .await?;
        let worker = cluster.workers.iter_mut().find(|w| w.name == home);
        worker.context("the home worker")?.agent.service.kill()?;
        let answer = cluster.complete(0, "after-kill", &prompt, 4).await?;
        let served = decode(&answer);
        ensure!(served != home, "served by the dead {home}: {answer}");
        ensure!(
            answer["switchyard"]["retry_of"].is_string(),
            "not a retry: {}",
            answer["switchyard"]
        );
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peer_routers_reservations_go_when_it_crashes_or_stops() -> Result<()> {
    let mut cluster = Cluster::start_secured(&["p0"], &["d0"], 2).await?;
    let result = async {
        // 1. A long request on r1, held in r0's ledger.
        let body = stream(&cluster, 1, 20_000, 3).await?;
        let c = &cluster;
        c.eventually("r0 to hold r1's decision", || async {
            Ok(
                held_for(c, 0, "r1").await? == Some(1)
                    && c.router_state(0).await?["in_flight"] == 1,
            )
        })
        .await?;
        // 2. kill -9 r1: r0 hears nothing more and, after the peer timeout
        // (5 s, plus a tick), releases what r1 held.
        cluster.routers[1].service.kill()?;
        drop(body);
        let killed = Instant::now();
        let c = &cluster;
        c.eventually("r0 to release r1's reservation", || async {
            Ok(held_for(c, 0, "r1").await?.is_none() && c.router_state(0).await?["in_flight"] == 0)
        })
        .await?;
        let took = killed.elapsed();
        eprintln!("r0 released the crashed r1's reservation after {took:?}");
        ensure!(took < Duration::from_secs(8), "took {took:?}");
        let m = metrics(c, format!("{}/metrics", c.routers[0].url())).await?;
        ensure!(
            m.contains(r#"router_peer_released_total{why="silent"} 1"#),
            "{m}"
        );

        // 3. r1 back, then SIGTERM while a short request (~2 s) streams
        // from it: the request finishes (drain), and r0 drops r1 at once
        // (its leaving notice), not after the 5 s of silence.
        cluster.routers[1].service.restart()?;
        let port = cluster.routers[1].port;
        cluster.routers[1]
            .service
            .wait_http_ok(port, "/readyz", Duration::from_secs(30))?;
        let c = &cluster;
        c.eventually("r0 to hear r1 again", || async {
            Ok(held_for(c, 0, "r1").await?.is_some())
        })
        .await?;
        let body = stream(&cluster, 1, 2_000, 2).await?;
        cluster.routers[1].service.terminate();
        let text = rest(body, Duration::from_secs(15)).await?;
        ensure!(
            text.contains("[DONE]") && !text.contains("\"error\""),
            "the request in flight did not finish through the drain: ...{}",
            &text[text.len().saturating_sub(600)..]
        );
        let deadline = Instant::now() + Duration::from_secs(15);
        while cluster.routers[1].service.is_running() {
            if Instant::now() > deadline {
                bail!("r1 did not exit after its drain");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let exited = Instant::now();
        let c = &cluster;
        c.eventually("r0 to drop r1", || async {
            Ok(held_for(c, 0, "r1").await?.is_none())
        })
        .await?;
        let took = exited.elapsed();
        eprintln!("r0 dropped the stopped r1 {took:?} after it exited");
        ensure!(
            took < Duration::from_secs(3),
            "r0 took {took:?}: it timed r1 out instead of hearing it leave"
        );
        ensure!(
            cluster.routers[1]
                .service
                .log()
                .contains("telling the peers this replica leaves"),
            "{}",
            cluster.routers[1].service.log()
        );
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_agent_deregisters_and_finishes_what_it_serves() -> Result<()> {
    let mut cluster = Cluster::start_secured(&["p0"], &["d0"], 1).await?;
    let result = async {
        // ~2 s of output; SIGTERM to d0's agent after two chunks.
        let body = stream(&cluster, 0, 2_000, 2).await?;
        let worker = cluster.workers.iter_mut().find(|w| w.name == "d0");
        worker.context("d0")?.agent.service.terminate();
        // The router drops d0 while its request still streams.
        let c = &cluster;
        c.eventually("the router to drop the draining d0", || async {
            let state = c.router_state(0).await?;
            Ok(!state["workers"]
                .as_array()
                .is_some_and(|w| w.iter().any(|w| w["worker"] == "d0")))
        })
        .await?;
        let text = rest(body, Duration::from_secs(15)).await?;
        ensure!(
            text.contains("[DONE]") && !text.contains("\"error\""),
            "the request in flight did not finish through the drain: ...{}",
            &text[text.len().saturating_sub(600)..]
        );
        let output: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let finish = output
            .iter()
            .filter_map(|v| v["choices"][0]["finish_reason"].as_str())
            .next_back();
        ensure!(finish == Some("length"), "finish reason {finish:?}");
        let worker = cluster.workers.iter_mut().find(|w| w.name == "d0");
        let agent = &mut worker.context("d0")?.agent.service;
        let deadline = Instant::now() + Duration::from_secs(10);
        while agent.is_running() {
            if Instant::now() > deadline {
                bail!("the agent did not exit after its drain");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let log = agent.log();
        ensure!(
            log.contains("deregistered") && log.contains("drained"),
            "{log}"
        );
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}
