//! The glue against real nats-server and etcd processes.

use std::time::Duration;

use anyhow::Result;
use bus::{Bus, BusError, Registry, StreamLimits, WorkerChange};
use futures::StreamExt;
use protocol::{subjects, IndexDelta, IndexSnapshot, KvEvent, KvEventBatch};
use tests::fixtures::{one_block_delta as delta, worker, worker_record as record};
use tests::{EtcdServer, NatsServer};

#[tokio::test(flavor = "multi_thread")]
async fn streams_dedup_fencing_and_snapshots() -> Result<()> {
    let server = NatsServer::start()?;
    let bus = Bus::connect(&server.url(), "bus-test").await?;
    bus.ensure_streams(&StreamLimits::default()).await?;
    bus.ensure_streams(&StreamLimits::default()).await?; // idempotent

    let batch = KvEventBatch {
        worker: worker("d0"),
        epoch: 1,
        seq: 0,
        events: vec![KvEvent::Cleared],
    };
    assert!(!bus.publish_kv_batch(&batch).await?);
    assert!(
        bus.publish_kv_batch(&batch).await?,
        "a republished batch is a duplicate"
    );

    // Deltas: n is stream message n; out of turn is refused.
    assert!(matches!(
        bus.publish_delta(&delta(2)).await,
        Err(BusError::Fenced { seq: 2 })
    ));
    for seq in 1..=3 {
        bus.publish_delta(&delta(seq)).await?;
    }
    bus.publish_delta(&delta(3)).await?; // the same delta again: a no-op
    let other = IndexDelta {
        changes: vec![],
        ..delta(3)
    };
    assert!(matches!(
        bus.publish_delta(&other).await,
        Err(BusError::Fenced { seq: 3 })
    ));
    assert_eq!(bus.last_delta_seq().await?, 3);
    let got: Vec<u64> = bus
        .deltas_from(2)
        .await?
        .take(2)
        .map(|d| d.map(|d| d.seq))
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    assert_eq!(got, vec![2, 3]);
    // Trimming keeps the numbering.
    bus.trim_deltas(2).await?;
    bus.publish_delta(&delta(4)).await?;
    let mut follow = bus.deltas_from(1).await?;
    let first = tokio::time::timeout(Duration::from_secs(5), follow.next())
        .await?
        .unwrap()?;
    assert_eq!(first.seq, 3, "deltas up to 2 were trimmed");

    assert_eq!(bus.latest_snapshot().await?, None);
    let snapshot = IndexSnapshot {
        delta_seq: 3,
        workers: vec![worker("d0")],
        cursors: vec![],
        runs: vec![],
        digest: 0,
    };
    bus.put_snapshot(&snapshot).await?;
    assert_eq!(bus.latest_snapshot().await?, Some(snapshot));
    Ok(())
}

/// A stream's byte cap and age limit, as the server reports them.
async fn retention(bus: &Bus, name: &str) -> Result<(i64, Duration)> {
    let mut stream = bus.jetstream().get_stream(name).await?;
    let config = &stream.info().await?.config;
    Ok((config.max_bytes, config.max_age))
}

