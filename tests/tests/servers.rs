//! Smoke tests of the server harness against real `nats-server` and `etcd`
//! processes, and of the client features the services rely on.

use std::error::Error;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, object_store, stream};
use bytes::Bytes;
use etcd_client::{EventType, PutOptions, WatchOptions};
use futures::StreamExt;
use tests::{EtcdServer, NatsServer};
use tokio::io::AsyncReadExt;
use tokio::time::timeout;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

/// Bounds every client call, so a broken server fails a test instead of
/// hanging it.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

async fn bounded<T>(future: impl std::future::IntoFuture<Output = T>) -> T {
    timeout(CALL_TIMEOUT, future)
        .await
        .expect("client call timed out")
}

async fn events_stream(
    js: &jetstream::Context,
) -> Result<stream::Stream, Box<dyn Error + Send + Sync>> {
    Ok(bounded(js.create_stream(stream::Config {
        name: "EVENTS".into(),
        subjects: vec!["events.>".into()],
        storage: stream::StorageType::File,
        ..Default::default()
    }))
    .await?)
}

async fn publish(
    js: &jetstream::Context,
    subject: &'static str,
    id: &str,
    payload: &'static [u8],
) -> Result<jetstream::publish::PublishAck, Box<dyn Error + Send + Sync>> {
    let message = jetstream::message::PublishMessage::build()
        .message_id(id)
        .payload(Bytes::from_static(payload));
    let ack = bounded(js.send_publish(subject, message)).await?;
    Ok(bounded(ack).await?)
}

async fn durable_consumer(
    stream: &stream::Stream,
) -> Result<consumer::Consumer<consumer::pull::Config>, Box<dyn Error + Send + Sync>> {
    Ok(bounded(stream.create_consumer(consumer::pull::Config {
        durable_name: Some("worker".into()),
        ack_policy: consumer::AckPolicy::Explicit,
        ..Default::default()
    }))
    .await?)
}

/// Fetches what is pending (without waiting for more), acking each message
/// with a server confirmation; returns the payloads.
async fn fetch_all(
    consumer: &consumer::Consumer<consumer::pull::Config>,
) -> Result<Vec<Bytes>, Box<dyn Error + Send + Sync>> {
    let mut batch = bounded(consumer.fetch().max_messages(100).messages()).await?;
    let mut payloads = Vec::new();
    while let Some(message) = bounded(batch.next()).await {
        let message = message?;
        bounded(message.double_ack()).await?;
        payloads.push(message.payload.clone());
    }
    Ok(payloads)
}

