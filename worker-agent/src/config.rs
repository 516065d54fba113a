//! The agent's configuration: command-line flags, each with a
//! `SWITCHYARD_*` environment variable, and their validation.

use std::net::SocketAddr;
use std::time::Duration;

use engine_sim::{KvTransfer, Preset};
use protocol::ids::InvalidWorkerId;
use protocol::{HashingContract, Role, WorkerId};

use crate::core::OutboxLimits;
use crate::vllm::{EngineKind, ReplayLimits, VllmConfig};

/// The engine behind the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineChoice {
    /// The built-in simulated engine (engine-sim in real time).
    Sim,
    /// A vLLM server (or mock-vllm): KV events over ZMQ, OpenAI HTTP API.
    Vllm,
    /// An SGLang server: its KV events and metrics; local requests only.
    Sglang,
}

/// Everything the agent is told at start.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "worker-agent",
    version,
    about = "Switchyard's sidecar beside one engine worker: registers it, publishes its KV events and load, serves its generation requests"
)]
pub struct Config {
    /// NATS server URL.
    #[arg(
        long,
        env = "SWITCHYARD_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,

    /// etcd endpoints, comma-separated.
    #[arg(
        long,
        env = "SWITCHYARD_ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379"
    )]
    pub etcd_endpoints: Vec<String>,

    /// Worker name: `[A-Za-z0-9_-]`, unique in the deployment.
    #[arg(long, env = "SWITCHYARD_WORKER_NAME")]
    pub worker_name: String,

    /// Data-parallel rank of the engine this agent serves.
    #[arg(long, env = "SWITCHYARD_DP_RANK", default_value_t = 0)]
    pub dp_rank: u32,

    /// What the worker does: prefill, decode or both.
    #[arg(long, env = "SWITCHYARD_ROLE", default_value = "both")]
    pub role: Role,

    /// Model name; it seeds the block hashes and must be the engine's model
    /// (default: the preset's model).
    #[arg(long, env = "SWITCHYARD_MODEL")]
    pub model: Option<String>,

    /// Tokens per KV block (the router's and indexer's block size).
    #[arg(long, env = "SWITCHYARD_BLOCK_SIZE", default_value_t = engine_sim::DEFAULT_BLOCK_SIZE)]
    pub block_size: u32,

    /// Engine preset: llama70b_fp8_tp2_h100 or llama8b_h100. The simulated
    /// engine's model; for a real engine, the hardware facts registered for
    /// the router's cost model (GPUs, KV bytes per token, step budget) and
    /// the KV capacity when the engine does not report it.
    #[arg(
        long,
        env = "SWITCHYARD_PRESET",
        default_value = "llama70b_fp8_tp2_h100"
    )]
    pub preset: String,

    /// Simulated engine speed-up: virtual step and transfer durations are
    /// divided by it.
    #[arg(long, env = "SWITCHYARD_SPEEDUP", default_value_t = 1.0)]
    pub speedup: f64,

    /// KV cache size in blocks (default: a real engine's own figure when it
    /// reports one, else the preset's).
    #[arg(long, env = "SWITCHYARD_KV_CAPACITY_BLOCKS")]
    pub kv_capacity_blocks: Option<u32>,

    /// Simulated KV transfer link for decode requests, GB/s.
    #[arg(long, env = "SWITCHYARD_LINK_GB_S", default_value_t = 87.0)]
    pub link_gb_s: f64,

    /// Registration lease TTL in seconds: the worker's key disappears this
    /// long after the agent dies.
    #[arg(long, env = "SWITCHYARD_LEASE_TTL_S", default_value_t = 10)]
    pub lease_ttl_s: u64,

    /// Longest gap between load reports, ms (at most 100); a changed load
    /// is reported within 10 ms.
    #[arg(long, env = "SWITCHYARD_LOAD_INTERVAL_MS", default_value_t = 100)]
    pub load_interval_ms: u64,

    /// KV events held while NATS does not acknowledge them; beyond this the
    /// agent resynchronises (new epoch with the full block set).
    #[arg(long, env = "SWITCHYARD_KV_QUEUE_EVENTS", default_value_t = 65_536)]
    pub kv_queue_events: usize,

    /// Most KV events in one published batch (a resync's first batch holds
    /// the whole block set regardless).
    #[arg(long, env = "SWITCHYARD_KV_BATCH_EVENTS", default_value_t = 256)]
    pub kv_batch_events: usize,

    /// Serve `GET /metrics` (Prometheus text) and `GET /healthz` here.
    #[arg(long, env = "SWITCHYARD_HTTP_ADDR")]
    pub http_addr: Option<SocketAddr>,

    /// The engine: the built-in simulation, or a real server.
    #[arg(long, env = "SWITCHYARD_ENGINE", value_enum, default_value = "sim")]
    pub engine: EngineChoice,

    /// Real engine: its OpenAI API's base URL.
    #[arg(
        long,
        env = "SWITCHYARD_ENGINE_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub engine_url: String,

    /// Real engine: its KV-event PUB socket for data-parallel rank 0 (the
    /// port is offset by --dp-rank).
    #[arg(
        long,
        env = "SWITCHYARD_KV_EVENTS_ENDPOINT",
        default_value = "tcp://127.0.0.1:5557"
    )]
    pub kv_events_endpoint: String,

    /// Real engine: its KV-event replay (ROUTER) socket for rank 0, if it
    /// has one (recommended: gaps and restarts are then recovered exactly).
    #[arg(long, env = "SWITCHYARD_KV_REPLAY_ENDPOINT")]
    pub kv_replay_endpoint: Option<String>,

    /// Real engine: the KV events' topic.
    #[arg(long, env = "SWITCHYARD_KV_EVENTS_TOPIC", default_value = "")]
    pub kv_events_topic: String,

    /// Real engine: data-parallel ranks behind its API; above 1, requests
    /// are pinned to --dp-rank (`X-data-parallel-rank`).
    #[arg(long, env = "SWITCHYARD_ENGINE_DP_SIZE", default_value_t = 1)]
    pub engine_dp_size: u32,

    /// Real engine: how long to wait for it to come up.
    #[arg(
        long,
        env = "SWITCHYARD_ENGINE_STARTUP_TIMEOUT_S",
        default_value_t = 600
    )]
    pub engine_startup_timeout_s: u64,

    /// Real engine: a request that makes no progress for this long fails
    /// (retryable).
    #[arg(long, env = "SWITCHYARD_ENGINE_TIMEOUT_S", default_value_t = 300)]
    pub engine_timeout_s: u64,

    /// Real engine: how often its /metrics is scraped for the load, ms.
    #[arg(
        long,
        env = "SWITCHYARD_ENGINE_METRICS_INTERVAL_MS",
        default_value_t = 200
    )]
    pub engine_metrics_interval_ms: u64,

    /// Real engine: ask for generated token ids (`return_token_ids`).
    #[arg(
        long,
        env = "SWITCHYARD_ENGINE_RETURN_TOKEN_IDS",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub engine_return_token_ids: bool,

    /// Real engine: longest KV replay, ms (a replay that takes longer is
    /// given up, and the gap resynchronised).
    #[arg(long, env = "SWITCHYARD_KV_REPLAY_TIMEOUT_MS", default_value_t = 5_000)]
    pub kv_replay_timeout_ms: u64,

    /// Real engine: when no KV event came for this long, ask the replay
    /// socket for any batch the subscription missed (0: never), ms.
    #[arg(long, env = "SWITCHYARD_KV_IDLE_CHECK_MS", default_value_t = 1_000)]
    pub kv_idle_check_ms: u64,
}

