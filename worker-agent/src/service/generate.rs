//! Generation: requests from the generate subject checked against the
//! worker's role and handed to the engine, its events forwarded as
//! numbered chunks; cancels from routers stop a stream.

use async_nats::{Client, Message as NatsMessage, Subject};
use futures::future::{self, FutureExt};
use futures::stream::BoxStream;
use futures::StreamExt;
use metrics::counter;
use protocol::{
    CancelRequest, DecisionId, GenerateChunk, GenerateEvent, GenerateRequest, Message,
    RequestFragment, Role, Stage, WorkerId,
};
use tracing::{debug, info, warn, Instrument};

use super::event_loop::Agent;
use crate::metrics as m;

/// Most bytes of fragmented generate requests waiting for their rest.
pub(super) const FRAGMENTS_MAX_BYTES: u64 = 256 << 20;
/// How long a fragmented request may take to arrive whole.
pub(super) const FRAGMENTS_MAX_AGE_MS: u64 = 30_000;

impl Agent {
    pub(super) fn on_generate(&mut self, message: NatsMessage) {
        let mut decoded = GenerateRequest::decode(&message.payload).map_err(|e| e.to_string());
        // A request larger than the bus's payload limit comes in fragments
        // with one reply subject: kept until the last one.
        if decoded.is_err() {
            if let (Ok(fragment), Some(reply)) = (
                RequestFragment::decode(&message.payload),
                message.reply.as_ref(),
            ) {
                let now_ms = self.origin.elapsed().as_millis() as u64;
                decoded = match self.fragments.push(reply.as_str(), fragment, now_ms) {
                    Ok(None) => return,
                    Ok(Some(whole)) => {
                        debug!(
                            bytes = whole.len(),
                            "a fragmented generate request is whole"
                        );
                        GenerateRequest::decode(&whole).map_err(|e| e.to_string())
                    }
                    Err(e) => {
                        counter!(m::MALFORMED_REQUESTS, "reason" => "fragment").increment(1);
                        Err(format!("a fragmented request: {e}"))
                    }
                };
            }
        }
        let Some(reply) = message.reply else {
            counter!(m::MALFORMED_REQUESTS, "reason" => "no_reply").increment(1);
            match &decoded {
                Ok(r) => warn!(
                    request_id = %r.request_id,
                    decision = %r.annotation.decision,
                    "generate request without a reply subject: dropped"
                ),
                Err(e) => warn!(
                    error = %e,
                    "generate message without a reply subject (and not a GenerateRequest): dropped"
                ),
            }
            return;
        };
        let request = match decoded {
            Ok(request) => request,
            Err(e) => {
                counter!(m::MALFORMED_REQUESTS, "reason" => "decode").increment(1);
                warn!(bytes = message.payload.len(), error = %e, "malformed generate request");
                let out = ChunkSender {
                    client: self.client.clone(),
                    subject: reply,
                    request_id: None,
                    decision: None,
                    stage: "unknown",
                };
                let failure = GenerateEvent::Failed {
                    error: format!("malformed GenerateRequest: {e}"),
                    retryable: false,
                };
                self.tasks
                    .spawn(async move { out.send(0, failure).await }.in_current_span());
                return;
            }
        };
        let stage = request.stage.as_str();
        let out = ChunkSender {
            client: self.client.clone(),
            subject: reply,
            request_id: Some(request.request_id.clone()),
            decision: Some(request.annotation.decision),
            stage,
        };
        if let Err(why) = check_request(self.role, &self.worker, &request) {
            counter!(m::GENERATE_REQUESTS, "stage" => stage, "outcome" => "refused").increment(1);
            warn!(
                request_id = %request.request_id,
                decision = %request.annotation.decision,
                stage,
                error = %why,
                "generate request refused"
            );
            let failure = GenerateEvent::Failed {
                error: why,
                retryable: false,
            };
            self.tasks
                .spawn(async move { out.send(0, failure).await }.in_current_span());
            return;
        }
        if let Some(field) = self.engine.unsupported(&request.sampling) {
            counter!(m::GENERATE_REQUESTS, "stage" => stage, "outcome" => "rejected").increment(1);
            warn!(
                request_id = %request.request_id,
                decision = %request.annotation.decision,
                stage,
                field,
                "generate request rejected: the engine cannot honour a field"
            );
            let rejected = GenerateEvent::Rejected {
                status: 400,
                param: Some(field.to_owned()),
                error: format!("{field}: this worker's engine cannot honour it"),
            };
            self.tasks
                .spawn(async move { out.send(0, rejected).await }.in_current_span());
            return;
        }
        info!(
            request_id = %request.request_id,
            decision = %request.annotation.decision,
            stage,
            sampling = ?request.sampling.fields_set(),
            prompt_tokens = request.prompt.len(),
            max_tokens = request.max_tokens,
            "generate"
        );
        let decision = request.annotation.decision;
        let held = self.in_flight.hold(decision);
        let pulls = matches!(request.stage, Stage::Prefill) && request.annotation.fetch.is_some();
        let events = if pulls && self.engine.wants_kv_handles() {
            // The source engine's handle to the prefix first (vLLM's
            // bidirectional transfer: it exports the prefix), from its
            // agent.
            let (engine, client) = (self.engine.clone(), self.client.clone());
            let block_size = self.block_size;
            async move {
                let handle = super::kv_handle::ask(&client, block_size, &request).await;
                engine.generate_pulling(request, handle)
            }
            .boxed()
        } else {
            future::ready(self.engine.generate(request)).boxed()
        };
        let task = self.tasks.spawn(
            async move {
                forward(out, events.await).await;
                drop(held);
            }
            .in_current_span(),
        );
        self.streams.insert(decision, task);
    }

