//! How fast a new router replica is ready: writes a snapshot of N distinct
//! blocks (the peer index benchmark's workload) as the latest snapshot,
//! starts a router process and times it from spawn to `/readyz` = 200.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bus::{Bus, StreamLimits};
use kv_indexer::workload::PrefixGroups;
use kv_indexer::{KvIndexer, OwnershipIndex};
use protocol::{KvEvent, KvEventBatch, Message, Tier, WorkerId};

#[derive(Debug, Clone)]
pub struct ReadyBench {
    pub nats: String,
    pub etcd: Vec<String>,
    /// Credentials and TLS.
    pub auth: bus::AuthArgs,
    pub router_bin: String,
    pub blocks: usize,
    pub port: u16,
}

pub async fn run(bench: ReadyBench) -> anyhow::Result<serde_json::Value> {
    let bus = Bus::connect_with(&bench.nats, "loadgen-ready", &bench.auth.nats).await?;
    bus.ensure_streams(&StreamLimits::default()).await?;
    if bus.last_delta_seq().await? > 0 {
        bail!("the delta stream is not empty: run this against a fresh NATS without a kv-indexer");
    }
    let mut indexer = KvIndexer::new(OwnershipIndex::new());
    // A quarter of each sequence is shared: submit a third more blocks
    // than the distinct ones wanted.
    let workload = PrefixGroups {
        depth: 64,
        workers: 16,
        total_blocks: bench.blocks * 4 / 3 + 64,
    };
    let mut seqs = [0u64; 16];
    for s in workload.sequences() {
        let worker = WorkerId::new(&format!("w{}", s.worker), 0)?;
        let batch = KvEventBatch {
            worker,
            epoch: 1,
            seq: seqs[s.worker],
            events: vec![KvEvent::Stored {
                parent: None,
                blocks: s.chained,
                tier: Tier::Device,
            }],
        };
        seqs[s.worker] += 1;
        indexer.apply(batch);
    }
    let snapshot = indexer.snapshot();
    let bytes = snapshot.encode().len();
    let blocks = indexer.index().stats().blocks;
    bus.put_snapshot(&snapshot).await?;

    // A router is ready only with a decode-capable worker: one registered
    // (it never gets a request).
    let registry = bus::Registry::connect_with(&bench.etcd, &bench.auth.etcd).await?;
    let id = WorkerId::new("ready-bench-d0", 0)?;
    let record = protocol::WorkerRecord {
        subjects: protocol::WorkerSubjects::for_worker(&id),
        id,
        role: protocol::Role::Decode,
        contract: protocol::HashingContract::for_model("ready-bench", 16),
        kv_capacity_blocks: 1000,
        max_batched_tokens: 8192,
        kv_bytes_per_token: 1,
        gpus: 1,
        max_model_len: 0,
        capabilities: Default::default(),
    };
    let registration = registry.register(&record, Duration::from_secs(10)).await?;

    let started = Instant::now();
    let mut child = Command::new(&bench.router_bin)
        .args([
            "--nats-url",
            &bench.nats,
            "--etcd-endpoints",
            &bench.etcd.join(","),
            "--http-addr",
            &format!("127.0.0.1:{}", bench.port),
            "--model",
            "ready-bench",
            "--block-size",
            "16",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bench.router_bin))?;
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{}/readyz", bench.port);
    let ready = loop {
        if let Ok(r) = client.get(&url).send().await {
            if r.status().is_success() {
                break started.elapsed();
            }
        }
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            bail!("the router was not ready within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    registration.revoke().await?;
    Ok(serde_json::json!({
        "snapshot_blocks": blocks,
        "snapshot_bytes": bytes,
        "ready_ms": ready.as_secs_f64() * 1e3,
    }))
}
