//! The router's settings: the raw arguments ([`Args`]: flags,
//! `SWITCHYARD_*` variables, a TOML file) layered into a validated
//! [`Config`] (see the `settings` crate).
//!
//! Every setting has one key, one flag and one variable: `[decode]
//! overlap_credit`, `--decode-overlap-credit`,
//! `SWITCHYARD_DECODE_OVERLAP_CREDIT`. The file's sections are the core's
//! own config structs (`[decode]` is [`DecodeSelection`], `[gate]`
//! [`GateConfig`], `[ledger]` [`LedgerConfig`], `[fetch]` [`FetchConfig`], `[policy]` the policy with
//! its parameters from the registry); defaults are their `Default`s, and
//! `--help` shows them. A flag beats the variable, which beats the file,
//! which beats the default. Unknown keys and invalid values are refused at
//! start with the key's name; spellings of the previous release are
//! accepted and reported for the log.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use protocol::HashingContract;
use serde::{Deserialize, Serialize};
use settings::{Deprecation, Flag, Kind, Legacy, SettingsError};

use crate::core::{
    AdmissionConfig, BreakerConfig, DecodeSelection, FetchConfig, GateConfig, LedgerConfig,
    PeerConfig, Policy, PolicySpec, PrefillSelection, RouterConfig, SessionConfig, TierWeights,
    POLICIES,
};

pub use settings::Args;

/// Why the settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Settings(#[from] SettingsError),
    #[error("model is required: set --model, SWITCHYARD_MODEL or `model` in the config file")]
    NoModel,
    #[error("{key} = {value}: {expected}")]
    Invalid {
        key: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error(transparent)]
    Core(#[from] crate::core::ConfigError),
}

/// Retries of a dispatch that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Retry {
    /// Further attempts, each on a new decision avoiding every worker that
    /// failed the request. Default 2.
    pub attempts: u32,
    /// Wait before the first retry, doubled before each next one.
    /// Default 50 ms.
    #[serde(with = "settings::duration")]
    pub backoff: Duration,
    /// A stream whose worker died (or lost it, or stalled) after some
    /// tokens goes on elsewhere: the tokens already sent are appended to
    /// the prompt and the rest is generated on a new decision (see
    /// `dispatch::resumable`). Default on.
    pub resume: bool,
}

impl Default for Retry {
    fn default() -> Self {
        Self {
            attempts: 2,
            backoff: Duration::from_millis(50),
            resume: true,
        }
    }
}

/// Dispatch and service timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Timeouts {
    /// Longest wait for a worker's first chunk of a leg. Default 30 s.
    #[serde(with = "settings::duration")]
    pub first_chunk: Duration,
    /// Longest wait between two chunks. Default 30 s.
    #[serde(with = "settings::duration")]
    pub idle: Duration,
    /// Longest wait for the event loop's answer to a route request.
    /// Default 2 s.
    #[serde(with = "settings::duration")]
    pub route: Duration,
    /// A leg quiet this long has its worker probed (and is failed at once
    /// when no agent listens any more); also the probe's own wait.
    /// Default 1 s.
    #[serde(with = "settings::duration")]
    pub probe: Duration,
    /// Grace for in-flight HTTP requests at shutdown. Default 10 s.
    #[serde(with = "settings::duration")]
    pub drain: Duration,
    /// At shutdown, how long the replica goes on serving while `/readyz`
    /// says "draining", before it stops accepting: the time a load
    /// balancer needs to see it and send elsewhere. Default 0 (stop
    /// accepting at once).
    #[serde(with = "settings::duration")]
    pub drain_notice: Duration,
    /// Period of ledger expiry, gauges and delta-head polling. Default 1 s.
    #[serde(with = "settings::duration")]
    pub tick: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            first_chunk: Duration::from_secs(30),
            idle: Duration::from_secs(30),
            route: Duration::from_secs(2),
            probe: Duration::from_secs(1),
            drain: Duration::from_secs(10),
            drain_notice: Duration::ZERO,
            tick: Duration::from_secs(1),
        }
    }
}

