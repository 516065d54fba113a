//! The vLLM adapter against a KV-event publisher written in Python with
//! pyzmq and msgspec (what vLLM publishes with), the agent's output read
//! from real NATS, block by block, against the canonical hashes the
//! fixture computes itself (xxh3-64 in Python).
//!
//! The fixture runs with `$SWITCHYARD_PYTHON` (scripts/test makes a venv
//! from scripts/requirements-test.txt and sets it); without it these
//! tests say so and pass.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use axum::routing::get;
use bus::Bus;
use futures::StreamExt;
use protocol::{subjects, BlockHash, KvEvent, LoadReport, Message, WorkerId};
use serde_json::{json, Value};
use tests::{free_port, EtcdServer, NatsServer};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::oneshot;
use tokio::time::{timeout, Instant};
use worker_agent::{AgentError, EngineChoice, Options};

use common::{Agent, KvFollower};

const MODEL: &str = "fixture-model";
const BLOCK_SIZE: u32 = 4;
const WAIT: Duration = Duration::from_secs(15);

fn python() -> Option<String> {
    match std::env::var("SWITCHYARD_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            eprintln!(
                "NOTE: SWITCHYARD_PYTHON is not set: skipping the pyzmq/msgspec fixture test \
                 (scripts/test sets it from scripts/requirements-test.txt)"
            );
            None
        }
    }
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_test_writer()
        .try_init();
}

/// The Python publisher, driven over stdin/stdout.
struct Fixture {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    pub_port: u16,
    replay_port: u16,
}

impl Fixture {
    async fn start(python: &str, args: &[&str]) -> Result<Self> {
        let (pub_port, replay_port) = (free_port()?, free_port()?);
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/kv_publisher.py"
        );
        let mut child = Command::new(python)
            .arg(script)
            .arg(pub_port.to_string())
            .arg(replay_port.to_string())
            .args(["--model", MODEL, "--block-size", &BLOCK_SIZE.to_string()])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {python} {script}"))?;
        let stdin = child.stdin.take().context("stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("stdout")?).lines();
        let mut fixture = Self {
            child,
            stdin,
            stdout,
            pub_port,
            replay_port,
        };
        let ready = fixture.read().await?;
        ensure!(ready["ready"] == json!(true), "{ready}");
        Ok(fixture)
    }

    async fn read(&mut self) -> Result<Value> {
        let line = timeout(WAIT, self.stdout.next_line())
            .await
            .context("the fixture did not answer")??
            .context("the fixture exited")?;
        Ok(serde_json::from_str(&line)?)
    }

    async fn cmd(&mut self, command: Value) -> Result<Value> {
        self.stdin
            .write_all(format!("{command}\n").as_bytes())
            .await?;
        self.stdin.flush().await?;
        let answer = self.read().await?;
        ensure!(answer["ok"] == json!(true), "{command}: {answer}");
        Ok(answer)
    }

    async fn store(&mut self, prompt: &[u32], blocks: usize) -> Result<Value> {
        self.cmd(json!({"cmd": "store", "prompt": prompt, "blocks": blocks}))
            .await
    }

    /// The (canonical hash, tier) pairs the engine holds.
    async fn expected(&mut self) -> Result<BTreeSet<(u64, u8)>> {
        let answer = self.cmd(json!({"cmd": "expected"})).await?;
        answer["blocks"]
            .as_array()
            .context("blocks")?
            .iter()
            .map(|b| {
                let hash: u64 = b[0].as_str().context("hash")?.parse()?;
                let tier = b[1].as_u64().context("tier")? as u8;
                Ok((hash, tier))
            })
            .collect()
    }

    async fn quit(mut self) {
        let _ = self.stdin.write_all(b"{\"cmd\": \"quit\"}\n").await;
        let _ = timeout(Duration::from_secs(2), self.child.wait()).await;
    }
}

