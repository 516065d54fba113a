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
    /// When a turn is sent again, through the next router.
    pub retries: Retries,
}

/// When a turn is sent again, through the next router (the session moves
/// with it, as behind a load balancer). A router's own answers (an error
/// status other than 429 and 503, an error event in the stream) are never
/// retried: they count as failed.
#[derive(Debug, Clone, Copy)]
pub struct Retries {
    /// After no response at all (the connection was refused or reset), or
    /// a 429 or 503 that says when to come back (`Retry-After`, waited,
    /// at most 10 s): what the `openai` client retries (twice by default).
    pub request: u32,
    /// After a stream cut by a transport error once its response began
    /// (its router died): the turn is sent again from the start and the
    /// tokens already received are dropped, as agent clients do (Codex
    /// reconnects a dropped stream up to 5 times by default).
    pub stream: u32,
}

impl Default for Retries {
    fn default() -> Self {
        Self {
            request: 2,
            stream: 2,
        }
    }
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
    /// Turns sent again, by why (each retry counted).
    retried: Retried,
}

/// Turns sent again, by why.
#[derive(Debug, Default)]
struct Retried {
    no_response: u64,
    retry_after: u64,
    broken_stream: u64,
}

/// Why a turn failed.
#[derive(Debug)]
enum TurnError {
    /// No response at all: the connection was refused or reset.
    NoResponse(anyhow::Error),
    /// A 429 or 503 that says when to come back.
    ComeBack {
        error: anyhow::Error,
        after: Duration,
    },
    /// The stream was cut by a transport error once its response began.
    Broken(anyhow::Error),
    /// The router answered with an error (or the wait timed out).
    Answered(anyhow::Error),
}

