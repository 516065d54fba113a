//! `POST /v1/completions`: a request parsed, handed to the dispatcher, and
//! answered as one JSON or as server-sent events.
//!
//! The handler waits for the decision and the first token (or the end)
//! before it answers: a refusal or a failure before the first token gets a
//! proper status, and a retry changes the decision before any header is
//! sent.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, Stream};
use protocol::FinishReason;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::error::{dispatch_status, kind_of, ApiError};
use super::openai::{
    AnyChoice, ChatChoice, ChatMessage, Choice, Completion, ErrorBody, ErrorDetail, SwitchyardInfo,
    Usage,
};
use super::request::Parsed;
use super::{json_response, set_header, App, DECISION_HEADER, REQUEST_ID_HEADER};
use crate::service::dispatch::{DispatchError, Out};
use crate::service::text::TextStream;

pub(super) async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(app, headers, body, false).await
}

/// `POST /v1/chat/completions`: the messages through the chat template,
/// then as a completion, answered in chat's shapes.
pub(super) async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(app, headers, body, true).await
}

async fn handle(
    app: Arc<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    chat: bool,
) -> Response {
    let request_id = app.request_id(&headers);
    let span = tracing::info_span!(
        "completion",
        request_id = %request_id,
        decision = tracing::field::Empty
    );
    async move {
        match serve(&app, request_id, &headers, body, chat).await {
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

async fn serve(
    app: &Arc<App>,
    request_id: String,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    chat: bool,
) -> Result<Response, ApiError> {
    let mut parsed = if chat {
        app.parse_chat(request_id.clone(), body)?
    } else {
        app.parse(request_id.clone(), body)?
    };
    app.session_header(&mut parsed, headers)?;
    let Parsed {
        prepared,
        prompt,
        stream,
        include_usage,
    } = parsed;
    let prompt_tokens = prepared.isl_tokens;
    let span = tracing::Span::current();
    let (tx, mut rx) = mpsc::channel(64);
    tokio::spawn(
        app.dispatcher
            .clone()
            .serve(prepared, prompt, tx)
            .instrument(span.clone()),
    );

    let mut info: Option<SwitchyardInfo> = None;
    let first = loop {
        match rx.recv().await {
            Some(Out::Refused(error)) => return Err(ApiError::refused(&error, &request_id)),
            Some(Out::Decided { decision, retry_of }) => {
                span.record("decision", tracing::field::display(decision.id));
                let mut decided = app.info(&decision);
                decided.retry_of = retry_of.map(|r| r.to_string());
                info = Some(decided);
            }
            Some(other) => break Some(other),
            None => break None,
        }
    };
    let internal =
        |message: &str| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, &request_id, message);
    let (Some(info), Some(first)) = (info, first) else {
        return Err(internal("the dispatcher ended without an answer"));
    };
    if let Out::Failed { error, no_retry } = first {
        let message = match no_retry {
            Some(why) => format!("{error} ({why})"),
            None => error.to_string(),
        };
        return Err(ApiError::dispatch(&error, &request_id, message).with_info(info));
    }
    let answer = Answer {
        app: app.clone(),
        id: if chat {
            format!("chatcmpl-{request_id}")
        } else {
            format!("cmpl-{request_id}")
        },
        chat,
        stream,
        request_id,
        info,
        created: unix_now(),
        prompt_tokens,
    };
    if stream {
        Ok(answer.sse(first, rx, span, include_usage))
    } else {
        answer.collect(first, rx).await
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A dispatched completion being answered.
struct Answer {
    app: Arc<App>,
    id: String,
    /// A chat completion (`chat.completion` shapes).
    chat: bool,
    stream: bool,
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
        let finish_reason = finish.map(FinishReason::as_str);
        let (object, choice) = match (self.chat, self.stream) {
            (false, _) => (
                "text_completion",
                AnyChoice::Text(Choice {
                    index: 0,
                    text,
                    token_ids,
                    logprobs: None,
                    finish_reason,
                }),
            ),
            (true, stream) => {
                let said = Some(ChatMessage {
                    role: "assistant",
                    content: text,
                });
                let (message, delta) = if stream { (None, said) } else { (said, None) };
                (
                    if stream {
                        "chat.completion.chunk"
                    } else {
                        "chat.completion"
                    },
                    AnyChoice::Chat(ChatChoice {
                        index: 0,
                        message,
                        delta,
                        token_ids,
                        logprobs: None,
                        finish_reason,
                    }),
                )
            }
        };
        Completion {
            id: &self.id,
            object,
            created: self.created,
            model: &self.app.model,
            choices: vec![choice],
            usage,
            switchyard: annotate.then_some(&self.info),
        }
    }

    /// The usage, with the engine's cached figure or the decision's
    /// overlap on the worker that prefilled.
    fn usage(&self, output_tokens: u32, engine_cached: Option<u32>) -> Usage {
        let overlap = if self.info.path == "remote" {
            self.info.prefill_overlap_tokens
        } else {
            self.info.decode_overlap_tokens
        };
        Usage::new(self.prompt_tokens, output_tokens, engine_cached, overlap)
    }

    fn headers(&self, response: &mut Response) {
        set_header(response, DECISION_HEADER, &self.info.decision);
        set_header(response, REQUEST_ID_HEADER, &self.request_id);
    }

    fn failed(&self, error: &DispatchError, output_tokens: usize) -> ApiError {
        let message = format!("{error} (after {output_tokens} output tokens)");
        ApiError::dispatch(error, &self.request_id, message).with_info(self.info.clone())
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
                Some(Out::Done {
                    reason,
                    cached_tokens,
                    ..
                }) => {
                    let text = self
                        .app
                        .text
                        .as_ref()
                        .map(|t| t.decode(&tokens))
                        .unwrap_or_default();
                    let usage = self.usage(tokens.len() as u32, cached_tokens);
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
                Some(Out::Failed { error, .. }) => return Err(self.failed(&error, tokens.len())),
                // Decisions come before the first token only.
                Some(Out::Decided { .. } | Out::Refused(_)) => {}
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
    /// `usage`), with `stream_options.include_usage` a last chunk with the
    /// usage and `choices: []` (what OpenAI sends, and `vllm bench serve`
    /// and AIPerf read), then `data: [DONE]`. A failure mid-stream is a last
    /// `data: {"error": ...}` event without `[DONE]`.
    fn sse(
        self,
        first: Out,
        rx: mpsc::Receiver<Out>,
        span: tracing::Span,
        include_usage: bool,
    ) -> Response {
        let text = self.app.text.as_ref().map(|t| t.stream());
        let mut headers = Response::new(axum::body::Body::empty());
        self.headers(&mut headers);
        let stream = Streamed {
            answer: self,
            rx,
            next: Some(first),
            text,
            output_tokens: 0,
            annotated: false,
            end: End::Streaming,
            usage_chunk: None,
            include_usage,
            span,
        };
        let mut response = Sse::new(stream.events()).into_response();
        response.headers_mut().extend(headers.headers().clone());
        response
    }
}

/// Where a stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Streaming,
    /// The last chunk was sent; `[DONE]` is next.
    Done,
    Ended,
}

/// A streamed answer's state.
struct Streamed {
    answer: Answer,
    rx: mpsc::Receiver<Out>,
    next: Option<Out>,
    text: Option<TextStream>,
    output_tokens: u32,
    annotated: bool,
    end: End,
    /// With `include_usage`: the usage, for a last chunk without choices
    /// (after the one with `finish_reason`, before `[DONE]`).
    usage_chunk: Option<Usage>,
    include_usage: bool,
    span: tracing::Span,
}

impl Streamed {
    fn events(self) -> impl Stream<Item = Result<Event, Infallible>> {
        stream::unfold(self, |mut s| async move {
            let span = s.span.clone();
            let event = s.next_event().instrument(span).await?;
            Some((Ok(event), s))
        })
    }

    async fn next_event(&mut self) -> Option<Event> {
        match self.end {
            End::Ended => return None,
            End::Done => {
                if let Some(usage) = self.usage_chunk.take() {
                    let mut chunk = self.answer.completion("", &[], None, Some(usage), false);
                    chunk.choices.clear();
                    return Some(json_event(&chunk));
                }
                self.end = End::Ended;
                return Some(Event::default().data("[DONE]"));
            }
            End::Streaming => {}
        }
        loop {
            let event = match self.next.take() {
                Some(e) => Some(e),
                None => self.rx.recv().await,
            };
            return Some(match event {
                Some(Out::Tokens(tokens)) => {
                    self.output_tokens += tokens.len() as u32;
                    let text = self
                        .text
                        .as_mut()
                        .map(|t| t.push(&tokens))
                        .unwrap_or_default();
                    let annotate = !std::mem::replace(&mut self.annotated, true);
                    json_event(&self.answer.completion(&text, &tokens, None, None, annotate))
                }
                Some(Out::Done {
                    reason,
                    cached_tokens,
                    ..
                }) => {
                    self.end = End::Done;
                    let text = self.text.as_mut().map(|t| t.finish()).unwrap_or_default();
                    let annotate = !std::mem::replace(&mut self.annotated, true);
                    let usage = self.answer.usage(self.output_tokens, cached_tokens);
                    self.usage_chunk = self.include_usage.then_some(usage);
                    tracing::info!(
                        output_tokens = self.output_tokens,
                        finish = reason.as_str(),
                        "completed (streamed)"
                    );
                    json_event(&self.answer.completion(
                        &text,
                        &[],
                        Some(reason),
                        Some(usage),
                        annotate,
                    ))
                }
                Some(Out::Failed { error, .. }) => {
                    self.end = End::Ended;
                    let message = format!("{error} (after {} output tokens)", self.output_tokens);
                    self.error_event(dispatch_status(&error), &message)
                }
                // Decisions come before the first token only.
                Some(Out::Decided { .. } | Out::Refused(_)) => continue,
                None => {
                    self.end = End::Ended;
                    self.error_event(
                        StatusCode::BAD_GATEWAY,
                        "the dispatcher ended the stream without its end",
                    )
                }
            });
        }
    }

    fn error_event(&self, status: StatusCode, message: &str) -> Event {
        json_event(&ErrorBody {
            error: ErrorDetail {
                message,
                kind: kind_of(status),
                param: None,
                code: status.as_u16(),
            },
            switchyard: Some(&self.answer.info),
        })
    }
}

/// `data: {json}`, or an error event if it does not serialize.
fn json_event(value: &impl serde::Serialize) -> Event {
    Event::default().json_data(value).unwrap_or_else(|_| {
        Event::default().data(
            r#"{"error":{"message":"serialization failed","type":"server_error","code":500}}"#,
        )
    })
}