/// The engine's HTTP API as far as the KV side needs it: `/v1/models` and
/// `/metrics` (a captured-format text, then an inter-token latency
/// histogram whose totals grow by 10 tokens at 45 ms each per scrape).
async fn engine_api(metrics: &'static str) -> Result<(SocketAddr, oneshot::Sender<()>)> {
    let scrapes = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let metrics = move || {
        let k = scrapes.fetch_add(1, std::sync::atomic::Ordering::Relaxed) as f64;
        let labels = format!("engine=\"0\",model_name=\"{MODEL}\"");
        async move {
            format!(
                "{metrics}# TYPE vllm:inter_token_latency_seconds histogram\n\
                 vllm:inter_token_latency_seconds_bucket{{{labels},le=\"+Inf\"}} {count}\n\
                 vllm:inter_token_latency_seconds_sum{{{labels}}} {sum}\n\
                 vllm:inter_token_latency_seconds_count{{{labels}}} {count}\n",
                count = 10.0 * k,
                sum = 0.45 * k,
            )
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .route(
            "/v1/models",
            get(|| async {
                axum::Json(json!({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
            }),
        )
        .route("/metrics", get(metrics));
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
    });
    Ok((addr, stop))
}

const METRICS: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="fixture-model"} 3.0
vllm:num_requests_waiting{engine="0",model_name="fixture-model"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="fixture-model"} 0.25
vllm:cache_config_info{block_size="4",engine="0",num_gpu_blocks="1000"} 1.0
"#;

fn agent_config(
    servers: &(NatsServer, EtcdServer),
    name: &str,
    fixture: &Fixture,
    api: SocketAddr,
) -> Options {
    let mut config = Options::new(name, &servers.0.url(), &[servers.1.endpoint()]);
    config.engine = EngineChoice::Vllm;
    config.engine_url = format!("http://{api}");
    config.kv_events_endpoint = format!("tcp://127.0.0.1:{}", fixture.pub_port);
    config.kv_replay_endpoint = Some(format!("tcp://127.0.0.1:{}", fixture.replay_port));
    config.model = Some(MODEL.into());
    config.block_size = BLOCK_SIZE;
    config.lease_ttl = Duration::from_secs(2);
    config.engine_startup_timeout = Duration::from_secs(10);
    config.kv_replay_timeout = Duration::from_millis(2_000);
    config
}

/// The blocks the follower holds, with their tiers.
fn held(follower: &KvFollower) -> BTreeSet<(u64, u8)> {
    follower
        .mirror
        .stored_events()
        .into_iter()
        .flat_map(|e| match e {
            KvEvent::Stored { blocks, tier, .. } => blocks
                .into_iter()
                .map(|BlockHash(h)| (h, tier as u8))
                .collect::<Vec<_>>(),
            _ => Vec::new(),
        })
        .collect()
}

/// How long the follower waits for a batch before looking again.
const POLL: Duration = Duration::from_millis(200);

/// Reads batches until `n` epochs were seen.
async fn until_epochs(follower: &mut KvFollower, n: usize, step: &str) -> Result<()> {
    let deadline = Instant::now() + WAIT;
    while follower.epochs.len() < n {
        ensure!(
            Instant::now() < deadline,
            "{step}: {} epochs, {n} expected",
            follower.epochs.len()
        );
        follower
            .next_within(POLL)
            .await
            .with_context(|| step.to_owned())?;
    }
    ensure!(
        follower.epochs.len() == n,
        "{step}: {} epochs, {n} expected",
        follower.epochs.len()
    );
    Ok(())
}

/// Reads batches until the agent's blocks are the engine's.
async fn until_matches(follower: &mut KvFollower, fixture: &mut Fixture, step: &str) -> Result<()> {
    let want = fixture.expected().await?;
    let deadline = Instant::now() + WAIT;
    loop {
        if held(follower) == want {
            return Ok(());
        }
        if Instant::now() > deadline {
            let got = held(follower);
            bail!(
                "{step}: the agent's blocks differ from the engine's:\n  missing {:?}\n  extra {:?}",
                want.difference(&got).collect::<Vec<_>>(),
                got.difference(&want).collect::<Vec<_>>()
            );
        }
        follower
            .next_within(POLL)
            .await
            .with_context(|| step.to_owned())?;
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 10_000 + i).collect()
}

/// The whole scenario for one encoding and hash flavour.
async fn scenario(name: &str, fixture_args: &[&str], topic: &str) -> Result<()> {
    let Some(python) = python() else {
        return Ok(());
    };
    init_tracing();
    let servers = (NatsServer::start()?, EtcdServer::start()?);
    let mut args = fixture_args.to_vec();
    args.extend(["--topic", topic]);
    let mut fx = Fixture::start(&python, &args).await?;
    let (api, api_stop) = engine_api(METRICS).await?;
    let worker = WorkerId::new(name, 0)?;
    let bus = Bus::connect(&servers.0.url(), "fixture-test").await?;
    let mut follower = KvFollower::new(&bus, &worker, WAIT).await?;
    let client = async_nats::connect(servers.0.url()).await?;
    let mut loads = client.subscribe(subjects::load(&worker)).await?;

    // 1. History published before the agent: its startup replay reads it.
    let a = prompt(1, 12);
    fx.store(&a, 3).await?;
    fx.store(&prompt(2, 8), 2).await?;
    let mut config = agent_config(&servers, name, &fx, api);
    config.kv_events_topic = topic.into();
    let metrics_addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    config.http_addr = Some(metrics_addr);
    let agent = Agent::start(config);
    let subscribed = fx.cmd(json!({"cmd": "wait_subscribed"})).await?;
    ensure!(
        subscribed["subscribed"] == json!(true),
        "the agent never subscribed"
    );
    until_matches(&mut follower, &mut fx, "history").await?;
    until_epochs(&mut follower, 1, "history").await?;

    // The load comes from the engine's metrics, the recent inter-token
    // latency from its histogram's totals over two scrapes or more.
    let report = timeout(WAIT, async {
        while let Some(m) = loads.next().await {
            let r = LoadReport::decode(&m.payload)?;
            if r.running == 3 && r.recent_itl_us > 0 {
                return Ok::<_, anyhow::Error>(r);
            }
        }
        bail!("load subscription ended")
    })
    .await??;
    ensure!(
        (
            report.waiting,
            report.kv_blocks_used,
            report.kv_blocks_total,
            report.recent_itl_us
        ) == (2, 250, 1000, 45_000),
        "{report:?}"
    );

    // 2. Live: a prefix shared with the history, a removal, a host tier.
    let mut b = a[..8].to_vec();
    b.extend(prompt(3, 8));
    fx.store(&b, 4).await?;
    fx.cmd(json!({"cmd": "remove", "prompt": a, "block": 2}))
        .await?;
    fx.cmd(json!({"cmd": "store", "prompt": a, "blocks": 2, "medium": "CPU"}))
        .await?;
    until_matches(&mut follower, &mut fx, "live").await?;

    // 3. A gap the replay covers: no new epoch.
    fx.cmd(json!({"cmd": "store", "prompt": prompt(4, 8), "blocks": 2, "drop": true}))
        .await?;
    fx.cmd(json!({"cmd": "remove", "prompt": b, "block": 3, "drop": true}))
        .await?;
    fx.store(&prompt(5, 4), 1).await?;
    until_matches(&mut follower, &mut fx, "gap replayed").await?;

    // 4. Garbage: a batch that is not msgpack (it takes a seq) and a
    // message with two frames; both skipped, the stream goes on.
    fx.cmd(json!({"cmd": "garbage"})).await?;
    fx.store(&prompt(6, 8), 2).await?;
    until_matches(&mut follower, &mut fx, "after garbage").await?;
    // (The epoch count at step 5 shows that neither the covered gap nor
    // the garbage started one.)

    // 5. An unknown parent: not placed; the agent rebuilds from the
    // engine's whole history (a new epoch), which has the same orphan.
    fx.cmd(json!({"cmd": "orphan", "tokens": prompt(7, 4)}))
        .await?;
    fx.store(&prompt(8, 4), 1).await?;
    until_epochs(&mut follower, 2, "rebuild after an orphan").await?;
    until_matches(&mut follower, &mut fx, "after an orphan").await?;

    // 6. A gap the replay cannot cover (evicted): the worker is
    // resynchronised from what the agent knows, in a new epoch.
    let lost = prompt(9, 8);
    fx.cmd(json!({"cmd": "store", "prompt": lost, "blocks": 2, "drop": true}))
        .await?;
    fx.cmd(json!({"cmd": "forget_replay"})).await?;
    fx.store(&prompt(10, 4), 1).await?;
    until_epochs(&mut follower, 3, "lost gap").await?;
    // The engine evicts the blocks the agent never heard of.
    fx.cmd(json!({"cmd": "remove", "prompt": lost, "block": 1}))
        .await?;
    fx.cmd(json!({"cmd": "remove", "prompt": lost, "block": 0}))
        .await?;
    until_matches(&mut follower, &mut fx, "lost gap resynchronised").await?;

    // 7. The engine restarts: seq back to 0, cache empty, a new epoch.
    fx.cmd(json!({"cmd": "restart"})).await?;
    fx.store(&prompt(11, 8), 2).await?;
    until_epochs(&mut follower, 4, "restart").await?;
    until_matches(&mut follower, &mut fx, "restart").await?;

    // 8. AllBlocksCleared, then more blocks.
    fx.cmd(json!({"cmd": "clear"})).await?;
    fx.store(&prompt(12, 8), 2).await?;
    until_matches(&mut follower, &mut fx, "cleared").await?;

    // A hybrid model's other KV-cache group and partial tails were
    // skipped and counted, not indexed (their tokens are the same, so the
    // block set alone would not show it).
    if fixture_args.contains(&"--hybrid") {
        let metrics = metrics_text(metrics_addr).await?;
        for what in ["other_groups", "other_block_sizes"] {
            let count = counter(
                &metrics,
                &format!("worker_agent_engine_kv_total{{what=\"{what}\"}}"),
            );
            ensure!(count > 0.0, "{what}: {count}\n{metrics}");
        }
    }

    agent.shutdown(WAIT).await?;
    fx.quit().await;
    let _ = api_stop.send(());
    Ok(())
}

/// The agent's `/metrics`.
async fn metrics_text(addr: SocketAddr) -> Result<String> {
    use tokio::io::AsyncReadExt;
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
        .await?;
    let mut text = String::new();
    timeout(WAIT, stream.read_to_string(&mut text)).await??;
    Ok(text)
}

/// The value of the sample named `name` (with its labels), 0 when absent.
fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_arrays_with_u64_hashes() -> Result<()> {
    scenario(
        "fx-array",
        &["--encoding", "array", "--flavour", "vllm"],
        "",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_maps_with_bytes_hashes_and_topic_in_replies() -> Result<()> {
    scenario(
        "fx-map",
        &[
            "--encoding",
            "map",
            "--flavour",
            "bytes",
            "--replay-topic-frame",
        ],
        "kv@fx",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_arrays_with_i64_hashes() -> Result<()> {
    scenario(
        "fx-sglang",
        &["--encoding", "array", "--flavour", "sglang"],
        "",
    )
    .await
}

/// The engine's own `kv_events.py` (extracted by scripts/engine-kv-events.py
/// into `$SWITCHYARD_ENGINE_KV_EVENTS/<engine>-<version>/`), when there:
/// the fixture then encodes with the engine's classes.
fn engine_classes(dir_name: &str) -> Option<String> {
    let dir = std::env::var("SWITCHYARD_ENGINE_KV_EVENTS").ok()?;
    let path = format!("{dir}/{dir_name}/kv_events.py");
    if std::path::Path::new(&path).exists() {
        Some(path)
    } else {
        eprintln!(
            "NOTE: {path} is absent: the fixture encodes {dir_name}'s shape with its own classes \
             (scripts/engine-kv-events.py fetches the engine's)"
        );
        None
    }
}

/// vLLM 0.33: an array batch of tagged-map events, 32-byte digests,
/// `group_idx` and the new optional fields; a hybrid model's other KV-cache
/// group (sliding window) and partial tails beside every store. The agent
/// holds exactly the full-attention blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_033_tagged_maps_digests_groups_and_partial_tails() -> Result<()> {
    let classes = engine_classes("vllm-0.33.0");
    let mut args = vec!["--encoding", "tagged", "--flavour", "bytes", "--hybrid"];
    args.push("--replay-topic-frame");
    if let Some(c) = &classes {
        args.extend(["--classes", c.as_str()]);
    }
    scenario("fx-vllm033", &args, "kv@033").await
}

/// SGLang 0.5: an array batch `[ts, events, attn_dp_rank]` of tagged maps
/// with i64 hashes and SGLang's extra keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_05_tagged_maps_with_i64_hashes() -> Result<()> {
    let classes = engine_classes("sglang-0.5.23");
    let mut args = vec!["--encoding", "tagged", "--flavour", "sglang"];
    if let Some(c) = &classes {
        args.extend(["--classes", c.as_str()]);
    }
    scenario("fx-sglang05", &args, "").await
}

/// A BlockStored of another block size stops the agent with a clear error;
/// an engine that says so at registration is refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_block_size_is_refused_loudly() -> Result<()> {
    let Some(python) = python() else {
        return Ok(());
    };
    init_tracing();
    let servers = (NatsServer::start()?, EtcdServer::start()?);
    let mut fx = Fixture::start(&python, &[]).await?;
    // The engine does not say its block size: the agent assumes the
    // deployment's (8) and checks the events (4).
    let (api, _api_stop) = engine_api("vllm:num_requests_running 0\n").await?;
    let mut config = agent_config(&servers, "fx-bs", &fx, api);
    config.block_size = 8;
    let agent = Agent::start(config);
    fx.cmd(json!({"cmd": "wait_subscribed"})).await?;
    fx.store(&prompt(1, 8), 2).await?;
    let result = agent.outcome(WAIT).await?;
    match result {
        Err(AgentError::EngineFailed(why)) => {
            ensure!(
                why.contains("blocks of 4 tokens") && why.contains("block size is 8"),
                "{why}"
            )
        }
        other => bail!("expected a refusal, got {other:?}"),
    }

    // The engine says 4 (vllm:cache_config_info): refused at registration.
    let (api, _api_stop) = engine_api(METRICS).await?;
    let mut config = agent_config(&servers, "fx-bs2", &fx, api);
    config.block_size = 8;
    let result = timeout(
        WAIT,
        worker_agent::run(config.validate()?, std::future::pending()),
    )
    .await?;
    ensure!(
        matches!(&result, Err(AgentError::Contract { .. }))
            && result
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("block size 4"),
        "{result:?}"
    );
    fx.quit().await;
    Ok(())
}
