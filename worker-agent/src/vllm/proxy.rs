//! Generation requests: each one a call to the engine's
//! `/v1/completions` ([`super::openai`]): local requests streamed, a
//! prefill's `kv_transfer_params` passed on, a decode's sent back; every
//! failure ends as a clear `Failed`. With bidirectional KV transfer, a
//! decode engine exports a prefix when another worker's prefill asks for
//! it ([`RequestContext::export`]; only the leading blocks it still holds,
//! by its KV events) and a pulling prefill sends its source's handle.

use std::time::Duration;

use futures::StreamExt;
use metrics::counter;
use protocol::{
    FinishReason, GenerateEvent, GenerateRequest, KvHandle, KvHandleQuery, KvTransferParams,
    Sampling, Stage, WorkerId,
};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, info, warn};

use super::engine::EngineKind;
use super::kv_task::KvCommand;
use super::load::InflightGuard;
use super::openai::{self, Kind};
use crate::metrics as m;

/// What every generation request needs.
#[derive(Debug)]
pub(super) struct RequestContext {
    pub(super) kind: EngineKind,
    pub(super) http: reqwest::Client,
    pub(super) completions_url: String,
    pub(super) model: String,
    pub(super) worker: WorkerId,
    pub(super) dp_size: u32,
    pub(super) block_size: u32,
    pub(super) return_token_ids: bool,
    /// vLLM's bidirectional KV transfer (`VllmConfig::bidirectional_kv`):
    /// the engine exports prefixes asked for, and a fetching prefill leg
    /// pulls with its source's handle.
    pub(super) bidirectional: bool,
    /// Bypasses carry `do_local_prefill: true` (an SGLang decode server).
    pub(super) do_local_prefill: bool,
    pub(super) timeout: Duration,
    /// The KV task, which knows the blocks the engine holds.
    pub(super) kv: mpsc::UnboundedSender<KvCommand>,
    pub(super) stop: watch::Receiver<bool>,
}

impl RequestContext {
    /// Serves one request, sending its events to `out`; `handle`: the
    /// source engine's, for a prefill that pulls its prefix.
    pub(super) async fn serve(
        &self,
        request: GenerateRequest,
        handle: Option<KvHandle>,
        out: &mpsc::UnboundedSender<GenerateEvent>,
        guard: &InflightGuard,
    ) {
        let mut stop = self.stop.clone();
        if *stop.borrow() {
            let _ = out.send(GenerateEvent::Failed {
                error: "the engine adapter stopped".into(),
                retryable: true,
            });
            return;
        }
        tokio::select! {
            // The stream just ends: the agent reports a retryable failure.
            _ = stop.changed() => {}
            () = self.serve_inner(request, handle, out, guard) => {}
        }
    }

