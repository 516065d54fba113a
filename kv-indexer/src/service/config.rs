//! The service's configuration: the raw arguments ([`Args`]: flags, each
//! also a `SWITCHYARD_*` variable, and a TOML file) layered into a
//! validated [`Config`] (see the `settings` crate). Defaults are
//! [`Config::default`]; `--help` shows them.

use std::net::SocketAddr;
use std::time::Duration;

use bus::StreamLimits;
use serde::{Deserialize, Serialize};
use settings::{Deprecation, Flag, Kind, SettingsError};

use crate::DEFAULT_RESERVE_BLOCKS;

pub use settings::Args;

/// Everything `kv-indexer` can be told.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// NATS server (with JetStream).
    pub nats_url: String,
    /// etcd endpoints.
    pub etcd_endpoints: Vec<String>,
    /// NATS credentials and TLS (`[nats]`).
    pub nats: bus::NatsAuth,
    /// etcd credentials and TLS (`[etcd]`).
    pub etcd: bus::EtcdAuth,
    /// Name of the durable JetStream consumer over the workers' KV events.
    pub consumer: String,
    /// Address of the HTTP endpoints (`/metrics`, `/healthz`, `/status`).
    pub http_addr: SocketAddr,
    /// Keep at most this many distinct blocks in the index; beyond it the
    /// least recently touched are evicted (and the eviction is a delta).
    pub max_blocks: Option<u64>,
    /// Blocks the index's table is sized for at start (at most
    /// `max_blocks`).
    pub reserve_blocks: usize,
    /// Store a snapshot at least this often (when the index changed).
    #[serde(with = "settings::duration")]
    pub snapshot_interval: Duration,
    /// Store a snapshot after this many deltas, whatever the interval.
    pub snapshot_every_deltas: u64,
    /// After a snapshot, deltas it covers are trimmed from the stream except
    /// this many most recent ones (for routers catching up).
    pub delta_margin: u64,
    /// Workers the index holds but etcd does not list are removed after
    /// this long.
    #[serde(with = "settings::duration")]
    pub worker_grace: Duration,
    /// How long to wait for a worker's agent to answer a resync request.
    #[serde(with = "settings::duration")]
    pub resync_timeout: Duration,
    /// At most one resync request per worker this often.
    #[serde(with = "settings::duration")]
    pub resync_interval: Duration,
    /// KV messages asked for per pull request (and applied per loop turn).
    pub fetch_batch: usize,
    /// Delta publishes awaiting the stream's confirmation at once.
    pub max_in_flight: usize,
    /// The KV consumer's ack wait: an unacked message is redelivered after
    /// this long.
    #[serde(with = "settings::duration")]
    pub ack_wait: Duration,
    /// How long the workers' KV events are kept.
    #[serde(with = "settings::duration")]
    pub kv_events_max_age: Duration,
    /// At most this many bytes of KV events are kept (0: no cap).
    #[serde(with = "settings::bytes")]
    pub kv_events_max_bytes: u64,
    /// How long the decision log keeps a decision.
    #[serde(with = "settings::duration")]
    pub decisions_max_age: Duration,
    /// At most this many bytes of decision log are kept (0: no cap).
    #[serde(with = "settings::bytes")]
    pub decisions_max_bytes: u64,
    /// A KV batch whose epoch is further ahead of the wall clock (agents
    /// number epochs in milliseconds since the Unix epoch) is rejected.
    #[serde(with = "settings::duration")]
    pub max_epoch_ahead: Duration,
    /// Bearer token of `/status`; none: loopback clients only.
    pub admin_token: Option<bus::Secret>,
    /// Copies JetStream keeps of each stream and of the snapshot store
    /// (set on existing streams at start, like the caps).
    pub stream_replicas: usize,
    /// The lease of this indexer's candidacy in the leader election (whole
    /// seconds): a killed leader's standby takes over about this long
    /// after the last renewal.
    #[serde(with = "settings::duration")]
    pub leader_ttl: Duration,
    /// Fault injection for tests: stop abruptly once delta N is confirmed,
    /// before its KV message is acked. Not a setting.
    #[serde(skip)]
    pub crash_after_delta: Option<u64>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            nats_url: "nats://127.0.0.1:4222".into(),
            etcd_endpoints: vec!["http://127.0.0.1:2379".into()],
            nats: bus::NatsAuth::default(),
            etcd: bus::EtcdAuth::default(),
            consumer: protocol::subjects::KV_INDEXER_CONSUMER.into(),
            http_addr: SocketAddr::from(([0, 0, 0, 0], 9091)),
            max_blocks: None,
            reserve_blocks: DEFAULT_RESERVE_BLOCKS,
            snapshot_interval: Duration::from_secs(30),
            snapshot_every_deltas: 200_000,
            delta_margin: 100_000,
            worker_grace: Duration::from_secs(10),
            resync_timeout: Duration::from_secs(5),
            resync_interval: Duration::from_secs(10),
            fetch_batch: 1024,
            max_in_flight: 8192,
            ack_wait: Duration::from_secs(60),
            kv_events_max_age: Duration::from_secs(24 * 3600),
            kv_events_max_bytes: 1 << 30,
            decisions_max_age: Duration::from_secs(24 * 3600),
            decisions_max_bytes: 1 << 30,
            max_epoch_ahead: Duration::from_secs(300),
            admin_token: None,
            stream_replicas: 1,
            leader_ttl: Duration::from_secs(1),
            crash_after_delta: None,
        }
    }
}

