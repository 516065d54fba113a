//! A request body read into what the dispatcher needs: the prompt's token
//! ids (tokenized when it is text) and block hashes, `max_tokens`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;

use protocol::{BlockHasher, SessionId};

use super::error::ApiError;
use super::fields::{FieldError, Fields, Members, MAX_CHOICES};
use super::openai::{CompletionRequest, Prompt};
use super::App;
use crate::service::chat_template::Message;
use crate::service::dispatch::Prepared;

/// The session header (vllm-project/router's `X-Session-ID`).
pub const SESSION_HEADER: &str = "x-session-id";

/// A parsed, tokenized and hashed completion request: one routed request
/// a choice (`n` a prompt, for each prompt of a batch), in index order.
pub(super) struct Parsed {
    pub(super) choices: Vec<ChoiceRequest>,
    /// Whether the answer is streamed (SSE).
    pub(super) stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage and no
    /// choice.
    pub(super) include_usage: bool,
}

/// One choice of a request: its own routed request.
pub(super) struct ChoiceRequest {
    /// The choice's `index`: prompt-major (`prompt * n + j`), as OpenAI
    /// numbers a batch's choices.
    pub(super) index: u32,
    /// Whether it is its prompt's first choice (whose prompt tokens the
    /// usage counts).
    pub(super) first_of_prompt: bool,
    /// What its decisions are made from (its request id is the request's,
    /// `-INDEX` appended when there are several choices).
    pub(super) prepared: Prepared,
    /// Its prompt's token ids.
    pub(super) prompt: Vec<u32>,
    /// With `echo`: its prompt's text, which its text starts with.
    pub(super) echo: Option<String>,
}

impl Parsed {
    /// The only choice, for what decides one request (`/v1/route`): a
    /// batch or `n` above 1 is a 400.
    pub(super) fn single(mut self, request_id: &str) -> Result<ChoiceRequest, ApiError> {
        if self.choices.len() != 1 {
            return Err(ApiError::bad_request(
                request_id,
                format!(
                    "this request has {} choices (n, or a batch of prompts), but /v1/route decides one request: ask for one choice of one prompt",
                    self.choices.len()
                ),
            ));
        }
        Ok(self.choices.pop().expect("one"))
    }
}

impl App {
    /// The context length requests are checked against: `--max-model-len`,
    /// else the registered workers' smallest, if any said.
    pub(super) fn context_len(&self) -> Option<u32> {
        self.max_model_len
            .or_else(|| Some(*self.context.borrow()).filter(|&n| n > 0))
    }

    /// The hasher of a request's blocks: the deployment's, or salted with
    /// its LoRA adapter and `cache_salt` as the agent salts the blocks an
    /// engine stores for it (from the `BlockStored`'s `lora_name` and
    /// `cache_salt`), so that they match each other and nothing else.
    pub(super) fn hasher_for(&self, sampling: &protocol::Sampling) -> BlockHasher {
        sampling.block_hasher(self.hasher, &self.model)
    }

    /// The request's `max_tokens` (asked for, or the default cut to what
    /// the context leaves), if the prompt and it fit the context: else an
    /// error naming the field, before anything is routed or charged.
    fn fit_context(&self, isl_tokens: u32, asked: Option<u32>) -> Result<u32, FieldError> {
        let Some(context) = self.context_len() else {
            return Ok(asked.unwrap_or(self.default_max_tokens));
        };
        if isl_tokens >= context {
            return Err(FieldError::field(
                "prompt",
                format!("{isl_tokens} tokens, but the model's context length is {context} tokens (prompt and output)"),
            ));
        }
        let room = context - isl_tokens;
        match asked {
            Some(n) if n > room => Err(FieldError::field(
                "max_tokens",
                format!("{n} output tokens and the prompt's {isl_tokens} exceed the model's context length of {context} tokens: at most {room}"),
            )),
            Some(n) => Ok(n),
            None => Ok(self.default_max_tokens.min(room)),
        }
    }

