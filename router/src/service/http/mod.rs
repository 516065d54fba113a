//! The HTTP API (axum): the routes and what the handlers share.
//!
//! * `POST /v1/completions` ([`completions`]): OpenAI-compatible
//!   completions, streamed (SSE) or not; routed, dispatched, annotated with
//!   the decision.
//! * `POST /v1/route` ([`route`]): the decision for a completion request,
//!   without dispatching it (its ledger reservation is released at once).
//! * `GET /v1/models`, `GET /v1/models/{id}` ([`models`]): the served
//!   model.
//! * `GET /healthz` (also `/health`), `GET /readyz`, `GET /metrics`,
//!   `GET /debug/ledger` ([`ops`]).
//!
//! Every route is behind [`access`] (API keys, the admin token, routing
//! annotations stripped).
//!
//! Handlers parse and hash the prompt ([`request`]); the dispatcher asks
//! the event loop for decisions. Errors are OpenAI's shape ([`error`]);
//! the JSON types are in [`openai`].

pub mod access;
mod assemble;
mod completions;
mod error;
pub mod fields;
mod models;
pub mod openai;
mod ops;
mod request;
mod route;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use protocol::{BlockHasher, RouteDecision};
use serde::Serialize;
use tokio::sync::{mpsc, watch};

use super::dispatch::Dispatcher;
use super::event_loop::{Command, Readiness};
use super::metrics::Metrics;
use super::text::Text;
use error::ApiError;
use openai::SwitchyardInfo;

/// The decision id header.
pub const DECISION_HEADER: HeaderName = HeaderName::from_static("x-switchyard-decision");
/// The request id header (taken from the request when valid, else made).
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// What the handlers share.
pub struct App {
    pub commands: mpsc::Sender<Command>,
    pub hasher: BlockHasher,
    pub text: Option<Text>,
    /// The chat template of `/v1/chat/completions`.
    pub chat: Option<super::chat_template::ChatTemplate>,
    pub model: String,
    pub replica: Arc<str>,
    pub metrics: Metrics,
    pub readiness: watch::Receiver<Readiness>,
    /// Set at shutdown: `/readyz` says "draining" whatever the loop says.
    pub draining: std::sync::atomic::AtomicBool,
    pub dispatcher: Dispatcher,
    pub route_timeout: std::time::Duration,
    pub default_max_tokens: u32,
    /// `--max-model-len`: the context length requests are checked
    /// against, whatever the workers say.
    pub max_model_len: Option<u32>,
    /// The registered workers' smallest context length (0: none said).
    pub context: watch::Receiver<u32>,
    /// When the replica started (Unix seconds): the model's `created`.
    pub started_unix: u64,
    pub next_request: AtomicU64,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("replica", &self.replica)
            .finish_non_exhaustive()
    }
}

/// The routes.
pub fn router(app: Arc<App>, max_body_bytes: usize, access: access::Access) -> axum::Router {
    let metrics = app.metrics.clone();
    axum::Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/v1/route", post(route::route))
        .route("/v1/models", get(models::list))
        .route("/v1/models/{id}", get(models::one))
        .route("/healthz", get(ops::healthz))
        .route("/health", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/debug/ledger", get(ops::ledger))
        .route_layer(middleware::from_fn_with_state(
            Arc::new(access),
            access::guard,
        ))
        .route_layer(middleware::from_fn_with_state(metrics, count))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(app)
}

/// Counts responses by route and status.
async fn count(State(metrics): State<Metrics>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    metrics.http(&route, response.status().as_u16());
    response
}

impl App {
    /// The request's id: its `x-request-id` when valid (printable ASCII,
    /// at most 128 bytes), else `replica-n`.
    fn request_id(&self, headers: &HeaderMap) -> String {
        if let Some(id) = headers
            .get(&REQUEST_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        {
            return id.to_owned();
        }
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!("{}-{n}", self.replica)
    }

    fn info(&self, decision: &RouteDecision) -> SwitchyardInfo {
        SwitchyardInfo::new(decision, &self.replica)
    }
}

fn json_response(status: StatusCode, body: &impl Serialize) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            bytes,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn set_header(response: &mut Response, name: HeaderName, value: &str) {
    if let Ok(value) = HeaderValue::from_str(value) {
        response.headers_mut().insert(name, value);
    }
}

async fn not_found(State(app): State<Arc<App>>, method: Method, uri: Uri) -> Response {
    app.metrics.http("unmatched", 404);
    ApiError::new(
        StatusCode::NOT_FOUND,
        "-",
        format!("no route for {method} {}", uri.path()),
    )
    .into_response()
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "-",
        format!("{method} is not allowed on {}", uri.path()),
    )
    .into_response()
}
