//! Routing and dispatch end to end: bypass to the worker holding the
//! prompt (streamed and not), remote prefill with the transfer handed to
//! the decode leg, `/v1/route` without dispatch, text prompts through a
//! tokenizer, and several choices (`n`, a batch of prompts) with
//! log-probabilities and echo.

mod service_support;

use anyhow::{Context, Result};
use protocol::{subjects, DecisionId, LogEntry, Message, Path, Role, RouteDecision, Stage};
use service_support::*;

/// p0 prefills; d0 and d1 decode; d1 holds a 1 000-token conversation.
async fn deployment(cluster: &Cluster) -> Result<(Vec<FakeWorker>, Vec<u32>)> {
    let mut workers = Vec::new();
    for (name, role) in [
        ("p0", Role::Prefill),
        ("d0", Role::Decode),
        ("d1", Role::Decode),
    ] {
        workers.push(FakeWorker::start(cluster, record(name, role), Behavior::Serve).await?);
    }
    let history = tokens(42, 1000);
    let mut indexer = Indexer::new(cluster);
    indexer.store("d1", &history).await?;
    Ok((workers, history))
}

fn decision_header(r: &reqwest::Response) -> String {
    r.headers()["x-switchyard-decision"]
        .to_str()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_append_bypasses_to_the_worker_holding_the_conversation() -> Result<()> {
    let cluster = Cluster::start().await?;
    let (mut workers, history) = deployment(&cluster).await?;
    let router = RouterHandle::ready(cluster.config("r1")).await?;
    router.wait_workers(3).await?;
    let mut prompt = history.clone();
    prompt.extend(tokens(43, 50));

    // Not streamed.
    let r = router
        .post(
            "/v1/completions",
            serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 5}),
        )
        .await?;
    assert_eq!(r.status(), 200);
    let decision = decision_header(&r);
    let body: serde_json::Value = r.json().await?;
    let sy = &body["switchyard"];
    assert_eq!(sy["decision"], decision.as_str());
    assert_eq!(sy["path"], "bypass");
    assert_eq!(sy["decode"], "d1");
    assert_eq!(sy["rule"], "isl.short_append");
    assert_eq!(sy["decode_overlap_tokens"], 992);
    assert!(sy["reason"].as_str().unwrap().contains("bypass on d1"));
    assert_eq!(body["object"], "text_completion");
    let choice = &body["choices"][0];
    assert_eq!(
        choice["token_ids"],
        serde_json::json!([1000, 1001, 1002, 1003, 1004])
    );
    assert_eq!(choice["text"], "");
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(body["usage"]["prompt_tokens"], 1050);
    assert_eq!(body["usage"]["completion_tokens"], 5);
    // The fake engine says nothing of its cache: the router's overlap.
    let details = &body["usage"]["prompt_tokens_details"];
    assert_eq!(details["cached_tokens_source"], "router");
    assert_eq!(
        details["cached_tokens"],
        body["switchyard"]["decode_overlap_tokens"]
    );

    let d1 = &mut workers[2];
    let request = d1.next_request().await?;
    assert_eq!(request.stage, Stage::Local);
    assert_eq!(request.prompt, prompt);
    assert_eq!(request.annotation.decision, decision.parse::<DecisionId>()?);
    assert_eq!(request.annotation.path, Path::Bypass);
    assert!(workers[0].no_request() && workers[1].no_request());

    // The decision is in the decision log.
    let logged = cluster
        .bus
        .jetstream()
        .get_stream(subjects::DECISIONS_STREAM)
        .await?
        .get_last_raw_message_by_subject(&subjects::decisions("r1"))
        .await?;
    let logged = match LogEntry::decode(&logged.payload)? {
        LogEntry::Decision(d) => d.decision,
        other => anyhow::bail!("the last entry is not a decision: {other:?}"),
    };
    assert_eq!(logged.id.to_string(), decision);
    assert_eq!(logged.decode, id("d1"));

    // The first request's reservation is released (the router's loop
    // hears its end after the client does): until then it counts against
    // d1, more than the 62 blocks d1 holds, and d0 would win the decode.
    wait_for("the first request's release", || async {
        (router.ledger().await.ok()?["in_flight"] == 0).then_some(())
    })
    .await?;

    // Streamed: SSE chunks in order, the annotation first, [DONE] last.
    let r = router
        .post(
            "/v1/completions",
            serde_json::json!({"prompt": prompt, "max_tokens": 7, "stream": true}),
        )
        .await?;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let decision = decision_header(&r);
    let text = r.text().await?;
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("an SSE data line"))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e))
        .collect::<Result<_, _>>()?;
    assert_eq!(chunks[0]["switchyard"]["decision"], decision.as_str());
    assert_eq!(chunks[0]["switchyard"]["path"], "bypass");
    let streamed: Vec<u64> = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["token_ids"].as_array().unwrap().clone())
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(streamed, (1000..1007).collect::<Vec<u64>>());
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 7);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    assert_eq!(workers[2].next_request().await?.max_tokens, 7);

    // With stream_options.include_usage: after the finish, one more chunk
    // with the usage and no choice, then [DONE].
    let r = router
        .post(
            "/v1/completions",
            serde_json::json!({"prompt": prompt, "max_tokens": 3, "stream": true,
                "stream_options": {"include_usage": true}}),
        )
        .await?;
    let text = r.text().await?;
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("an SSE data line"))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let usage_only: serde_json::Value = serde_json::from_str(events[events.len() - 2])?;
    assert_eq!(usage_only["choices"], serde_json::json!([]));
    assert_eq!(usage_only["usage"]["completion_tokens"], 3);
    let finish: serde_json::Value = serde_json::from_str(events[events.len() - 3])?;
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert_eq!(workers[2].next_request().await?.max_tokens, 3);

    let metrics = router.get_text("/metrics").await?;
    assert!(
        metrics.contains("router_decisions_total{path=\"bypass\",rule=\"isl.short_append\"} 3"),
        "{metrics}"
    );
    assert!(metrics.contains("router_dispatch_total{outcome=\"ok\"} 3"));
    assert!(
        metrics.contains("router_http_requests_total{route=\"/v1/completions\",status=\"200\"} 3")
    );
    router.stop().await
}

