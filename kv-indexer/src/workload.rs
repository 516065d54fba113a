//! Deterministic index workloads for benchmarks (criterion benches, the
//! side-by-side comparison with the peer index, `kv-indexer bench`).

use protocol::{BlockHash, BlockHasher};

/// The peer's own microbenchmark workload: sequences of `depth` blocks,
/// the first quarter shared by one of 4 prefix groups, the rest unique;
/// sequences assigned to workers round-robin, until `total_blocks` blocks
/// have been submitted.
#[derive(Debug, Clone, Copy)]
pub struct PrefixGroups {
    pub depth: usize,
    pub workers: usize,
    pub total_blocks: usize,
}

/// One generated sequence, as both kinds of hashes.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub worker: usize,
    /// Per-block content hashes (what the peer's index matches on).
    pub content: Vec<u64>,
    /// Chained sequence hashes (what Switchyard's index matches on).
    pub chained: Vec<BlockHash>,
}

const GROUPS: u64 = 4;

fn mix(a: u64, b: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&[a.to_le_bytes(), b.to_le_bytes()].concat())
}

impl PrefixGroups {
    pub fn sequences(&self) -> Vec<Sequence> {
        let count = self.total_blocks.div_ceil(self.depth);
        let shared = self.depth / 4;
        (0..count as u64)
            .map(|s| {
                let group = s % GROUPS;
                let content: Vec<u64> = (0..self.depth as u64)
                    .map(|i| {
                        if (i as usize) < shared {
                            mix(group, i)
                        } else {
                            mix(GROUPS + s, i)
                        }
                    })
                    .collect();
                let mut chained = Vec::with_capacity(content.len());
                for c in &content {
                    chained.push(BlockHasher::chain(chained.last().copied(), *c));
                }
                Sequence {
                    worker: s as usize % self.workers,
                    content,
                    chained,
                }
            })
            .collect()
    }
}

/// A query no index holds, of `len` blocks.
pub fn miss(len: usize) -> Vec<BlockHash> {
    (0..len as u64)
        .map(|i| BlockHash(mix(u64::MAX, i)))
        .collect()
}
