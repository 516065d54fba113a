//! The chaos suite: agentic load (`loadgen agentic`) against two routers
//! on a highly available deployment (3 NATS nodes with R3 streams, 3 etcd
//! members, a leading and a standby kv-indexer, the bus's permissions on),
//! then, one window each, kill -9 and restart of every component in turn,
//! and forged messages from clients that may not send them. Each window
//! reports the requests sent / ok / failed / hung, the seconds until the
//! component is ready again and until the index has converged (the indexer
//! holds every agent's last KV batch, and every router the indexer's
//! index), and whether that digest equals a rebuild of the raw KV log and
//! `replay verify` reproduces the decision log.
//!
//! `scripts/chaos` runs it in full (`SWITCHYARD_CHAOS=full`: longer load
//! windows); `scripts/test` runs it shortened, without the full store. The table and the closing
//! JSON line go to stderr and, with `SWITCHYARD_CHAOS_REPORT=FILE`, to
//! that file. The test fails on what this deployment guarantees: a digest
//! mismatch, a replay that does not reproduce, an accepted forgery, a lost
//! request when etcd or an indexer dies, a failover over 30 s (a liveness
//! bound; the 2 s target is judged on `max_converge_s`), an index that did
//! not follow the engines while the store was full. Losses a
//! fault causes elsewhere (a router's or an agent's in-flight requests)
//! are measured and reported, not hidden; so are services that stop by
//! themselves during a window (restarted, as a supervisor would, and named
//! in the table; `crashed` in the totals).

mod cluster;

use std::fmt::Write as _;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use async_nats::{ConnectOptions, Event};
use cluster::{Cluster, Load, LoadOutcome, PASSWORD};
use protocol::{subjects, Message, WorkerId};
use serde_json::{json, Value};

/// Faults after which no request may be lost.
const LOSSLESS: &[&str] = &["indexer", "indexer with standby", "etcd member"];
/// Longest failover to the standby indexer this test accepts: a liveness
/// bound; the measured time is in the table and the JSON line
/// (`max_converge_s`), where the 2 s target is judged.
const FAILOVER: f64 = 30.0;

/// One fault's row of the table.
#[derive(Debug)]
struct Row {
    fault: &'static str,
    load: LoadOutcome,
    ready_s: f64,
    converge_s: f64,
    digest_equals_log: bool,
    replay_reproduced: bool,
    /// Services that stopped by themselves during the window (restarted,
    /// as a supervisor would).
    crashed: Vec<String>,
    /// What else the fault measured (the NATS node's own catch-up), in
    /// the order measured.
    notes: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Indexer,
    Router,
    DecodeAgent,
    PrefillAgent,
    NatsNode,
    EtcdMember,
    FullStore,
    IndexerWithStandby,
}

impl Fault {
    const ALL: [Fault; 8] = [
        Fault::Indexer,
        Fault::Router,
        Fault::DecodeAgent,
        Fault::PrefillAgent,
        Fault::NatsNode,
        Fault::EtcdMember,
        Fault::FullStore,
        Fault::IndexerWithStandby,
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::Indexer => "indexer",
            Fault::Router => "router",
            Fault::DecodeAgent => "decode agent",
            Fault::PrefillAgent => "prefill agent",
            Fault::NatsNode => "NATS node (1 of 3)",
            Fault::EtcdMember => "etcd member",
            Fault::FullStore => "full JetStream store",
            Fault::IndexerWithStandby => "indexer with standby",
        }
    }
}

/// How long a component stays dead before its restart.
const DOWN: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread")]
async fn chaos() -> Result<()> {
    let full = std::env::var("SWITCHYARD_CHAOS").is_ok_and(|v| v == "full");
    let mut cluster = Cluster::start_ha_secured(&["p0"], &["d0", "d1"], 2).await?;
    let result = run(&mut cluster, full).await;
    // SWITCHYARD_CHAOS_LOGS=1: every service's log, also when it passed.
    if std::env::var("SWITCHYARD_CHAOS_LOGS").is_ok_and(|v| v == "1") {
        eprintln!("{}{}", cluster.logs(), cluster.nats.log());
    }
    result.with_context(|| format!("{}{}", cluster.logs(), cluster.nats.log()))
}

