//! End-to-end on mock-vllm engines: the router, the indexer and agents
//! with `--engine vllm` (the adapter a real vLLM gets: ZMQ KV events with
//! engine-private hashes, OpenAI HTTP, kv_transfer_params) as processes.

mod cluster;

use anyhow::{ensure, Context, Result};
use cluster::{
    conversation, decode, output, path, tokens, Cluster, Engine, Wire, ANSWER, BLOCK_SIZE,
    COLD_PROMPT, LORA, MAX_MODEL_LEN, MODEL,
};
use serde_json::{json, Value};

const VLLM_ARRAYS: Engine = Engine::MockVllm(Wire {
    encoding: "array",
    hash_flavour: "vllm",
    replay_topic_frame: false,
});
const MAPS_SGLANG_HASHES: Engine = Engine::MockVllm(Wire {
    encoding: "map",
    hash_flavour: "sglang",
    replay_topic_frame: true,
});

/// Today's shapes (vLLM 0.33: an array batch of tagged-map events with
/// 32-byte digests and `group_idx`; SGLang 0.5: the same with i64 hashes,
/// one event per page, `CPU_PINNED`).
const VLLM_TODAY: Engine = Engine::MockVllm(Wire {
    encoding: "tagged",
    hash_flavour: "vllm",
    replay_topic_frame: true,
});
const SGLANG_TODAY: Engine = Engine::MockVllm(Wire {
    encoding: "tagged",
    hash_flavour: "sglang",
    replay_topic_frame: true,
});

