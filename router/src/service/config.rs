//! The router's settings: command-line flags, `SWITCHYARD_*` environment
//! variables and an optional TOML file, resolved into a validated
//! [`Config`].
//!
//! Every setting has one name in three spellings: the flag `--eff-isl-tokens`,
//! the variable `SWITCHYARD_EFF_ISL_TOKENS`, the file key `eff_isl_tokens`
//! (one exception: `--http-addr` is `SWITCHYARD_ROUTER_HTTP_ADDR`).
//! A flag beats the variable, which beats the file, which beats the
//! default. Unknown file keys are refused (a typo must not silently keep a
//! default).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use protocol::HashingContract;
use serde::Deserialize;

use crate::core::{
    AlwaysDisagg, ConditionalDisaggPolicy, CostModel, DecodeSelection, GateConfig, IslBased,
    IslOrLoad, LedgerConfig, LoadBased, NeverDisagg, PrefillSelection, RouterConfig, SlaDynamic,
    TierWeights,
};

/// Why the settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading the config file {path}: {error}")]
    ReadFile {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("parsing the config file {path}: {error}")]
    ParseFile {
        path: PathBuf,
        error: Box<toml::de::Error>,
    },
    #[error("{key} is required: set --{flag}, SWITCHYARD_{env} or `{key}` in the config file")]
    Missing {
        key: &'static str,
        flag: &'static str,
        env: &'static str,
    },
    #[error("{key} = {value}: {expected}")]
    Invalid {
        key: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("unknown policy {0:?}: expected one of always-disagg, never-disagg (or aggregated), isl, load, isl-or-load, sla")]
    UnknownPolicy(String),
    #[error(transparent)]
    Core(#[from] crate::core::ConfigError),
}

