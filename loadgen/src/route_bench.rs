//! `/v1/route` at fixed request rates (open loop), from another process.
//! Two latencies per request: from its actual send (the router's service
//! time plus the loopback HTTP exchange) and from its scheduled send time
//! (which also counts the load generator's own timer and scheduling lag,
//! so that a stall cannot hide queueing: no coordinated omission).
//! Each rate runs several rounds; the figures are the rounds' medians, with
//! every round's p99 and maximum beside them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::bail;
use tokio::sync::Semaphore;

use crate::stats::{round3, Samples};

/// What to measure.
#[derive(Debug, Clone)]
pub struct RouteBench {
    pub router: String,
    /// Requests per second, tried in order.
    pub rates: Vec<f64>,
    pub duration: Duration,
    pub prompt_tokens: usize,
    /// Distinct prompts cycled through (sharing prefixes in groups).
    pub distinct: usize,
    pub max_in_flight: usize,
    /// Rounds per rate; the figures are their medians (a single round's
    /// tail swings with whatever else the machine runs).
    pub rounds: usize,
    /// Stop the sweep once the median p99 exceeds this.
    pub stop_above_p99_ms: f64,
    /// The router's API key.
    pub api_key: Option<String>,
}

/// Request bodies: groups of prompts sharing three quarters of their tokens.
fn bodies(prompt_tokens: usize, distinct: usize) -> Vec<bytes::Bytes> {
    (0..distinct.max(1))
        .map(|i| {
            let shared = prompt_tokens * 3 / 4;
            let mut prompt = Vec::with_capacity(prompt_tokens);
            protocol::trace::extend_block_tokens((i % 16) as u64, shared, &mut prompt);
            protocol::trace::extend_block_tokens(
                1_000_000 + i as u64,
                prompt_tokens - shared,
                &mut prompt,
            );
            let body = serde_json::json!({"prompt": prompt, "max_tokens": 128});
            bytes::Bytes::from(serde_json::to_vec(&body).expect("JSON"))
        })
        .collect()
}

/// Runs the sweep; one JSON object per rate.
pub async fn run(bench: RouteBench) -> anyhow::Result<Vec<serde_json::Value>> {
    let client = crate::api_key::client(bench.api_key.as_deref())?
        .pool_max_idle_per_host(bench.max_in_flight)
        .build()?;
    let bodies = Arc::new(bodies(bench.prompt_tokens, bench.distinct));
    let url = format!("{}/v1/route", bench.router);
    // Warm up connections and the router.
    for body in bodies.iter().take(32) {
        let status = client
            .post(&url)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await?
            .status();
        if !status.is_success() {
            bail!("warm-up request got HTTP {status}");
        }
    }
    let mut out = Vec::new();
    for &rate in &bench.rates {
        let mut rounds = Vec::with_capacity(bench.rounds);
        for _ in 0..bench.rounds.max(1) {
            rounds.push(round(&bench, &client, &url, &bodies, rate).await?);
        }
        let latency = medians(&rounds, |r| &r.latency);
        let p99 = latency["p99"].as_f64().unwrap_or(0.0);
        out.push(serde_json::json!({
            "url": url,
            "target_rps": rate,
            "achieved_rps": round3(median(rounds.iter().map(|r| r.achieved_rps))),
            "rounds": rounds.len(),
            "requests_per_round": rounds[0].requests,
            "errors": rounds.iter().map(|r| r.errors).sum::<usize>(),
            "shed_over_max_in_flight": rounds.iter().map(|r| r.shed).sum::<usize>(),
            "prompt_tokens": bench.prompt_tokens,
            "latency_ms": latency,
            "latency_from_schedule_ms": medians(&rounds, |r| &r.from_schedule),
            "p99_ms_per_round": rounds.iter().map(|r| r.latency["p99"].clone()).collect::<Vec<_>>(),
            "max_ms_per_round": rounds.iter().map(|r| r.latency["max"].clone()).collect::<Vec<_>>(),
        }));
        if p99 > bench.stop_above_p99_ms {
            break;
        }
    }
    Ok(out)
}

/// The rounds' medians of p50, p90 and p99 of one kind of latency.
fn medians(rounds: &[Round], kind: impl Fn(&Round) -> &serde_json::Value) -> serde_json::Value {
    let of = |q: &str| {
        round3(median(
            rounds.iter().map(|r| kind(r)[q].as_f64().unwrap_or(0.0)),
        ))
    };
    serde_json::json!({"p50": of("p50"), "p90": of("p90"), "p99": of("p99")})
}

/// The median (the lower one of an even count; 0 when empty).
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
}

/// One round at one rate.
struct Round {
    requests: usize,
    achieved_rps: f64,
    errors: usize,
    shed: usize,
    latency: serde_json::Value,
    from_schedule: serde_json::Value,
}

async fn round(
    bench: &RouteBench,
    client: &reqwest::Client,
    url: &str,
    bodies: &Arc<Vec<bytes::Bytes>>,
    rate: f64,
) -> anyhow::Result<Round> {
    let samples = Arc::new(Mutex::new((Samples::default(), Samples::default())));
    let errors = Arc::new(AtomicUsize::new(0));
    let limit = Arc::new(Semaphore::new(bench.max_in_flight));
    let n = (rate * bench.duration.as_secs_f64()) as usize;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = Instant::now() + Duration::from_millis(10);
    // The pacer is an OS thread: tokio's timer ticks in milliseconds,
    // which would send 5 requests at once every millisecond at 5k/s
    // (a burst the router then queues) and add up to 1 ms to every
    // latency from the schedule.
    let runtime = tokio::runtime::Handle::current();
    let pacer = {
        let (client, url, bodies) = (client.clone(), url.to_owned(), bodies.clone());
        let (samples, errors) = (samples.clone(), errors.clone());
        tokio::task::spawn_blocking(move || {
            let mut tasks = Vec::with_capacity(n);
            let mut shed = 0usize;
            for i in 0..n {
                let scheduled = start + interval.mul_f64(i as f64);
                if let Some(wait) = scheduled.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let Ok(permit) = limit.clone().try_acquire_owned() else {
                    shed += 1;
                    continue;
                };
                let request = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(bodies[i % bodies.len()].clone());
                let (samples, errors) = (samples.clone(), errors.clone());
                tasks.push(runtime.spawn(async move {
                    let sent = Instant::now();
                    let ok = match request.send().await {
                        Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                        Err(_) => false,
                    };
                    if ok {
                        let mut s = samples.lock().expect("not poisoned");
                        s.0.push(sent.elapsed());
                        s.1.push(scheduled.elapsed());
                    } else {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    drop(permit);
                }));
            }
            (tasks, shed)
        })
    };
    let (tasks, shed) = pacer.await?;
    for task in tasks {
        task.await?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut samples = samples.lock().expect("not poisoned");
    Ok(Round {
        requests: n,
        achieved_rps: samples.0.len() as f64 / elapsed,
        errors: errors.load(Ordering::Relaxed),
        shed,
        latency: samples.0.summary(),
        from_schedule: samples.1.summary(),
    })
}
