//! Drives the simulator's agentic workload in real time against router
//! replicas: sessions arrive as in the simulator; each turn is a streamed
//! `/v1/completions` call; the next turn appends the tokens the worker
//! actually produced, so conversations really grow where they were decoded.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use sim::workload::{Agentic, AgenticConfig, Arrival, RequestSpec, Workload};

use crate::stats::{round3, Samples};

/// What to run.
#[derive(Debug, Clone)]
pub struct AgenticRun {
    pub routers: Vec<String>,
    pub workload: AgenticConfig,
    /// Divides the workload's time (think times, arrival gaps): 2.0 runs
    /// it twice as fast.
    pub time_scale: f64,
    /// Caps answer lengths (keeps live runs short).
    pub max_output_tokens: u32,
    pub request_timeout: Duration,
    /// The routers' API key.
    pub api_key: Option<String>,
    /// Sends of a turn again, through the next router, after a connection
    /// failure before any response.
    pub connect_retries: u32,
}

/// One finished turn.
#[derive(Debug, Clone)]
struct Turn {
    ttft: Duration,
    e2e: Duration,
    tokens: usize,
    path: String,
}

#[derive(Debug, Default)]
struct Results {
    turns: Vec<Turn>,
    errors: Vec<String>,
    /// Turns sent again after a connection failure before any response
    /// (each retry counted).
    connect_retries: u64,
}

/// Why a turn failed: before any response (its connection failed: a client
/// may send it again elsewhere), or after.
#[derive(Debug)]
enum TurnError {
    Connect(anyhow::Error),
    Answered(anyhow::Error),
}

impl From<anyhow::Error> for TurnError {
    fn from(e: anyhow::Error) -> Self {
        TurnError::Answered(e)
    }
}

/// A turn's response, from the stream.
#[derive(Debug, Default)]
struct Streamed {
    token_ids: Vec<u32>,
    first_token: Option<Instant>,
    path: Option<String>,
}

fn parse_event(data: &str, into: &mut Streamed) -> anyhow::Result<()> {
    let value: serde_json::Value =
        serde_json::from_str(data).with_context(|| format!("bad SSE data {data:?}"))?;
    if let Some(error) = value.get("error") {
        bail!("router error: {error}");
    }
    if let Some(path) = value.pointer("/switchyard/path").and_then(|p| p.as_str()) {
        into.path = Some(path.to_owned());
    }
    if let Some(ids) = value
        .pointer("/choices/0/token_ids")
        .and_then(|t| t.as_array())
    {
        if !ids.is_empty() && into.first_token.is_none() {
            into.first_token = Some(Instant::now());
        }
        into.token_ids
            .extend(ids.iter().filter_map(|t| t.as_u64()).map(|t| t as u32));
    }
    Ok(())
}

/// One streamed completion; returns what came back and when it started.
async fn complete(
    client: &reqwest::Client,
    router: &str,
    spec: &RequestSpec,
    max_tokens: u32,
    timeout: Duration,
) -> Result<(Streamed, Instant), TurnError> {
    let started = Instant::now();
    let body = serde_json::json!({
        "prompt": &spec.prompt[..],
        "max_tokens": max_tokens,
        "stream": true,
        "user": format!("session-{}", spec.session),
    });
    let response = client
        .post(format!("{router}/v1/completions"))
        .header("x-request-id", format!("s{}-t{}", spec.session, spec.turn))
        .json(&body)
        .timeout(timeout)
        .send()
        .await;
    let response = match response {
        Ok(response) => response,
        // No response at all, and not for want of time: the connection
        // was refused or reset.
        Err(e) if !e.is_timeout() => {
            return Err(TurnError::Connect(
                anyhow::Error::new(e).context("sending the request"),
            ))
        }
        Err(e) => return Err(anyhow::Error::new(e).context("sending the request").into()),
    };
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return Err(anyhow::anyhow!("HTTP {status}: {text}").into());
    }
    let mut streamed = Streamed::default();
    let mut buffer = String::new();
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        buffer.push_str(&String::from_utf8_lossy(
            &chunk.context("reading the stream")?,
        ));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    return Ok((streamed, started));
                }
                parse_event(data, &mut streamed)?;
            }
        }
    }
    Err(anyhow::anyhow!("the stream ended without [DONE]").into())
}

