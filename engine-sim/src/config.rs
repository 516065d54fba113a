//! Engine configuration.

use protocol::{BlockHasher, HashSalt};

use crate::cost::CostModel;
use crate::error::ConfigError;
use crate::transfer::KvTransfer;

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
    /// The optional host-memory tier (G2) behind the device cache; off
    /// (no blocks) by default.
    pub host: HostOffload,
}

/// A host-memory tier (G2) of `capacity_blocks` blocks behind the device
/// cache, on the worker's host link (PCIe).
///
/// - A block the device cache evicts is written to host (if it is not
///   there already). The write runs **beside** the step: a device-to-host
///   copy on its own stream and PCIe direction, as vLLM's offloading
///   connector and LMCache do, so it never lengthens a step; its time on the
///   link is counted ([`crate::EngineStats::host_write_us`]), and the
///   copy can be read back no earlier than it has been written.
/// - Host blocks are evicted least recently used (a block written or read
///   back is used).
/// - A waiting request whose prefix continues on host past its device hit
///   has those blocks read back before it is admitted: device blocks are
///   allocated for them at once, and the request waits `link.setup_us +
///   bytes / link.bytes_per_s` (reads queue one after another on the
///   host-to-device direction) while other requests run. Read-backs never
///   make a step longer either.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostOffload {
    /// Host blocks (0: no host tier).
    pub capacity_blocks: u32,
    /// The worker's host link, each direction: per-transfer latency and
    /// bandwidth over all its GPUs.
    pub link: KvTransfer,
}

impl Default for HostOffload {
    /// Off, on the preset's assumed PCIe link of one GPU
    /// ([`crate::preset::HOST_LINK_PCIE5`]).
    fn default() -> Self {
        Self {
            capacity_blocks: 0,
            link: crate::preset::HOST_LINK_PCIE5,
        }
    }
}

impl HostOffload {
    /// Whether the tier exists.
    pub fn enabled(&self) -> bool {
        self.capacity_blocks > 0
    }

    /// `gib` GiB of host memory for blocks of `block_size` tokens of
    /// `kv_bytes_per_token` bytes (whole blocks, rounded down).
    pub fn blocks_in_gib(gib: f64, kv_bytes_per_token: u64, block_size: u32) -> u32 {
        let block_bytes = kv_bytes_per_token
            .saturating_mul(u64::from(block_size))
            .max(1);
        let bytes = (gib.max(0.0) * (1u64 << 30) as f64) as u64;
        (bytes / block_bytes).min(u64::from(u32::MAX - 1)) as u32
    }
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
        if self.host.enabled()
            && !(self.host.link.bytes_per_s.is_finite() && self.host.link.bytes_per_s > 0.0)
        {
            return Err(ConfigError::HostLinkBandwidth(self.host.link.bytes_per_s));
        }
        if self.host.capacity_blocks == u32::MAX {
            return Err(ConfigError::CapacityTooLarge(self.host.capacity_blocks));
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

impl EngineConfig {
    /// KV bytes of one block.
    pub fn block_bytes(&self) -> u64 {
        self.kv_bytes(u64::from(self.block_size))
    }
}