    /// The router gave up on a request (its client went away): stop
    /// generating it. Late cancels (the stream already ended) are ignored.
    pub(super) fn on_cancel(&mut self, message: &NatsMessage) {
        let cancel = match CancelRequest::decode(&message.payload) {
            Ok(cancel) => cancel,
            Err(e) => {
                counter!(m::MALFORMED_REQUESTS, "reason" => "cancel").increment(1);
                warn!(bytes = message.payload.len(), error = %e, "malformed cancel request");
                return;
            }
        };
        let outcome = match self.streams.remove(&cancel.decision) {
            Some(task) if !task.is_finished() => {
                task.abort();
                info!(
                    request_id = %cancel.request_id,
                    decision = %cancel.decision,
                    reason = %cancel.reason,
                    "generation cancelled"
                );
                "cancelled"
            }
            _ => {
                debug!(request_id = %cancel.request_id, decision = %cancel.decision, "cancel for a stream that already ended");
                "already_ended"
            }
        };
        counter!(m::CANCELS, "outcome" => outcome).increment(1);
    }
}

/// Whether this worker can serve `request`, else a clear reason.
fn check_request(role: Role, worker: &WorkerId, request: &GenerateRequest) -> Result<(), String> {
    let served = match &request.stage {
        Stage::Local | Stage::Decode { .. } => role.decodes(),
        Stage::Prefill => role.prefills_for_others(),
    };
    if !served {
        return Err(format!(
            "worker {worker} has role {role} and does not serve {} requests",
            request.stage.as_str()
        ));
    }
    if request.prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    match &request.stage {
        Stage::Local | Stage::Decode { .. } if request.max_tokens == 0 => {
            return Err(format!(
                "max_tokens must be at least 1 for a {} request",
                request.stage.as_str()
            ));
        }
        Stage::Decode { transfer } if transfer.prompt_tokens as usize != request.prompt.len() => {
            return Err(format!(
                "the KV transfer from {} covers {} prompt tokens but the prompt has {}",
                transfer.source,
                transfer.prompt_tokens,
                request.prompt.len()
            ));
        }
        _ => {}
    }
    Ok(())
}

/// Sends one request's chunks to its reply subject.
#[derive(Debug)]
struct ChunkSender {
    client: Client,
    subject: Subject,
    request_id: Option<String>,
    decision: Option<DecisionId>,
    stage: &'static str,
}