    async fn serve_inner(
        &self,
        request: GenerateRequest,
        handle: Option<KvHandle>,
        out: &mpsc::UnboundedSender<GenerateEvent>,
        guard: &InflightGuard,
    ) {
        let kind = match &request.stage {
            Stage::Local => Kind::Local,
            Stage::Prefill | Stage::Decode { .. } if self.kind == EngineKind::Sglang => {
                let _ = out.send(GenerateEvent::Failed {
                    error: "remote prefill on SGLang needs its bootstrap handshake, which this adapter does not implement: serve SGLang workers aggregated (bypass only)".into(),
                    retryable: false,
                });
                return;
            }
            Stage::Prefill => match &request.annotation.fetch {
                Some(fetch) if self.bidirectional => {
                    let params = handle.and_then(|h| {
                        let blocks = h.blocks;
                        match serde_json::from_str::<Value>(&h.engine) {
                            Ok(Value::Object(p)) => Some((p, blocks)),
                            _ => None,
                        }
                    });
                    match params {
                        Some((params, blocks)) => {
                            counter!(m::ENGINE_PREFIX_FETCHES, "outcome" => "pulled").increment(1);
                            tracing::info!(
                                request_id = %request.request_id,
                                decision = %request.annotation.decision,
                                source = %fetch.source,
                                prefix_tokens = fetch.prefix_tokens,
                                handle_blocks = blocks,
                                "prefill pulling its prefix from a decode worker"
                            );
                            Kind::PrefillFetch(params)
                        }
                        None => {
                            counter!(m::ENGINE_PREFIX_FETCHES, "outcome" => "no_handle")
                                .increment(1);
                            Kind::Prefill
                        }
                    }
                }
                Some(fetch) => {
                    counter!(m::ENGINE_PREFIX_FETCHES, "outcome" => "plain").increment(1);
                    warn!(
                        request_id = %request.request_id,
                        decision = %request.annotation.decision,
                        source = %fetch.source,
                        "a prefill leg asked to fetch its prefix, but --vllm-bidirectional-kv is off: prefilled whole"
                    );
                    Kind::Prefill
                }
                None => Kind::Prefill,
            },
            Stage::Decode { transfer } => match transfer
                .engine
                .as_deref()
                .map(serde_json::from_str::<Value>)
            {
                Some(Ok(Value::Object(params))) => Kind::Decode(params),
                other => {
                    counter!(m::ENGINE_DECODE_WITHOUT_PARAMS).increment(1);
                    warn!(
                        request_id = %request.request_id,
                        source = %transfer.source,
                        params = ?other.map(|r| r.map_err(|e| e.to_string())),
                        "a decode without the prefill engine's kv_transfer_params: served as a local prefill"
                    );
                    Kind::Local
                }
            },
        };
        let mut body = openai::completion_body(
            &self.model,
            &request.prompt,
            request.max_tokens,
            &request.sampling,
            &kind,
            self.return_token_ids,
        );
        if self.do_local_prefill && kind == Kind::Local {
            openai::ask_local_prefill(&mut body);
        }
        let call = self.completion_call(&request.request_id, &body);
        let response = match tokio::time::timeout(self.timeout, call.send()).await {
            Err(_) => {
                return fail(
                    out,
                    true,
                    format!("the engine did not answer within {:?}", self.timeout),
                );
            }
            Ok(Err(e)) => {
                let error = if e.is_connect() {
                    format!("the engine at {} is unreachable: {e}", self.completions_url)
                } else {
                    format!(
                        "the request to the engine at {} failed: {e}",
                        self.completions_url
                    )
                };
                return fail(out, true, error);
            }
            Ok(Ok(r)) => r,
        };
        let status = response.status();
        if !status.is_success() {
            let text = tokio::time::timeout(Duration::from_secs(5), response.text())
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
            if let Some(field) = openai::client_error(status.as_u16(), &text, &request.sampling) {
                // The engine refused a field the client set (a value out
                // of its range, an adapter it does not have): the client's
                // error, passed on as such.
                let _ = out.send(GenerateEvent::Rejected {
                    status: status.as_u16(),
                    param: Some(field.to_owned()),
                    error: format!(
                        "the engine refused the request ({status}): {}",
                        openai::error_message(&text)
                    ),
                });
                return;
            }
            // vLLM fails a pulling prefill whose read it declined (the
            // export expired, or expires within its 5 s margin) unless told
            // to recompute: say so where the operator reads it.
            let hint = if matches!(kind, Kind::PrefillFetch(_)) && status.is_server_error() {
                " (a prefill that pulls its prefix: vLLM fails it so when the read is declined, e.g. the source's export expired or expires within 5 s, unless the prefill engine's kv_load_failure_policy is recompute)"
            } else {
                ""
            };
            return fail(
                out,
                openai::retryable_status(status.as_u16()),
                format!(
                    "the engine answered HTTP {status}: {}{hint}",
                    openai::error_message(&text)
                ),
            );
        }
        if matches!(kind, Kind::Prefill | Kind::PrefillFetch(_)) {
            return self.prefilled(request, response, out).await;
        }
        self.stream(response, out, guard, request.sampling.logprobs.is_some())
            .await;
    }

    /// A `/v1/completions` call of `body` named `request_id`, pinned to
    /// this worker's data-parallel rank when the engine has several.
    fn completion_call(&self, request_id: &str, body: &Value) -> reqwest::RequestBuilder {
        let call = self
            .http
            .post(&self.completions_url)
            .header("x-request-id", request_id)
            .json(body);
        if self.dp_size > 1 {
            call.header("x-data-parallel-rank", self.worker.dp_rank().to_string())
        } else {
            call
        }
    }

