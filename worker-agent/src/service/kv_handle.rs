//! The third path's handles between agents (vLLM's bidirectional KV
//! transfer): before a prefill leg that pulls its prefix from a decode
//! worker, this agent asks that worker's agent to have its engine export
//! the prefix and answer with the engine's handle to it ([`ask`]); and
//! every agent answers such queries about its own engine ([`answer`]),
//! each export a task of its own (it is a request to the engine), at most
//! [`MAX_EXPORTS`] at once and each within [`EXPORT_DEADLINE`], so that an
//! export the asker no longer waits for is not made (dropping the request
//! aborts it). A reply the bus cannot carry is not sent: the engine keeps
//! its export until its TTL.

use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, Subscriber};
use futures::StreamExt;
use metrics::counter;
use protocol::{subjects, GenerateRequest, KvHandle, KvHandleQuery, KvHandleReply, Message};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, warn, Instrument};

use crate::core::{EXPORT_DEADLINE, MAX_EXPORTS};
use crate::engine::Engine;
use crate::metrics as m;

/// How long a prefill leg waits for the source's agent (whose engine
/// exports the prefix in one step, unless its queue is long) before it
/// prefills whole.
pub(super) const ASK_TIMEOUT: Duration = Duration::from_secs(1);

/// Answers every handle query on `queries` with `engine`'s export, until
/// aborted (the exports under way with it).
pub(super) fn answer(
    client: Client,
    mut queries: Subscriber,
    engine: Arc<dyn Engine>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut exports = JoinSet::new();
        loop {
            tokio::select! {
                query = queries.next() => {
                    let Some(query) = query else { break };
                    let Some(reply) = query.reply else { continue };
                    if exports.len() >= MAX_EXPORTS {
                        counter!(m::KV_HANDLE_QUERIES, "outcome" => "busy").increment(1);
                        warn!(exports = exports.len(), "too many exports under way: a prefill worker's query answered with none");
                        send_reply(&client, reply, None, None).await;
                        continue;
                    }
                    let client = client.clone();
                    let engine = engine.clone();
                    exports.spawn(
                        async move {
                            answer_one(&client, reply, &query.payload, engine.as_ref()).await;
                        }
                        .in_current_span(),
                    );
                }
                Some(_) = exports.join_next(), if !exports.is_empty() => {}
            }
        }
    })
}

/// Has the engine export what `payload` asks for and answers on `reply`.
async fn answer_one(
    client: &Client,
    reply: async_nats::Subject,
    payload: &[u8],
    engine: &dyn Engine,
) {
    let (request_id, handle) = match KvHandleQuery::decode(payload) {
        Ok(q) => {
            // Room for the reply's envelope beside the params.
            let room = payload_limit(client).saturating_sub(REPLY_OVERHEAD);
            let request_id = q.request_id.clone();
            let handle = match tokio::time::timeout(EXPORT_DEADLINE, engine.export_kv(q, room))
                .await
            {
                Ok(handle) => handle,
                Err(_) => {
                    counter!(m::KV_HANDLE_QUERIES, "outcome" => "timeout").increment(1);
                    warn!(
                        request_id = %request_id,
                        "the engine's export took longer than {EXPORT_DEADLINE:?}: abandoned (the asker waits {ASK_TIMEOUT:?})"
                    );
                    None
                }
            };
            if let Some(h) = &handle {
                debug!(
                    request_id = %request_id,
                    blocks = h.blocks,
                    "answered a prefill worker with the engine's handle to its prefix"
                );
            }
            (Some(request_id), handle)
        }
        Err(e) => {
            counter!(m::KV_HANDLE_QUERIES, "outcome" => "malformed").increment(1);
            warn!(error = %e, "a malformed KV-handle query: answered with none");
            (None, None)
        }
    };
    send_reply(client, reply, handle, request_id.as_deref()).await;
}

/// Answers a query of `request_id` on `reply` with `handle`; a reply that
/// cannot be sent is warned of and counted (`unanswered`).
async fn send_reply(
    client: &Client,
    reply: async_nats::Subject,
    handle: Option<KvHandle>,
    request_id: Option<&str>,
) {
    let given = handle.is_some();
    let answer = KvHandleReply { handle }.encode();
    if let Err(e) = client.publish(reply, answer.into()).await {
        counter!(m::KV_HANDLE_QUERIES, "outcome" => "unanswered").increment(1);
        warn!(
            request_id = request_id.unwrap_or("unknown"),
            given,
            error = %e,
            "answering a KV-handle query failed (an export made is lost: the engine keeps its blocks until their TTL)"
        );
    }
}

/// Bytes of a reply or query beside its handle, or its tokens, adapter
/// and salt (envelope, request id, field headers), with room to spare.
const REPLY_OVERHEAD: usize = 4 << 10;

/// The most bytes one message may carry on this connection.
fn payload_limit(client: &Client) -> usize {
    client.server_info().max_payload
}

/// The handle the engine `request`'s prefix is pulled from exported for
/// it, if its agent got one (`None`, logged and counted by why, for every
/// other outcome: the leg then prefills whole). The query names the
/// prefix the router saw the source hold (whole blocks of `block_size`),
/// cut from the back to the bus's payload limit.
pub(super) async fn ask(
    client: &Client,
    block_size: u32,
    request: &GenerateRequest,
) -> Option<KvHandle> {
    let fetch = request.annotation.fetch.as_ref()?;
    let outcome = |outcome: &'static str| {
        counter!(m::KV_HANDLE_ASKS, "outcome" => outcome).increment(1);
    };
    let salt = |s: &Option<String>| s.as_ref().map_or(0, String::len);
    let room = payload_limit(client)
        .saturating_sub(REPLY_OVERHEAD)
        .saturating_sub(salt(&request.sampling.lora) + salt(&request.sampling.cache_salt))
        / TOKEN_BYTES;
    let bs = block_size.max(1) as usize;
    let tokens = (fetch.prefix_tokens as usize)
        .min(request.prompt.len())
        .min(room)
        / bs
        * bs;
    if tokens == 0 {
        outcome("empty");
        warn!(
            request_id = %request.request_id,
            prefix_tokens = fetch.prefix_tokens,
            "no whole block of the prefix to ask for: prefilled whole"
        );
        return None;
    }
    let query = KvHandleQuery {
        request_id: request.request_id.clone(),
        tokens: request.prompt[..tokens].to_vec(),
        lora: request.sampling.lora.clone(),
        cache_salt: request.sampling.cache_salt.clone(),
    };
    let asked = client.request(subjects::kv_handle(&fetch.source), query.encode().into());
    let (kind, why) = match tokio::time::timeout(ASK_TIMEOUT, asked).await {
        Err(_) => ("timeout", format!("no answer within {ASK_TIMEOUT:?}")),
        Ok(Err(e)) => ("failed", format!("the query failed: {e}")),
        Ok(Ok(message)) => match KvHandleReply::decode(&message.payload) {
            Ok(KvHandleReply { handle: Some(h) }) => {
                outcome("given");
                return Some(h);
            }
            Ok(KvHandleReply { handle: None }) => (
                "none",
                "the source's engine exported nothing (its agent logs why)".to_owned(),
            ),
            Err(e) => ("malformed", format!("its answer is malformed: {e}")),
        },
    };
    outcome(kind);
    warn!(
        request_id = %request.request_id,
        decision = %request.annotation.decision,
        source = %fetch.source,
        reason = %why,
        "no KV handle from the prefix's source: prefilled whole"
    );
    None
}

/// The most bytes a token takes in a msgpack query (a u32 as 5 bytes).
const TOKEN_BYTES: usize = 5;
