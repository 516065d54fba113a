//! Taking a window off a live cluster (NATS JetStream): the decision log,
//! the index deltas it needs (after the latest snapshot that precedes it),
//! the workers' KV batches since the window's first decision, and the
//! indexer's position and digest at the end.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use anyhow::{bail, Context};
use async_nats::jetstream::{self, consumer};
use bus::Bus;
use futures::StreamExt;
use protocol::{
    subjects, ContextId, DecisionContext, IndexStatus, KvEventBatch, LogEntry, LogReader,
    LoggedDecision, Message,
};

use crate::file::Export;

const TIMEOUT: Duration = Duration::from_secs(10);
/// Times a standing delta feed is opened again before an export gives up.
const REOPEN_FEED: u32 = 3;
/// How long a read from a start time waits for its first message before
/// it takes the stream to hold none after it.
const FIRST_BY_TIME: Duration = Duration::from_secs(2);

/// Messages of a stream from `policy` on, up to its last message now. A
/// read that stops before that last message (its consumer died with a
/// NATS node) is an error after `TIMEOUT` without a message, never a
/// window cut short in silence.
async fn read_stream(
    js: &jetstream::Context,
    stream: &str,
    policy: consumer::DeliverPolicy,
) -> anyhow::Result<Vec<jetstream::Message>> {
    let mut s = js
        .get_stream(stream)
        .await
        .with_context(|| format!("stream {stream}"))?;
    let state = s.info().await?.state.clone();
    if state.messages == 0 {
        return Ok(Vec::new());
    }
    let last = state.last_sequence;
    // From a start time there may be nothing to read: a short first wait.
    let first_wait = match policy {
        consumer::DeliverPolicy::All => TIMEOUT,
        _ => FIRST_BY_TIME,
    };
    let consumer = bus::create_consumer_patiently(|| {
        s.create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: policy,
            ..Default::default()
        })
    })
    .await
    .map_err(|e| anyhow::anyhow!("reading {stream}: {e}"))?;
    let mut messages = consumer.messages().await?;
    let mut out = Vec::new();
    let mut seq = 0;
    loop {
        let wait = if out.is_empty() { first_wait } else { TIMEOUT };
        let message = match tokio::time::timeout(wait, messages.next()).await {
            Ok(Some(m)) => m.map_err(|e| anyhow::anyhow!("reading {stream}: {e}"))?,
            Ok(None) => bail!("reading {stream}: the consumer ended at sequence {seq} of {last}"),
            // Nothing after the start time.
            Err(_) if out.is_empty() && first_wait < TIMEOUT => break,
            Err(_) => bail!(
                "reading {stream}: no message for {wait:?} at sequence {seq} of {last} (its consumer may have died with a NATS node: export again)"
            ),
        };
        seq = message
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
pub async fn export(
    nats_url: &str,
    auth: &bus::NatsAuth,
    last: Option<usize>,
) -> anyhow::Result<Export> {
    let bus = Bus::connect_with(nats_url, "switchyard-replay", auth).await?;
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

    let mut entries = Vec::new();
    for message in read_stream(
        &js,
        subjects::DECISIONS_STREAM,
        consumer::DeliverPolicy::All,
    )
    .await?
    {
        match LogEntry::decode(&message.payload) {
            Ok(entry) => entries.push(entry),
            Err(e) => {
                tracing::warn!(error = %e, subject = %message.subject, "skipping a malformed decision-log entry")
            }
        }
    }
    let window = Window::of(&entries, last);
    let decisions = window.decisions;
    let Some(first_needed) = decisions.iter().map(|d| d.delta_seq).min() else {
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
    let mut deltas: Vec<protocol::IndexDelta> = Vec::new();
    if checkpoint.delta_seq >= start {
        // A feed that stands still (its consumer died with a NATS node,
        // a stream electing its leader) is opened again after the last
        // delta read, a few times, before the export gives up.
        let mut reopened = 0;
        let mut stream = bus.deltas_from(start).await?;
        loop {
            let delta = match tokio::time::timeout(TIMEOUT, stream.next()).await {
                Ok(Some(delta)) => delta?,
                Ok(None) => break,
                Err(_) if reopened < REOPEN_FEED => {
                    reopened += 1;
                    let next = deltas.last().map_or(start, |d| d.seq + 1);
                    eprintln!(
                        "no delta for {TIMEOUT:?} (reading from {next}); opening the delta feed again ({reopened} of {REOPEN_FEED})"
                    );
                    stream = bus.deltas_from(next).await?;
                    continue;
                }
                Err(_) => bail!(
                    "reading deltas: none for {TIMEOUT:?} after delta {}, {REOPEN_FEED} times (is JetStream electing the delta stream's leader? try again)",
                    deltas.last().map_or(start - 1, |d| d.seq)
                ),
            };
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
        .map(|d| d.decision.at_ms)
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
        contexts: window.contexts,
        prompts: window.prompts,
        decisions,
        checkpoint: Some(checkpoint),
    })
}

/// The last decisions of the log and what they refer to: the contexts they
/// name and the prompts, logged before the window, that they begin with.
struct Window {
    contexts: Vec<DecisionContext>,
    prompts: Vec<Vec<protocol::BlockHash>>,
    decisions: Vec<LoggedDecision>,
}

impl Window {
    /// The last `last` decisions of `entries` (all when `None`).
    fn of(entries: &[LogEntry], last: Option<usize>) -> Window {
        let total = entries.iter().filter(|e| e.decision().is_some()).count();
        let skip = last.map_or(0, |n| total.saturating_sub(n));
        let mut reader = LogReader::new();
        let mut contexts: BTreeMap<ContextId, Option<DecisionContext>> = BTreeMap::new();
        let mut known: BTreeMap<ContextId, DecisionContext> = BTreeMap::new();
        let mut ends_in_window = HashSet::new();
        let mut prompts = Vec::new();
        let mut decisions = Vec::new();
        let mut seen = 0;
        for entry in entries {
            let d = match entry {
                LogEntry::Context { id, context } => {
                    known.insert(*id, context.clone());
                    reader.add_context(*id, context.clone());
                    continue;
                }
                LogEntry::Decision(d) => d,
            };
            seen += 1;
            if seen > skip {
                if let Some(prefix) = d.prompt.prefix {
                    if ends_in_window.insert((prefix.last, prefix.blocks)) {
                        match reader.prompt(&prefix) {
                            Some(hashes) => prompts.push(hashes.to_vec()),
                            None => tracing::warn!(
                                decision = %d.decision.id,
                                "the decision's prompt begins with {prefix}, no longer on the log: it will not replay"
                            ),
                        }
                    }
                }
                if let Some(end) = d.prompt.end() {
                    ends_in_window.insert(end);
                }
                contexts
                    .entry(d.context)
                    .or_insert_with(|| known.get(&d.context).cloned());
                decisions.push(d.clone());
            }
            // Its prompt, for the decisions after it.
            if let Err(e) = reader.decision(d) {
                tracing::debug!(error = %e, "a decision-log entry that does not read back");
            }
        }
        let contexts = contexts
            .into_iter()
            .filter_map(|(id, context)| {
                if context.is_none() {
                    tracing::warn!(context = %id, "a context the window's decisions name is no longer on the log: they will not replay");
                }
                context
            })
            .collect();
        Window {
            contexts,
            prompts,
            decisions,
        }
    }
}

fn time_from_ms(ms: u64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}