impl ChunkSender {
    async fn send(&self, index: u32, event: GenerateEvent) {
        let chunk = GenerateChunk { index, event };
        if let Err(e) = self
            .client
            .publish(self.subject.clone(), chunk.encode().into())
            .await
        {
            counter!(m::PUBLISH_ERRORS, "kind" => "chunk").increment(1);
            warn!(
                request_id = self.request_id.as_deref().unwrap_or("-"),
                decision = %self.decision.map(|d| d.to_string()).unwrap_or_default(),
                index,
                error = %e,
                "generate chunk not sent"
            );
        }
    }
}

/// Forwards the engine's events as numbered chunks; a stream that ends
/// without a last event gets a retryable failure.
async fn forward(out: ChunkSender, mut events: BoxStream<'static, GenerateEvent>) {
    let request_id = out.request_id.clone().unwrap_or_default();
    let decision = out.decision.map(|d| d.to_string()).unwrap_or_default();
    let mut index = 0u32;
    let mut outcome = "interrupted";
    while let Some(event) = events.next().await {
        let last = event.is_last();
        match &event {
            GenerateEvent::Finished {
                output_tokens,
                cached_tokens,
                reason,
            } => {
                outcome = "finished";
                info!(
                    request_id,
                    decision,
                    stage = out.stage,
                    output_tokens,
                    cached_tokens,
                    reason = reason.as_str(),
                    "generate finished"
                );
            }
            GenerateEvent::Failed { error, retryable } => {
                outcome = "failed";
                warn!(
                    request_id,
                    decision,
                    stage = out.stage,
                    error,
                    retryable,
                    "generate failed"
                );
            }
            GenerateEvent::Rejected {
                status,
                param,
                error,
            } => {
                outcome = "rejected";
                warn!(
                    request_id,
                    decision,
                    stage = out.stage,
                    status,
                    param,
                    error,
                    "generate rejected"
                );
            }
            GenerateEvent::Tokens(_)
            | GenerateEvent::Scored { .. }
            | GenerateEvent::Prefilled { .. } => {}
        }
        out.send(index, event).await;
        index += 1;
        if last {
            break;
        }
    }
    if outcome == "interrupted" {
        warn!(
            request_id,
            decision,
            stage = out.stage,
            "the engine stopped before the request finished"
        );
        let failure = GenerateEvent::Failed {
            error: "the engine stopped before the request finished".into(),
            retryable: true,
        };
        out.send(index, failure).await;
    }
    counter!(m::GENERATE_REQUESTS, "stage" => out.stage, "outcome" => outcome).increment(1);
}

#[cfg(test)]
mod tests {
    use ::tests::fixtures::generate_request;
    use protocol::KvTransferParams;

    use super::*;

    fn request(stage: Stage, prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
        generate_request("r", stage, prompt, max_tokens)
    }

    #[test]
    fn roles_serve_their_stages_only() {
        let w: WorkerId = "p0".parse().unwrap();
        let err = check_request(Role::Prefill, &w, &request(Stage::Local, vec![1], 1)).unwrap_err();
        assert_eq!(
            err,
            "worker p0 has role prefill and does not serve local requests"
        );
        assert!(check_request(Role::Prefill, &w, &request(Stage::Prefill, vec![1], 0)).is_ok());
        assert!(check_request(Role::Decode, &w, &request(Stage::Prefill, vec![1], 0)).is_err());
        assert!(
            check_request(Role::Both, &w, &request(Stage::Local, vec![], 1))
                .unwrap_err()
                .contains("empty")
        );
        assert!(
            check_request(Role::Both, &w, &request(Stage::Local, vec![1], 0))
                .unwrap_err()
                .contains("max_tokens")
        );
        let transfer = KvTransferParams {
            source: w.clone(),
            prompt_tokens: 2,
            engine: None,
        };
        assert!(check_request(
            Role::Decode,
            &w,
            &request(Stage::Decode { transfer }, vec![1], 1)
        )
        .unwrap_err()
        .contains("covers 2 prompt tokens"));
    }
}