#[tokio::test(flavor = "multi_thread")]
async fn stream_retention_is_set_by_the_indexer() -> Result<()> {
    let server = NatsServer::start()?;
    let bus = Bus::connect(&server.url(), "bus-test").await?;
    let defaults = StreamLimits::default();
    bus.ensure_streams(&defaults).await?;
    let day = Duration::from_secs(24 * 3600);
    for name in [subjects::KV_EVENTS_STREAM, subjects::DECISIONS_STREAM] {
        assert_eq!(retention(&bus, name).await?, (-1, day), "{name}");
    }
    assert_eq!(
        retention(&bus, subjects::INDEX_DELTAS_STREAM).await?,
        (-1, Duration::ZERO),
        "the indexer trims the deltas itself"
    );
    assert!(
        bus.apply_stream_limits(&defaults).await?.is_empty(),
        "the same limits again change nothing"
    );

    // The indexer's limits replace those of the existing streams...
    let capped = StreamLimits {
        kv_events_max_bytes: Some(1 << 30),
        decisions_max_bytes: Some(64 << 10),
        decisions_max_age: Duration::from_secs(3600),
        ..defaults
    };
    assert_eq!(
        bus.apply_stream_limits(&capped).await?,
        vec![subjects::KV_EVENTS_STREAM, subjects::DECISIONS_STREAM]
    );
    assert_eq!(
        retention(&bus, subjects::KV_EVENTS_STREAM).await?,
        (1 << 30, day)
    );
    assert_eq!(
        retention(&bus, subjects::DECISIONS_STREAM).await?,
        (64 << 10, Duration::from_secs(3600))
    );
    // ... the other services' creating calls leave them alone...
    bus.ensure_streams(&defaults).await?;
    assert!(bus.apply_stream_limits(&capped).await?.is_empty());
    // ... and the oldest records go once the log is full.
    let record = vec![7u8; 4096];
    for _ in 0..64 {
        bus.jetstream()
            .publish(subjects::decisions("r0"), record.clone().into())
            .await?
            .await?;
    }
    let mut stream = bus
        .jetstream()
        .get_stream(subjects::DECISIONS_STREAM)
        .await?;
    let state = stream.info().await?.state.clone();
    assert!(state.bytes <= 64 << 10, "{state:?}");
    assert!(
        state.first_sequence > 1,
        "the oldest were dropped: {state:?}"
    );
    assert_eq!(state.last_sequence, 64);
    Ok(())
}

