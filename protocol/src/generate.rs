//! Generation requests from routers to worker agents, streamed replies, and
//! the other request/reply and notice messages of the services.

use serde::{Deserialize, Serialize};

use crate::decision::Annotation;
use crate::ids::{BlockHash, DecisionId, WorkerId};

/// What a worker does with a routed request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stage {
    /// Bypass (or aggregated): prefill locally what is not cached, decode.
    Local,
    /// First leg of a remote prefill: prefill only, then reply with the
    /// parameters the decode worker needs to fetch the KV.
    Prefill,
    /// Second leg: decode with the KV of the prefill leg.
    Decode { transfer: KvTransferParams },
}

impl Stage {
    pub fn as_str(&self) -> &'static str {
        match self {
            Stage::Local => "local",
            Stage::Prefill => "prefill",
            Stage::Decode { .. } => "decode",
        }
    }
}

/// Where the KV of a finished prefill leg is, for the decode leg.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// The prefill worker holding the KV.
    pub source: WorkerId,
    pub prompt_tokens: u32,
    /// Engine-specific parameters passed through unchanged (vLLM's
    /// `kv_transfer_params` JSON).
    pub engine: Option<String>,
}

/// A routed request, sent to a worker's generate subject; the worker
/// streams [`GenerateChunk`]s to the message's reply subject.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub request_id: String,
    pub annotation: Annotation,
    pub stage: Stage,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
}

/// Why a stream ended normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "u8", try_from = "u8")]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length = 0,
    /// The model stopped.
    Stop = 1,
    /// A prefill leg is done.
    Prefilled = 2,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Prefilled => "prefilled",
        }
    }
}

impl From<FinishReason> for u8 {
    fn from(r: FinishReason) -> u8 {
        r as u8
    }
}

impl TryFrom<u8> for FinishReason {
    type Error = String;

    fn try_from(v: u8) -> Result<Self, Self::Error> {
        match v {
            0 => Ok(FinishReason::Length),
            1 => Ok(FinishReason::Stop),
            2 => Ok(FinishReason::Prefilled),
            other => Err(format!("unknown finish reason {other}")),
        }
    }
}

/// One step of a generation stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GenerateEvent {
    /// Output tokens, in order.
    Tokens(Vec<u32>),
    /// The prefill leg is done: the decode worker fetches the KV with these.
    Prefilled {
        transfer: KvTransferParams,
        /// Prompt tokens the prefill worker found cached.
        cached_tokens: u32,
    },
    /// Last message of a successful stream.
    Finished {
        output_tokens: u32,
        /// Prompt tokens the engine found cached (to set beside the router's
        /// prediction).
        cached_tokens: u32,
        reason: FinishReason,
    },
    /// Last message of a failed stream.
    Failed {
        error: String,
        /// Whether another worker may succeed (overload, engine restart), as
        /// opposed to a bad request.
        retryable: bool,
    },
}

impl GenerateEvent {
    /// Whether this ends the stream.
    pub fn is_last(&self) -> bool {
        matches!(
            self,
            GenerateEvent::Finished { .. } | GenerateEvent::Failed { .. }
        )
    }
}

/// A [`GenerateEvent`] with its place in the stream (from 0), so that a
/// receiver notices a lost chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerateChunk {
    pub index: u32,
    pub event: GenerateEvent,
}

/// Reply to a resync request: the worker republished its whole block set as
/// the first batch of a new epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResyncReply {
    pub worker: WorkerId,
    pub epoch: u64,
    pub blocks: u64,
}

/// Request/reply to the indexer: who holds how much of this prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlapQuery {
    pub block_hashes: Vec<BlockHash>,
}

/// One worker's cached prefix of a query, in blocks per tier (cumulative:
/// `host` counts device or host, `disk` any tier).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerOverlap {
    pub worker: WorkerId,
    pub device: u32,
    pub host: u32,
    pub disk: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlapReply {
    /// The index position the answer reflects.
    pub delta_seq: u64,
    pub workers: Vec<WorkerOverlap>,
}

/// A routed request's progress, so that every replica's in-flight ledger
/// releases what it reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "u8", try_from = "u8")]
pub enum Progress {
    /// The prefill is done (its prefill tokens leave the ledger).
    PrefillDone = 0,
    /// The request finished or failed (everything is released).
    Finished = 1,
}

impl From<Progress> for u8 {
    fn from(p: Progress) -> u8 {
        p as u8
    }
}

impl TryFrom<u8> for Progress {
    type Error = String;

    fn try_from(v: u8) -> Result<Self, Self::Error> {
        match v {
            0 => Ok(Progress::PrefillDone),
            1 => Ok(Progress::Finished),
            other => Err(format!("unknown progress {other}")),
        }
    }
}

/// Sent by the router to a worker serving a request nobody waits for any
/// more (the client went away): the worker stops generating it and frees
/// its KV. A cancel for a request the worker no longer serves is ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelRequest {
    pub decision: DecisionId,
    pub request_id: String,
    /// Why, for the worker's log.
    pub reason: String,
}

/// Published by the replica that dispatched a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestProgress {
    pub decision: DecisionId,
    pub progress: Progress,
    pub at_ms: u64,
}
