//! Restarts, crashes and recovery from snapshot + delta log, with traffic.

#![cfg(feature = "service")]

mod common;

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use common::*;
use futures::StreamExt;
use kv_indexer::service::consumer::PipelineError;
use kv_indexer::service::ServiceError;
use protocol::KvEventBatch;

const WAIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_and_crashes_during_traffic_lose_and_duplicate_nothing() -> Result<()> {
    let servers = Servers::start().await?;
    let mut config = servers.config();
    // The workers of this test never register.
    config.worker_grace = Duration::from_secs(3600);
    config.fetch_batch = 64;

    let workers = [worker("d0"), worker("d1"), worker("d2"), worker("p0")];
    let mut workload = Workload::new(&workers, 7);
    let batches: Vec<KvEventBatch> = (0..2000).map(|_| workload.batch()).collect();
    let local = local_indexer(&batches);
    ensure!(local.delta_seq() == batches.len() as u64);

    // The publisher runs through every phase.
    let publisher = {
        let bus = servers.bus.clone();
        let batches = batches.clone();
        tokio::spawn(async move {
            for chunk in batches.chunks(50) {
                for batch in chunk {
                    bus.publish_kv_batch(batch).await?;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            anyhow::Ok(())
        })
    };

    // 1. Graceful stop mid-traffic.
    let service = Running::start(config.clone()).await?;
    wait_for_delta(service.http, 200, WAIT).await?;
    service.stop().await?;
    let stopped_at = servers.bus.last_delta_seq().await?;

    // 2. A crash after a delta is published, before its KV message is acked.
    let crash_at = stopped_at + 100;
    let mut crashing = config.clone();
    crashing.crash_after_delta = Some(crash_at);
    let service = Running::start(crashing).await?;
    match service.join().await? {
        Err(ServiceError::Pipeline(PipelineError::InjectedCrash { seq })) if seq == crash_at => {}
        other => bail!("expected the injected crash at {crash_at}, got {other:?}"),
    }

    // 3. Aborted mid-stream (no shutdown at all), while it works through a
    // backlog. The message whose delta was published but not acked comes
    // back: a duplicate. (Deltas after it that the crashed instance had
    // already sent may be in the stream too: republished identical, they
    // are no-ops.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    let service = Running::start(config.clone()).await?;
    let at = servers.bus.last_delta_seq().await?;
    ensure!(at >= crash_at);
    wait_for("progress on the backlog", WAIT, || async {
        let s = service.status().await?;
        Ok((s["delta_seq"].as_u64() >= Some(at + 100)).then_some(()))
    })
    .await?;
    ensure!(
        service
            .metric("kv_indexer_batches_total{status=\"duplicate\"}")
            .await?
            >= 1.0
    );
    service.abort().await;

    // 4. Runs to the end.
    let service = Running::start(config.clone()).await?;
    publisher.await??;
    let status = wait_for_delta(service.http, local.delta_seq(), WAIT).await?;
    ensure!(
        status["delta_seq"] == local.delta_seq(),
        "no extra delta (a gap or a re-applied batch would add one): {status}"
    );
    ensure!(
        status["digest"] == digest_hex(local.index().digest()),
        "{status}"
    );
    ensure!(
        service
            .metric("kv_indexer_batches_total{status=\"gap\"}")
            .await?
            == 0.0
    );

    let deltas = read_deltas(&servers.bus, 1, local.delta_seq()).await?;
    check_sources(&deltas)?;
    let replica = replica_at(&servers.bus, local.delta_seq()).await?;
    ensure!(replica.index().digest() == local.index().digest());
    service.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_and_the_delta_log_recover_the_index() -> Result<()> {
    let servers = Servers::start().await?;
    let mut config = servers.config();
    config.worker_grace = Duration::from_secs(3600);
    config.snapshot_interval = Duration::from_secs(3600);
    config.snapshot_every_deltas = 50;
    config.delta_margin = 20;
    config.fetch_batch = 16;

    let workers = [worker("d0"), worker("d1"), worker("d2")];
    let mut workload = Workload::new(&workers, 11);
    let batches: Vec<KvEventBatch> = (0..420).map(|_| workload.batch()).collect();
    let local = local_indexer(&batches);

    let service = Running::start(config.clone()).await?;
    for batch in &batches[..320] {
        servers.bus.publish_kv_batch(batch).await?;
    }
    let status = wait_for_delta(service.http, 320, WAIT).await?;
    let snapshot_seq = wait_for("a snapshot", WAIT, || async {
        let s = service.status().await?["snapshot_seq"]
            .as_u64()
            .unwrap_or(0);
        Ok((s >= 250).then_some(s))
    })
    .await?;
    ensure!(snapshot_seq < 320, "{status}");
    // Every 50 deltas, but a snapshot under way defers the next one: fewer
    // than 250 / 50 when the deltas come faster than they are stored.
    ensure!(
        service
            .metric("kv_indexer_snapshots_total{result=\"ok\"}")
            .await?
            >= 2.0
    );
    ensure!(service.metric("kv_indexer_snapshot_bytes").await? > 0.0);
    service.stop().await?;

    // Deltas the snapshot covers are trimmed, but for the margin.
    let first = servers
        .bus
        .deltas_from(1)
        .await?
        .next()
        .await
        .context("no delta")??;
    let snapshot = servers
        .bus
        .latest_snapshot()
        .await?
        .context("no snapshot")?;
    ensure!(
        first.seq == snapshot.delta_seq - 20 + 1,
        "first delta {}",
        first.seq
    );

    // Restart: the snapshot plus the deltas after it.
    let service = Running::start(config.clone()).await?;
    let replayed = service
        .metric("kv_indexer_recovery_replayed_deltas")
        .await?;
    ensure!(
        replayed == (320 - snapshot.delta_seq) as f64 && replayed > 0.0,
        "replayed {replayed} after snapshot {}",
        snapshot.delta_seq
    );
    let status = service.status().await?;
    ensure!(status["delta_seq"] == 320);
    let at_320 = local_indexer(&batches[..320]);
    ensure!(status["digest"] == digest_hex(at_320.index().digest()));
    for batch in &batches[320..] {
        servers.bus.publish_kv_batch(batch).await?;
    }
    let status = wait_for_delta(service.http, 420, WAIT).await?;
    ensure!(
        status["digest"] == digest_hex(local.index().digest()),
        "{status}"
    );
    ensure!(
        service
            .metric("kv_indexer_batches_total{status=\"duplicate\"}")
            .await?
            == 0.0
    );
    let replica = replica_at(&servers.bus, 420).await?;
    ensure!(replica.index().digest() == local.index().digest());
    service.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_fences_the_indexer_off() -> Result<()> {
    let servers = Servers::start().await?;
    let service = Running::start(servers.config()).await?;
    let mut workload = Workload::new(&[worker("d0")], 13);
    servers.bus.publish_kv_batch(&workload.batch()).await?;
    wait_for_delta(service.http, 1, WAIT).await?;
    // Someone else writes delta 2.
    let intruder = protocol::IndexDelta {
        seq: 2,
        changes: vec![],
        source: None,
    };
    servers.bus.publish_delta(&intruder).await?;
    servers.bus.publish_kv_batch(&workload.batch()).await?;
    match service.join().await? {
        Err(ServiceError::Fenced { seq: 2 }) => Ok(()),
        other => bail!("expected the indexer to be fenced off at delta 2, got {other:?}"),
    }
}

/// A nats-server whose JetStream store holds 48 MB (a filler fills it), and
/// a bus on it with the streams made.
async fn small_store() -> Result<(tempfile::TempDir, tests::NatsServer, bus::Bus)> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let conf = dir.path().join("nats.conf");
    std::fs::write(&conf, "jetstream {\n  max_file_store: 48MB\n}\n")?;
    let nats = tests::NatsServer::start_with_config(&conf)?;
    let bus = bus::Bus::connect(&nats.url(), "kv-indexer-test").await?;
    bus.ensure_streams(&bus::StreamLimits::default()).await?;
    Ok((dir, nats, bus))
}

/// Refused deltas retried quickly, for up to [`WAIT`].
fn quick_retries() -> kv_indexer::service::consumer::RetryPolicy {
    kv_indexer::service::consumer::RetryPolicy {
        backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(400),
        give_up: WAIT,
    }
}

/// A full JetStream store refuses deltas: the pipeline sends the ones the
/// stream does not hold again, in place and in order, once room returns
/// (no gap, none twice), and counts each refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_deltas_are_sent_again_in_place_once_the_store_has_room() -> Result<()> {
    use kv_indexer::service::consumer::{Confirmed, Pipeline};

    let (_dir, _nats, bus) = small_store().await?;
    let delta = tests::fixtures::one_block_delta;
    let mut announced = bus.live_deltas().await?;
    let policy = quick_retries();
    let mut pipeline = Pipeline::new(&bus, 16, None, policy);
    for seq in 1..=3 {
        pipeline.push(Some(delta(seq)), None).await?;
    }
    while let Some(done) = pipeline.next().await {
        done?;
    }
    // Another tenant's stream takes the rest of the store.
    tests::fixtures::fill_store(bus.jetstream()).await?;
    let mut refusals = 0;
    for seq in 4..=6 {
        match pipeline.push(Some(delta(seq)), None).await {
            Err(e) | Ok(Some(Err(e))) => {
                ensure!(e.retryable(), "{e}");
                pipeline.refuse();
                refusals += 1;
            }
            Ok(_) => {}
        }
    }
    while refusals == 0 {
        match tokio::time::timeout(WAIT, pipeline.next()).await? {
            Some(Err(e)) => {
                ensure!(e.retryable(), "{e}");
                pipeline.refuse();
                refusals += 1;
            }
            Some(Ok(done)) => bail!("the full store took a delta: {done:?}"),
            None => bail!("the full store refused no delta"),
        }
    }
    ensure!(pipeline.is_refused());
    ensure!(bus.last_delta_seq().await? == 3);
    // Deltas made meanwhile wait for the next try (announced at once).
    for seq in 7..=8 {
        ensure!(pipeline.push(Some(delta(seq)), None).await?.is_none());
    }

    // Room returns a second later, while the pipeline retries.
    let freeing = {
        let bus = bus.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            bus.jetstream().delete_stream("FILLER").await
        })
    };
    loop {
        match tokio::time::timeout(WAIT, pipeline.next()).await? {
            Some(Ok(Confirmed { seq: Some(8) })) => break,
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                ensure!(e.retryable(), "{e}");
                pipeline.refuse();
                refusals += 1;
            }
            None => bail!("the pipeline stopped before delta 8"),
        }
    }
    freeing.await??;
    ensure!(refusals >= 2, "no refusal was retried");
    ensure!(!pipeline.is_refused() && pipeline.is_empty());
    // Refused again, and a delta made while the try that goes through
    // runs: it is sent as the pipeline goes on (by the next push, or by a
    // try), in order.
    pipeline.refuse();
    let _ = tokio::time::timeout(Duration::from_millis(1), pipeline.next()).await;
    for seq in 9..=10 {
        if let Some(Err(e)) = pipeline.push(Some(delta(seq)), None).await? {
            bail!("delta {seq}: {e}");
        }
    }
    while !pipeline.is_empty() {
        match tokio::time::timeout(WAIT, pipeline.next()).await? {
            Some(Err(e)) => bail!("refused with room: {e}"),
            Some(Ok(_)) => {}
            None => break,
        }
    }
    let mut deltas = bus.deltas_from(1).await?;
    for seq in 1..=10 {
        let got = tokio::time::timeout(WAIT, deltas.next())
            .await?
            .context("the delta stream ended")??;
        ensure!(got == delta(seq), "delta {seq}: {got:?}");
    }
    ensure!(bus.last_delta_seq().await? == 10, "a delta twice");
    // Each delta was announced as it was made, and the refused ones again
    // on every try, for routers that missed them.
    let mut times = [0; 11];
    while let Ok(Some(got)) =
        tokio::time::timeout(Duration::from_millis(500), announced.next()).await
    {
        let got = got?;
        ensure!(got == delta(got.seq), "announced {got:?}");
        times[got.seq as usize] += 1;
    }
    ensure!(times[1..=3] == [1, 1, 1], "announced {times:?}");
    ensure!(times[4..=8].iter().all(|&n| n >= 2), "announced {times:?}");
    ensure!(times[9..=10].iter().all(|&n| n >= 1), "announced {times:?}");
    // Fenced still stops: a delta that does not follow the stream's end.
    let mut other = Pipeline::new(&bus, 16, None, policy);
    other.push(Some(delta(13)), None).await?;
    let fenced = other.next().await.context("an entry")?.unwrap_err();
    ensure!(!fenced.retryable(), "{fenced}");
    Ok(())
}

