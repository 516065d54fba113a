//! mock-vllm's flags (each with a `MOCK_VLLM_*` variable).

use std::net::SocketAddr;

use engine_sim::{KvTransfer, Preset};
use protocol::Role;
use worker_agent::{engine_model, EngineModelError};

use crate::wire::{Encoding, Flavour};

#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "mock-vllm",
    version,
    about = "A GPU-free vLLM stand-in: engine-sim behind vLLM's OpenAI API, ZMQ KV events (with replay) and Prometheus metrics"
)]
pub struct Config {
    /// HTTP port (OpenAI API, /metrics, /health, /switchyard/config).
    #[arg(long, env = "MOCK_VLLM_PORT", default_value_t = 8000)]
    pub port: u16,

    /// HTTP address to listen on.
    #[arg(long, env = "MOCK_VLLM_HOST", default_value = "0.0.0.0")]
    pub host: String,

    /// Served model name (default: the preset's model).
    #[arg(long, env = "MOCK_VLLM_MODEL")]
    pub model: Option<String>,

    /// engine-sim preset: llama70b_fp8_tp2_h100 or llama8b_h100.
    #[arg(
        long,
        env = "MOCK_VLLM_PRESET",
        default_value = "llama70b_fp8_tp2_h100"
    )]
    pub preset: String,

    /// What the engine does in a disaggregated deployment: prefill
    /// (kv_producer), decode (kv_consumer) or both. Plain requests are
    /// served by every role.
    #[arg(long, env = "MOCK_VLLM_ROLE", default_value = "both")]
    pub role: Role,

    /// Tokens per KV block.
    #[arg(long, env = "MOCK_VLLM_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,

    /// KV cache size in blocks (default: the preset's).
    #[arg(long, env = "MOCK_VLLM_KV_CAPACITY_BLOCKS")]
    pub kv_capacity_blocks: Option<u32>,

    /// KV-event PUB socket to bind for rank 0 (ranks offset the port).
    #[arg(
        long,
        env = "MOCK_VLLM_KV_EVENTS_ENDPOINT",
        default_value = "tcp://*:5557"
    )]
    pub kv_events_endpoint: String,

    /// KV-event replay ROUTER socket to bind for rank 0; `none` for none.
    #[arg(
        long,
        env = "MOCK_VLLM_KV_REPLAY_ENDPOINT",
        default_value = "tcp://*:5558"
    )]
    pub kv_replay_endpoint: String,

    /// KV events' topic.
    #[arg(long, env = "MOCK_VLLM_KV_EVENTS_TOPIC", default_value = "")]
    pub kv_events_topic: String,

    /// Batches and events as positional arrays or as maps.
    #[arg(long, env = "MOCK_VLLM_ENCODING", value_enum, default_value = "array")]
    pub encoding: Encoding,

    /// Whose block hashes and envelope: vLLM's (u64) or SGLang's (i64).
    #[arg(
        long,
        env = "MOCK_VLLM_HASH_FLAVOUR",
        value_enum,
        default_value = "vllm"
    )]
    pub hash_flavour: Flavour,

    /// Seed of the vLLM-flavour block hashes (default: random per process,
    /// as vLLM without PYTHONHASHSEED).
    #[arg(long, env = "MOCK_VLLM_HASH_SEED")]
    pub hash_seed: Option<u64>,

    /// Put the topic frame in replay replies (newer vLLM builds).
    #[arg(long, env = "MOCK_VLLM_REPLAY_TOPIC_FRAME", default_value_t = false, action = clap::ArgAction::Set)]
    pub replay_topic_frame: bool,

    /// Batches kept for replay.
    #[arg(long, env = "MOCK_VLLM_REPLAY_BUFFER", default_value_t = 10_000)]
    pub replay_buffer: usize,

    /// Data-parallel ranks (one engine and one publisher each).
    #[arg(long, env = "MOCK_VLLM_DATA_PARALLEL_SIZE", default_value_t = 1)]
    pub data_parallel_size: u32,

    /// Virtual step and transfer durations are divided by this.
    #[arg(long, env = "MOCK_VLLM_SPEEDUP", default_value_t = 1.0)]
    pub speedup: f64,

    /// KV transfer link for remote-prefilled decodes, GB/s.
    #[arg(long, env = "MOCK_VLLM_LINK_GB_S", default_value_t = 87.0)]
    pub link_gb_s: f64,

    /// Export the older `vllm:gpu_cache_usage_perc` instead of
    /// `vllm:kv_cache_usage_perc`.
    #[arg(long, env = "MOCK_VLLM_OLD_METRIC_NAMES", default_value_t = false, action = clap::ArgAction::Set)]
    pub old_metric_names: bool,

    /// This engine's id in the made-up kv_transfer_params of its prefills
    /// (default: random).
    #[arg(long, env = "MOCK_VLLM_ENGINE_ID")]
    pub engine_id: Option<String>,
}

