//! The agent's pure core: what it decides about KV batches, as plain
//! structs without IO, threads or a clock of their own (time is an
//! argument). The service (`crate::service`) and the cluster simulator
//! drive the same code.
//!
//! - [`KvOutbox`] (`outbox.rs`): numbering the engine's events into
//!   batches, the bounded queue, overflow, new epochs.
//! - [`Backoff`] (`backoff.rs`): delays between publishes of a batch that
//!   was not acknowledged.
//! - [`KvCore`] (`kv.rs`): the pipeline around the outbox, in the style of
//!   raft-rs's `RawNode`: [`KvCore::step`] takes an [`Input`] and the time
//!   and returns [`Effect`]s (publish, cancel, retry at, ask the engine for
//!   its block set, reply to a resync, note for metrics and logs).
//! - [`EXPORT_DEADLINE`], [`MAX_EXPORTS`] (`exports.rs`): the limits on
//!   the exports the agent's engine makes for other workers' prefill legs.

mod backoff;
mod exports;
mod kv;
mod outbox;

pub use backoff::Backoff;
pub use exports::{EXPORT_DEADLINE, MAX_EXPORTS};
pub use kv::{
    linger, stall_after, Effect, Input, KvCore, Note, ResyncReason, MAX_LINGER, MAX_STALL,
    MIN_LINGER, MIN_STALL,
};
pub use outbox::{KvOutbox, OutboxLimits, Pushed, StaleEpoch};
