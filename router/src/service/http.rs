//! The HTTP API (axum).
//!
//! * `POST /v1/completions`: OpenAI-compatible completions, streamed (SSE)
//!   or not; routed, dispatched, annotated with the decision.
//! * `POST /v1/route`: the decision for a completion request, without
//!   dispatching it (its ledger reservation is released at once).
//! * `GET /healthz`, `GET /readyz`, `GET /metrics`.
//! * `GET /debug/ledger[?decision=ID]`: this replica's in-flight ledger.
//!
//! Handlers parse and hash the prompt, then ask the event loop for a
//! decision; errors are `{"error": {"message", "type", "code"}}`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, MatchedPath, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::stream;
use protocol::{BlockHasher, DecisionId, FinishReason, RouteDecision};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::Instrument;

use super::dispatch::{Dispatcher, Job, Out};
use super::metrics::Metrics;
use super::openai::{
    Choice, Completion, CompletionRequest, ErrorBody, ErrorDetail, LedgerQuery, Prompt, ReadyBody,
    RouteBody, SwitchyardInfo, Usage,
};
use super::state::{ask_route, AskError, Command, Readiness, RouteJob, Routed};
use super::text::Text;
use crate::core::RouteError;

/// The decision id header.
pub const DECISION_HEADER: HeaderName = HeaderName::from_static("x-switchyard-decision");
/// The request id header (taken from the request when valid, else made).
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// What the handlers share.
pub struct App {
    pub commands: mpsc::Sender<Command>,
    pub hasher: BlockHasher,
    pub text: Option<Text>,
    pub model: String,
    pub replica: Arc<str>,
    pub metrics: Metrics,
    pub readiness: watch::Receiver<Readiness>,
    pub dispatcher: Dispatcher,
    pub route_timeout: Duration,
    pub default_max_tokens: u32,
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
pub fn router(app: Arc<App>, max_body_bytes: usize) -> axum::Router {
    let metrics = app.metrics.clone();
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/route", post(route))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .route("/debug/ledger", get(ledger))
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

// --- Errors ---------------------------------------------------------------

/// An error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    request_id: String,
    info: Option<Box<SwitchyardInfo>>,
}

impl ApiError {
    fn new(status: StatusCode, request_id: &str, message: impl Into<String>) -> Self {
        let kind = match status.as_u16() {
            404 => "not_found_error",
            400..=499 => "invalid_request_error",
            503 => "service_unavailable",
            504 => "timeout_error",
            _ => "server_error",
        };
        Self {
            status,
            kind,
            message: message.into(),
            request_id: request_id.to_owned(),
            info: None,
        }
    }

    fn bad_request(request_id: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, request_id, message)
    }

    fn with_info(mut self, info: SwitchyardInfo) -> Self {
        self.info = Some(Box::new(info));
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind,
                code: self.status.as_u16(),
            },
            switchyard: self.info.as_deref(),
        };
        let mut response = json_response(self.status, &body);
        set_header(&mut response, REQUEST_ID_HEADER, &self.request_id);
        if let Some(info) = &self.info {
            set_header(&mut response, DECISION_HEADER, &info.decision);
        }
        response
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