#[tokio::test(flavor = "multi_thread")]
async fn jetstream_dedups_by_message_id_and_serves_a_durable_pull_consumer() -> TestResult {
    let nats = NatsServer::start()?;
    let client = bounded(async_nats::connect(nats.url())).await?;
    assert_eq!(client.server_info().server_name, nats.name());
    let js = jetstream::new(client);
    let stream = events_stream(&js).await?;

    let first = publish(&js, "events.a", "m-1", b"one").await?;
    assert!(!first.duplicate);
    let again = publish(&js, "events.a", "m-1", b"one").await?;
    assert!(again.duplicate, "same Nats-Msg-Id within the window");
    assert_eq!(again.sequence, first.sequence);
    let second = publish(&js, "events.b", "m-2", b"two").await?;
    assert!(!second.duplicate);
    assert_eq!(second.sequence, first.sequence + 1);

    let consumer = durable_consumer(&stream).await?;
    assert_eq!(fetch_all(&consumer).await?, [&b"one"[..], &b"two"[..]]);
    assert!(fetch_all(&consumer).await?.is_empty(), "all acked");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn object_store_round_trips_a_multi_chunk_object() -> TestResult {
    let nats = NatsServer::start()?;
    let js = jetstream::new(bounded(async_nats::connect(nats.url())).await?);
    let bucket = bounded(js.create_object_store(object_store::Config {
        bucket: "snapshots".into(),
        storage: stream::StorageType::File,
        ..Default::default()
    }))
    .await?;

    // Larger than the 128 KiB default chunk.
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let info = bounded(bucket.put("index.bin", &mut data.as_slice())).await?;
    assert_eq!(info.size, data.len());
    assert!(info.chunks > 1);

    let mut object = bounded(bucket.get("index.bin")).await?;
    let mut read = Vec::new();
    bounded(object.read_to_end(&mut read)).await?;
    assert!(read == data, "object read back differs");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn stream_and_consumer_state_survive_a_restart() -> TestResult {
    let mut nats = NatsServer::start()?;
    let port = nats.port();
    let client = bounded(async_nats::connect(nats.url())).await?;
    let js = jetstream::new(client.clone());
    let stream = events_stream(&js).await?;
    let consumer = durable_consumer(&stream).await?;
    publish(&js, "events.a", "m-1", b"one").await?;
    assert_eq!(fetch_all(&consumer).await?, [&b"one"[..]]);
    publish(&js, "events.a", "m-2", b"two").await?;
    publish(&js, "events.a", "m-3", b"three").await?;

    nats.restart()?;
    assert_eq!(nats.port(), port);
    assert!(nats.is_running());

    // The same client reconnects to the same URL.
    let mut stream = bounded(js.get_stream("EVENTS")).await?;
    let state = bounded(stream.info()).await?.state.clone();
    assert_eq!(
        (state.messages, state.first_sequence, state.last_sequence),
        (3, 1, 3)
    );
    // The dedup window survives too.
    assert!(publish(&js, "events.a", "m-3", b"three").await?.duplicate);
    // The durable consumer resumes after its last ack.
    let consumer: consumer::Consumer<consumer::pull::Config> =
        bounded(stream.get_consumer("worker")).await?;
    assert_eq!(fetch_all(&consumer).await?, [&b"two"[..], &b"three"[..]]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn etcd_key_under_a_lease_disappears_once_keep_alives_stop() -> TestResult {
    let etcd = EtcdServer::start()?;
    let mut client = bounded(etcd_client::Client::connect([etcd.endpoint()], None)).await?;
    let lease = bounded(client.lease_grant(2, None)).await?;
    assert_eq!(lease.ttl(), 2);
    let put = bounded(client.put(
        "/workers/w-1",
        "alive",
        Some(PutOptions::new().with_lease(lease.id())),
    ))
    .await?;
    let revision = put.header().expect("put header").revision();
    let mut watch = bounded(client.watch(
        "/workers/w-1",
        Some(WatchOptions::new().with_start_revision(revision + 1)),
    ))
    .await?;

    let (mut keeper, mut keep_alives) = bounded(client.lease_keep_alive(lease.id())).await?;
    bounded(keeper.keep_alive()).await?;
    let renewed = bounded(keep_alives.message())
        .await?
        .expect("keep-alive response");
    let last_keep_alive = Instant::now();
    assert_eq!(renewed.ttl(), 2);
    drop((keeper, keep_alives));
    let present = bounded(client.get("/workers/w-1", None)).await?;
    assert_eq!(present.kvs().len(), 1);

    let deadline = last_keep_alive + Duration::from_secs(4);
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let response = timeout(remaining, watch.message())
            .await
            .map_err(|_| "key still present 4 s after the last keep-alive")??
            .expect("watch stream ended");
        if response
            .events()
            .iter()
            .any(|event| event.event_type() == EventType::Delete)
        {
            break;
        }
    }
    let gone_after = last_keep_alive.elapsed();
    assert!(
        gone_after >= Duration::from_millis(1500),
        "expired early: {gone_after:?}"
    );
    let absent = bounded(client.get("/workers/w-1", None)).await?;
    assert!(absent.kvs().is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn etcd_keys_survive_a_restart() -> TestResult {
    let mut etcd = EtcdServer::start()?;
    let ports = (etcd.client_port(), etcd.peer_port());
    let mut client = bounded(etcd_client::Client::connect([etcd.endpoint()], None)).await?;
    bounded(client.put("/config/k", "v", None)).await?;

    etcd.restart()?;
    assert_eq!((etcd.client_port(), etcd.peer_port()), ports);

    let mut client = bounded(etcd_client::Client::connect([etcd.endpoint()], None)).await?;
    let got = bounded(client.get("/config/k", None)).await?;
    assert_eq!(got.kvs().first().map(|kv| kv.value()), Some(&b"v"[..]));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn servers_started_in_parallel_get_distinct_ports() -> TestResult {
    fn join<T>(handle: thread::ScopedJoinHandle<'_, T>) -> T {
        handle.join().expect("start panicked")
    }
    let (nats, etcd) = thread::scope(|scope| {
        let nats: Vec<_> = (0..2).map(|_| scope.spawn(NatsServer::start)).collect();
        let etcd: Vec<_> = (0..2).map(|_| scope.spawn(EtcdServer::start)).collect();
        (
            nats.into_iter()
                .map(join)
                .collect::<anyhow::Result<Vec<_>>>(),
            etcd.into_iter()
                .map(join)
                .collect::<anyhow::Result<Vec<_>>>(),
        )
    });
    let (nats, etcd) = (nats?, etcd?);

    let mut ports: Vec<u16> = nats.iter().map(NatsServer::port).collect();
    ports.extend(etcd.iter().flat_map(|e| [e.client_port(), e.peer_port()]));
    let mut unique = ports.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), ports.len(), "ports collide: {ports:?}");

    for server in &nats {
        let client = bounded(async_nats::connect(server.url())).await?;
        assert_eq!(client.server_info().server_name, server.name());
    }
    for server in &etcd {
        let mut client = bounded(etcd_client::Client::connect([server.endpoint()], None)).await?;
        let members = bounded(client.member_list()).await?;
        let names: Vec<&str> = members.members().iter().map(|m| m.name()).collect();
        assert_eq!(names, [server.name()]);
    }
    Ok(())
}

/// Whether a loopback port can be bound again (its server has released it).
fn port_is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

#[test]
fn dropping_a_guard_stops_its_server_and_frees_its_ports() -> TestResult {
    let nats = NatsServer::start()?;
    let etcd = EtcdServer::start()?;
    let ports = [nats.port(), etcd.client_port(), etcd.peer_port()];
    assert!(ports.iter().all(|&p| !port_is_free(p)));
    drop(nats);
    drop(etcd);
    for port in ports {
        assert!(TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err());
        assert!(port_is_free(port), "port {port} still bound after drop");
    }
    Ok(())
}

#[test]
fn a_stopped_server_is_stopped_until_restarted() -> TestResult {
    let mut nats = NatsServer::start()?;
    nats.stop()?;
    assert!(!nats.is_running());
    assert!(TcpStream::connect((Ipv4Addr::LOCALHOST, nats.port())).is_err());
    nats.restart()?;
    assert!(nats.is_running());
    assert!(nats.log().contains("Server is ready"));
    Ok(())
}

const ORPHAN_ENV: &str = "SWITCHYARD_TESTS_ORPHAN_CHILD";

/// Runs this same test in a child process that starts servers and exits
/// without dropping their guards: the servers must go away anyway.
#[test]
fn servers_do_not_outlive_a_test_process_that_skips_drop() -> TestResult {
    if std::env::var_os(ORPHAN_ENV).is_some() {
        let nats = NatsServer::start()?;
        let etcd = EtcdServer::start()?;
        println!(
            "ORPHAN-PORTS {} {} {} {}",
            nats.port(),
            etcd.client_port(),
            nats.dir().display(),
            etcd.dir().display()
        );
        // Neither guard is dropped.
        std::process::exit(0);
    }

    let output = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "servers_do_not_outlive_a_test_process_that_skips_drop",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ORPHAN_ENV, "1")
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .find_map(|line| line.split_once("ORPHAN-PORTS ").map(|(_, rest)| rest))
        .ok_or_else(|| {
            format!(
                "child printed no ports; stdout:\n{stdout}\nstderr:\n{}",
                String::from_utf8_lossy(&output.stderr)
            )
        })?;
    let fields: Vec<&str> = line.split_whitespace().collect();
    let [nats_port, etcd_port, nats_dir, etcd_dir] = fields[..] else {
        return Err(format!("malformed child output {line:?}").into());
    };
    let ports: [u16; 2] = [nats_port.parse()?, etcd_port.parse()?];

    let deadline = Instant::now() + Duration::from_secs(10);
    for port in ports {
        while TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() {
            assert!(
                Instant::now() < deadline,
                "server on port {port} outlived its test process"
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
    // The child's temporary directories were not removed either.
    // (Best effort: a server may still be finishing its shutdown.)
    for dir in [nats_dir, etcd_dir] {
        for _ in 0..50 {
            if std::fs::remove_dir_all(dir).is_ok() {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}
