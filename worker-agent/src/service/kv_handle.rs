//! The third path's handles between agents (vLLM's bidirectional KV
//! transfer): before a prefill leg that pulls its prefix from a decode
//! worker, this agent asks that worker's agent for its engine's handle to
//! the longest leading part of the prompt it holds ([`ask`]); and every
//! agent answers such queries about its own engine, from its own task
//! ([`answer`]), as it answers probes. A reply the bus cannot carry is
//! not sent: the engine keeps a handle too large for it.

use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, Subscriber};
use futures::StreamExt;
use metrics::counter;
use protocol::{
    subjects, GenerateRequest, HashingContract, KvHandle, KvHandleQuery, KvHandleReply, Message,
};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::engine::Engine;
use crate::metrics as m;

/// How long a prefill leg waits for the source's agent (which answers
/// from memory) before it prefills whole.
pub(super) const ASK_TIMEOUT: Duration = Duration::from_secs(1);

/// Answers every handle query on `queries` with `engine`'s handle, until
/// aborted.
pub(super) fn answer(
    client: Client,
    mut queries: Subscriber,
    engine: Arc<dyn Engine>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(query) = queries.next().await {
            let Some(reply) = query.reply else { continue };
            let (request_id, handle) = match KvHandleQuery::decode(&query.payload) {
                Ok(q) => {
                    // Room for the reply's envelope beside the params.
                    let room = payload_limit(&client).saturating_sub(REPLY_OVERHEAD);
                    let handle = engine.take_kv_handle(&q, room);
                    if let Some(h) = &handle {
                        info!(
                            request_id = %q.request_id,
                            blocks = h.blocks,
                            "gave a prefill worker the handle to this engine's blocks of its prefix"
                        );
                    }
                    (Some(q.request_id), handle)
                }
                Err(e) => {
                    counter!(m::KV_HANDLE_QUERIES, "outcome" => "malformed").increment(1);
                    warn!(error = %e, "a malformed KV-handle query: answered with none");
                    (None, None)
                }
            };
            let given = handle.is_some();
            let answer = KvHandleReply { handle }.encode();
            if let Err(e) = client.publish(reply, answer.into()).await {
                counter!(m::KV_HANDLE_QUERIES, "outcome" => "unanswered").increment(1);
                warn!(
                    request_id = request_id.as_deref().unwrap_or("unknown"),
                    given,
                    error = %e,
                    "answering a KV-handle query failed (a handle given is lost: the engine keeps its blocks until their TTL)"
                );
            }
        }
    })
}

/// Bytes of a reply or query beside its handle or hashes (envelope,
/// request id, field headers), with room to spare.
const REPLY_OVERHEAD: usize = 4 << 10;

/// The most bytes one message may carry on this connection.
fn payload_limit(client: &Client) -> usize {
    client.server_info().max_payload
}

/// The handle of the engine `request`'s prefix is pulled from, if its
/// agent has one (`None`, logged and counted by why, for every other
/// outcome: the leg then prefills whole). The query names every whole
/// block of the prompt (the source matches as much as it holds, which may
/// be more than the router saw), cut from the front to the bus's payload
/// limit.
pub(super) async fn ask(
    client: &Client,
    contract: &HashingContract,
    request: &GenerateRequest,
) -> Option<KvHandle> {
    let fetch = request.annotation.fetch.as_ref()?;
    let outcome = |outcome: &'static str| {
        counter!(m::KV_HANDLE_ASKS, "outcome" => outcome).increment(1);
    };
    let base = match contract.hasher() {
        Ok(b) => b,
        Err(e) => {
            outcome("failed");
            warn!(request_id = %request.request_id, error = %e, "no KV-handle query: the contract's block size");
            return None;
        }
    };
    let hasher = request.sampling.block_hasher(base, &contract.model);
    let mut prefix = hasher.hash_prompt(&request.prompt);
    let room = payload_limit(client).saturating_sub(REPLY_OVERHEAD) / HASH_BYTES;
    let first = prefix.len().saturating_sub(room);
    prefix.drain(..first);
    let query = KvHandleQuery {
        request_id: request.request_id.clone(),
        first: first as u32,
        prefix,
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
            Ok(KvHandleReply { handle: None }) => {
                outcome("none_held");
                info!(
                    request_id = %request.request_id,
                    decision = %request.annotation.decision,
                    source = %fetch.source,
                    "the prefix's source holds no handle to it: prefilled whole"
                );
                return None;
            }
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

/// A block hash's bytes in a msgpack query (a u64 as 9 bytes).
const HASH_BYTES: usize = 9;
