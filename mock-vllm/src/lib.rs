//! mock-vllm: the whole vLLM-facing stack without a GPU.
//!
//! The `engine-sim` model (through the agent's [`worker_agent::SimEngine`],
//! in real time, sped up) behind vLLM's interfaces, so that the agent's
//! vLLM adapter ([`worker_agent::vllm`]) is exercised exactly as against a
//! real vLLM:
//!
//! - the OpenAI HTTP API ([`server`]): `/v1/completions` with token-id
//!   prompts, streamed (SSE, `token_ids` in every chunk's choice) or not;
//!   `kv_transfer_params` in and out (a request with `do_remote_decode`
//!   prefills and answers made-up NIXL parameters; one with
//!   `do_remote_prefill` treats the prompt's KV as received, after the
//!   simulated transfer); `/v1/models`; `/metrics` under vLLM's names;
//!   and, mock-only, `/switchyard/config` (block size and capacity, which
//!   real vLLM does not serve as such) and `/switchyard/debug` (what it
//!   was asked, e.g. the `kv_transfer_params` it received);
//! - KV events on a ZMQ PUB socket with a ROUTER replay socket keeping the
//!   last batches ([`publisher`]), in either encoding and with vLLM's or
//!   SGLang's hashes ([`wire`]): engine-sim's canonical events re-expressed
//!   as a real engine would publish them, with engine-private hashes, the
//!   blocks' tokens, the parent's engine hash, the block size and the
//!   medium ([`relabel`]);
//! - sampling and stopping fields (`server::SAMPLING_FIELDS`, vLLM's
//!   names, and `model` naming a LoRA adapter of `--lora-modules`): every
//!   one is accepted and recorded per request (`/switchyard/debug`'s
//!   `received`, the last 64 requests by `x-request-id`), so a test checks
//!   what arrived. The simulated engine honours what it models: it has no
//!   end-of-sequence token (every request runs to `max_tokens`, as with
//!   `ignore_eos`), `min_tokens` (checked against `max_tokens` as vLLM
//!   does), and `stop_token_ids` (the answer ends with the first one
//!   emitted at or after `min_tokens` tokens, `finish_reason: "stop"`).
//!   It draws no tokens, so temperature, top-p/k, min-p, penalties, seed,
//!   logit bias, stop strings and response formats are recorded but
//!   change nothing; `cache_salt` and the adapter do not change its block
//!   hashes;
//! - `--max-model-len` (default 131,072): reported in `/v1/models` (the
//!   agent registers it, routers check requests against it) and enforced
//!   with vLLM's 400; request bodies of any size (a 256k-token prompt is
//!   about 2 MB of JSON);
//! - data-parallel ranks: one engine and one publisher per rank, ports
//!   offset by the rank, requests pinned with `X-data-parallel-rank`
//!   (round robin without it).
//!
//! ```text
//! mock-vllm --port 8000 --role decode --block-size 16 --speedup 10 \
//!     --kv-events-endpoint 'tcp://*:5557' --kv-replay-endpoint 'tcp://*:5558'
//! worker-agent --worker-name decode-0 --role decode --engine vllm \
//!     --engine-url http://127.0.0.1:8000 \
//!     --kv-events-endpoint tcp://127.0.0.1:5557 --kv-replay-endpoint tcp://127.0.0.1:5558
//! ```

pub mod config;
pub mod itl;
pub mod nixl;
pub mod publisher;
pub mod relabel;
pub mod server;
pub mod wire;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt;
use protocol::{BlockHasher, Role, WorkerId};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};
use worker_agent::{Engine, EngineModelError, KvUpdate, SimEngine, SimEngineConfig};

pub use config::{Args, Config, ConfigError, Options};