async fn run(cluster: &mut Cluster, full: bool) -> Result<()> {
    let load = Load {
        duration: Duration::from_secs(if full { 20 } else { 5 }),
        request_timeout: Duration::from_secs(if full { 60 } else { 15 }),
        ..Load::default()
    };
    let mut rows = Vec::new();
    // SWITCHYARD_CHAOS_ONLY=TEXT runs only the faults whose name holds it
    // (to study one; the suite's checks then judge those rows only).
    let only = std::env::var("SWITCHYARD_CHAOS_ONLY").ok();
    for (i, fault) in Fault::ALL.into_iter().enumerate() {
        // The shortened run (scripts/test) leaves out the full store: it
        // needs 15 s of load while 3 × 96 MB fill, and on a loaded machine
        // JetStream then answered nothing for over 10 s (the filler's
        // delete and a read of the KV log timed out). scripts/chaos runs it.
        if matches!(fault, Fault::FullStore) && !full && only.is_none() {
            continue;
        }
        if only
            .as_ref()
            .is_some_and(|o| !fault.name().contains(o.as_str()))
        {
            continue;
        }
        let started = Instant::now();
        let watch = ReadyWatch::start(cluster, fault.name()).await?;
        // The store takes seconds to fill: the load must outlast it.
        let duration = match fault {
            Fault::FullStore => load.duration.max(Duration::from_secs(15)),
            _ => load.duration,
        };
        let window = Load {
            seed: 100 + i as u64,
            duration,
            ..load.clone()
        }
        .start(&cluster.router_urls())?;
        tokio::time::sleep(load.duration / 4).await;
        let (mut ready_s, since, note) = inject(cluster, fault).await?;
        let mut notes: Vec<String> = note.into_iter().collect();
        let mut crashed = cluster.heal().await?;
        let converge_s = if let Fault::FullStore = fault {
            // Timed apart, from the same instant.
            let (converge_s, writes_s) =
                tokio::join!(converge(cluster, since), took_writes_again(cluster, since));
            ready_s = writes_s?;
            notes.push(format!(
                "every service took JetStream writes again {ready_s:.2} s after the room returned (the streams' leader elections); the index followed the agents' announced batches meanwhile"
            ));
            converge_s?
        } else {
            converge(cluster, since).await?
        };
        if let Fault::NatsNode = fault {
            notes.push(nats_node_healthy(cluster, since).await?);
            streams_led(cluster).await?;
        }
        let elections = watch.stop(since).await;
        if let Fault::NatsNode = fault {
            // nats-server's Raft waits 4-9 s for a dead leader. The routers
            // follow the indexer's announcements meanwhile; the agents'
            // batches wait for the KV-event stream's.
            if let Some(t) = elections.deltas {
                notes.push(format!(
                    "the delta stream's leader died with the node; its new leader was elected {t:+.2} s from the restart (the kill was {DOWN:?} before it): the routers followed the indexer's announcements meanwhile"
                ));
            }
            if let Some(t) = elections.kv {
                notes.push(format!(
                    "the KV-event stream's leader died with the node; its new leader was elected {t:+.2} s from the restart: the agents' batches waited for it in their queues, and the indexer applied their announcements meanwhile"
                ));
            }
        }
        let outcome = window.await??;
        crashed.extend(cluster.heal().await?);
        let digest_equals_log = cluster.index_matches_log().await?;
        let replay_reproduced = replay_verify(cluster).await?;
        eprintln!(
            "chaos: {} done in {:.1} s: {outcome:?}",
            fault.name(),
            started.elapsed().as_secs_f64()
        );
        rows.push(Row {
            fault: fault.name(),
            load: outcome,
            ready_s,
            converge_s,
            digest_equals_log,
            replay_reproduced,
            crashed,
            notes,
        });
    }
    let forgeries = forgeries(cluster).await?;
    let report = report(&rows, &forgeries);
    eprintln!("{report}");
    if let Ok(path) = std::env::var("SWITCHYARD_CHAOS_REPORT") {
        std::fs::write(&path, &report).with_context(|| format!("writing {path}"))?;
    }

    for row in &rows {
        ensure!(
            row.digest_equals_log,
            "{}: the index differs from the KV log's",
            row.fault
        );
        ensure!(
            row.replay_reproduced,
            "{}: replay verify did not reproduce",
            row.fault
        );
        if LOSSLESS.contains(&row.fault) {
            ensure!(
                row.load.failed == 0,
                "{}: requests lost: {:?}",
                row.fault,
                row.load
            );
        }
        ensure!(
            row.load.ok > 0,
            "{}: nothing was served: {:?}",
            row.fault,
            row.load
        );
        ensure!(
            !row.notes.iter().any(|n| n.contains(NOT_FOLLOWED)),
            "{}: {:?}",
            row.fault,
            row.notes
        );
    }
    if let Some(failover) = rows.iter().find(|r| r.fault == "indexer with standby") {
        ensure!(
            failover.ready_s <= FAILOVER,
            "the standby took {:.2} s to take over",
            failover.ready_s
        );
    }
    let accepted: Vec<_> = forgeries.iter().filter(|f| f.accepted).collect();
    ensure!(accepted.is_empty(), "forgeries accepted: {accepted:?}");
    Ok(())
}

