//! HTTP endpoints: `GET /metrics` (Prometheus text), `GET /healthz` (200
//! while the service loop runs) and `GET /status` (JSON, answered by the
//! loop: delta sequences, index size, digest).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use super::metrics::Metrics;

/// A `/status` request to the service loop.
pub type StatusRequest = oneshot::Sender<serde_json::Value>;

const STATUS_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    status: mpsc::Sender<StatusRequest>,
}

pub fn router(metrics: Arc<Metrics>, status: mpsc::Sender<StatusRequest>) -> Router {
    Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(healthz))
        .route("/status", get(status_json))
        .with_state(AppState { metrics, status })
}

/// Serves until `stop` fires (or its sender is dropped).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    stop: oneshot::Receiver<()>,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = stop.await;
        })
        .await
}

async fn render_metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}

async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    if state.status.is_closed() {
        (StatusCode::SERVICE_UNAVAILABLE, "stopped\n")
    } else {
        (StatusCode::OK, "ok\n")
    }
}

async fn status_json(State(state): State<AppState>) -> Result<Json<serde_json::Value>, StatusCode> {
    let (tx, rx) = oneshot::channel();
    state
        .status
        .send(tx)
        .await
        .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    match tokio::time::timeout(STATUS_TIMEOUT, rx).await {
        Ok(Ok(status)) => Ok(Json(status)),
        Ok(Err(_)) => Err(StatusCode::SERVICE_UNAVAILABLE),
        Err(_) => Err(StatusCode::GATEWAY_TIMEOUT),
    }
}