    /// A prefill's non-streamed response: its `kv_transfer_params`.
    async fn prefilled(
        &self,
        request: GenerateRequest,
        response: reqwest::Response,
        out: &mpsc::UnboundedSender<GenerateEvent>,
    ) {
        let body = match tokio::time::timeout(self.timeout, response.json::<Value>()).await {
            Err(_) => {
                return fail(
                    out,
                    true,
                    "the prefill response did not complete in time".into(),
                )
            }
            Ok(Err(e)) => return fail(out, true, format!("the prefill response is not JSON: {e}")),
            Ok(Ok(v)) => v,
        };
        let chunk = match openai::parse_chunk(&body) {
            Ok(c) => c,
            Err(e) => return fail(out, false, format!("the prefill response: {e}")),
        };
        if let Some((error, code)) = chunk.error {
            return fail(
                out,
                code.is_none_or(openai::retryable_status),
                format!("the engine failed the prefill: {error}"),
            );
        }
        let Some(params) = chunk.kv_transfer_params else {
            return fail(
                out,
                false,
                "the prefill engine returned no kv_transfer_params: is it started with a KV connector (e.g. --kv-transfer-config with NixlConnector, kv_role kv_producer or kv_both)?".into(),
            );
        };
        let cached = chunk.usage.and_then(|u| u.cached_tokens);
        let _ = out.send(GenerateEvent::Prefilled {
            transfer: KvTransferParams {
                source: self.worker.clone(),
                prompt_tokens: request.prompt.len() as u32,
                engine: Some(params.to_string()),
            },
            cached_tokens: cached,
        });
        let _ = out.send(GenerateEvent::Finished {
            output_tokens: 0,
            cached_tokens: cached,
            reason: FinishReason::Prefilled,
        });
    }

    /// Has the engine export its blocks of `query`'s tokens (whole blocks
    /// of them) for another engine's read: a one-token request of them
    /// with `kv_transfer_params` ([`openai::Kind::Export`]), after which
    /// vLLM keeps the blocks until one read or its `decoder_kv_blocks_ttl`.
    /// Returns the engine's handle, of at most `max_bytes`; every outcome
    /// is counted (`worker_agent_kv_handle_queries_total`) and every miss
    /// logged with the request id.
    pub(super) async fn export(&self, query: KvHandleQuery, max_bytes: usize) -> Option<KvHandle> {
        let request_id = query.request_id.clone();
        let (outcome, handle) = match self.export_inner(query, max_bytes).await {
            Ok(handle) => ("given", Some(handle)),
            Err((outcome, why)) => {
                warn!(%request_id, reason = %why, "no export of a prefill worker's prefix");
                (outcome, None)
            }
        };
        counter!(m::KV_HANDLE_QUERIES, "outcome" => outcome).increment(1);
        handle
    }

