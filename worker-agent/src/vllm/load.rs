//! The engine's load: `/metrics` scraped every interval ([`super::prom`]),
//! completed with what the metrics do not say, from this agent's requests
//! in flight (prompt tokens still to prefill, blocks of decoding requests).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use metrics::counter;
use tokio::sync::watch;
use tracing::{info, warn};

use super::engine::{lock, Shared};
use super::prom::{self, ScrapedLoad};
use crate::engine::EngineLoad;
use crate::metrics as m;

/// The requests this agent has in flight on the engine: what the
/// engine's metrics do not say (prompt tokens still to prefill, blocks of
/// decoding requests).
#[derive(Debug, Default)]
pub(super) struct Inflight {
    next: u64,
    requests: HashMap<u64, InflightRequest>,
}

#[derive(Debug, Clone, Copy)]
struct InflightRequest {
    prompt_tokens: u64,
    produced: u64,
    decoding: bool,
}

/// Removes its request from the in-flight set when dropped.
pub(super) struct InflightGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl InflightGuard {
    /// Adds a request of `prompt_tokens` to the in-flight set.
    pub(super) fn new(shared: &Arc<Shared>, prompt_tokens: usize) -> Self {
        let mut inflight = lock(&shared.inflight);
        let id = inflight.next;
        inflight.next += 1;
        inflight.requests.insert(
            id,
            InflightRequest {
                prompt_tokens: prompt_tokens as u64,
                produced: 0,
                decoding: false,
            },
        );
        Self {
            shared: shared.clone(),
            id,
        }
    }

    /// The request produced `tokens` more: it is decoding.
    pub(super) fn produced(&self, tokens: usize) {
        if let Some(r) = lock(&self.shared.inflight).requests.get_mut(&self.id) {
            r.decoding = true;
            r.produced += tokens as u64;
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        lock(&self.shared.inflight).requests.remove(&self.id);
    }
}

/// The load now: the engine's scraped counts (which include requests from
/// others), else this agent's requests in flight.
pub(super) fn engine_load(shared: &Shared, block_size: u32, total: u64) -> EngineLoad {
    let scraped = *lock(&shared.scraped);
    let bs = u64::from(block_size.max(1));
    let (mut running, mut waiting, mut queued, mut decode_blocks) = (0u32, 0u32, 0u64, 0u64);
    for r in lock(&shared.inflight).requests.values() {
        if r.decoding {
            running += 1;
            decode_blocks += (r.prompt_tokens + r.produced).div_ceil(bs);
        } else {
            waiting += 1;
            queued += r.prompt_tokens;
        }
    }
    let as_u32 = |v: f64| {
        if v.is_finite() && v > 0.0 {
            v.round().min(f64::from(u32::MAX)) as u32
        } else {
            0
        }
    };
    EngineLoad {
        // The engine's own counts include requests from others; before
        // the first scrape, this agent's requests.
        running: scraped.running.map_or(running, as_u32),
        waiting: scraped.waiting.map_or(waiting, as_u32),
        queued_prefill_tokens: queued,
        active_decode_blocks: decode_blocks,
        kv_blocks_used: scraped
            .kv_usage
            .map_or(0, |u| (u * total as f64).round() as u64)
            .min(total),
        kv_blocks_total: total,
    }
}

/// One scrape of the engine's `/metrics` for `model` at `rank`.
pub(super) async fn scrape(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    rank: u32,
) -> Result<ScrapedLoad, String> {
    let timeout = Duration::from_secs(2);
    let response = tokio::time::timeout(timeout, http.get(url).send())
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("HTTP {}", response.status()));
    }
    let text = tokio::time::timeout(timeout, response.text())
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    let (samples, bad) = prom::parse(&text);
    if bad > 0 {
        counter!(m::ENGINE_SCRAPE_ERRORS, "reason" => "bad_line").increment(bad as u64);
    }
    Ok(prom::load(&samples, Some(model), rank))
}

/// Scrapes every `interval` into the shared state until `stop`; a failing
/// scrape keeps the last values (said once, counted every time).
pub(super) async fn scrape_loop(
    http: reqwest::Client,
    url: String,
    model: String,
    rank: u32,
    interval: Duration,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        match scrape(&http, &url, &model, rank).await {
            Ok(load) => {
                if failing {
                    info!(url, "engine metrics scraped again");
                    failing = false;
                }
                *lock(&shared.scraped) = load;
            }
            Err(e) => {
                counter!(m::ENGINE_SCRAPE_ERRORS, "reason" => "request").increment(1);
                if !failing {
                    warn!(url, error = %e, "engine metrics not scraped; the load keeps its last values");
                    failing = true;
                }
            }
        }
    }
}