/// The configuration of a router replica: deserialized from the layered
/// settings, then [`Config::validate`]d.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// NATS servers, comma separated (the servers of one cluster).
    pub nats_url: String,
    pub etcd_endpoints: Vec<String>,
    /// Copies JetStream keeps of the streams this replica creates when
    /// they are missing (the kv-indexer sets it on existing ones).
    pub stream_replicas: usize,
    /// NATS credentials and TLS (`[nats]`).
    pub nats: bus::NatsAuth,
    /// etcd credentials and TLS (`[etcd]`).
    pub etcd: bus::EtcdAuth,
    /// Where `main` binds the HTTP listener (`run` takes the listener).
    pub http_addr: SocketAddr,
    /// API keys and the admin token (`[http]`).
    pub http: super::http::access::Access,
    /// When the replica says it is not ready (`[readiness]`).
    pub readiness: super::health::ReadinessConfig,
    /// `[A-Za-z0-9_-]`; names the replica's decision and progress subjects.
    /// Empty: `hostname-pid`, filled in by [`Config::validate`].
    pub replica_id: String,
    /// The served model (also the hashing contract's). Required.
    pub model: String,
    /// Tokens per KV block (hashing contract).
    pub block_size: u32,
    /// HuggingFace `tokenizer.json`: text prompts and text output.
    pub tokenizer: Option<PathBuf>,
    /// The chat template (a Jinja file) of `/v1/chat/completions`; without
    /// it, `tokenizer_config.json`'s beside the tokenizer.
    pub chat_template: Option<PathBuf>,
    /// Bytes of recent prompts' text and token ids kept to tokenize a
    /// conversation's next turn from its prefix (0: off).
    #[serde(with = "settings::bytes")]
    pub tokenizer_cache: u64,
    /// The deployment's seed of decisions' draws (the same on every replica).
    pub seed: u64,
    /// Blocks the index replica is sized for.
    pub reserve_blocks: usize,
    /// Largest request body.
    #[serde(with = "settings::bytes")]
    pub max_body_bytes: u64,
    /// `max_tokens` of a request that does not say.
    pub default_max_tokens: u32,
    /// The context length (prompt plus output) requests are checked
    /// against before routing; without it, the registered workers'
    /// smallest (`WorkerRecord::max_model_len`).
    pub max_model_len: Option<u32>,
    /// The bypass-or-remote policy, with its parameters.
    #[serde(skip_serializing)]
    pub policy: Policy,
    pub decode: DecodeSelection,
    pub prefill: PrefillSelection,
    /// Weights of offloaded tiers, for both selections.
    pub tier_weights: TierWeights,
    pub gate: GateConfig,
    pub ledger: LedgerConfig,
    /// Heartbeats between replicas (`[peers]`).
    pub peers: PeerConfig,
    /// The queue at the door while every decode worker is busy
    /// (`[admission]`).
    pub admission: AdmissionConfig,
    /// Retries before the first token (`[retry]`).
    pub retry: Retry,
    /// The circuit breaker (`[breaker]`).
    pub breaker: BreakerConfig,
    /// The third path (remote prefill with the prefix fetched from a
    /// decode worker): off unless every worker's engine supports it.
    pub fetch: FetchConfig,
    /// Session affinity (`[session]`).
    pub session: SessionConfig,
    pub timeouts: Timeouts,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            nats_url: "nats://127.0.0.1:4222".into(),
            etcd_endpoints: vec!["http://127.0.0.1:2379".into()],
            stream_replicas: 1,
            nats: bus::NatsAuth::default(),
            etcd: bus::EtcdAuth::default(),
            http_addr: SocketAddr::from(([0, 0, 0, 0], 8080)),
            http: Default::default(),
            readiness: Default::default(),
            replica_id: String::new(),
            model: String::new(),
            block_size: 16,
            tokenizer: None,
            chat_template: None,
            tokenizer_cache: 256 << 20,
            seed: 0,
            reserve_blocks: kv_indexer::DEFAULT_RESERVE_BLOCKS,
            max_body_bytes: 32 << 20,
            default_max_tokens: 16,
            max_model_len: None,
            policy: Policy::default(),
            decode: DecodeSelection::default(),
            prefill: PrefillSelection::default(),
            tier_weights: TierWeights::default(),
            gate: GateConfig::default(),
            ledger: LedgerConfig::default(),
            peers: PeerConfig::default(),
            admission: AdmissionConfig::default(),
            retry: Retry::default(),
            breaker: BreakerConfig::default(),
            fetch: FetchConfig::default(),
            session: SessionConfig::default(),
            timeouts: Timeouts::default(),
        }
    }
}

