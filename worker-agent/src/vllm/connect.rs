//! Start-up: waits for the engine's API, learns the model it serves, its
//! block size and KV capacity, refuses a contract the deployment does not
//! use, subscribes to its KV events and starts the KV and scrape tasks.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use protocol::HashingContract;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{info, Instrument};

use super::engine::{lock, Shared, VllmConfig, VllmEngine, VllmError};
use super::kv_task::KvTask;
use super::load::{scrape, scrape_loop};
use super::proxy::RequestContext;
use super::sequence::{RankCore, Stats};
use super::translate::Translator;
use super::zmq as z;
use crate::engine::EngineFacts;

/// Facts learned at start, and how.
#[derive(Debug, Clone)]
struct Learned {
    served_model: String,
    block_size: u32,
    block_size_from: &'static str,
    capacity: u64,
}

impl VllmEngine {
    /// Waits for the engine's API (up to the startup timeout), learns its
    /// model, block size and capacity, subscribes to its KV events and
    /// starts reading them and its metrics. Call inside a tokio runtime.
    pub async fn connect(config: VllmConfig) -> Result<Self, VllmError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| VllmError::Http(e.to_string()))?;
        let base = config.api_url.trim_end_matches('/').to_owned();
        let started = Instant::now();
        let deadline = started + config.startup_timeout;
        let rank = config.worker.dp_rank();

        // 1. The API is up and serves a model.
        let models_url = format!("{base}/v1/models");
        let mut said = false;
        let models = loop {
            match get_json(&http, &models_url, Duration::from_secs(5)).await {
                Ok(v) => break v,
                Err(e) => {
                    if Instant::now() >= deadline {
                        return Err(VllmError::Unreachable {
                            kind: config.kind.as_str(),
                            url: models_url,
                            waited: config.startup_timeout,
                            last: e,
                        });
                    }
                    if !said {
                        info!(url = %models_url, error = %e, "waiting for the engine's API");
                        said = true;
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        };
        let served: Vec<String> = models["data"]
            .as_array()
            .map(|d| {
                d.iter()
                    .filter_map(|m| m["id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let max_model_len = |model: &str| {
            models["data"]
                .as_array()?
                .iter()
                .find(|m| m["id"] == model)?["max_model_len"]
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
        };
        let served_model = if served.contains(&config.model) {
            config.model.clone()
        } else {
            served
                .first()
                .cloned()
                .ok_or(VllmError::NoModel { url: base.clone() })?
        };

        // 2. Block size and capacity: mock-vllm says at /switchyard/config;
        // vLLM exports its cache configuration as metric labels; otherwise
        // the deployment's block size, checked against the first
        // BlockStored.
        let sy = get_json(
            &http,
            &format!("{base}/switchyard/config"),
            Duration::from_secs(2),
        )
        .await
        .ok();
        let scraped = scrape(&http, &format!("{base}/metrics"), &served_model, rank)
            .await
            .ok();
        let (block_size, block_size_from) = match (
            sy.as_ref()
                .and_then(|c| c["block_size"].as_u64())
                .and_then(|b| u32::try_from(b).ok()),
            scraped.and_then(|s| s.block_size),
        ) {
            (Some(b), _) => (b, "/switchyard/config"),
            (None, Some(b)) => (b, "vllm:cache_config_info"),
            (None, None) => (
                config.block_size,
                "configuration (checked against the first BlockStored)",
            ),
        };
        let capacity = config
            .kv_capacity_blocks
            .map(u64::from)
            .or_else(|| sy.as_ref().and_then(|c| c["kv_capacity_blocks"].as_u64()))
            .or_else(|| scraped.and_then(|s| s.num_gpu_blocks))
            .unwrap_or_else(|| u64::from(config.preset.kv_capacity_blocks(block_size.max(1))));
        let max_model_len = max_model_len(&served_model).unwrap_or(0);
        let learned = Learned {
            served_model,
            block_size,
            block_size_from,
            capacity,
        };
        info!(
            engine = config.kind.as_str(),
            url = %base,
            model = %learned.served_model,
            block_size = learned.block_size,
            block_size_from = learned.block_size_from,
            kv_capacity_blocks = learned.capacity,
            max_model_len,
            "engine API up"
        );
        let facts = EngineFacts {
            contract: HashingContract::for_model(&learned.served_model, learned.block_size),
            kv_capacity_blocks: learned.capacity,
            max_batched_tokens: config.preset.max_batched_tokens,
            kv_bytes_per_token: config.preset.kv_bytes_per_token,
            gpus: config.preset.gpus,
            max_model_len,
        };

        // A model or block size the deployment does not use is refused
        // before anything else.
        let configured = HashingContract::for_model(&config.model, config.block_size);
        if let Err(source) = configured.check(&facts.contract) {
            return Err(VllmError::Contract { configured, source });
        }

        // 3. KV events: subscribe now; the history comes from the replay.
        let events_endpoint =
            z::offset_endpoint(&config.kv_events, rank).map_err(VllmError::Zmq)?;
        let replay_endpoint = config
            .kv_replay
            .as_deref()
            .map(|e| z::offset_endpoint(e, rank))
            .transpose()
            .map_err(VllmError::Zmq)?;
        let sub = z::connect_sub(&events_endpoint, &config.topic, deadline)
            .await
            .map_err(VllmError::Zmq)?;
        info!(
            endpoint = %events_endpoint,
            replay = replay_endpoint.as_deref().unwrap_or("none"),
            topic = %config.topic,
            "subscribed to the engine's KV events"
        );

        let shared = Arc::new(Shared::default());
        *lock(&shared.scraped) = scraped.unwrap_or_default();
        let (stop, stop_rx) = watch::channel(false);
        let (updates_tx, updates_rx) = mpsc::unbounded_channel();
        let (commands_tx, commands_rx) = mpsc::unbounded_channel();
        // The deployment's hasher: the translator names blocks the way the
        // router does (the block size is checked event by event).
        let hasher = HashingContract::for_model(&config.model, config.block_size)
            .hasher()
            .map_err(|e| VllmError::Zmq(e.to_string()))?;
        let core = RankCore::new(
            Translator::new(&config.model, hasher),
            rank,
            replay_endpoint.is_some(),
            100_000,
        );
        let span = tracing::Span::current();
        let kv_task = tokio::spawn(
            KvTask {
                core,
                sub,
                topic: Bytes::from(config.topic.clone().into_bytes()),
                replay_endpoint,
                replay_limits: config.replay,
                idle_check: config.idle_check,
                updates: updates_tx,
                commands: commands_rx,
                stop: stop_rx.clone(),
                shared: shared.clone(),
                exported: Stats::default(),
            }
            .run()
            .instrument(span.clone()),
        );
        let scrape_task = tokio::spawn(
            scrape_loop(
                http.clone(),
                format!("{base}/metrics"),
                learned.served_model.clone(),
                rank,
                config.metrics_interval,
                shared.clone(),
                stop_rx.clone(),
            )
            .instrument(span),
        );
        let ctx = Arc::new(RequestContext {
            kind: config.kind,
            http,
            completions_url: format!("{base}/v1/completions"),
            model: learned.served_model.clone(),
            worker: config.worker.clone(),
            dp_size: config.dp_size,
            block_size: learned.block_size,
            return_token_ids: config.return_token_ids,
            bidirectional: config.bidirectional_kv,
            do_local_prefill: config.do_local_prefill,
            timeout: config.request_timeout,
            kv: commands_tx.clone(),
            stop: stop_rx,
        });
        Ok(Self {
            facts,
            ctx,
            shared,
            kv_updates: Mutex::new(Some(updates_rx)),
            commands: commands_tx,
            stop,
            tasks: Mutex::new(vec![kv_task, scrape_task]),
        })
    }
}

async fn get_json(http: &reqwest::Client, url: &str, timeout: Duration) -> Result<Value, String> {
    let response = tokio::time::timeout(timeout, http.get(url).send())
        .await
        .map_err(|_| format!("GET {url} timed out"))?
        .map_err(|e| format!("GET {url}: {e}"))?;
    let status = response.status();
    if !status.is_success() {
        return Err(format!("GET {url}: HTTP {status}"));
    }
    tokio::time::timeout(timeout, response.json::<Value>())
        .await
        .map_err(|_| format!("GET {url}: body timed out"))?
        .map_err(|e| format!("GET {url}: {e}"))
}
