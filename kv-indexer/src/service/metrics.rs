//! The service's metrics, kept in a Prometheus recorder of its own (not the
//! process-wide one: several services can run in one test process).

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

use crate::index::IndexStats;
use crate::indexer::BatchStatus;

/// Handles to every metric of the service.
#[derive(Debug)]
pub struct Metrics {
    handle: PrometheusHandle,
    batches: [Counter; 6],
    pub block_events: Counter,
    pub malformed_messages: Counter,
    pub rejected_wrong_subject: Counter,
    pub rejected_future_epoch: Counter,
    pub epochs_reset: Counter,
    pub frozen_workers: Gauge,
    pub deltas_published: Counter,
    pub delta_seq: Gauge,
    pub delta_seq_published: Gauge,
    pub consumer_pending: Gauge,
    pub index_blocks: Gauge,
    pub index_pairs: Gauge,
    pub index_runs: Gauge,
    pub index_workers: Gauge,
    pub index_evicted_blocks: Gauge,
    pub snapshots_ok: Counter,
    pub snapshots_failed: Counter,
    pub snapshot_seconds: Histogram,
    pub snapshot_bytes: Gauge,
    pub snapshot_seq: Gauge,
    pub deltas_trimmed: Counter,
    pub recovery_replayed: Gauge,
    pub resync_requests: Counter,
    pub resync_rate_limited: Counter,
    pub resync_ok: Counter,
    pub resync_failed: Counter,
    pub resync_timeout: Counter,
    pub overlap_ok: Counter,
    pub overlap_malformed: Counter,
    pub workers_removed_lease: Counter,
    pub workers_removed_unregistered: Counter,
    pub workers_returned: Counter,
    pub registry_malformed: Counter,
    pub registry_errors: Counter,
    pub leader: Gauge,
    pub takeover_seconds: Gauge,
    pub delta_publish_retries: Counter,
    pub delta_publish_refused: Gauge,
    pub reannounced: Counter,
    pub live_applied: Counter,
    pub live_left_to_stream: Counter,
    pub kv_reannounce_requests: Counter,
    /// Why JetStream refuses the deltas being retried, while it does (the
    /// HTTP `/readyz` reads it).
    pub refused_because: std::sync::Mutex<Option<String>>,
}

const STATUSES: [&str; 6] = [
    "applied",
    "new_epoch",
    "duplicate",
    "gap",
    "awaiting_resync",
    "stale_epoch",
];

struct Reg {
    recorder: PrometheusRecorder,
}

impl Reg {
    fn metadata() -> Metadata<'static> {
        Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()))
    }

    fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
        let labels: Vec<Label> = labels.iter().map(|(k, v)| Label::new(*k, *v)).collect();
        Key::from_parts(name, labels)
    }

    fn counter(
        &self,
        name: &'static str,
        labels: &[(&'static str, &'static str)],
        help: &'static str,
    ) -> Counter {
        self.recorder.describe_counter(
            KeyName::from_const_str(name),
            None,
            SharedString::const_str(help),
        );
        self.recorder
            .register_counter(&Self::key(name, labels), &Self::metadata())
    }

    fn gauge(&self, name: &'static str, help: &'static str) -> Gauge {
        self.recorder.describe_gauge(
            KeyName::from_const_str(name),
            None,
            SharedString::const_str(help),
        );
        self.recorder
            .register_gauge(&Self::key(name, &[]), &Self::metadata())
    }

    fn histogram(&self, name: &'static str, help: &'static str) -> Histogram {
        self.recorder.describe_histogram(
            KeyName::from_const_str(name),
            None,
            SharedString::const_str(help),
        );
        self.recorder
            .register_histogram(&Self::key(name, &[]), &Self::metadata())
    }
}