/// Every setting, each optional: what one source (flags and environment,
/// or the file) says. See the module documentation for the names.
#[derive(Debug, Clone, Default, Deserialize, clap::Parser)]
#[command(
    name = "router",
    version,
    about = "Switchyard router replica: OpenAI-compatible completions routed to prefill and decode workers"
)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// TOML config file (keys are the flags' names with underscores).
    #[arg(long, env = "SWITCHYARD_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,

    /// NATS server URL. Default nats://127.0.0.1:4222.
    #[arg(long, env = "SWITCHYARD_NATS_URL")]
    pub nats_url: Option<String>,
    /// etcd endpoints, comma separated. Default http://127.0.0.1:2379.
    #[arg(long, env = "SWITCHYARD_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Option<Vec<String>>,
    /// HTTP listen address. Default 0.0.0.0:8080. (Its variable names the
    /// router: the worker agent has an HTTP address too.)
    #[arg(long, env = "SWITCHYARD_ROUTER_HTTP_ADDR")]
    pub http_addr: Option<SocketAddr>,
    /// This replica's id ([A-Za-z0-9_-]; it names its decision and progress
    /// subjects). Default: hostname-pid.
    #[arg(long, env = "SWITCHYARD_REPLICA_ID")]
    pub replica_id: Option<String>,

    /// The served model (required): part of the hashing contract workers
    /// must meet.
    #[arg(long, env = "SWITCHYARD_MODEL")]
    pub model: Option<String>,
    /// Tokens per KV block (hashing contract). Default 16.
    #[arg(long, env = "SWITCHYARD_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// HuggingFace tokenizer.json: enables text prompts and text output.
    #[arg(long, env = "SWITCHYARD_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,

    /// Policy: always-disagg, never-disagg (aggregated), isl, load,
    /// isl-or-load, sla. Default isl-or-load.
    #[arg(long, env = "SWITCHYARD_POLICY")]
    pub policy: Option<String>,
    /// isl: longest uncached append still prefilled locally is one less.
    /// Default 2048.
    #[arg(long, env = "SWITCHYARD_EFF_ISL_TOKENS")]
    pub eff_isl_tokens: Option<u32>,
    /// isl: largest uncached share of the prompt still prefilled locally.
    /// Default 0.7.
    #[arg(long, env = "SWITCHYARD_EFF_ISL_RATIO")]
    pub eff_isl_ratio: Option<f64>,
    /// load: queued prefill tokens (in max-size steps) above which a
    /// prefill worker is busy. Default 2.0.
    #[arg(long, env = "SWITCHYARD_PREFILL_BUSY")]
    pub prefill_busy: Option<f64>,
    /// load: KV usage from which a decode worker is too busy to prefill.
    /// Default 0.8.
    #[arg(long, env = "SWITCHYARD_DECODE_BUSY")]
    pub decode_busy: Option<f64>,
    /// sla: time-to-first-token target (ms). Default 2000.
    #[arg(long, env = "SWITCHYARD_TTFT_TARGET_MS")]
    pub ttft_target_ms: Option<f64>,
    /// sla: inter-token latency target (ms). Default 60.
    #[arg(long, env = "SWITCHYARD_ITL_TARGET_MS")]
    pub itl_target_ms: Option<f64>,

    /// Decode selection: cost removed per cached block. Default 1.0.
    #[arg(long, env = "SWITCHYARD_DECODE_OVERLAP_CREDIT")]
    pub decode_overlap_credit: Option<f64>,
    /// Decode selection: cost per block's worth of queued prefill. Default 1.0.
    #[arg(long, env = "SWITCHYARD_DECODE_QUEUE_WEIGHT")]
    pub decode_queue_weight: Option<f64>,
    /// Decode selection: KV usage from which a worker is skipped. Default 0.9.
    #[arg(long, env = "SWITCHYARD_DECODE_BUSY_KV_USAGE")]
    pub decode_busy_kv_usage: Option<f64>,
    /// Decode selection: waiting requests from which a worker is skipped.
    /// Default 16.
    #[arg(long, env = "SWITCHYARD_DECODE_BUSY_WAITING")]
    pub decode_busy_waiting: Option<u32>,
    /// Decode selection: softmax temperature (0: the cheapest). Default 0.
    #[arg(long, env = "SWITCHYARD_DECODE_TEMPERATURE")]
    pub decode_temperature: Option<f64>,
    /// Prefill selection: softmax temperature. Default 0.
    #[arg(long, env = "SWITCHYARD_PREFILL_TEMPERATURE")]
    pub prefill_temperature: Option<f64>,
    /// Weight of a block cached in host memory (device = 1). Default 0.5.
    #[arg(long, env = "SWITCHYARD_HOST_TIER_WEIGHT")]
    pub host_tier_weight: Option<f64>,
    /// Weight of a block cached on disk. Default 0.25.
    #[arg(long, env = "SWITCHYARD_DISK_TIER_WEIGHT")]
    pub disk_tier_weight: Option<f64>,

    /// Decode gate on or off. Default true.
    #[arg(long, env = "SWITCHYARD_GATE_ENABLED")]
    pub gate_enabled: Option<bool>,
    /// Decode gate: share of the KV capacity a bypass may fill. Default 0.95.
    #[arg(long, env = "SWITCHYARD_GATE_BUDGET_FRACTION")]
    pub gate_budget_fraction: Option<f64>,

    /// Ledger: an entry whose completion never arrives is dropped after
    /// this long (ms). Default 600000.
    #[arg(long, env = "SWITCHYARD_LEDGER_TTL_MS")]
    pub ledger_ttl_ms: Option<u64>,
    /// Ledger: how long a finished id is remembered (ms). Default 60000.
    #[arg(long, env = "SWITCHYARD_LEDGER_TOMBSTONE_TTL_MS")]
    pub ledger_tombstone_ttl_ms: Option<u64>,
    /// Ledger: delay a load report is assumed to lag decisions by (ms).
    /// Default 50.
    #[arg(long, env = "SWITCHYARD_REPORT_GRACE_MS")]
    pub report_grace_ms: Option<u64>,

    /// Dispatch: longest wait for a worker's first chunk (ms). Default 30000.
    #[arg(long, env = "SWITCHYARD_FIRST_CHUNK_TIMEOUT_MS")]
    pub first_chunk_timeout_ms: Option<u64>,
    /// Dispatch: longest wait between two chunks (ms). Default 30000.
    #[arg(long, env = "SWITCHYARD_IDLE_TIMEOUT_MS")]
    pub idle_timeout_ms: Option<u64>,
    /// Longest wait for the event loop's decision (ms). Default 2000.
    #[arg(long, env = "SWITCHYARD_ROUTE_TIMEOUT_MS")]
    pub route_timeout_ms: Option<u64>,
    /// On shutdown, in-flight HTTP requests get this long to finish (ms).
    /// Default 10000.
    #[arg(long, env = "SWITCHYARD_DRAIN_TIMEOUT_MS")]
    pub drain_timeout_ms: Option<u64>,
    /// Period of ledger expiry, gauges and delta-head polling (ms).
    /// Default 1000.
    #[arg(long, env = "SWITCHYARD_TICK_MS")]
    pub tick_ms: Option<u64>,

    /// Largest accepted request body (bytes). Default 33554432 (32 MiB).
    #[arg(long, env = "SWITCHYARD_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Size the index replica's block table for this many blocks: growing
    /// it past its size rebuilds it, which stops the event loop (and so
    /// every decision) for a while, about 20 ms per million blocks on a
    /// 2-vCPU VM. About 18 bytes per block. Default 1048576.
    #[arg(long, env = "SWITCHYARD_RESERVE_BLOCKS")]
    pub reserve_blocks: Option<usize>,
    /// max_tokens of a request that gives none. Default 16 (OpenAI's).
    #[arg(long, env = "SWITCHYARD_DEFAULT_MAX_TOKENS")]
    pub default_max_tokens: Option<u32>,
    /// Seed of the decisions' random draws (tie breaks, softmax picks);
    /// with the request, it fixes them, so every replica of a deployment
    /// must use the same one. Default 0.
    #[arg(long, env = "SWITCHYARD_SEED")]
    pub seed: Option<u64>,
}

