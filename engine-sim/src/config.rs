//! Engine configuration.

use protocol::{BlockHasher, HashSalt};

use crate::cost::CostModel;
use crate::error::ConfigError;

/// Everything an [`crate::Engine`] needs to know about its worker. Usually
/// built by [`crate::Preset::engine_config`] and then adjusted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block (the router's and indexer's block size).
    pub block_size: u32,
    /// KV cache size in blocks.
    pub kv_capacity_blocks: u32,
    /// Token budget of one step (decodes count one token each).
    pub max_batched_tokens: u32,
    /// Cap on requests in the running batch.
    pub max_running: u32,
    /// Seed of the block hashes (model, LoRA, cache salt).
    pub salt: HashSalt,
    /// KV bytes per token over the whole worker (all GPUs).
    pub kv_bytes_per_token: u64,
    /// GPUs of the worker.
    pub gpus: u32,
    /// Step-time constants.
    pub cost: CostModel,
    /// Share by which a step is longer while the engine serves a read of
    /// its blocks by another worker (a prefix pulled D -> P, the third
    /// path; [`crate::Engine::pin_prefix`]). See
    /// [`crate::preset::READ_STEP_OVERHEAD`].
    pub read_step_overhead: f64,
}

impl EngineConfig {
    /// Checks the configuration can build an engine.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::ZeroBlockSize);
        }
        if self.kv_capacity_blocks == 0 {
            return Err(ConfigError::ZeroCapacity);
        }
        if self.kv_capacity_blocks == u32::MAX {
            return Err(ConfigError::CapacityTooLarge(self.kv_capacity_blocks));
        }
        if self.max_batched_tokens == 0 {
            return Err(ConfigError::ZeroMaxBatchedTokens);
        }
        if self.max_running == 0 {
            return Err(ConfigError::ZeroMaxRunning);
        }
        self.cost.validate()
    }

    /// The hasher naming this worker's blocks.
    pub fn hasher(&self) -> Result<BlockHasher, ConfigError> {
        BlockHasher::new(self.block_size, self.salt).map_err(|_| ConfigError::ZeroBlockSize)
    }

    /// KV bytes of `tokens` tokens (what a transfer of them moves).
    pub fn kv_bytes(&self, tokens: u64) -> u64 {
        tokens.saturating_mul(self.kv_bytes_per_token)
    }

    /// KV capacity in tokens.
    pub fn kv_capacity_tokens(&self) -> u64 {
        u64::from(self.kv_capacity_blocks) * u64::from(self.block_size)
    }
}
