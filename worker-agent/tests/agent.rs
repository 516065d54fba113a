//! The agent against real nats-server and etcd processes, checked from the
//! outside with plain clients.

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use async_nats::{Client, Subscriber};
use bus::{Bus, Registry, WorkerChange};
use engine_sim::Preset;
use futures::StreamExt;
use protocol::{
    subjects, BlockHash, BlockHasher, CancelRequest, DecisionId, FinishReason, GenerateChunk,
    GenerateEvent, GenerateRequest, HashingContract, KvEvent, KvEventBatch, KvTransferParams,
    LegProbe, LegProbeReply, LoadReport, Message, ResyncReply, Role, Stage, WorkerId, WorkerRecord,
    WorkerSubjects,
};
use tests::fixtures::{generate_request as request, output_tokens, worker};
use tests::{EtcdServer, NatsServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::{timeout, Instant};
use worker_agent::{AgentError, Options};

use common::{Agent, KvFollower};

const PRESET: Preset = Preset::llama8b_h100();
const BLOCK_SIZE: u32 = 16;
const WAIT: Duration = Duration::from_secs(10);

struct Servers {
    nats: NatsServer,
    etcd: EtcdServer,
}

impl Servers {
    fn start() -> Result<Self> {
        // The agent's logs show when a test fails (RUST_LOG filters them).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "info".into()),
            )
            .with_test_writer()
            .try_init();
        Ok(Self {
            nats: NatsServer::start()?,
            etcd: EtcdServer::start()?,
        })
    }

    fn config(&self, name: &str, role: Role) -> Options {
        let mut config = Options::new(name, &self.nats.url(), &[self.etcd.endpoint()]);
        config.role = role.as_str().into();
        config.preset = PRESET.name.into();
        config.block_size = BLOCK_SIZE;
        config.speedup = 100.0;
        config.lease_ttl = Duration::from_secs(2);
        config
    }

    async fn client(&self) -> Result<Client> {
        Ok(async_nats::connect(self.nats.url()).await?)
    }

    async fn registry(&self) -> Result<Registry> {
        Ok(Registry::connect(&[self.etcd.endpoint()]).await?)
    }
}

fn contract() -> HashingContract {
    HashingContract::for_model(PRESET.model, BLOCK_SIZE)
}

fn hasher() -> BlockHasher {
    BlockHasher::new(BLOCK_SIZE, contract().salt).unwrap()
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut tokens = Vec::new();
    protocol::trace::extend_block_tokens(seed, len, &mut tokens);
    tokens
}

/// The worker's record in etcd, if registered.
/// The epoch etcd recorded for `id`'s agent.
async fn etcd_epoch(servers: &Servers, id: &WorkerId) -> Option<u64> {
    let mut client = etcd_client::Client::connect([servers.etcd.endpoint()], None)
        .await
        .ok()?;
    let response = client.get(subjects::etcd_epoch_key(id), None).await.ok()?;
    std::str::from_utf8(response.kvs().first()?.value())
        .ok()?
        .parse()
        .ok()
}

async fn record(registry: &Registry, id: &WorkerId) -> Result<Option<WorkerRecord>> {
    let (changes, _) = registry.workers().await?;
    Ok(changes.into_iter().find_map(|c| match c {
        WorkerChange::Up(r) if &r.id == id => Some(r),
        _ => None,
    }))
}