impl Metrics {
    pub fn new() -> Self {
        let r = Reg {
            recorder: PrometheusBuilder::new()
                .set_buckets(&[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0])
                .expect("non-empty buckets")
                .build_recorder(),
        };
        let batches = STATUSES.map(|status| {
            r.counter(
                "kv_indexer_batches_total",
                &[("status", status)],
                "KV event batches by admission status (the stream's copy of a batch applied from its announcement counts as a duplicate)",
            )
        });
        let resync = |result| {
            r.counter(
                "kv_indexer_resync_replies_total",
                &[("result", result)],
                "Outcomes of resync requests",
            )
        };
        let overlap = |result| {
            r.counter(
                "kv_indexer_overlap_queries_total",
                &[("result", result)],
                "Overlap queries answered",
            )
        };
        let removed = |reason| {
            r.counter(
                "kv_indexer_workers_removed_total",
                &[("reason", reason)],
                "Workers removed from the index",
            )
        };
        let snapshots = |result| {
            r.counter(
                "kv_indexer_snapshots_total",
                &[("result", result)],
                "Snapshots stored (or failed)",
            )
        };
        Self {
            batches,
            block_events: r.counter(
                "kv_indexer_block_events_total",
                &[],
                "Block events (stored or removed blocks) of applied batches",
            ),
            malformed_messages: r.counter(
                "kv_indexer_malformed_messages_total",
                &[],
                "KV messages that could not be decoded (skipped)",
            ),
            deltas_published: r.counter(
                "kv_indexer_deltas_published_total",
                &[],
                "Deltas confirmed by the delta stream",
            ),
            delta_seq: r.gauge("kv_indexer_delta_seq", "Last delta produced"),
            delta_seq_published: r.gauge(
                "kv_indexer_delta_seq_published",
                "Last delta confirmed by the delta stream",
            ),
            consumer_pending: r.gauge(
                "kv_indexer_consumer_pending",
                "KV messages not yet delivered to the indexer (consumer lag)",
            ),
            index_blocks: r.gauge("kv_indexer_index_blocks", "Distinct blocks in the index"),
            index_pairs: r.gauge(
                "kv_indexer_index_pairs",
                "(block, worker) pairs in the index",
            ),
            index_runs: r.gauge("kv_indexer_index_runs", "Runs in the index"),
            index_workers: r.gauge("kv_indexer_index_workers", "Workers known to the index"),
            index_evicted_blocks: r.gauge(
                "kv_indexer_index_evicted_blocks",
                "Blocks evicted by the memory cap since start",
            ),
            snapshots_ok: snapshots("ok"),
            snapshots_failed: snapshots("error"),
            snapshot_seconds: r.histogram(
                "kv_indexer_snapshot_duration_seconds",
                "Time to take and store a snapshot",
            ),
            snapshot_bytes: r.gauge("kv_indexer_snapshot_bytes", "Size of the last snapshot"),
            snapshot_seq: r.gauge(
                "kv_indexer_snapshot_delta_seq",
                "Delta sequence covered by the last stored snapshot",
            ),
            deltas_trimmed: r.counter(
                "kv_indexer_deltas_trimmed_total",
                &[],
                "Deltas purged from the stream after a snapshot",
            ),
            recovery_replayed: r.gauge(
                "kv_indexer_recovery_replayed_deltas",
                "Deltas replayed after the snapshot at the last start",
            ),
            resync_requests: r.counter(
                "kv_indexer_resync_requests_total",
                &[],
                "Resync requests sent to worker agents",
            ),
            resync_rate_limited: r.counter(
                "kv_indexer_resync_rate_limited_total",
                &[],
                "Resync requests not sent: one was sent to the worker recently",
            ),
            resync_ok: resync("ok"),
            resync_failed: resync("error"),
            resync_timeout: resync("timeout"),
            overlap_ok: overlap("ok"),
            overlap_malformed: overlap("malformed"),
            workers_removed_lease: removed("lease_expired"),
            workers_removed_unregistered: removed("unregistered"),
            workers_returned: r.counter(
                "kv_indexer_workers_returned_total",
                &[],
                "Workers removed from the index that registered again (each asked to resync)",
            ),
            registry_malformed: r.counter(
                "kv_indexer_registry_malformed_total",
                &[],
                "Malformed worker records in etcd (skipped)",
            ),
            rejected_wrong_subject: r.counter(
                "kv_indexer_batches_rejected_total",
                &[("reason", "wrong_subject")],
                "KV batches refused before the index saw them (a worker's batch on another worker's subject; an epoch beyond --max-epoch-ahead)",
            ),
            rejected_future_epoch: r.counter(
                "kv_indexer_batches_rejected_total",
                &[("reason", "future_epoch")],
                "KV batches refused before the index saw them (a worker's batch on another worker's subject; an epoch beyond --max-epoch-ahead)",
            ),
            epochs_reset: r.counter(
                "kv_indexer_epochs_reset_total",
                &[],
                "Workers reset because the index held an epoch of theirs beyond --max-epoch-ahead",
            ),
            frozen_workers: r.gauge(
                "kv_indexer_frozen_workers",
                "Workers whose batches are dropped as stale since their last applied one (/status lists them)",
            ),
            registry_errors: r.counter(
                "kv_indexer_registry_errors_total",
                &[],
                "etcd list or watch failures (retried)",
            ),
            leader: r.gauge(
                "kv_indexer_leader",
                "1 while this indexer is the elected leader (it alone consumes KV events and publishes deltas), 0 as a standby",
            ),
            takeover_seconds: r.gauge(
                "kv_indexer_takeover_seconds",
                "Seconds from this indexer's election to consuming: recovering the latest snapshot and the delta log",
            ),
            delta_publish_retries: r.counter(
                "kv_indexer_delta_publish_retries_total",
                &[],
                "Delta publishes JetStream refused or did not confirm (a full store, no stream leader during an election, a timeout), sent again in place after a backoff",
            ),
            delta_publish_refused: r.gauge(
                "kv_indexer_delta_publish_refused",
                "1 while JetStream refuses this indexer's deltas and it retries them (not ready)",
            ),
            reannounced: r.counter(
                "kv_indexer_deltas_reannounced_total",
                &[],
                "Unconfirmed deltas announced again because a router asked (it missed announcements)",
            ),
            live_applied: r.counter(
                "kv_indexer_live_batches_total",
                &[("outcome", "applied")],
                "KV batches announced on core NATS: applied ahead of the stream (next in their worker's order), or left to the stream (not next: a gap, a new epoch, already applied)",
            ),
            live_left_to_stream: r.counter(
                "kv_indexer_live_batches_total",
                &[("outcome", "left_to_stream")],
                "KV batches announced on core NATS: applied ahead of the stream (next in their worker's order), or left to the stream (not next: a gap, a new epoch, already applied)",
            ),
            kv_reannounce_requests: r.counter(
                "kv_indexer_kv_reannounce_requests_total",
                &[],
                "Requests to the agents to announce their recent KV batches again, after a gap in a worker's announced batches (at most every 250 ms)",
            ),
            refused_because: std::sync::Mutex::new(None),
            handle: r.recorder.handle(),
        }
    }

