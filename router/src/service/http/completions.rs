//! `POST /v1/completions`: a request parsed, handed to the dispatcher, and
//! answered as one JSON or as server-sent events.
//!
//! Each choice (`n` a prompt, for each prompt of a batch) is its own
//! routed request, dispatched at once; the answer numbers them
//! prompt-major and sums their usage ([`super::assemble`]). The handler
//! waits for every choice's decision and first token (or end) before it
//! answers: a refusal or a failure before the first token gets a proper
//! status (the other choices are cancelled), and a retry changes the
//! decision before any header is sent.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, SelectAll, Stream, StreamExt};
use protocol::{FinishReason, TokenLogprob};
use tokio::sync::mpsc;
use tracing::Instrument;

use super::assemble::{self, ChoiceUsage};
use super::error::{dispatch_status, kind_of, ApiError};
use super::openai::{
    AnyChoice, ChatChoice, ChatMessage, Choice, Completion, ErrorBody, ErrorDetail, SwitchyardInfo,
    Usage,
};
use super::request::{ChoiceRequest, Parsed};
use super::{json_response, set_header, App, DECISION_HEADER, REQUEST_ID_HEADER};
use crate::service::dispatch::Out;
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
        choices,
        stream,
        include_usage,
    } = parsed;
    let span = tracing::Span::current();
    // Every choice dispatched at once, each its own request.
    let started: Vec<(ChoiceRequest, mpsc::Receiver<Out>)> = choices
        .into_iter()
        .map(|mut choice| {
            let (tx, rx) = mpsc::channel(64);
            let prompt = std::mem::take(&mut choice.prompt);
            tokio::spawn(
                app.dispatcher
                    .clone()
                    .serve(choice.prepared.clone(), prompt, tx)
                    .instrument(span.clone()),
            );
            (choice, rx)
        })
        .collect();
    // Each one's decision and first event, in index order: the first
    // refusal or failure answers the request (dropping the others'
    // receivers cancels them).
    let mut legs = Vec::with_capacity(started.len());
    for (choice, mut rx) in started {
        let (info, first) = first_event(app, &request_id, &mut rx).await?;
        if legs.is_empty() {
            span.record("decision", tracing::field::display(&info.decision));
        }
        legs.push(ChoiceLeg {
            index: choice.index,
            usage: ChoiceUsage::new(choice.prepared.isl_tokens, choice.first_of_prompt, &info),
            echo: choice.echo,
            info,
            first: Some(first),
            rx,
        });
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
        created: unix_now(),
    };
    if stream {
        Ok(answer.sse(legs, span, include_usage))
    } else {
        answer.collect(legs).await
    }
}

/// A choice's decision (the last, after retries) and its first event after
/// it; a refusal or a failure is the request's error.
async fn first_event(
    app: &App,
    request_id: &str,
    rx: &mut mpsc::Receiver<Out>,
) -> Result<(SwitchyardInfo, Out), ApiError> {
    let mut info: Option<SwitchyardInfo> = None;
    let first = loop {
        match rx.recv().await {
            Some(Out::Refused(error)) => return Err(ApiError::refused(&error, request_id)),
            Some(Out::Decided { decision, retry_of }) => {
                let mut decided = app.info(&decision);
                decided.retry_of = retry_of.map(|r| r.to_string());
                info = Some(decided);
            }
            Some(other) => break Some(other),
            None => break None,
        }
    };
    let (Some(info), Some(first)) = (info, first) else {
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            request_id,
            "the dispatcher ended without an answer",
        ));
    };
    if let Out::Failed { error, no_retry } = first {
        let message = match no_retry {
            Some(why) => format!("{error} ({why})"),
            None => error.to_string(),
        };
        return Err(ApiError::dispatch(&error, request_id, message).with_info(info));
    }
    Ok((info, first))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One choice being answered: its routed request's events.
struct ChoiceLeg {
    index: u32,
    usage: ChoiceUsage,
    echo: Option<String>,
    info: SwitchyardInfo,
    /// Its first event after the decision (taken when answering).
    first: Option<Out>,
    rx: mpsc::Receiver<Out>,
}

/// What a choice generated, whole.
struct Collected {
    tokens: Vec<u32>,
    logprobs: Option<Vec<TokenLogprob>>,
    reason: FinishReason,
    cached_tokens: Option<u32>,
}