/// Kills the fault's component (SIGKILL), restarts it after [`DOWN`]
/// (the failover: the standby takes over at once), and waits until it
/// is ready again. Returns the seconds from the restart (the failover:
/// from the kill; the full store: from the room's return) to readiness,
/// that instant, and what else the fault showed.
async fn inject(cluster: &mut Cluster, fault: Fault) -> Result<(f64, Instant, Option<String>)> {
    let since;
    let mut note = None;
    match fault {
        Fault::IndexerWithStandby => {
            since = Instant::now();
            let took = cluster.fail_over_indexer().await?;
            return Ok((took, since, None));
        }
        Fault::FullStore => {
            let js = async_nats::jetstream::new(cluster.nats_client().await?);
            let filled = fill_store(&js).await?;
            let full_at = Instant::now();
            let said = said_store_full(cluster).await;
            // While JetStream stores nothing, the index follows the
            // engines through the announcements.
            let current =
                tokio::time::timeout(Duration::from_secs(10), cluster.converged_with_agents())
                    .await;
            let current = match current {
                Ok(Ok(_)) => format!(
                    "the index held every agent's last batch and the routers the index {:.2} s after the store filled",
                    full_at.elapsed().as_secs_f64()
                ),
                Ok(Err(e)) => format!("{NOT_FOLLOWED}: {e}"),
                Err(_) => format!("{NOT_FOLLOWED} (10 s)"),
            };
            // Room again (from when the filler is gone: its deletion can
            // take seconds on a full cluster); nothing is restarted, the
            // services must see it.
            free_store(&js).await?;
            since = Instant::now();
            note = Some(format!(
                "store full after {filled} ({}); {current}; {}",
                cluster::HA_STORE_PER_NODE,
                match said {
                    Some((who, text, after)) => format!(
                        "said so {after:.2} s later on {who}: {}",
                        text.chars().take(120).collect::<String>()
                    ),
                    None => "NOT said on any /readyz or /healthz within 5 s".into(),
                }
            ));
        }
        Fault::Indexer => {
            // Alone: the standby stands down first.
            let mut standby = cluster.standby.take().context("a standby")?;
            standby.service.stop()?;
            cluster.indexer.service.kill()?;
            tokio::time::sleep(DOWN).await;
            since = Instant::now();
            cluster.indexer.service.restart()?;
            cluster::wait_http(cluster.indexer.port, "/readyz").await?;
            let ready = since.elapsed().as_secs_f64();
            standby.service.restart()?;
            let port = standby.port;
            cluster::wait_http(port, "/healthz").await?;
            cluster.standby = Some(standby);
            return Ok((ready, since, None));
        }
        Fault::Router => {
            let router = &mut cluster.routers[1];
            router.service.kill()?;
            tokio::time::sleep(DOWN).await;
            since = Instant::now();
            router.service.restart()?;
            let port = router.port;
            cluster::wait_http(port, "/readyz").await?;
        }
        Fault::DecodeAgent | Fault::PrefillAgent => {
            let name = if matches!(fault, Fault::DecodeAgent) {
                "d1"
            } else {
                "p0"
            };
            let worker = cluster
                .workers
                .iter_mut()
                .find(|w| w.name == name)
                .context("the worker")?;
            worker.agent.service.kill()?;
            tokio::time::sleep(DOWN).await;
            since = Instant::now();
            worker.agent.service.restart()?;
            let port = worker.agent.port;
            cluster::wait_http(port, "/healthz").await?;
            cluster.wait_routers_know_workers().await?;
        }
        Fault::NatsNode => {
            // The node leading the delta stream: the worst case, every run
            // (its deltas wait for a new leader's election). The system
            // must converge on the two live nodes: the restarted node's
            // own JetStream catch-up (seconds) is waited for after
            // convergence, and reported apart.
            let node = delta_stream_leader(cluster).await?;
            let nats = cluster.nats.cluster().context("a NATS cluster")?;
            nats.kill(node)?;
            tokio::time::sleep(DOWN).await;
            since = Instant::now();
            nats.restart_accepting(node)?;
            note = Some(format!(
                "killed {}, the delta stream's leader",
                nats.name(node)
            ));
        }
        Fault::EtcdMember => {
            let etcd = cluster.etcd.cluster().context("an etcd cluster")?;
            etcd.kill(1)?;
            tokio::time::sleep(DOWN).await;
            since = Instant::now();
            etcd.restart(1)?;
        }
    }
    for router in &cluster.routers {
        cluster::wait_http(router.port, "/readyz").await?;
    }
    Ok((since.elapsed().as_secs_f64(), since, note))
}