/// A decision whose log entry JetStream did not take ("no stream found",
/// as while the stream's leader is elected after a NATS node's death) is
/// held and sent again until it does: the log loses nothing of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_the_log_did_not_take_is_sent_again_once_it_does() -> Result<()> {
    let cluster = Cluster::start().await?;
    let (mut workers, history) = deployment(&cluster).await?;
    let router = RouterHandle::ready(cluster.config("r1")).await?;
    router.wait_workers(3).await?;
    let js = cluster.bus.jetstream();
    js.delete_stream(subjects::DECISIONS_STREAM).await?;
    let mut prompt = history.clone();
    prompt.extend(tokens(43, 50));
    let r = router
        .post(
            "/v1/completions",
            serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 5}),
        )
        .await?;
    assert_eq!(r.status(), 200, "routing needs no decision log");
    let decision = decision_header(&r);
    workers[2].next_request().await?;
    // Long enough for the first send and a resend to fail.
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    cluster
        .bus
        .ensure_streams(&bus::StreamLimits::default())
        .await?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let logged = loop {
        let last = js
            .get_stream(subjects::DECISIONS_STREAM)
            .await?
            .get_last_raw_message_by_subject(&subjects::decisions("r1"))
            .await;
        if let Ok(message) = last {
            break LogEntry::decode(&message.payload)?;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the decision never reached the log"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    match logged {
        LogEntry::Decision(d) => assert_eq!(d.decision.id.to_string(), decision),
        other => anyhow::bail!("the last entry is not a decision: {other:?}"),
    }
    let metrics = router.get_text("/metrics").await?;
    assert!(
        metrics.contains(r#"router_dispatch_total{outcome="decision_log_resent"}"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"router_dispatch_total{outcome="decision_log_error"} 0"#),
        "{metrics}"
    );
    router.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_cold_prompt_is_prefilled_remotely() -> Result<()> {
    let cluster = Cluster::start().await?;
    let (mut workers, _) = deployment(&cluster).await?;
    let router = RouterHandle::ready(cluster.config("r1")).await?;
    router.wait_workers(3).await?;
    let prompt = tokens(7, 4000);
    let r = router
        .post(
            "/v1/completions",
            serde_json::json!({"prompt": prompt, "max_tokens": 3}),
        )
        .await?;
    assert_eq!(r.status(), 200);
    let decision: DecisionId = decision_header(&r).parse()?;
    let body: serde_json::Value = r.json().await?;
    assert_eq!(body["switchyard"]["path"], "remote");
    assert_eq!(body["switchyard"]["prefill"], "p0");
    assert_eq!(body["switchyard"]["rule"], "isl.long_prefill");
    assert_eq!(
        body["choices"][0]["token_ids"],
        serde_json::json!([1000, 1001, 1002])
    );

    let prefill = workers[0].next_request().await?;
    assert_eq!(prefill.stage, Stage::Prefill);
    assert_eq!(prefill.annotation.decision, decision);
    assert_eq!(prefill.annotation.prefill, Some(id("p0")));
    let decode_name = body["switchyard"]["decode"].as_str().unwrap().to_owned();
    let decoder = workers
        .iter_mut()
        .find(|w| w.id.to_string() == decode_name)
        .context("the decode worker")?;
    let decode = decoder.next_request().await?;
    match &decode.stage {
        Stage::Decode { transfer } => {
            assert_eq!(transfer.source, id("p0"));
            assert_eq!(transfer.prompt_tokens, 4000);
            assert_eq!(transfer.engine.as_deref(), Some(ENGINE_PARAMS));
        }
        other => panic!("expected a decode leg, got {other:?}"),
    }
    assert_eq!(decode.annotation, prefill.annotation);
    assert_eq!(decode.prompt, prompt);

    // Every reservation of this replica is released.
    wait_for("the ledger emptied", || async {
        (router.ledger().await.ok()?["in_flight"] == 0).then_some(())
    })
    .await?;
    router.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_returns_the_decision_without_dispatching() -> Result<()> {
    let cluster = Cluster::start().await?;
    let (mut workers, history) = deployment(&cluster).await?;
    let router = RouterHandle::ready(cluster.config("r1")).await?;
    router.wait_workers(3).await?;
    let mut prompt = history;
    prompt.extend(tokens(3, 20));
    let r = router
        .post(
            "/v1/route",
            serde_json::json!({"prompt": prompt, "max_tokens": 10}),
        )
        .await?;
    assert_eq!(r.status(), 200);
    let header = decision_header(&r);
    let body: serde_json::Value = r.json().await?;
    let decision: RouteDecision = serde_json::from_value(body.clone())?;
    assert_eq!(decision.id.to_string(), header);
    assert_eq!(
        (decision.path, decision.decode.to_string()),
        (Path::Bypass, "d1".into())
    );
    assert_eq!(decision.isl_tokens, 1020);
    assert_eq!(decision.decode_overlap_tokens, 992);
    assert_eq!(body["switchyard"]["decision"], header.as_str());

    // Nothing was dispatched, nothing stays reserved.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(workers.iter_mut().all(|w| w.no_request()));
    let ledger = router.ledger().await?;
    assert_eq!(ledger["in_flight"], 0);
    assert!(ledger["workers"]
        .as_array()
        .unwrap()
        .iter()
        .all(|w| w["charged_requests"] == 0));

    // What clients ask before their first request: the served model (and
    // no other), and health under both names.
    let models: serde_json::Value = serde_json::from_str(&router.get_text("/v1/models").await?)?;
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"].as_array().map(Vec::len), Some(1));
    let one: serde_json::Value =
        serde_json::from_str(&router.get_text(&format!("/v1/models/{MODEL}")).await?)?;
    assert_eq!(
        (&one["id"], &one["object"]),
        (&MODEL.into(), &"model".into())
    );
    let other = router
        .http
        .get(router.url("/v1/models/gpt-4"))
        .send()
        .await?;
    assert_eq!(other.status(), 404);
    let error: serde_json::Value = other.json().await?;
    assert_eq!(error["error"]["type"], "not_found_error");
    assert_eq!(
        router.get_text("/health").await?,
        router.get_text("/healthz").await?
    );
    router.stop().await
}

const TOKENIZER: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [],
  "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": null,
  "model": {
    "type": "WordLevel",
    "vocab": {"[UNK]": 0, "hello": 1, "world": 2,
              "alpha": 1000, "beta": 1001, "gamma": 1002, "delta": 1003},
    "unk_token": "[UNK]"
  }
}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_prompts_and_text_output_with_a_tokenizer() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, TOKENIZER)?;
    // Its chat template, where HuggingFace puts it: each message's content,
    // then the assistant's turn ("world").
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::json!({"chat_template":
            "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}world{% endif %}"})
        .to_string(),
    )?;
    let cluster = Cluster::start().await?;
    let mut worker =
        FakeWorker::start(&cluster, record("d0", Role::Decode), Behavior::Serve).await?;
    let mut config = cluster.config("r1");
    config.tokenizer = Some(path);
    let router = RouterHandle::ready(config).await?;
    router.wait_workers(1).await?;

    let r = router
        .post(
            "/v1/completions",
            serde_json::json!({"prompt": "hello world hello", "max_tokens": 3}),
        )
        .await?;
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await?;
    assert_eq!(body["choices"][0]["text"], "alpha beta gamma");
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    assert_eq!(worker.next_request().await?.prompt, vec![1, 2, 1]);

    let r = router
        .post(
            "/v1/completions",
            serde_json::json!({"prompt": "hello", "max_tokens": 4, "stream": true}),
        )
        .await?;
    let text = r.text().await?;
    let pieces: String = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| {
            let v: serde_json::Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(
        pieces.split_whitespace().collect::<Vec<_>>(),
        ["alpha", "beta", "gamma", "delta"]
    );

    worker.next_request().await?;

    // Chat: the messages through the template ("hello hello world"),
    // max_completion_tokens, the answer as a chat.completion.
    let r = router
        .post(
            "/v1/chat/completions",
            serde_json::json!({"model": MODEL, "messages": [
                {"role": "system", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}]},
            ], "max_completion_tokens": 2}),
        )
        .await?;
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await?;
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["message"]["content"], "alpha beta");
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    let sent = worker.next_request().await?;
    assert_eq!((sent.prompt, sent.max_tokens), (vec![1, 1, 2], 2));

    // Streamed, with the usage-only last chunk.
    let r = router
        .post(
            "/v1/chat/completions",
            serde_json::json!({"messages": [{"role": "user", "content": "hello"}],
                "max_completion_tokens": 3, "stream": true,
                "stream_options": {"include_usage": true}}),
        )
        .await?;
    let text = r.text().await?;
    let chunks: Vec<serde_json::Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let said: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        said.split_whitespace().collect::<Vec<_>>(),
        ["alpha", "beta", "gamma"]
    );
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], serde_json::json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 3);
    worker.next_request().await?;

    // Echo: the prompt's text first, streamed or not; token-id prompts
    // are echoed as their text.
    for (prompt, stream) in [
        (serde_json::json!("hello world"), false),
        (serde_json::json!([1, 2]), true),
    ] {
        let r = router
            .post(
                "/v1/completions",
                serde_json::json!({"prompt": prompt, "max_tokens": 2, "echo": true, "stream": stream}),
            )
            .await?;
        assert_eq!(r.status(), 200);
        let text = if stream {
            let (chunks, _) = sse_chunks(&r.text().await?);
            chunks
                .iter()
                .filter_map(|c| c["choices"][0]["text"].as_str())
                .collect::<String>()
        } else {
            let v: serde_json::Value = r.json().await?;
            v["choices"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(
            text.split_whitespace().collect::<Vec<_>>(),
            ["hello", "worldalpha", "beta"],
            "{prompt}"
        );
        worker.next_request().await?;
    }

    // Chat's logprobs: true with top_logprobs, named by the tokenizer; n.
    let r = router
        .post(
            "/v1/chat/completions",
            serde_json::json!({"messages": [{"role": "user", "content": "hello"}],
                "max_completion_tokens": 2, "logprobs": true, "top_logprobs": 1, "n": 2}),
        )
        .await?;
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await?;
    assert_eq!(body["choices"].as_array().map(Vec::len), Some(2));
    let content = &body["choices"][1]["logprobs"]["content"];
    assert_eq!(content[0]["token"], "alpha");
    assert_eq!(content[0]["bytes"], serde_json::json!(b"alpha".to_vec()));
    assert_eq!(content[1]["top_logprobs"][0]["token"], "beta");
    assert_eq!(body["usage"]["completion_tokens"], 4);
    assert_eq!(body["usage"]["prompt_tokens"], 2);
    for _ in 0..2 {
        assert_eq!(worker.next_request().await?.sampling.logprobs, Some(1));
    }

    // Bad chat bodies are 400s naming the field.
    for (body, param) in [
        (serde_json::json!({"max_tokens": 2}), "messages"),
        (serde_json::json!({"messages": []}), "messages"),
        (
            serde_json::json!({"messages": [{"content": "x"}]}),
            "messages",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
            "temperature",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": "x"}], "logprobs": 2}),
            "logprobs",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": "x"}], "echo": true}),
            "echo",
        ),
    ] {
        let r = router.post("/v1/chat/completions", body.clone()).await?;
        assert_eq!(r.status(), 400, "{body}");
        let error: serde_json::Value = r.json().await?;
        assert_eq!(error["error"]["param"], param, "{body}: {error}");
    }
    router.stop().await
}

/// The SSE `data` of a streamed answer, `[DONE]` apart (whether it came
/// last).
fn sse_chunks(text: &str) -> (Vec<serde_json::Value>, bool) {
    let datas: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    let done = datas.last() == Some(&"[DONE]");
    let chunks = datas
        .iter()
        .filter(|d| **d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    (chunks, done)
}

/// A batch of two prompts with `n: 2` is four choices, each its own routed
/// request (its own decision, request id `-INDEX`), numbered prompt-major;
/// the usage sums completion tokens over the choices and counts each
/// prompt once; the engine's log-probabilities come back per token, in
/// OpenAI's shape; streamed, each choice's chunks carry its index and the
/// usage comes last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_choices_each_routed_with_logprobs() -> Result<()> {
    let cluster = Cluster::start().await?;
    let (mut workers, _) = deployment(&cluster).await?;
    let router = RouterHandle::ready(cluster.config("r1")).await?;
    router.wait_workers(3).await?;
    let (a, b) = (tokens(7, 40), tokens(8, 24));
    let body = serde_json::json!({"prompt": [a, b], "n": 2, "max_tokens": 3, "logprobs": 2,
        "seed": 10});
    let r = router.post("/v1/completions", body.clone()).await?;
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await?;
    let choices = v["choices"].as_array().context("choices")?;
    assert_eq!(choices.len(), 4, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["token_ids"], serde_json::json!([1000, 1001, 1002]));
        let l = &c["logprobs"];
        // No tokenizer: tokens named by id.
        assert_eq!(
            l["tokens"],
            serde_json::json!(["token_id:1000", "token_id:1001", "token_id:1002"])
        );
        assert_eq!(l["token_logprobs"], serde_json::json!([0.0, -0.1, -0.2]));
        assert_eq!(
            l["top_logprobs"][1],
            serde_json::json!({"token_id:1001": -0.1, "token_id:1002": -1.1})
        );
        assert_eq!(l["text_offset"], serde_json::json!([0, 13, 26]));
    }
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], 64);
    assert_eq!(u["completion_tokens"], 12);
    assert_eq!(u["total_tokens"], 76);
    let decisions = v["switchyard_choices"]
        .as_array()
        .context("switchyard_choices")?;
    assert_eq!(decisions.len(), 4);
    assert_eq!(v["switchyard"], decisions[0]);
    let mut ids: Vec<String> = decisions
        .iter()
        .map(|d| d["decision"].as_str().unwrap().to_owned())
        .collect();
    ids.dedup();
    assert_eq!(ids.len(), 4, "one decision a choice");
    // Each choice reached a worker as its own request, logprobs and a seed
    // of its own (vLLM's seed + j) with it.
    let mut sent = Vec::new();
    for w in &mut workers {
        while let Ok(r) = w.requests.try_recv() {
            // A remote prefill's first leg is the same request.
            if r.stage != Stage::Prefill {
                sent.push(r);
            }
        }
    }
    sent.sort_by(|x, y| x.request_id.cmp(&y.request_id));
    let got: Vec<(String, usize, Option<u32>, Option<i64>)> = sent
        .iter()
        .map(|r| {
            let suffix = r.request_id.rsplit('-').next().unwrap().to_owned();
            (suffix, r.prompt.len(), r.sampling.logprobs, r.sampling.seed)
        })
        .collect();
    assert_eq!(
        got,
        vec![
            ("0".into(), 40, Some(2), Some(10)),
            ("1".into(), 40, Some(2), Some(11)),
            ("2".into(), 24, Some(2), Some(10)),
            ("3".into(), 24, Some(2), Some(11)),
        ]
    );

    // Streamed, with the usage-only last chunk.
    let mut streamed = body.clone();
    streamed["stream"] = serde_json::json!(true);
    streamed["stream_options"] = serde_json::json!({"include_usage": true});
    let r = router.post("/v1/completions", streamed).await?;
    assert_eq!(r.status(), 200);
    let (chunks, done) = sse_chunks(&r.text().await?);
    assert!(done, "the stream ends with [DONE]");
    let last = chunks.last().context("chunks")?;
    assert_eq!(last["choices"], serde_json::json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 12);
    assert_eq!(last["usage"]["prompt_tokens"], 64);
    for i in 0..4u64 {
        let of: Vec<&serde_json::Value> = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().unwrap())
            .filter(|c| c["index"] == i)
            .collect();
        let ids: Vec<u64> = of
            .iter()
            .flat_map(|c| c["token_ids"].as_array().unwrap())
            .map(|t| t.as_u64().unwrap())
            .collect();
        assert_eq!(ids, [1000, 1001, 1002], "choice {i}");
        let logprobs: Vec<&serde_json::Value> = of
            .iter()
            .filter(|c| !c["logprobs"].is_null())
            .flat_map(|c| c["logprobs"]["tokens"].as_array().unwrap())
            .collect();
        assert_eq!(logprobs.len(), 3, "choice {i}");
        assert_eq!(
            of.iter().filter(|c| c["finish_reason"] == "length").count(),
            1,
            "choice {i}"
        );
    }

    // What one call cannot be: /v1/route decides one request; more than
    // 128 choices; echo with logprobs.
    for (path, body, needle) in [
        (
            "/v1/route",
            serde_json::json!({"prompt": [1, 2], "n": 2}),
            "decides one request",
        ),
        (
            "/v1/completions",
            serde_json::json!({"prompt": [[1], [2], [3]], "n": 50}),
            "more than 128",
        ),
        (
            "/v1/completions",
            serde_json::json!({"prompt": [1, 2], "echo": true, "logprobs": 1}),
            "echo with logprobs",
        ),
        (
            "/v1/completions",
            serde_json::json!({"prompt": [1, 2], "echo": true}),
            "--tokenizer",
        ),
    ] {
        let r = router.post(path, body.clone()).await?;
        assert_eq!(r.status(), 400, "{body}");
        let e: serde_json::Value = r.json().await?;
        let message = e["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{body}: {message}");
    }
    Ok(())
}

/// A leg larger than the NATS server's payload limit (64 KiB here; a
/// 50,000-token prompt packs to about 150 KB) goes in fragments with one
/// reply subject, and the worker gets the whole request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leg_past_the_payload_limit_goes_in_fragments() -> Result<()> {
    let cluster = Cluster::start_with_max_payload(64 * 1024).await?;
    assert_eq!(cluster.bus.client().server_info().max_payload, 64 * 1024);
    let mut worker =
        FakeWorker::start(&cluster, record("d0", Role::Decode), Behavior::Serve).await?;
    let router = RouterHandle::ready(cluster.config("r1")).await?;
    router.wait_workers(1).await?;
    let prompt = tokens(9, 50_000);
    let r = router
        .post(
            "/v1/completions",
            serde_json::json!({"prompt": prompt, "max_tokens": 3}),
        )
        .await?;
    let status = r.status();
    let body: serde_json::Value = r.json().await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 50_000);
    assert_eq!(
        body["choices"][0]["token_ids"],
        serde_json::json!([1000, 1001, 1002])
    );
    let sent = worker.next_request().await?;
    assert_eq!(sent.prompt, prompt);
    assert!(sent.encode().len() > 64 * 1024);
    router.stop().await
}