    async fn export_inner(
        &self,
        query: KvHandleQuery,
        max_bytes: usize,
    ) -> Result<KvHandle, (&'static str, String)> {
        if !self.bidirectional {
            return Err((
                "disabled",
                "--vllm-bidirectional-kv is off on this worker".into(),
            ));
        }
        let bs = self.block_size.max(1) as usize;
        let asked = query.tokens.len() / bs;
        if asked == 0 {
            return Err(("empty", "the query names no whole block".into()));
        }
        // Only what the engine still holds: a block it lost since the
        // router saw it would be computed here, on the decode worker.
        let held = self.held_prefix_blocks(&query).await.ok_or((
            "failed",
            "the adapter's KV event task has stopped".to_owned(),
        ))?;
        if held == 0 {
            return Err((
                "unheld",
                format!("the engine holds none of the prefix's {asked} blocks any more, by its KV events (evicted since the router saw them): not computed here"),
            ));
        }
        if held < asked {
            debug!(
                request_id = %query.request_id,
                asked,
                held,
                "exporting only the leading blocks the engine still holds"
            );
        }
        let tokens = &query.tokens[..held * bs];
        let salt = Sampling {
            lora: query.lora,
            cache_salt: query.cache_salt,
            ..Sampling::default()
        };
        let body = openai::completion_body(&self.model, tokens, 1, &salt, &Kind::Export, false);
        let call = self.completion_call(&format!("{}-export", query.request_id), &body);
        let failed = |why: String| ("failed", why);
        let response = tokio::time::timeout(self.timeout, call.send())
            .await
            .map_err(|_| {
                failed(format!(
                    "the engine did not answer within {:?}",
                    self.timeout
                ))
            })?
            .map_err(|e| failed(format!("the request to the engine failed: {e}")))?;
        let status = response.status();
        let text = tokio::time::timeout(self.timeout, response.text())
            .await
            .map_err(|_| failed("the engine's answer did not complete in time".into()))?
            .map_err(|e| failed(format!("the engine's answer broke off: {e}")))?;
        if !status.is_success() {
            return Err(failed(format!(
                "the engine answered HTTP {status}: {}",
                openai::error_message(&text)
            )));
        }
        let chunk = serde_json::from_str::<Value>(&text)
            .map_err(|e| e.to_string())
            .and_then(|v| openai::parse_chunk(&v))
            .map_err(|e| ("unreadable", format!("the engine's answer: {e}")))?;
        let params = chunk.kv_transfer_params.ok_or((
            "unreadable",
            "the engine returned no kv_transfer_params: is it started with bidirectional_kv_xfer?"
                .to_owned(),
        ))?;
        let remote_tokens = params
            .get("remote_num_tokens")
            .and_then(Value::as_u64)
            .filter(|_| params.get("do_remote_decode").and_then(Value::as_bool) == Some(true))
            .ok_or_else(|| {
                (
                    "unreadable",
                    format!(
                        "the engine's kv_transfer_params are no handle to its blocks: {params}"
                    ),
                )
            })?;
        let blocks = (remote_tokens as usize).min(tokens.len()) / bs;
        if blocks == 0 {
            return Err((
                "unreadable",
                format!("the engine's handle covers no whole block: {params}"),
            ));
        }
        let engine = params.to_string();
        if engine.len() > max_bytes {
            return Err((
                "too_large",
                format!(
                    "its handle ({} bytes) is larger than the bus carries ({max_bytes}): the engine keeps the blocks until its TTL",
                    engine.len()
                ),
            ));
        }
        let recomputed = chunk
            .usage
            .and_then(|u| u.cached_tokens)
            .map(|cached| (tokens.len() as u64).saturating_sub(u64::from(cached)));
        if let Some(n) = recomputed {
            counter!(m::KV_EXPORT_RECOMPUTED_TOKENS).increment(n);
        }
        info!(
            request_id = %query.request_id,
            tokens = tokens.len(),
            blocks,
            recomputed,
            "the engine exported a prefix for a prefill worker"
        );
        Ok(KvHandle {
            blocks: blocks as u32,
            engine,
        })
    }

    /// How many leading whole blocks of `query`'s prompt the engine holds,
    /// by its KV events (`None`: the KV task is gone).
    async fn held_prefix_blocks(&self, query: &KvHandleQuery) -> Option<usize> {
        let (reply, held) = oneshot::channel();
        self.kv
            .send(KvCommand::HeldPrefix {
                tokens: query.tokens.clone(),
                lora: query.lora.clone(),
                cache_salt: query.cache_salt.clone(),
                reply,
            })
            .ok()?;
        held.await.ok()
    }

