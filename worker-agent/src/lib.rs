//! Switchyard's worker agent: the sidecar beside one engine worker.
//!
//! - registers the worker's [`protocol::WorkerRecord`] in etcd under a
//!   lease kept alive while the agent runs (revoked at shutdown);
//! - publishes the engine's KV events as [`protocol::KvEventBatch`]es to
//!   JetStream: a fresh epoch at every start whose first batch starts with
//!   `Cleared`, `seq` gap-free from 0, each batch retried with the same
//!   message id until acknowledged ([`core`]);
//! - publishes [`protocol::LoadReport`]s at least every 100 ms and on
//!   change;
//! - answers resync requests with a new epoch holding the full block set;
//! - serves generation requests (local, prefill, decode stages), streaming
//!   numbered [`protocol::GenerateChunk`]s to the reply subject.
//!
//! The engine sits behind the [`Engine`] trait; [`SimEngine`] is the
//! built-in simulated engine (`engine_sim` driven in real time, sped up),
//! [`vllm::VllmEngine`] a real vLLM or SGLang server (or mock-vllm): KV
//! events over ZMQ translated to canonical hashes, load from its
//! metrics, generation over its OpenAI API (`--engine vllm|sglang`).
//!
//! What the agent decides about KV batches is a pure core ([`core`]:
//! numbering, retries, resyncs, owed replies) that the service drives and
//! the cluster simulator drives too. Without the default `service` feature
//! the crate is only that core and [`BlockMirror`] (no tokio, no NATS).
//!
//! ```no_run
//! # #[cfg(feature = "service")]
//! # async fn example() -> Result<(), worker_agent::AgentError> {
//! let options = worker_agent::Options::new("decode-0", "nats://127.0.0.1:4222", &["http://127.0.0.1:2379".into()]);
//! worker_agent::run(options.validate()?, async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```

pub mod block_set;
#[cfg(feature = "service")]
pub mod config;
pub mod core;
#[cfg(feature = "service")]
pub mod engine;
#[cfg(feature = "service")]
pub mod error;
#[cfg(feature = "service")]
pub mod http;
#[cfg(feature = "service")]
pub mod metrics;
#[cfg(feature = "service")]
pub mod service;
#[cfg(feature = "service")]
pub mod sim_engine;
#[cfg(feature = "service")]
pub mod vllm;

pub use crate::core::{Backoff, KvCore, KvOutbox, OutboxLimits, Pushed};
pub use block_set::BlockMirror;
#[cfg(feature = "service")]
pub use config::{
    engine_model, Args, Config, ConfigError, EngineChoice, EngineModelError, Loaded, Options,
};
#[cfg(feature = "service")]
pub use engine::{Engine, EngineFacts, EngineLoad, KvUpdate};
#[cfg(feature = "service")]
pub use error::AgentError;
#[cfg(feature = "service")]
pub use service::{run, run_with_engine};
#[cfg(feature = "service")]
pub use sim_engine::{SimEngine, SimEngineConfig};
