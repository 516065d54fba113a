//! The agent's answers to the third path's handle queries, against a real
//! nats-server and etcd: its engine's export within a deadline (a late one
//! is dropped, which aborts the engine's request), at most a bounded number
//! at once, and none for a malformed query or an engine that exports
//! nothing.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use async_nats::Client;
use engine_sim::Preset;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use protocol::{
    subjects, GenerateEvent, GenerateRequest, KvHandle, KvHandleQuery, KvHandleReply, Message,
    Role, Sampling, WorkerId,
};
use tests::fixtures::worker;
use tests::{EtcdServer, NatsServer};
use tokio::sync::oneshot;
use tokio::time::{timeout, Instant};
use worker_agent::{
    AgentError, Engine, EngineFacts, EngineLoad, KvUpdate, Options, SimEngine, SimEngineConfig,
};

const WAIT: Duration = Duration::from_secs(10);

/// The simulated engine, with exports that take `delay` and say how many
/// started, finished, and were dropped before finishing.
#[derive(Debug)]
struct SlowExports {
    inner: SimEngine,
    delay: Duration,
    counts: Arc<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    started: AtomicUsize,
    finished: AtomicUsize,
    dropped: AtomicUsize,
}

/// Counts a dropped export that did not finish.
struct Unfinished(Arc<Counts>, bool);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.1 {
            self.0.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Engine for SlowExports {
    fn facts(&self) -> EngineFacts {
        self.inner.facts()
    }
    fn take_kv_updates(&self) -> Option<BoxStream<'static, KvUpdate>> {
        self.inner.take_kv_updates()
    }
    fn request_block_set(&self) {
        self.inner.request_block_set();
    }
    fn load(&self) -> EngineLoad {
        self.inner.load()
    }
    fn generate(&self, request: GenerateRequest) -> BoxStream<'static, GenerateEvent> {
        self.inner.generate(request)
    }
    fn unsupported(&self, sampling: &Sampling) -> Option<&'static str> {
        self.inner.unsupported(sampling)
    }
    fn stop(&self) {
        self.inner.stop();
    }
    fn export_kv(&self, query: KvHandleQuery, _: usize) -> BoxFuture<'static, Option<KvHandle>> {
        let (counts, delay) = (self.counts.clone(), self.delay);
        Box::pin(async move {
            counts.started.fetch_add(1, Ordering::SeqCst);
            let mut guard = Unfinished(counts.clone(), false);
            tokio::time::sleep(delay).await;
            guard.1 = true;
            counts.finished.fetch_add(1, Ordering::SeqCst);
            Some(KvHandle {
                blocks: query.tokens.len() as u32 / 16,
                engine: "{}".into(),
            })
        })
    }
}

/// An agent for worker `name` in front of an engine whose exports take
/// `delay`; stopped by sending on the returned channel.
async fn start(
    nats: &NatsServer,
    etcd: &EtcdServer,
    name: &str,
    delay: Duration,
) -> Result<(
    Arc<Counts>,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), AgentError>>,
)> {
    let mut options = Options::new(name, &nats.url(), &[etcd.endpoint()]);
    options.role = Role::Decode.as_str().into();
    options.preset = Preset::llama8b_h100().name.into();
    options.block_size = 16;
    let config = options.validate()?;
    let inner = SimEngine::start(SimEngineConfig {
        worker: config.worker.clone(),
        role: config.role,
        preset: config.preset,
        block_size: 16,
        kv_capacity_blocks: None,
        speedup: 100.0,
        link: config.link,
    })?;
    let counts = Arc::new(Counts::default());
    let engine = Arc::new(SlowExports {
        inner,
        delay,
        counts: counts.clone(),
    });
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(worker_agent::run_with_engine(config, engine, async {
        let _ = stopped.await;
    }));
    Ok((counts, stop, task))
}

fn query(id: &str) -> KvHandleQuery {
    KvHandleQuery {
        request_id: id.into(),
        tokens: (0..64).collect(),
        lora: None,
        cache_salt: None,
    }
}

/// Asks `worker`'s agent, retrying until it listens; its answer and how
/// long it took.
async fn ask(
    client: &Client,
    worker: &WorkerId,
    payload: Vec<u8>,
) -> Result<(KvHandleReply, Duration)> {
    let deadline = Instant::now() + WAIT;
    loop {
        let started = Instant::now();
        match client
            .request(subjects::kv_handle(worker), payload.clone().into())
            .await
        {
            Ok(m) => return Ok((KvHandleReply::decode(&m.payload)?, started.elapsed())),
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e).context("asking the agent"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_are_answered_within_a_deadline_and_a_bound() -> Result<()> {
    let (nats, etcd) = (NatsServer::start()?, EtcdServer::start()?);
    let client = async_nats::connect(nats.url()).await?;

    // A quick export is given; a malformed query gets none.
    let fast = worker("fast");
    let (counts, stop, task) = start(&nats, &etcd, "fast", Duration::from_millis(10)).await?;
    let (reply, _) = ask(&client, &fast, query("q1").encode()).await?;
    ensure!(
        reply.handle.as_ref().is_some_and(|h| h.blocks == 4),
        "{reply:?}"
    );
    let (reply, _) = ask(&client, &fast, b"garbage".to_vec()).await?;
    ensure!(reply.handle.is_none());
    ensure!(counts.finished.load(Ordering::SeqCst) == 1);
    let _ = stop.send(());
    timeout(WAIT, task).await???;

    // An export slower than the deadline: answered with none in time for
    // the asker's second, and dropped, not left to finish.
    let slow = worker("slow");
    let (counts, stop, task) = start(&nats, &etcd, "slow", Duration::from_secs(3)).await?;
    let (reply, took) = ask(&client, &slow, query("q2").encode()).await?;
    ensure!(reply.handle.is_none(), "{reply:?}");
    ensure!(took < Duration::from_secs(1), "answered after {took:?}");
    ensure!(
        counts.dropped.load(Ordering::SeqCst) == 1 && counts.finished.load(Ordering::SeqCst) == 0
    );

    // More queries at once than the bound: the ones beyond it get none at
    // once, the engine never sees them.
    let asks: Vec<_> = (0..20)
        .map(|i| {
            let (client, slow) = (client.clone(), slow.clone());
            tokio::spawn(async move { ask(&client, &slow, query(&format!("b{i}")).encode()).await })
        })
        .collect();
    for a in asks {
        let (reply, _) = a.await??;
        ensure!(reply.handle.is_none());
    }
    let started = counts.started.load(Ordering::SeqCst);
    ensure!(
        (1 + 16..1 + 20).contains(&started),
        "{started} exports started for 21 queries"
    );
    let _ = stop.send(());
    timeout(WAIT, task).await???;
    Ok(())
}