/// Why the settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Settings(#[from] SettingsError),
    #[error("{key} = {value}: {expected}")]
    Invalid {
        key: &'static str,
        value: String,
        expected: &'static str,
    },
}

/// Every flag; each also a variable (`SWITCHYARD_INDEXER_*` for the
/// indexer's own).
pub fn flags() -> Vec<Flag> {
    let mut flags = vec![
        Flag::new("nats_url", Kind::Text, "NATS server (with JetStream)"),
        Flag::new("etcd_endpoints", Kind::List, "etcd endpoints, comma separated"),
        Flag::new(
            "consumer",
            Kind::Text,
            "Name of the durable JetStream consumer over the workers' KV events",
        )
        .env("SWITCHYARD_INDEXER_CONSUMER"),
        Flag::new(
            "http_addr",
            Kind::Text,
            "Address of the HTTP endpoints (/metrics, /healthz, /status)",
        )
        .env("SWITCHYARD_INDEXER_HTTP_ADDR"),
        Flag::new(
            "max_blocks",
            Kind::Number,
            "Keep at most this many distinct blocks; beyond it the least recently touched are evicted [default: no cap]",
        )
        .env("SWITCHYARD_INDEXER_MAX_BLOCKS"),
        Flag::new(
            "reserve_blocks",
            Kind::Number,
            "Size the index's block table for this many blocks at start: growing it rebuilds it, which stops the indexer for a while (about 20 ms per million blocks on a 2-vCPU VM); about 18 bytes per block",
        )
        .env("SWITCHYARD_INDEXER_RESERVE_BLOCKS"),
        Flag::new(
            "snapshot_interval",
            Kind::Duration,
            "Store a snapshot at least this often (when the index changed)",
        )
        .env("SWITCHYARD_INDEXER_SNAPSHOT_INTERVAL"),
        Flag::new(
            "snapshot_every_deltas",
            Kind::Number,
            "Store a snapshot after this many deltas, whatever the interval",
        )
        .env("SWITCHYARD_INDEXER_SNAPSHOT_EVERY_DELTAS"),
        Flag::new(
            "delta_margin",
            Kind::Number,
            "After a snapshot, deltas it covers are trimmed except this many most recent ones (for routers catching up)",
        )
        .env("SWITCHYARD_INDEXER_DELTA_MARGIN"),
        Flag::new(
            "worker_grace",
            Kind::Duration,
            "Workers the index holds but etcd does not list are removed after this long (about one lease TTL)",
        )
        .env("SWITCHYARD_INDEXER_WORKER_GRACE"),
        Flag::new(
            "resync_timeout",
            Kind::Duration,
            "How long to wait for a worker's agent to answer a resync request",
        )
        .env("SWITCHYARD_INDEXER_RESYNC_TIMEOUT"),
        Flag::new(
            "resync_interval",
            Kind::Duration,
            "At most one resync request per worker this often",
        )
        .env("SWITCHYARD_INDEXER_RESYNC_INTERVAL"),
        Flag::new(
            "fetch_batch",
            Kind::Number,
            "KV messages asked for per pull request (and applied per loop turn)",
        )
        .env("SWITCHYARD_INDEXER_FETCH_BATCH"),
        Flag::new(
            "max_in_flight",
            Kind::Number,
            "Delta publishes awaiting the stream's confirmation at once; KV messages are acked once their delta is confirmed",
        )
        .env("SWITCHYARD_INDEXER_MAX_IN_FLIGHT"),
        Flag::new(
            "ack_wait",
            Kind::Duration,
            "The KV consumer's ack wait: an unacked message is redelivered after this long",
        )
        .env("SWITCHYARD_INDEXER_ACK_WAIT"),
        Flag::new(
            "kv_events_max_age",
            Kind::Duration,
            "How long the workers' KV events are kept (the indexer sets the streams' retention at start)",
        ),
        Flag::new(
            "kv_events_max_bytes",
            Kind::Bytes,
            "At most this many bytes of KV events are kept, the oldest dropped (0: no cap); events dropped before they were read show as gaps, which resyncing mends; JetStream reserves the bytes in its store",
        ),
        Flag::new(
            "decisions_max_age",
            Kind::Duration,
            "How long the decision log keeps a decision (for replay and explain)",
        ),
        Flag::new(
            "decisions_max_bytes",
            Kind::Bytes,
            "At most this many bytes of decision log are kept, the oldest dropped (0: no cap); a dispatched 8k-token request's record takes about 8 KB",
        ),
        Flag::new(
            "max_epoch_ahead",
            Kind::Duration,
            "Reject KV batches whose epoch (the agent's start, ms since the Unix epoch) is further ahead of this clock than this (a forged far-future epoch would make every real batch stale)",
        )
        .env("SWITCHYARD_INDEXER_MAX_EPOCH_AHEAD"),
        Flag::new(
            "admin_token",
            Kind::Text,
            "Bearer token of /status (it names every worker and what it holds); none: loopback clients only",
        )
        .env("SWITCHYARD_INDEXER_ADMIN_TOKEN"),
        bus::stream_replicas_flag(),
        Flag::new(
            "leader_ttl",
            Kind::Duration,
            "Lease of this indexer's candidacy in the leader election (whole seconds): only the leader consumes and publishes, a standby takes over about this long after a leader dies (etcd raises a TTL below 1.5 of its election timeouts)",
        )
        .env("SWITCHYARD_INDEXER_LEADER_TTL"),
    ];
    flags.extend(bus::auth_flags());
    flags
}

