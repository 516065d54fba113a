//! What operators look at: `/healthz`, `/readyz`, `/metrics` and
//! `/debug/ledger[?decision=ID]`.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use protocol::{DecisionId, Role};
use tokio::sync::oneshot;

use super::error::ApiError;
use super::openai::{LedgerBody, LedgerPeer, LedgerQuery, LedgerWorker, ReadyBody};
use super::{json_response, App};
use crate::service::event_loop::{Command, LedgerView, Readiness};

pub(super) async fn healthz() -> &'static str {
    "ok\n"
}

pub(super) async fn readyz(State(app): State<Arc<App>>) -> Response {
    let mut readiness = app.readiness.borrow().clone();
    if app.draining.load(std::sync::atomic::Ordering::Relaxed) {
        readiness = Readiness::not_ready(format!(
            "draining: shutting down, finishing the requests in flight ({})",
            readiness.status
        ));
    }
    let status = if readiness.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(
        status,
        &ReadyBody {
            ready: readiness.ready,
            status: &readiness.status,
            replica: &app.replica,
        },
    )
}

pub(super) async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        app.metrics.render(),
    )
        .into_response()
}

pub(super) async fn ledger(
    State(app): State<Arc<App>>,
    query: Result<Query<LedgerQuery>, QueryRejection>,
) -> Response {
    let request_id = format!("{}-ledger", app.replica);
    let query = match query {
        Ok(Query(q)) => q,
        Err(e) => return ApiError::bad_request(&request_id, e.body_text()).into_response(),
    };
    let decision = match query.decision {
        None => None,
        Some(text) => match text.parse::<DecisionId>() {
            Ok(id) => Some(id),
            Err(e) => return ApiError::bad_request(&request_id, e.to_string()).into_response(),
        },
    };
    let (reply, answer) = oneshot::channel();
    let ask = async {
        app.commands
            .send(Command::Ledger { decision, reply })
            .await
            .ok()?;
        answer.await.ok()
    };
    match tokio::time::timeout(app.route_timeout, ask).await {
        Ok(Some(view)) => json_response(StatusCode::OK, &render(&app.replica, view)),
        _ => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            &request_id,
            "the event loop did not answer",
        )
        .into_response(),
    }
}

fn render(replica: &str, view: LedgerView) -> LedgerBody {
    LedgerBody {
        replica: replica.to_owned(),
        in_flight: view.in_flight,
        applied_delta: view.applied_delta,
        index_digest: format!("{:016x}", view.index_digest),
        index_blocks: view.index_blocks,
        workers: view
            .workers
            .into_iter()
            .map(|w| LedgerWorker {
                worker: w.worker.to_string(),
                role: match w.role {
                    Role::Prefill => "prefill",
                    Role::Decode => "decode",
                    Role::Both => "both",
                },
                breaker: w.breaker.label(),
                charged_prefill_tokens: w.charges.prefill_tokens,
                charged_decode_blocks: w.charges.decode_blocks,
                charged_cache_blocks: w.charges.cache_blocks,
                charged_requests: w.charges.requests,
                effective_kv_blocks_used: w.load.map(|l| l.kv_blocks_used),
                effective_queued_prefill_tokens: w.load.map(|l| l.queued_prefill_tokens),
            })
            .collect(),
        knows_decision: view.knows_decision,
        peers: view
            .peers
            .into_iter()
            .map(|(replica, held)| LedgerPeer {
                replica: replica.to_string(),
                held_decisions: held,
            })
            .collect(),
    }
}