macro_rules! merge_fields {
    ($high:expr, $low:expr; $($field:ident),* $(,)?) => {
        $( if $high.$field.is_none() { $high.$field = $low.$field; } )*
    };
}

impl Settings {
    /// These settings, completed by `lower` where they say nothing.
    pub fn or(mut self, lower: Settings) -> Settings {
        merge_fields!(self, lower;
            config, nats_url, etcd_endpoints, http_addr, replica_id, model, block_size,
            tokenizer, policy, eff_isl_tokens, eff_isl_ratio, prefill_busy, decode_busy,
            ttft_target_ms, itl_target_ms, decode_overlap_credit, decode_queue_weight,
            decode_busy_kv_usage, decode_busy_waiting, decode_temperature, prefill_temperature,
            host_tier_weight, disk_tier_weight, gate_enabled, gate_budget_fraction,
            ledger_ttl_ms, ledger_tombstone_ttl_ms, report_grace_ms, first_chunk_timeout_ms,
            idle_timeout_ms, route_timeout_ms, drain_timeout_ms, tick_ms, max_body_bytes,
            reserve_blocks, default_max_tokens, seed,
        );
        self
    }

    /// Reads a TOML config file.
    pub fn from_file(path: &Path) -> Result<Settings, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::ReadFile {
            path: path.to_owned(),
            error,
        })?;
        Self::from_toml(&text).map_err(|error| ConfigError::ParseFile {
            path: path.to_owned(),
            error: Box::new(error),
        })
    }

    /// Parses TOML config text.
    pub fn from_toml(text: &str) -> Result<Settings, toml::de::Error> {
        toml::from_str(text)
    }

    /// Flags and environment completed by the config file they name (if
    /// any), resolved and validated.
    pub fn load(self) -> Result<Config, ConfigError> {
        let merged = match &self.config {
            Some(path) => {
                let file = Self::from_file(path)?;
                self.or(file)
            }
            None => self,
        };
        Config::from_settings(merged)
    }
}

