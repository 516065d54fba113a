//! Typed errors of the engine model.

use protocol::Role;

use crate::request::Mode;

/// Why an [`crate::EngineConfig`] cannot build an engine.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// Blocks must hold at least one token.
    #[error("block size must be at least one token")]
    ZeroBlockSize,
    /// The KV cache must hold at least one block.
    #[error("KV capacity must be at least one block")]
    ZeroCapacity,
    /// Block ids are `u32` with one value reserved.
    #[error("KV capacity of {0} blocks is too large (at most {max})", max = u32::MAX - 1)]
    CapacityTooLarge(u32),
    /// A step must be allowed at least one token.
    #[error("max batched tokens must be at least one")]
    ZeroMaxBatchedTokens,
    /// At least one request must be allowed to run.
    #[error("max running sequences must be at least one")]
    ZeroMaxRunning,
    /// The host tier's link must move bytes.
    #[error("host link bandwidth {0} B/s must be finite and > 0")]
    HostLinkBandwidth(f64),
    /// A cost constant is negative, infinite or NaN.
    #[error("cost constant {name} = {value} must be finite and non-negative")]
    InvalidCost {
        /// The constant's field name.
        name: &'static str,
        /// Its value.
        value: f64,
    },
}

/// Why [`crate::Engine::submit`] refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The worker's role does not serve this mode.
    #[error("a {role} worker does not accept {mode} requests")]
    UnsupportedMode {
        /// The worker's role.
        role: Role,
        /// The refused mode.
        mode: Mode,
    },
    /// A request with this id is still waiting or running.
    #[error("request {0} is already in flight on this worker")]
    DuplicateId(u64),
    /// The prompt has no tokens.
    #[error("request {0} has an empty prompt")]
    EmptyPrompt(u64),
    /// A request that decodes must produce at least one token.
    #[error("request {0} asks for no output tokens")]
    NoOutputTokens(u64),
    /// Prompt plus output does not fit in `u32` tokens.
    #[error("request {0} is longer than {max} tokens", max = u32::MAX)]
    TooLong(u64),
    /// The request alone needs more KV blocks than the cache has: it could
    /// never finish.
    #[error("request {id} needs {needed_blocks} KV blocks; the cache holds {capacity_blocks}")]
    ExceedsKvCapacity {
        /// The request.
        id: u64,
        /// Blocks it holds at its peak.
        needed_blocks: u64,
        /// The cache's capacity.
        capacity_blocks: u32,
    },
}
