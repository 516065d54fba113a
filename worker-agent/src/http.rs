//! `GET /metrics` (Prometheus text) and `GET /healthz` (200 while NATS is
//! connected and JetStream accepts the KV events, 503 otherwise).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_nats::connection::State;
use axum::extract::State as Extract;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

#[derive(Debug, Clone)]
struct HttpState {
    nats: async_nats::Client,
    /// JetStream refuses KV batches for want of room in its store.
    store_full: Arc<AtomicBool>,
}

/// Serves on `listener` until `shutdown` completes; `/metrics` renders
/// `metrics` (empty when `None`).
pub async fn serve(
    listener: TcpListener,
    metrics: Option<&'static PrometheusHandle>,
    nats: async_nats::Client,
    store_full: Arc<AtomicBool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(move || async move { metrics.map(|h| h.render()).unwrap_or_default() }),
        )
        .route("/healthz", get(healthz))
        .with_state(HttpState { nats, store_full });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn healthz(Extract(state): Extract<HttpState>) -> (StatusCode, &'static str) {
    match state.nats.connection_state() {
        State::Connected if state.store_full.load(Ordering::Relaxed) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "JetStream does not accept KV events (its store is full, or it does not confirm them): held and retried\n",
        ),
        State::Connected => (StatusCode::OK, "ok\n"),
        State::Pending | State::Disconnected => {
            (StatusCode::SERVICE_UNAVAILABLE, "NATS is not connected\n")
        }
    }
}
