//! Metric names (the `metrics` facade; exported as Prometheus text by
//! [`crate::http`] when an HTTP address is configured).

use std::sync::OnceLock;

use metrics::{describe_counter, describe_gauge};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// KV batches JetStream acknowledged.
pub const KV_BATCHES_PUBLISHED: &str = "worker_agent_kv_batches_published_total";
/// KV batches announced on core NATS as they were formed.
pub const KV_BATCHES_ANNOUNCED: &str = "worker_agent_kv_batches_announced_total";
/// The seq of the last KV batch formed (and announced), in the epoch
/// `worker_agent_kv_epoch`: the indexer's cursor for this worker reaches
/// it once the batch is applied.
pub const KV_BATCH_SEQ: &str = "worker_agent_kv_batch_seq";
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

/// 1 while JetStream refuses KV batches for want of room in its store.
pub const STORE_FULL: &str = "worker_agent_jetstream_store_full";

/// KV batch publishes JetStream refused for want of room in its store.
pub const STORE_FULL_ERRORS: &str = "worker_agent_kv_store_full_errors_total";
/// New epochs started from the full block set, by `reason` (request, overflow).
pub const RESYNCS: &str = "worker_agent_resyncs_total";
/// Generation requests by `stage` and `outcome` (finished, failed, rejected,
/// interrupted, refused).
pub const GENERATE_REQUESTS: &str = "worker_agent_generate_requests_total";
/// Messages that are not valid requests, by `reason` (decode, no_reply,
/// cancel).
pub const MALFORMED_REQUESTS: &str = "worker_agent_malformed_requests_total";
/// Cancel requests from routers, by `outcome` (`cancelled`, `already_ended`).
pub const CANCELS: &str = "worker_agent_cancels_total";
/// Load reports published.
pub const LOAD_REPORTS: &str = "worker_agent_load_reports_total";
/// Core NATS publishes that failed or were skipped (NATS down), by `kind`
/// (load, chunk, resync_reply).
pub const PUBLISH_ERRORS: &str = "worker_agent_publish_errors_total";

/// Workers refused because the engine names blocks differently from the
/// deployment, by `reason` (model, block_size, ...).
pub const CONTRACT_REFUSALS: &str = "worker_agent_contract_refusals_total";
/// The real engine's KV event stream, by `what` (batches, gaps,
/// gaps_recovered, gaps_unrecovered, restarts, replays, replay_failures,
/// rebuilds, unknown_parents, unknown_removed, duplicates, resyncs, ...).
pub const ENGINE_KV: &str = "worker_agent_engine_kv_total";
/// Real-engine input skipped, by `reason` (bad_frames, other_topic,
/// msgpack, unknown_event, field, bad_chunk, ...).
pub const ENGINE_KV_SKIPPED: &str = "worker_agent_engine_skipped_total";
/// New epochs the real engine's stream started, by `reason`
/// (engine_restart, lost_gap, rebuild).
pub const ENGINE_KV_NEW_EPOCHS: &str = "worker_agent_engine_new_epochs_total";
/// Failed scrapes of the real engine's `/metrics`, by `reason`.
pub const ENGINE_SCRAPE_ERRORS: &str = "worker_agent_engine_scrape_errors_total";
/// Decode requests without the prefill engine's `kv_transfer_params`
/// (served as local prefills).
pub const ENGINE_DECODE_WITHOUT_PARAMS: &str = "worker_agent_engine_decode_without_params_total";
/// Prefill legs of the third path (a prefix to pull from a decode worker)
/// by outcome: `pulled` (sent with the source's handle), `no_handle` (the
/// source's agent gave none: prefilled whole) or `plain`
/// (`--vllm-bidirectional-kv` off: prefilled whole).
pub const ENGINE_PREFIX_FETCHES: &str = "worker_agent_engine_prefix_fetches_total";
/// KV-handle queries this agent answered by having its engine export the
/// prefix, by outcome (`given`; `disabled`: `--vllm-bidirectional-kv`
/// off or an engine that exports nothing; `busy`: too many exports under
/// way; `timeout`: the export abandoned, too late for the asker;
/// `unheld`: the engine holds none of the prefix any more, by its KV
/// events; `empty`, `failed`, `unreadable`, `too_large`, `malformed`;
/// `unanswered`: the answer could not be sent).
pub const KV_HANDLE_QUERIES: &str = "worker_agent_kv_handle_queries_total";
/// Prompt tokens the engine computed for the exports it was asked for
/// (the prefix's last block, which vLLM always recomputes, and any block
/// it no longer held).
pub const KV_EXPORT_RECOMPUTED_TOKENS: &str = "worker_agent_kv_export_recomputed_tokens_total";
/// This agent's queries for the handle of a pulling prefill's source, by
/// outcome (`given`, `none`, `timeout`, `failed`, `malformed`; `empty`:
/// no whole block to ask for, not sent).
pub const KV_HANDLE_ASKS: &str = "worker_agent_kv_handle_asks_total";
/// Streamed chunks with text but no token ids (an engine that ignores
/// `return_token_ids`).
pub const ENGINE_TEXT_ONLY_CHUNKS: &str = "worker_agent_engine_text_only_chunks_total";

