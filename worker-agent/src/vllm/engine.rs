//! [`VllmEngine`]: a real engine (vLLM, or SGLang) behind the agent's
//! [`Engine`] trait: the handle, its configuration and errors, and the
//! state its tasks share. The IO shell around the pure parts, one job a
//! file: `connect.rs` (start-up: the API, model, block size, capacity, the
//! KV subscription), `load.rs` (scraping `/metrics`, the load), `kv_task.rs`
//! (the KV event task around the [`super::sequence::RankCore`]: one event
//! enum, one `select!`), `proxy.rs` (generation requests over HTTP, one
//! call each).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use engine_sim::Preset;
use futures::future::BoxFuture;
use futures::stream::{self, BoxStream};
use futures::StreamExt;
use protocol::{
    Capabilities, GenerateEvent, GenerateRequest, HashingContract, KvHandle, KvHandleQuery, Role,
    Sampling, WorkerId,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::kv_task::KvCommand;
use super::load::{self, Inflight, InflightGuard};
use super::prom::ScrapedLoad;
use super::proxy::RequestContext;
use super::zmq::ReplayLimits;
use crate::engine::{Engine, EngineFacts, EngineLoad, KvUpdate};

/// Which engine is behind the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    Vllm,
    Sglang,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        }
    }

    /// The legs an engine of this kind with `role` can serve through this
    /// adapter. vLLM: every leg (NIXL). SGLang: no remote leg (its
    /// prefill/decode bootstrap handshake is not implemented); a decode
    /// server prefills locally only with `do_local_prefill` (SGLang builds
    /// that accept it), an aggregated one always.
    pub fn capabilities(self, role: Role, do_local_prefill: bool) -> Capabilities {
        match self {
            EngineKind::Vllm => Capabilities::default(),
            EngineKind::Sglang => Capabilities {
                local_prefill: role == Role::Both || (role == Role::Decode && do_local_prefill),
                remote_decode: false,
                remote_prefill: false,
            },
        }
    }

    /// The first sampling field the adapter cannot pass to this kind of
    /// engine. vLLM's `/v1/completions` takes every one (`lora` as the
    /// `model`); SGLang's OpenAI API has no `cache_salt`, and selects
    /// adapters in a way this adapter does not speak.
    pub fn unsupported(self, sampling: &Sampling) -> Option<&'static str> {
        const SGLANG_LACKS: [&str; 2] = ["cache_salt", "lora"];
        match self {
            EngineKind::Vllm => None,
            EngineKind::Sglang => sampling
                .fields_set()
                .into_iter()
                .find(|f| SGLANG_LACKS.contains(f)),
        }
    }
}

/// How to reach the engine and what the deployment expects of it.
#[derive(Debug, Clone)]
pub struct VllmConfig {
    pub kind: EngineKind,
    /// The worker (its data-parallel rank offsets the ZMQ ports).
    pub worker: WorkerId,
    pub role: Role,
    /// The deployment's model: the engine must serve it.
    pub model: String,
    /// The deployment's block size: the engine's blocks must have it.
    pub block_size: u32,
    /// The OpenAI API's base URL, e.g. `http://127.0.0.1:8000`.
    pub api_url: String,
    /// The KV-event publisher of rank 0, e.g. `tcp://127.0.0.1:5557`.
    pub kv_events: String,
    /// The replay socket of rank 0, if the engine has one.
    pub kv_replay: Option<String>,
    pub topic: String,
    /// Data-parallel ranks behind one API server: requests are pinned to
    /// this worker's rank (`X-data-parallel-rank`) when above 1.
    pub dp_size: u32,
    /// Hardware facts for the registration (GPUs, KV bytes per token,
    /// step budget) and the KV capacity when the engine does not say.
    pub preset: Preset,
    pub kv_capacity_blocks: Option<u32>,
    /// How long to wait for the engine to come up.
    pub startup_timeout: Duration,
    /// A request that makes no progress for this long fails (retryable).
    pub request_timeout: Duration,
    pub metrics_interval: Duration,
    /// Ask for generated token ids (`return_token_ids`).
    pub return_token_ids: bool,
    /// vLLM's bidirectional KV transfer (the third path): have the engine
    /// export a prefix a prefill worker asks for, and serve a prefill leg
    /// that fetches its prefix with its source's handle; off: as a plain
    /// prefill.
    pub bidirectional_kv: bool,
    /// SGLang decode server: send bypasses with `do_local_prefill: true`.
    pub do_local_prefill: bool,
    /// Limits of one replay request.
    pub replay: ReplayLimits,
    /// When nothing came on the SUB socket for this long, ask the replay
    /// socket for anything after the last batch seen; `None`: never.
    pub idle_check: Option<Duration>,
}

