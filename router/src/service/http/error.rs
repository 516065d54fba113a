//! Error responses: OpenAI's `{"error": {"message", "type", "code"}}`, plus
//! the `switchyard` annotation once a decision was made.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::fields::FieldError;
use super::openai::{ErrorBody, ErrorDetail, SwitchyardInfo};
use super::{json_response, set_header, DECISION_HEADER, REQUEST_ID_HEADER};
use crate::core::RouteError;
use crate::service::dispatch::DispatchError;
use crate::service::event_loop::AskError;

/// An error response.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    kind: &'static str,
    pub(super) message: String,
    param: Option<String>,
    request_id: String,
    info: Option<Box<SwitchyardInfo>>,
    /// `Retry-After` (s) of a 429.
    retry_after_s: Option<u32>,
}

/// OpenAI's error `type` of a status.
pub(super) fn kind_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        404 => "not_found_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        503 => "service_unavailable",
        504 => "timeout_error",
        _ => "server_error",
    }
}

impl ApiError {
    pub(super) fn new(status: StatusCode, request_id: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind: kind_of(status),
            message: message.into(),
            param: None,
            request_id: request_id.to_owned(),
            info: None,
            retry_after_s: None,
        }
    }

    pub(super) fn bad_request(request_id: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, request_id, message)
    }

    /// A field (or the body) is wrong: a 400 naming it.
    pub(super) fn field(request_id: &str, error: FieldError) -> Self {
        let mut e = Self::bad_request(request_id, error.message);
        e.param = error.param;
        e
    }

    /// The request names a model this router does not serve: OpenAI's
    /// 404.
    pub(super) fn unknown_model(request_id: &str, asked: &str, served: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            request_id,
            format!("The model `{asked}` does not exist: this router serves `{served}` (LoRA adapters go in `lora`)"),
        );
        e.param = Some("model".into());
        e
    }

    /// No decision could be made.
    pub(super) fn refused(error: &AskError, request_id: &str) -> Self {
        if let AskError::Route(RouteError::Saturated { retry_after_s, .. }) = error {
            let mut e = Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                request_id,
                format!("the deployment is saturated: {error}"),
            );
            e.retry_after_s = Some(*retry_after_s);
            return e;
        }
        if let AskError::Route(RouteError::Starting { retry_after_s, .. }) = error {
            let mut e = Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                request_id,
                error.to_string(),
            );
            e.retry_after_s = Some(*retry_after_s);
            return e;
        }
        let status = match error {
            AskError::Route(RouteError::EmptyPrompt | RouteError::PromptTooLong(_)) => {
                StatusCode::BAD_REQUEST
            }
            AskError::Route(
                RouteError::NoDecodeWorker
                | RouteError::NoOtherDecodeWorker { .. }
                | RouteError::NoCapableDecodeWorker { .. },
            )
            | AskError::Stopped
            | AskError::Timeout(_) => StatusCode::SERVICE_UNAVAILABLE,
            AskError::Route(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let message = match status {
            StatusCode::SERVICE_UNAVAILABLE => format!("no worker can serve this request: {error}"),
            _ => error.to_string(),
        };
        Self::new(status, request_id, message)
    }

    /// The dispatch failed before any header was sent.
    pub(super) fn dispatch(error: &DispatchError, request_id: &str, message: String) -> Self {
        let mut e = Self::new(dispatch_status(error), request_id, message);
        if let DispatchError::Rejected { param, .. } = error {
            e.param.clone_from(param);
        }
        e
    }

    pub(super) fn with_info(mut self, info: SwitchyardInfo) -> Self {
        self.info = Some(Box::new(info));
        self
    }
}

/// The engine's own 4xx for a request it refused, 504 for a worker that
/// timed out, else 502.
pub(super) fn dispatch_status(error: &DispatchError) -> StatusCode {
    if let DispatchError::Rejected { status, .. } = error {
        return StatusCode::from_u16(*status)
            .ok()
            .filter(StatusCode::is_client_error)
            .unwrap_or(StatusCode::BAD_REQUEST);
    }
    if let DispatchError::TooLarge { .. } = error {
        return StatusCode::PAYLOAD_TOO_LARGE;
    }
    if error.is_timeout() {
        StatusCode::GATEWAY_TIMEOUT
    } else {
        StatusCode::BAD_GATEWAY
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.status.as_u16(),
            },
            switchyard: self.info.as_deref(),
        };
        let mut response = json_response(self.status, &body);
        set_header(&mut response, REQUEST_ID_HEADER, &self.request_id);
        if let Some(info) = &self.info {
            set_header(&mut response, DECISION_HEADER, &info.decision);
        }
        if let Some(seconds) = self.retry_after_s {
            set_header(
                &mut response,
                axum::http::header::RETRY_AFTER,
                &seconds.to_string(),
            );
        }
        response
    }
}