#[tokio::test(flavor = "multi_thread")]
async fn a_conversation_on_mock_vllm_engines() -> Result<()> {
    let cluster = Cluster::start_with(
        &[
            ("p0", "prefill", VLLM_ARRAYS),
            ("d0", "decode", VLLM_ARRAYS),
            ("d1", "decode", MAPS_SGLANG_HASHES),
        ],
        1,
    )
    .await?;
    let result = async {
        // Each turn waits until the router sees the previous turn's blocks
        // (published by its engine with private hashes, translated by its
        // agent) before it is sent.
        let turns = conversation(&cluster, 0, 7, 3).await?;
        for (turn, response) in turns.iter().enumerate() {
            ensure!(
                output(response).len() == ANSWER as usize,
                "turn {turn}: {} token ids came back: {response}",
                output(response).len()
            );
        }

        // Turn 0, cold and long: prefilled on p0, decoded on a decode
        // worker with p0's kv_transfer_params.
        ensure!(
            path(&turns[0]) == "remote",
            "turn 0: {}",
            turns[0]["switchyard"]
        );
        let home = decode(&turns[0]).to_owned();
        let debug = cluster.engine_debug(&home).await?;
        ensure!(
            debug["kv_transfer_params_received"].as_u64() == Some(1),
            "{home}'s engine: {debug}"
        );
        let params = &debug["last_kv_transfer_params"];
        let p0_id = cluster.worker("p0")?.engine_id.as_str();
        ensure!(
            params["remote_engine_id"] == p0_id
                && params["do_remote_prefill"] == true
                && params["remote_block_ids"]
                    .as_array()
                    .is_some_and(|b| !b.is_empty()),
            "the decode engine got {params}"
        );
        let p0 = cluster.engine_debug("p0").await?;
        ensure!(
            p0["requests"]["prefill"].as_u64() == Some(1),
            "p0's engine: {p0}"
        );

        // Later turns, short appends: bypass, on the worker holding them.
        for (turn, response) in turns.iter().enumerate().skip(1) {
            ensure!(
                path(response) == "bypass",
                "turn {turn}: {}",
                response["switchyard"]
            );
            ensure!(
                decode(response) == home,
                "turn {turn} left {home}: {}",
                response["switchyard"]
            );
            ensure!(
                response["switchyard"]["decode_overlap_tokens"]
                    .as_u64()
                    .unwrap_or(0)
                    >= COLD_PROMPT as u64 / u64::from(BLOCK_SIZE) * u64::from(BLOCK_SIZE),
                "turn {turn}: {}",
                response["switchyard"]
            );
        }
        let engine = cluster.engine_debug(&home).await?;
        ensure!(
            engine["requests"]["local"].as_u64() == Some(2)
                && engine["requests"]["decode"].as_u64() == Some(1),
            "{home}'s engine: {engine}"
        );

        // The agents count no unknown parent or lost gap.
        for w in &cluster.workers {
            let metrics = cluster
                .http
                .get(format!("{}/metrics", w.agent.url()))
                .send()
                .await?
                .text()
                .await?;
            for bad in ["unknown_parents", "gaps_unrecovered", "malformed_batches"] {
                ensure!(
                    !metrics
                        .lines()
                        .any(|l| l.contains(&format!("what=\"{bad}\"")) && !l.ends_with(" 0")),
                    "{}: {bad}:\n{metrics}",
                    w.name
                );
            }
        }
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

/// The agent indexes today's engine shapes: a conversation prefilled on an
/// SGLang 0.5-shaped engine and decoded on a vLLM 0.33-shaped one; each
/// later turn waits until the router sees the previous one's blocks on
/// the decode engine (digests translated), and the prefill engine's blocks
/// (i64 pages) are seen too.
#[tokio::test(flavor = "multi_thread")]
async fn todays_vllm_and_sglang_shapes_are_indexed() -> Result<()> {
    let cluster = Cluster::start_with(
        &[
            ("p0", "prefill", SGLANG_TODAY),
            ("d0", "decode", VLLM_TODAY),
        ],
        1,
    )
    .await?;
    let result = async {
        let turns = conversation(&cluster, 0, 11, 3).await?;
        ensure!(
            path(&turns[0]) == "remote",
            "turn 0: {}",
            turns[0]["switchyard"]
        );
        for (turn, response) in turns.iter().enumerate().skip(1) {
            ensure!(
                path(response) == "bypass" && decode(response) == "d0",
                "turn {turn}: {}",
                response["switchyard"]
            );
        }
        // The first turn's prompt, prefilled on p0: its pages are indexed.
        let first = tokens(11, COLD_PROMPT);
        let held = (COLD_PROMPT as u64) / u64::from(BLOCK_SIZE) * u64::from(BLOCK_SIZE);
        let c = &cluster;
        cluster
            .eventually("p0's SGLang pages to reach the router", || {
                let first = &first;
                async move {
                    let d = c.route(0, first).await?;
                    Ok(d["prefill_overlap_tokens"].as_u64().unwrap_or(0) >= held)
                }
            })
            .await?;
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

/// A client that leaves mid-stream: the adapter closes the engine's HTTP
/// stream, which is how vLLM learns to abort a request.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_leaves_cancels_its_request_on_the_engine() -> Result<()> {
    let cluster = Cluster::start_with(
        &[
            ("p0", "prefill", VLLM_ARRAYS),
            ("d0", "decode", VLLM_ARRAYS),
        ],
        1,
    )
    .await?;
    let result = cluster.leave_mid_stream("d0").await;
    result.with_context(|| cluster.logs())
}

/// Every sampling and stopping field a client sets reaches the vLLM
/// engine, under vLLM's name, through the router and the adapter; what
/// the simulated engine behind mock-vllm models (stop token ids after
/// `min_tokens`) shapes the output.
#[tokio::test(flavor = "multi_thread")]
async fn every_sampling_field_reaches_the_engine() -> Result<()> {
    let cluster = Cluster::start_with(
        &[
            ("p0", "prefill", VLLM_ARRAYS),
            ("d0", "decode", VLLM_ARRAYS),
        ],
        1,
    )
    .await?;
    let result = async {
        let prompt = tokens(5, 48);
        // Output tokens are the simulated engine's function of the request
        // id: both requests have the same.
        let first = cluster.complete(0, "sampled", &prompt, 8).await?;
        let plain = output(&first);
        ensure!(plain.len() == 8, "{first}");
        // A stop token the plain answer emits at position 5: with
        // `min_tokens` 3 the answer ends there (unless it came earlier
        // too, past 3).
        let stop = plain[5];
        let at = plain.iter().skip(3).position(|&t| t == stop).unwrap() + 3;
        let fields = json!({
            "temperature": 0.25, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 1234,
            "stop": ["\n\n"], "stop_token_ids": [stop], "ignore_eos": true, "min_tokens": 3,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
            "logit_bias": {"5": -100.0}, "response_format": {"type": "json_object"},
            "cache_salt": "tenant-a",
        });
        let mut body = fields.clone();
        body["model"] = json!(MODEL);
        body["prompt"] = json!(prompt);
        body["max_tokens"] = json!(8);
        body["lora"] = json!(LORA);
        let response = cluster
            .http
            .post(format!("{}/v1/completions", cluster.routers[0].url()))
            .header("x-request-id", "sampled")
            .json(&body)
            .send()
            .await?;
        let status = response.status();
        let answer: Value = response.json().await?;
        ensure!(status.is_success(), "HTTP {status}: {answer}");
        ensure!(
            output(&answer) == plain[..=at] && answer["choices"][0]["finish_reason"] == "stop",
            "stopped at {stop} (position {at}) of {plain:?}: {answer}"
        );
        // The engine says what it found cached (the first answer's blocks).
        let details = &answer["usage"]["prompt_tokens_details"];
        ensure!(
            details["cached_tokens_source"] == "engine"
                && details["cached_tokens"].as_u64() >= Some(32),
            "{}",
            answer["usage"]
        );
        let home = decode(&answer).to_owned();
        let debug = cluster.engine_debug(&home).await?;
        let received = debug["received"]
            .as_array()
            .and_then(|r| r.iter().rev().find(|r| r["request_id"] == "sampled"))
            .with_context(|| format!("{home}'s engine has no request \"sampled\": {debug}"))?;
        for (key, value) in fields.as_object().unwrap() {
            ensure!(
                &received["fields"][key] == value,
                "{key}: sent {value}, {home}'s engine got {}",
                received["fields"][key]
            );
        }
        ensure!(received["model"] == LORA, "{received}");

        // Log-probabilities: forwarded, and the engine's (mock-vllm's
        // made-up ones) come back one a token, named by id (this router
        // has no tokenizer), with as many alternatives as asked for.
        body["logprobs"] = json!(2);
        let response = cluster
            .http
            .post(format!("{}/v1/completions", cluster.routers[0].url()))
            .header("x-request-id", "scored")
            .json(&body)
            .send()
            .await?;
        let status = response.status();
        let answer: Value = response.json().await?;
        ensure!(status.is_success(), "HTTP {status}: {answer}");
        let logprobs = &answer["choices"][0]["logprobs"];
        let named: Vec<String> = output(&answer)
            .iter()
            .map(|t| format!("token_id:{t}"))
            .collect();
        ensure!(logprobs["tokens"] == json!(named), "{answer}");
        let tops = logprobs["top_logprobs"]
            .as_array()
            .context("top_logprobs")?;
        ensure!(
            tops.len() == named.len()
                && tops
                    .iter()
                    .all(|t| t.as_object().is_some_and(|t| t.len() == 2)),
            "{answer}"
        );
        ensure!(
            logprobs["token_logprobs"]
                .as_array()
                .is_some_and(|l| l.iter().all(|x| x.as_f64().is_some_and(|x| x < 0.0))),
            "{answer}"
        );
        let debug = cluster.engine_debug(decode(&answer)).await?;
        let received = debug["received"]
            .as_array()
            .and_then(|r| r.iter().rev().find(|r| r["request_id"] == "scored"))
            .context("no request \"scored\"")?;
        ensure!(received["fields"]["logprobs"] == json!(2), "{received}");
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

/// A 256k-token prompt (about 1.8 MB of JSON) completes end to end: the
/// router hashes it, each leg carries it over NATS packed below the 1 MiB
/// payload limit, the prefill and decode engines take it; so does a 400k
/// one, whose legs go in fragments; one past the engines' registered
/// context length is a 400 before routing.
#[tokio::test(flavor = "multi_thread")]
async fn a_256k_token_prompt_completes() -> Result<()> {
    let cluster = Cluster::start_with(
        &[
            ("p0", "prefill", VLLM_ARRAYS),
            ("d0", "decode", VLLM_ARRAYS),
        ],
        1,
    )
    .await?;
    let result = async {
        let prompt = tokens(11, 256 * 1024);
        let answer = cluster.complete(0, "long", &prompt, 4).await?;
        ensure!(
            output(&answer).len() == 4 && answer["usage"]["prompt_tokens"] == 256 * 1024,
            "{}",
            answer["usage"]
        );
        // 400k tokens pack to 1.2 MB, past NATS's default 1 MiB: each leg
        // goes in fragments, and completes alike.
        let prompt = tokens(13, 400_000);
        let answer = cluster.complete(0, "longer", &prompt, 4).await?;
        ensure!(
            output(&answer).len() == 4 && answer["usage"]["prompt_tokens"] == 400_000,
            "{}",
            answer["usage"]
        );
        let response = cluster
            .http
            .post(format!("{}/v1/completions", cluster.routers[0].url()))
            .json(&json!({"prompt": tokens(12, MAX_MODEL_LEN as usize - 2), "max_tokens": 4}))
            .send()
            .await?;
        let status = response.status();
        let error: Value = response.json().await?;
        ensure!(
            status == 400 && error["error"]["param"] == "max_tokens",
            "HTTP {status}: {error}"
        );
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

/// Capabilities at registration, honoured by selection: an SGLang decode
/// server (no bootstrap handshake here) is never sent a remote decode.
/// With `--sglang-do-local-prefill` (d0) it serves bypasses, each sent
/// with `do_local_prefill`; without (d2) it serves nothing at all. Every
/// request succeeds (the engine refuses what it cannot serve with a 400,
/// which would fail the request).
#[tokio::test(flavor = "multi_thread")]
async fn sglang_decode_servers_get_only_what_they_can_serve() -> Result<()> {
    let mut cluster = Cluster::start_with(
        &[
            ("p0", "prefill", VLLM_ARRAYS),
            (
                "d0",
                "decode",
                Engine::SglangDecode {
                    do_local_prefill: true,
                },
            ),
            ("d1", "decode", VLLM_ARRAYS),
            (
                "d2",
                "decode",
                Engine::SglangDecode {
                    do_local_prefill: false,
                },
            ),
        ],
        1,
    )
    .await?;
    // Router 0 (isl): cold prompts are prefilled remotely. Router 1
    // (never_disagg): everything bypasses.
    cluster.start_router_with("r1", &["--policy=never_disagg"])?;
    cluster.wait_ready().await?;
    let result = async {
        let (mut on_d0, mut remote, mut last) = (0, 0, Value::Null);
        for i in 0..40u64 {
            let router = (i % 2) as usize;
            let prompt = tokens(1_000 + i, if router == 0 { COLD_PROMPT } else { 64 });
            let r = cluster
                .complete(router, &format!("caps-{i}"), &prompt, 4)
                .await?;
            ensure!(output(&r).len() == 4, "request {i}: {r}");
            let (d, p) = (decode(&r), path(&r));
            ensure!(
                d != "d2",
                "request {i} went to d2, which serves no leg: {}",
                r["switchyard"]
            );
            if d == "d0" {
                ensure!(
                    p == "bypass",
                    "request {i}: a {p} decode on d0: {}",
                    r["switchyard"]
                );
                on_d0 += 1;
            }
            if p == "remote" {
                remote += 1;
            }
            last = r["switchyard"].clone();
        }
        ensure!(
            on_d0 > 0 && remote == 20,
            "{on_d0} bypasses on d0, {remote} remote decodes; the last: {last}"
        );
        let d0 = cluster.engine_debug("d0").await?;
        ensure!(
            d0["kv_transfer_params_received"] == 0
                && d0["do_local_prefill_received"] == on_d0
                && d0["requests"]["local"] == on_d0,
            "d0's engine: {d0}"
        );
        let d2 = cluster.engine_debug("d2").await?;
        ensure!(
            d2["requests"]["local"] == 0 && d2["errors"] == 0,
            "d2's engine: {d2}"
        );
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}