/// While the delta stream refuses deltas (here: a message cap that
/// discards new ones; in production a stream electing its leader), the
/// indexer goes on applying KV events and announcing their deltas to the
/// routers, says so in `/status` (`deltas_refused`), and stores the deltas
/// in order once the stream takes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_are_applied_and_announced_while_the_delta_stream_refuses() -> Result<()> {
    use async_nats::jetstream::stream::DiscardPolicy;
    use protocol::subjects;

    let servers = Servers::start().await?;
    let service = Running::start(servers.config()).await?;
    let mut announced = servers.bus.live_deltas().await?;
    let workers = [worker("d0")];
    let mut workload = Workload::new(&workers, 3);
    let batches: Vec<KvEventBatch> = (0..4).map(|_| workload.batch()).collect();
    servers.bus.publish_kv_batch(&batches[0]).await?;
    wait_for_delta(service.http, 1, WAIT).await?;

    let js = servers.bus.jetstream();
    let mut stream = js.get_stream(subjects::INDEX_DELTAS_STREAM).await?;
    let open = stream.info().await?.config.clone();
    js.update_stream(async_nats::jetstream::stream::Config {
        max_messages: 1,
        discard: DiscardPolicy::New,
        ..open.clone()
    })
    .await?;
    for batch in &batches[1..] {
        servers.bus.publish_kv_batch(batch).await?;
    }
    let status = wait_for("the batches applied while refused", WAIT, || async {
        let status = service.status().await?;
        Ok((status["deltas_refused"] == true && status["delta_seq"] == 4).then_some(status))
    })
    .await?;
    ensure!(status["delta_seq_published"] == 1, "{status}");
    let mut seqs = Vec::new();
    while seqs.last() != Some(&4) {
        let delta = tokio::time::timeout(WAIT, announced.next())
            .await?
            .context("the announcements ended")??;
        seqs.push(delta.seq);
    }
    // In order, each first time (refused ones are announced again on
    // every try).
    let mut firsts: Vec<u64> = Vec::new();
    for seq in &seqs {
        if !firsts.contains(seq) {
            firsts.push(*seq);
        }
    }
    ensure!(firsts == [1, 2, 3, 4], "announced {seqs:?}");
    // A router that missed them asks: the unconfirmed ones come again.
    let mut again = servers.bus.live_deltas().await?;
    servers
        .bus
        .client()
        .publish(subjects::INDEX_REANNOUNCE, Vec::new().into())
        .await?;
    let mut resent = Vec::new();
    while resent.len() < 3 {
        let delta = tokio::time::timeout(WAIT, again.next())
            .await?
            .context("no announcement came again")??;
        resent.push(delta.seq);
    }
    resent.sort_unstable();
    resent.dedup();
    ensure!(resent == [2, 3, 4], "announced again {resent:?}");

    js.update_stream(open).await?;
    let status = wait_for_delta(service.http, 4, WAIT).await?;
    ensure!(status["deltas_refused"] == false, "{status}");
    ensure!(servers.bus.last_delta_seq().await? == 4);
    let replica = replica_at(&servers.bus, 4).await?;
    ensure!(replica.index().digest() == local_indexer(&batches).index().digest());
    service.stop().await
}