/// The bypass-or-remote policy and its parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyConfig {
    AlwaysDisagg,
    NeverDisagg,
    Isl(IslBased),
    Load(LoadBased),
    IslOrLoad(IslOrLoad),
    Sla(SlaDynamic),
}

impl PolicyConfig {
    /// The policy, for the core.
    pub fn build(&self) -> Box<dyn ConditionalDisaggPolicy> {
        match self {
            PolicyConfig::AlwaysDisagg => Box::new(AlwaysDisagg),
            PolicyConfig::NeverDisagg => Box::new(NeverDisagg),
            PolicyConfig::Isl(p) => Box::new(*p),
            PolicyConfig::Load(p) => Box::new(*p),
            PolicyConfig::IslOrLoad(p) => Box::new(*p),
            PolicyConfig::Sla(p) => Box::new(*p),
        }
    }
}

/// Dispatch and service timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Longest wait for a worker's first chunk of a leg.
    pub first_chunk: Duration,
    /// Longest wait between two chunks.
    pub idle: Duration,
    /// Longest wait for the event loop's answer to a route request.
    pub route: Duration,
    /// Grace for in-flight HTTP requests at shutdown.
    pub drain: Duration,
    /// Period of ledger expiry, gauges and delta-head polling.
    pub tick: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            first_chunk: Duration::from_secs(30),
            idle: Duration::from_secs(30),
            route: Duration::from_secs(2),
            drain: Duration::from_secs(10),
            tick: Duration::from_secs(1),
        }
    }
}

/// The resolved, validated configuration of a router replica.
#[derive(Debug, Clone)]
pub struct Config {
    pub nats_url: String,
    pub etcd_endpoints: Vec<String>,
    /// Where `main` binds the HTTP listener (`run` takes the listener).
    pub http_addr: SocketAddr,
    pub replica_id: String,
    /// The served model (also the hashing contract's).
    pub model: String,
    pub tokenizer: Option<PathBuf>,
    pub policy: PolicyConfig,
    /// The core's configuration (contract, selection, gate, ledger).
    pub router: RouterConfig,
    pub timeouts: Timeouts,
    pub max_body_bytes: usize,
    /// Blocks the index replica is sized for.
    pub reserve_blocks: usize,
    pub default_max_tokens: u32,
    /// The deployment's seed of decisions' draws (the same on every replica).
    pub seed: u64,
}

impl Config {
    /// Defaults for a model, talking to the given servers (what tests and
    /// embedders start from).
    pub fn new(
        nats_url: &str,
        etcd_endpoints: &[String],
        model: &str,
    ) -> Result<Self, ConfigError> {
        Config::from_settings(Settings {
            nats_url: Some(nats_url.to_owned()),
            etcd_endpoints: Some(etcd_endpoints.to_vec()),
            model: Some(model.to_owned()),
            ..Settings::default()
        })
    }

