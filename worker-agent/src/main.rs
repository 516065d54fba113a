//! `worker-agent`: the sidecar beside one engine worker. Flags and
//! `SWITCHYARD_*` variables: `--help`.

use anyhow::Context;
use tracing_subscriber::EnvFilter;
use worker_agent::{config, Config};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = config::args();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let loaded = Config::from_args(&args).context("invalid configuration")?;
    for deprecation in &loaded.deprecations {
        tracing::warn!("{deprecation}");
    }
    worker_agent::run(loaded.config, bus::shutdown_signal()).await?;
    Ok(())
}
