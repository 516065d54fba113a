//! Metric names (the `metrics` facade; exported as Prometheus text by
//! [`crate::http`] when an HTTP address is configured).

use std::sync::OnceLock;

use metrics::{describe_counter, describe_gauge};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// KV batches JetStream acknowledged.
pub const KV_BATCHES_PUBLISHED: &str = "worker_agent_kv_batches_published_total";
/// Block events (stored or removed blocks) in acknowledged batches.
pub const KV_BLOCKS_PUBLISHED: &str = "worker_agent_kv_blocks_published_total";
/// Acknowledged batches JetStream had already stored (a retry after a lost ack).
pub const KV_BATCHES_DUPLICATE: &str = "worker_agent_kv_batches_duplicate_total";
/// Failed KV batch publishes (each is retried with the same message id).
pub const KV_PUBLISH_RETRIES: &str = "worker_agent_kv_publish_retries_total";
/// KV events held for publishing (queued or unacknowledged).
pub const KV_QUEUE_EVENTS: &str = "worker_agent_kv_queue_events";
/// KV queue overflows (each leads to a resync).
pub const KV_QUEUE_OVERFLOWS: &str = "worker_agent_kv_queue_overflows_total";
/// The current KV epoch.
pub const KV_EPOCH: &str = "worker_agent_kv_epoch";
/// New epochs started from the full block set, by `reason` (request, overflow).
pub const RESYNCS: &str = "worker_agent_resyncs_total";
/// Generation requests by `stage` and `outcome` (finished, failed,
/// interrupted, refused).
pub const GENERATE_REQUESTS: &str = "worker_agent_generate_requests_total";
/// Messages that are not valid requests, by `reason` (decode, no_reply).
pub const MALFORMED_REQUESTS: &str = "worker_agent_malformed_requests_total";
/// Load reports published.
pub const LOAD_REPORTS: &str = "worker_agent_load_reports_total";
/// Core NATS publishes that failed or were skipped (NATS down), by `kind`
/// (load, chunk, resync_reply).
pub const PUBLISH_ERRORS: &str = "worker_agent_publish_errors_total";

/// Registers the help texts with the installed recorder.
pub fn describe() {
    describe_counter!(KV_BATCHES_PUBLISHED, "KV batches JetStream acknowledged");
    describe_counter!(
        KV_BLOCKS_PUBLISHED,
        "Block events in acknowledged KV batches"
    );
    describe_counter!(
        KV_BATCHES_DUPLICATE,
        "Acknowledged KV batches JetStream had already stored"
    );
    describe_counter!(
        KV_PUBLISH_RETRIES,
        "Failed KV batch publishes, retried with the same message id"
    );
    describe_gauge!(KV_QUEUE_EVENTS, "KV events held for publishing");
    describe_counter!(
        KV_QUEUE_OVERFLOWS,
        "KV queue overflows, each followed by a resync"
    );
    describe_gauge!(KV_EPOCH, "The current KV epoch");
    describe_counter!(
        RESYNCS,
        "New epochs started from the full block set, by reason"
    );
    describe_counter!(
        GENERATE_REQUESTS,
        "Generation requests by stage and outcome"
    );
    describe_counter!(
        MALFORMED_REQUESTS,
        "Messages that are not valid requests, by reason"
    );
    describe_counter!(LOAD_REPORTS, "Load reports published");
    describe_counter!(
        PUBLISH_ERRORS,
        "Core NATS publishes that failed or were skipped, by kind"
    );
}

/// The process's Prometheus recorder, installed on first use. `None` when
/// another recorder was installed first.
pub fn prometheus() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            match metrics::set_global_recorder(recorder) {
                Ok(()) => {
                    describe();
                    Some(handle)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a metrics recorder is already installed; /metrics stays empty");
                    None
                }
            }
        })
        .as_ref()
}