/// Registers the help texts with the installed recorder.
pub fn describe() {
    describe_counter!(KV_BATCHES_PUBLISHED, "KV batches JetStream acknowledged");
    describe_gauge!(
        KV_BATCH_SEQ,
        "Seq of the last KV batch formed and announced, in the current epoch (worker_agent_kv_epoch)"
    );
    describe_counter!(
        KV_BATCHES_ANNOUNCED,
        "KV batches announced on core NATS as they were formed (ahead of JetStream)"
    );
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
    describe_gauge!(
        STORE_FULL,
        "1 while JetStream refuses KV batches for want of room in its store, or does not confirm them (held and retried)"
    );
    describe_counter!(
        STORE_FULL_ERRORS,
        "KV batch publishes refused for want of room in JetStream's store, or not confirmed"
    );
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
    describe_counter!(
        CONTRACT_REFUSALS,
        "Engines refused for naming blocks differently from the deployment, by reason"
    );
    describe_counter!(
        ENGINE_KV,
        "The real engine's KV event stream, by what happened"
    );
    describe_counter!(ENGINE_KV_SKIPPED, "Real-engine input skipped, by reason");
    describe_counter!(
        ENGINE_KV_NEW_EPOCHS,
        "New epochs started by the real engine's stream, by reason"
    );
    describe_counter!(
        ENGINE_SCRAPE_ERRORS,
        "Failed scrapes of the real engine's metrics, by reason"
    );
    describe_counter!(
        ENGINE_DECODE_WITHOUT_PARAMS,
        "Decode requests without kv_transfer_params, served as local prefills"
    );
    describe_counter!(
        ENGINE_PREFIX_FETCHES,
        "Prefill legs that fetch their prefix from a decode worker, by outcome (pulled, no_handle, plain)"
    );
    describe_counter!(
        KV_HANDLE_QUERIES,
        "Queries for an export of this engine's blocks of a prefix (from a prefill worker's agent), by outcome (given, disabled, busy, timeout, unheld, empty, failed, unreadable, too_large, malformed, unanswered)"
    );
    describe_counter!(
        KV_EXPORT_RECOMPUTED_TOKENS,
        "Prompt tokens the engine computed for the exports it was asked for"
    );
    describe_counter!(
        KV_HANDLE_ASKS,
        "Queries for the handle of a pulling prefill's source, by outcome (given, none, timeout, failed, malformed, empty)"
    );
    describe_counter!(
        ENGINE_TEXT_ONLY_CHUNKS,
        "Streamed chunks with text but no token ids"
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