/// The command line's name, version and description.
pub fn command() -> clap::Command {
    clap::Command::new("kv-indexer")
        .version(env!("CARGO_PKG_VERSION"))
        .about("Switchyard's global KV block-ownership indexer")
}

/// The process's arguments (`--help` and bad flags exit here). A leading
/// `run` (the earlier release's only subcommand) is skipped.
pub fn args() -> Args {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == "run") {
        argv.remove(1);
    }
    Args::try_parse_from(command(), &flags(), &Config::default(), argv).unwrap_or_else(|e| e.exit())
}

/// A configuration, and the spellings of an earlier release it used.
#[derive(Debug)]
pub struct Loaded {
    pub config: Config,
    pub deprecations: Vec<Deprecation>,
}

impl Config {
    /// The defaults, with the given NATS server and etcd endpoints (what a
    /// test or an embedding program starts from).
    pub fn new(nats_url: impl Into<String>, etcd_endpoints: Vec<String>) -> Self {
        Self {
            nats_url: nats_url.into(),
            etcd_endpoints,
            ..Config::default()
        }
    }

    /// The raw arguments layered (file, variables, flags), deserialized and
    /// validated.
    pub fn from_args(args: &Args) -> Result<Loaded, ConfigError> {
        let (config, deprecations) = args.load::<Config>(&flags())?;
        Ok(Loaded {
            config: config.validate()?,
            deprecations,
        })
    }

    /// Checks what the types do not.
    pub fn validate(self) -> Result<Config, ConfigError> {
        let invalid = |key, value: &dyn std::fmt::Display, expected| ConfigError::Invalid {
            key,
            value: value.to_string(),
            expected,
        };
        if self.etcd_endpoints.is_empty() {
            return Err(invalid(
                "etcd_endpoints",
                &"[]",
                "needs at least one endpoint",
            ));
        }
        for (key, value) in [
            ("fetch_batch", self.fetch_batch),
            ("max_in_flight", self.max_in_flight),
        ] {
            if value == 0 {
                return Err(invalid(key, &0, "must be at least 1"));
            }
        }
        if self.consumer.trim().is_empty() {
            return Err(invalid("consumer", &"\"\"", "must not be empty"));
        }
        bus::check_replicas(self.stream_replicas)
            .map_err(|expected| invalid("stream_replicas", &self.stream_replicas, expected))?;
        if self.leader_ttl < Duration::from_secs(1) || self.leader_ttl.subsec_nanos() != 0 {
            return Err(invalid(
                "leader_ttl",
                &settings::format_duration(self.leader_ttl),
                "etcd leases count whole seconds: 1s or more",
            ));
        }
        Ok(self)
    }