    /// The session of `x-session-id` (vllm-project/router's `X-Session-ID`;
    /// header names are case-insensitive) onto `parsed`: a bad one, or one
    /// that differs from the body's `agent_context.session_id`, is a 400.
    pub(super) fn session_header(
        &self,
        parsed: &mut Parsed,
        headers: &HeaderMap,
    ) -> Result<(), ApiError> {
        let Some(value) = headers.get(SESSION_HEADER) else {
            return Ok(());
        };
        let Some(first) = parsed.choices.first() else {
            return Ok(());
        };
        let request_id = first.prepared.request_id.clone();
        let bad =
            |why: String| ApiError::bad_request(&request_id, format!("{SESSION_HEADER}: {why}"));
        let id = value
            .to_str()
            .map_err(|_| bad("not visible ASCII".into()))
            .and_then(|s| SessionId::new(s).map_err(|e| bad(e.to_string())))?;
        for choice in &mut parsed.choices {
            match &choice.prepared.session {
                Some(body) if *body != id => {
                    return Err(bad(format!(
                        "{id} differs from the body's agent_context.session_id {body}"
                    )))
                }
                _ => choice.prepared.session = Some(id.clone()),
            }
        }
        Ok(())
    }

    /// Reads a completion request; a bad one is a 4xx naming what is wrong.
    pub(super) fn parse(
        &self,
        request_id: String,
        body: Result<Bytes, BytesRejection>,
    ) -> Result<Parsed, ApiError> {
        let body = read_body(&request_id, body)?;
        let CompletionRequest { prompt, fields } =
            CompletionRequest::parse(&body).map_err(|e| ApiError::field(&request_id, e))?;
        let prompts = prompt.into_prompts().into_iter().map(Source::Prompt);
        self.prepare(request_id, prompts.collect(), fields)
    }

    /// Reads a chat completion request: its messages through the chat
    /// template, `max_completion_tokens` as `max_tokens`, the other fields
    /// as a completion's.
    pub(super) fn parse_chat(
        &self,
        request_id: String,
        body: Result<Bytes, BytesRejection>,
    ) -> Result<Parsed, ApiError> {
        let body = read_body(&request_id, body)?;
        let field = |e: FieldError| ApiError::field(&request_id, e);
        if body.is_empty() {
            return Err(field(FieldError::body(
                "the request body is empty: expected a JSON chat completion request",
            )));
        }
        let Members(mut members) = serde_json::from_slice(&body)
            .map_err(|e| field(FieldError::body(format!("invalid request body: {e}"))))?;
        let mut take = |key: &str| {
            members
                .iter()
                .position(|(k, _)| k == key)
                .map(|at| members.remove(at).1)
        };
        let messages = take("messages")
            .ok_or_else(|| field(FieldError::field("messages", "missing field `messages`")))?;
        let messages = chat_messages(messages).map_err(field)?;
        let completion_tokens = take("max_completion_tokens");
        if let Some(n) = completion_tokens.filter(|v| !v.is_null()) {
            if members.iter().any(|(k, _)| k == "max_tokens") {
                return Err(field(FieldError::field(
                    "max_completion_tokens",
                    "give max_tokens or max_completion_tokens, not both",
                )));
            }
            members.push(("max_tokens".into(), n));
        }
        chat_logprobs(&mut members).map_err(field)?;
        if let Some((key, _)) = members.iter().find(|(k, _)| k == "echo" || k == "suffix") {
            return Err(field(FieldError::field(
                key,
                "a completions field: chat completions do not take it",
            )));
        }
        let fields = Fields::read(members).map_err(field)?;
        self.prepare(request_id, vec![Source::Chat(messages)], fields)
    }

