//! `router`: one Switchyard router replica.

use std::io::IsTerminal;

use anyhow::Context;
use router::service::{self, config, Config};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = config::args();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_ansi(std::io::stdout().is_terminal())
        .init();
    let loaded = Config::from_args(&args).context("invalid configuration")?;
    for deprecation in &loaded.deprecations {
        tracing::warn!("{deprecation}");
    }
    let config = loaded.config;
    let listener = tokio::net::TcpListener::bind(config.http_addr)
        .await
        .with_context(|| format!("binding the HTTP listener on {}", config.http_addr))?;
    service::run(config, listener, bus::shutdown_signal())
        .await
        .context("the router failed")?;
    Ok(())
}
