//! `kv-indexer`: the indexer service. Flags and `SWITCHYARD_*` variables:
//! `--help`. (The trace benchmark is `kv-indexer-bench`.)

use anyhow::Context;
use kv_indexer::service::{self, config, Config};

fn main() -> anyhow::Result<()> {
    let args = config::args();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let loaded = Config::from_args(&args).context("invalid configuration")?;
    for deprecation in &loaded.deprecations {
        tracing::warn!("{deprecation}");
    }
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime
        .block_on(service::run(loaded.config, bus::shutdown_signal()))
        .context("kv-indexer failed")
}