/// A configuration that cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("worker name: {0}")]
    WorkerId(#[from] InvalidWorkerId),
    #[error(transparent)]
    EngineModel(#[from] EngineModelError),
    #[error("lease TTL must be at least 1 s")]
    LeaseTtl,
    #[error("load interval {0} ms must be between 1 and 100 ms (load reports come at least every 100 ms)")]
    LoadInterval(u64),
    #[error("the KV queue must hold at least one event")]
    KvQueue,
    #[error("a KV batch must hold at least one event")]
    KvBatch,
    #[error("no etcd endpoint given")]
    NoEtcdEndpoint,
    #[error("engine URL {0:?} is not http://host:port")]
    EngineUrl(String),
    #[error("KV events: {0}")]
    KvEndpoint(String),
    #[error("--dp-rank {rank} is not below --engine-dp-size {size}")]
    DpRank { rank: u32, size: u32 },
    #[error("{0} must be at least 1")]
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
pub struct Settings {
    pub worker: WorkerId,
    pub role: Role,
    /// How the deployment names blocks: model and block size.
    pub contract: HashingContract,
    pub preset: Preset,
    pub speedup: f64,
    pub kv_capacity_blocks: Option<u32>,
    pub link: KvTransfer,
    pub lease_ttl: Duration,
    /// Longest gap between two load reports.
    pub load_interval: Duration,
    /// How often the load is checked for a change.
    pub load_poll: Duration,
    pub outbox: OutboxLimits,
    /// The real engine to connect to; `None` for the simulated engine.
    pub real_engine: Option<VllmConfig>,
}

impl Config {
    /// A configuration for `worker_name` talking to the given servers,
    /// everything else at its default (or its `SWITCHYARD_*` variable when
    /// set): what tests and embedders start from.
    pub fn new(worker_name: &str, nats_url: &str, etcd_endpoints: &[String]) -> Self {
        use clap::Parser as _;
        let mut config = Self::parse_from(["worker-agent", "--worker-name", worker_name]);
        config.nats_url = nats_url.to_owned();
        config.etcd_endpoints = etcd_endpoints.to_vec();
        config
    }

    /// The model the worker serves: the configured one, else the preset's.
    pub fn model(&self, preset: &Preset) -> String {
        self.model
            .clone()
            .unwrap_or_else(|| preset.model.to_owned())
    }

    /// Checks every value and converts them.
    pub fn validate(&self) -> Result<Settings, ConfigError> {
        let worker = WorkerId::new(&self.worker_name, self.dp_rank)?;
        let preset = engine_model(&self.preset, self.block_size, self.speedup, self.link_gb_s)?;
        if self.lease_ttl_s == 0 {
            return Err(ConfigError::LeaseTtl);
        }
        if !(1..=100).contains(&self.load_interval_ms) {
            return Err(ConfigError::LoadInterval(self.load_interval_ms));
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
        let load_interval = Duration::from_millis(self.load_interval_ms);
        let real_engine = self.real_engine(&worker, &preset)?;
        Ok(Settings {
            worker,
            role: self.role,
            contract: HashingContract::for_model(&self.model(&preset), self.block_size),
            preset,
            speedup: self.speedup,
            kv_capacity_blocks: self.kv_capacity_blocks,
            link: KvTransfer {
                setup_us: 0,
                bytes_per_s: self.link_gb_s * 1e9,
            },
            lease_ttl: Duration::from_secs(self.lease_ttl_s),
            load_interval,
            load_poll: LOAD_POLL.min(load_interval),
            outbox: OutboxLimits {
                max_queued_events: self.kv_queue_events,
                max_batch_events: self.kv_batch_events,
            },
            real_engine,
        })
    }

    fn real_engine(
        &self,
        worker: &WorkerId,
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
            (self.engine_startup_timeout_s, "--engine-startup-timeout-s"),
            (self.engine_timeout_s, "--engine-timeout-s"),
            (
                self.engine_metrics_interval_ms,
                "--engine-metrics-interval-ms",
            ),
            (self.kv_replay_timeout_ms, "--kv-replay-timeout-ms"),
        ] {
            if value == 0 {
                return Err(ConfigError::ZeroDuration(name));
            }
        }
        let replay_total = Duration::from_millis(self.kv_replay_timeout_ms);
        Ok(Some(VllmConfig {
            kind,
            worker: worker.clone(),
            role: self.role,
            model: self.model(preset),
            block_size: self.block_size,
            api_url: url.trim_end_matches('/').to_owned(),
            kv_events: self.kv_events_endpoint.clone(),
            kv_replay: replay.map(str::to_owned),
            topic: self.kv_events_topic.clone(),
            dp_size: self.engine_dp_size.max(1),
            preset: *preset,
            kv_capacity_blocks: self.kv_capacity_blocks,
            startup_timeout: Duration::from_secs(self.engine_startup_timeout_s),
            request_timeout: Duration::from_secs(self.engine_timeout_s),
            metrics_interval: Duration::from_millis(self.engine_metrics_interval_ms),
            return_token_ids: self.engine_return_token_ids,
            replay: ReplayLimits {
                connect: Duration::from_secs(2).min(replay_total),
                idle: Duration::from_secs(2).min(replay_total),
                total: replay_total,
            },
            idle_check: (self.kv_idle_check_ms > 0)
                .then(|| Duration::from_millis(self.kv_idle_check_ms)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config::new("w0", "nats://127.0.0.1:1", &["http://127.0.0.1:2".into()])
    }

    #[test]
    fn defaults_are_valid() {
        let settings = config().validate().unwrap();
        assert_eq!(settings.worker.to_string(), "w0");
        assert_eq!(settings.role, Role::Both);
        let preset = Preset::llama70b_fp8_tp2_h100();
        assert_eq!(
            settings.contract,
            HashingContract::for_model(preset.model, 16)
        );
        assert_eq!(settings.contract.salt, preset.salt());
        assert_eq!(settings.load_poll, Duration::from_millis(10));
    }

    #[test]
    fn flags_parse() {
        use clap::Parser as _;
        let c = Config::parse_from([
            "worker-agent",
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
        ]);
        assert_eq!(c.role, Role::Prefill);
        assert_eq!(c.etcd_endpoints, vec!["http://a:1", "http://b:2"]);
        assert_eq!(c.validate().unwrap().worker.to_string(), "p1.2");
        assert!(
            Config::try_parse_from(["worker-agent", "--worker-name", "x", "--role", "boss"])
                .is_err()
        );
    }

    #[test]
    fn bad_values_are_refused_clearly() {
        let mut c = config();
        c.worker_name = "a b".into();
        assert!(matches!(c.validate(), Err(ConfigError::WorkerId(_))));
        let mut c = config();
        c.preset = "gpt5".into();
        let err = c.validate().unwrap_err();
        assert!(err.to_string().contains("llama8b_h100"), "{err}");
        let mut c = config();
        c.speedup = 0.0;
        assert_eq!(
            c.validate().unwrap_err(),
            EngineModelError::Speedup(0.0).into()
        );
        let mut c = config();
        c.load_interval_ms = 250;
        assert_eq!(c.validate().unwrap_err(), ConfigError::LoadInterval(250));
        let mut c = config();
        c.block_size = 0;
        assert_eq!(
            c.validate().unwrap_err(),
            EngineModelError::ZeroBlockSize.into()
        );
    }

    #[test]
    fn real_engine_flags() {
        use clap::Parser as _;
        assert!(config().validate().unwrap().real_engine.is_none());
        let c = Config::parse_from([
            "worker-agent",
            "--worker-name",
            "d0",
            "--dp-rank",
            "1",
            "--engine",
            "vllm",
            "--engine-url",
            "http://engine:8000/",
            "--kv-events-endpoint",
            "tcp://engine:5557",
            "--kv-replay-endpoint",
            "tcp://engine:5558",
            "--engine-dp-size",
            "2",
            "--model",
            "m",
            "--engine-return-token-ids",
            "false",
        ]);
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
        assert_eq!(
            bad.validate().unwrap_err(),
            ConfigError::DpRank { rank: 2, size: 2 }
        );
    }
}
