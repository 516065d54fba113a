//! Worker registration: the contract a worker must meet to be routed to.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::hash::{BlockHasher, HashSalt, ZeroBlockSize, HASH_SCHEME};
use crate::ids::WorkerId;

/// What a worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "u8", try_from = "u8")]
pub enum Role {
    /// Prefills prompts whose KV then moves to a decode worker.
    Prefill = 0,
    /// Decodes; may prefill locally (the bypass path).
    Decode = 1,
    /// Aggregated: prefills and decodes.
    Both = 2,
}

impl Role {
    pub fn prefills_for_others(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" => Ok(Role::Both),
            other => Err(UnknownRole(other.to_owned())),
        }
    }
}

impl From<Role> for u8 {
    fn from(r: Role) -> u8 {
        r as u8
    }
}

/// A value that is not a [`Role`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role {0:?} (expected prefill, decode or both)")]
pub struct UnknownRole(pub String);

impl TryFrom<u8> for Role {
    type Error = UnknownRole;

    fn try_from(v: u8) -> Result<Self, Self::Error> {
        match v {
            0 => Ok(Role::Prefill),
            1 => Ok(Role::Decode),
            2 => Ok(Role::Both),
            other => Err(UnknownRole(other.to_string())),
        }
    }
}

/// How blocks are named: both sides of a deployment must agree on all of it,
/// or every overlap is silently zero.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HashingContract {
    pub model: String,
    pub block_size: u32,
    pub scheme: String,
    pub salt: HashSalt,
}

impl HashingContract {
    /// The contract of this crate's hashing scheme for a model without LoRA
    /// or cache salt.
    pub fn for_model(model: &str, block_size: u32) -> Self {
        Self {
            model: model.to_owned(),
            block_size,
            scheme: HASH_SCHEME.to_owned(),
            salt: HashSalt::new(model, None, None),
        }
    }

    /// The hasher of the contract's blocks (a request's own salt aside:
    /// [`crate::Sampling::block_hasher`]).
    pub fn hasher(&self) -> Result<BlockHasher, ZeroBlockSize> {
        BlockHasher::new(self.block_size, self.salt)
    }
}

/// How a worker's contract differs from the deployment's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractMismatch {
    #[error("model {got:?} differs from the deployment's {expected:?}")]
    Model { expected: String, got: String },
    #[error(
        "block size {got} differs from the deployment's {expected}: every overlap would be zero"
    )]
    BlockSize { expected: u32, got: u32 },
    #[error("hash scheme {got:?} differs from the deployment's {expected:?}")]
    Scheme { expected: String, got: String },
    #[error("hash salt {got:016x} differs from the deployment's {expected:016x}: every overlap would be zero")]
    Salt { expected: u64, got: u64 },
}

impl ContractMismatch {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            ContractMismatch::Model { .. } => "model",
            ContractMismatch::BlockSize { .. } => "block_size",
            ContractMismatch::Scheme { .. } => "scheme",
            ContractMismatch::Salt { .. } => "salt",
        }
    }
}

impl HashingContract {
    /// `Ok` when `got` names blocks exactly as `self` does.
    pub fn check(&self, got: &HashingContract) -> Result<(), ContractMismatch> {
        if got.model != self.model {
            return Err(ContractMismatch::Model {
                expected: self.model.clone(),
                got: got.model.clone(),
            });
        }
        if got.block_size != self.block_size {
            return Err(ContractMismatch::BlockSize {
                expected: self.block_size,
                got: got.block_size,
            });
        }
        if got.scheme != self.scheme {
            return Err(ContractMismatch::Scheme {
                expected: self.scheme.clone(),
                got: got.scheme.clone(),
            });
        }
        if got.salt != self.salt {
            return Err(ContractMismatch::Salt {
                expected: self.salt.0,
                got: got.salt.0,
            });
        }
        Ok(())
    }
}

/// A registered worker, as stored in etcd under its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    pub id: WorkerId,
    pub role: Role,
    pub contract: HashingContract,
    /// KV cache capacity in blocks.
    pub kv_capacity_blocks: u64,
    /// Most tokens one engine step processes.
    pub max_batched_tokens: u32,
    pub kv_bytes_per_token: u64,
    /// GPUs behind this worker (for per-GPU figures).
    pub gpus: u32,
    /// Where the worker takes requests and resync requests.
    pub subjects: WorkerSubjects,
    /// The engine's context length (prompt plus output tokens), as it
    /// said (vLLM's `max_model_len`); 0: it did not say. Records written
    /// before this field read as 0.
    #[serde(default)]
    pub max_model_len: u32,
    /// Which legs the engine can serve. Records written before this field
    /// read as [`Capabilities::default`] (every leg its role allows).
    #[serde(default)]
    pub capabilities: Capabilities,
}

/// The legs a worker's engine can serve, beyond what its [`Role`] says:
/// an SGLang decode server without the bootstrap handshake takes no remote
/// decode, and without `do_local_prefill` no local prefill either. The
/// router's selection honours them; a leg's role still decides whether the
/// worker is a candidate at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Capabilities {
    /// Prefills its own prompts and decodes them (the bypass path).
    pub local_prefill: bool,
    /// Decodes a prompt prefilled elsewhere, pulling its KV (remote path).
    pub remote_decode: bool,
    /// Prefills for a decode elsewhere (remote path, prefill leg).
    pub remote_prefill: bool,
}

impl Default for Capabilities {
    /// Every leg: what a worker could do before capabilities were said.
    fn default() -> Self {
        Self {
            local_prefill: true,
            remote_decode: true,
            remote_prefill: true,
        }
    }
}

impl Capabilities {
    /// Whether a decode worker can serve `path`'s decode leg.
    pub fn serves(&self, path: crate::Path) -> bool {
        match path {
            crate::Path::Bypass => self.local_prefill,
            crate::Path::Remote | crate::Path::RemoteFetch => self.remote_decode,
        }
    }

    /// The legs named, for logs: `local_prefill,remote_decode`.
    pub fn names(&self) -> String {
        let mut v = Vec::new();
        for (on, name) in [
            (self.local_prefill, "local_prefill"),
            (self.remote_decode, "remote_decode"),
            (self.remote_prefill, "remote_prefill"),
        ] {
            if on {
                v.push(name);
            }
        }
        if v.is_empty() {
            "none".into()
        } else {
            v.join(",")
        }
    }
}

/// The NATS subjects a worker serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerSubjects {
    pub generate: String,
    pub resync: String,
}

impl WorkerSubjects {
    /// The standard subjects of a worker (see [`crate::subjects`]).
    pub fn for_worker(id: &WorkerId) -> Self {
        Self {
            generate: crate::subjects::generate(id),
            resync: crate::subjects::resync(id),
        }
    }
}
