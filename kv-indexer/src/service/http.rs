//! HTTP endpoints: `GET /metrics` (Prometheus text), `GET /healthz` (200
//! while the service runs, standby or leader), `GET /readyz` (200 only
//! while this indexer leads and its loop runs; 503 naming the role
//! otherwise) and `GET /status` (JSON, answered by the loop: role, delta
//! sequences, index size, digest; a standby answers its role and the
//! leader). `/status` names every
//! worker and what it holds: it needs the admin token when one is set
//! (`Authorization: Bearer TOKEN`), else a client on loopback.

use std::sync::Arc;
use std::time::Duration;

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};

use super::metrics::Metrics;
use super::standby::Role;

/// A `/status` request to the service loop.
pub type StatusRequest = oneshot::Sender<serde_json::Value>;

const STATUS_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    status: mpsc::Sender<StatusRequest>,
    admin_token: Option<bus::Secret>,
    role: watch::Receiver<Role>,
}

pub fn router(
    metrics: Arc<Metrics>,
    status: mpsc::Sender<StatusRequest>,
    admin_token: Option<bus::Secret>,
    role: watch::Receiver<Role>,
) -> Router {
    Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status_json))
        .with_state(AppState {
            metrics,
            status,
            admin_token,
            role,
        })
}

/// Whether a `/status` request may be answered: the admin token when one
/// is set, else a loopback peer.
fn admitted(admin_token: Option<&bus::Secret>, headers: &HeaderMap, peer: SocketAddr) -> bool {
    match admin_token {
        Some(token) => headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| given.trim() == token.expose()),
        None => peer.ip().is_loopback(),
    }
}

/// Serves until `stop` fires (or its sender is dropped).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    stop: oneshot::Receiver<()>,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
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

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let role = *state.role.borrow();
    match role {
        _ if state.status.is_closed() => (StatusCode::SERVICE_UNAVAILABLE, "stopped\n".to_owned()),
        Role::Leader => match state
            .metrics
            .refused_because
            .lock()
            .expect("no panic while held")
            .as_deref()
        {
            Some(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("leader: JetStream refuses the deltas (retrying): {why}\n"),
            ),
            None => (StatusCode::OK, "leader\n".to_owned()),
        },
        Role::Standby | Role::Recovering => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}: not leading\n", role.as_str()),
        ),
    }
}

async fn status_json(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, StatusCode> {
    if !admitted(state.admin_token.as_ref(), &headers, peer) {
        return Err(StatusCode::FORBIDDEN);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_needs_the_token_or_loopback() {
        let loopback: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let remote: SocketAddr = "10.0.0.7:1".parse().unwrap();
        let none = HeaderMap::new();
        let mut with = HeaderMap::new();
        with.insert(header::AUTHORIZATION, "Bearer t0k".parse().unwrap());
        assert!(admitted(None, &none, loopback));
        assert!(!admitted(None, &none, remote));
        let token = bus::Secret::new("t0k");
        assert!(admitted(Some(&token), &with, remote));
        assert!(!admitted(Some(&token), &none, loopback));
    }
}
