//! The router's Prometheus metrics.
//!
//! Each replica owns its recorder (no process-global state: tests run
//! several replicas in one process); `GET /metrics` renders it. Names:
//!
//! | metric | kind | labels |
//! | --- | --- | --- |
//! | `router_decisions_total` | counter | `path`, `rule` |
//! | `router_bypass_share` | gauge | (share of bypass decisions since start) |
//! | `router_overlap_tokens` | histogram | `side` (`decode`, `prefill`) |
//! | `router_decision_seconds` | histogram | (time in the core's `route`) |
//! | `router_route_seconds` | histogram | (handler: parse, hash, loop round trip) |
//! | `router_route_errors_total` | counter | `reason` |
//! | `router_dispatch_total` | counter | `outcome` |
//! | `router_http_requests_total` | counter | `route`, `status` |
//! | `router_workers_registered` | gauge | |
//! | `router_sessions_bound` | gauge | (live session bindings) |
//! | `router_workers_refused_total` | counter | `reason` (contract mismatch label) |
//! | `router_workers_malformed_total` | counter | |
//! | `router_index_applied_seq` | gauge | (last delta applied) |
//! | `router_index_head_seq` | gauge | (last delta in the stream, polled) |
//! | `router_index_delta_seq_lag` | gauge | (head - applied) |
//! | `router_index_reloads_total` | counter | `reason` |
//! | `router_deltas_total` | counter | `outcome`: read from the delta stream (`applied`; `confirmed`: the same as the announced delta applied before it; `duplicate`, `gap`, `error`, `stalled`: the feed stood still behind the stream's head and was opened again; `superseded`: an announced delta applied before differs from the stream's, and the index is loaded again) or announced by the indexer ahead of the stream (`live_applied`, `live_early`: held for the ones before it, `live_duplicate`, `live_skipped`: left to the stream, `live_error`) |
//! | `router_decision_log_lag_seconds` | histogram | (a peer's decision: JetStream publication to application) |
//! | `router_peer_messages_total` | counter | `kind`, `outcome` |
//! | `router_ledger_in_flight` | gauge | |
//! | `router_ledger_expired_total` | counter | |
//! | `router_peers` | gauge | (peer replicas heard of, alive) |
//! | `router_peer_released_total` | counter | `why` (`left`, `silent`): peers' reservations released when the peer stopped or fell silent |
//! | `router_worker_probes_total` | counter | `outcome` (`alive`, `gone`, `not_held`: the agent does not generate the leg, two in a row fail it as lost, `unsupported`: no responders from an agent never seen answering, `no_answer`): liveness probes of a quiet leg's worker |
//! | `router_admission_queued` | gauge | (requests waiting while every decode worker is busy) |
//! | `router_admission_total` | counter | `outcome` (`admitted`, `queued`, `rejected`: queue full, `timed_out`: waited `max_wait`) |
//! | `router_breaker_transitions_total` | counter | `to` (`open`, `half_open`, `closed`) |
//! | `router_breaker_open` | gauge | (workers out of rotation: breaker open, or half-open with its trial on its way) |
//! | `router_jetstream_store_full` | gauge | (1 while JetStream's store refuses the decision log for want of room) |
//! | `router_calibration_factor` | gauge | `factor` (`local_ttft`, `remote_ttft`, `itl`: the SLA policy's observed / predicted) |
//! | `router_tokenizations_total` | counter | `outcome` (`exact`, `prefix`, `miss`: the tokenization cache) |
//! | `router_tokens_total` | counter | `source` (`cache`, `tokenizer`: text prompts' tokens) |
//! | `router_tokenizer_cache_bytes` | gauge | (the tokenization cache's size) |

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, Label, Recorder};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};
use protocol::{Path, RouteDecision};

use super::token_cache::Encoded;

