//! The kv-indexer: the global KV block-ownership index, its event-stream
//! sequencing, and (with the `service` feature) the service that runs it on
//! NATS JetStream.
//!
//! [`index`], [`indexer`], [`replica`] and [`live`] are pure: no IO, no clock, no
//! async. Router replicas and the simulator use them directly.

pub mod alloc_counter;
pub mod index;
pub mod indexer;
pub mod live;
pub mod replica;
#[cfg(feature = "service")]
pub mod service;
pub mod trace_bench;
pub mod workload;

pub use index::{
    IndexStats, Matches, OwnershipIndex, PrefixDepth, RestoreError, WorkerSlot,
    DEFAULT_RESERVE_BLOCKS,
};
pub use indexer::{BatchOutcome, BatchStatus, KvIndexer};
pub use live::{Announced, LiveDeltas, Logged};
pub use replica::{apply_change, DeltaError, IndexReplica};
