//! `POST /v1/route`: the decision for a completion request, nothing
//! dispatched (`?explain=true`: with what it looked at).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::openai::RouteBody;
use super::{json_response, set_header, App, DECISION_HEADER, REQUEST_ID_HEADER};
use crate::service::dispatch::Purpose;

/// `?explain=true` on `/v1/route`.
#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct RouteQuery {
    #[serde(default)]
    explain: bool,
}

pub(super) async fn route(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    query: Result<Query<RouteQuery>, QueryRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request_id = app.request_id(&headers);
    let result = async {
        let Query(query) = query.map_err(|e| ApiError::bad_request(&request_id, e.body_text()))?;
        let mut parsed = app.parse(request_id.clone(), body)?;
        app.session_header(&mut parsed, &headers)?;
        let choice = parsed.single(&request_id)?;
        let purpose = Purpose::DryRun {
            explain: query.explain,
        };
        let assignment = app
            .dispatcher
            .decide(&choice.prepared, Vec::new(), purpose, None)
            .await
            .map_err(|e| ApiError::refused(&e, &request_id))?;
        let decision = &assignment.decision;
        let info = app.info(decision);
        let explanation = assignment
            .explanation
            .as_ref()
            .map(|e| crate::explain::to_json(decision, e, app.hasher.block_size()));
        let mut response = json_response(
            StatusCode::OK,
            &RouteBody {
                decision,
                switchyard: &info,
                explanation,
            },
        );
        set_header(&mut response, DECISION_HEADER, &info.decision);
        set_header(&mut response, REQUEST_ID_HEADER, &request_id);
        Ok::<_, ApiError>(response)
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}