/// Seconds from `since` until every service takes JetStream writes again:
/// the indexer ready (its deltas stored) and every agent healthy (its KV
/// batches stored).
async fn took_writes_again(cluster: &Cluster, since: Instant) -> Result<f64> {
    cluster::wait_http(cluster.indexer.port, "/readyz").await?;
    for worker in &cluster.workers {
        cluster::wait_http(worker.agent.port, "/healthz").await?;
    }
    Ok(since.elapsed().as_secs_f64())
}

/// What the full-store row says when the index did not follow the engines
/// while JetStream stored nothing (a failure).
const NOT_FOLLOWED: &str = "the index did NOT follow the engines while the store was full";

/// The stream that fills the store (another tenant's, R3).
const FILLER: &str = "CHAOS_FILLER";

/// Fills JetStream's store with a stream of 1 MB messages until it refuses
/// one for want of room; says how much it took.
async fn fill_store(js: &async_nats::jetstream::Context) -> Result<String> {
    js.create_stream(async_nats::jetstream::stream::Config {
        name: FILLER.into(),
        subjects: vec!["chaos.filler".into()],
        num_replicas: 3,
        ..Default::default()
    })
    .await?;
    let chunk = bytes::Bytes::from(vec![0u8; 1 << 20]);
    for mb in 0..4096u32 {
        let sent = async { js.publish("chaos.filler", chunk.clone()).await?.await }.await;
        if let Err(e) = sent {
            // A clustered JetStream with a full store refuses, or stops
            // confirming.
            let e = e.to_string();
            let unconfirmed = e.contains("timed out") || e.contains("no stream found");
            ensure!(bus::store_full(&e) || unconfirmed, "filling the store: {e}");
            return Ok(format!("{mb} MB of filler, then: {e}"));
        }
    }
    bail!("4 GB of filler did not fill the store")
}

/// Deletes the filler (its meta request may time out on a full cluster:
/// tried again for up to 30 s, until the stream is gone).
async fn free_store(js: &async_nats::jetstream::Context) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match js.delete_stream(FILLER).await {
            Ok(_) => return Ok(()),
            Err(e) if e.to_string().contains("not found") => return Ok(()),
            Err(e) if Instant::now() < deadline => {
                eprintln!("chaos: deleting the filler: {e}; again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => bail!("deleting the filler for 30 s: {e}"),
        }
    }
}