/// Why the adapter cannot start.
#[derive(Debug, thiserror::Error)]
pub enum VllmError {
    #[error("the {kind} engine's API at {url} did not answer within {waited:?}: {last}")]
    Unreachable {
        kind: &'static str,
        url: String,
        waited: Duration,
        last: String,
    },
    #[error("the engine at {url} serves no model")]
    NoModel { url: String },
    #[error("the engine's KV events: {0}")]
    Zmq(String),
    #[error("the HTTP client: {0}")]
    Http(String),
    #[error("the engine names blocks differently from the deployment (model {:?}, block size {}): {source}", configured.model, configured.block_size)]
    Contract {
        configured: HashingContract,
        #[source]
        source: protocol::ContractMismatch,
    },
}

/// State shared by the engine's tasks and its handle.
#[derive(Debug, Default)]
pub(super) struct Shared {
    pub(super) scraped: Mutex<ScrapedLoad>,
    pub(super) inflight: Mutex<Inflight>,
    pub(super) failure: Mutex<Option<String>>,
}

/// Locks `m`, also when a task panicked holding it (nothing is left
/// half-done under these locks).
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A real engine behind the agent. See the module documentation of
/// [`crate::vllm`].
#[derive(Debug)]
pub struct VllmEngine {
    pub(super) facts: EngineFacts,
    pub(super) ctx: Arc<RequestContext>,
    pub(super) shared: Arc<Shared>,
    pub(super) kv_updates: Mutex<Option<mpsc::UnboundedReceiver<KvUpdate>>>,
    pub(super) commands: mpsc::UnboundedSender<KvCommand>,
    pub(super) stop: watch::Sender<bool>,
    pub(super) tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for VllmEngine {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}

impl Engine for VllmEngine {
    fn facts(&self) -> EngineFacts {
        self.facts.clone()
    }

    fn take_kv_updates(&self) -> Option<BoxStream<'static, KvUpdate>> {
        let mut rx = lock(&self.kv_updates).take()?;
        Some(stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed())
    }

    fn request_block_set(&self) {
        let _ = self.commands.send(KvCommand::BlockSet);
    }

    fn load(&self) -> EngineLoad {
        load::engine_load(
            &self.shared,
            self.ctx.block_size,
            self.facts.kv_capacity_blocks,
        )
    }

    fn generate(&self, request: GenerateRequest) -> BoxStream<'static, GenerateEvent> {
        self.generate_pulling(request, None)
    }

    fn wants_kv_handles(&self) -> bool {
        self.ctx.bidirectional
    }

    fn generate_pulling(
        &self,
        request: GenerateRequest,
        handle: Option<KvHandle>,
    ) -> BoxStream<'static, GenerateEvent> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let ctx = self.ctx.clone();
        let guard = InflightGuard::new(&self.shared, &request);
        tokio::spawn(
            async move {
                // A dropped stream (the router cancelled the request) drops
                // the HTTP response, and vLLM aborts a request whose
                // connection closed. The stream also stops at the next
                // token it cannot pass on; this covers a silent engine
                // (queued, or in a long prefill).
                tokio::select! {
                    () = ctx.serve(request, handle, &tx, &guard) => {}
                    () = tx.closed() => {}
                }
            }
            .in_current_span(),
        );
        stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
    }

    fn unsupported(&self, sampling: &Sampling) -> Option<&'static str> {
        self.ctx.kind.unsupported(sampling)
    }

    fn export_kv(
        &self,
        query: KvHandleQuery,
        max_bytes: usize,
    ) -> BoxFuture<'static, Option<KvHandle>> {
        let ctx = self.ctx.clone();
        Box::pin(async move { ctx.export(query, max_bytes).await }.in_current_span())
    }

    fn stop(&self) {
        let _ = self.stop.send(true);
    }

    fn failure(&self) -> Option<String> {
        lock(&self.shared.failure).clone()
    }
}
