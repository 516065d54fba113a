//! Generation requests from routers to worker agents, streamed replies, and
//! the other request/reply and notice messages of the services.

use serde::{Deserialize, Serialize};

use crate::decision::Annotation;
use crate::hash::{BlockHasher, HashSalt};
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub request_id: String,
    pub annotation: Annotation,
    pub stage: Stage,
    /// On the wire as packed bytes ([`packed_tokens`]): 3 bytes a token
    /// for vocabularies below 16M, so that a 256k-token prompt (768 KiB)
    /// fits NATS's default 1 MiB payload.
    #[serde(with = "packed_tokens")]
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    /// How to sample and when to stop: every field the client set, for
    /// the engine to honour or refuse (never to drop).
    pub sampling: Sampling,
}

/// Token ids as one byte string: a width byte (1 to 4: the bytes of the
/// largest id), then each id in that many little-endian bytes. A msgpack
/// array of ids takes 5 bytes for each id of 65,536 and above (most of a
/// 128k vocabulary).
pub mod packed_tokens {
    use serde::de::{self, Deserializer, Visitor};
    use serde::Serializer;

    /// The bytes of `tokens`.
    pub fn pack(tokens: &[u32]) -> Vec<u8> {
        let max = tokens.iter().copied().max().unwrap_or(0);
        let width = (4 - max.leading_zeros() as usize / 8).max(1);
        let mut out = Vec::with_capacity(1 + tokens.len() * width);
        out.push(width as u8);
        for t in tokens {
            out.extend_from_slice(&t.to_le_bytes()[..width]);
        }
        out
    }

    /// The tokens of [`pack`]'s bytes; an error for any other.
    pub fn unpack(bytes: &[u8]) -> Result<Vec<u32>, String> {
        let (&width, ids) = bytes
            .split_first()
            .ok_or("packed tokens without their width byte")?;
        let width = usize::from(width);
        if !(1..=4).contains(&width) || ids.len() % width != 0 {
            return Err(format!(
                "packed tokens of width {width}: {} bytes is not a whole number of ids",
                ids.len()
            ));
        }
        Ok(ids
            .chunks_exact(width)
            .map(|c| {
                let mut b = [0u8; 4];
                b[..width].copy_from_slice(c);
                u32::from_le_bytes(b)
            })
            .collect())
    }

    pub fn serialize<S: Serializer>(tokens: &[u32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&pack(tokens))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Vec<u32>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("packed token ids (a byte string)")
            }

            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u32>, E> {
                unpack(v).map_err(E::custom)
            }
        }
        d.deserialize_bytes(V)
    }
}

/// The sampling and stopping parameters of a request, as the client set
/// them (`None`, empty or `false`: not set, the engine's default). Names
/// and meanings are OpenAI's and vLLM's `SamplingParams`'; the router
/// checked types and ranges.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// `-1` (or `0`): no top-k.
    pub top_k: Option<i32>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    /// Stop strings (the engine detokenizes to find them).
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    /// Generate past the end-of-sequence token.
    pub ignore_eos: bool,
    /// No EOS or stop token before this many output tokens.
    pub min_tokens: u32,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// Log-probabilities of this many most likely tokens per position.
    pub logprobs: Option<u32>,
    /// Token id and bias, in token order.
    pub logit_bias: Vec<(u32, f64)>,
    /// OpenAI's `response_format` object, as JSON text.
    pub response_format: Option<String>,
    /// vLLM's `cache_salt`: the request's KV blocks are shared only with
    /// requests of the same salt.
    pub cache_salt: Option<String>,
    /// The LoRA adapter to generate with (vLLM selects it by `model`).
    pub lora: Option<String>,
}

impl Sampling {
    /// The fields an engine receives under these names (OpenAI's and vLLM's,
    /// as in the HTTP body), in declaration order; `lora` is apart, since
    /// vLLM selects an adapter by `model`.
    pub const ENGINE_FIELDS: [&'static str; 16] = [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logprobs",
        "logit_bias",
        "response_format",
        "cache_salt",
    ];

    /// The names (as in the HTTP body) of the fields set, in declaration
    /// order: what an engine must honour.
    pub fn fields_set(&self) -> Vec<&'static str> {
        let set = [
            self.temperature.is_some(),
            self.top_p.is_some(),
            self.top_k.is_some(),
            self.min_p.is_some(),
            self.seed.is_some(),
            !self.stop.is_empty(),
            !self.stop_token_ids.is_empty(),
            self.ignore_eos,
            self.min_tokens > 0,
            self.presence_penalty.is_some(),
            self.frequency_penalty.is_some(),
            self.repetition_penalty.is_some(),
            self.logprobs.is_some(),
            !self.logit_bias.is_empty(),
            self.response_format.is_some(),
            self.cache_salt.is_some(),
        ];
        Self::ENGINE_FIELDS
            .into_iter()
            .zip(set)
            .chain([("lora", self.lora.is_some())])
            .filter_map(|(name, on)| on.then_some(name))
            .collect()
    }

    /// The hasher of this request's blocks: `base` (the deployment's, for
    /// `model`), or salted with its LoRA adapter and `cache_salt` when it
    /// has either, as an engine's `BlockStored` for it is salted (from its
    /// `lora_name` and `cache_salt`), so that they match each other and
    /// nothing else.
    pub fn block_hasher(&self, base: BlockHasher, model: &str) -> BlockHasher {
        let (lora, cache_salt) = (self.lora.as_deref(), self.cache_salt.as_deref());
        if lora.is_none() && cache_salt.is_none() {
            return base;
        }
        BlockHasher::new(base.block_size(), HashSalt::new(model, lora, cache_salt)).unwrap_or(base)
    }
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

