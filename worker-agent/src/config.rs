//! The agent's configuration: the raw arguments ([`Args`]: flags, each also
//! a `SWITCHYARD_*` variable, and a TOML file) read into [`Options`] (what
//! they say, defaults from `Options::default`, shown by `--help`), then
//! validated into [`Config`], in the types the agent uses (see the
//! `settings` crate).

use std::net::SocketAddr;
use std::time::Duration;

use engine_sim::{KvTransfer, Preset};
use protocol::ids::InvalidWorkerId;
use protocol::{HashingContract, Role, WorkerId};
use serde::{Deserialize, Serialize};
use settings::{Deprecation, Flag, Kind, Legacy, SettingsError};

use crate::core::OutboxLimits;
use crate::vllm::{EngineKind, ReplayLimits, VllmConfig};

pub use settings::Args;

/// The engine behind the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineChoice {
    /// The built-in simulated engine (engine-sim in real time).
    Sim,
    /// A vLLM server (or mock-vllm): KV events over ZMQ, OpenAI HTTP API.
    Vllm,
    /// An SGLang server: its KV events and metrics; local requests only.
    Sglang,
}

/// What the flags, variables and file say, each with its default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Options {
    /// NATS servers, comma separated (the servers of one cluster).
    pub nats_url: String,
    pub etcd_endpoints: Vec<String>,
    /// Copies JetStream keeps of the KV-event stream if this agent
    /// creates it (the kv-indexer sets it on the existing stream).
    pub stream_replicas: usize,
    /// NATS credentials and TLS (`[nats]`).
    pub nats: bus::NatsAuth,
    /// etcd credentials and TLS (`[etcd]`).
    pub etcd: bus::EtcdAuth,
    /// `[A-Za-z0-9_-]`, unique in the deployment. Required.
    pub worker_name: String,
    pub dp_rank: u32,
    /// `prefill`, `decode` or `both`.
    pub role: String,
    /// The engine's model (default: the preset's).
    pub model: Option<String>,
    pub block_size: u32,
    pub preset: String,
    pub speedup: f64,
    pub kv_capacity_blocks: Option<u32>,
    pub link_gb_s: f64,
    #[serde(with = "settings::duration")]
    pub lease_ttl: Duration,
    #[serde(with = "settings::duration")]
    pub drain_timeout: Duration,
    #[serde(with = "settings::duration")]
    pub load_interval: Duration,
    pub kv_queue_events: usize,
    pub kv_batch_events: usize,
    pub http_addr: Option<SocketAddr>,
    pub engine: EngineChoice,
    pub engine_url: String,
    pub kv_events_endpoint: String,
    pub kv_replay_endpoint: Option<String>,
    pub kv_events_topic: String,
    pub engine_dp_size: u32,
    #[serde(with = "settings::duration")]
    pub engine_startup_timeout: Duration,
    #[serde(with = "settings::duration")]
    pub engine_timeout: Duration,
    #[serde(with = "settings::duration")]
    pub engine_metrics_interval: Duration,
    pub engine_return_token_ids: bool,
    /// Real engine: serve the third path's prefill legs (a prefix pulled
    /// from a decode worker) with vLLM's bidirectional NIXL parameters.
    pub vllm_bidirectional_kv: bool,
    /// SGLang decode server that accepts `do_local_prefill` (SGLang builds
    /// with draft PR #34773): it serves bypasses.
    pub sglang_do_local_prefill: bool,
    #[serde(with = "settings::duration")]
    pub kv_replay_timeout: Duration,
    #[serde(with = "settings::duration")]
    pub kv_idle_check: Duration,
}

