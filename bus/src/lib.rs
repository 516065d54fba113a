//! The services' glue to the bus and the registry, shared by the worker
//! agent, the kv-indexer and the router:
//!
//! - [`Bus`] (NATS JetStream): the streams and their limits, defined once;
//!   KV batches published with message ids (duplicates dropped); deltas
//!   published with the expected last sequence (delta `n` is stream message
//!   `n`, and a second indexer is fenced off); following the delta stream;
//!   snapshots in the object store.
//! - [`Registry`] (etcd): a worker's record under a lease with keep-alive;
//!   the list and watch of registered workers; leader election under a
//!   lease ([`Registry::campaign`], [`Leadership`]) for the standby
//!   kv-indexer.
//!
//! - Credentials and TLS for both ([`NatsAuth`], [`EtcdAuth`]): one flag
//!   group ([`auth_flags`], [`AuthArgs`] for the tools), secrets never
//!   printed; the per-role subject permissions of the nats-server
//!   ([`permissions`]).
//!
//! Names of subjects, streams and keys come from [`protocol::subjects`].

mod auth;
mod election;
mod nats;
pub mod permissions;
mod registry;
mod signal;

pub use auth::{auth_flags, redact_url, AuthArgs, AuthError, EtcdAuth, NatsAuth, Secret};
pub use election::{LeaderEntry, Leadership};
pub use nats::{
    check_replicas, create_consumer_patiently, store_full, stream_replicas_flag, Bus, BusError,
    DeltaPublisher, DeltaSent, StreamLimits, CONNECT_PATIENCE, MAX_REPLICAS, MIN_FITTED_BYTES,
    STREAM_ASK_WAIT,
};
pub use registry::{Registration, Registry, RegistryError, WorkerChange, WorkerWatch};
pub use signal::shutdown_signal;
