//! Why the agent could not start or had to stop.

use std::net::SocketAddr;

use bus::{BusError, RegistryError};
use protocol::{ContractMismatch, HashingContract};

use crate::config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("the simulated engine cannot start: {0}")]
    Engine(#[from] engine_sim::ConfigError),
    #[error(
        "the engine names blocks differently from the configuration (model {:?}, block size {}): {source}",
        configured.model,
        configured.block_size
    )]
    Contract {
        configured: HashingContract,
        #[source]
        source: ContractMismatch,
    },
    #[error("the engine's KV event stream was already taken")]
    KvStreamTaken,
    #[error("the engine's KV event stream ended: the engine stopped")]
    EngineStopped,
    #[error("the engine cannot serve this deployment: {0}")]
    EngineFailed(String),
    #[error("the real engine cannot start: {0}")]
    RealEngine(#[from] crate::vllm::VllmError),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("subscribing to {subject}: {message}")]
    Subscribe { subject: String, message: String },
    #[error("the subscription to {subject} ended (the NATS connection closed)")]
    SubscriptionClosed { subject: String },
    #[error("serving HTTP on {addr}: {source}")]
    Http {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}