async fn wait_registered(registry: &Registry, id: &WorkerId) -> Result<WorkerRecord> {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(r) = record(registry, id).await? {
            return Ok(r);
        }
        ensure!(Instant::now() < deadline, "{id} never registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends raw bytes to the worker's generate subject and collects the
/// reply stream up to its last chunk, checking the indexes.
async fn generate_raw(
    client: &Client,
    id: &WorkerId,
    payload: Vec<u8>,
) -> Result<Vec<GenerateChunk>> {
    generate_parts(client, id, vec![payload]).await
}

/// [`generate_raw`] with the request in several messages (fragments),
/// each with the same reply subject.
async fn generate_parts(
    client: &Client,
    id: &WorkerId,
    payloads: Vec<Vec<u8>>,
) -> Result<Vec<GenerateChunk>> {
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await?;
    for payload in payloads {
        client
            .publish_with_reply(subjects::generate(id), inbox.clone(), payload.into())
            .await?;
    }
    let mut chunks = Vec::new();
    loop {
        let message = timeout(WAIT, replies.next())
            .await
            .context("waiting for a chunk")?
            .context("reply subscription ended")?;
        let chunk = GenerateChunk::decode(&message.payload)?;
        ensure!(
            chunk.index as usize == chunks.len(),
            "chunk {} after {} chunks",
            chunk.index,
            chunks.len()
        );
        let last = chunk.event.is_last();
        chunks.push(chunk);
        if last {
            return Ok(chunks);
        }
    }
}

async fn generate(
    client: &Client,
    id: &WorkerId,
    request: &GenerateRequest,
) -> Result<Vec<GenerateEvent>> {
    let chunks = generate_raw(client, id, request.encode()).await?;
    Ok(chunks.into_iter().map(|c| c.event).collect())
}

fn free_addr() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    // HTTP/1.0: the body comes whole, not in chunks.
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: agent\r\n\r\n").as_bytes())
        .await?;
    let mut text = String::new();
    timeout(WAIT, stream.read_to_string(&mut text)).await??;
    let status = text.get(9..12).context("no status line")?.parse()?;
    let (_, body) = text.split_once("\r\n\r\n").context("no body")?;
    Ok((status, body.to_owned()))
}

// --- 1. Registration ---------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_and_revokes_at_shutdown() -> Result<()> {
    let servers = Servers::start()?;
    let registry = servers.registry().await?;
    let id = worker("reg");
    let agent = Agent::start(servers.config("reg", Role::Decode));
    let got = wait_registered(&registry, &id).await?;
    assert_eq!(
        got,
        WorkerRecord {
            id: id.clone(),
            role: Role::Decode,
            contract: contract(),
            kv_capacity_blocks: u64::from(PRESET.kv_capacity_blocks(BLOCK_SIZE)),
            max_batched_tokens: PRESET.max_batched_tokens,
            kv_bytes_per_token: PRESET.kv_bytes_per_token,
            gpus: PRESET.gpus,
            // The simulated engine takes what its whole cache holds.
            max_model_len: PRESET.kv_capacity_blocks(BLOCK_SIZE) * BLOCK_SIZE,
            subjects: WorkerSubjects::for_worker(&id),
            capabilities: Default::default(),
        }
    );
    // Kept alive past its TTL.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(record(&registry, &id).await?.is_some());

    agent.shutdown(WAIT).await?;
    assert_eq!(record(&registry, &id).await?, None, "revoked at shutdown");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_expires_when_the_agent_dies() -> Result<()> {
    let servers = Servers::start()?;
    let registry = servers.registry().await?;
    let id = worker("dies");
    let agent = Agent::start(servers.config("dies", Role::Both));
    wait_registered(&registry, &id).await?;
    agent.kill();
    let aborted = Instant::now();
    while record(&registry, &id).await?.is_some() {
        ensure!(
            aborted.elapsed() < Duration::from_secs(3),
            "still registered 3 s (TTL + 1 s) after the agent died"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

#[tokio::test]
async fn refuses_a_model_the_engine_does_not_hash_for() {
    let mut config = Options::new("m", "nats://127.0.0.1:1", &["http://127.0.0.1:1".into()]);
    config.model = Some("some-other-model".into());
    let err = worker_agent::run(config.validate().unwrap(), std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(err, AgentError::Contract { .. }), "{err}");
    assert!(err.to_string().contains("some-other-model"), "{err}");
}

// --- 2. Generation in every stage, and its KV events --------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_every_stage_and_publishes_its_kv_events() -> Result<()> {
    let servers = Servers::start()?;
    let client = servers.client().await?;
    let bus = Bus::from_client(client.clone());
    let id = worker("stages");
    let mut kv = KvFollower::new(&bus, &id, WAIT).await?;
    let agent = Agent::start(servers.config("stages", Role::Both));
    wait_registered(&servers.registry().await?, &id).await?;

    // Local (bypass): prefill what is not cached, decode.
    let local = prompt(1, 70);
    let events = generate(
        &client,
        &id,
        &request("local", Stage::Local, local.clone(), 5),
    )
    .await?;
    let tokens = output_tokens(&events);
    assert_eq!(tokens.len(), 5);
    assert_eq!(
        events.last(),
        Some(&GenerateEvent::Finished {
            output_tokens: 5,
            cached_tokens: Some(0),
            reason: FinishReason::Length
        })
    );
    // The same request id gives the same tokens.
    let again = generate(
        &client,
        &id,
        &request("local", Stage::Local, local.clone(), 5),
    )
    .await?;
    assert_eq!(output_tokens(&again), tokens);
    assert!(matches!(
        again.last(),
        Some(GenerateEvent::Finished {
            cached_tokens: Some(64),
            ..
        })
    ));

    // The same request in fragments (as a router sends one larger than
    // the bus's payload limit): put back together, served alike.
    let whole = request("local", Stage::Local, local.clone(), 5).encode();
    let parts: Vec<Vec<u8>> = protocol::fragment::split(&whole, 97)
        .iter()
        .map(Message::encode)
        .collect();
    assert!(parts.len() > 2);
    let chunks = generate_parts(&client, &id, parts.clone()).await?;
    let events: Vec<GenerateEvent> = chunks.into_iter().map(|c| c.event).collect();
    assert_eq!(output_tokens(&events), tokens);
    // A fragment that disagrees with the others: a clear failure, not a
    // hang.
    let mut bad = protocol::fragment::split(&whole, 97);
    bad[1].total_bytes += 1;
    let chunks = generate_parts(&client, &id, bad.iter().map(Message::encode).collect()).await?;
    assert!(
        matches!(&chunks[0].event, GenerateEvent::Failed { retryable: false, error } if error.contains("fragment")),
        "{chunks:?}"
    );

    // Prefill: prefill only, then the transfer parameters.
    let prefill = prompt(2, 64);
    let events = generate(
        &client,
        &id,
        &request("prefill", Stage::Prefill, prefill.clone(), 5),
    )
    .await?;
    assert_eq!(
        events,
        vec![
            GenerateEvent::Prefilled {
                transfer: KvTransferParams {
                    source: id.clone(),
                    prompt_tokens: 64,
                    engine: None
                },
                cached_tokens: Some(0)
            },
            GenerateEvent::Finished {
                output_tokens: 0,
                cached_tokens: Some(0),
                reason: FinishReason::Prefilled
            },
        ]
    );

    // Decode: the KV comes from another worker.
    let decode = prompt(3, 48);
    let transfer = KvTransferParams {
        source: worker("p0"),
        prompt_tokens: 48,
        engine: None,
    };
    let events = generate(
        &client,
        &id,
        &request("decode", Stage::Decode { transfer }, decode.clone(), 3),
    )
    .await?;
    assert_eq!(output_tokens(&events).len(), 3);
    assert!(matches!(
        events.last(),
        Some(GenerateEvent::Finished {
            output_tokens: 3,
            reason: FinishReason::Length,
            ..
        })
    ));

    // Their blocks arrive as gap-free batches of one epoch, named by the
    // contract's hasher; generated tokens extend the local chain.
    let mut local_chain = local.clone();
    local_chain.extend(&tokens[..4]);
    let mut want = hasher().hash_prompt(&local_chain);
    assert_eq!(want.len(), 4);
    want.extend(hasher().hash_prompt(&prefill));
    want.extend(hasher().hash_prompt(&decode));
    kv.until_holding(&want).await?;
    assert_eq!(kv.epochs.len(), 1, "one epoch");

    agent.shutdown(WAIT).await?;
    Ok(())
}

// --- 3. Restart -----------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_starts_a_greater_epoch() -> Result<()> {
    let servers = Servers::start()?;
    let bus = Bus::from_client(servers.client().await?);
    let id = worker("restart");
    let mut kv = KvFollower::new(&bus, &id, WAIT).await?;

    let agent = Agent::start(servers.config("restart", Role::Both));
    let first = kv.next().await?;
    assert_eq!(
        (first.seq, first.events.clone()),
        (0, vec![KvEvent::Cleared])
    );
    agent.shutdown(WAIT).await?;

    let agent = Agent::start(servers.config("restart", Role::Both));
    let second = kv.next().await?; // the follower checks: greater, seq 0, Cleared
    assert!(second.epoch > first.epoch);
    assert_eq!(kv.epochs, vec![first.epoch, second.epoch]);
    agent.shutdown(WAIT).await?;

    // The clock went back (etcd recorded an epoch an hour ahead of it):
    // the next start is still later than every earlier epoch.
    let registry = servers.registry().await?;
    let ahead = second.epoch + 3_600_000;
    registry.record_epoch(&id, ahead).await?;
    let agent = Agent::start(servers.config("restart", Role::Both));
    let third = kv.next().await?;
    assert_eq!(third.epoch, ahead + 1);
    agent.shutdown(WAIT).await?;
    Ok(())
}

// --- 4. Resync ------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_republishes_the_full_block_set() -> Result<()> {
    let servers = Servers::start()?;
    let client = servers.client().await?;
    let bus = Bus::from_client(client.clone());
    let id = worker("resync");
    let mut kv = KvFollower::new(&bus, &id, WAIT).await?;
    let agent = Agent::start(servers.config("resync", Role::Both));
    wait_registered(&servers.registry().await?, &id).await?;

    let a = prompt(10, 64);
    let b = prompt(11, 40);
    generate(&client, &id, &request("a", Stage::Local, a.clone(), 2)).await?;
    generate(&client, &id, &request("b", Stage::Prefill, b.clone(), 1)).await?;
    let mut want = hasher().hash_prompt(&a);
    want.extend(hasher().hash_prompt(&b));
    kv.until_holding(&want).await?;
    let old_epoch = kv.epoch.unwrap();

    let reply = timeout(
        WAIT,
        client.request(subjects::resync(&id), Vec::new().into()),
    )
    .await??;
    let reply = ResyncReply::decode(&reply.payload)?;
    assert_eq!(reply.worker, id);
    assert!(reply.epoch > old_epoch);
    // The new epoch is recorded: a restart would start after it.
    let recorded = async {
        loop {
            if etcd_epoch(&servers, &id).await == Some(reply.epoch) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    timeout(WAIT, recorded).await?;

    // Every batch of the old epoch, then the new epoch's first batch: the
    // whole block set.
    let (first, held_before) = loop {
        let held: HashSet<BlockHash> = kv
            .mirror
            .stored_events()
            .iter()
            .flat_map(stored_blocks)
            .collect();
        let batch = kv.next().await?;
        if batch.epoch == reply.epoch {
            break (batch, held);
        }
    };
    assert_eq!(first.seq, 0);
    assert_eq!(first.events[0], KvEvent::Cleared);
    let republished: HashSet<BlockHash> =
        first.events[1..].iter().flat_map(stored_blocks).collect();
    assert_eq!(republished.len() as u64, reply.blocks);
    assert_eq!(republished, held_before);
    for h in &want {
        assert!(republished.contains(h));
    }

    // Serving and publishing go on in the new epoch.
    generate(&client, &id, &request("c", Stage::Local, prompt(12, 32), 1)).await?;
    kv.until_holding(&hasher().hash_prompt(&prompt(12, 32)))
        .await?;
    assert_eq!(kv.epoch, Some(reply.epoch));
    agent.shutdown(WAIT).await?;
    Ok(())
}

fn stored_blocks(event: &KvEvent) -> Vec<BlockHash> {
    match event {
        KvEvent::Stored { blocks, .. } => blocks.clone(),
        other => panic!("not a Stored event: {other:?}"),
    }
}

// --- 5. Load reports ------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reports_come_at_least_every_100ms_and_on_change() -> Result<()> {
    let servers = Servers::start()?;
    let client = servers.client().await?;
    let id = worker("load");
    let mut reports = client.subscribe(subjects::load(&id)).await?;
    let mut config = servers.config("load", Role::Both);
    // 150 decode steps of ~8.5 ms virtual: ~0.6 s.
    config.speedup = 2.0;
    let agent = Agent::start(config);

    let mut got: Vec<LoadReport> = Vec::new();
    let first = timeout(WAIT, reports.next()).await?.context("no report")?;
    got.push(LoadReport::decode(&first.payload)?);
    // A long generation runs while reports are collected.
    let generation = tokio::spawn({
        let client = client.clone();
        let id = id.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            generate(
                &client,
                &id,
                &request("long", Stage::Local, prompt(20, 64), 150),
            )
            .await
        }
    });
    let until = Instant::now() + Duration::from_millis(1200);
    while Instant::now() < until {
        let message = timeout(WAIT, reports.next())
            .await?
            .context("reports ended")?;
        got.push(LoadReport::decode(&message.payload)?);
    }
    generation.await??;
    agent.shutdown(WAIT).await?;

    assert!(got.iter().all(|r| r.worker == id));
    assert!(got
        .iter()
        .all(|r| r.kv_blocks_total == u64::from(PRESET.kv_capacity_blocks(BLOCK_SIZE))));
    let max_gap = got
        .windows(2)
        .map(|w| w[1].at_ms.saturating_sub(w[0].at_ms))
        .max()
        .unwrap();
    // 100 ms, and a little for a busy test machine's scheduling.
    assert!(max_gap <= 120, "a {max_gap} ms gap between load reports");
    assert!(got.len() >= 12, "{} reports in 1.2 s", got.len());
    assert!(
        got.iter().any(|r| r.running == 1),
        "the running request was reported"
    );
    Ok(())
}

// --- 6. Malformed and refused requests ----------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_a_clear_failure_and_serving_goes_on() -> Result<()> {
    let servers = Servers::start()?;
    let client = servers.client().await?;
    let id = worker("bad");
    let http = free_addr()?;
    let mut config = servers.config("bad", Role::Prefill);
    config.http_addr = Some(http);
    let agent = Agent::start(config);
    wait_registered(&servers.registry().await?, &id).await?;

    let chunks = generate_raw(&client, &id, b"not msgpack".to_vec()).await?;
    match &chunks[..] {
        [GenerateChunk {
            index: 0,
            event:
                GenerateEvent::Failed {
                    error,
                    retryable: false,
                },
        }] => assert!(error.starts_with("malformed GenerateRequest"), "{error}"),
        other => bail!("unexpected reply {other:?}"),
    }

    // No reply subject: counted and dropped.
    client
        .publish(
            subjects::generate(&id),
            request("noreply", Stage::Prefill, vec![1], 1)
                .encode()
                .into(),
        )
        .await?;

    // A stage this worker's role does not serve.
    let events = generate(
        &client,
        &id,
        &request("local", Stage::Local, prompt(30, 32), 2),
    )
    .await?;
    assert_eq!(
        events,
        vec![GenerateEvent::Failed {
            error: "worker bad has role prefill and does not serve local requests".into(),
            retryable: false
        }]
    );

    // Still serving.
    let events = generate(
        &client,
        &id,
        &request("ok", Stage::Prefill, prompt(31, 32), 1),
    )
    .await?;
    assert!(matches!(
        events.last(),
        Some(GenerateEvent::Finished {
            reason: FinishReason::Prefilled,
            ..
        })
    ));

    let (status, _) = http_get(http, "/healthz").await?;
    assert_eq!(status, 200);
    let (status, metrics) = http_get(http, "/metrics").await?;
    assert_eq!(status, 200);
    for line in [
        "worker_agent_malformed_requests_total{reason=\"decode\"}",
        "worker_agent_malformed_requests_total{reason=\"no_reply\"}",
        "worker_agent_generate_requests_total{stage=\"local\",outcome=\"refused\"}",
        "worker_agent_kv_batches_published_total",
        "worker_agent_load_reports_total",
    ] {
        assert!(metrics.contains(line), "{line} missing from\n{metrics}");
    }
    tests::promtool::check_metrics(&metrics, &[])?;
    agent.shutdown(WAIT).await?;
    Ok(())
}

