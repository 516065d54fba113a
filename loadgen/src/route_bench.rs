//! `/v1/route` at fixed request rates (open loop), from another process.
//! Two latencies per request: from its actual send (the router's service
//! time plus the loopback HTTP exchange) and from its scheduled send time
//! (which also counts the load generator's own timer and scheduling lag,
//! so that a stall cannot hide queueing: no coordinated omission).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use tokio::sync::{Mutex, Semaphore};

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
    /// Stop the sweep once p99 exceeds this.
    pub stop_above_p99_ms: f64,
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
            let body =
                serde_json::json!({"model": "switchyard", "prompt": prompt, "max_tokens": 128});
            bytes::Bytes::from(serde_json::to_vec(&body).expect("JSON"))
        })
        .collect()
}

/// Runs the sweep; one JSON object per rate.
pub async fn run(bench: RouteBench) -> anyhow::Result<Vec<serde_json::Value>> {
    let client = reqwest::Client::builder()
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
        let samples = Arc::new(Mutex::new((Samples::default(), Samples::default())));
        let errors = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let limit = Arc::new(Semaphore::new(bench.max_in_flight));
        let mut shed = 0usize;
        let n = (rate * bench.duration.as_secs_f64()) as usize;
        let interval = Duration::from_secs_f64(1.0 / rate);
        let start = Instant::now() + Duration::from_millis(10);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..n {
            let scheduled = start + interval.mul_f64(i as f64);
            tokio::time::sleep_until(scheduled.into()).await;
            let Ok(permit) = limit.clone().try_acquire_owned() else {
                shed += 1;
                continue;
            };
            let (client, url, body) = (
                client.clone(),
                url.clone(),
                bodies[i % bodies.len()].clone(),
            );
            let (samples, errors) = (samples.clone(), errors.clone());
            tasks.spawn(async move {
                let sent = Instant::now();
                let result = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await;
                let ok = match result {
                    Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                    Err(_) => false,
                };
                if ok {
                    let mut s = samples.lock().await;
                    s.0.push(sent.elapsed());
                    s.1.push(scheduled.elapsed());
                } else {
                    errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                drop(permit);
            });
        }
        while tasks.join_next().await.is_some() {}
        let elapsed = start.elapsed().as_secs_f64();
        let mut samples = samples.lock().await;
        let ok = samples.0.len();
        let p99 = samples.0.percentile_ms(0.99);
        out.push(serde_json::json!({
            "target_rps": rate,
            "achieved_rps": round3(ok as f64 / elapsed),
            "requests": n,
            "errors": errors.load(std::sync::atomic::Ordering::Relaxed),
            "shed_over_max_in_flight": shed,
            "prompt_tokens": bench.prompt_tokens,
            "latency_ms": samples.0.summary(),
            "latency_from_schedule_ms": samples.1.summary(),
        }));
        if p99 > bench.stop_above_p99_ms {
            break;
        }
    }
    Ok(out)
}