impl ChoiceLeg {
    /// Its events to the end.
    async fn collect(&mut self) -> Result<Collected, ApiError> {
        let mut tokens = Vec::new();
        let mut logprobs: Option<Vec<TokenLogprob>> = None;
        loop {
            let event = match self.first.take() {
                Some(event) => Some(event),
                None => self.rx.recv().await,
            };
            match event {
                Some(Out::Tokens {
                    tokens: t,
                    logprobs: l,
                }) => {
                    tokens.extend_from_slice(&t);
                    if let Some(l) = l {
                        logprobs.get_or_insert_with(Vec::new).extend(l);
                    }
                }
                Some(Out::Done {
                    reason,
                    cached_tokens,
                    ..
                }) => {
                    return Ok(Collected {
                        tokens,
                        logprobs,
                        reason,
                        cached_tokens,
                    })
                }
                Some(Out::Failed { error, .. }) => {
                    let message = format!("{error} (after {} output tokens)", tokens.len());
                    return Err(ApiError::dispatch(&error, &self.info.request_id, message)
                        .with_info(self.info.clone()));
                }
                // Decisions come before the first token only.
                Some(Out::Decided { .. } | Out::Refused(_)) => {}
                None => {
                    return Err(ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        &self.info.request_id,
                        "the dispatcher ended the stream without its end",
                    )
                    .with_info(self.info.clone()))
                }
            }
        }
    }
}

/// A dispatched completion being answered.
struct Answer {
    app: Arc<App>,
    id: String,
    /// A chat completion (`chat.completion` shapes).
    chat: bool,
    stream: bool,
    request_id: String,
    created: u64,
}

/// One choice of a response (or of a chunk).
struct ChoicePart<'a> {
    index: u32,
    text: &'a str,
    token_ids: &'a [u32],
    /// The tokens' log-probabilities, and where the first one's text
    /// starts in the choice's text (moved past them).
    logprobs: Option<(&'a [TokenLogprob], &'a mut u32)>,
    finish: Option<FinishReason>,
}

impl Answer {
    /// A token's name in `logprobs`: its text, else `token_id:ID`.
    fn name(&self, id: u32) -> String {
        match &self.app.text {
            Some(text) => text.decode(&[id]),
            None => assemble::id_name(id),
        }
    }