const LATENCY_BUCKETS: &[f64] = &[
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
    500e-3, 1.0, 2.5, 5.0, 10.0,
];
const TOKEN_BUCKETS: &[f64] = &[
    0.0, 16.0, 64.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0,
    131072.0,
];
const LAG_BUCKETS: &[f64] = &[
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Every metric family and its `# HELP` text (`promtool check metrics`
/// wants one for each).
const FAMILIES: &[(&str, &str)] = &[
    (
        "router_decisions_total",
        "Routing decisions (dispatched or dry runs) by path and rule",
    ),
    (
        "router_bypass_share",
        "Share of bypass decisions since the replica started",
    ),
    (
        "router_overlap_tokens",
        "Prompt tokens the chosen worker already held, per decision",
    ),
    (
        "router_decision_seconds",
        "Time the core took to decide (in the event loop)",
    ),
    (
        "router_route_seconds",
        "Time from the parsed request to the decision (hashing, queueing, deciding)",
    ),
    (
        "router_route_errors_total",
        "Requests no decision could be made for, by reason",
    ),
    ("router_dispatch_total", "Dispatched requests by outcome"),
    (
        "router_http_requests_total",
        "HTTP responses by route and status",
    ),
    (
        "router_workers_registered",
        "Workers registered with this replica",
    ),
    (
        "router_sessions_bound",
        "Sessions bound to a decode worker on this replica (session affinity)",
    ),
    (
        "router_workers_refused_total",
        "Worker registrations refused, by hashing-contract mismatch",
    ),
    (
        "router_workers_malformed_total",
        "Malformed worker records in the registry, ignored",
    ),
    ("router_index_applied_seq", "The last index delta applied"),
    (
        "router_index_head_seq",
        "The last index delta in the stream (polled every tick)",
    ),
    (
        "router_index_delta_seq_lag",
        "Index deltas published but not applied yet (head polled every tick)",
    ),
    (
        "router_index_reloads_total",
        "Index reloads from a snapshot, by reason",
    ),
    ("router_deltas_total", "Index deltas received, by outcome"),
    (
        "router_decision_log_lag_seconds",
        "Time from a peer decision's publication to its application here",
    ),
    (
        "router_peer_messages_total",
        "Messages from peers and workers (load reports, progress, decisions) by kind and outcome",
    ),
    (
        "router_ledger_in_flight",
        "Decisions in this replica's in-flight ledger",
    ),
    (
        "router_ledger_expired_total",
        "Ledger entries dropped at their time-to-live without a finish notice",
    ),
    (
        "router_peers",
        "Peer router replicas heard of and alive (heartbeats)",
    ),
    (
        "router_peer_released_total",
        "Ledger reservations of peer replicas released because the peer left or fell silent, by why",
    ),
    (
        "router_worker_probes_total",
        "Liveness probes of the worker of a quiet leg, by outcome (gone: no agent listens any more, the leg failed at once; not_held: the agent does not generate the leg, lost on the bus)",
    ),
    (
        "router_admission_queued",
        "Requests waiting in the admission queue while every decode worker is busy",
    ),
    (
        "router_admission_total",
        "Requests at the door by outcome: admitted at once, queued, rejected (queue full: 429), timed_out (waited max_wait in the queue: 429)",
    ),
    (
        "router_breaker_transitions_total",
        "Circuit breaker changes by the state entered: open (out of rotation), half_open (a trial may go), closed (back)",
    ),
    (
        "router_breaker_open",
        "Workers the circuit breaker keeps out of rotation",
    ),
    (
        "router_jetstream_store_full",
        "1 while JetStream's store refuses this replica's decision log for want of room (not ready meanwhile, until a write is accepted or none is refused for 2 s)",
    ),
    (
        "router_calibration_factor",
        "The SLA policy's calibration factors (observed / predicted) by factor: local_ttft, remote_ttft, itl",
    ),
    (
        "router_tokenizations_total",
        "Text and chat prompts tokenized, by the tokenization cache's outcome: exact (all cached), prefix (a cached prefix and the rest tokenized), miss",
    ),
    (
        "router_tokens_total",
        "Tokens of text and chat prompts, by source: cache (a conversation's earlier prefix) or tokenizer",
    ),
    (
        "router_tokenizer_cache_bytes",
        "Bytes the tokenization cache holds (text, ids and offsets of recent prompts)",
    ),
];

/// Counters at zero from the start, for each documented label value (so
/// that a rate or an alert has a series before the first occurrence).
const ZEROED: &[(&str, &str, &[&str])] = &[
    (
        "router_tokenizations_total",
        "outcome",
        &["exact", "prefix", "miss"],
    ),
    ("router_tokens_total", "source", &["cache", "tokenizer"]),
    (
        "router_dispatch_total",
        "outcome",
        &[
            "ok",
            "retried",
            "resumed",
            "client_gone",
            "decision_log_dropped",
            "decision_log_error",
            "no_responders",
            "worker_gone",
            "first_chunk_timeout",
            "idle_timeout",
            "worker_failed",
            "missing_chunk",
            "malformed_chunk",
            "protocol_error",
            "nats_error",
            "rejected",
            "too_large",
        ],
    ),
    (
        "router_route_errors_total",
        "reason",
        &[
            "no_decode_worker",
            "no_other_decode_worker",
            "empty_prompt",
            "prompt_too_long",
            "internal",
            "stopping",
            "overloaded",
            "saturated",
            "queue_timeout",
        ],
    ),
    (
        "router_deltas_total",
        "outcome",
        &[
            "applied",
            "confirmed",
            "duplicate",
            "gap",
            "error",
            "stalled",
            "superseded",
            "live_applied",
            "live_early",
            "live_duplicate",
            "live_skipped",
            "live_error",
        ],
    ),
    ("router_peer_released_total", "why", &["left", "silent"]),
    (
        "router_breaker_transitions_total",
        "to",
        &["open", "half_open", "closed"],
    ),
    (
        "router_admission_total",
        "outcome",
        &["admitted", "queued", "rejected", "timed_out"],
    ),
    (
        "router_worker_probes_total",
        "outcome",
        &["alive", "gone", "unsupported", "no_answer"],
    ),
];

static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// One replica's metrics; cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

struct Inner {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    decisions: AtomicU64,
    bypasses: AtomicU64,
    bypass_share: Gauge,
    overlap_decode: Histogram,
    overlap_prefill: Histogram,
    decision_seconds: Histogram,
    route_seconds: Histogram,
    decision_log_lag: Histogram,
    workers_registered: Gauge,
    sessions_bound: Gauge,
    workers_malformed: Counter,
    applied_seq: Gauge,
    head_seq: Gauge,
    seq_lag: Gauge,
    in_flight: Gauge,
    peers: Gauge,
    admission_queued: Gauge,
    breakers_open: Gauge,
    store_full: Gauge,
    tokenizer_cache_bytes: Gauge,
    calibration: [Gauge; 3],
    expired: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let builder = PrometheusBuilder::new();
        let builder = [
            ("router_decision_seconds", LATENCY_BUCKETS),
            ("router_route_seconds", LATENCY_BUCKETS),
            ("router_overlap_tokens", TOKEN_BUCKETS),
            ("router_decision_log_lag_seconds", LAG_BUCKETS),
        ]
        .into_iter()
        .fold(builder, |b, (name, buckets)| {
            b.set_buckets_for_metric(Matcher::Full(name.into()), buckets)
                .expect("non-empty buckets")
        });
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        for (name, help) in FAMILIES {
            // One description per name, whatever the metric's kind.
            recorder.describe_counter((*name).into(), None, (*help).into());
        }
        // The documented counters exist from the start, at zero.
        for (name, label, values) in ZEROED {
            for value in *values {
                recorder
                    .register_counter(
                        &Key::from_parts(*name, vec![Label::new(*label, *value)]),
                        &METADATA,
                    )
                    .absolute(0);
            }
        }
        let histogram = |name: &'static str, labels: Vec<Label>| {
            recorder.register_histogram(&Key::from_parts(name, labels), &METADATA)
        };
        let gauge = |name: &'static str| recorder.register_gauge(&Key::from_name(name), &METADATA);
        let inner = Inner {
            decisions: AtomicU64::new(0),
            bypasses: AtomicU64::new(0),
            bypass_share: gauge("router_bypass_share"),
            overlap_decode: histogram("router_overlap_tokens", vec![Label::new("side", "decode")]),
            overlap_prefill: histogram(
                "router_overlap_tokens",
                vec![Label::new("side", "prefill")],
            ),
            decision_seconds: histogram("router_decision_seconds", vec![]),
            route_seconds: histogram("router_route_seconds", vec![]),
            decision_log_lag: histogram("router_decision_log_lag_seconds", vec![]),
            workers_registered: gauge("router_workers_registered"),
            sessions_bound: gauge("router_sessions_bound"),
            workers_malformed: recorder
                .register_counter(&Key::from_name("router_workers_malformed_total"), &METADATA),
            applied_seq: gauge("router_index_applied_seq"),
            head_seq: gauge("router_index_head_seq"),
            seq_lag: gauge("router_index_delta_seq_lag"),
            in_flight: gauge("router_ledger_in_flight"),
            peers: gauge("router_peers"),
            admission_queued: gauge("router_admission_queued"),
            breakers_open: gauge("router_breaker_open"),
            store_full: gauge("router_jetstream_store_full"),
            tokenizer_cache_bytes: gauge("router_tokenizer_cache_bytes"),
            calibration: crate::core::Factors::NAMES.map(|name| {
                recorder.register_gauge(
                    &Key::from_parts(
                        "router_calibration_factor",
                        vec![Label::new("factor", name)],
                    ),
                    &METADATA,
                )
            }),
            expired: recorder
                .register_counter(&Key::from_name("router_ledger_expired_total"), &METADATA),
            recorder,
            handle,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        self.inner.handle.render()
    }

    /// Folds histogram samples; call periodically.
    pub fn upkeep(&self) {
        self.inner.handle.run_upkeep();
    }

    /// Runs [`Metrics::upkeep`] every `period`, forever. A task of its own,
    /// often: at 5k requests/s a second's samples take milliseconds to fold,
    /// which the event loop (and every decision waiting on it) should not
    /// spend.
    pub async fn upkeep_every(self, period: Duration) {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.upkeep();
        }
    }

    fn counter(&self, name: &'static str, labels: Vec<Label>) -> Counter {
        self.inner
            .recorder
            .register_counter(&Key::from_parts(name, labels), &METADATA)
    }

    /// A decision the core made.
    pub fn decision(&self, decision: &RouteDecision, took: Duration) {
        let i = &self.inner;
        i.decision_seconds.record(took.as_secs_f64());
        self.counter(
            "router_decisions_total",
            vec![
                Label::new("path", decision.path.as_str()),
                Label::new("rule", decision.rule.clone()),
            ],
        )
        .increment(1);
        let total = i.decisions.fetch_add(1, Ordering::Relaxed) + 1;
        let bypasses = i
            .bypasses
            .fetch_add(u64::from(decision.path == Path::Bypass), Ordering::Relaxed)
            + u64::from(decision.path == Path::Bypass);
        i.bypass_share.set(bypasses as f64 / total as f64);
        i.overlap_decode
            .record(f64::from(decision.decode_overlap_tokens));
        if decision.path.is_remote() {
            i.overlap_prefill
                .record(f64::from(decision.prefill_overlap_tokens));
        }
    }

    /// The handler's view of a decision's latency.
    pub fn route_latency(&self, took: Duration) {
        self.inner.route_seconds.record(took.as_secs_f64());
    }

    /// A text or chat prompt tokenized (through the cache, whose size is
    /// `cache_bytes`).
    pub fn tokenized(&self, encoded: &Encoded, cache_bytes: usize) {
        self.counter(
            "router_tokenizations_total",
            vec![Label::new("outcome", encoded.outcome.as_str())],
        )
        .increment(1);
        let reused = encoded.reused.min(encoded.ids.len());
        let source = |s| vec![Label::new("source", s)];
        self.counter("router_tokens_total", source("cache"))
            .increment(reused as u64);
        self.counter("router_tokens_total", source("tokenizer"))
            .increment((encoded.ids.len() - reused) as u64);
        self.inner.tokenizer_cache_bytes.set(cache_bytes as f64);
    }

    /// A request that could not be routed.
    pub fn route_error(&self, reason: &'static str) {
        self.counter(
            "router_route_errors_total",
            vec![Label::new("reason", reason)],
        )
        .increment(1);
    }

    /// A dispatch ended (or was retried).
    pub fn dispatch(&self, outcome: &'static str) {
        self.dispatch_by(outcome, 1);
    }

    /// [`Metrics::dispatch`], `n` at once.
    pub fn dispatch_by(&self, outcome: &'static str, n: u64) {
        self.counter(
            "router_dispatch_total",
            vec![Label::new("outcome", outcome)],
        )
        .increment(n);
    }

    /// An HTTP response.
    pub fn http(&self, route: &str, status: u16) {
        self.counter(
            "router_http_requests_total",
            vec![
                Label::new("route", route.to_owned()),
                Label::new("status", status.to_string()),
            ],
        )
        .increment(1);
    }

    pub fn worker_refused(&self, reason: &'static str) {
        self.counter(
            "router_workers_refused_total",
            vec![Label::new("reason", reason)],
        )
        .increment(1);
    }

    pub fn worker_malformed(&self) {
        self.inner.workers_malformed.increment(1);
    }

    pub fn workers_registered(&self, n: usize) {
        self.inner.workers_registered.set(n as f64);
    }

    pub fn sessions_bound(&self, n: usize) {
        self.inner.sessions_bound.set(n as f64);
    }

    pub fn delta(&self, outcome: &'static str) {
        self.counter("router_deltas_total", vec![Label::new("outcome", outcome)])
            .increment(1);
    }

    /// Where the replica stands in the delta stream.
    pub fn index_position(&self, applied: u64, head: u64) {
        let i = &self.inner;
        i.applied_seq.set(applied as f64);
        i.head_seq.set(head as f64);
        i.seq_lag.set(head.saturating_sub(applied) as f64);
    }

    pub fn index_reload(&self, reason: &'static str) {
        self.counter(
            "router_index_reloads_total",
            vec![Label::new("reason", reason)],
        )
        .increment(1);
    }

    /// A message from a peer or a worker (load report, progress, decision).
    pub fn peer_message(&self, kind: &'static str, outcome: &'static str) {
        self.counter(
            "router_peer_messages_total",
            vec![Label::new("kind", kind), Label::new("outcome", outcome)],
        )
        .increment(1);
    }

    pub fn decision_log_lag(&self, lag: Duration) {
        self.inner.decision_log_lag.record(lag.as_secs_f64());
    }

    /// The SLA policy's calibration factors (1 until observed).
    pub fn calibration(&self, factors: &crate::core::Factors) {
        for (gauge, (_, value)) in self.inner.calibration.iter().zip(factors.named()) {
            gauge.set(value);
        }
    }

    /// Peer replicas alive.
    pub fn peers(&self, n: usize) {
        self.inner.peers.set(n as f64);
    }

    /// Reservations of a peer released (`why`: `left`, `silent`).
    pub fn peer_released(&self, why: &'static str, n: usize) {
        self.counter("router_peer_released_total", vec![Label::new("why", why)])
            .increment(n as u64);
    }

    /// A request at the door (`admitted`, `queued`, `rejected`,
    /// `timed_out`), and the queue's length after it.
    pub fn admission(&self, outcome: &'static str, queued: usize) {
        self.counter(
            "router_admission_total",
            vec![Label::new("outcome", outcome)],
        )
        .increment(1);
        self.inner.admission_queued.set(queued as f64);
    }

    pub fn admission_queued(&self, queued: usize) {
        self.inner.admission_queued.set(queued as f64);
    }

    /// A circuit breaker changed (`to`: `open`, `half_open`, `closed`).
    pub fn breaker(&self, to: &'static str) {
        self.counter(
            "router_breaker_transitions_total",
            vec![Label::new("to", to)],
        )
        .increment(1);
    }

    pub fn store_full(&self, full: bool) {
        self.inner.store_full.set(if full { 1.0 } else { 0.0 });
    }

    pub fn breakers_open(&self, n: usize) {
        self.inner.breakers_open.set(n as f64);
    }

    /// A liveness probe of a quiet leg's worker.
    pub fn worker_probe(&self, outcome: &'static str) {
        self.counter(
            "router_worker_probes_total",
            vec![Label::new("outcome", outcome)],
        )
        .increment(1);
    }

    pub fn ledger(&self, in_flight: usize, expired: usize) {
        self.inner.in_flight.set(in_flight as f64);
        self.inner.expired.increment(expired as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_what_was_recorded() {
        let m = Metrics::new();
        m.worker_refused("block_size");
        m.http("/v1/route", 200);
        m.route_latency(Duration::from_micros(300));
        m.calibration(&crate::core::Factors {
            itl: 1.5,
            ..Default::default()
        });
        m.upkeep();
        let text = m.render();
        assert!(
            text.contains("router_workers_refused_total{reason=\"block_size\"} 1"),
            "{text}"
        );
        assert!(text.contains("router_http_requests_total{route=\"/v1/route\",status=\"200\"} 1"));
        assert!(text.contains("router_route_seconds_bucket"), "{text}");
        assert!(
            text.contains("router_calibration_factor{factor=\"itl\"} 1.5"),
            "{text}"
        );
        // Two recorders do not share anything.
        assert!(!Metrics::new().render().contains("block_size"));
    }

    /// Every family rendered has its HELP, and a new replica already
    /// shows the documented counters at zero; `promtool check metrics`
    /// (when installed) finds nothing to say.
    #[test]
    fn every_family_has_help_and_the_counters_start_at_zero() {
        let m = Metrics::new();
        m.decision_log_lag(Duration::from_millis(3));
        m.route_error("overloaded");
        m.index_reload("gap");
        m.peer_message("load", "applied");
        m.http("/v1/completions", 200);
        m.worker_refused("block_size");
        m.worker_malformed();
        m.ledger(1, 0);
        m.peers(1);
        m.upkeep();
        let text = m.render();
        for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let family = line.split(' ').next().unwrap();
            assert!(
                text.contains(&format!("# HELP {family} ")),
                "{family} has no HELP:\n{text}"
            );
            assert!(
                FAMILIES.iter().any(|(name, _)| *name == family),
                "{family} is not in FAMILIES"
            );
        }
        let fresh = Metrics::new().render();
        for (name, label, values) in ZEROED {
            for value in *values {
                let series = format!("{name}{{{label}=\"{value}\"}} 0");
                assert!(fresh.contains(&series), "no {series}:\n{fresh}");
            }
        }
        ::tests::promtool::check_metrics(&text, &[]).unwrap();
    }
}