/// Waits (5 s at most) until a service says the store is full: a router's
/// or the indexer's `/readyz`, or an agent's `/healthz`, not 200. Returns
/// who, what it said and after how long.
async fn said_store_full(cluster: &Cluster) -> Option<(String, String, f64)> {
    let mut targets: Vec<(String, String)> = cluster
        .routers
        .iter()
        .enumerate()
        .map(|(i, r)| (format!("router {i} /readyz"), format!("{}/readyz", r.url())))
        .collect();
    targets.push((
        "indexer /readyz".into(),
        format!("{}/readyz", cluster.indexer.url()),
    ));
    for w in &cluster.workers {
        targets.push((
            format!("agent {} /healthz", w.name),
            format!("http://127.0.0.1:{}/healthz", w.agent.port),
        ));
    }
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        for (who, url) in &targets {
            if let Ok(r) = cluster.http.get(url).send().await {
                if !r.status().is_success() {
                    let text = r.text().await.unwrap_or_default();
                    return Some((
                        who.clone(),
                        text.trim().to_owned(),
                        started.elapsed().as_secs_f64(),
                    ));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// What the routers' and the indexers' `/readyz` answered during a fault,
/// polled every 50 ms: each change, printed (`chaos: ` lines) with its time
/// from the restart, to show what readiness waited for.
struct ReadyWatch {
    task: tokio::task::JoinHandle<Vec<(Instant, String, String)>>,
    stop: tokio::sync::oneshot::Sender<()>,
    fault: &'static str,
}

impl ReadyWatch {
    async fn start(cluster: &Cluster, fault: &'static str) -> Result<Self> {
        let js = async_nats::jetstream::new(cluster.nats_client().await?);
        let mut targets: Vec<(String, String)> = cluster
            .routers
            .iter()
            .enumerate()
            .map(|(i, r)| (format!("router {i}"), format!("{}/readyz", r.url())))
            .collect();
        targets.push((
            "indexer".into(),
            format!("{}/readyz", cluster.indexer.url()),
        ));
        if let Some(standby) = &cluster.standby {
            targets.push(("standby".into(), format!("{}/readyz", standby.url())));
        }
        let http = cluster.http.clone();
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut last: Vec<String> = vec![String::new(); targets.len()];
            let mut changes = Vec::new();
            // Each stream's leader and when its last sequence last moved:
            // a stall of over 300 ms is recorded when it moves again.
            let streams = [
                subjects::KV_EVENTS_STREAM,
                subjects::INDEX_DELTAS_STREAM,
                subjects::DECISIONS_STREAM,
            ];
            let mut moved: Vec<(Option<u64>, Instant, String)> =
                vec![(None, Instant::now(), String::new()); streams.len()];
            loop {
                for (i, name) in streams.iter().enumerate() {
                    let info = tokio::time::timeout(Duration::from_millis(500), async {
                        js.get_stream(*name).await.ok()?.info().await.ok().cloned()
                    })
                    .await
                    .ok()
                    .flatten();
                    let Some(info) = info else { continue };
                    let leader = info
                        .cluster
                        .and_then(|c| c.leader)
                        .unwrap_or_else(|| "none".into());
                    let seq = info.state.last_sequence;
                    let (last_seq, at, last_leader) = &mut moved[i];
                    let now = Instant::now();
                    if leader != *last_leader {
                        changes.push((now, format!("stream {name}"), format!("leader {leader}")));
                        *last_leader = leader;
                    }
                    if *last_seq != Some(seq) {
                        if last_seq.is_some() && now - *at > Duration::from_millis(300) {
                            changes.push((
                                now,
                                format!("stream {name}"),
                                format!(
                                    "moved again at {seq} after {:.2} s still",
                                    (now - *at).as_secs_f64()
                                ),
                            ));
                        }
                        *last_seq = Some(seq);
                        *at = now;
                    }
                }
                for (i, (name, url)) in targets.iter().enumerate() {
                    let answer = match http
                        .get(url)
                        .timeout(Duration::from_millis(500))
                        .send()
                        .await
                    {
                        Ok(r) => {
                            let status = r.status().as_u16();
                            let text = r.text().await.unwrap_or_default();
                            // The delta position changes all the time:
                            // only the verdict is a change.
                            let text = match serde_json::from_str::<Value>(&text) {
                                Ok(v) => v["status"]
                                    .as_str()
                                    .map(|s| s.split(':').next().unwrap_or(s).to_owned())
                                    .unwrap_or_default(),
                                Err(_) => text.trim().to_owned(),
                            };
                            format!("{status} {text}")
                        }
                        Err(e) if e.is_connect() => "down".into(),
                        Err(e) if e.is_timeout() => "no answer in 500 ms".into(),
                        Err(e) => format!("error {e}"),
                    };
                    if answer != last[i] {
                        changes.push((Instant::now(), name.clone(), answer.clone()));
                        last[i] = answer;
                    }
                }
                tokio::select! {
                    _ = &mut stopped => break,
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
            changes
        });
        Ok(Self { task, stop, fault })
    }

    /// Stops polling and prints the changes, timed from `since`
    /// (negative: before the restart). Returns when, from `since`, the KV
    /// and the delta stream last got a new leader after the fault's start
    /// (`None`: it kept its leader).
    async fn stop(self, since: Instant) -> Elections {
        let _ = self.stop.send(());
        let fault = self.fault;
        let Ok(changes) = self.task.await else {
            return Elections::default();
        };
        let streams = [subjects::KV_EVENTS_STREAM, subjects::INDEX_DELTAS_STREAM]
            .map(|stream| format!("stream {stream}"));
        let mut leaders = [0; 2];
        let mut elected = [None; 2];
        for (at, name, answer) in changes {
            let t = if at >= since {
                (at - since).as_secs_f64()
            } else {
                -(since - at).as_secs_f64()
            };
            eprintln!("chaos: {fault}: {t:+.2} s {name}: {answer}");
            let Some(i) = streams.iter().position(|s| *s == name) else {
                continue;
            };
            if answer.starts_with("leader ") && answer != "leader none" {
                leaders[i] += 1;
                // After the kill, DOWN before the restart.
                if leaders[i] > 1 && t > -DOWN.as_secs_f64() {
                    elected[i] = Some(t);
                }
            }
        }
        Elections {
            kv: elected[0],
            deltas: elected[1],
        }
    }
}

/// When, from the restart, a stream whose leader died got a new one.
#[derive(Debug, Default)]
struct Elections {
    kv: Option<f64>,
    deltas: Option<f64>,
}

/// Waits (at most 20 s) until the KV-event and the delta stream have a
/// leader, so that the watch sees their elections.
async fn streams_led(cluster: &Cluster) -> Result<()> {
    let js = async_nats::jetstream::new(cluster.nats_client().await?);
    let deadline = Instant::now() + Duration::from_secs(20);
    for name in [subjects::KV_EVENTS_STREAM, subjects::INDEX_DELTAS_STREAM] {
        loop {
            let led = async { js.get_stream(name).await.ok()?.info().await.ok().cloned() }
                .await
                .and_then(|info| info.cluster?.leader)
                .is_some();
            if led || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// Which node of the NATS cluster leads the delta stream.
async fn delta_stream_leader(cluster: &mut Cluster) -> Result<usize> {
    let js = async_nats::jetstream::new(cluster.nats_client().await?);
    let mut stream = js.get_stream(subjects::INDEX_DELTAS_STREAM).await?;
    let info = stream.info().await?;
    let leader = info
        .cluster
        .as_ref()
        .and_then(|c| c.leader.clone())
        .context("the delta stream has no leader")?;
    let nats = cluster.nats.cluster().context("a NATS cluster")?;
    (0..nats.len())
        .find(|&i| nats.name(i) == leader)
        .with_context(|| format!("the delta stream's leader {leader} is no node of the cluster"))
}

/// Waits (at most a minute) until every NATS node's JetStream is healthy
/// (the restarted one caught up); says how long it took from `since`.
async fn nats_node_healthy(cluster: &mut Cluster, since: Instant) -> Result<String> {
    let nats = cluster.nats.cluster().context("a NATS cluster")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(0..nats.len()).all(|i| tokio::task::block_in_place(|| nats.jetstream_healthy(i))) {
        ensure!(
            Instant::now() < deadline,
            "the NATS nodes' JetStream was not healthy within a minute"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(format!(
        "every node's JetStream healthy (the restarted one caught up) {:.2} s after its restart; nothing waited for it",
        since.elapsed().as_secs_f64()
    ))
}

/// Seconds from `since` until the indexer holds every agent's last KV
/// batch and every router holds the indexer's digest at its delta.
async fn converge(cluster: &Cluster, since: Instant) -> Result<f64> {
    cluster.converged_with_agents().await?;
    Ok(since.elapsed().as_secs_f64())
}

/// `replay export` of the last decisions, then `replay verify`: every
/// decision reproduced and the rebuilt index equal to the live one. An
/// export that has not ended in a minute is killed and run once more (one
/// hung once, reading the stream after an indexer restart: cause not
/// found; a hang is reported, never waited for).
async fn replay_verify(cluster: &Cluster) -> Result<bool> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("window.syx");
    let file = file.to_str().context("a UTF-8 path")?;
    let replay = tests::binary("replay")?;
    let nats = cluster.nats.url();
    let mut output = None;
    for attempt in 1..=2 {
        let mut export = tokio::process::Command::new(&replay);
        export.args(["export", "--nats", &nats, "--out", file, "--last", "200"]);
        export.args(cluster.nats_login(bus::permissions::REPLAY_USER));
        export.kill_on_drop(true);
        match tokio::time::timeout(Duration::from_secs(60), export.output()).await {
            // A read that failed in a fault's aftermath (streams still
            // electing leaders) is tried once more, as a person would.
            Ok(Ok(done)) if !done.status.success() && attempt == 1 => {
                eprintln!(
                    "chaos: replay export failed (attempt 1), trying again: {}",
                    String::from_utf8_lossy(&done.stderr).trim()
                );
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Ok(done) => {
                output = Some(done.context("replay export")?);
                break;
            }
            Err(_) => eprintln!("chaos: replay export hung for 60 s (attempt {attempt}); killed"),
        }
    }
    let output = output.context("replay export hung for 60 s, or failed then hung")?;
    if !output.status.success() {
        bail!(
            "replay export failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let output = Command::new(&replay)
        .args(["verify", "--file", file, "--json"])
        .output()
        .context("replay verify")?;
    let verify: Value = serde_json::from_slice(&output.stdout)
        .with_context(|| format!("replay verify: {}", String::from_utf8_lossy(&output.stderr)))?;
    if verify["decisions"] != verify["reproduced"]
        || verify["digest"]["live"] != verify["digest"]["rebuilt"]
    {
        let text = verify.to_string();
        eprintln!(
            "chaos: replay verify: {}",
            text.chars().take(2000).collect::<String>()
        );
    }
    Ok(verify["decisions"] == verify["reproduced"]
        && verify["digest"]["live"] == verify["digest"]["rebuilt"])
}

/// One forged message and what became of it.
#[derive(Debug)]
struct Forgery {
    who: String,
    what: String,
    accepted: bool,
}

/// Forged messages from clients that may not send them: an anonymous
/// client (the server must refuse the login), and agent d0 publishing as
/// d1 (a KV batch with a far-future epoch, a load report), as the indexer
/// (a delta), as a router (a generate request), and a chunk on a router's
/// reply inbox. Accepted: the server reported no permissions violation
/// within 2 s.
async fn forgeries(cluster: &Cluster) -> Result<Vec<Forgery>> {
    let mut out = Vec::new();
    let anonymous = ConnectOptions::new().connect(cluster.nats.urls()).await;
    out.push(Forgery {
        who: "anonymous".into(),
        what: "login".into(),
        accepted: anonymous.is_ok(),
    });
    let d0: WorkerId = "d0".parse()?;
    let d1: WorkerId = "d1".parse()?;
    let user = bus::permissions::agent_user(&d0);
    let (tx, mut errors) = tokio::sync::mpsc::unbounded_channel::<String>();
    let client = ConnectOptions::new()
        .user_and_password(user.clone(), PASSWORD.into())
        .custom_inbox_prefix(bus::permissions::inbox_prefix(&user))
        .event_callback(move |event| {
            let tx = tx.clone();
            async move {
                if let Event::ServerError(e) = event {
                    let _ = tx.send(e.to_string().to_lowercase());
                }
            }
        })
        .connect(cluster.nats.urls())
        .await?;
    let batch = protocol::KvEventBatch {
        worker: d1.clone(),
        epoch: 1 << 62,
        seq: 0,
        events: vec![protocol::KvEvent::Cleared],
    };
    let attempts = [
        (
            subjects::kv_events(&d1),
            batch.encode(),
            "KV batch as d1, epoch 2^62",
        ),
        (
            subjects::kv_events_live(&d1),
            batch.encode(),
            "KV batch announcement as d1",
        ),
        (subjects::load(&d1), b"forged".to_vec(), "load report as d1"),
        (
            subjects::INDEX_DELTAS.to_owned(),
            b"forged".to_vec(),
            "index delta",
        ),
        (
            subjects::INDEX_DELTAS_LIVE.to_owned(),
            tests::fixtures::one_block_delta(1).encode(),
            "index delta announcement",
        ),
        (
            subjects::generate(&d1),
            b"forged".to_vec(),
            "generate request to d1",
        ),
        (
            format!(
                "{}.forged",
                bus::permissions::inbox_prefix(bus::permissions::ROUTER_USER)
            ),
            b"forged".to_vec(),
            "chunk on a router's inbox",
        ),
    ];
    for (subject, payload, what) in attempts {
        client.publish(subject.clone(), payload.into()).await?;
        client.flush().await?;
        let want = format!("\"{}\"", subject.to_lowercase());
        let refused = tokio::time::timeout(Duration::from_secs(2), async {
            while let Some(error) = errors.recv().await {
                if error.contains("permissions violation") && error.contains(&want) {
                    return true;
                }
            }
            false
        })
        .await
        .unwrap_or(false);
        out.push(Forgery {
            who: user.clone(),
            what: what.into(),
            accepted: !refused,
        });
    }
    Ok(out)
}

/// The table, then one JSON line of the totals.
fn report(rows: &[Row], forgeries: &[Forgery]) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "{:<22} {:>5} {:>5} {:>6} {:>5} {:>7} {:>8} {:>10} {:>14}",
        "fault",
        "sent",
        "ok",
        "failed",
        "hung",
        "retried",
        "ready_s",
        "converge_s",
        "digest=replay"
    );
    for r in rows {
        let _ = writeln!(
            text,
            "{:<22} {:>5} {:>5} {:>6} {:>5} {:>7} {:>8.2} {:>10.2} {:>14}",
            r.fault,
            r.load.sent,
            r.load.ok,
            r.load.failed,
            r.load.hung,
            r.load.client_retries,
            r.ready_s,
            r.converge_s,
            if r.digest_equals_log && r.replay_reproduced {
                "yes"
            } else {
                "NO"
            }
        );
        if !r.notes.is_empty() {
            let _ = writeln!(text, "    {}", r.notes.join("; "));
        }
        if r.load.streams_resent > 0 {
            let _ = writeln!(
                text,
                "    of the retried, {} sent again from the start after their stream broke",
                r.load.streams_resent
            );
        }
        if !r.crashed.is_empty() {
            let _ = writeln!(
                text,
                "    stopped by itself, restarted: {}",
                r.crashed.join(", ")
            );
        }
        for error in &r.load.first_errors {
            let _ = writeln!(
                text,
                "    failed: {}",
                error.chars().take(160).collect::<String>()
            );
        }
    }
    for f in forgeries {
        let _ = writeln!(
            text,
            "forged: {:<40} by {:<16} {}",
            f.what,
            f.who,
            if f.accepted { "ACCEPTED" } else { "refused" }
        );
    }
    let sum = |f: fn(&LoadOutcome) -> u64| rows.iter().map(|r| f(&r.load)).sum::<u64>();
    let max_converge = rows.iter().map(|r| r.converge_s).fold(0.0, f64::max);
    let totals = json!({
        "faults": rows.len() + usize::from(!forgeries.is_empty()),
        "sent": sum(|l| l.sent),
        "lost": sum(|l| l.failed),
        "hung": sum(|l| l.hung),
        "unclear_5xx": sum(|l| l.unclear_5xx),
        "client_retries": sum(|l| l.client_retries),
        "streams_resent": sum(|l| l.streams_resent),
        "max_converge_s": (max_converge * 100.0).round() / 100.0,
        "digest_mismatches": rows.iter().filter(|r| !(r.digest_equals_log && r.replay_reproduced)).count(),
        "crashed": rows.iter().map(|r| r.crashed.len()).sum::<usize>(),
        "forgeries_accepted": forgeries.iter().filter(|f| f.accepted).count(),
    });
    let _ = writeln!(text, "{totals}");
    text
}
