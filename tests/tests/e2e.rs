//! End-to-end: the real binaries as processes (kv-indexer, router replicas,
//! worker agents with simulated engines) against real nats-server and etcd.

mod cluster;

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use async_nats::jetstream;
use cluster::{conversation, decode, path, tokens, Cluster, COLD_PROMPT};
use futures::StreamExt;
use protocol::{subjects, LogEntry, Message, Path, RouteDecision};
use serde_json::Value;

/// Reads every decision on the decision log.
async fn decision_log(cluster: &Cluster) -> Result<Vec<RouteDecision>> {
    Ok(logged_decisions(cluster)
        .await?
        .into_iter()
        .map(|d| d.decision)
        .collect())
}

/// Reads every logged decision on the decision log, with its inputs.
async fn logged_decisions(cluster: &Cluster) -> Result<Vec<protocol::LoggedDecision>> {
    let js = jetstream::new(cluster.nats_client().await?);
    let mut stream = js.get_stream(subjects::DECISIONS_STREAM).await?;
    let last = stream.info().await?.state.last_sequence;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await?;
    let mut messages = consumer.messages().await?;
    let mut decisions = Vec::new();
    let mut seen = 0;
    while seen < last {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .context("reading the decision log")?
            .context("the decision log ended early")??;
        seen = message
            .info()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .stream_sequence;
        if let LogEntry::Decision(d) = LogEntry::decode(&message.payload)? {
            decisions.push(d);
        }
    }
    Ok(decisions)
}