// --- NATS outage ------------------------------------------------------------

/// Runs a generation whose decode stores blocks while NATS is down, and
/// follows the worker's batches once NATS is back until every block of
/// prompt and output is held.
async fn through_an_outage(name: &str, kv_queue_events: usize) -> Result<KvFollower> {
    let mut servers = Servers::start()?;
    let client = servers.client().await?;
    let id = worker(name);
    let mut config = servers.config(name, Role::Both);
    // 400 decode steps of ~8.5 ms virtual: ~1.7 s, a block every ~70 ms.
    config.speedup = 2.0;
    config.kv_queue_events = kv_queue_events;
    let agent = Agent::start(config);
    wait_registered(&servers.registry().await?, &id).await?;

    let p = prompt(40, 64);
    let max_tokens = 400;
    let inbox = client.new_inbox();
    client
        .publish_with_reply(
            subjects::generate(&id),
            inbox,
            request(name, Stage::Local, p.clone(), max_tokens)
                .encode()
                .into(),
        )
        .await?;
    client.flush().await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    tokio::task::block_in_place(|| servers.nats.stop())?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    tokio::task::block_in_place(|| servers.nats.restart())?;

    let bus = Bus::from_client(servers.client().await?);
    let mut kv = KvFollower::new(&bus, &id, WAIT).await?;
    let mut chain = p.clone();
    chain.extend(
        worker_agent::sim_engine::output_tokens(name, max_tokens)
            .iter()
            .take(max_tokens as usize - 1),
    );
    let want = hasher().hash_prompt(&chain);
    assert_eq!(want.len(), (64 + 399) / 16);
    kv.until_holding(&want).await?;
    agent.shutdown(WAIT).await?;
    Ok(kv)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_wait_for_nats_and_are_published_when_it_returns() -> Result<()> {
    let kv = through_an_outage("outage", 65_536).await?;
    assert_eq!(kv.epochs.len(), 1, "no resync was needed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_overflow_resyncs_instead_of_dropping() -> Result<()> {
    // Three events fit: the decode's stores overflow the queue while NATS
    // is down, and a new epoch republishes the whole block set.
    let kv = through_an_outage("overflow", 3).await?;
    assert!(kv.epochs.len() >= 2, "no resync: {:?}", kv.epochs);
    Ok(())
}

// --- 7. Cancellation ------------------------------------------------------

/// A cancelled generation stops: no more chunks come, and the engine drops
/// the request (its load reports show nothing running). A cancel for a
/// stream that already ended, and a malformed one, change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_generation_stops_and_leaves_the_engine() -> Result<()> {
    let servers = Servers::start()?;
    let client = servers.client().await?;
    let id = worker("cancel");
    let mut config = servers.config("cancel", Role::Both);
    // 2,000 decode steps of ~8.5 ms: ~17 s if not cancelled.
    config.speedup = 1.0;
    let agent = Agent::start(config);
    wait_registered(&servers.registry().await?, &id).await?;
    let mut reports = client.subscribe(subjects::load(&id)).await?;

    let long = request("long", Stage::Local, prompt(30, 64), 2_000);
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await?;
    client
        .publish_with_reply(subjects::generate(&id), inbox, long.encode().into())
        .await?;
    for _ in 0..3 {
        timeout(WAIT, replies.next())
            .await
            .context("waiting for a chunk")?
            .context("replies ended")?;
    }
    until_running(&mut reports, true)
        .await
        .context("the request never showed as running")?;
    // A probe naming the leg: held while it streams.
    assert_eq!(
        probe(&client, &id, long.annotation.decision).await?,
        Some(true)
    );
    assert_eq!(probe(&client, &id, DecisionId(0xbad)).await?, Some(false));
    send_cancel(&client, &id, &long).await?;
    client
        .publish(subjects::cancel(&id), b"garbage".to_vec().into())
        .await?;

    // The engine drops it at once: a report shows nothing running well
    // before the request could have finished.
    let idle = until_running(&mut reports, false)
        .await
        .context("the cancelled request kept running")?;
    assert_eq!((idle.waiting, idle.active_decode_blocks), (0, 0));
    // Cancelled: no longer held; an empty probe gets an empty answer.
    assert_eq!(
        probe(&client, &id, long.annotation.decision).await?,
        Some(false)
    );
    let empty = timeout(WAIT, client.request(subjects::ping(&id), Vec::new().into())).await??;
    assert!(empty.payload.is_empty());
    // No chunk comes any more (a few may have been in flight).
    tokio::time::sleep(Duration::from_millis(100)).await;
    while let Ok(Some(_)) = timeout(Duration::from_millis(10), replies.next()).await {}
    assert!(
        timeout(Duration::from_millis(300), replies.next())
            .await
            .is_err(),
        "chunks still come after the cancel"
    );

    // Serving goes on; a cancel after the end is ignored.
    let mut short = request("short", Stage::Local, prompt(31, 64), 3);
    short.annotation.decision = DecisionId(0xd1);
    let events = generate(&client, &id, &short).await?;
    assert_eq!(output_tokens(&events).len(), 3);
    send_cancel(&client, &id, &short).await?;
    client.flush().await?;
    agent.shutdown(WAIT).await?;
    Ok(())
}

/// Asks the agent whether it generates `decision`'s leg (`None`: it
/// answered nothing about legs).
async fn probe(client: &Client, id: &WorkerId, decision: DecisionId) -> Result<Option<bool>> {
    let answer = timeout(
        WAIT,
        client.request(subjects::ping(id), LegProbe { decision }.encode().into()),
    )
    .await??;
    Ok(LegProbeReply::decode(&answer.payload).ok().map(|reply| {
        assert_eq!(reply.decision, decision);
        reply.in_flight
    }))
}

async fn send_cancel(client: &Client, id: &WorkerId, request: &GenerateRequest) -> Result<()> {
    let cancel = CancelRequest {
        decision: request.annotation.decision,
        request_id: request.request_id.clone(),
        reason: "test".into(),
    };
    client
        .publish(subjects::cancel(id), cancel.encode().into())
        .await?;
    Ok(())
}

/// The first load report (within 3 s) whose `running > 0` is `running`.
async fn until_running(reports: &mut Subscriber, running: bool) -> Result<LoadReport> {
    timeout(Duration::from_secs(3), async {
        while let Some(message) = reports.next().await {
            let report = LoadReport::decode(&message.payload)?;
            if (report.running > 0) == running {
                return Ok(report);
            }
        }
        anyhow::bail!("reports ended")
    })
    .await?
}

// --- KV announcements -------------------------------------------------------

/// The worker's batches as announced on its live subject, checked and
/// mirrored like the stream's (a fresh follower's state).
struct Announced {
    subscriber: Subscriber,
    follower: KvFollower,
    batches: Vec<KvEventBatch>,
}

impl Announced {
    /// Reads announcements until every block of `want` is held.
    async fn until_holding(&mut self, want: &[BlockHash]) -> Result<()> {
        while !want.iter().all(|h| self.follower.mirror.contains(*h)) {
            let message = timeout(WAIT, self.subscriber.next())
                .await
                .context("waiting for an announced batch")?
                .context("the live subscription ended")?;
            let batch = KvEventBatch::decode(&message.payload)?;
            self.follower.check(&batch)?;
            self.batches.push(batch);
        }
        Ok(())
    }
}

/// While JetStream refuses the KV batches (the stream takes one message),
/// the agent announces each batch on its live subject as it forms it, so
/// the indexer can follow the engine; once the stream takes them again it
/// gets the very same batches, in the same order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_are_announced_while_the_stream_refuses_them() -> Result<()> {
    let servers = Servers::start()?;
    let client = servers.client().await?;
    let js = async_nats::jetstream::new(client.clone());
    let mut config = async_nats::jetstream::stream::Config {
        name: subjects::KV_EVENTS_STREAM.into(),
        subjects: vec![subjects::KV_EVENTS_ALL.into()],
        max_messages: 1,
        discard: async_nats::jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    };
    js.create_stream(config.clone()).await?;
    let id = worker("announcer");
    let mut announced = Announced {
        subscriber: client.subscribe(subjects::kv_events_live(&id)).await?,
        follower: KvFollower::detached(WAIT),
        batches: Vec::new(),
    };
    client.flush().await?;
    let agent = Agent::start(servers.config("announcer", Role::Both));
    wait_registered(&servers.registry().await?, &id).await?;

    let p = prompt(50, 96);
    generate(
        &client,
        &id,
        &request("announced", Stage::Local, p.clone(), 40),
    )
    .await?;
    let mut chain = p.clone();
    chain.extend(
        worker_agent::sim_engine::output_tokens("announced", 40)
            .iter()
            .take(39),
    );
    let want = hasher().hash_prompt(&chain);
    announced.until_holding(&want).await?;
    let stored = js
        .get_stream(subjects::KV_EVENTS_STREAM)
        .await?
        .info()
        .await?
        .state
        .messages;
    ensure!(
        stored == 1,
        "the stream took {stored} messages while refusing"
    );
    ensure!(announced.batches.len() > 1, "{:?}", announced.batches);
    // Asked (an indexer that missed those after its position), the agent
    // announces them again, unchanged.
    let epoch = announced.batches[0].epoch;
    client
        .publish(
            subjects::kv_reannounce(&id),
            subjects::kv_reannounce_body(epoch, 0).into(),
        )
        .await?;
    let again = timeout(WAIT, announced.subscriber.next())
        .await
        .context("nothing announced again")?
        .context("the live subscription ended")?;
    let again = KvEventBatch::decode(&again.payload)?;
    ensure!(
        again.seq == 1 && announced.batches.get(1) == Some(&again),
        "{again:?}"
    );

    // Room again: the stream gets what was announced, as it was.
    config.max_messages = -1;
    js.update_stream(&config).await?;
    let bus = Bus::from_client(client.clone());
    let mut kv = KvFollower::new(&bus, &id, WAIT).await?;
    let mut from_stream = Vec::new();
    while from_stream.len() < announced.batches.len() {
        from_stream.push(kv.next().await?);
    }
    ensure!(
        from_stream == announced.batches,
        "the stream differs from the announcements"
    );
    agent.shutdown(WAIT).await?;
    Ok(())
}