impl Default for Options {
    fn default() -> Self {
        let outbox = OutboxLimits::default();
        Self {
            nats_url: "nats://127.0.0.1:4222".into(),
            etcd_endpoints: vec!["http://127.0.0.1:2379".into()],
            stream_replicas: 1,
            nats: bus::NatsAuth::default(),
            etcd: bus::EtcdAuth::default(),
            worker_name: String::new(),
            dp_rank: 0,
            role: Role::Both.as_str().into(),
            model: None,
            block_size: engine_sim::DEFAULT_BLOCK_SIZE,
            preset: Preset::llama70b_fp8_tp2_h100().name.into(),
            speedup: 1.0,
            kv_capacity_blocks: None,
            link_gb_s: 87.0,
            lease_ttl: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(30),
            load_interval: Duration::from_millis(100),
            kv_queue_events: outbox.max_queued_events,
            kv_batch_events: outbox.max_batch_events,
            http_addr: None,
            engine: EngineChoice::Sim,
            engine_url: "http://127.0.0.1:8000".into(),
            kv_events_endpoint: "tcp://127.0.0.1:5557".into(),
            kv_replay_endpoint: None,
            kv_events_topic: String::new(),
            engine_dp_size: 1,
            engine_startup_timeout: Duration::from_secs(600),
            engine_timeout: Duration::from_secs(300),
            engine_metrics_interval: Duration::from_millis(200),
            engine_return_token_ids: true,
            vllm_bidirectional_kv: false,
            sglang_do_local_prefill: false,
            kv_replay_timeout: Duration::from_secs(5),
            kv_idle_check: Duration::from_secs(1),
        }
    }
}

