//! The service's configuration: command-line flags, each also read from a
//! `SWITCHYARD_*` environment variable.

use std::net::SocketAddr;
use std::time::Duration;

use bus::StreamLimits;

use crate::DEFAULT_RESERVE_BLOCKS;

/// Everything `kv-indexer run` can be told.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// NATS server (with JetStream).
    #[arg(long, env = "SWITCHYARD_NATS_URL", default_value = DEFAULT_NATS_URL)]
    pub nats_url: String,

    /// etcd endpoints, comma-separated.
    #[arg(
        long,
        env = "SWITCHYARD_ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = DEFAULT_ETCD_ENDPOINT
    )]
    pub etcd_endpoints: Vec<String>,

    /// Name of the durable JetStream consumer over the workers' KV events.
    #[arg(long, env = "SWITCHYARD_INDEXER_CONSUMER", default_value = DEFAULT_CONSUMER)]
    pub consumer: String,

    /// Address of the HTTP endpoints (`/metrics`, `/healthz`, `/status`).
    #[arg(long, env = "SWITCHYARD_INDEXER_HTTP_ADDR", default_value = DEFAULT_HTTP_ADDR)]
    pub http_addr: SocketAddr,

    /// Keep at most this many distinct blocks in the index; beyond it the
    /// least recently touched are evicted (and the eviction is a delta).
    #[arg(long, env = "SWITCHYARD_INDEXER_MAX_BLOCKS")]
    pub max_blocks: Option<u64>,

    /// Size the index's block table for this many blocks at start (at most
    /// --max-blocks): growing it past its size rebuilds it, which stops the
    /// indexer for a while (about 20 ms per million blocks on a 2-vCPU VM).
    /// Costs about 18 bytes per block.
    #[arg(long, env = "SWITCHYARD_INDEXER_RESERVE_BLOCKS", default_value_t = DEFAULT_RESERVE_BLOCKS)]
    pub reserve_blocks: usize,

    /// Store a snapshot at least this often (when the index changed), e.g.
    /// `30s`, `500ms`, `5m`.
    #[arg(long, env = "SWITCHYARD_INDEXER_SNAPSHOT_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub snapshot_interval: Duration,

    /// Store a snapshot after this many deltas, whatever the interval.
    #[arg(long, env = "SWITCHYARD_INDEXER_SNAPSHOT_EVERY_DELTAS", default_value_t = DEFAULT_SNAPSHOT_EVERY_DELTAS)]
    pub snapshot_every_deltas: u64,

    /// After a snapshot, deltas it covers are trimmed from the stream except
    /// this many most recent ones (for routers catching up).
    #[arg(long, env = "SWITCHYARD_INDEXER_DELTA_MARGIN", default_value_t = DEFAULT_DELTA_MARGIN)]
    pub delta_margin: u64,

    /// Workers the index holds but etcd does not list are removed after
    /// this long (about one lease TTL: a restarting agent re-registers
    /// within it).
    #[arg(long, env = "SWITCHYARD_INDEXER_WORKER_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub worker_grace: Duration,

    /// How long to wait for a worker's agent to answer a resync request.
    #[arg(long, env = "SWITCHYARD_INDEXER_RESYNC_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub resync_timeout: Duration,

    /// At most one resync request per worker this often.
    #[arg(long, env = "SWITCHYARD_INDEXER_RESYNC_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub resync_interval: Duration,

    /// KV messages asked for per pull request (and applied per loop turn).
    #[arg(long, env = "SWITCHYARD_INDEXER_FETCH_BATCH", default_value_t = DEFAULT_FETCH_BATCH)]
    pub fetch_batch: usize,

    /// Delta publishes awaiting the stream's confirmation at once; KV
    /// messages are acked once their delta is confirmed.
    #[arg(long, env = "SWITCHYARD_INDEXER_MAX_IN_FLIGHT", default_value_t = DEFAULT_MAX_IN_FLIGHT)]
    pub max_in_flight: usize,

    /// The KV consumer's ack wait: an unacked message is redelivered after
    /// this long.
    #[arg(long, env = "SWITCHYARD_INDEXER_ACK_WAIT", default_value = "60s", value_parser = parse_duration)]
    pub ack_wait: Duration,

    /// How long the workers' KV events are kept (the snapshots and the
    /// delta log make older ones unnecessary). The indexer sets the
    /// streams' retention at start.
    #[arg(long, env = "SWITCHYARD_KV_EVENTS_MAX_AGE", default_value = "24h", value_parser = parse_duration)]
    pub kv_events_max_age: Duration,

    /// At most this many bytes of KV events are kept, the oldest dropped
    /// (e.g. `512MiB`, `2GiB`; `0`: no cap). Events dropped before they
    /// were read show as gaps, which resyncing the workers mends. JetStream
    /// reserves the bytes in its store.
    #[arg(long, env = "SWITCHYARD_KV_EVENTS_MAX_BYTES", default_value = "1GiB", value_parser = parse_bytes)]
    pub kv_events_max_bytes: u64,

    /// How long the decision log keeps a decision (for replay and explain).
    #[arg(long, env = "SWITCHYARD_DECISIONS_MAX_AGE", default_value = "24h", value_parser = parse_duration)]
    pub decisions_max_age: Duration,

    /// At most this many bytes of decision log are kept, the oldest
    /// dropped (`0`: no cap). A dispatched 8k-token request's record takes
    /// about 8 KB.
    #[arg(long, env = "SWITCHYARD_DECISIONS_MAX_BYTES", default_value = "1GiB", value_parser = parse_bytes)]
    pub decisions_max_bytes: u64,

    /// Fault injection for tests: stop abruptly once delta N is confirmed,
    /// before its KV message is acked. Not a command-line flag.
    #[arg(skip)]
    pub crash_after_delta: Option<u64>,
}

pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
pub const DEFAULT_ETCD_ENDPOINT: &str = "http://127.0.0.1:2379";
pub const DEFAULT_CONSUMER: &str = "kv-indexer";
pub const DEFAULT_HTTP_ADDR: &str = "0.0.0.0:9091";
pub const DEFAULT_SNAPSHOT_EVERY_DELTAS: u64 = 200_000;
pub const DEFAULT_DELTA_MARGIN: u64 = 100_000;
pub const DEFAULT_FETCH_BATCH: usize = 1024;
pub const DEFAULT_MAX_IN_FLIGHT: usize = 8192;
pub const DEFAULT_STREAM_MAX_AGE: Duration = Duration::from_secs(24 * 3600);
pub const DEFAULT_STREAM_MAX_BYTES: u64 = 1 << 30;

impl Config {
    /// The defaults, with the given NATS server and etcd endpoints (what a
    /// test or an embedding program starts from).
    pub fn new(nats_url: impl Into<String>, etcd_endpoints: Vec<String>) -> Self {
        Self {
            nats_url: nats_url.into(),
            etcd_endpoints,
            consumer: DEFAULT_CONSUMER.to_owned(),
            http_addr: DEFAULT_HTTP_ADDR.parse().expect("valid default address"),
            max_blocks: None,
            reserve_blocks: DEFAULT_RESERVE_BLOCKS,
            snapshot_interval: Duration::from_secs(30),
            snapshot_every_deltas: DEFAULT_SNAPSHOT_EVERY_DELTAS,
            delta_margin: DEFAULT_DELTA_MARGIN,
            worker_grace: Duration::from_secs(10),
            resync_timeout: Duration::from_secs(5),
            resync_interval: Duration::from_secs(10),
            fetch_batch: DEFAULT_FETCH_BATCH,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            ack_wait: Duration::from_secs(60),
            kv_events_max_age: DEFAULT_STREAM_MAX_AGE,
            kv_events_max_bytes: DEFAULT_STREAM_MAX_BYTES,
            decisions_max_age: DEFAULT_STREAM_MAX_AGE,
            decisions_max_bytes: DEFAULT_STREAM_MAX_BYTES,
            crash_after_delta: None,
        }
    }

    /// The streams' retention this indexer sets.
    pub fn stream_limits(&self) -> StreamLimits {
        let cap = |bytes: u64| (bytes > 0).then_some(bytes);
        StreamLimits {
            kv_events_max_age: self.kv_events_max_age,
            kv_events_max_bytes: cap(self.kv_events_max_bytes),
            decisions_max_age: self.decisions_max_age,
            decisions_max_bytes: cap(self.decisions_max_bytes),
            ..StreamLimits::default()
        }
    }
}

/// `1GiB`, `512MiB`, `64KiB`, `2TiB`; a bare number is bytes.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (like 512MiB, 1GiB)"))?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        "TiB" => 40,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?} (B, KiB, MiB, GiB or TiB)"
            ))
        }
    };
    value
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// `250ms`, `2s`, `1.5s`, `5m`, `1h`; a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (like 500ms, 2s, 5m)"))?;
    let seconds = match unit.trim() {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?} (ms, s, m or h)"
            ))
        }
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("{text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("s").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("0"), Ok(0));
        assert!(parse_bytes("1GB").unwrap_err().contains("GiB"));
        assert!(parse_bytes("MiB").is_err());
        assert!(parse_bytes("99999999TiB")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn flags_and_defaults_agree() {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Cli {
            #[command(flatten)]
            config: Config,
        }
        let parsed =
            Cli::try_parse_from(["kv-indexer", "--etcd-endpoints", "http://a:1,http://b:2"])
                .unwrap()
                .config;
        let defaults = Config::new(DEFAULT_NATS_URL, vec![]);
        assert_eq!(parsed.etcd_endpoints, vec!["http://a:1", "http://b:2"]);
        assert_eq!(parsed.snapshot_interval, defaults.snapshot_interval);
        assert_eq!(parsed.worker_grace, defaults.worker_grace);
        assert_eq!(parsed.http_addr, defaults.http_addr);
        assert_eq!(parsed.ack_wait, defaults.ack_wait);
        assert_eq!(parsed.reserve_blocks, defaults.reserve_blocks);
        assert_eq!(parsed.kv_events_max_bytes, defaults.kv_events_max_bytes);
        assert_eq!(parsed.decisions_max_age, defaults.decisions_max_age);
        let limits = Config {
            decisions_max_bytes: 0,
            ..defaults
        }
        .stream_limits();
        assert_eq!(limits.kv_events_max_bytes, Some(DEFAULT_STREAM_MAX_BYTES));
        assert_eq!(limits.decisions_max_bytes, None, "0 is no cap");
    }
}
