//! Taking a window off a live cluster (NATS JetStream): the decision log,
//! the index deltas it needs (after the latest snapshot that precedes it),
//! the workers' KV batches since the window's first decision, and the
//! indexer's position and digest at the end.

use std::time::Duration;

use anyhow::{bail, Context};
use async_nats::jetstream::{self, consumer};
use bus::Bus;
use futures::StreamExt;
use protocol::{subjects, DecisionRecord, IndexStatus, KvEventBatch, Message};

use crate::file::Export;

const TIMEOUT: Duration = Duration::from_secs(10);

/// Messages of a stream from `policy` on, up to its last message now.
async fn read_stream(
    js: &jetstream::Context,
    stream: &str,
    policy: consumer::DeliverPolicy,
) -> anyhow::Result<Vec<jetstream::Message>> {
    let mut s = js
        .get_stream(stream)
        .await
        .with_context(|| format!("stream {stream}"))?;
    let last = s.info().await?.state.last_sequence;
    let consumer = s
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: policy,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut out = Vec::new();
    loop {
        let next = tokio::time::timeout(Duration::from_millis(500), messages.next()).await;
        let message = match next {
            Ok(Some(m)) => m.map_err(|e| anyhow::anyhow!("reading {stream}: {e}"))?,
            // Nothing more (the window may start after the last message).
            Ok(None) | Err(_) => break,
        };
        let seq = message
            .info()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .stream_sequence;
        out.push(message);
        if seq >= last {
            break;
        }
    }
    Ok(out)
}

/// Exports the last `last` decisions (all when `None`) and what replaying
/// them needs.
pub async fn export(nats_url: &str, last: Option<usize>) -> anyhow::Result<Export> {
    let bus = Bus::connect(nats_url, "switchyard-replay").await?;
    let js = bus.jetstream().clone();

    // The indexer's position and digest now: the deltas will run to it.
    let reply = tokio::time::timeout(
        TIMEOUT,
        bus.client()
            .request(subjects::INDEX_STATUS, Vec::new().into()),
    )
    .await
    .context("the kv-indexer did not answer the status request")?
    .context("asking the kv-indexer for its status")?;
    let checkpoint = IndexStatus::decode(&reply.payload)?;

    let mut decisions = Vec::new();
    for message in read_stream(
        &js,
        subjects::DECISIONS_STREAM,
        consumer::DeliverPolicy::All,
    )
    .await?
    {
        match DecisionRecord::decode(&message.payload) {
            Ok(record) => decisions.push(record),
            Err(e) => {
                tracing::warn!(error = %e, subject = %message.subject, "skipping a malformed decision-log entry")
            }
        }
    }
    if let Some(n) = last {
        let skip = decisions.len().saturating_sub(n);
        decisions.drain(..skip);
    }
    let Some(first_needed) = decisions.iter().map(|r| r.inputs.delta_seq).min() else {
        bail!("the decision log is empty");
    };

    // The index before the window: the latest snapshot if it precedes the
    // window, else the deltas from the start.
    let snapshot = bus
        .latest_snapshot()
        .await?
        .filter(|s| s.delta_seq <= first_needed);
    let start = snapshot.as_ref().map_or(1, |s| s.delta_seq + 1);
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while bus.last_delta_seq().await? < checkpoint.delta_seq {
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the delta stream did not reach the indexer's position {}",
                checkpoint.delta_seq
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut deltas = Vec::new();
    if checkpoint.delta_seq >= start {
        let mut stream = bus.deltas_from(start).await?;
        while let Some(delta) = tokio::time::timeout(TIMEOUT, stream.next())
            .await
            .context("reading deltas")?
        {
            let delta = delta?;
            if deltas.is_empty() && delta.seq != start {
                bail!(
                    "deltas from {start} are needed but the stream starts at {} (trimmed) and the latest snapshot is newer than the window; export a shorter window",
                    delta.seq
                );
            }
            let seq = delta.seq;
            deltas.push(delta);
            if seq >= checkpoint.delta_seq {
                break;
            }
        }
    }

    // The workers' KV batches since the window's first decision.
    let first_ms = decisions
        .iter()
        .map(|r| r.decision.at_ms)
        .min()
        .unwrap_or(0);
    let start_time = consumer::DeliverPolicy::ByStartTime {
        start_time: time_from_ms(first_ms),
    };
    let kv_batches = read_stream(&js, subjects::KV_EVENTS_STREAM, start_time)
        .await?
        .iter()
        .filter_map(|m| KvEventBatch::decode(&m.payload).ok())
        .collect();

    Ok(Export {
        snapshot,
        deltas,
        kv_batches,
        decisions,
        checkpoint: Some(checkpoint),
    })
}

fn time_from_ms(ms: u64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}