    /// The common part of both: model, limits, then each prompt's tokens
    /// and block hashes, and its `n` choices.
    fn prepare(
        &self,
        request_id: String,
        prompts: Vec<Source>,
        fields: Fields,
    ) -> Result<Parsed, ApiError> {
        // One router serves one model (its hashing contract): a request
        // for another is a 404 before anything is routed; one without a
        // model gets the served one.
        if let Some(asked) = fields.model.as_deref().filter(|m| *m != self.model) {
            return Err(ApiError::unknown_model(&request_id, asked, &self.model));
        }
        if fields.max_tokens == Some(0) {
            return Err(ApiError::field(
                &request_id,
                FieldError::field("max_tokens", "must be at least 1"),
            ));
        }
        let n = fields.choices();
        let total = u64::from(n) * prompts.len() as u64;
        if total > u64::from(MAX_CHOICES) {
            return Err(ApiError::field(
                &request_id,
                FieldError::field(
                    "n",
                    format!("{n} choices of each of {} prompts are {total} choices, more than {MAX_CHOICES} (each is its own routed request)", prompts.len()),
                ),
            ));
        }
        if fields.echo && fields.sampling.logprobs.is_some() {
            return Err(ApiError::field(
                &request_id,
                FieldError::field(
                    "echo",
                    "echo with logprobs would need the prompt's log-probabilities, which this router does not ask engines for: send echo or logprobs",
                ),
            ));
        }
        let mut choices = Vec::with_capacity(total as usize);
        for (p, source) in prompts.into_iter().enumerate() {
            let echo_text = match (&source, fields.echo) {
                (_, false) => None,
                (Source::Prompt(Prompt::Text(t)), true) => Some(t.clone()),
                (_, true) => None,
            };
            let (prepared, prompt) = self.prepare_one(request_id.clone(), source, &fields)?;
            let echo = match (fields.echo, echo_text, &self.text) {
                (false, ..) => None,
                (true, Some(t), _) => Some(t),
                (true, None, Some(text)) => Some(text.decode(&prompt)),
                (true, None, None) => {
                    return Err(ApiError::field(
                        &request_id,
                        FieldError::field(
                            "echo",
                            "echoing a token-id prompt needs its text: start the router with --tokenizer tokenizer.json",
                        ),
                    ))
                }
            };
            for j in 0..n {
                let index = p as u32 * n + j;
                let mut prepared = prepared.clone();
                if total > 1 {
                    prepared.request_id = format!("{request_id}-{index}");
                }
                // vLLM's choices of one request: seed + j each.
                if let Some(seed) = &mut prepared.sampling.seed {
                    *seed = seed.wrapping_add(i64::from(j));
                }
                choices.push(ChoiceRequest {
                    index,
                    first_of_prompt: j == 0,
                    prepared,
                    prompt: prompt.clone(),
                    echo: echo.clone(),
                });
            }
        }
        Ok(Parsed {
            choices,
            stream: fields.stream,
            include_usage: fields.include_usage,
        })
    }

    /// One prompt's tokens, limits and block hashes.
    fn prepare_one(
        &self,
        request_id: String,
        prompt: Source,
        fields: &Fields,
    ) -> Result<(Prepared, Vec<u32>), ApiError> {
        let prompt = match prompt {
            Source::Chat(messages) => {
                let (Some(template), Some(text)) = (&self.chat, &self.text) else {
                    return Err(ApiError::bad_request(
                        &request_id,
                        "chat completions need a tokenizer and a chat template: start the router with --tokenizer tokenizer.json (and a tokenizer_config.json beside it with a chat_template, or --chat-template file.jinja)",
                    ));
                };
                let rendered = template
                    .render(&messages)
                    .map_err(|e| ApiError::bad_request(&request_id, e.to_string()))?;
                let encoded = text
                    .encode_rendered(&rendered)
                    .map_err(|e| ApiError::bad_request(&request_id, e.to_string()))?;
                self.metrics.tokenized(&encoded, text.cache_bytes());
                encoded.ids
            }
            Source::Prompt(Prompt::Tokens(tokens)) => tokens,
            Source::Prompt(Prompt::Batch(_)) => {
                return Err(ApiError::bad_request(
                    &request_id,
                    "prompt: a batch inside a batch",
                ))
            }
            Source::Prompt(Prompt::Text(prompt)) => match &self.text {
                Some(text) => {
                    let encoded = text
                        .encode(&prompt)
                        .map_err(|e| ApiError::bad_request(&request_id, e.to_string()))?;
                    self.metrics.tokenized(&encoded, text.cache_bytes());
                    encoded.ids
                }
                None => {
                    return Err(ApiError::bad_request(
                        &request_id,
                        "the prompt is text, but this router has no tokenizer (start it with --tokenizer tokenizer.json): send the prompt as a list of token ids",
                    ))
                }
            },
        };
        if prompt.is_empty() {
            return Err(ApiError::bad_request(
                &request_id,
                "the prompt is empty: send at least one token",
            ));
        }
        let isl_tokens = u32::try_from(prompt.len()).map_err(|_| {
            ApiError::bad_request(
                &request_id,
                format!("a prompt of {} tokens is too long", prompt.len()),
            )
        })?;
        let max_tokens = self
            .fit_context(isl_tokens, fields.max_tokens)
            .map_err(|e| ApiError::field(&request_id, e))?;
        let hashes: Arc<[protocol::BlockHash]> = self
            .hasher_for(&fields.sampling)
            .hash_prompt(&prompt)
            .into();
        Ok((
            Prepared {
                request_id,
                isl_tokens,
                hashes,
                max_tokens,
                sampling: fields.sampling.clone(),
                session: fields.session.clone(),
            },
            prompt,
        ))
    }
}