    /// Applies the defaults and checks every value.
    pub fn from_settings(s: Settings) -> Result<Config, ConfigError> {
        let policy = policy(&s)?;
        let model = s.model.ok_or(ConfigError::Missing {
            key: "model",
            flag: "model",
            env: "MODEL",
        })?;
        if model.trim().is_empty() {
            return Err(invalid("model", "\"\"", "must not be empty"));
        }
        let block_size = s.block_size.unwrap_or(16);
        if block_size == 0 {
            return Err(invalid("block_size", 0, "must be at least 1"));
        }
        let replica_id = match s.replica_id {
            Some(id) => {
                if !valid_token(&id) {
                    return Err(invalid(
                        "replica_id",
                        format!("{id:?}"),
                        "must be 1 to 128 characters of [A-Za-z0-9_-] (it is a NATS subject token)",
                    ));
                }
                id
            }
            None => default_replica_id(),
        };
        let etcd_endpoints = s
            .etcd_endpoints
            .unwrap_or_else(|| vec!["http://127.0.0.1:2379".into()]);
        if etcd_endpoints.is_empty() || etcd_endpoints.iter().any(|e| e.trim().is_empty()) {
            return Err(invalid(
                "etcd_endpoints",
                format!("{etcd_endpoints:?}"),
                "needs at least one non-empty endpoint",
            ));
        }

        let non_negative = |key: &'static str, v: Option<f64>, default: f64| match v {
            Some(v) if !(v.is_finite() && v >= 0.0) => {
                Err(invalid(key, v, "must be a finite number >= 0"))
            }
            v => Ok(v.unwrap_or(default)),
        };
        let weights = TierWeights {
            host: non_negative("host_tier_weight", s.host_tier_weight, 0.5)?,
            disk: non_negative("disk_tier_weight", s.disk_tier_weight, 0.25)?,
        };
        let d = DecodeSelection::default();
        let decode = DecodeSelection {
            overlap_credit: non_negative(
                "decode_overlap_credit",
                s.decode_overlap_credit,
                d.overlap_credit,
            )?,
            tier_weights: weights,
            queue_weight: non_negative(
                "decode_queue_weight",
                s.decode_queue_weight,
                d.queue_weight,
            )?,
            busy_kv_usage: non_negative(
                "decode_busy_kv_usage",
                s.decode_busy_kv_usage,
                d.busy_kv_usage,
            )?,
            busy_waiting: s.decode_busy_waiting.unwrap_or(d.busy_waiting),
            temperature: non_negative("decode_temperature", s.decode_temperature, d.temperature)?,
        };
        let prefill = PrefillSelection {
            tier_weights: weights,
            temperature: non_negative(
                "prefill_temperature",
                s.prefill_temperature,
                PrefillSelection::default().temperature,
            )?,
        };
        let g = GateConfig::default();
        let gate = GateConfig {
            enabled: s.gate_enabled.unwrap_or(g.enabled),
            budget_fraction: match s.gate_budget_fraction {
                Some(v) if !(v.is_finite() && v > 0.0) => {
                    return Err(invalid(
                        "gate_budget_fraction",
                        v,
                        "must be a finite number > 0",
                    ))
                }
                v => v.unwrap_or(g.budget_fraction),
            },
            count_reservations: true,
        };
        let l = LedgerConfig::default();
        let ledger = LedgerConfig {
            ttl_ms: positive_u64("ledger_ttl_ms", s.ledger_ttl_ms, l.ttl_ms)?,
            tombstone_ttl_ms: s.ledger_tombstone_ttl_ms.unwrap_or(l.tombstone_ttl_ms),
            report_grace_ms: s.report_grace_ms.unwrap_or(l.report_grace_ms),
        };
        let router = RouterConfig {
            contract: HashingContract::for_model(&model, block_size),
            decode,
            prefill,
            gate,
            ledger,
        };
        router.validate()?;

        let t = Timeouts::default();
        let ms = |key, v: Option<u64>, default: Duration| {
            positive_u64(key, v, default.as_millis() as u64).map(Duration::from_millis)
        };
        let timeouts = Timeouts {
            first_chunk: ms(
                "first_chunk_timeout_ms",
                s.first_chunk_timeout_ms,
                t.first_chunk,
            )?,
            idle: ms("idle_timeout_ms", s.idle_timeout_ms, t.idle)?,
            route: ms("route_timeout_ms", s.route_timeout_ms, t.route)?,
            drain: Duration::from_millis(s.drain_timeout_ms.unwrap_or(t.drain.as_millis() as u64)),
            tick: ms("tick_ms", s.tick_ms, t.tick)?,
        };
        let max_body_bytes = s.max_body_bytes.unwrap_or(32 << 20);
        if max_body_bytes < 1024 {
            return Err(invalid(
                "max_body_bytes",
                max_body_bytes,
                "must be at least 1024",
            ));
        }
        let default_max_tokens = s.default_max_tokens.unwrap_or(16);
        if default_max_tokens == 0 {
            return Err(invalid("default_max_tokens", 0, "must be at least 1"));
        }