    /// The streams' retention this indexer sets.
    pub fn stream_limits(&self) -> StreamLimits {
        let cap = |bytes: u64| (bytes > 0).then_some(bytes);
        StreamLimits {
            kv_events_max_age: self.kv_events_max_age,
            kv_events_max_bytes: cap(self.kv_events_max_bytes),
            decisions_max_age: self.decisions_max_age,
            decisions_max_bytes: cap(self.decisions_max_bytes),
            replicas: self.stream_replicas,
            ..StreamLimits::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Loaded, ConfigError> {
        let args = Args::try_parse_from(
            command(),
            &flags(),
            &Config::default(),
            std::iter::once("kv-indexer").chain(args.iter().copied()),
        )
        .expect("valid flags");
        Config::from_args(&args)
    }

    #[test]
    fn credentials_come_from_flags_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("indexer.toml");
        std::fs::write(
            &file,
            "[nats]\ncreds_file = \"/run/secrets/indexer.creds\"\ntls_ca = \"/etc/ca.pem\"\n[etcd]\nuser = \"indexer\"\npassword = \"from-file\"\n",
        )
        .unwrap();
        let config = parse(&[
            "--config",
            file.to_str().unwrap(),
            "--nats-tls-ca",
            "/etc/other-ca.pem",
        ])
        .unwrap()
        .config;
        assert_eq!(
            config.nats.creds_file.as_deref(),
            Some(std::path::Path::new("/run/secrets/indexer.creds"))
        );
        // The flag beats the file.
        assert_eq!(
            config.nats.tls_ca.as_deref(),
            Some(std::path::Path::new("/etc/other-ca.pem"))
        );
        assert_eq!(config.etcd.password, Some(bus::Secret::new("from-file")));
        assert!(!format!("{config:?}").contains("from-file"));
    }

    #[test]
    fn flags_and_defaults_agree() {
        let parsed = parse(&["--etcd-endpoints", "http://a:1,http://b:2"])
            .unwrap()
            .config;
        assert_eq!(parsed.etcd_endpoints, vec!["http://a:1", "http://b:2"]);
        assert_eq!(
            parsed,
            Config {
                etcd_endpoints: parsed.etcd_endpoints.clone(),
                ..Config::default()
            }
        );
        let c = parse(&[
            "--snapshot-interval",
            "500ms",
            "--kv-events-max-bytes",
            "512MiB",
            "--max-blocks",
            "60",
        ])
        .unwrap()
        .config;
        assert_eq!(c.snapshot_interval, Duration::from_millis(500));
        assert_eq!(c.kv_events_max_bytes, 512 << 20);
        assert_eq!(c.max_blocks, Some(60));
        let limits = Config {
            decisions_max_bytes: 0,
            ..Config::default()
        }
        .stream_limits();
        assert_eq!(limits.kv_events_max_bytes, Some(1 << 30));
        assert_eq!(limits.decisions_max_bytes, None, "0 is no cap");
    }

    #[test]
    fn high_availability_settings() {
        let c = parse(&[
            "--nats-url",
            "nats://a:4222,nats://b:4222",
            "--stream-replicas",
            "3",
            "--leader-ttl",
            "2s",
        ])
        .unwrap()
        .config;
        assert_eq!(c.stream_limits().replicas, 3);
        assert_eq!(c.leader_ttl, Duration::from_secs(2));
        assert_eq!(c.nats_url, "nats://a:4222,nats://b:4222");
        let e = parse(&["--stream-replicas", "7"]).unwrap_err().to_string();
        assert!(e.starts_with("stream_replicas = 7"), "{e}");
        let e = parse(&["--leader-ttl", "1500ms"]).unwrap_err().to_string();
        assert!(e.starts_with("leader_ttl = 1500ms"), "{e}");
    }

    #[test]
    fn bad_values_are_named() {
        let e = parse(&["--fetch-batch", "0"]).unwrap_err().to_string();
        assert!(e.starts_with("fetch_batch = 0"), "{e}");
        let mut args = Args::from_file(None);
        args.set("ack_wait", "soon");
        let e = Config::from_args(&args).unwrap_err().to_string();
        assert!(e.starts_with("ack_wait: \"soon\" is not a duration"), "{e}");
        let e = Args::try_parse_from(
            command(),
            &flags(),
            &Config::default(),
            ["kv-indexer", "--ack-wait", "5"],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not a duration"), "{e}");
    }

    #[test]
    fn help_shows_the_defaults() {
        let mut command = settings::command(command(), &flags(), &Config::default());
        let help = command.render_long_help().to_string();
        for expected in [
            "[default: 30s]",
            "[default: 1GiB]",
            "[default: 24h]",
            "SWITCHYARD_INDEXER_ACK_WAIT",
            "[default: kv-indexer]",
        ] {
            assert!(help.contains(expected), "{expected} not in\n{help}");
        }
    }
}
