//! `GET /metrics` (Prometheus text) and `GET /healthz` (200 while NATS is
//! connected, 503 otherwise).

use std::future::Future;

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
}

/// Serves on `listener` until `shutdown` completes; `/metrics` renders
/// `metrics` (empty when `None`).
pub async fn serve(
    listener: TcpListener,
    metrics: Option<&'static PrometheusHandle>,
    nats: async_nats::Client,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(move || async move { metrics.map(|h| h.render()).unwrap_or_default() }),
        )
        .route("/healthz", get(healthz))
        .with_state(HttpState { nats });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn healthz(Extract(state): Extract<HttpState>) -> (StatusCode, &'static str) {
    match state.nats.connection_state() {
        State::Connected => (StatusCode::OK, "ok\n"),
        State::Pending | State::Disconnected => {
            (StatusCode::SERVICE_UNAVAILABLE, "NATS is not connected\n")
        }
    }
}