    /// A streamed completion: tokens as they come (with their
    /// log-probabilities when `logprobs` were asked for: an engine that
    /// sends tokens without them, or unreadable ones, refuses the field),
    /// then the end.
    async fn stream(
        &self,
        response: reqwest::Response,
        out: &mpsc::UnboundedSender<GenerateEvent>,
        guard: &InflightGuard,
        logprobs: bool,
    ) {
        let mut body = response.bytes_stream();
        let mut sse = openai::SseParser::new();
        let mut produced = 0u32;
        let mut finish: Option<String> = None;
        let mut usage = None;
        let mut text_only = false;
        loop {
            let next = match tokio::time::timeout(self.timeout, body.next()).await {
                Err(_) => {
                    return fail(
                        out,
                        true,
                        format!("the engine sent nothing for {:?}", self.timeout),
                    );
                }
                Ok(next) => next,
            };
            let datas = match next {
                Some(Ok(bytes)) => match sse.feed(&bytes) {
                    Ok(d) => d,
                    Err(e) => return fail(out, false, format!("the engine's stream: {e}")),
                },
                Some(Err(e)) => return fail(out, true, format!("the engine's stream broke: {e}")),
                None => {
                    let rest: Vec<String> = sse.finish().into_iter().collect();
                    if rest.is_empty() {
                        return match finish {
                            // A stream without [DONE] that said it finished.
                            Some(reason) => finished(out, produced, usage, &reason),
                            None => fail(
                                out,
                                true,
                                "the engine closed the stream before the request finished".into(),
                            ),
                        };
                    }
                    rest
                }
            };
            for data in datas {
                match openai::parse_event(&data) {
                    Ok(openai::Event::Done) => {
                        return finished(
                            out,
                            produced,
                            usage,
                            finish.as_deref().unwrap_or("length"),
                        );
                    }
                    Ok(openai::Event::Chunk(c)) => {
                        if let Some((error, code)) = c.error {
                            return fail(
                                out,
                                code.is_none_or(openai::retryable_status),
                                format!("the engine failed the request: {error}"),
                            );
                        }
                        match c.token_ids {
                            Some(ids) if !ids.is_empty() => {
                                produced += ids.len() as u32;
                                guard.produced(ids.len());
                                let event = match (logprobs, c.logprobs) {
                                    (false, _) => GenerateEvent::Tokens(ids),
                                    (true, Some(l)) if l.len() == ids.len() => {
                                        GenerateEvent::Scored {
                                            tokens: ids,
                                            logprobs: l,
                                        }
                                    }
                                    (true, l) => {
                                        return reject_logprobs(
                                            out,
                                            format!(
                                            "the engine sent {} tokens with {} log-probabilities",
                                            ids.len(),
                                            l.map_or(0, |l| l.len())
                                        ),
                                        )
                                    }
                                };
                                if out.send(event).is_err() {
                                    return;
                                }
                            }
                            Some(_) => {}
                            None if c.text.is_some() => {
                                guard.produced(1);
                                counter!(m::ENGINE_TEXT_ONLY_CHUNKS).increment(1);
                                if !text_only {
                                    text_only = true;
                                    warn!("the engine streams text without token ids (it ignores return_token_ids): no tokens can be reported");
                                }
                            }
                            None => {}
                        }
                        if c.finish_reason.is_some() {
                            finish = c.finish_reason;
                        }
                        if c.usage.is_some() {
                            usage = c.usage;
                        }
                    }
                    Err(e) if logprobs && e.starts_with("logprobs") => {
                        return reject_logprobs(out, e)
                    }
                    Err(e) => {
                        counter!(m::ENGINE_KV_SKIPPED, "reason" => "bad_chunk").increment(1);
                        warn!(error = %e, "an unreadable chunk from the engine: skipped");
                    }
                }
            }
        }
    }
}

/// The engine cannot return the log-probabilities asked for: a 400
/// naming `logprobs`, never tokens without them.
fn reject_logprobs(out: &mpsc::UnboundedSender<GenerateEvent>, error: String) {
    let _ = out.send(GenerateEvent::Rejected {
        status: 400,
        param: Some("logprobs".into()),
        error: format!("logprobs: this engine does not return them as asked: {error}"),
    });
}

fn fail(out: &mpsc::UnboundedSender<GenerateEvent>, retryable: bool, error: String) {
    let _ = out.send(GenerateEvent::Failed { error, retryable });
}

fn finished(
    out: &mpsc::UnboundedSender<GenerateEvent>,
    produced: u32,
    usage: Option<openai::Usage>,
    reason: &str,
) {
    let _ = out.send(GenerateEvent::Finished {
        output_tokens: usage.map_or(produced, |u| u.completion_tokens.max(produced)),
        cached_tokens: usage.and_then(|u| u.cached_tokens),
        reason: if reason == "length" {
            FinishReason::Length
        } else {
            FinishReason::Stop
        },
    });
}