        Ok(Config {
            nats_url: s.nats_url.unwrap_or_else(|| "nats://127.0.0.1:4222".into()),
            etcd_endpoints,
            http_addr: s
                .http_addr
                .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 8080))),
            replica_id,
            model,
            tokenizer: s.tokenizer,
            policy,
            router,
            timeouts,
            max_body_bytes,
            reserve_blocks: s
                .reserve_blocks
                .unwrap_or(kv_indexer::DEFAULT_RESERVE_BLOCKS),
            default_max_tokens,
            seed: s.seed.unwrap_or(0),
        })
    }
}

fn invalid(key: &'static str, value: impl ToString, expected: &'static str) -> ConfigError {
    ConfigError::Invalid {
        key,
        value: value.to_string(),
        expected,
    }
}

fn positive_u64(key: &'static str, v: Option<u64>, default: u64) -> Result<u64, ConfigError> {
    match v {
        Some(0) => Err(invalid(key, 0, "must be at least 1")),
        v => Ok(v.unwrap_or(default)),
    }
}

fn policy(s: &Settings) -> Result<PolicyConfig, ConfigError> {
    let ratio = |key: &'static str, v: Option<f64>, default: f64| match v {
        Some(v) if !(v.is_finite() && v >= 0.0) => {
            Err(invalid(key, v, "must be a finite number >= 0"))
        }
        v => Ok(v.unwrap_or(default)),
    };
    let target = |key: &'static str, v: Option<f64>, default: f64| match v {
        Some(v) if !(v.is_finite() && v > 0.0) => {
            Err(invalid(key, v, "must be a finite number > 0"))
        }
        v => Ok(v.unwrap_or(default)),
    };
    let di = IslBased::default();
    let isl = IslBased {
        eff_isl_tokens: s.eff_isl_tokens.unwrap_or(di.eff_isl_tokens),
        eff_isl_ratio: ratio("eff_isl_ratio", s.eff_isl_ratio, di.eff_isl_ratio)?,
    };
    let dl = LoadBased::default();
    let load = LoadBased {
        prefill_busy: ratio("prefill_busy", s.prefill_busy, dl.prefill_busy)?,
        decode_busy: ratio("decode_busy", s.decode_busy, dl.decode_busy)?,
    };
    let name = s.policy.as_deref().unwrap_or("isl-or-load");
    Ok(
        match name.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "always-disagg" | "disagg" | "disaggregated" => PolicyConfig::AlwaysDisagg,
            "never-disagg" | "aggregated" | "agg" => PolicyConfig::NeverDisagg,
            "isl" => PolicyConfig::Isl(isl),
            "load" => PolicyConfig::Load(load),
            "isl-or-load" => PolicyConfig::IslOrLoad(IslOrLoad { isl, load }),
            "sla" => PolicyConfig::Sla(SlaDynamic::new(
                target("ttft_target_ms", s.ttft_target_ms, 2000.0)?,
                target("itl_target_ms", s.itl_target_ms, 60.0)?,
                CostModel::default(),
            )),
            _ => return Err(ConfigError::UnknownPolicy(name.to_owned())),
        },
    )
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
mod tests {
    use super::*;

    fn base() -> Settings {
        Settings {
            model: Some("m".into()),
            ..Settings::default()
        }
    }

