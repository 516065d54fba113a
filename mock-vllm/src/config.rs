//! mock-vllm's configuration: the raw arguments ([`Args`]: flags, each also
//! a `MOCK_VLLM_*` variable, and a TOML file) read into [`Options`], then
//! validated into [`Config`] (see the `settings` crate).

use std::net::SocketAddr;
use std::time::Duration;

use engine_sim::{KvTransfer, Preset};
use protocol::Role;
use serde::{Deserialize, Serialize};
use settings::{Flag, Kind, SettingsError};
use worker_agent::{engine_model, EngineModelError};

use crate::nixl::KvLoadFailurePolicy;
use crate::wire::{Encoding, Flavour};

pub use settings::Args;

/// What the flags, variables and file say, each with its default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Options {
    pub port: u16,
    pub host: String,
    pub model: Option<String>,
    pub preset: String,
    /// `prefill`, `decode` or `both`.
    pub role: String,
    pub block_size: u32,
    pub kv_capacity_blocks: Option<u32>,
    pub kv_events_endpoint: String,
    pub kv_replay_endpoint: String,
    pub kv_events_topic: String,
    pub encoding: Encoding,
    pub hash_flavour: Flavour,
    pub hash_seed: Option<u64>,
    pub replay_topic_frame: bool,
    pub replay_buffer: usize,
    pub data_parallel_size: u32,
    pub speedup: f64,
    pub link_gb_s: f64,
    pub old_metric_names: bool,
    pub engine_id: Option<String>,
    /// LoRA adapters served beside the model (vLLM's `--lora-modules`).
    pub lora_modules: Vec<String>,
    /// The context length `/v1/models` reports and requests are held to.
    pub max_model_len: u32,
    /// Acts as an SGLang decode-mode server (with `role` decode): refuses
    /// `kv_transfer_params` and any request without `do_local_prefill`.
    pub sglang_decode: bool,
    /// vLLM's `bidirectional_kv_xfer` (NixlConnector, vLLM >= 0.21):
    /// export finished requests' blocks, and pull a prefix with a handle.
    pub bidirectional_kv_xfer: bool,
    /// How long exported blocks wait for their read.
    #[serde(with = "settings::duration")]
    pub decoder_kv_blocks_ttl: Duration,
    /// What a prefill does when its pull is declined.
    pub kv_load_failure_policy: KvLoadFailurePolicy,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            port: 8000,
            host: "0.0.0.0".into(),
            model: None,
            preset: Preset::llama70b_fp8_tp2_h100().name.into(),
            role: Role::Both.as_str().into(),
            block_size: engine_sim::DEFAULT_BLOCK_SIZE,
            kv_capacity_blocks: None,
            kv_events_endpoint: "tcp://*:5557".into(),
            kv_replay_endpoint: "tcp://*:5558".into(),
            kv_events_topic: String::new(),
            encoding: Encoding::Array,
            hash_flavour: Flavour::Vllm,
            hash_seed: None,
            replay_topic_frame: false,
            replay_buffer: 10_000,
            data_parallel_size: 1,
            speedup: 1.0,
            link_gb_s: 87.0,
            old_metric_names: false,
            engine_id: None,
            lora_modules: Vec::new(),
            max_model_len: 131_072,
            sglang_decode: false,
            bidirectional_kv_xfer: false,
            decoder_kv_blocks_ttl: Duration::from_secs(480),
            kv_load_failure_policy: KvLoadFailurePolicy::Fail,
        }
    }
}