/// Runs the workload to its end and returns a JSON summary.
pub async fn run(config: AgenticRun) -> anyhow::Result<serde_json::Value> {
    if config.routers.is_empty() {
        bail!("no router URL");
    }
    let workload = Arc::new(Mutex::new(Agentic::new(config.workload.clone())));
    let results = Arc::new(Mutex::new(Results::default()));
    let client = crate::api_key::client(config.api_key.as_deref())?.build()?;
    let start = Instant::now();
    let scale = config.time_scale.max(1e-6);
    let at =
        move |workload_us: u64| start + Duration::from_micros((workload_us as f64 / scale) as u64);
    let mut sessions = tokio::task::JoinSet::new();
    let mut next_router = 0usize;
    loop {
        let arrival = workload
            .lock()
            .expect("no panic while locked")
            .next_arrival();
        let Some(arrival) = arrival else { break };
        tokio::time::sleep_until(at(arrival.at_us).into()).await;
        let mut router = next_router % config.routers.len();
        next_router += 1;
        let (client, workload, results, config) = (
            client.clone(),
            workload.clone(),
            results.clone(),
            config.clone(),
        );
        sessions.spawn(async move {
            let mut turn: Option<Arrival> = Some(arrival);
            while let Some(Arrival { at_us, request }) = turn.take() {
                tokio::time::sleep_until(at(at_us).into()).await;
                let max_tokens = (request.output.len() as u32).min(config.max_output_tokens).max(1);
                let mut retries = 0;
                let outcome = loop {
                    let url = &config.routers[router];
                    match complete(&client, url, &request, max_tokens, config.request_timeout).await {
                        Err(TurnError::Connect(e)) if retries < config.connect_retries => {
                            retries += 1;
                            tracing::info!(session = request.session, turn = request.turn, router = %url, error = %format!("{e:#}"), "no response; sending the turn through the next router");
                            results.lock().expect("no panic while locked").connect_retries += 1;
                            // The session moves with it, as behind a load balancer.
                            router = (router + 1) % config.routers.len();
                        }
                        Err(TurnError::Connect(e) | TurnError::Answered(e)) => break Err(e),
                        Ok(done) => break Ok(done),
                    }
                };
                match outcome {
                    Ok((streamed, started)) => {
                        let e2e = started.elapsed();
                        let ttft = streamed.first_token.map_or(e2e, |t| t - started);
                        results.lock().expect("no panic while locked").turns.push(Turn {
                            ttft,
                            e2e,
                            tokens: streamed.token_ids.len(),
                            path: streamed.path.clone().unwrap_or_else(|| "unknown".into()),
                        });
                        // The next turn appends what the worker produced.
                        let done = RequestSpec {
                            output: streamed.token_ids.into(),
                            ..request
                        };
                        let now_us = (start.elapsed().as_secs_f64() * 1e6 * scale) as u64;
                        turn = workload.lock().expect("no panic while locked").on_finished(&done, now_us);
                    }
                    Err(e) => {
                        tracing::warn!(session = request.session, turn = request.turn, error = %e, "turn failed; session ends");
                        results.lock().expect("no panic while locked").errors.push(format!("{e:#}"));
                    }
                }
            }
        });
    }
    while sessions.join_next().await.is_some() {}
    let elapsed = start.elapsed().as_secs_f64();
    let results = Arc::try_unwrap(results)
        .expect("all sessions ended")
        .into_inner()
        .expect("no panic");
    let (mut ttft, mut e2e) = (Samples::default(), Samples::default());
    let mut tokens = 0;
    let mut paths = std::collections::BTreeMap::<String, usize>::new();
    for t in &results.turns {
        ttft.push(t.ttft);
        e2e.push(t.e2e);
        tokens += t.tokens;
        *paths.entry(t.path.clone()).or_default() += 1;
    }
    Ok(serde_json::json!({
        "turns": results.turns.len(),
        "errors": results.errors.len(),
        "connect_retries": results.connect_retries,
        "first_errors": results.errors.iter().take(5).collect::<Vec<_>>(),
        "output_tokens": tokens,
        "seconds": round3(elapsed),
        "output_tokens_per_s": round3(tokens as f64 / elapsed.max(1e-9)),
        "ttft_ms": ttft.summary(),
        "e2e_ms": e2e.summary(),
        "paths": paths,
    }))
}
