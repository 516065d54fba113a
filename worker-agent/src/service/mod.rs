//! The agent's service: a thin shell that connects the engine to NATS and
//! etcd around the pure [`crate::core::KvCore`].
//!
//! - `startup.rs`: [`run`] and [`run_with_engine`]: the engine, its
//!   contract (a mismatch is refused), NATS and etcd, registration, the
//!   orderly stop.
//! - `event_loop.rs`: the loop: one owner of the state, one closed `Event`
//!   enum awaited in one `select!`; load reports.
//! - `kv.rs`: the KV core's effects carried out (publishes, the retry
//!   timer, block-set requests, resync replies, metrics and logs).
//! - `generate.rs`: generation requests, chunks and cancels.
//! - `ping.rs`: answers routers' liveness probes, from its own task, until
//!   the agent has drained.
//! - `kv_handle.rs`: the third path's handles between agents: a pulling
//!   prefill leg asks its source's agent for the engine's handle to the
//!   prefix; queries about this engine are answered from their own task.

mod event_loop;
mod generate;
mod kv;
mod kv_handle;
mod ping;
mod startup;

pub use startup::{run, run_with_engine};