/// A configuration that cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    EngineModel(#[from] EngineModelError),
    #[error("data-parallel size must be 1 to 64")]
    DataParallel,
    #[error("{0}")]
    Endpoint(String),
    #[error("listen address {0:?}: not host:port")]
    Listen(String),
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: SocketAddr,
    pub model: String,
    pub preset: Preset,
    pub role: Role,
    pub block_size: u32,
    pub kv_capacity_blocks: Option<u32>,
    /// Per rank: (PUB endpoint, replay endpoint).
    pub endpoints: Vec<(String, Option<String>)>,
    pub topic: String,
    pub encoding: Encoding,
    pub flavour: Flavour,
    pub hash_seed: u64,
    pub replay_topic_frame: bool,
    pub replay_buffer: usize,
    pub speedup: f64,
    pub link: KvTransfer,
    pub old_metric_names: bool,
    pub engine_id: String,
}

impl Config {
    pub fn validate(&self) -> Result<Settings, ConfigError> {
        let preset = engine_model(&self.preset, self.block_size, self.speedup, self.link_gb_s)?;
        if !(1..=64).contains(&self.data_parallel_size) {
            return Err(ConfigError::DataParallel);
        }
        let listen: SocketAddr = format!("{}:{}", self.host, self.port)
            .parse()
            .map_err(|_| ConfigError::Listen(format!("{}:{}", self.host, self.port)))?;
        let replay = Some(self.kv_replay_endpoint.trim()).filter(|e| !e.is_empty() && *e != "none");
        let mut endpoints = Vec::new();
        for rank in 0..self.data_parallel_size {
            let offset = |e: &str| {
                if !e.starts_with("tcp://") {
                    return Err(ConfigError::Endpoint(format!(
                        "endpoint {e:?} is not tcp://host:port"
                    )));
                }
                worker_agent::vllm::zmq::offset_endpoint(e, rank).map_err(ConfigError::Endpoint)
            };
            endpoints.push((
                offset(&self.kv_events_endpoint)?,
                replay.map(offset).transpose()?,
            ));
        }
        Ok(Settings {
            listen,
            model: self
                .model
                .clone()
                .unwrap_or_else(|| preset.model.to_owned()),
            preset,
            role: self.role,
            block_size: self.block_size,
            kv_capacity_blocks: self.kv_capacity_blocks,
            endpoints,
            topic: self.kv_events_topic.clone(),
            encoding: self.encoding,
            flavour: self.hash_flavour,
            hash_seed: self.hash_seed.unwrap_or_else(rand::random),
            replay_topic_frame: self.replay_topic_frame,
            replay_buffer: self.replay_buffer,
            speedup: self.speedup,
            link: KvTransfer {
                setup_us: 0,
                bytes_per_s: self.link_gb_s * 1e9,
            },
            old_metric_names: self.old_metric_names,
            engine_id: self
                .engine_id
                .clone()
                .unwrap_or_else(|| format!("mock-{:016x}", rand::random::<u64>())),
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[test]
    fn flags() {
        let c = Config::parse_from([
            "mock-vllm",
            "--port",
            "9000",
            "--host",
            "127.0.0.1",
            "--role",
            "prefill",
            "--encoding",
            "map",
            "--hash-flavour",
            "sglang",
            "--data-parallel-size",
            "2",
            "--kv-events-endpoint",
            "tcp://*:6000",
            "--kv-replay-endpoint",
            "tcp://*:6100",
        ]);
        let s = c.validate().unwrap();
        assert_eq!(s.listen.to_string(), "127.0.0.1:9000");
        assert_eq!(s.role, Role::Prefill);
        assert_eq!(s.encoding, Encoding::Map);
        assert_eq!(s.flavour, Flavour::Sglang);
        assert_eq!(
            s.endpoints,
            vec![
                ("tcp://*:6000".to_owned(), Some("tcp://*:6100".to_owned())),
                ("tcp://*:6001".to_owned(), Some("tcp://*:6101".to_owned())),
            ]
        );
        assert_eq!(s.model, "Llama-3.3-70B-Instruct-FP8");
        let mut bad = c.clone();
        bad.preset = "gpt".into();
        assert!(matches!(
            bad.validate(),
            Err(ConfigError::EngineModel(
                EngineModelError::UnknownPreset { .. }
            ))
        ));
        let mut bad = c.clone();
        bad.kv_replay_endpoint = "none".into();
        assert!(bad.validate().unwrap().endpoints[0].1.is_none());
        let mut bad = c;
        bad.kv_events_endpoint = "ipc:///x".into();
        assert!(bad.validate().is_err());
    }
}
