//! The router service: a thin shell around [`RouterCore`].
//!
//! [`run`] connects to NATS and etcd, opens the inputs (load reports,
//! progress notices, the decision log, the worker registry), starts the
//! event loop that owns the core ([`event_loop`]) and serves the HTTP API
//! ([`http`]) until `shutdown` resolves. See the crate's README section in
//! `router/README.md` for the API and the settings.

pub mod chat_template;
pub mod config;
pub mod decision_log;
pub mod dispatch;
pub mod event_loop;
pub mod health;
pub mod http;
pub mod inputs;
pub mod metrics;
pub mod replica;
pub mod text;
pub mod token_cache;

use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use axum::serve::ListenerExt;
use bus::{Bus, BusError, Registry, RegistryError, StreamLimits};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

pub use config::{Args, Config, ConfigError, Loaded, Retry, Timeouts};
pub use http::{DECISION_HEADER, REQUEST_ID_HEADER};

use crate::core::RouterCore;
use chat_template::ChatTemplate;
use decision_log::DecisionLog;
use dispatch::Dispatcher;
use event_loop::{LoopParts, Readiness, RouterLoop};
use inputs::{InputError, Inputs};
use metrics::Metrics;
use text::{Text, TextError};

/// Commands queued for the event loop before handlers wait (backpressure).
const COMMAND_QUEUE: usize = 4096;

/// How often histogram samples are folded (small batches, off the loop).
const METRICS_UPKEEP: std::time::Duration = std::time::Duration::from_millis(100);