    /// JetStream refuses the deltas (`Some(why)`), or takes them again.
    pub fn set_refused(&self, why: Option<String>) {
        self.delta_publish_refused
            .set(if why.is_some() { 1.0 } else { 0.0 });
        *self.refused_because.lock().expect("no panic while held") = why;
    }

    /// The counter of batches with this status.
    pub fn batches(&self, status: &BatchStatus) -> &Counter {
        let i = STATUSES
            .iter()
            .position(|s| *s == status.label())
            .unwrap_or(0);
        &self.batches[i]
    }

    pub fn set_index(&self, stats: IndexStats, workers: usize) {
        self.index_blocks.set(stats.blocks as f64);
        self.index_pairs.set(stats.pairs as f64);
        self.index_runs.set(stats.runs as f64);
        self.index_workers.set(workers as f64);
        self.index_evicted_blocks.set(stats.evicted_blocks as f64);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        self.handle.render()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_has_its_counter() {
        let m = Metrics::new();
        m.batches(&BatchStatus::Gap {
            expected: 1,
            got: 3,
        })
        .increment(2);
        m.batches(&BatchStatus::Applied).increment(1);
        let text = m.render();
        assert!(
            text.contains("kv_indexer_batches_total{status=\"gap\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("kv_indexer_batches_total{status=\"applied\"} 1"),
            "{text}"
        );
        assert!(text.contains("# HELP kv_indexer_batches_total"), "{text}");
    }
}