/// The longest `Retry-After` a turn waits before it is sent again.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(10);

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
            return Err(TurnError::NoResponse(
                anyhow::Error::new(e).context("sending the request"),
            ))
        }
        Err(e) => return Err(anyhow::Error::new(e).context("sending the request").into()),
    };
    let status = response.status();
    if !status.is_success() {
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let text = response.text().await.unwrap_or_default();
        let error = anyhow::anyhow!("HTTP {status}: {text}");
        return Err(match retry_after {
            Some(after) if matches!(status.as_u16(), 429 | 503) => TurnError::ComeBack {
                error,
                after: after.min(MAX_RETRY_AFTER),
            },
            _ => TurnError::Answered(error),
        });
    }
    let mut streamed = Streamed::default();
    let mut buffer = String::new();
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(e) if e.is_timeout() => {
                return Err(anyhow::Error::new(e).context("reading the stream").into())
            }
            Err(e) => {
                return Err(TurnError::Broken(
                    anyhow::Error::new(e).context("reading the stream"),
                ))
            }
        };
        buffer.push_str(&String::from_utf8_lossy(&chunk));
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
                let (mut request_retries, mut stream_retries) = (0, 0);
                let outcome = loop {
                    let url = &config.routers[router];
                    let error = match complete(&client, url, &request, max_tokens, config.request_timeout).await {
                        Ok(done) => break Ok(done),
                        Err(error) => error,
                    };
                    let (error, wait) = match error {
                        TurnError::NoResponse(e) if request_retries < config.retries.request => {
                            request_retries += 1;
                            results.lock().expect("no panic while locked").retried.no_response += 1;
                            (e, Duration::ZERO)
                        }
                        TurnError::ComeBack { error, after } if request_retries < config.retries.request => {
                            request_retries += 1;
                            results.lock().expect("no panic while locked").retried.retry_after += 1;
                            (error, after)
                        }
                        TurnError::Broken(e) if stream_retries < config.retries.stream => {
                            stream_retries += 1;
                            results.lock().expect("no panic while locked").retried.broken_stream += 1;
                            (e, Duration::ZERO)
                        }
                        TurnError::NoResponse(e)
                        | TurnError::ComeBack { error: e, .. }
                        | TurnError::Broken(e)
                        | TurnError::Answered(e) => break Err(e),
                    };
                    tracing::info!(session = request.session, turn = request.turn, router = %url, error = %format!("{error:#}"), ?wait, "sending the turn again through the next router");
                    tokio::time::sleep(wait).await;
                    // The session moves with it, as behind a load balancer.
                    router = (router + 1) % config.routers.len();
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
        "client_retries": results.retried.no_response + results.retried.retry_after + results.retried.broken_stream,
        "retried": {
            "no_response": results.retried.no_response,
            "retry_after": results.retried.retry_after,
            "broken_stream": results.retried.broken_stream,
        },
        "first_errors": results.errors.iter().take(5).collect::<Vec<_>>(),
        "output_tokens": tokens,
        "seconds": round3(elapsed),
        "output_tokens_per_s": round3(tokens as f64 / elapsed.max(1e-9)),
        "ttft_ms": ttft.summary(),
        "e2e_ms": e2e.summary(),
        "paths": paths,
    }))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// What the fake router does with one request.
    #[derive(Debug, Clone, Copy)]
    enum Answer {
        /// Starts the stream, then closes the connection mid-body.
        Cut,
        /// 503 with `Retry-After: 0`.
        ComeBack,
        /// An error event in the stream (the router's own answer).
        ErrorEvent,
        /// Two tokens, then `[DONE]`.
        Done,
    }

    const HEAD: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                        transfer-encoding: chunked\r\nconnection: close\r\n\r\n";

    fn chunk(text: &str) -> String {
        format!("{:x}\r\n{text}\r\n", text.len())
    }

    /// Reads one request (headers and a `content-length` body).
    async fn read_request(socket: &mut tokio::net::TcpStream) -> std::io::Result<()> {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = socket.read(&mut buf).await?;
            if n == 0 {
                return Ok(());
            }
            seen.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&seen);
            if let Some(end) = text.find("\r\n\r\n") {
                let length = text[..end]
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse::<usize>().ok())?
                    })
                    .unwrap_or(0);
                if seen.len() >= end + 4 + length {
                    return Ok(());
                }
            }
        }
    }

    /// A router on loopback that answers its requests, in arrival order,
    /// as `script` says, then with `Done`.
    async fn fake_router(script: Vec<Answer>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let next = Arc::new(AtomicUsize::new(0));
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let answer = script.get(i).copied().unwrap_or(Answer::Done);
                tokio::spawn(async move {
                    read_request(&mut socket).await?;
                    let event = |v: &str| chunk(&format!("data: {v}\n\n"));
                    let tokens = event(
                        r#"{"choices":[{"token_ids":[7,8]}],"switchyard":{"path":"bypass"}}"#,
                    );
                    let reply = match answer {
                        Answer::Cut => format!("{HEAD}{tokens}"),
                        Answer::ComeBack => {
                            let body = r#"{"error":{"message":"still starting"}}"#;
                            format!(
                                "HTTP/1.1 503 Service Unavailable\r\nretry-after: 0\r\n\
                                 content-type: application/json\r\ncontent-length: {}\r\n\
                                 connection: close\r\n\r\n{body}",
                                body.len()
                            )
                        }
                        Answer::ErrorEvent => format!(
                            "{HEAD}{}{}0\r\n\r\n",
                            event(r#"{"error":{"message":"lost chunk"}}"#),
                            event("[DONE]")
                        ),
                        Answer::Done => format!("{HEAD}{tokens}{}0\r\n\r\n", event("[DONE]")),
                    };
                    socket.write_all(reply.as_bytes()).await?;
                    // Cut: closed here, without the last chunk.
                    socket.shutdown().await
                });
            }
        });
        url
    }

    fn run_config(url: String) -> AgenticRun {
        AgenticRun {
            routers: vec![url],
            workload: AgenticConfig {
                sessions_per_s: 20.0,
                duration_s: 0.5,
                turns: (1, 1),
                system_prompt_tokens: (16, 32),
                seed: 3,
                ..AgenticConfig::default()
            },
            time_scale: 1.0,
            max_output_tokens: 2,
            request_timeout: Duration::from_secs(10),
            api_key: None,
            retries: Retries::default(),
        }
    }

    #[tokio::test]
    async fn broken_streams_and_come_back_answers_are_sent_again_router_errors_are_not() {
        let script = vec![Answer::Cut, Answer::ComeBack, Answer::ErrorEvent];
        let summary = run(run_config(fake_router(script).await)).await.unwrap();
        assert_eq!(summary["retried"]["broken_stream"], 1, "{summary}");
        assert_eq!(summary["retried"]["retry_after"], 1, "{summary}");
        assert_eq!(summary["retried"]["no_response"], 0, "{summary}");
        assert_eq!(summary["client_retries"], 2, "{summary}");
        // The error event is the router's answer: failed, not retried.
        assert_eq!(summary["errors"], 1, "{summary}");
        assert!(summary["turns"].as_u64().unwrap() >= 2, "{summary}");
    }

    #[tokio::test]
    async fn without_stream_retries_a_broken_stream_fails() {
        let url = fake_router(vec![Answer::Cut]).await;
        let config = AgenticRun {
            retries: Retries {
                stream: 0,
                ..Retries::default()
            },
            ..run_config(url)
        };
        let summary = run(config).await.unwrap();
        assert_eq!(summary["errors"], 1, "{summary}");
        assert_eq!(summary["client_retries"], 0, "{summary}");
    }
}