/// Every flag of mock-vllm; its variables are `MOCK_VLLM_*`.
pub fn flags() -> Vec<Flag> {
    [
        Flag::new("port", Kind::Number, "HTTP port of the OpenAI API and /metrics"),
        Flag::new("host", Kind::Text, "HTTP listen host"),
        Flag::new("model", Kind::Text, "The served model's name [default: the preset's]"),
        Flag::new("preset", Kind::Text, "Engine preset: llama70b_fp8_tp2_h100 or llama8b_h100"),
        Flag::new(
            "role",
            Kind::Text,
            "prefill, decode or both: which kv_transfer_params it accepts (every role serves plain requests)",
        ),
        Flag::new("block_size", Kind::Number, "Tokens per KV block"),
        Flag::new(
            "kv_capacity_blocks",
            Kind::Number,
            "KV cache size in blocks [default: the preset's]",
        ),
        Flag::new(
            "kv_events_endpoint",
            Kind::Text,
            "KV-event PUB socket of data-parallel rank 0 (the port is offset by the rank)",
        ),
        Flag::new(
            "kv_replay_endpoint",
            Kind::Text,
            "KV-event replay ROUTER socket of rank 0 (none: no replay)",
        ),
        Flag::new("kv_events_topic", Kind::Text, "The KV events' topic"),
        Flag::new(
            "sglang_decode",
            Kind::Switch,
            "Act as an SGLang decode-mode server: kv_transfer_params refused (SGLang's bootstrap handshake instead), and a request without do_local_prefill refused (it cannot prefill locally)",
        ),
        Flag::new(
            "bidirectional_kv_xfer",
            Kind::Switch,
            "vLLM's bidirectional NIXL transfer (kv_connector_extra_config.bidirectional_kv_xfer): a request that came with kv_transfer_params exports its blocks when it finishes (the handle in its response's kv_transfer_params, streamed in the final chunk as with vLLM PR #40186), and a prefill whose kv_transfer_params are such a handle pulls that prefix from the engine named in it",
        ),
        Flag::new(
            "decoder_kv_blocks_ttl",
            Kind::Duration,
            "With --bidirectional-kv-xfer: how long exported blocks wait for their one read (vLLM's decoder_kv_blocks_ttl); a prefill engine reads a handle only until 5 s before then",
        ),
        Flag::new(
            "kv_load_failure_policy",
            Kind::Text,
            "With --bidirectional-kv-xfer: fail or recompute, what a prefill does when its pull is declined (vLLM's kv_load_failure_policy; fail: an HTTP 500, as vLLM's finish reason error)",
        ),
        Flag::new("encoding", Kind::Text, "KV batch encoding: array, map, or tagged (today's vLLM 0.33 / SGLang 0.5: an array batch of tagged-map events; vLLM's with 32-byte digests and group_idx)"),
        Flag::new(
            "hash_flavour",
            Kind::Text,
            "Whose hashes and envelope: vllm (u64) or sglang (i64, attn_dp_rank)",
        ),
        Flag::new(
            "hash_seed",
            Kind::Number,
            "Seed of the engine-private block hashes [default: random]",
        ),
        Flag::new(
            "replay_topic_frame",
            Kind::Switch,
            "Replay replies carry the topic frame (vLLM 0.33)",
        ),
        Flag::new("replay_buffer", Kind::Number, "KV batches kept for replay"),
        Flag::new("data_parallel_size", Kind::Number, "Data-parallel ranks (1 to 64)"),
        Flag::new(
            "speedup",
            Kind::Number,
            "Simulated engine speed-up: virtual step and transfer durations are divided by it",
        ),
        Flag::new("link_gb_s", Kind::Number, "Simulated KV transfer link, GB/s"),
        Flag::new(
            "old_metric_names",
            Kind::Switch,
            "Export the metric names of vLLM releases before 0.10",
        ),
        Flag::new(
            "engine_id",
            Kind::Text,
            "Engine id in kv_transfer_params [default: mock-<random>]",
        ),
        Flag::new(
            "lora_modules",
            Kind::List,
            "LoRA adapter names a request may give as its model (vLLM's --lora-modules)",
        ),
        Flag::new(
            "max_model_len",
            Kind::Number,
            "Context length (prompt + max_tokens) it reports in /v1/models and enforces, as vLLM's --max-model-len",
        ),
    ]
    .into_iter()
    .map(|f| f.env_prefix("MOCK_VLLM_"))
    .collect()
}

/// The command line's name, version and description.
pub fn command() -> clap::Command {
    clap::Command::new("mock-vllm")
        .version(env!("CARGO_PKG_VERSION"))
        .about("A GPU-free vLLM stand-in: engine-sim behind vLLM's OpenAI API, ZMQ KV events (with replay) and Prometheus metrics")
}

/// The process's arguments (`--help` and bad flags exit here).
pub fn args() -> Args {
    Args::parse(command(), &flags(), &Options::default())
}

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Settings(#[from] SettingsError),
    #[error("role {0:?}: expected prefill, decode or both")]
    Role(String),
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
pub struct Config {
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
    pub lora_modules: Vec<String>,
    pub max_model_len: u32,
    pub sglang_decode: bool,
    pub bidirectional_kv_xfer: bool,
    pub decoder_kv_blocks_ttl: Duration,
    pub kv_load_failure_policy: KvLoadFailurePolicy,
}

impl Config {
    /// The raw arguments layered (file, variables, flags), deserialized and
    /// validated.
    pub fn from_args(args: &Args) -> Result<Config, ConfigError> {
        let (options, _) = args.load::<Options>(&flags())?;
        options.validate()
    }
}

impl Options {
    /// Checks every value and converts them.
    pub fn validate(&self) -> Result<Config, ConfigError> {
        let preset = engine_model(&self.preset, self.block_size, self.speedup, self.link_gb_s)?;
        let role: Role = self
            .role
            .parse()
            .map_err(|_| ConfigError::Role(self.role.clone()))?;
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
        Ok(Config {
            listen,
            model: self
                .model
                .clone()
                .unwrap_or_else(|| preset.model.to_owned()),
            preset,
            role,
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
            lora_modules: self.lora_modules.clone(),
            max_model_len: self.max_model_len,
            sglang_decode: self.sglang_decode,
            bidirectional_kv_xfer: self.bidirectional_kv_xfer,
            decoder_kv_blocks_ttl: self.decoder_kv_blocks_ttl,
            kv_load_failure_policy: self.kv_load_failure_policy,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Options {
        let args = Args::try_parse_from(
            command(),
            &flags(),
            &Options::default(),
            std::iter::once("mock-vllm").chain(args.iter().copied()),
        )
        .expect("valid flags");
        args.load::<Options>(&flags()).unwrap().0
    }

    #[test]
    fn flags_parse() {
        let c = parse(&[
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

    #[test]
    fn variables_are_mock_vllm_s() {
        let mut command = settings::command(command(), &flags(), &Options::default());
        let help = command.render_long_help().to_string();
        assert!(help.contains("MOCK_VLLM_PORT"), "{help}");
        assert!(help.contains("[default: 8000]"), "{help}");
    }
}
