//! `GET /v1/models` and `GET /v1/models/{id}`: the one model this router
//! serves (its hashing contract's), with its context length when known.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::openai::{ModelCard, ModelList};
use super::{json_response, App};

impl App {
    fn model_card(&self) -> ModelCard<'_> {
        ModelCard {
            id: &self.model,
            object: "model",
            created: self.started_unix,
            owned_by: "switchyard",
            root: &self.model,
            parent: None,
            max_model_len: self.context_len(),
        }
    }
}

pub(super) async fn list(State(app): State<Arc<App>>) -> Response {
    json_response(
        StatusCode::OK,
        &ModelList {
            object: "list",
            data: [app.model_card()],
        },
    )
}

pub(super) async fn one(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if id != app.model {
        return ApiError::unknown_model("-", &id, &app.model).into_response();
    }
    json_response(StatusCode::OK, &app.model_card())
}