/// The body axum read, or the 4xx it refused it with.
fn read_body(request_id: &str, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| ApiError::new(rejection.status(), request_id, rejection.body_text()))
}

/// What a request's prompt is made of.
enum Source {
    Prompt(Prompt),
    Chat(Vec<Message>),
}

/// Chat's `logprobs: true` and `top_logprobs: K` as a completion's
/// `logprobs: K` (`top_logprobs` alone is a 400, as at OpenAI).
fn chat_logprobs(members: &mut Vec<(String, serde_json::Value)>) -> Result<(), FieldError> {
    let mut take = |key: &str| {
        members
            .iter()
            .position(|(k, _)| k == key)
            .map(|at| members.remove(at).1)
            .filter(|v| !v.is_null())
    };
    let on = take("logprobs")
        .map(|v| {
            serde_json::from_value::<bool>(v).map_err(|e| {
                FieldError::field(
                    "logprobs",
                    format!("{e} (a chat request's logprobs is true or false)"),
                )
            })
        })
        .transpose()?
        .unwrap_or(false);
    let top = take("top_logprobs")
        .map(|v| serde_json::from_value::<u32>(v).map_err(|e| FieldError::field("top_logprobs", e)))
        .transpose()?;
    if let Some(k) = top.filter(|&k| k > super::fields::MAX_LOGPROBS) {
        return Err(FieldError::field(
            "top_logprobs",
            format!("{k}: at most {}", super::fields::MAX_LOGPROBS),
        ));
    }
    match (on, top) {
        (false, Some(_)) => Err(FieldError::field("top_logprobs", "needs logprobs: true")),
        (false, None) => Ok(()),
        (true, top) => {
            members.push(("logprobs".into(), serde_json::json!(top.unwrap_or(0))));
            Ok(())
        }
    }
}

/// A chat request's `messages`: each a `role` and a `content` (a string,
/// or a list of `{"type": "text", "text"}` parts).
fn chat_messages(value: serde_json::Value) -> Result<Vec<Message>, FieldError> {
    let bad = |what: String| FieldError::field("messages", what);
    let serde_json::Value::Array(items) = value else {
        return Err(bad("must be a list of messages".into()));
    };
    if items.is_empty() {
        return Err(bad("must have at least one message".into()));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m["role"]
                .as_str()
                .ok_or_else(|| bad(format!("message {i} has no string `role`")))?;
            let content = match &m["content"] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Null => String::new(),
                serde_json::Value::Array(parts) => parts
                    .iter()
                    .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                        (Some("text"), Some(t)) => Ok(t),
                        _ => Err(bad(format!(
                            "message {i}: only text content parts are supported"
                        ))),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .concat(),
                _ => return Err(bad(format!("message {i}'s content is not text"))),
            };
            Ok(Message {
                role: role.to_owned(),
                content,
            })
        })
        .collect()
}