/// Why the service could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Core(#[from] crate::core::ConfigError),
    #[error(transparent)]
    Tokenizer(#[from] TextError),
    #[error(transparent)]
    ChatTemplate(#[from] chat_template::TemplateError),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("the HTTP server failed: {0}")]
    Http(std::io::Error),
    #[error("the event loop stopped unexpectedly")]
    LoopStopped,
}

/// Runs a router replica until `shutdown` resolves: serves HTTP on
/// `listener` (bind it first: its address is known before `run` starts),
/// then drains in-flight requests for at most `config.timeouts.drain`.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServiceError> {
    let text = config
        .tokenizer
        .as_deref()
        .map(|path| Text::load(path, config.tokenizer_cache))
        .transpose()?;
    let chat = match (&config.chat_template, &config.tokenizer) {
        (Some(path), _) => Some(ChatTemplate::from_file(path)?),
        (None, Some(tokenizer)) => {
            let beside = tokenizer.with_file_name("tokenizer_config.json");
            if beside.exists() {
                ChatTemplate::from_tokenizer_config(&beside)?
            } else {
                None
            }
        }
        (None, None) => None,
    };
    let core = RouterCore::new(config.router(), config.policy.clone())?;
    let hasher = *core.hasher();
    let seed = config.seed;
    let replica: Arc<str> = config.replica_id.as_str().into();
    tracing::info!(
        replica = %replica,
        model = %config.model,
        block_size = config.block_size,
        policy = core.policy().name(),
        params = ?core.policy().params(),
        seed,
        tokenizer = ?config.tokenizer,
        tokenizer_cache = text.as_ref().is_some_and(Text::cached),
        "starting the router"
    );

    let bus =
        Bus::connect_with(&config.nats_url, &format!("router-{replica}"), &config.nats).await?;
    bus.ensure_streams(&StreamLimits::with_replicas(config.stream_replicas))
        .await?;
    let registry = Registry::connect_with(&config.etcd_endpoints, &config.etcd).await?;
    let inputs = Inputs::open(&bus, registry).await?;

    let metrics = Metrics::new();
    let upkeep = tokio::spawn(metrics.clone().upkeep_every(METRICS_UPKEEP));
    let (ready_tx, ready_rx) = watch::channel(Readiness::not_ready("starting"));
    let (context_tx, context_rx) = watch::channel(0);
    let (commands, command_rx) = mpsc::channel(COMMAND_QUEUE);
    let (stop_loop, loop_stopped) = watch::channel(false);
    let (stop_http, http_stopped) = watch::channel(false);

    let (decision_log, log_task) =
        DecisionLog::start(bus.clone(), replica.clone(), metrics.clone());
    let router_loop = RouterLoop::new(LoopParts {
        core,
        seed,
        id_seed: random_seed(),
        replica: replica.clone(),
        bus: bus.clone(),
        metrics: metrics.clone(),
        readiness: ready_tx,
        context: context_tx,
        tick: config.timeouts.tick,
        reserve_blocks: config.reserve_blocks,
        decision_log,
        readiness_bounds: config.readiness,
        peers: crate::core::Peers::new(config.peers),
        admission: crate::core::Admission::new(config.admission),
        breakers: crate::core::Breakers::new(config.breaker),
    });
    let mut loop_task = tokio::spawn(router_loop.run(command_rx, inputs, loop_stopped));

    let dispatcher = Dispatcher::new(
        bus.clone(),
        replica.clone(),
        commands.clone(),
        config.timeouts,
        config.retry,
        std::time::Duration::from_millis(config.admission.max_wait_ms),
        metrics.clone(),
    );
    let app = Arc::new(http::App {
        commands,
        hasher,
        text,
        chat,
        model: config.model.clone(),
        replica: replica.clone(),
        metrics,
        readiness: ready_rx,
        draining: AtomicBool::new(false),
        dispatcher,
        route_timeout: config.timeouts.route,
        default_max_tokens: config.default_max_tokens,
        max_model_len: config.max_model_len,
        context: context_rx,
        started_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        next_request: AtomicU64::new(0),
    });
    let routes = http::router(app.clone(), config.max_body(), config.http.clone());
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving HTTP");
    }
    // Streamed tokens are small writes: without TCP_NODELAY, Nagle's
    // algorithm holds each one until the previous is acknowledged.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY on a connection");
        }
    });
    let mut http_task = tokio::spawn(async move {
        let mut stopped = http_stopped;
        // The peer's address: debug endpoints serve loopback clients only
        // when no admin token is set.
        let routes = routes.into_make_service_with_connect_info::<std::net::SocketAddr>();
        axum::serve(listener, routes)
            .with_graceful_shutdown(async move {
                let _ = stopped.wait_for(|s| *s).await;
            })
            .await
    });

    let outcome = tokio::select! {
        _ = shutdown => {
            app.draining.store(true, Ordering::Relaxed);
            let notice = config.timeouts.drain_notice;
            if !notice.is_zero() {
                tracing::info!(?notice, "shutting down: /readyz says draining; serving on for the notice");
                tokio::select! {
                    () = tokio::time::sleep(notice) => {}
                    _ = &mut http_task => {}
                }
            }
            tracing::info!("shutting down: draining HTTP requests");
            Ok(())
        }
        served = &mut http_task => Err(match served {
            Ok(Err(e)) => ServiceError::Http(e),
            _ => ServiceError::Http(std::io::Error::other("the HTTP server stopped")),
        }),
        _ = &mut loop_task => Err(ServiceError::LoopStopped),
    };

    // HTTP first (requests in flight still need the loop), then the loop.
    let _ = stop_http.send(true);
    if !http_task.is_finished()
        && tokio::time::timeout(config.timeouts.drain, &mut http_task)
            .await
            .is_err()
    {
        tracing::warn!(drain = ?config.timeouts.drain, "requests still in flight after the drain timeout; closing them");
        http_task.abort();
    }
    let _ = stop_loop.send(true);
    if !loop_task.is_finished() {
        let _ = loop_task.await;
    }
    // The loop held the last handle: the log drains what it sent.
    let _ = log_task.await;
    upkeep.abort();
    tracing::info!(replica = %replica, "router stopped");
    outcome
}

/// A seed for this replica's decision ids (unique per process), from the
/// process's randomly keyed hasher state: no RNG crate with OS entropy is
/// needed.
fn random_seed() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.write_u32(std::process::id());
    hasher.finish()
}