/// Every flag of the agent.
pub fn flags() -> Vec<Flag> {
    let mut flags = vec![
        Flag::new("nats_url", Kind::Text, "NATS server URLs, comma separated (one cluster's)"),
        Flag::new("etcd_endpoints", Kind::List, "etcd endpoints, comma separated"),
        bus::stream_replicas_flag(),
        Flag::new(
            "worker_name",
            Kind::Text,
            "Worker name: [A-Za-z0-9_-], unique in the deployment (required)",
        ),
        Flag::new("dp_rank", Kind::Number, "Data-parallel rank of the engine this agent serves"),
        Flag::new("role", Kind::Text, "What the worker does: prefill, decode or both"),
        Flag::new(
            "model",
            Kind::Text,
            "Model name; it seeds the block hashes and must be the engine's model [default: the preset's model]",
        ),
        Flag::new("block_size", Kind::Number, "Tokens per KV block (the router's and indexer's block size)"),
        Flag::new(
            "preset",
            Kind::Text,
            "Engine preset (llama70b_fp8_tp2_h100, llama8b_h100): the simulated engine's model; for a real engine, the hardware facts registered for the router's cost model and the KV capacity when the engine does not report it",
        ),
        Flag::new(
            "speedup",
            Kind::Number,
            "Simulated engine speed-up: virtual step and transfer durations are divided by it",
        ),
        Flag::new(
            "kv_capacity_blocks",
            Kind::Number,
            "KV cache size in blocks [default: a real engine's own figure when it reports one, else the preset's]",
        ),
        Flag::new("link_gb_s", Kind::Number, "Simulated KV transfer link for decode requests, GB/s"),
        Flag::new(
            "lease_ttl",
            Kind::Duration,
            "Registration lease TTL: the worker's key disappears this long after the agent dies",
        )
        .legacy(Legacy::seconds("lease-ttl-s")),
        Flag::new(
            "drain_timeout",
            Kind::Duration,
            "On SIGTERM the agent deregisters, takes no new request and gives the ones in flight this long to finish before it stops the engine",
        ),
        Flag::new(
            "load_interval",
            Kind::Duration,
            "Longest gap between load reports (at most 100ms); a changed load is reported within 10 ms",
        )
        .legacy(Legacy::millis("load-interval-ms")),
        Flag::new(
            "kv_queue_events",
            Kind::Number,
            "KV events held while NATS does not acknowledge them; beyond this the agent resynchronises (new epoch with the full block set)",
        ),
        Flag::new(
            "kv_batch_events",
            Kind::Number,
            "Most KV events in one published batch (a resync's first batch holds the whole block set regardless)",
        ),
        Flag::new(
            "http_addr",
            Kind::Text,
            "Serve GET /metrics (Prometheus text) and GET /healthz here [default: none]",
        ),
        Flag::new("engine", Kind::Text, "The engine: sim (built in), vllm or sglang"),
        Flag::new("engine_url", Kind::Text, "Real engine: its OpenAI API's base URL"),
        Flag::new(
            "kv_events_endpoint",
            Kind::Text,
            "Real engine: its KV-event PUB socket for data-parallel rank 0 (the port is offset by --dp-rank)",
        ),
        Flag::new(
            "kv_replay_endpoint",
            Kind::Text,
            "Real engine: its KV-event replay (ROUTER) socket for rank 0, if it has one (recommended: gaps and restarts are then recovered exactly)",
        ),
        Flag::new("kv_events_topic", Kind::Text, "Real engine: the KV events' topic"),
        Flag::new(
            "engine_dp_size",
            Kind::Number,
            "Real engine: data-parallel ranks behind its API; above 1, requests are pinned to --dp-rank (X-data-parallel-rank)",
        ),
        Flag::new(
            "engine_startup_timeout",
            Kind::Duration,
            "Real engine: how long to wait for it to come up",
        )
        .legacy(Legacy::seconds("engine-startup-timeout-s")),
        Flag::new(
            "engine_timeout",
            Kind::Duration,
            "Real engine: a request that makes no progress for this long fails (retryable)",
        )
        .legacy(Legacy::seconds("engine-timeout-s")),
        Flag::new(
            "engine_metrics_interval",
            Kind::Duration,
            "Real engine: how often its /metrics is scraped for the load",
        )
        .legacy(Legacy::millis("engine-metrics-interval-ms")),
        Flag::new(
            "engine_return_token_ids",
            Kind::Switch,
            "Real engine: ask for generated token ids (return_token_ids)",
        ),
        Flag::new(
            "vllm_bidirectional_kv",
            Kind::Switch,
            "Real engine: vLLM's bidirectional KV transfer (vLLM >= 0.21 with bidirectional_kv_xfer on P and D; see the README): have the engine export a prefix a prefill worker asks for (a one-token request of it) and serve a prefill leg that fetches its prefix from a decode worker (the router's --prefix-fetch) with the handle that worker's engine exported; off: such legs are plain prefills. vLLM then also keeps every remote decode leg's blocks for its decoder_kv_blocks_ttl: see the README before turning it on",
        ),
        Flag::new(
            "sglang_do_local_prefill",
            Kind::Switch,
            "SGLang decode server that accepts do_local_prefill (SGLang draft PR #34773): advertise local_prefill and send bypasses with do_local_prefill; without it an SGLang decode server serves no leg",
        ),
        Flag::new(
            "kv_replay_timeout",
            Kind::Duration,
            "Real engine: longest KV replay (a replay that takes longer is given up, and the gap resynchronised)",
        )
        .legacy(Legacy::millis("kv-replay-timeout-ms")),
        Flag::new(
            "kv_idle_check",
            Kind::Duration,
            "Real engine: when no KV event came for this long, ask the replay socket for any batch the subscription missed (0s: never)",
        )
        .legacy(Legacy::millis("kv-idle-check-ms")),
    ];
    flags.extend(bus::auth_flags());
    flags
}

/// The command line's name, version and description.
pub fn command() -> clap::Command {
    clap::Command::new("worker-agent")
        .version(env!("CARGO_PKG_VERSION"))
        .about("Switchyard's sidecar beside one engine worker: registers it, publishes its KV events and load, serves its generation requests")
}

/// The process's arguments (`--help` and bad flags exit here).
pub fn args() -> Args {
    Args::parse(command(), &flags(), &Options::default())
}

