//! Canonical block hashing: the one function router, agents and simulator
//! use to name KV blocks.
//!
//! A prompt's tokens are cut into full blocks of `block_size` tokens (a
//! partial tail is not hashed). Each block's content hash is xxh3-64 of its
//! tokens as little-endian `u32` bytes, seeded by a [`HashSalt`]. Blocks are
//! chained: `h[0] = content[0]`, `h[i] = xxh3-64(h[i-1] ‖ content[i])`, so one
//! [`BlockHash`] names its whole prefix.

use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::ids::BlockHash;

/// Names the hashing scheme in registrations, so that a worker hashing any
/// other way is refused instead of silently matching nothing.
pub const HASH_SCHEME: &str = "xxh3-64-chain/v1";

/// Seed of the content hash: separates models, LoRA adapters and cache salts
/// so that equal tokens under different weights never share a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct HashSalt(pub u64);

impl HashSalt {
    /// The salt for a model, an optional LoRA adapter and an optional
    /// per-tenant cache salt.
    pub fn new(model: &str, lora: Option<&str>, cache_salt: Option<&str>) -> Self {
        let mut bytes = Vec::with_capacity(model.len() + 64);
        for part in [Some(model), lora, cache_salt] {
            // A presence byte keeps `None` distinct from `Some("")`.
            match part {
                Some(p) => {
                    bytes.push(1);
                    bytes.extend_from_slice(&(p.len() as u64).to_le_bytes());
                    bytes.extend_from_slice(p.as_bytes());
                }
                None => bytes.push(0),
            }
        }
        HashSalt(xxh3_64(&bytes))
    }
}

/// Why a hasher cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("block size must be at least one token")]
pub struct ZeroBlockSize;

/// Hashes token sequences into chained block hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: NonZeroU32,
    salt: HashSalt,
}

impl BlockHasher {
    pub fn new(block_size: u32, salt: HashSalt) -> Result<Self, ZeroBlockSize> {
        let block_size = NonZeroU32::new(block_size).ok_or(ZeroBlockSize)?;
        Ok(Self { block_size, salt })
    }

    pub fn block_size(&self) -> u32 {
        self.block_size.get()
    }

    pub fn salt(&self) -> HashSalt {
        self.salt
    }

    /// The content hash of one block's tokens.
    pub fn content_hash(&self, block: &[u32]) -> u64 {
        xxh3_64_with_seed(&le_bytes(block), self.salt.0)
    }

    /// Chains a block's content hash onto its parent's sequence hash.
    pub fn chain(parent: Option<BlockHash>, content: u64) -> BlockHash {
        match parent {
            None => BlockHash(content),
            Some(parent) => {
                let mut pair = [0u8; 16];
                pair[..8].copy_from_slice(&parent.0.to_le_bytes());
                pair[8..].copy_from_slice(&content.to_le_bytes());
                BlockHash(xxh3_64(&pair))
            }
        }
    }

    /// The chained hashes of every full block of a prompt.
    pub fn hash_prompt(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size.get() as usize);
        self.extend(None, tokens, &mut out);
        out
    }

    /// Appends the chained hashes of `tokens`' full blocks, continuing from
    /// `parent` (the hash of the block just before `tokens[0]`).
    pub fn extend(&self, parent: Option<BlockHash>, tokens: &[u32], out: &mut Vec<BlockHash>) {
        let mut parent = parent;
        for block in tokens.chunks_exact(self.block_size.get() as usize) {
            let hash = Self::chain(parent, self.content_hash(block));
            out.push(hash);
            parent = Some(hash);
        }
    }

    /// Number of full blocks in `tokens` tokens.
    pub fn full_blocks(&self, tokens: usize) -> usize {
        tokens / self.block_size.get() as usize
    }
}

#[cfg(target_endian = "little")]
fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Borrowed(bytemuck::cast_slice(tokens))
}

#[cfg(target_endian = "big")]
fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher(block_size: u32) -> BlockHasher {
        BlockHasher::new(block_size, HashSalt::new("m", None, None)).unwrap()
    }

    #[test]
    fn partial_tail_is_not_hashed() {
        let h = hasher(4);
        assert_eq!(h.hash_prompt(&[1, 2, 3]).len(), 0);
        assert_eq!(h.hash_prompt(&[1, 2, 3, 4, 5, 6, 7]).len(), 1);
        assert_eq!(h.hash_prompt(&[0; 8]).len(), 2);
    }

    #[test]
    fn one_hash_names_its_whole_prefix() {
        let h = hasher(2);
        let a = h.hash_prompt(&[1, 2, 3, 4]);
        let b = h.hash_prompt(&[9, 9, 3, 4]);
        // Same second block, different first: different chained hashes.
        assert_ne!(a[1], b[1]);
        assert_eq!(a[0], BlockHash(h.content_hash(&[1, 2])));
    }

    #[test]
    fn extend_continues_a_chain() {
        let h = hasher(2);
        let whole = h.hash_prompt(&[1, 2, 3, 4, 5, 6]);
        let mut parts = h.hash_prompt(&[1, 2]);
        h.extend(Some(parts[0]), &[3, 4, 5, 6], &mut parts);
        assert_eq!(whole, parts);
    }

    #[test]
    fn salt_separates_models_loras_and_tenants() {
        let salts = [
            HashSalt::new("m", None, None),
            HashSalt::new("m2", None, None),
            HashSalt::new("m", Some(""), None),
            HashSalt::new("m", None, Some("")),
            HashSalt::new("m", Some("a"), None),
        ];
        for (i, a) in salts.iter().enumerate() {
            for b in &salts[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn hashes_are_stable_across_builds() {
        // Guards the wire contract: changing these values breaks every
        // deployed agent's agreement with the routers.
        let h = BlockHasher::new(4, HashSalt(7)).unwrap();
        let got = h.hash_prompt(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let first = xxh3_64_with_seed(&[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0], 7);
        let second = xxh3_64_with_seed(&[5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0, 0, 8, 0, 0, 0], 7);
        let mut pair = first.to_le_bytes().to_vec();
        pair.extend_from_slice(&second.to_le_bytes());
        assert_eq!(got, vec![BlockHash(first), BlockHash(xxh3_64(&pair))]);
    }

    #[test]
    fn zero_block_size_is_refused() {
        assert_eq!(BlockHasher::new(0, HashSalt(0)), Err(ZeroBlockSize));
    }
}