/// A leader that dies without resigning holds its etcd lease until the
/// TTL runs out; the standby asks it over NATS whether it is there, and on
/// "no responders" three times running revokes the lease and takes over
/// well before (here the TTL is 10 s: the lease could not have run out in
/// under 6.7 s, the last renewal being at most a third of it old).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_from_a_dead_leader_before_its_lease_runs_out() -> Result<()> {
    let servers = Servers::start().await?;
    let mut config = servers.config();
    config.leader_ttl = Duration::from_secs(10);
    let leader = Running::start(config.clone()).await?;
    let standby = tokio::spawn(kv_indexer::service::Service::start(config));
    // A standby that finds its leader alive stays one.
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        !standby.is_finished(),
        "the standby took over from a live leader"
    );
    ensure!(leader.status().await?["role"] == "leader");

    leader.abort().await;
    let died = std::time::Instant::now();
    let elected = tokio::time::timeout(WAIT, standby)
        .await
        .context("the standby did not take over")???;
    let took = died.elapsed();
    ensure!(
        took < Duration::from_secs(6),
        "took over after {took:?}: the lease ran out rather than being revoked"
    );
    drop(elected);
    Ok(())
}

/// A KV message that made no delta (most often the stream's copy of a
/// batch already applied from its announcement) is acked only once the
/// last delta made before it is in the stream: not while JetStream refuses
/// that delta, which would let a failover lose the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_without_a_delta_waits_for_the_delta_made_before_it() -> Result<()> {
    use async_nats::jetstream::{consumer, message::AckKind, stream};
    use kv_indexer::service::consumer::{Confirmed, Pipeline};

    let (_dir, _nats, bus) = small_store().await?;
    let js = bus.jetstream();
    // A stand-in for the KV stream: one message to ack.
    let acks = js
        .create_stream(stream::Config {
            name: "ACKS".into(),
            subjects: vec!["acks".into()],
            ..Default::default()
        })
        .await?;
    js.publish("acks", "copy".into()).await?.await?;
    let pull = acks
        .create_consumer(consumer::pull::Config {
            durable_name: Some("acks".into()),
            ..Default::default()
        })
        .await?;
    let message = pull
        .fetch()
        .max_messages(1)
        .messages()
        .await?
        .next()
        .await
        .context("the message to ack")?
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (_, acker) = message.split();
    let pending = |pull: consumer::PullConsumer| async move {
        let mut pull = pull;
        anyhow::Ok(pull.info().await?.num_ack_pending)
    };

    let delta = tests::fixtures::one_block_delta;
    let policy = quick_retries();
    let mut pipeline = Pipeline::new(&bus, 16, None, policy);
    pipeline.push(Some(delta(1)), None).await?;
    while let Some(done) = pipeline.next().await {
        done?;
    }
    tests::fixtures::fill_store(js).await?;
    // Delta 2 is sent (the store refuses it), then the message without a
    // delta is pushed behind it.
    ensure!(pipeline.push(Some(delta(2)), None).await?.is_none());
    ensure!(pipeline
        .push(None, Some((acker, AckKind::Ack)))
        .await?
        .is_none());
    match tokio::time::timeout(WAIT, pipeline.next()).await? {
        Some(Err(e)) => {
            ensure!(e.retryable(), "{e}");
            pipeline.refuse();
        }
        other => bail!("the full store took delta 2: {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    ensure!(
        pending(pull.clone()).await? == 1,
        "acked while its delta was refused"
    );

    js.delete_stream("FILLER").await?;
    loop {
        match tokio::time::timeout(WAIT, pipeline.next()).await? {
            Some(Ok(Confirmed { seq: Some(2) })) => break,
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                ensure!(e.retryable(), "{e}");
                pipeline.refuse();
            }
            None => bail!("the pipeline stopped before delta 2"),
        }
    }
    wait_for("the ack once delta 2 is stored", WAIT, || {
        let pull = pull.clone();
        async move { Ok((pending(pull).await? == 0).then_some(())) }
    })
    .await
}
