//! Start-up and stop: the engine (simulated, or a real one connected to),
//! its contract checked, NATS and etcd connected, the worker registered,
//! the loop run until shutdown, then the orderly stop.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, Subscriber};
use bus::{Bus, Registry};
use futures::stream::BoxStream;
use metrics::counter;
use protocol::{
    subjects, ContractMismatch, HashingContract, WorkerId, WorkerRecord, WorkerSubjects,
};
use tracing::{error, info, warn, Instrument};

use super::event_loop::{unix_ms, Agent, Epochs, Subscriptions};
use crate::config::Config;
use crate::engine::{Engine, KvUpdate};
use crate::error::AgentError;
use crate::metrics as m;
use crate::sim_engine::{SimEngine, SimEngineConfig};
use crate::vllm::{VllmEngine, VllmError};

/// Runs the agent with the configured engine (the built-in simulated one,
/// or a real one it connects to) until `shutdown` completes, then revokes
/// the registration and stops.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AgentError> {
    let settings = &config;
    let mut shutdown = std::pin::pin!(shutdown);
    let engine: Arc<dyn Engine> = match settings.real_engine.clone() {
        None => Arc::new(SimEngine::start(SimEngineConfig {
            worker: settings.worker.clone(),
            role: settings.role,
            preset: settings.preset,
            block_size: settings.contract.block_size,
            kv_capacity_blocks: settings.kv_capacity_blocks,
            speedup: settings.speedup,
            link: settings.link,
        })?),
        Some(real) => {
            if config.http_addr.is_some() {
                // Installed before the engine's first events are counted.
                let _ = crate::metrics::prometheus();
            }
            let span = tracing::info_span!("worker_agent", worker = %settings.worker);
            let connect = VllmEngine::connect(real).instrument(span);
            // The engine may take long to come up (its own timeout); an
            // early shutdown stops the wait.
            tokio::select! {
                engine = connect => match engine {
                    Ok(engine) => Arc::new(engine),
                    Err(VllmError::Contract { configured, source }) => {
                        return Err(refuse_engine(&settings.worker, configured, source));
                    }
                    Err(e) => return Err(e.into()),
                },
                () = shutdown.as_mut() => return Ok(()),
            }
        }
    };
    run_with_engine(config, engine, shutdown).await
}

/// Runs the agent in front of `engine` until `shutdown` completes.
pub async fn run_with_engine(
    config: Config,
    engine: Arc<dyn Engine>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AgentError> {
    let facts = engine.facts();
    if let Err(source) = config.contract.check(&facts.contract) {
        return Err(refuse_engine(
            &config.worker,
            config.contract.clone(),
            source,
        ));
    }
    let kv_updates = engine.take_kv_updates().ok_or(AgentError::KvStreamTaken)?;
    let span = tracing::info_span!("worker_agent", worker = %config.worker);
    serve_worker(config, engine, kv_updates, shutdown)
        .instrument(span)
        .await
}

/// The engine names blocks differently from the deployment: it is refused
/// (logged, counted), never registered.
fn refuse_engine(
    worker: &WorkerId,
    configured: HashingContract,
    source: ContractMismatch,
) -> AgentError {
    counter!(m::CONTRACT_REFUSALS, "reason" => source.label()).increment(1);
    error!(
        worker = %worker,
        error = %source,
        "REFUSING the engine: it names blocks differently from the deployment"
    );
    AgentError::Contract { configured, source }
}

/// Connects, registers, serves until `shutdown`, then stops.
async fn serve_worker(
    config: Config,
    engine: Arc<dyn Engine>,
    kv_updates: BoxStream<'static, KvUpdate>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AgentError> {
    let facts = engine.facts();
    let worker = config.worker.clone();
    let bus = Bus::connect_with(
        &config.nats_url,
        &format!("worker-agent {worker}"),
        &config.nats,
    )
    .await?;
    bus.ensure_kv_stream(&bus::StreamLimits::with_replicas(config.stream_replicas))
        .await?;
    let client = bus.client().clone();
    let subscriptions = Subscriptions {
        generate: subscribe(&client, subjects::generate(&worker)).await?,
        resync: subscribe(&client, subjects::resync(&worker)).await?,
        cancel: subscribe(&client, subjects::cancel(&worker)).await?,
        reannounce: subscribe(&client, subjects::kv_reannounce(&worker)).await?,
    };
    let in_flight = super::ping::InFlight::default();
    let pings = super::ping::answer(
        client.clone(),
        subscribe(&client, subjects::ping(&worker)).await?,
        in_flight.clone(),
    );
    let handle_queries = super::kv_handle::answer(
        client.clone(),
        subscribe(&client, subjects::kv_handle(&worker)).await?,
        engine.clone(),
    );

    let store_full = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (http_stop, http_task) = match config.http_addr {
        Some(addr) => {
            // Installed before anything is counted.
            let metrics = crate::metrics::prometheus();
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| AgentError::Http { addr, source })?;
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(crate::http::serve(
                listener,
                metrics,
                client.clone(),
                store_full.clone(),
                async {
                    let _ = stopped.await;
                },
            ));
            info!(%addr, "serving /metrics and /healthz");
            (Some(stop), Some(task))
        }
        None => (None, None),
    };

    let record = WorkerRecord {
        id: worker.clone(),
        role: config.role,
        contract: config.contract.clone(),
        kv_capacity_blocks: facts.kv_capacity_blocks,
        max_batched_tokens: facts.max_batched_tokens,
        kv_bytes_per_token: facts.kv_bytes_per_token,
        gpus: facts.gpus,
        subjects: WorkerSubjects::for_worker(&worker),
        max_model_len: facts.max_model_len,
        capabilities: config.capabilities,
    };
    let registry = Registry::connect_with(&config.etcd_endpoints, &config.etcd).await?;
    let registration = registry.register(&record, config.lease_ttl).await?;
    let epochs = Epochs {
        first: registry.next_epoch(&worker, unix_ms()).await?,
        registry: registry.clone(),
    };

    let mut agent = Agent::new(
        &config,
        engine,
        bus,
        kv_updates,
        subscriptions,
        epochs,
        in_flight,
    );
    agent.store_full = store_full;
    info!(
        role = %config.role,
        epoch = agent.epoch(),
        lease = registration.lease(),
        model = %config.contract.model,
        capabilities = %record.capabilities.names(),
        "worker registered; serving"
    );
    let result = agent.serve(shutdown).await;

    // Stop: leave the registry first (no new requests are routed here),
    // take no new request, let what is in flight finish (probes are still
    // answered), then stop the engine; each open stream left gets its last
    // chunk.
    let revoked = registration.revoke().await;
    if let Err(e) = &revoked {
        warn!(error = %e, "revoking the registration failed; routers will drop this worker when its lease expires");
    } else {
        info!("deregistered");
    }
    if result.is_ok() {
        agent.drain(config.drain_timeout).await;
    }
    let unpublished = agent.wind_down().await;
    pings.abort();
    handle_queries.abort();
    if let Some(stop) = http_stop {
        let _ = stop.send(());
    }
    if let Some(task) = http_task {
        let _ = tokio::time::timeout(Duration::from_secs(1), task).await;
    }
    info!(unpublished_events = unpublished, "stopped");
    result?;
    revoked?;
    Ok(())
}

async fn subscribe(client: &Client, subject: String) -> Result<Subscriber, AgentError> {
    client
        .subscribe(subject.clone())
        .await
        .map_err(|e| AgentError::Subscribe {
            subject,
            message: e.to_string(),
        })
}