#[tokio::test(flavor = "multi_thread")]
async fn conversations_replicas_late_joiners_and_bad_input() -> Result<()> {
    let mut cluster = Cluster::start(&["p0"], &["d0", "d1", "d2"], 2).await?;
    let result = async {
        // 1. A multi-turn conversation: turn 0 remote (P -> D), later short
        // turns bypass to that same D; the decision log explains it.
        let turns = conversation(&cluster, 0, 1, 4).await?;
        ensure!(
            path(&turns[0]) == "remote",
            "turn 0: {}",
            turns[0]["switchyard"]
        );
        let home = decode(&turns[0]).to_owned();
        for (i, turn) in turns.iter().enumerate().skip(1) {
            ensure!(path(turn) == "bypass", "turn {i}: {}", turn["switchyard"]);
            ensure!(
                decode(turn) == home,
                "turn {i} left {home}: {}",
                turn["switchyard"]
            );
        }
        let log = decision_log(&cluster).await?;
        let turn2 = log
            .iter()
            .find(|d| d.request_id == "conv1-turn2")
            .context("turn 2 is on the decision log")?;
        ensure!(turn2.path == Path::Bypass && turn2.decode.to_string() == home);
        ensure!(
            turn2.decode_overlap_tokens as usize >= COLD_PROMPT,
            "{turn2:?}"
        );
        ensure!(
            turn2.reason.contains("2048") && turn2.reason.contains(&home),
            "{}",
            turn2.reason
        );

        // Conversations through the other replica too.
        conversation(&cluster, 1, 2, 2).await?;

        // 2. Both replicas agree with the indexer, and decide alike.
        let digest = cluster.converged_digest().await?;
        ensure!(digest == cluster.digest_from_event_log().await?);
        for seed in [1, 2, 3] {
            let prompt = tokens(seed, COLD_PROMPT + 100);
            let (a, b) = (
                cluster.route(0, &prompt).await?,
                cluster.route(1, &prompt).await?,
            );
            for field in ["path", "decode", "prefill", "decode_overlap_tokens", "rule"] {
                ensure!(
                    a[field] == b[field],
                    "replicas differ on {field}: {a} vs {b}"
                );
            }
        }

        // 5. A replica started late is ready from snapshot + deltas and
        // agrees on the digest.
        let late = cluster.start_router("late")?;
        cluster.wait_ready().await?;
        ensure!(cluster.converged_digest().await? == digest);
        let prompt = tokens(1, COLD_PROMPT);
        let (a, c) = (
            cluster.route(0, &prompt).await?,
            cluster.route(late, &prompt).await?,
        );
        ensure!(
            a["decode"] == c["decode"] && a["path"] == c["path"],
            "{a} vs {c}"
        );

        // 6. Bad input: a malformed message on the event stream is counted
        // and skipped; the consumer keeps going. Malformed HTTP gets a 4xx.
        let client = cluster.nats_client().await?;
        jetstream::new(client)
            .publish(
                "sy.kv.events.garbage.0",
                bytes::Bytes::from_static(b"\x93not a batch"),
            )
            .await?
            .await?;
        conversation(&cluster, 0, 4, 1).await?;
        cluster
            .eventually("the malformed message to be counted", || async {
                let metrics = cluster
                    .http
                    .get(format!("{}/metrics", cluster.indexer.url()))
                    .send()
                    .await?
                    .text()
                    .await?;
                Ok(metrics.lines().any(|l| {
                    l.starts_with("kv_indexer_malformed_messages_total") && !l.ends_with(" 0")
                }))
            })
            .await?;
        ensure!(cluster.converged_digest().await? == cluster.digest_from_event_log().await?);
        // Limits fail fast: an unknown model is a 404, output past the
        // context length (the workers' registrations) a 400, both before
        // routing: the ledger is untouched. Wrong types and unknown fields
        // are refused at the door, naming the field; a field the simulated
        // engine cannot honour is refused by its agent (after the
        // decision), naming it too.
        let ledger_url = format!("{}/debug/ledger", cluster.routers[0].url());
        let ledger = |l: Value| (l["in_flight"].clone(), l["workers"].clone());
        let before = ledger(cluster.get_json(ledger_url.clone()).await?);
        let too_long = format!(
            r#"{{"prompt": {:?}, "max_tokens": 1000000000}}"#,
            tokens(3, 40)
        );
        let fail_fast = [
            (r#"{"model": "gpt-4", "prompt": [1, 2, 3]}"#, Some("model")),
            (too_long.as_str(), Some("max_tokens")),
        ];
        let refused: [(&str, Option<&str>); 9] = [
            ("{not json", None),
            (r#"{"prompt": []}"#, None),
            (r#"{"prompt": "text without a tokenizer"}"#, None),
            (
                r#"{"prompt": [1, 2, 3], "temperature": "hot"}"#,
                Some("temperature"),
            ),
            (
                r#"{"prompt": [1, 2, 3], "temprature": 0}"#,
                Some("temprature"),
            ),
            (r#"{"prompt": [1, 2, 3], "n": 0}"#, Some("n")),
            (
                r#"{"prompt": [1, 2, 3], "stop_token_ids": "2"}"#,
                Some("stop_token_ids"),
            ),
            (
                r#"{"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.7}"#,
                Some("temperature"),
            ),
            // The simulated engine draws no tokens: no log-probabilities.
            (
                r#"{"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 1}"#,
                Some("logprobs"),
            ),
        ];
        for (k, (body, param)) in fail_fast.into_iter().chain(refused).enumerate() {
            if k == 2 {
                let after = ledger(cluster.get_json(ledger_url.clone()).await?);
                ensure!(before == after, "the ledger moved: {before:?} -> {after:?}");
            }
            let response = cluster
                .http
                .post(format!("{}/v1/completions", cluster.routers[0].url()))
                .header("content-type", "application/json")
                .body(body.to_owned())
                .send()
                .await?;
            let status = response.status();
            let error: Value = response.json().await?;
            let (want, kind) = match param {
                Some("model") => (404, "not_found_error"),
                _ => (400, "invalid_request_error"),
            };
            ensure!(status.as_u16() == want, "{body}: HTTP {status}");
            ensure!(
                error["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()),
                "{error}"
            );
            ensure!(
                error["error"]["type"] == kind && error["error"]["param"].as_str() == param,
                "{body}: {error}"
            );
        }
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_indexer_crashes_and_recovers_during_traffic() -> Result<()> {
    let mut cluster = Cluster::start(&["p0"], &["d0", "d1"], 2).await?;
    let result = async {
        conversation(&cluster, 0, 10, 2).await?;
        // Let a snapshot cover part of the log (1 s interval).
        tokio::time::sleep(Duration::from_millis(1500)).await;

        // 3. Kill the indexer (SIGKILL) during traffic: the routers keep
        // serving from their replicas (which stop learning new blocks until
        // it is back, so these requests get no new affinity).
        cluster.indexer.service.kill()?;
        for seed in 11..17 {
            cluster
                .complete(
                    (seed % 2) as usize,
                    &format!("outage-{seed}"),
                    &tokens(seed, 3000),
                    16,
                )
                .await
                .context("serving while the indexer is down")?;
        }
        let port = cluster.indexer.port;
        cluster.indexer.service.restart()?;
        cluster
            .indexer
            .service
            .wait_http_ok(port, "/healthz", Duration::from_secs(30))?;
        conversation(&cluster, 0, 20, 2).await?;

        // It recovered from snapshot + log: nothing lost, nothing doubled,
        // and the replicas converge on it.
        let digest = cluster.converged_digest().await?;
        ensure!(digest == cluster.digest_from_event_log().await?);
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_worker_leaves_every_index() -> Result<()> {
    let mut cluster = Cluster::start(&["p0"], &["d0", "d1"], 2).await?;
    let result = async {
        let turns = conversation(&cluster, 0, 30, 2).await?;
        let home = decode(&turns[1]).to_owned();

        // 4. Kill the agent of the worker holding the conversation: its
        // lease (2 s) expires, its blocks leave every replica's index, and
        // nothing is routed to it afterwards.
        let worker = cluster
            .workers
            .iter_mut()
            .find(|w| w.name == home)
            .context("the home worker")?;
        worker.agent.service.kill()?;
        let c = &cluster;
        for router in 0..2 {
            c.eventually(&format!("router {router} to drop {home}"), || {
                let home = &home;
                async move {
                    let state = c.router_state(router).await?;
                    Ok(!state["workers"]
                        .as_array()
                        .is_some_and(|w| w.iter().any(|w| w["worker"] == home.as_str())))
                }
            })
            .await?;
        }
        let digest = cluster.converged_digest().await?;
        ensure!(digest == cluster.digest_from_event_log().await?);
        let status = cluster.indexer_status().await?;
        ensure!(status["worker_blocks"].get(&home).is_none(), "{status}");
        for seed in 31..35 {
            let response = cluster
                .complete(
                    (seed % 2) as usize,
                    &format!("after-{seed}"),
                    &tokens(seed, 3000),
                    8,
                )
                .await?;
            ensure!(
                decode(&response) != home,
                "routed to the dead {home}: {}",
                response["switchyard"]
            );
        }
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

/// A client that leaves in the middle of a stream: the router cancels the
/// request on the worker, whose engine drops it.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_leaves_cancels_its_request() -> Result<()> {
    let cluster = Cluster::start(&["p0"], &["d0"], 1).await?;
    let result = cluster.leave_mid_stream("d0").await;
    result.with_context(|| cluster.logs())
}

/// Session affinity across two router replicas: first turns of one
/// session racing on both replicas land on one decode worker, and every
/// later turn follows it whichever replica takes it and however the
/// session is named (`X-Session-ID` header, `agent_context.session_id`);
/// the decision log carries the session for replay. Without a session
/// id the KV-aware choice is unchanged (no session note).
#[tokio::test(flavor = "multi_thread")]
async fn sessions_stick_to_one_decode_worker_across_replicas() -> Result<()> {
    let cluster = Cluster::start(&["p0"], &["d0", "d1", "d2", "d3"], 2).await?;
    let result = async {
        let mut homes = std::collections::BTreeSet::new();
        for s in 0..6u64 {
            let session = format!("agent-{s}");
            // Two first turns at once, one per replica, different prompts.
            let body =
                |seed: u64| serde_json::json!({"prompt": tokens(seed, 200), "max_tokens": 4});
            let header = [("X-Session-ID", session.as_str())];
            let (id_a, id_b) = (format!("{session}-a"), format!("{session}-b"));
            let (a, b) = tokio::join!(
                cluster.complete_with(0, &id_a, body(100 + s), &header),
                cluster.complete_with(1, &id_b, body(200 + s), &header),
            );
            let (a, b) = (a?, b?);
            ensure!(
                decode(&a) == decode(&b),
                "session {session}: first turns on {} and {}",
                a["switchyard"],
                b["switchyard"]
            );
            let home = decode(&a).to_owned();
            ensure!(
                a["switchyard"]["reason"]
                    .as_str()
                    .unwrap_or("")
                    .contains(&format!("session {session}")),
                "{}",
                a["switchyard"]
            );
            homes.insert(home.clone());
            // Later turns, alternating replicas and ways to name the session.
            for turn in 1..5u64 {
                let router = (turn % 2) as usize;
                let mut body = body(300 + 10 * s + turn);
                let r = if turn % 2 == 0 {
                    cluster
                        .complete_with(router, &format!("{session}-{turn}"), body, &header)
                        .await?
                } else {
                    body["agent_context"] = serde_json::json!({"session_id": session});
                    cluster
                        .complete_with(router, &format!("{session}-{turn}"), body, &[])
                        .await?
                };
                ensure!(
                    decode(&r) == home,
                    "session {session} turn {turn} left {home}: {}",
                    r["switchyard"]
                );
            }
        }
        ensure!(homes.len() > 1, "every session on one worker: {homes:?}");
        // A bad session id is a 400 naming it.
        let bad = cluster
            .complete_with(
                0,
                "bad-session",
                serde_json::json!({"prompt": [1, 2, 3]}),
                &[("x-session-id", "two words")],
            )
            .await;
        ensure!(
            bad.as_ref().is_err_and(
                |e| e.to_string().contains("400") && e.to_string().contains("x-session-id")
            ),
            "{bad:?}"
        );
        // The decision log carries the sessions (for replay and peers).
        let logged = logged_decisions(&cluster).await?;
        let with_session = logged.iter().filter(|d| d.session.is_some()).count();
        ensure!(
            with_session >= 6 * 6,
            "{with_session} logged decisions with a session"
        );
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}