    #[test]
    fn defaults_resolve() {
        let c = Config::from_settings(base()).unwrap();
        assert_eq!(c.router.contract, HashingContract::for_model("m", 16));
        assert!(matches!(c.policy, PolicyConfig::IslOrLoad(_)));
        assert!(valid_token(&c.replica_id), "{}", c.replica_id);
        assert_eq!(c.timeouts, Timeouts::default());
    }

    #[test]
    fn the_model_is_required() {
        let e = Config::from_settings(Settings::default()).unwrap_err();
        assert!(e.to_string().contains("SWITCHYARD_MODEL"), "{e}");
    }

    #[test]
    fn bad_values_are_named() {
        for (settings, key) in [
            (
                Settings {
                    block_size: Some(0),
                    ..base()
                },
                "block_size",
            ),
            (
                Settings {
                    replica_id: Some("a.b".into()),
                    ..base()
                },
                "replica_id",
            ),
            (
                Settings {
                    eff_isl_ratio: Some(f64::NAN),
                    policy: Some("isl".into()),
                    ..base()
                },
                "eff_isl_ratio",
            ),
            (
                Settings {
                    gate_budget_fraction: Some(0.0),
                    ..base()
                },
                "gate_budget_fraction",
            ),
            (
                Settings {
                    first_chunk_timeout_ms: Some(0),
                    ..base()
                },
                "first_chunk_timeout_ms",
            ),
            (
                Settings {
                    decode_temperature: Some(-1.0),
                    ..base()
                },
                "decode_temperature",
            ),
        ] {
            let e = Config::from_settings(settings).unwrap_err().to_string();
            assert!(e.starts_with(key), "{e}");
        }
        let e = Config::from_settings(Settings {
            policy: Some("fastest".into()),
            ..base()
        })
        .unwrap_err();
        assert!(matches!(e, ConfigError::UnknownPolicy(_)), "{e}");
    }

    #[test]
    fn policies_by_name() {
        for (name, expected) in [
            ("always-disagg", "always_disagg"),
            ("never_disagg", "never_disagg"),
            ("aggregated", "never_disagg"),
            ("isl", "isl"),
            ("load", "load"),
            ("ISL-or-load", "isl_or_load"),
            ("sla", "sla_dynamic"),
        ] {
            let c = Config::from_settings(Settings {
                policy: Some(name.into()),
                ..base()
            })
            .unwrap();
            let got = c.policy.build();
            assert!(
                got.name().starts_with(expected.split('_').next().unwrap()),
                "{name}: {}",
                got.name()
            );
        }
    }

    #[test]
    fn flags_beat_the_file_and_unknown_keys_are_refused() {
        let file = Settings::from_toml(
            "model = \"from-file\"\nblock_size = 32\npolicy = \"isl\"\neff_isl_tokens = 512\n",
        )
        .unwrap();
        let flags = Settings {
            block_size: Some(64),
            ..Settings::default()
        };
        let c = Config::from_settings(flags.or(file)).unwrap();
        assert_eq!(c.model, "from-file");
        assert_eq!(c.router.contract.block_size, 64);
        assert_eq!(
            c.policy,
            PolicyConfig::Isl(IslBased {
                eff_isl_tokens: 512,
                ..IslBased::default()
            })
        );
        let e = Settings::from_toml("modle = \"x\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("modle"), "{e}");
    }

    #[test]
    fn flags_and_environment_parse() {
        use clap::Parser;
        let s = Settings::try_parse_from([
            "router",
            "--model",
            "m",
            "--etcd-endpoints",
            "http://a:1,http://b:2",
            "--policy",
            "sla",
            "--ttft-target-ms",
            "500",
        ])
        .unwrap();
        let c = s.load().unwrap();
        assert_eq!(c.etcd_endpoints, vec!["http://a:1", "http://b:2"]);
        match c.policy {
            PolicyConfig::Sla(p) => assert_eq!(p.ttft_target_ms, 500.0),
            other => panic!("{other:?}"),
        }
    }
}
