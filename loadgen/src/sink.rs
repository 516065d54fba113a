//! An HTTP server that reads each `/v1/route` body and answers `{}`: the
//! floor of the route benchmark. Loaded like a router, it shows what the
//! load generator, loopback HTTP and the machine's scheduling cost on
//! their own, so that the router's figures can be read against it.

use std::net::SocketAddr;

use axum::body::Bytes;
use axum::routing::{get, post};

/// Serves until the process is stopped.
pub async fn run(addr: SocketAddr) -> anyhow::Result<()> {
    let app = axum::Router::new()
        .route("/v1/route", post(answer))
        .route("/healthz", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "sink listening");
    axum::serve(listener, app)
        .with_graceful_shutdown(bus::shutdown_signal())
        .await?;
    Ok(())
}

/// Reads the whole body (as a router must), then answers at once.
async fn answer(body: Bytes) -> &'static str {
    std::hint::black_box(body.len());
    "{}"
}
