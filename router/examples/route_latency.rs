//! Rough local latency of `POST /v1/route`: an 8k-token token-id prompt,
//! 64 decode and 8 prefill workers, an index of about 2 600 conversations
//! (loaded as a snapshot). Starts real nats-server and etcd, one router
//! replica in this process, then times sequential requests and a closed
//! loop of concurrent clients. The client shares the machine (and this
//! process) with the router: the figures are an upper bound of the
//! router's own latency and a lower bound of its throughput.
//!
//! ```text
//! cargo run --release -p router --example route_latency [-- SECONDS CONCURRENCY]
//! ```

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use bus::{Bus, Registry, StreamLimits};
use kv_indexer::{KvIndexer, OwnershipIndex};
use protocol::{
    BlockHasher, HashingContract, KvEvent, KvEventBatch, Role, Tier, WorkerId, WorkerRecord,
};
use router::service::{self, Config};
use tests::{tokens, EtcdServer, NatsServer};

const DECODE: usize = 64;
const PREFILL: usize = 8;
const BLOCK: u32 = 16;
const MODEL: &str = "bench";

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn report(what: &str, mut samples: Vec<Duration>, elapsed: Duration) {
    samples.sort();
    println!(
        "{what}: {} requests in {:.2} s = {:.0}/s; p50 {:?} p90 {:?} p99 {:?} max {:?}",
        samples.len(),
        elapsed.as_secs_f64(),
        samples.len() as f64 / elapsed.as_secs_f64(),
        percentile(&samples, 0.5),
        percentile(&samples, 0.9),
        percentile(&samples, 0.99),
        samples.last().unwrap(),
    );
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let seconds: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(5);
    let concurrency: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(16);

    let nats = NatsServer::start()?;
    let etcd = EtcdServer::start()?;
    let bus = Bus::connect(&nats.url(), "latency").await?;
    bus.ensure_streams(&StreamLimits::default()).await?;
    let registry = Registry::connect(&[etcd.endpoint()]).await?;
    let contract = HashingContract::for_model(MODEL, BLOCK);
    let hasher = BlockHasher::new(BLOCK, contract.salt)?;

    // The index: a 2k system prompt everywhere, 40 conversations per
    // decode worker behind it, the measured conversation on d7.
    let mut indexer = KvIndexer::new(OwnershipIndex::new());
    let system = tokens(1, 2048);
    let mut registrations = Vec::new();
    let mut workers = Vec::new();
    for i in 0..DECODE + PREFILL {
        let (name, role) = if i < DECODE {
            (format!("d{i}"), Role::Decode)
        } else {
            (format!("p{}", i - DECODE), Role::Prefill)
        };
        let id: WorkerId = name.parse()?;
        let record = WorkerRecord {
            kv_capacity_blocks: 100_000,
            kv_bytes_per_token: 163_840,
            gpus: 2,
            max_model_len: 0,
            ..tests::fixtures::registration(&name, role, contract.clone())
        };
        registrations.push(registry.register(&record, Duration::from_secs(30)).await?);
        let mut events = vec![KvEvent::Cleared];
        let mut store = |prompt: &[u32]| {
            events.push(KvEvent::Stored {
                parent: None,
                blocks: hasher.hash_prompt(prompt),
                tier: Tier::Device,
            })
        };
        store(&system);
        if role == Role::Decode {
            for c in 0..40u64 {
                let mut conversation = system.clone();
                let len = 2000 + (c as usize * 151) % 6000;
                conversation.extend(tokens(1000 * i as u64 + c, len));
                store(&conversation);
            }
        }
        indexer.apply(KvEventBatch {
            worker: id,
            epoch: 1,
            seq: 0,
            events,
        });
        workers.push(name);
    }
    let mut conversation = system.clone();
    conversation.extend(tokens(77, 5500));
    indexer.apply(KvEventBatch {
        worker: "d7".parse()?,
        epoch: 1,
        seq: 1,
        events: vec![KvEvent::Stored {
            parent: None,
            blocks: hasher.hash_prompt(&conversation),
            tier: Tier::Device,
        }],
    });
    bus.put_snapshot(&indexer.snapshot()).await?;
    let mut prompt = conversation;
    prompt.extend(tokens(78, 8192 - prompt.len()));

    let config = Config {
        nats_url: nats.url(),
        etcd_endpoints: vec![etcd.endpoint()],
        model: MODEL.into(),
        block_size: BLOCK,
        replica_id: "latency".into(),
        ..Config::default()
    }
    .validate()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/v1/route", listener.local_addr()?);
    let ready = format!("http://{}/readyz", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = tokio::spawn(service::run(config, listener, async move {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency * 2)
        .build()?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let body: serde_json::Value = http.get(&ready).send().await?.json().await?;
        if body["ready"] == true {
            break;
        }
        ensure!(Instant::now() < deadline, "not ready: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Wait for the 72 registrations to be seen.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let body = bytes::Bytes::from(serde_json::to_vec(
        &serde_json::json!({"prompt": prompt, "max_tokens": 256}),
    )?);
    println!(
        "prompt: {} tokens, body {} bytes; {DECODE} decode + {PREFILL} prefill workers",
        prompt.len(),
        body.len()
    );
    let first: serde_json::Value = http
        .post(&url)
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await?
        .json()
        .await?;
    println!(
        "decision: {} on {} ({})",
        first["switchyard"]["path"], first["switchyard"]["decode"], first["switchyard"]["rule"]
    );

    // Sequential.
    let mut samples = Vec::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(seconds.min(3)) {
        let t = Instant::now();
        let r = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await?;
        ensure!(r.status() == 200, "{}", r.status());
        r.bytes().await?;
        samples.push(t.elapsed());
    }
    report("sequential", samples, started.elapsed());

    // Closed loop of concurrent clients.
    let started = Instant::now();
    let until = started + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            while Instant::now() < until {
                let t = Instant::now();
                let r = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await?;
                ensure!(r.status() == 200, "{}", r.status());
                r.bytes().await?;
                samples.push(t.elapsed());
            }
            Ok(samples)
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await??);
    }
    report(
        &format!("{concurrency} concurrent"),
        samples,
        started.elapsed(),
    );

    let metrics = http
        .get(url.replace("/v1/route", "/metrics"))
        .send()
        .await?
        .text()
        .await?;
    for line in metrics.lines().filter(|l| {
        l.starts_with("router_decision_seconds_bucket")
            || l.starts_with("router_route_seconds_bucket")
            || l.starts_with("router_decision_seconds_sum")
            || l.starts_with("router_decision_seconds_count")
            || l.starts_with("router_route_seconds_sum")
            || l.starts_with("router_route_seconds_count")
    }) {
        println!("{line}");
    }
    let _ = stop.send(());
    router.await??;
    drop(registrations);
    Ok(())
}
