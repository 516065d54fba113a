//! The vLLM adapter's generation path against a stub engine that
//! misbehaves: errors, silence, broken and text-only streams. Every one
//! ends as a clear `Failed` (retryable or not) or a `Finished`, in time.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use engine_sim::Preset;
use futures::StreamExt;
use protocol::{FinishReason, GenerateEvent, GenerateRequest, Role, Stage, WorkerId};
use serde_json::{json, Value};
use tests::fixtures::generate_request;
use tokio::time::Instant;
use worker_agent::vllm::{EngineKind, ReplayLimits, VllmConfig, VllmEngine};
use worker_agent::Engine;
use zeromq::Socket;

const MODEL: &str = "stub-model";

fn sse(lines: &[&str]) -> Response {
    let body: String = lines.iter().map(|l| format!("data: {l}\n\n")).collect();
    ([("content-type", "text/event-stream")], body).into_response()
}

/// `/v1/completions`: what it does depends on the prompt's first token.
async fn completions(axum::Json(body): axum::Json<Value>) -> Response {
    if body["stream"] == json!(false) {
        // A prefill answered by an engine without a KV connector.
        return axum::Json(json!({"choices": [{"text": "x", "finish_reason": "length"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})).into_response();
    }
    match body["prompt"][0].as_u64() {
        Some(1) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"error": {"message": "overloaded"}})),
        )
            .into_response(),
        Some(2) => {
            tokio::time::sleep(Duration::from_secs(60)).await;
            StatusCode::OK.into_response()
        }
        Some(3) => sse(&[r#"{"choices":[{"text":"a","token_ids":[5]}]}"#]),
        Some(4) => (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"detail": "Not Found"})),
        )
            .into_response(),
        Some(5) => sse(&[
            r#"{"choices":[{"text":"a"}]}"#,
            r#"{"choices":[{"text":"b","finish_reason":"stop"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":2}}"#,
            "[DONE]",
        ]),
        Some(6) => sse(&[
            r#"{"choices":[{"text":"a","token_ids":[7]}]}"#,
            r#"{"error":{"message":"boom","code":500}}"#,
        ]),
        // Logprobs, asked with the ids for names.
        Some(9)
            if body["logprobs"] == json!(1)
                && body["return_tokens_as_token_ids"] == json!(true) =>
        {
            sse(&[
                r#"{"choices":[{"text":"x","token_ids":[9,10],"logprobs":{"tokens":["token_id:9","token_id:10"],"token_logprobs":[-0.5,-1.0],"top_logprobs":[{"token_id:9":-0.5},{"token_id:3":-2.0,"token_id:10":-1.0}],"text_offset":[0,1]}}]}"#,
                r#"{"choices":[{"text":"","token_ids":[],"finish_reason":"length"}]}"#,
                "[DONE]",
            ])
        }
        Some(7) => {
            // A stream that stalls after its first chunk.
            let chunks = futures::stream::iter([Ok::<_, std::io::Error>(
                "data: {\"choices\":[{\"token_ids\":[1]}]}\n\n".to_owned(),
            )])
            .chain(futures::stream::pending());
            Response::new(Body::from_stream(chunks))
        }
        _ => sse(&[
            r#"{"choices":[{"text":"x","token_ids":[9,10]}]}"#,
            "not json",
            r#"{"choices":[{"text":"","token_ids":[],"finish_reason":"length"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1}}}"#,
            "[DONE]",
        ]),
    }
}