/// Why mock-vllm cannot start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("the simulated engine cannot start: {0}")]
    Engine(#[from] engine_sim::ConfigError),
    #[error("binding {what} on {endpoint}: {message}")]
    Bind {
        what: &'static str,
        endpoint: String,
        message: String,
    },
    #[error("serving HTTP on {addr}: {source}")]
    Http {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

use crate::publisher::PublisherConfig;
use crate::relabel::Relabeler;
use crate::server::{App, RankHandle, RankStats};
use crate::wire::{encode_batch, Encoding, Flavour};

/// How long requests in flight get at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Runs mock-vllm until `shutdown` completes.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let s = config;
    let (stop, stop_rx) = watch::channel(false);
    let mut ranks = Vec::new();
    let mut tasks = Vec::new();
    for (rank, (endpoint, replay)) in s.endpoints.iter().enumerate() {
        let rank = rank as u32;
        let engine = SimEngine::start(SimEngineConfig {
            worker: WorkerId::new("mock", rank).expect("a valid worker name"),
            // Every role serves plain requests; the role only gates
            // kv_transfer_params (see the server).
            role: Role::Both,
            preset: s.preset,
            block_size: s.block_size,
            kv_capacity_blocks: s.kv_capacity_blocks,
            speedup: s.speedup,
            link: s.link,
        })?;
        let kv = engine
            .take_kv_updates()
            .expect("a fresh engine's KV stream is there");
        let capacity = engine.facts().kv_capacity_blocks as usize;
        let relabel = Arc::new(Mutex::new(Relabeler::new(
            BlockHasher::new(s.block_size, s.preset.salt())
                .map_err(|_| ConfigError::from(EngineModelError::ZeroBlockSize))?,
            s.flavour,
            s.hash_seed.wrapping_add(u64::from(rank)),
            (4 * capacity).max(100_000),
        )));
        let publisher_config = PublisherConfig {
            endpoint: endpoint.clone(),
            replay_endpoint: replay.clone(),
            topic: s.topic.clone(),
            buffer: s.replay_buffer,
            replay_topic_frame: s.replay_topic_frame,
        };
        let (pub_socket, router) = publisher::bind(&publisher_config).await?;
        let (batches_tx, batches_rx) = mpsc::channel(4096);
        let (published_tx, published_rx) = watch::channel(0);
        tasks.push(tokio::spawn(publisher::run(
            publisher_config,
            pub_socket,
            router,
            batches_rx,
            published_tx,
            stop_rx.clone(),
        )));
        tasks.push(tokio::spawn(forward_kv(
            kv,
            relabel.clone(),
            batches_tx,
            rank,
            s.encoding,
            s.flavour,
        )));
        ranks.push(RankHandle {
            engine,
            relabel,
            published: published_rx,
            stats: Mutex::new(RankStats::default()),
        });
    }
    let listener = tokio::net::TcpListener::bind(s.listen)
        .await
        .map_err(|source| Error::Http {
            addr: s.listen,
            source,
        })?;
    info!(
        addr = %s.listen,
        model = %s.model,
        role = %s.role,
        block_size = s.block_size,
        ranks = ranks.len(),
        encoding = ?s.encoding,
        hash_flavour = ?s.flavour,
        "mock-vllm serving"
    );
    let app = Arc::new(App::new(s, ranks));
    // At shutdown, requests in flight get a grace period; idle keep-alive
    // connections (the agent's pool) do not hold the exit.
    let (stopping, mut stopping_rx) = watch::channel(false);
    let mut signal = stopping_rx.clone();
    tokio::spawn(async move {
        shutdown.await;
        let _ = stopping.send(true);
    });
    let serve =
        axum::serve(listener, server::router(app.clone())).with_graceful_shutdown(async move {
            let _ = signal.wait_for(|s| *s).await;
        });
    let served = tokio::select! {
        served = serve => served,
        () = async {
            let _ = stopping_rx.wait_for(|s| *s).await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {
            warn!("requests still open after the shutdown grace period: closed");
            Ok(())
        }
    };
    let _ = stop.send(true);
    for r in &app.ranks {
        r.engine.stop();
    }
    for task in tasks {
        if tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .is_err()
        {
            warn!("a task did not stop in time");
        }
    }
    info!("stopped");
    let addr = app.settings.listen;
    served.map_err(|source| Error::Http { addr, source })
}

/// The engine's canonical events, relabeled and encoded, to the publisher.
async fn forward_kv(
    mut kv: futures::stream::BoxStream<'static, KvUpdate>,
    relabel: Arc<Mutex<Relabeler>>,
    batches: mpsc::Sender<Bytes>,
    rank: u32,
    encoding: Encoding,
    flavour: Flavour,
) {
    let mut reported = relabel::RelabelErrors::default();
    while let Some(update) = kv.next().await {
        let KvUpdate::Events(events) = update else {
            continue;
        };
        let (engine_events, errors) = {
            let mut r = relabel
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let out = r.relabel(&events);
            (out, r.errors)
        };
        if errors != reported {
            warn!(
                ?errors,
                "blocks that could not be relabeled (a mock-vllm bug)"
            );
            reported = errors;
        }
        if engine_events.is_empty() {
            continue;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = encode_batch(ts, &engine_events, rank, encoding, flavour);
        // Never dropped: a lost batch would be a gap nobody can see.
        if batches.send(Bytes::from(payload)).await.is_err() {
            return;
        }
    }
}