/// The flags of every setting but the policy's parameters (those come from
/// the registry: [`flags`]).
fn fixed_flags() -> Vec<Flag> {
    vec![
    Flag::new("nats_url", Kind::Text, "NATS server URLs, comma separated (one cluster's)"),
    Flag::new("etcd_endpoints", Kind::List, "etcd endpoints, comma separated"),
    bus::stream_replicas_flag(),
    Flag::new("http_addr", Kind::Text, "HTTP listen address")
        // The worker agent has an HTTP address too.
        .env("SWITCHYARD_ROUTER_HTTP_ADDR"),
    Flag::new(
        "readiness.max_delta_lag",
        Kind::Number,
        "/readyz fails while the index is more deltas than this behind the delta stream",
    ),
    Flag::new(
        "readiness.max_quiet",
        Kind::Duration,
        "/readyz fails when no delta came for this long and no kv-indexer pulls the KV events",
    ),
    Flag::new(
        "readiness.max_delta_stall",
        Kind::Duration,
        "The delta feed is opened again when the stream's head is ahead of the index and no delta came for this long (its consumer died with a NATS node)",
    ),
    Flag::new(
        "http.api_keys",
        Kind::List,
        "Bearer keys accepted on /v1/completions and /v1/route, comma separated (none: open); prefer the variable or the file",
    ),
    Flag::new(
        "http.admin_token",
        Kind::Text,
        "Bearer token of /debug/* and /v1/route?explain=true (none: loopback clients only)",
    ),
    Flag::new(
        "replica_id",
        Kind::Text,
        "This replica's id ([A-Za-z0-9_-]; it names its decision and progress subjects) [default: hostname-pid]",
    ),
    Flag::new(
        "model",
        Kind::Text,
        "The served model (required): part of the hashing contract workers must meet",
    ),
    Flag::new("block_size", Kind::Number, "Tokens per KV block (hashing contract)"),
    Flag::new(
        "tokenizer",
        Kind::Text,
        "HuggingFace tokenizer.json: enables text prompts and text output",
    ),
    Flag::new(
        "chat_template",
        Kind::Text,
        "Chat template (Jinja file) for /v1/chat/completions [default: chat_template of the tokenizer_config.json beside --tokenizer]",
    ),
    Flag::new(
        "tokenizer_cache",
        Kind::Bytes,
        "Tokenization cache: recent prompts' text and ids, so a conversation's next turn tokenizes only its new part (0: off)",
    ),
    Flag::new(
        "seed",
        Kind::Number,
        "Seed of the decisions' random draws (tie-breaks, sampling): the same on every replica",
    ),
    Flag::new(
        "reserve_blocks",
        Kind::Number,
        "Blocks the index replica's table is sized for at start (growing it stalls routing)",
    ),
    Flag::new("max_body_bytes", Kind::Bytes, "Largest request body"),
    Flag::new(
        "default_max_tokens",
        Kind::Number,
        "max_tokens of a request that gives none (also its expected output)",
    ),
    Flag::new(
        "max_model_len",
        Kind::Number,
        "Context length (prompt + max_tokens) requests are checked against before routing [default: the workers' smallest]",
    ),
    Flag::new("policy.name", Kind::Text, "")
        .long("policy")
        .env("SWITCHYARD_POLICY"),
    Flag::new(
        "decode.overlap_credit",
        Kind::Number,
        "Decode selection: cost removed per cached block",
    ),
    Flag::new(
        "decode.queue_weight",
        Kind::Number,
        "Decode selection: cost per block's worth of queued prefill",
    ),
    Flag::new(
        "decode.busy_kv_usage",
        Kind::Number,
        "Decode selection: KV usage from which a worker is skipped",
    ),
    Flag::new(
        "decode.busy_waiting",
        Kind::Number,
        "Decode selection: waiting requests from which a worker is skipped",
    ),
    Flag::new(
        "decode.temperature",
        Kind::Number,
        "Decode selection: softmax temperature (0: the cheapest)",
    ),
    Flag::new(
        "decode.offer_holder",
        Kind::Switch,
        "Offer the SLA policy the decode worker holding more of the prompt than the pick, for a bypass there instead",
    ),
    Flag::new(
        "prefill.miss_weight",
        Kind::Number,
        "Prefill selection: weight of the blocks a worker would recompute that another holds, per request-sized queue on the pool (0: the soonest start alone)",
    ),
    Flag::new(
        "prefill.temperature",
        Kind::Number,
        "Prefill selection: softmax temperature (0: the cheapest)",
    ),
    Flag::new(
        "tier_weights.host",
        Kind::Number,
        "Weight of a block cached in host memory (device = 1), both selections",
    )
    .long("host-tier-weight"),
    Flag::new(
        "tier_weights.disk",
        Kind::Number,
        "Weight of a block cached on disk, both selections",
    )
    .long("disk-tier-weight"),
    Flag::new("gate.enabled", Kind::Switch, "Decode gate on or off"),
    Flag::new(
        "gate.budget_fraction",
        Kind::Number,
        "Decode gate: share of the KV capacity a bypass may fill",
    ),
    Flag::new(
        "fetch.enabled",
        Kind::Switch,
        "Third path: a remote prefill may pull the prefix a decode worker holds (needs every engine to support it: mock-vllm, or vLLM >= 0.21 with bidirectional_kv_xfer and agents started with --vllm-bidirectional-kv)",
    )
    .long("prefix-fetch"),
    Flag::new(
        "fetch.min_tokens",
        Kind::Number,
        "Third path: fewest tokens worth pulling from a decode worker",
    )
    .long("prefix-fetch-min-tokens"),
    Flag::new(
        "ledger.ttl",
        Kind::Duration,
        "Ledger: an entry whose completion never arrives is dropped after this long",
    )
    .long("ledger-ttl")
    .legacy(Legacy::millis("ledger-ttl-ms")),
    Flag::new(
        "ledger.tombstone_ttl",
        Kind::Duration,
        "Ledger: how long a finished id is remembered",
    )
    .legacy(Legacy::millis("ledger-tombstone-ttl-ms")),
    Flag::new(
        "ledger.report_grace",
        Kind::Duration,
        "Ledger: delay a load report is assumed to lag decisions by",
    )
    .long("report-grace")
    .legacy(Legacy::millis("report-grace-ms")),
    Flag::new(
        "peers.heartbeat",
        Kind::Duration,
        "Peers: how often this replica tells the others it is alive",
    )
    .long("peer-heartbeat"),
    Flag::new(
        "peers.timeout",
        Kind::Duration,
        "Peers: a replica not heard of for this long is taken for dead and its reservations released",
    )
    .long("peer-timeout"),
    Flag::new(
        "admission.max_queued",
        Kind::Number,
        "Admission: requests that may wait while every decode worker is busy; one more gets 429 (0: none waits)",
    )
    .long("admission-queue"),
    Flag::new(
        "admission.max_wait",
        Kind::Duration,
        "Admission: longest wait in the queue before a 429",
    )
    .long("admission-max-wait"),
    Flag::new(
        "admission.retry_after_s",
        Kind::Number,
        "Admission: the Retry-After (seconds) of a 429",
    )
    .long("admission-retry-after"),
    Flag::new(
        "retry.attempts",
        Kind::Number,
        "Dispatch: further attempts of a request that failed before its first token, each on another worker",
    )
    .long("retry-attempts"),
    Flag::new(
        "retry.backoff",
        Kind::Duration,
        "Dispatch: wait before the first retry, doubled before each next one",
    )
    .long("retry-backoff"),
    Flag::new(
        "retry.resume",
        Kind::Switch,
        "Dispatch: a stream whose worker died after some tokens goes on on another worker (the tokens sent are appended to its prompt)",
    )
    .long("retry-resume"),
    Flag::new(
        "breaker.failures",
        Kind::Number,
        "Circuit breaker: failed dispatches in a row that take a worker out of rotation (0: off)",
    )
    .long("breaker-failures"),
    Flag::new(
        "breaker.open_for",
        Kind::Duration,
        "Circuit breaker: how long a worker stays out before one trial request",
    )
    .long("breaker-open-for"),
    Flag::new(
        "session.enabled",
        Kind::Switch,
        "Session affinity: a session id (x-session-id, agent_context.session_id) keeps a conversation on one decode worker on every replica",
    ),
    Flag::new(
        "session.ttl",
        Kind::Duration,
        "Session affinity: a binding lasts this long after the session's last turn",
    ),
    Flag::new(
        "session.max_sessions",
        Kind::Number,
        "Session affinity: most sessions bound at once (the oldest dropped first)",
    ),
    Flag::new(
        "timeouts.first_chunk",
        Kind::Duration,
        "Dispatch: longest wait for a worker's first chunk",
    )
    .long("first-chunk-timeout")
    .legacy(Legacy::millis("first-chunk-timeout-ms")),
    Flag::new(
        "timeouts.idle",
        Kind::Duration,
        "Dispatch: longest wait between two chunks",
    )
    .long("idle-timeout")
    .legacy(Legacy::millis("idle-timeout-ms")),
    Flag::new(
        "timeouts.route",
        Kind::Duration,
        "Longest wait for the event loop's decision",
    )
    .long("route-timeout")
    .legacy(Legacy::millis("route-timeout-ms")),
    Flag::new(
        "timeouts.probe",
        Kind::Duration,
        "Dispatch: a leg quiet this long has its worker probed; a worker whose agent is gone fails the leg at once",
    )
    .long("probe-interval"),
    Flag::new(
        "timeouts.drain",
        Kind::Duration,
        "On shutdown, in-flight HTTP requests get this long to finish",
    )
    .long("drain-timeout")
    .legacy(Legacy::millis("drain-timeout-ms")),
    Flag::new(
        "timeouts.drain_notice",
        Kind::Duration,
        "On shutdown, serve on this long while /readyz says draining, before refusing new connections (a load balancer's notice)",
    )
    .long("drain-notice"),
    Flag::new(
        "timeouts.tick",
        Kind::Duration,
        "Period of ledger expiry, gauges and delta-head polling",
    )
    .long("tick")
    .legacy(Legacy::millis("tick-ms")),
    ]
}