fn route_error(error: AskError, request_id: &str, metrics: &Metrics) -> ApiError {
    let (status, label) = match &error {
        AskError::Route(RouteError::NoDecodeWorker) => {
            (StatusCode::SERVICE_UNAVAILABLE, "no_decode_worker")
        }
        AskError::Route(RouteError::NoOtherDecodeWorker { .. }) => {
            (StatusCode::SERVICE_UNAVAILABLE, "no_other_decode_worker")
        }
        AskError::Route(RouteError::EmptyPrompt) => (StatusCode::BAD_REQUEST, "empty_prompt"),
        AskError::Route(RouteError::PromptTooLong(_)) => {
            (StatusCode::BAD_REQUEST, "prompt_too_long")
        }
        AskError::Route(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        AskError::Stopped => (StatusCode::SERVICE_UNAVAILABLE, "stopping"),
        AskError::Timeout(_) => (StatusCode::SERVICE_UNAVAILABLE, "overloaded"),
    };
    metrics.route_error(label);
    let message = match status {
        StatusCode::SERVICE_UNAVAILABLE => format!("no worker can serve this request: {error}"),
        _ => error.to_string(),
    };
    ApiError::new(status, request_id, message)
}

// --- Requests ---------------------------------------------------------------

/// A parsed, tokenized and hashed request.
struct Prepared {
    request_id: String,
    tokens: Vec<u32>,
    hashes: Arc<[protocol::BlockHash]>,
    max_tokens: u32,
    stream: bool,
}

impl App {
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

    fn prepare(
        &self,
        request_id: String,
        body: Result<Bytes, BytesRejection>,
    ) -> Result<Prepared, ApiError> {
        let body = body.map_err(|rejection| {
            ApiError::new(rejection.status(), &request_id, rejection.body_text())
        })?;
        let request = CompletionRequest::parse(&body)
            .map_err(|message| ApiError::bad_request(&request_id, message))?;
        // One router serves one model (its hashing contract): the `model`
        // field is not checked (clients and load generators send aliases),
        // and responses name the served model.
        let max_tokens = match request.max_tokens {
            Some(0) => {
                return Err(ApiError::bad_request(
                    &request_id,
                    "max_tokens must be at least 1",
                ))
            }
            Some(n) => n,
            None => self.default_max_tokens,
        };
        let tokens = match request.prompt {
            Prompt::Tokens(tokens) => tokens,
            Prompt::Text(text) => match &self.text {
                Some(t) => t
                    .encode(&text)
                    .map_err(|e| ApiError::bad_request(&request_id, e.to_string()))?,
                None => {
                    return Err(ApiError::bad_request(
                        &request_id,
                        "the prompt is text, but this router has no tokenizer (start it with --tokenizer tokenizer.json): send the prompt as a list of token ids",
                    ))
                }
            },
        };
        if tokens.is_empty() {
            return Err(ApiError::bad_request(
                &request_id,
                "the prompt is empty: send at least one token",
            ));
        }
        if u32::try_from(tokens.len()).is_err() {
            return Err(ApiError::bad_request(
                &request_id,
                format!("a prompt of {} tokens is too long", tokens.len()),
            ));
        }
        let hashes: Arc<[protocol::BlockHash]> = self.hasher.hash_prompt(&tokens).into();
        Ok(Prepared {
            request_id,
            tokens,
            hashes,
            max_tokens,
            stream: request.stream,
        })
    }

    async fn decide(&self, p: &Prepared, dry_run: bool, explain: bool) -> Result<Routed, ApiError> {
        let started = Instant::now();
        let job = RouteJob {
            request_id: p.request_id.clone(),
            isl_tokens: p.tokens.len() as u32,
            hashes: p.hashes.clone(),
            expected_output_tokens: p.max_tokens,
            avoid: Vec::new(),
            dry_run,
            explain,
        };
        let routed = ask_route(&self.commands, job, self.route_timeout)
            .await
            .map_err(|e| route_error(e, &p.request_id, &self.metrics))?;
        self.metrics.route_latency(started.elapsed());
        Ok(routed)
    }

    fn info(&self, decision: &RouteDecision) -> SwitchyardInfo {
        SwitchyardInfo::new(decision, &self.replica)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

// --- Handlers ---------------------------------------------------------------

/// `?explain=true` on `/v1/route`.
#[derive(Debug, Default, serde::Deserialize)]
struct RouteQuery {
    #[serde(default)]
    explain: bool,
}

async fn route(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    query: Result<Query<RouteQuery>, QueryRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request_id = app.request_id(&headers);
    let result = async {
        let Query(query) = query.map_err(|e| ApiError::bad_request(&request_id, e.body_text()))?;
        let prepared = app.prepare(request_id.clone(), body)?;
        let routed = app.decide(&prepared, true, query.explain).await?;
        let info = app.info(&routed.decision);
        let explanation = routed
            .explanation
            .as_ref()
            .map(|e| crate::explain::to_json(&routed.decision, e, app.hasher.block_size()));
        let mut response = json_response(
            StatusCode::OK,
            &RouteBody {
                decision: &routed.decision,
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

async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request_id = app.request_id(&headers);
    let span = tracing::info_span!(
        "completion",
        request_id = %request_id,
        decision = tracing::field::Empty
    );
    async move {
        match serve_completion(&app, request_id, body).await {
            Ok(response) => response,
            Err(e) => {
                tracing::info!(status = e.status.as_u16(), error = %e.message, "request refused");
                e.into_response()
            }
        }
    }
    .instrument(span)
    .await
}

async fn serve_completion(
    app: &Arc<App>,
    request_id: String,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let prepared = app.prepare(request_id, body)?;
    let routed = app.decide(&prepared, false, false).await?;
    let span = tracing::Span::current();
    span.record("decision", tracing::field::display(routed.decision.id));
    let d = &routed.decision;
    tracing::info!(
        path = %d.path,
        decode = %d.decode,
        prefill = ?d.prefill.as_ref().map(|p| p.to_string()),
        decode_overlap_tokens = d.decode_overlap_tokens,
        isl_tokens = d.isl_tokens,
        rule = %d.rule,
        "routed"
    );
    let Prepared {
        request_id,
        tokens,
        hashes,
        max_tokens,
        stream,
    } = prepared;
    let prompt_tokens = tokens.len() as u32;
    let mut info = app.info(&routed.decision);
    let (tx, mut rx) = mpsc::channel(64);
    let job = Job {
        request_id: request_id.clone(),
        prompt: tokens,
        max_tokens,
        hashes,
    };
    tokio::spawn(
        app.dispatcher
            .clone()
            .serve(routed, job, tx)
            .instrument(span.clone()),
    );

    // Wait for the first token (or the end): a failure before it gets a
    // proper status, and a retry changes the decision before any header is
    // sent.
    let first = loop {
        match rx.recv().await {
            Some(Out::Rerouted { decision, retry_of }) => {
                span.record("decision", tracing::field::display(decision.id));
                info = app.info(&decision);
                info.retry_of = Some(retry_of.to_string());
            }
            Some(other) => break other,
            None => {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &request_id,
                    "the dispatcher ended without an answer",
                )
                .with_info(info))
            }
        }
    };
    if let Out::Failed { error, no_retry } = first {
        let status = if error.is_timeout() {
            StatusCode::GATEWAY_TIMEOUT
        } else {
            StatusCode::BAD_GATEWAY
        };
        let message = match no_retry {
            Some(why) => format!("{error} ({why})"),
            None => error.to_string(),
        };
        return Err(ApiError::new(status, &request_id, message).with_info(info));
    }
    let completion = Answer {
        app: app.clone(),
        id: format!("cmpl-{request_id}"),
        request_id,
        info,
        created: unix_now(),
        prompt_tokens,
    };
    if stream {
        Ok(completion.sse(first, rx, span))
    } else {
        completion.collect(first, rx).await
    }
}

/// A dispatched completion being answered.
struct Answer {
    app: Arc<App>,
    id: String,
    request_id: String,
    info: SwitchyardInfo,
    created: u64,
    prompt_tokens: u32,
}

impl Answer {
    fn completion<'a>(
        &'a self,
        text: &'a str,
        token_ids: &'a [u32],
        finish: Option<FinishReason>,
        usage: Option<Usage>,
        annotate: bool,
    ) -> Completion<'a> {
        Completion {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: &self.app.model,
            choices: [Choice {
                index: 0,
                text,
                token_ids,
                logprobs: None,
                finish_reason: finish.map(FinishReason::as_str),
            }],
            usage,
            switchyard: annotate.then_some(&self.info),
        }
    }

    fn headers(&self, response: &mut Response) {
        set_header(response, DECISION_HEADER, &self.info.decision);
        set_header(response, REQUEST_ID_HEADER, &self.request_id);
    }

    /// The whole answer as one JSON.
    async fn collect(self, first: Out, mut rx: mpsc::Receiver<Out>) -> Result<Response, ApiError> {
        let mut tokens = Vec::new();
        let mut next = Some(first);
        loop {
            let event = match next.take() {
                Some(event) => Some(event),
                None => rx.recv().await,
            };
            match event {
                Some(Out::Tokens(t)) => tokens.extend_from_slice(&t),
                Some(Out::Done { reason, .. }) => {
                    let text = self
                        .app
                        .text
                        .as_ref()
                        .map(|t| t.decode(&tokens))
                        .unwrap_or_default();
                    let usage = Usage::new(self.prompt_tokens, tokens.len() as u32);
                    tracing::info!(
                        output_tokens = tokens.len(),
                        finish = reason.as_str(),
                        "completed"
                    );
                    let mut response = json_response(
                        StatusCode::OK,
                        &self.completion(&text, &tokens, Some(reason), Some(usage), true),
                    );
                    self.headers(&mut response);
                    return Ok(response);
                }
                Some(Out::Failed { error, .. }) => {
                    let status = if error.is_timeout() {
                        StatusCode::GATEWAY_TIMEOUT
                    } else {
                        StatusCode::BAD_GATEWAY
                    };
                    let message = format!("{error} (after {} output tokens)", tokens.len());
                    return Err(
                        ApiError::new(status, &self.request_id, message).with_info(self.info)
                    );
                }
                Some(Out::Rerouted { .. }) => {} // only before the first token
                None => {
                    return Err(ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        &self.request_id,
                        "the dispatcher ended the stream without its end",
                    )
                    .with_info(self.info))
                }
            }
        }
    }

    /// Server-sent events: one `data: {json}` per token chunk (the first
    /// with the `switchyard` annotation, the last with `finish_reason` and
    /// `usage`), then `data: [DONE]`. A failure mid-stream is a last
    /// `data: {"error": ...}` event without `[DONE]`.
    fn sse(self, first: Out, rx: mpsc::Receiver<Out>, span: tracing::Span) -> Response {
        struct State {
            answer: Answer,
            rx: mpsc::Receiver<Out>,
            next: Option<Out>,
            text: Option<super::text::TextStream>,
            output_tokens: u32,
            annotated: bool,
            ended: bool,
            span: tracing::Span,
        }
        let text = self.app.text.as_ref().map(Text::stream);
        let mut headers = Response::new(Body::empty());
        self.headers(&mut headers);
        let (mut headers, _) = headers.into_parts();
        let state = State {
            answer: self,
            rx,
            next: Some(first),
            text,
            output_tokens: 0,
            annotated: false,
            ended: false,
            span,
        };
        let events = stream::unfold(state, |mut s| {
            let span = s.span.clone();
            async move {
                if s.ended {
                    return None;
                }
                let event = match s.next.take() {
                    Some(e) => Some(e),
                    None => s.rx.recv().await,
                };
                let bytes = match event {
                    Some(Out::Tokens(tokens)) => {
                        s.output_tokens += tokens.len() as u32;
                        let text = s.text.as_mut().map(|t| t.push(&tokens)).unwrap_or_default();
                        let annotate = !std::mem::replace(&mut s.annotated, true);
                        sse_data(&s.answer.completion(&text, &tokens, None, None, annotate))
                    }
                    Some(Out::Done { reason, .. }) => {
                        s.ended = true;
                        let text = s.text.as_mut().map(|t| t.finish()).unwrap_or_default();
                        let annotate = !std::mem::replace(&mut s.annotated, true);
                        let usage = Usage::new(s.answer.prompt_tokens, s.output_tokens);
                        tracing::info!(
                            output_tokens = s.output_tokens,
                            finish = reason.as_str(),
                            "completed (streamed)"
                        );
                        let mut bytes = sse_data(&s.answer.completion(
                            &text,
                            &[],
                            Some(reason),
                            Some(usage),
                            annotate,
                        ));
                        bytes.extend_from_slice(b"data: [DONE]\n\n");
                        bytes
                    }
                    Some(Out::Failed { error, .. }) => {
                        s.ended = true;
                        let message = format!("{error} (after {} output tokens)", s.output_tokens);
                        let status = if error.is_timeout() { 504 } else { 502 };
                        let kind = if error.is_timeout() {
                            "timeout_error"
                        } else {
                            "server_error"
                        };
                        sse_data(&ErrorBody {
                            error: ErrorDetail {
                                message: &message,
                                kind,
                                code: status,
                            },
                            switchyard: Some(&s.answer.info),
                        })
                    }
                    Some(Out::Rerouted { .. }) => Vec::new(),
                    None => {
                        s.ended = true;
                        let message = "the dispatcher ended the stream without its end";
                        sse_data(&ErrorBody {
                            error: ErrorDetail {
                                message,
                                kind: "server_error",
                                code: 502,
                            },
                            switchyard: Some(&s.answer.info),
                        })
                    }
                };
                Some((Ok::<_, Infallible>(Bytes::from(bytes)), s))
            }
            .instrument(span)
        });
        let body = Body::from_stream(events);
        let h = &mut headers.headers;
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        Response::from_parts(headers, body)
    }
}

fn sse_data(value: &impl Serialize) -> Vec<u8> {
    let mut bytes = b"data: ".to_vec();
    if serde_json::to_writer(&mut bytes, value).is_err() {
        bytes.truncate(6);
        bytes.extend_from_slice(
            br#"{"error":{"message":"serialization failed","type":"server_error","code":500}}"#,
        );
    }
    bytes.extend_from_slice(b"\n\n");
    bytes
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(app): State<Arc<App>>) -> Response {
    let readiness = app.readiness.borrow().clone();
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

async fn render_metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        app.metrics.render(),
    )
        .into_response()
}

async fn ledger(
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
        Ok(Some(body)) => json_response(StatusCode::OK, &body),
        _ => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            &request_id,
            "the event loop did not answer",
        )
        .into_response(),
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