    fn choice<'a>(&self, part: ChoicePart<'a>) -> AnyChoice<'a> {
        let ChoicePart {
            index,
            text,
            token_ids,
            logprobs,
            finish,
        } = part;
        let finish_reason = finish.map(FinishReason::as_str);
        let name = |id| self.name(id);
        if !self.chat {
            return AnyChoice::Text(Choice {
                index,
                text,
                token_ids,
                logprobs: logprobs
                    .map(|(l, offset)| assemble::completion_logprobs(token_ids, l, &name, offset)),
                finish_reason,
            });
        }
        let said = Some(ChatMessage {
            role: "assistant",
            content: text,
        });
        let (message, delta) = if self.stream {
            (None, said)
        } else {
            (said, None)
        };
        AnyChoice::Chat(ChatChoice {
            index,
            message,
            delta,
            token_ids,
            logprobs: logprobs.map(|(l, _)| assemble::chat_logprobs(token_ids, l, &name)),
            finish_reason,
        })
    }

    fn completion<'a>(
        &'a self,
        choices: Vec<AnyChoice<'a>>,
        usage: Option<Usage>,
        switchyard: Option<&'a SwitchyardInfo>,
    ) -> Completion<'a> {
        let object = match (self.chat, self.stream) {
            (false, _) => "text_completion",
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
        };
        Completion {
            id: &self.id,
            object,
            created: self.created,
            model: &self.app.model,
            choices,
            usage,
            switchyard,
            switchyard_choices: None,
        }
    }

    fn headers(&self, response: &mut Response, first: &SwitchyardInfo) {
        set_header(response, DECISION_HEADER, &first.decision);
        set_header(response, REQUEST_ID_HEADER, &self.request_id);
    }

    /// The whole answer as one JSON: every choice collected (at once).
    async fn collect(self, mut legs: Vec<ChoiceLeg>) -> Result<Response, ApiError> {
        let collected =
            futures::future::try_join_all(legs.iter_mut().map(ChoiceLeg::collect)).await?;
        let texts: Vec<String> = legs
            .iter()
            .zip(&collected)
            .map(|(leg, c)| {
                let generated = self
                    .app
                    .text
                    .as_ref()
                    .map(|t| t.decode(&c.tokens))
                    .unwrap_or_default();
                assemble::echoed(leg.echo.as_deref(), &generated)
            })
            .collect();
        let mut offsets: Vec<u32> = legs
            .iter()
            .map(|leg| leg.echo.as_deref().map_or(0, |e| e.chars().count() as u32))
            .collect();
        let usage = assemble::total_usage(legs.iter().zip(&collected).map(|(leg, c)| {
            (
                &leg.usage,
                leg.usage.usage(c.tokens.len() as u32, c.cached_tokens),
            )
        }));
        let output_tokens: usize = collected.iter().map(|c| c.tokens.len()).sum();
        tracing::info!(
            output_tokens,
            choices = legs.len(),
            finish = collected[0].reason.as_str(),
            "completed"
        );
        let choices = legs
            .iter()
            .zip(&collected)
            .zip(&texts)
            .zip(offsets.iter_mut())
            .map(|(((leg, c), text), offset)| {
                self.choice(ChoicePart {
                    index: leg.index,
                    text,
                    token_ids: &c.tokens,
                    logprobs: c.logprobs.as_deref().map(|l| (l, offset)),
                    finish: Some(c.reason),
                })
            })
            .collect();
        let mut completion = self.completion(choices, Some(usage), Some(&legs[0].info));
        if legs.len() > 1 {
            completion.switchyard_choices = Some(legs.iter().map(|l| &l.info).collect());
        }
        let mut response = json_response(StatusCode::OK, &completion);
        self.headers(&mut response, &legs[0].info);
        Ok(response)
    }

    /// Server-sent events: one `data: {json}` per token chunk of a choice
    /// (its first with the choice's `switchyard` annotation and, with
    /// `echo`, its prompt's text first; its last with `finish_reason`; the
    /// last choice to finish with the request's `usage`), with
    /// `stream_options.include_usage` a last chunk with the usage and
    /// `choices: []` (what OpenAI sends, and `vllm bench serve` and AIPerf
    /// read), then `data: [DONE]`. A failure mid-stream is a last
    /// `data: {"error": ...}` event without `[DONE]`.
    fn sse(self, legs: Vec<ChoiceLeg>, span: tracing::Span, include_usage: bool) -> Response {
        let mut headers = Response::new(axum::body::Body::empty());
        self.headers(&mut headers, &legs[0].info);
        let mut merged = SelectAll::new();
        let mut choices = Vec::with_capacity(legs.len());
        for (k, mut leg) in legs.into_iter().enumerate() {
            let first = leg.first.take();
            let events: BoxStream<'static, (usize, Option<Out>)> = stream::iter(first)
                .chain(stream::unfold(leg.rx, |mut rx| async move {
                    rx.recv().await.map(|out| (out, rx))
                }))
                .map(Some)
                .chain(stream::once(async { None }))
                .map(move |out| (k, out))
                .boxed();
            merged.push(events);
            choices.push(StreamChoice {
                index: leg.index,
                usage: leg.usage,
                offset: leg.echo.as_deref().map_or(0, |e| e.chars().count() as u32),
                echo: leg.echo,
                info: leg.info,
                text: self.app.text.as_ref().map(|t| t.stream()),
                output_tokens: 0,
                annotated: false,
                done: None,
            });
        }
        let stream = Streamed {
            answer: self,
            merged,
            choices,
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

/// One choice of a streamed answer.
struct StreamChoice {
    index: u32,
    usage: ChoiceUsage,
    /// The prompt's text, until the choice's first chunk carries it.
    echo: Option<String>,
    /// Characters of the choice's text sent so far (`text_offset`).
    offset: u32,
    info: SwitchyardInfo,
    text: Option<TextStream>,
    output_tokens: u32,
    annotated: bool,
    /// Its usage, once finished.
    done: Option<Usage>,
}

/// A streamed answer's state.
struct Streamed {
    answer: Answer,
    /// Every choice's events, as `(position, event)`; `None` once a
    /// choice's events ended.
    merged: SelectAll<BoxStream<'static, (usize, Option<Out>)>>,
    choices: Vec<StreamChoice>,
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
                    let chunk = self.answer.completion(Vec::new(), Some(usage), None);
                    return Some(json_event(&chunk));
                }
                self.end = End::Ended;
                return Some(Event::default().data("[DONE]"));
            }
            End::Streaming => {}
        }
        loop {
            let Some((k, event)) = self.merged.next().await else {
                // Every choice's events ended, not all finished.
                self.end = End::Ended;
                return Some(self.error_event(
                    StatusCode::BAD_GATEWAY,
                    "the dispatcher ended the stream without its end",
                ));
            };
            return Some(match event {
                Some(Out::Tokens { tokens, logprobs }) => self.tokens(k, &tokens, logprobs),
                Some(Out::Done {
                    reason,
                    cached_tokens,
                    ..
                }) => self.done(k, reason, cached_tokens),
                Some(Out::Failed { error, .. }) => {
                    self.end = End::Ended;
                    let message = format!(
                        "{error} (after {} output tokens)",
                        self.choices[k].output_tokens
                    );
                    self.error_event(dispatch_status(&error), &message)
                }
                // Decisions come before the first token only.
                Some(Out::Decided { .. } | Out::Refused(_)) => continue,
                // A finished choice's events end after its `Done`.
                None if self.choices[k].done.is_some() => continue,
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

    /// A chunk of choice `k`'s tokens.
    fn tokens(&mut self, k: usize, tokens: &[u32], logprobs: Option<Vec<TokenLogprob>>) -> Event {
        let c = &mut self.choices[k];
        c.output_tokens += tokens.len() as u32;
        let generated = c.text.as_mut().map(|t| t.push(tokens)).unwrap_or_default();
        let text = assemble::echoed(c.echo.take().as_deref(), &generated);
        let annotate = !std::mem::replace(&mut c.annotated, true);
        // Log-probabilities' offsets follow the text, echo included.
        let mut offset = c.offset;
        c.offset += generated.chars().count() as u32;
        let c = &self.choices[k];
        let choice = self.answer.choice(ChoicePart {
            index: c.index,
            text: &text,
            token_ids: tokens,
            logprobs: logprobs.as_deref().map(|l| (l, &mut offset)),
            finish: None,
        });
        json_event(
            &self
                .answer
                .completion(vec![choice], None, annotate.then_some(&c.info)),
        )
    }

    /// Choice `k`'s last chunk; the last choice to finish carries the
    /// request's usage.
    fn done(&mut self, k: usize, reason: FinishReason, cached_tokens: Option<u32>) -> Event {
        let c = &mut self.choices[k];
        let rest = c.text.as_mut().map(|t| t.finish()).unwrap_or_default();
        let text = assemble::echoed(c.echo.take().as_deref(), &rest);
        let annotate = !std::mem::replace(&mut c.annotated, true);
        c.done = Some(c.usage.usage(c.output_tokens, cached_tokens));
        tracing::info!(
            choice = c.index,
            output_tokens = c.output_tokens,
            finish = reason.as_str(),
            "completed (streamed)"
        );
        let usage = self
            .choices
            .iter()
            .map(|c| c.done.map(|u| (&c.usage, u)))
            .collect::<Option<Vec<_>>>()
            .map(assemble::total_usage);
        if usage.is_some() {
            self.end = End::Done;
            self.usage_chunk = usage.filter(|_| self.include_usage);
        }
        let c = &self.choices[k];
        let choice = self.answer.choice(ChoicePart {
            index: c.index,
            text: &text,
            token_ids: &[],
            logprobs: None,
            finish: Some(reason),
        });
        json_event(
            &self
                .answer
                .completion(vec![choice], usage, annotate.then_some(&c.info)),
        )
    }

    fn error_event(&self, status: StatusCode, message: &str) -> Event {
        json_event(&ErrorBody {
            error: ErrorDetail {
                message,
                kind: kind_of(status),
                param: None,
                code: status.as_u16(),
            },
            switchyard: self.choices.first().map(|c| &c.info),
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