/// Every flag: the fixed ones, the policy's (with the registry's list in its
/// help), and one per policy parameter of the registry (`--eff-isl-tokens`
/// is `[policy] eff_isl_tokens`), its help naming the policies that take it
/// and their defaults.
pub fn flags() -> Vec<Flag> {
    let mut flags = fixed_flags();
    flags.extend(bus::auth_flags());
    for flag in &mut flags {
        if flag.path == "policy.name" {
            let list = POLICIES
                .iter()
                .map(|p| format!("{} ({})", p.name, p.about))
                .collect::<Vec<_>>()
                .join("; ");
            flag.help =
                format!("The policy: {list} [default: {}]", Policy::default().name()).into();
        }
    }
    let mut seen: Vec<&str> = Vec::new();
    for spec in &POLICIES {
        for param in spec.params() {
            if seen.contains(&param.name) {
                continue;
            }
            seen.push(param.name);
            let defaults = POLICIES
                .iter()
                .filter(|s| s.param(param.name).is_some())
                .map(|s| {
                    let value = s
                        .default_policy()
                        .params()
                        .into_iter()
                        .find(|(n, _)| *n == param.name)
                        .map_or(0.0, |(_, v)| v);
                    format!("{value} for {}", s.name)
                })
                .collect::<Vec<_>>()
                .join(", ");
            flags.push(
                Flag::owned(
                    format!("policy.{}", param.name),
                    Kind::Number,
                    format!("{} [default: {defaults}]", param.help),
                )
                .long(param.name.replace('_', "-")),
            );
        }
    }
    flags
}

