//! The engine's load: `/metrics` scraped every interval ([`super::prom`]),
//! completed with what the metrics do not say, from this agent's requests
//! in flight (prompt tokens still to prefill, blocks of decoding requests).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use metrics::counter;
use protocol::{GenerateRequest, Stage};
use tokio::sync::watch;
use tracing::{info, warn};

use super::engine::{lock, Shared};
use super::prom::{self, ScrapedLoad};
use super::recent::RecentLatency;
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
    /// What it leaves the engine to compute ([`expected_prefill_tokens`]).
    prefill_tokens: u64,
    produced: u64,
    decoding: bool,
}

/// Prompt tokens a routed request leaves this engine to compute: its prompt
/// less the prefix the router expected here (the decode worker's on a
/// local leg; on a prefill leg the prefill worker's, or the prefix it
/// fetches), and none on a decode leg, whose KV arrives. What the load
/// report queues while the request waits: the router's ledger counts the
/// same, and a whole prompt made a worker holding many prefixes look busier
/// than it is.
pub(super) fn expected_prefill_tokens(request: &GenerateRequest) -> u64 {
    let a = &request.annotation;
    let held = match &request.stage {
        Stage::Local => a.decode_overlap_tokens,
        Stage::Prefill => a.fetch.as_ref().map_or(a.prefill_overlap_tokens, |f| {
            f.prefix_tokens.max(a.prefill_overlap_tokens)
        }),
        Stage::Decode { .. } => return 0,
    };
    (request.prompt.len() as u64).saturating_sub(u64::from(held))
}

/// Removes its request from the in-flight set when dropped.
pub(super) struct InflightGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl InflightGuard {
    /// Adds a routed request to the in-flight set.
    pub(super) fn new(shared: &Arc<Shared>, request: &GenerateRequest) -> Self {
        let mut inflight = lock(&shared.inflight);
        let id = inflight.next;
        inflight.next += 1;
        inflight.requests.insert(
            id,
            InflightRequest {
                prompt_tokens: request.prompt.len() as u64,
                prefill_tokens: expected_prefill_tokens(request),
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
            queued += r.prefill_tokens;
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
        recent_itl_us: scraped.recent_itl_us,
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

/// Scrapes every `interval` into the shared state until `stop`, with the
/// recent inter-token latency from the scrapes so far; a failing scrape
/// keeps the last values (said once, counted every time).
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
    let started = tokio::time::Instant::now();
    let mut recent = RecentLatency::default();
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        match scrape(&http, &url, &model, rank).await {
            Ok(mut load) => {
                if failing {
                    info!(url, "engine metrics scraped again");
                    failing = false;
                }
                let at_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                recent.observe(at_ms, load.itl);
                load.recent_itl_us = recent.mean_us();
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

#[cfg(test)]
mod tests {
    use ::tests::fixtures::generate_request;
    use protocol::{KvTransferParams, PrefixFetch, WorkerId};

    use super::*;

    #[test]
    fn a_leg_queues_what_the_router_expected_it_to_compute() {
        let mut r = generate_request("r", Stage::Local, vec![7; 1000], 8);
        r.annotation.decode_overlap_tokens = 640;
        r.annotation.prefill_overlap_tokens = 128;
        assert_eq!(expected_prefill_tokens(&r), 360);
        r.stage = Stage::Prefill;
        assert_eq!(expected_prefill_tokens(&r), 872);
        r.annotation.fetch = Some(PrefixFetch {
            source: WorkerId::new("d1", 0).unwrap(),
            prefix_tokens: 896,
            pulled_tokens: 768,
        });
        assert_eq!(expected_prefill_tokens(&r), 104);
        r.stage = Stage::Decode {
            transfer: KvTransferParams {
                source: WorkerId::new("p0", 0).unwrap(),
                prompt_tokens: 1000,
                engine: None,
            },
        };
        assert_eq!(expected_prefill_tokens(&r), 0);
        // An overlap the router overestimated leaves nothing, not less.
        r.stage = Stage::Local;
        r.annotation.decode_overlap_tokens = 5000;
        assert_eq!(expected_prefill_tokens(&r), 0);
    }
}
