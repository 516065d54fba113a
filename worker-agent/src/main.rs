//! `worker-agent`: the sidecar beside one engine worker (here the built-in
//! simulated engine). Flags and `SWITCHYARD_*` variables: `--help`.

use clap::Parser;
use tracing_subscriber::EnvFilter;
use worker_agent::Config;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    worker_agent::run(config, bus::shutdown_signal()).await?;
    Ok(())
}