/// The command line's name, version and description.
pub fn command() -> clap::Command {
    clap::Command::new("router")
        .version(env!("CARGO_PKG_VERSION"))
        .about("Switchyard router replica: OpenAI-compatible completions routed to prefill and decode workers")
}

/// The process's arguments (`--help` and bad flags exit here).
pub fn args() -> Args {
    Args::parse(command(), &flags(), &Config::default())
}

/// A configuration, and the spellings of an earlier release it used (to
/// log once tracing is up).
#[derive(Debug)]
pub struct Loaded {
    pub config: Config,
    pub deprecations: Vec<Deprecation>,
}

impl Config {
    /// Defaults for a model, talking to the given servers (what tests and
    /// embedders start from), validated.
    pub fn new(
        nats_url: &str,
        etcd_endpoints: &[String],
        model: &str,
    ) -> Result<Self, ConfigError> {
        let config = Config {
            nats_url: nats_url.to_owned(),
            etcd_endpoints: etcd_endpoints.to_vec(),
            model: model.to_owned(),
            ..Config::default()
        };
        config.validate()
    }

    /// The raw arguments layered (file, variables, flags), deserialized and
    /// validated.
    pub fn from_args(args: &Args) -> Result<Loaded, ConfigError> {
        let flags = flags();
        let (table, mut deprecations) = args.layered(&flags)?;
        let name = table
            .get("policy")
            .and_then(|p| p.get("name"))
            .and_then(|n| n.as_str());
        if let Some(name) = name {
            if let Ok(found) = PolicySpec::find(name) {
                if found.deprecated {
                    deprecations.push(Deprecation {
                        old: format!("the policy name {name:?}"),
                        new: found.spec.name.to_owned(),
                    });
                }
            }
        }
        let config: Config = settings::deserialize(table)?;
        Ok(Loaded {
            config: config.validate()?,
            deprecations,
        })
    }