/// The log-probabilities of one generated token (OpenAI's `logprobs`):
/// its own, and the most likely tokens at its position, most likely first
/// (as many as `Sampling::logprobs` asked for).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// One step of a generation stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum GenerateEvent {
    /// Output tokens, in order.
    Tokens(Vec<u32>),
    /// The prefill leg is done: the decode worker fetches the KV with these.
    Prefilled {
        transfer: KvTransferParams,
        /// Prompt tokens the prefill worker's engine found cached, when it
        /// says (`None`: it did not).
        cached_tokens: Option<u32>,
    },
    /// Last message of a successful stream.
    Finished {
        output_tokens: u32,
        /// Prompt tokens the engine found cached (to set beside the router's
        /// prediction), when it says (`None`: it did not).
        cached_tokens: Option<u32>,
        reason: FinishReason,
    },
    /// Last message of a stream the engine (or its agent) refused as
    /// asked: a client error (a field it cannot honour, a value it
    /// rejects), answered with `status` (4xx) and not retried elsewhere.
    Rejected {
        status: u16,
        /// The request field at fault, when known.
        param: Option<String>,
        error: String,
    },
    /// Last message of a failed stream.
    Failed {
        error: String,
        /// Whether another worker may succeed (overload, engine restart), as
        /// opposed to a bad request.
        retryable: bool,
    },
    /// Output tokens, in order, with their log-probabilities (one entry a
    /// token): what a request that set `Sampling::logprobs` streams
    /// instead of `Tokens`. Added after the others, so that older
    /// receivers decode every other event unchanged.
    Scored {
        tokens: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
    },
}

impl GenerateEvent {
    /// Whether this ends the stream.
    pub fn is_last(&self) -> bool {
        matches!(
            self,
            GenerateEvent::Finished { .. }
                | GenerateEvent::Failed { .. }
                | GenerateEvent::Rejected { .. }
        )
    }
}

/// A [`GenerateEvent`] with its place in the stream (from 0), so that a
/// receiver notices a lost chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

/// A router's probe of a quiet leg, on [`crate::subjects::ping`]: is the
/// agent there, and does it still serve the leg of `decision`? A leg the
/// agent does not hold was lost on the bus (a NATS node died with the
/// request or its last chunks): the router retries it while nothing has
/// streamed. An empty probe asks only whether the agent is there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LegProbe {
    pub decision: DecisionId,
}

/// The agent's answer to a [`LegProbe`] (an empty answer: the agent is
/// there, and says nothing of legs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LegProbeReply {
    pub decision: DecisionId,
    /// Whether a stream of that decision is still being generated here.
    pub in_flight: bool,
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

/// Request/reply to the agent of a decode worker, on
/// [`crate::subjects::kv_handle`]: the prefill worker's agent of a
/// [`crate::Path::RemoteFetch`] leg asks it to have its engine export the
/// prompt's prefix the router saw it hold (vLLM's bidirectional KV
/// transfer: a one-token request of the prefix, whose blocks the engine
/// then keeps for one read), and answers with the engine's handle to them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvHandleQuery {
    /// The leg's request, for the source's log.
    pub request_id: String,
    /// The prompt's leading tokens to export: whole blocks (cut from the
    /// back to what the bus carries).
    pub tokens: Vec<u32>,
    /// The request's LoRA adapter and `cache_salt`: the source's prefix
    /// cache names the prefix's blocks with them
    /// ([`Sampling::block_hasher`]).
    pub lora: Option<String>,
    pub cache_salt: Option<String>,
}

/// The answer to a [`KvHandleQuery`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvHandleReply {
    /// `None`: the source's engine exported nothing (it failed, or the
    /// engine exports nothing: its agent says why in its log and metrics).
    pub handle: Option<KvHandle>,
}

/// An engine's handle to KV blocks another engine may read once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvHandle {
    /// How many leading blocks of the query's tokens it covers.
    pub blocks: u32,
    /// Engine-specific, passed through unchanged (vLLM's
    /// `kv_transfer_params` JSON).
    pub engine: String,
}

/// Published by the replica that dispatched a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestProgress {
    pub decision: DecisionId,
    pub progress: Progress,
    pub at_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::HashingContract;

    /// A salted request's blocks match blocks stored under the same
    /// adapter and salt, not the base model's nor another tenant's.
    #[test]
    fn lora_and_cache_salt_salt_the_hashes() {
        let contract = HashingContract::for_model("m", 4);
        let base = BlockHasher::new(4, contract.salt).unwrap();
        let prompt: Vec<u32> = (0..12).collect();
        let with = |lora: Option<&str>, salt: Option<&str>| {
            let s = Sampling {
                lora: lora.map(str::to_owned),
                cache_salt: salt.map(str::to_owned),
                ..Sampling::default()
            };
            s.block_hasher(base, "m").hash_prompt(&prompt)
        };
        assert_eq!(with(None, None), base.hash_prompt(&prompt));
        let stored = BlockHasher::new(4, HashSalt::new("m", Some("a"), Some("t1"))).unwrap();
        assert_eq!(with(Some("a"), Some("t1")), stored.hash_prompt(&prompt));
        let all = [
            with(None, None),
            with(Some("a"), None),
            with(None, Some("t1")),
            with(Some("a"), Some("t1")),
            with(Some("a"), Some("t2")),
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a[0], b[0]);
            }
        }
    }
}
