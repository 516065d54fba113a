//! What the agent needs from an engine, so that the simulated engine and a
//! real one (a vLLM adapter: ZMQ KV events translated to canonical
//! [`KvEvent`]s, generation forwarded over HTTP) slot in the same way.
//!
//! The engine speaks in canonical terms only: block hashes of
//! [`protocol::BlockHasher`] under its [`HashingContract`], [`KvEvent`]
//! lists, [`GenerateEvent`]s. The agent owns everything on the wire:
//! epochs, sequence numbers, batching, publishing, retries, registration.

use std::fmt;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use protocol::{
    GenerateEvent, GenerateRequest, HashingContract, KvEvent, KvHandle, KvHandleQuery, LoadReport,
    Sampling, WorkerId,
};

/// Facts about the engine that do not change while it runs (they go into
/// the worker's [`protocol::WorkerRecord`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFacts {
    /// How the engine names its blocks; the agent refuses to start when it
    /// differs from the configured contract.
    pub contract: HashingContract,
    /// KV cache capacity in blocks.
    pub kv_capacity_blocks: u64,
    /// Most tokens one engine step processes.
    pub max_batched_tokens: u32,
    /// KV bytes per token over the whole worker.
    pub kv_bytes_per_token: u64,
    /// GPUs behind the worker.
    pub gpus: u32,
    /// The longest prompt plus output the engine takes (0: unknown).
    pub max_model_len: u32,
}

/// The engine's load now: a [`LoadReport`] without the worker and clock,
/// which the agent adds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineLoad {
    pub running: u32,
    pub waiting: u32,
    pub queued_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub kv_blocks_used: u64,
    pub kv_blocks_total: u64,
    /// The inter-token latency its decodes saw lately, µs (0: unknown or
    /// nothing decoding; see [`LoadReport::recent_itl_us`]).
    pub recent_itl_us: u32,
}

impl EngineLoad {
    /// The report of `worker` at `at_ms` on the agent's clock.
    pub fn report(self, worker: WorkerId, at_ms: u64) -> LoadReport {
        LoadReport {
            worker,
            running: self.running,
            waiting: self.waiting,
            queued_prefill_tokens: self.queued_prefill_tokens,
            active_decode_blocks: self.active_decode_blocks,
            kv_blocks_used: self.kv_blocks_used,
            kv_blocks_total: self.kv_blocks_total,
            at_ms,
            recent_itl_us: self.recent_itl_us,
        }
    }
}

impl From<&LoadReport> for EngineLoad {
    fn from(r: &LoadReport) -> Self {
        Self {
            running: r.running,
            waiting: r.waiting,
            queued_prefill_tokens: r.queued_prefill_tokens,
            active_decode_blocks: r.active_decode_blocks,
            kv_blocks_used: r.kv_blocks_used,
            kv_blocks_total: r.kv_blocks_total,
            recent_itl_us: r.recent_itl_us,
        }
    }
}

/// One item of the engine's KV stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvUpdate {
    /// Canonical events, in the engine's order. A `Cleared` means the
    /// engine lost every block (its restart, a cache reset).
    Events(Vec<KvEvent>),
    /// The engine's whole block set, answering
    /// [`Engine::request_block_set`]: only `Stored` events, every held
    /// block once, each parent before its children. It reflects every
    /// `Events` item before it in the stream and none after it, so the
    /// agent can start a new epoch from it without losing or repeating a
    /// change.
    BlockSet(Vec<KvEvent>),
}

/// An engine behind the agent. Object-safe: the agent holds an
/// `Arc<dyn Engine>`.
pub trait Engine: Send + Sync + fmt::Debug {
    /// The engine's static facts.
    fn facts(&self) -> EngineFacts;

    /// The engine's KV stream (events and requested block sets, in order).
    /// There is one: `None` once it was taken. The stream ends when the
    /// engine stops.
    fn take_kv_updates(&self) -> Option<BoxStream<'static, KvUpdate>>;

    /// Asks for the full block set; it comes as a [`KvUpdate::BlockSet`]
    /// in the KV stream. Requests made before it arrives may share it.
    fn request_block_set(&self);

    /// The load now (cheap: the agent polls it every few milliseconds).
    fn load(&self) -> EngineLoad;

    /// Serves a request whose stage the worker's role accepts (the agent
    /// checks). The stream yields the request's events and ends after a
    /// [`GenerateEvent::Finished`] or [`GenerateEvent::Failed`]; if it ends
    /// without one (the engine stopped), the agent sends a retryable
    /// failure.
    fn generate(&self, request: GenerateRequest) -> BoxStream<'static, GenerateEvent>;

    /// Whether a prefill leg that pulls its prefix from a decode worker
    /// ([`protocol::Path::RemoteFetch`]) needs that engine's handle to the
    /// blocks (vLLM's bidirectional KV transfer). The agent then asks the
    /// source's agent to have its engine export them
    /// ([`protocol::subjects::kv_handle`], [`Engine::export_kv`]) and
    /// serves the leg with [`Engine::generate_pulling`].
    fn wants_kv_handles(&self) -> bool {
        false
    }

    /// Serves a prefill leg that pulls its prefix, with the source
    /// engine's handle (`None`: the source had none to give, so the leg
    /// prefills whole).
    fn generate_pulling(
        &self,
        request: GenerateRequest,
        handle: Option<KvHandle>,
    ) -> BoxStream<'static, GenerateEvent> {
        let _ = handle;
        self.generate(request)
    }

    /// Has the engine export its blocks of `query`'s tokens for another
    /// engine's read, and returns its handle to them, of at most
    /// `max_bytes` of engine parameters (what the bus carries). vLLM with
    /// bidirectional KV transfer: a one-token request of those tokens,
    /// whose blocks the engine then keeps until one read or its TTL.
    /// `None`: nothing exported (the engine says why in its log and
    /// metrics).
    fn export_kv(
        &self,
        query: KvHandleQuery,
        max_bytes: usize,
    ) -> BoxFuture<'static, Option<KvHandle>> {
        let _ = (query, max_bytes);
        metrics::counter!(crate::metrics::KV_HANDLE_QUERIES, "outcome" => "disabled").increment(1);
        Box::pin(std::future::ready(None))
    }

    /// The first field of `sampling` (its HTTP name) this engine cannot
    /// honour: the agent answers such a request with a
    /// [`GenerateEvent::Rejected`] naming it rather than serve it
    /// without.
    fn unsupported(&self, sampling: &Sampling) -> Option<&'static str>;

    /// Stops serving: in-flight generation streams and the KV stream end.
    fn stop(&self);

    /// Why the engine stopped, when it failed (e.g. a real engine whose
    /// blocks are not the deployment's size): the agent exits with it
    /// when the KV stream ends.
    fn failure(&self) -> Option<String> {
        None
    }
}