    /// Checks every value and fills in the derived defaults (the replica
    /// id).
    pub fn validate(mut self) -> Result<Config, ConfigError> {
        if self.model.trim().is_empty() {
            return Err(ConfigError::NoModel);
        }
        if self.block_size == 0 {
            return Err(invalid("block_size", 0, "must be at least 1"));
        }
        if self.replica_id.is_empty() {
            self.replica_id = default_replica_id();
        } else if !valid_token(&self.replica_id) {
            return Err(invalid(
                "replica_id",
                format!("{:?}", self.replica_id),
                "must be 1 to 128 characters of [A-Za-z0-9_-] (it is a NATS subject token)",
            ));
        }
        if self.etcd_endpoints.is_empty() || self.etcd_endpoints.iter().any(|e| e.trim().is_empty())
        {
            return Err(invalid(
                "etcd_endpoints",
                format!("{:?}", self.etcd_endpoints),
                "needs at least one non-empty endpoint",
            ));
        }
        bus::check_replicas(self.stream_replicas)
            .map_err(|expected| invalid("stream_replicas", self.stream_replicas, expected))?;
        if self.max_body_bytes < 1024 {
            return Err(invalid(
                "max_body_bytes",
                self.max_body_bytes,
                "must be at least 1KiB",
            ));
        }
        if self.max_model_len == Some(0) {
            return Err(invalid("max_model_len", 0, "must be at least 1"));
        }
        if self.default_max_tokens == 0 {
            return Err(invalid("default_max_tokens", 0, "must be at least 1"));
        }
        let t = &self.timeouts;
        for (key, value) in [
            ("timeouts.first_chunk", t.first_chunk),
            ("timeouts.idle", t.idle),
            ("timeouts.route", t.route),
            ("timeouts.probe", t.probe),
            ("timeouts.tick", t.tick),
        ] {
            if value.is_zero() {
                return Err(invalid(key, "0s", "must be longer than 0"));
            }
        }
        if self.ledger.ttl_ms == 0 {
            return Err(invalid("ledger.ttl", "0s", "must be longer than 0"));
        }
        if self.peers.heartbeat_ms == 0 {
            return Err(invalid("peers.heartbeat", "0s", "must be longer than 0"));
        }
        if self.peers.timeout_ms < 2 * self.peers.heartbeat_ms {
            return Err(invalid(
                "peers.timeout",
                format!("{}ms", self.peers.timeout_ms),
                "must be at least two heartbeats (peers.heartbeat)",
            ));
        }
        self.router().validate()?;
        self.policy
            .validate()
            .map_err(crate::core::ConfigError::from)?;
        Ok(self)
    }

    /// The core's configuration (contract, selection, gate, ledger).
    pub fn router(&self) -> RouterConfig {
        RouterConfig {
            contract: HashingContract::for_model(&self.model, self.block_size),
            decode: DecodeSelection {
                tier_weights: self.tier_weights,
                ..self.decode
            },
            prefill: PrefillSelection {
                tier_weights: self.tier_weights,
                ..self.prefill
            },
            gate: self.gate,
            ledger: self.ledger,
            fetch: self.fetch,
            session: self.session,
        }
    }

    /// The largest request body, for the HTTP layer.
    pub fn max_body(&self) -> usize {
        usize::try_from(self.max_body_bytes).unwrap_or(usize::MAX)
    }
}

fn invalid(key: &'static str, value: impl ToString, expected: &'static str) -> ConfigError {
    ConfigError::Invalid {
        key,
        value: value.to_string(),
        expected,
    }
}

fn valid_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// `hostname-pid`, with the hostname cut to subject-token characters.
fn default_replica_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .unwrap_or_default();
    let host: String = host
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(100)
        .collect();
    let host = if host.is_empty() {
        "router".to_owned()
    } else {
        host
    };
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests;
