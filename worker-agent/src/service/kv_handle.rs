//! The third path's handles between agents (vLLM's bidirectional KV
//! transfer): before a prefill leg that pulls its prefix from a decode
//! worker, this agent asks that worker's agent for its engine's handle to
//! the prefix's blocks ([`ask`]); and every agent answers such queries
//! about its own engine, from its own task ([`answer`]), as it answers
//! probes.

use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, Subscriber};
use futures::StreamExt;
use metrics::counter;
use protocol::{
    subjects, GenerateRequest, HashingContract, KvHandle, KvHandleQuery, KvHandleReply, Message,
};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

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
            let handle = match KvHandleQuery::decode(&query.payload) {
                Ok(q) => {
                    let handle = engine.take_kv_handle(&q.request_id, &q.prefix);
                    if let Some(h) = &handle {
                        info!(
                            request_id = %q.request_id,
                            blocks = h.blocks,
                            "gave a prefill worker the handle to this engine's blocks of its prefix"
                        );
                    }
                    handle
                }
                Err(e) => {
                    counter!(m::KV_HANDLE_QUERIES, "outcome" => "malformed").increment(1);
                    warn!(error = %e, "a malformed KV-handle query: answered with none");
                    None
                }
            };
            let answer = KvHandleReply { handle }.encode();
            if let Err(e) = client.publish(reply, answer.into()).await {
                debug!(error = %e, "answering a KV-handle query failed");
            }
        }
    })
}

/// The handle of the engine `request`'s prefix is pulled from, if its
/// agent has one (`None`, logged, for every other outcome: the leg then
/// prefills whole).
pub(super) async fn ask(
    client: &Client,
    contract: &HashingContract,
    request: &GenerateRequest,
) -> Option<KvHandle> {
    let fetch = request.annotation.fetch.as_ref()?;
    let base = protocol::BlockHasher::new(contract.block_size, contract.salt).ok()?;
    let hasher = request.sampling.block_hasher(base, &contract.model);
    let prefix_tokens = (fetch.prefix_tokens as usize).min(request.prompt.len());
    let query = KvHandleQuery {
        request_id: request.request_id.clone(),
        prefix: hasher.hash_prompt(&request.prompt[..prefix_tokens]),
    };
    let asked = client.request(subjects::kv_handle(&fetch.source), query.encode().into());
    let why = match tokio::time::timeout(ASK_TIMEOUT, asked).await {
        Err(_) => format!("no answer within {ASK_TIMEOUT:?}"),
        Ok(Err(e)) => format!("the query failed: {e}"),
        Ok(Ok(message)) => match KvHandleReply::decode(&message.payload) {
            Ok(KvHandleReply { handle: Some(h) }) => return Some(h),
            Ok(KvHandleReply { handle: None }) => "it holds none for this prefix".to_owned(),
            Err(e) => format!("its answer is malformed: {e}"),
        },
    };
    warn!(
        request_id = %request.request_id,
        decision = %request.annotation.decision,
        source = %fetch.source,
        reason = %why,
        "no KV handle from the prefix's source: prefilled whole"
    );
    None
}