/// A configuration, and the spellings of an earlier release it used.
#[derive(Debug)]
pub struct Loaded {
    pub config: Config,
    pub deprecations: Vec<Deprecation>,
}

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Settings(#[from] SettingsError),
    #[error("worker_name is required: set --worker-name, SWITCHYARD_WORKER_NAME or `worker_name` in the config file")]
    NoWorkerName,
    #[error("role {0:?}: expected prefill, decode or both")]
    Role(String),
    #[error("sglang_do_local_prefill is for --engine sglang only")]
    DoLocalPrefill,
    #[error("vllm_bidirectional_kv is for --engine vllm only (SGLang's decode servers refuse kv_transfer_params)")]
    BidirectionalKv,
    #[error("worker name: {0}")]
    WorkerId(#[from] InvalidWorkerId),
    #[error(transparent)]
    EngineModel(#[from] EngineModelError),
    #[error("lease TTL must be at least 1 s")]
    LeaseTtl,
    #[error("load interval {0:?} must be between 1ms and 100ms (load reports come at least every 100 ms)")]
    LoadInterval(Duration),
    #[error("the KV queue must hold at least one event")]
    KvQueue,
    #[error("a KV batch must hold at least one event")]
    KvBatch,
    #[error("no etcd endpoint given")]
    NoEtcdEndpoint,
    #[error("stream_replicas = {0}: {1}")]
    StreamReplicas(usize, &'static str),
    #[error("engine URL {0:?} is not http://host:port")]
    EngineUrl(String),
    #[error("KV events: {0}")]
    KvEndpoint(String),
    #[error("--dp-rank {rank} is not below --engine-dp-size {size}")]
    DpRank { rank: u32, size: u32 },
    #[error("{0} must be longer than 0")]
    ZeroDuration(&'static str),
}

/// Values of the simulated engine's flags that cannot run (the agent's
/// `--engine sim` and mock-vllm take the same ones).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineModelError {
    #[error("unknown preset {name:?} (known: {known})")]
    UnknownPreset { name: String, known: String },
    #[error("block size must be at least one token")]
    ZeroBlockSize,
    #[error("speed-up {0} must be a finite number above 0")]
    Speedup(f64),
    #[error("link bandwidth {0} GB/s must be a finite number above 0")]
    Link(f64),
}

/// Checks the simulated engine's flags; the preset they name.
pub fn engine_model(
    preset: &str,
    block_size: u32,
    speedup: f64,
    link_gb_s: f64,
) -> Result<Preset, EngineModelError> {
    let preset = Preset::by_name(preset).ok_or_else(|| EngineModelError::UnknownPreset {
        name: preset.to_owned(),
        known: Preset::ALL.map(|p| p.name).join(", "),
    })?;
    if block_size == 0 {
        return Err(EngineModelError::ZeroBlockSize);
    }
    if !(speedup.is_finite() && speedup > 0.0) {
        return Err(EngineModelError::Speedup(speedup));
    }
    if !(link_gb_s.is_finite() && link_gb_s > 0.0) {
        return Err(EngineModelError::Link(link_gb_s));
    }
    Ok(preset)
}

/// How often the load is checked for a change.
const LOAD_POLL: Duration = Duration::from_millis(10);

/// A validated configuration, in the types the agent uses.
#[derive(Debug, Clone)]
pub struct Config {
    pub nats_url: String,
    pub etcd_endpoints: Vec<String>,
    pub stream_replicas: usize,
    pub nats: bus::NatsAuth,
    pub etcd: bus::EtcdAuth,
    /// Where `/metrics` and `/healthz` are served, if anywhere.
    pub http_addr: Option<SocketAddr>,
    pub worker: WorkerId,
    pub role: Role,
    /// How the deployment names blocks: model and block size.
    pub contract: HashingContract,
    pub preset: Preset,
    pub speedup: f64,
    pub kv_capacity_blocks: Option<u32>,
    pub link: KvTransfer,
    pub lease_ttl: Duration,
    /// At shutdown, how long in-flight requests get to finish.
    pub drain_timeout: Duration,
    /// Longest gap between two load reports.
    pub load_interval: Duration,
    /// How often the load is checked for a change.
    pub load_poll: Duration,
    pub outbox: OutboxLimits,
    /// The real engine to connect to; `None` for the simulated engine.
    pub real_engine: Option<VllmConfig>,
    /// The legs the engine can serve, advertised at registration.
    pub capabilities: protocol::Capabilities,
}

impl Config {
    /// The raw arguments layered (file, variables, flags), deserialized and
    /// validated.
    pub fn from_args(args: &Args) -> Result<Loaded, ConfigError> {
        let (options, deprecations) = args.load::<Options>(&flags())?;
        Ok(Loaded {
            config: options.validate()?,
            deprecations,
        })
    }
}

impl Options {
    /// The defaults for `worker_name` talking to the given servers: what
    /// tests and embedders start from.
    pub fn new(worker_name: &str, nats_url: &str, etcd_endpoints: &[String]) -> Self {
        Self {
            worker_name: worker_name.to_owned(),
            nats_url: nats_url.to_owned(),
            etcd_endpoints: etcd_endpoints.to_vec(),
            ..Options::default()
        }
    }

    /// The model the worker serves: the configured one, else the preset's.
    pub fn model(&self, preset: &Preset) -> String {
        self.model
            .clone()
            .unwrap_or_else(|| preset.model.to_owned())
    }

    /// Checks every value and converts them.
    pub fn validate(&self) -> Result<Config, ConfigError> {
        if self.worker_name.is_empty() {
            return Err(ConfigError::NoWorkerName);
        }
        let worker = WorkerId::new(&self.worker_name, self.dp_rank)?;
        let role: Role = self
            .role
            .parse()
            .map_err(|_| ConfigError::Role(self.role.clone()))?;
        let preset = engine_model(&self.preset, self.block_size, self.speedup, self.link_gb_s)?;
        if self.lease_ttl < Duration::from_secs(1) {
            return Err(ConfigError::LeaseTtl);
        }
        if !(Duration::from_millis(1)..=Duration::from_millis(100)).contains(&self.load_interval) {
            return Err(ConfigError::LoadInterval(self.load_interval));
        }
        if self.kv_queue_events == 0 {
            return Err(ConfigError::KvQueue);
        }
        if self.kv_batch_events == 0 {
            return Err(ConfigError::KvBatch);
        }
        if self.etcd_endpoints.iter().all(|e| e.trim().is_empty()) {
            return Err(ConfigError::NoEtcdEndpoint);
        }
        bus::check_replicas(self.stream_replicas)
            .map_err(|expected| ConfigError::StreamReplicas(self.stream_replicas, expected))?;
        let load_interval = self.load_interval;
        let real_engine = self.real_engine(&worker, role, &preset)?;
        if self.vllm_bidirectional_kv && self.engine != EngineChoice::Vllm {
            return Err(ConfigError::BidirectionalKv);
        }
        if self.sglang_do_local_prefill && self.engine != EngineChoice::Sglang {
            return Err(ConfigError::DoLocalPrefill);
        }
        let capabilities = real_engine.as_ref().map_or_else(Default::default, |e| {
            e.kind.capabilities(role, self.sglang_do_local_prefill)
        });
        Ok(Config {
            nats_url: self.nats_url.clone(),
            etcd_endpoints: self.etcd_endpoints.clone(),
            stream_replicas: self.stream_replicas,
            nats: self.nats.clone(),
            etcd: self.etcd.clone(),
            http_addr: self.http_addr,
            worker,
            role,
            contract: HashingContract::for_model(&self.model(&preset), self.block_size),
            preset,
            speedup: self.speedup,
            kv_capacity_blocks: self.kv_capacity_blocks,
            link: KvTransfer {
                setup_us: 0,
                bytes_per_s: self.link_gb_s * 1e9,
            },
            lease_ttl: self.lease_ttl,
            drain_timeout: self.drain_timeout,
            load_interval,
            load_poll: LOAD_POLL.min(load_interval),
            outbox: OutboxLimits {
                max_queued_events: self.kv_queue_events,
                max_batch_events: self.kv_batch_events,
            },
            real_engine,
            capabilities,
        })
    }

    fn real_engine(
        &self,
        worker: &WorkerId,
        role: Role,
        preset: &Preset,
    ) -> Result<Option<VllmConfig>, ConfigError> {
        let kind = match self.engine {
            EngineChoice::Sim => return Ok(None),
            EngineChoice::Vllm => EngineKind::Vllm,
            EngineChoice::Sglang => EngineKind::Sglang,
        };
        let url = self.engine_url.trim();
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| ConfigError::EngineUrl(url.to_owned()))?;
        if rest.is_empty() || rest.starts_with('/') {
            return Err(ConfigError::EngineUrl(url.to_owned()));
        }
        crate::vllm::zmq::check_connect_endpoint(&self.kv_events_endpoint)
            .map_err(ConfigError::KvEndpoint)?;
        let replay = self
            .kv_replay_endpoint
            .as_deref()
            .map(str::trim)
            .filter(|e| !e.is_empty() && *e != "none");
        if let Some(replay) = replay {
            crate::vllm::zmq::check_connect_endpoint(replay).map_err(ConfigError::KvEndpoint)?;
        }
        for e in std::iter::once(self.kv_events_endpoint.as_str()).chain(replay) {
            crate::vllm::zmq::offset_endpoint(e, worker.dp_rank())
                .map_err(ConfigError::KvEndpoint)?;
        }
        if self.engine_dp_size > 1 && worker.dp_rank() >= self.engine_dp_size {
            return Err(ConfigError::DpRank {
                rank: worker.dp_rank(),
                size: self.engine_dp_size,
            });
        }
        for (value, name) in [
            (self.engine_startup_timeout, "engine_startup_timeout"),
            (self.engine_timeout, "engine_timeout"),
            (self.engine_metrics_interval, "engine_metrics_interval"),
            (self.kv_replay_timeout, "kv_replay_timeout"),
        ] {
            if value.is_zero() {
                return Err(ConfigError::ZeroDuration(name));
            }
        }
        let replay_total = self.kv_replay_timeout;
        Ok(Some(VllmConfig {
            kind,
            worker: worker.clone(),
            role,
            model: self.model(preset),
            block_size: self.block_size,
            api_url: url.trim_end_matches('/').to_owned(),
            kv_events: self.kv_events_endpoint.clone(),
            kv_replay: replay.map(str::to_owned),
            topic: self.kv_events_topic.clone(),
            dp_size: self.engine_dp_size.max(1),
            preset: *preset,
            kv_capacity_blocks: self.kv_capacity_blocks,
            startup_timeout: self.engine_startup_timeout,
            request_timeout: self.engine_timeout,
            metrics_interval: self.engine_metrics_interval,
            return_token_ids: self.engine_return_token_ids,
            bidirectional_kv: self.vllm_bidirectional_kv,
            do_local_prefill: self.sglang_do_local_prefill && role == Role::Decode,
            replay: ReplayLimits {
                connect: Duration::from_secs(2).min(replay_total),
                idle: Duration::from_secs(2).min(replay_total),
                total: replay_total,
            },
            idle_check: (!self.kv_idle_check.is_zero()).then_some(self.kv_idle_check),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> Options {
        Options::new("w0", "nats://127.0.0.1:1", &["http://127.0.0.1:2".into()])
    }

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let args = Args::try_parse_from(
            command(),
            &flags(),
            &Options::default(),
            std::iter::once("worker-agent").chain(args.iter().copied()),
        )
        .expect("valid flags");
        Ok(Config::from_args(&args)?.config)
    }

    #[test]
    fn defaults_are_valid() {
        let config = options().validate().unwrap();
        assert_eq!(config.worker.to_string(), "w0");
        assert_eq!(config.role, Role::Both);
        let preset = Preset::llama70b_fp8_tp2_h100();
        assert_eq!(
            config.contract,
            HashingContract::for_model(preset.model, 16)
        );
        assert_eq!(config.contract.salt, preset.salt());
        assert_eq!(config.load_poll, Duration::from_millis(10));
        assert_eq!(config.outbox, OutboxLimits::default());
    }

    #[test]
    fn flags_parse() {
        let c = parse(&[
            "--worker-name",
            "p1",
            "--dp-rank",
            "2",
            "--role",
            "prefill",
            "--etcd-endpoints",
            "http://a:1,http://b:2",
            "--http-addr",
            "127.0.0.1:9000",
            "--lease-ttl",
            "3s",
        ])
        .unwrap();
        assert_eq!(c.role, Role::Prefill);
        assert_eq!(c.worker.to_string(), "p1.2");
        assert_eq!(c.lease_ttl, Duration::from_secs(3));
        let e = parse(&["--worker-name", "x", "--role", "boss"]).unwrap_err();
        assert!(e.to_string().contains("\"boss\": expected prefill"), "{e}");
        let e = parse(&[]).unwrap_err();
        assert!(e.to_string().contains("SWITCHYARD_WORKER_NAME"), "{e}");
    }

    #[test]
    fn a_cluster_of_servers_and_replicated_streams() {
        let c = parse(&[
            "--worker-name",
            "w",
            "--nats-url",
            "nats://a:4222,nats://b:4222",
            "--stream-replicas",
            "3",
        ])
        .unwrap();
        assert_eq!(c.nats_url, "nats://a:4222,nats://b:4222");
        assert_eq!(c.stream_replicas, 3);
        let e = parse(&["--worker-name", "w", "--stream-replicas", "0"]).unwrap_err();
        assert!(e.to_string().starts_with("stream_replicas = 0"), "{e}");
    }

    #[test]
    fn the_previous_releases_flags_still_work() {
        let args = Args::try_parse_from(
            command(),
            &flags(),
            &Options::default(),
            [
                "worker-agent",
                "--worker-name",
                "w",
                "--lease-ttl-s",
                "2",
                "--load-interval-ms",
                "50",
            ],
        )
        .unwrap();
        let loaded = Config::from_args(&args).unwrap();
        assert_eq!(loaded.config.lease_ttl, Duration::from_secs(2));
        assert_eq!(loaded.config.load_interval, Duration::from_millis(50));
        assert_eq!(loaded.deprecations.len(), 2, "{:?}", loaded.deprecations);
    }

    #[test]
    fn bad_values_are_refused_clearly() {
        let mut c = options();
        c.worker_name = "a b".into();
        assert!(matches!(c.validate(), Err(ConfigError::WorkerId(_))));
        let mut c = options();
        c.preset = "gpt5".into();
        let err = c.validate().unwrap_err();
        assert!(err.to_string().contains("llama8b_h100"), "{err}");
        let mut c = options();
        c.speedup = 0.0;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::EngineModel(EngineModelError::Speedup(_)))
        ));
        let mut c = options();
        c.load_interval = Duration::from_millis(250);
        assert!(matches!(c.validate(), Err(ConfigError::LoadInterval(_))));
        let mut c = options();
        c.block_size = 0;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::EngineModel(EngineModelError::ZeroBlockSize))
        ));
    }

    #[test]
    fn real_engine_flags() {
        assert!(options().validate().unwrap().real_engine.is_none());
        let c = Options {
            dp_rank: 1,
            engine: EngineChoice::Vllm,
            engine_url: "http://engine:8000/".into(),
            kv_events_endpoint: "tcp://engine:5557".into(),
            kv_replay_endpoint: Some("tcp://engine:5558".into()),
            engine_dp_size: 2,
            model: Some("m".into()),
            engine_return_token_ids: false,
            ..Options::new("d0", "nats://127.0.0.1:1", &["http://127.0.0.1:2".into()])
        };
        let real = c.validate().unwrap().real_engine.unwrap();
        assert_eq!(real.kind, EngineKind::Vllm);
        assert_eq!(real.api_url, "http://engine:8000");
        assert_eq!(real.kv_replay.as_deref(), Some("tcp://engine:5558"));
        assert_eq!(real.worker.to_string(), "d0.1");
        assert_eq!(real.model, "m");
        assert!(!real.return_token_ids);

        let mut bad = c.clone();
        bad.engine_url = "engine:8000".into();
        assert!(matches!(bad.validate(), Err(ConfigError::EngineUrl(_))));
        let mut bad = c.clone();
        bad.kv_events_endpoint = "tcp://*:5557".into();
        assert!(matches!(bad.validate(), Err(ConfigError::KvEndpoint(_))));
        let mut bad = c.clone();
        bad.engine_dp_size = 1;
        bad.dp_rank = 0;
        bad.kv_replay_endpoint = Some("none".into());
        assert!(bad
            .validate()
            .unwrap()
            .real_engine
            .unwrap()
            .kv_replay
            .is_none());
        let mut bad = c;
        bad.dp_rank = 2;
        assert!(matches!(
            bad.validate(),
            Err(ConfigError::DpRank { rank: 2, size: 2 })
        ));
    }

    /// The legs advertised at registration: vLLM every one; SGLang no
    /// remote leg, a decode server's bypass only with do_local_prefill.
    #[test]
    fn capabilities_by_engine_and_role() {
        use protocol::Capabilities;
        let engine = |engine, role: &str, do_local_prefill| Options {
            engine,
            role: role.into(),
            engine_url: "http://engine:8000".into(),
            kv_events_endpoint: "tcp://engine:5557".into(),
            model: Some("m".into()),
            sglang_do_local_prefill: do_local_prefill,
            ..Options::new("d0", "nats://127.0.0.1:1", &["http://127.0.0.1:2".into()])
        };
        let caps = |o: Options| {
            o.validate().map(|c| {
                let sends = c.real_engine.as_ref().is_some_and(|e| e.do_local_prefill);
                (c.capabilities, sends)
            })
        };
        let none = Capabilities {
            local_prefill: false,
            remote_decode: false,
            remote_prefill: false,
        };
        let bypass = Capabilities {
            local_prefill: true,
            ..none
        };
        assert_eq!(caps(options()).unwrap(), (Capabilities::default(), false));
        assert_eq!(
            caps(engine(EngineChoice::Vllm, "decode", false)).unwrap(),
            (Capabilities::default(), false)
        );
        assert_eq!(
            caps(engine(EngineChoice::Sglang, "decode", false)).unwrap(),
            (none, false)
        );
        assert_eq!(
            caps(engine(EngineChoice::Sglang, "decode", true)).unwrap(),
            (bypass, true)
        );
        assert_eq!(
            caps(engine(EngineChoice::Sglang, "both", false)).unwrap(),
            (bypass, false)
        );
        assert_eq!(
            caps(engine(EngineChoice::Sglang, "prefill", true)).unwrap(),
            (none, false)
        );
        assert!(matches!(
            caps(engine(EngineChoice::Vllm, "decode", true)),
            Err(ConfigError::DoLocalPrefill)
        ));
        // vLLM's bidirectional transfer on vLLM only.
        for (choice, ok) in [(EngineChoice::Vllm, true), (EngineChoice::Sglang, false)] {
            let o = Options {
                vllm_bidirectional_kv: true,
                ..engine(choice, "decode", false)
            };
            let validated = o.validate();
            assert_eq!(validated.is_ok(), ok, "{choice:?}: {:?}", validated.err());
        }
    }
}