/// Request `r{first}` of three tokens (`first, 0, 0`), four to generate.
fn request(first: u32, stage: Stage) -> GenerateRequest {
    generate_request(&format!("r{first}"), stage, vec![first, 0, 0], 4)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_ends_clearly_and_in_time() -> Result<()> {
    // A publisher for the adapter to subscribe to (it publishes nothing).
    let events_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut publisher = zeromq::PubSocket::new();
    publisher
        .bind(&format!("tcp://127.0.0.1:{events_port}"))
        .await?;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .route(
            "/v1/models",
            get(|| async { axum::Json(json!({"data": [{"id": MODEL}]})) }),
        )
        .route("/metrics", get(|| async { "" }))
        .route("/v1/completions", post(completions));
    tokio::spawn(async move { axum::serve(listener, app).await });

    let engine = VllmEngine::connect(VllmConfig {
        kind: EngineKind::Vllm,
        worker: WorkerId::new("w", 0)?,
        role: Role::Both,
        model: MODEL.into(),
        block_size: 16,
        api_url: format!("http://{addr}"),
        kv_events: format!("tcp://127.0.0.1:{events_port}"),
        kv_replay: None,
        topic: String::new(),
        dp_size: 1,
        preset: Preset::llama8b_h100(),
        kv_capacity_blocks: Some(100),
        startup_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_millis(500),
        metrics_interval: Duration::from_millis(100),
        return_token_ids: true,
        bidirectional_kv: false,
        do_local_prefill: false,
        replay: ReplayLimits {
            connect: Duration::from_secs(1),
            idle: Duration::from_secs(1),
            total: Duration::from_secs(1),
        },
        idle_check: None,
    })
    .await?;
    ensure!(engine.facts().kv_capacity_blocks == 100);

    let run = |first: u32, stage: Stage| {
        let events = engine.generate(request(first, stage));
        async move {
            let started = Instant::now();
            let events: Vec<GenerateEvent> =
                tokio::time::timeout(Duration::from_secs(5), events.collect())
                    .await
                    .context("the stream did not end")?;
            ensure!(
                started.elapsed() < Duration::from_secs(3),
                "took {:?}",
                started.elapsed()
            );
            Ok::<_, anyhow::Error>(events)
        }
    };
    let failed = |events: &[GenerateEvent], want_retryable: bool, text: &str| match events.last() {
        Some(GenerateEvent::Failed { retryable, error }) => {
            *retryable == want_retryable && error.contains(text)
        }
        _ => false,
    };

    let e = run(1, Stage::Local).await?;
    ensure!(
        failed(&e, true, "HTTP 503") && failed(&e, true, "overloaded"),
        "{e:?}"
    );
    let e = run(2, Stage::Local).await?;
    ensure!(failed(&e, true, "did not answer"), "{e:?}");
    let e = run(3, Stage::Local).await?;
    ensure!(e.first() == Some(&GenerateEvent::Tokens(vec![5])), "{e:?}");
    ensure!(failed(&e, true, "closed the stream"), "{e:?}");
    let e = run(4, Stage::Local).await?;
    ensure!(
        failed(&e, false, "HTTP 404") && failed(&e, false, "Not Found"),
        "{e:?}"
    );
    let e = run(5, Stage::Local).await?;
    ensure!(
        e == vec![GenerateEvent::Finished {
            output_tokens: 2,
            cached_tokens: None,
            reason: FinishReason::Stop
        }],
        "text-only: no ids, the count from usage: {e:?}"
    );
    let e = run(6, Stage::Local).await?;
    ensure!(failed(&e, true, "boom"), "{e:?}");
    let e = run(7, Stage::Local).await?;
    ensure!(failed(&e, true, "sent nothing"), "{e:?}");
    let e = run(8, Stage::Local).await?;
    ensure!(
        e == vec![
            GenerateEvent::Tokens(vec![9, 10]),
            GenerateEvent::Finished {
                output_tokens: 2,
                cached_tokens: Some(1),
                reason: FinishReason::Length
            }
        ],
        "{e:?}"
    );
    // Log-probabilities relayed per token; an engine that streams tokens
    // without them (prompt 10: the plain stream) refuses the field, a 400
    // naming it, not tokens without what was asked.
    let scored = |first: u32| {
        let mut r = request(first, Stage::Local);
        r.sampling.logprobs = Some(1);
        engine.generate(r).collect::<Vec<_>>()
    };
    let e = scored(9).await;
    ensure!(
        e.first()
            == Some(&GenerateEvent::Scored {
                tokens: vec![9, 10],
                logprobs: vec![
                    protocol::TokenLogprob {
                        logprob: -0.5,
                        top: vec![(9, -0.5)]
                    },
                    protocol::TokenLogprob {
                        logprob: -1.0,
                        top: vec![(10, -1.0), (3, -2.0)]
                    },
                ],
            })
            && matches!(
                e.last(),
                Some(GenerateEvent::Finished {
                    output_tokens: 2,
                    ..
                })
            ),
        "{e:?}"
    );
    let e = scored(10).await;
    ensure!(
        matches!(e.last(), Some(GenerateEvent::Rejected { status: 400, param: Some(p), .. }) if p == "logprobs"),
        "{e:?}"
    );

    // A prefill whose response has no kv_transfer_params: the engine has
    // no KV connector; not retryable.
    let e = run(8, Stage::Prefill).await?;
    ensure!(failed(&e, false, "no kv_transfer_params"), "{e:?}");

    // Stopped: streams end at once (the agent then fails them, retryable).
    let stalled = engine.generate(request(2, Stage::Local));
    tokio::time::sleep(Duration::from_millis(50)).await;
    engine.stop();
    let e: Vec<GenerateEvent> =
        tokio::time::timeout(Duration::from_secs(2), stalled.collect()).await?;
    ensure!(e.is_empty(), "{e:?}");
    Ok(())
}