/// Services start in any order: an agent creating the KV-event stream
/// while the indexer creates it with other caps must not fail (JetStream
/// answers the later create "stream name already in use with a different
/// configuration"; seen as an agent's exit at start in the test suite).
/// The same holds for the snapshot store, which two indexers applying
/// their limits may create at once (seen as this test's failure on a busy
/// machine).
#[tokio::test(flavor = "multi_thread")]
async fn streams_created_at_once_by_services_with_other_caps_both_start() -> Result<()> {
    let server = NatsServer::start()?;
    let capped = StreamLimits {
        kv_events_max_bytes: Some(1 << 30),
        ..StreamLimits::default()
    };
    let mut buses = Vec::new();
    for i in 0..4 {
        buses.push(Bus::connect(&server.url(), &format!("bus-test-{i}")).await?);
    }
    for round in 0..40 {
        let _ = buses[0]
            .jetstream()
            .delete_stream(subjects::KV_EVENTS_STREAM)
            .await;
        let creators = buses.iter().enumerate().map(|(i, bus)| {
            let capped = &capped;
            async move {
                if i % 2 == 0 {
                    bus.ensure_kv_stream(&StreamLimits::default()).await
                } else {
                    bus.apply_stream_limits(capped).await.map(drop)
                }
            }
        });
        for (i, result) in futures::future::join_all(creators)
            .await
            .into_iter()
            .enumerate()
        {
            result.map_err(|e| anyhow::anyhow!("round {round}, creator {i}: {e}"))?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn registration_lives_with_its_lease() -> Result<()> {
    let server = EtcdServer::start()?;
    let registry = Registry::connect(&[server.endpoint()]).await?;
    let (initial, revision) = registry.workers().await?;
    assert!(initial.is_empty());
    let mut watch = registry.watch_workers(revision).await?;

    let a = registry
        .register(&record("a"), Duration::from_secs(2))
        .await?;
    let b = registry
        .register(&record("b"), Duration::from_secs(2))
        .await?;
    let mut seen = Vec::new();
    while seen.len() < 2 {
        seen.extend(tokio::time::timeout(Duration::from_secs(5), watch.next()).await??);
    }
    assert_eq!(
        seen,
        vec![WorkerChange::Up(record("a")), WorkerChange::Up(record("b"))]
    );

    // Kept alive past its TTL.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(registry.workers().await?.0.len(), 2);

    // Revoked: gone at once. Dropped: gone when the lease expires.
    a.revoke().await?;
    let change = tokio::time::timeout(Duration::from_secs(2), watch.next()).await??;
    assert_eq!(change, vec![WorkerChange::Down(worker("a"))]);
    drop(b);
    let change = tokio::time::timeout(Duration::from_secs(5), watch.next()).await??;
    assert_eq!(change, vec![WorkerChange::Down(worker("b"))]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn epochs_only_go_up_even_when_the_clock_goes_back() -> Result<()> {
    let server = EtcdServer::start()?;
    let registry = Registry::connect(&[server.endpoint()]).await?;
    let w = worker("d0");
    assert_eq!(registry.next_epoch(&w, 1_000).await?, 1_000);
    // The clock went back: still later than the last one.
    assert_eq!(registry.next_epoch(&w, 500).await?, 1_001);
    // Epochs the agent moved to while running count too.
    registry.record_epoch(&w, 5_000).await?;
    registry.record_epoch(&w, 10).await?; // never lowers it
    assert_eq!(registry.next_epoch(&w, 2_000).await?, 5_001);
    assert_eq!(registry.next_epoch(&w, 9_000).await?, 9_000);
    // Agents starting at once get different epochs.
    let (a, b) = tokio::join!(registry.next_epoch(&w, 0), registry.next_epoch(&w, 0));
    let (a, b) = (a?, b?);
    assert!(a != b && a.min(b) == 9_001, "{a} {b}");
    // Per worker.
    assert_eq!(registry.next_epoch(&worker("d1"), 7).await?, 7);
    Ok(())
}

/// A JetStream store smaller than the caps asked for: the caps are lowered
/// until they fit (no start-up failure), and a stream that fills the store
/// makes publishes fail with an error that says so; freeing the room lets
/// them through again.
#[tokio::test(flavor = "multi_thread")]
async fn caps_larger_than_the_store_are_lowered_and_a_full_store_is_named() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("nats.conf");
    std::fs::write(&config, "jetstream {\n  max_file_store: 48MB\n}\n")?;
    let server = NatsServer::start_with_config(&config)?;
    let bus = Bus::connect(&server.url(), "bus-test").await?;
    // What every service creates: no byte cap.
    bus.ensure_streams(&StreamLimits::default()).await?;
    let asked = StreamLimits {
        kv_events_max_bytes: Some(1 << 30),
        decisions_max_bytes: Some(1 << 30),
        ..StreamLimits::default()
    };
    let refused = bus.apply_stream_limits(&asked).await.unwrap_err();
    assert!(refused.is_store_full(), "{refused}");
    let (set, changed) = bus.fit_stream_limits(&asked).await?;
    let (kv, decisions) = (
        set.kv_events_max_bytes.unwrap(),
        set.decisions_max_bytes.unwrap(),
    );
    assert!(kv + decisions <= 48 << 20, "{kv} + {decisions}");
    assert!(kv >= 8 << 20, "lowered no more than needed: {kv}");
    assert_eq!(
        changed,
        vec![subjects::KV_EVENTS_STREAM, subjects::DECISIONS_STREAM]
    );
    assert_eq!(
        retention(&bus, subjects::KV_EVENTS_STREAM).await?.0,
        kv as i64
    );

    // Another tenant's stream takes the rest of the store...
    let full = tests::fixtures::fill_store(bus.jetstream()).await?;
    let full = full.expect("the store filled");
    assert!(bus::store_full(&full), "{full}");
    // ... so a KV batch is refused, and the error says why.
    let batch = KvEventBatch {
        worker: worker("d0"),
        epoch: 1,
        seq: 0,
        events: vec![KvEvent::Cleared],
    };
    let error = bus.publish_kv_batch(&batch).await.unwrap_err();
    assert!(error.is_store_full(), "{error}");
    // Room again: it goes through.
    bus.jetstream().delete_stream("FILLER").await?;
    bus.publish_kv_batch(&batch).await?;
    Ok(())
}
