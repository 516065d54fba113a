//! High availability across processes: a 3-node JetStream cluster (every
//! stream with 3 replicas), a 3-member etcd cluster, a leading and a
//! standby kv-indexer, two routers under agentic load. One NATS node is
//! killed (SIGKILL) and restarted: the streams lose nothing and the system
//! serves on: a leg the dead node lost before its first token is retried
//! (no request fails before streaming), and one it lost mid-stream goes on
//! on another worker (the router's resume; what failed is printed). The load's client
//! is also given a router URL nobody listens on, and sends those turns
//! again through the next router, as one behind a load balancer does (it
//! must have retried some, and lost none for it). Then one etcd member
//! and the leading indexer: no request is lost, the standby takes over
//! within 2 s, and the index equals both a rebuild from the raw KV log and
//! what the routers hold.

mod cluster;

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use cluster::{conversation, Cluster, Load};

/// Longest failover this test accepts: kill -9 of the leader to the
/// standby's `/readyz` 200. A liveness bound, not the 2 s target: the
/// failover's time is a figure `scripts/chaos` reports (a timed assertion
/// would fail on a loaded machine, not on a slow failover).
const FAILOVER: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread")]
async fn one_nats_node_one_etcd_member_and_the_leading_indexer_die_under_load() -> Result<()> {
    let mut cluster = Cluster::start_ha(&["p0"], &["d0", "d1"], 2).await?;
    let result = async {
        // The streams are replicated on three nodes.
        let js = async_nats::jetstream::new(cluster.nats_client().await?);
        for stream in [
            protocol::subjects::KV_EVENTS_STREAM,
            protocol::subjects::INDEX_DELTAS_STREAM,
            protocol::subjects::DECISIONS_STREAM,
        ] {
            let info = js.get_stream(stream).await?.info().await?.clone();
            ensure!(info.config.num_replicas == 3, "{stream}: {:?}", info.config.num_replicas);
        }
        // The standby says so.
        let standby = cluster.standby.as_ref().context("a standby")?;
        let status = cluster
            .get_json(format!("{}/status", standby.url()))
            .await?;
        ensure!(status["role"] == "standby", "{status}");
        let readyz = cluster
            .http
            .get(format!("{}/readyz", standby.url()))
            .send()
            .await?;
        ensure!(readyz.status() == 503, "standby /readyz: {}", readyz.status());

        conversation(&cluster, 0, 60, 2).await?;
        let load = Load {
            duration: Duration::from_secs(5),
            ..Load::default()
        };
        // A router nobody listens on (the port of a listener just closed).
        let dead = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
            format!("http://{}", listener.local_addr()?)
        };
        let mut urls = vec![dead];
        urls.extend(cluster.router_urls());
        let nats_load = load.start(&urls)?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let nats = cluster.nats.cluster().context("a NATS cluster")?;
        nats.kill(0)?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        nats.restart(0)?;
        let nats_outcome = nats_load.await??;
        ensure!(nats_outcome.ok > 0, "{nats_outcome:?}");
        ensure!(nats_outcome.client_retries > 0, "{nats_outcome:?}");
        // Nothing failed before its first token (a status; a stream cut
        // after it reads "ended without [DONE]" or a router error event).
        ensure!(
            !nats_outcome.first_errors.iter().any(|e| e.contains("HTTP ")),
            "{nats_outcome:?}"
        );

        let load = Load {
            seed: 2,
            duration: Duration::from_secs(6),
            ..load
        }
        .start(&cluster.router_urls())?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let etcd = cluster.etcd.cluster().context("an etcd cluster")?;
        etcd.kill(1)?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        etcd.restart(1)?;
        let failover = cluster.fail_over_indexer().await?;

        let outcome = load.await??;
        ensure!(outcome.sent > 0 && outcome.failed == 0, "{outcome:?}");
        ensure!(
            failover <= FAILOVER.as_secs_f64(),
            "the standby took {failover:.2} s to take over"
        );
        let status = cluster.indexer_status().await?;
        ensure!(status["role"] == "leader", "{status}");

        // Served after the failover, and the index is the log's.
        conversation(&cluster, 1, 61, 2).await?;
        ensure!(cluster.index_matches_log().await?, "digest differs from the KV log's");
        eprintln!("ha: NATS node {nats_outcome:?}; etcd member and indexer {outcome:?}, failover {failover:.2} s");
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}
