//! A request body read into what the dispatcher needs: the prompt's token
//! ids (tokenized when it is text) and block hashes, `max_tokens`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;

use super::error::ApiError;
use super::openai::{CompletionRequest, Prompt};
use super::App;
use crate::service::dispatch::Prepared;

/// A parsed, tokenized and hashed completion request.
pub(super) struct Parsed {
    /// What its decisions are made from.
    pub(super) prepared: Prepared,
    /// Its token ids.
    pub(super) prompt: Vec<u32>,
    /// Whether the answer is streamed (SSE).
    pub(super) stream: bool,
}

impl App {
    /// Reads a completion request; a bad one is a 4xx naming what is wrong.
    pub(super) fn parse(
        &self,
        request_id: String,
        body: Result<Bytes, BytesRejection>,
    ) -> Result<Parsed, ApiError> {
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
        let prompt = match request.prompt {
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
        let hashes: Arc<[protocol::BlockHash]> = self.hasher.hash_prompt(&prompt).into();
        Ok(Parsed {
            prepared: Prepared {
                request_id,
                isl_tokens,
                hashes,
                max_tokens,
            },
            prompt,
            stream: request.stream,
        })
    }
}
