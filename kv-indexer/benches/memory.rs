//! Live heap bytes per (block, owner) pair, measured by a counting
//! allocator around building the index.
//!
//! `cargo bench -p kv-indexer --bench memory`

use kv_indexer::alloc_counter::{live_bytes, CountingAllocator};
use kv_indexer::workload::PrefixGroups;
use kv_indexer::OwnershipIndex;
use protocol::{Tier, WorkerId};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn main() {
    println!(
        "{:>7} {:>8} {:>10} {:>12} {:>14}",
        "depth", "workers", "pairs", "heap MiB", "bytes/pair"
    );
    for (depth, n) in [(32, 4), (256, 64), (1024, 64), (16_384, 512)] {
        let workload = PrefixGroups {
            depth,
            workers: n,
            total_blocks: 1_000_000,
        };
        let sequences = workload.sequences();
        let workers: Vec<WorkerId> = (0..n)
            .map(|w| WorkerId::new(&format!("w{w}"), 0).unwrap())
            .collect();
        let before = live_bytes();
        let mut index = OwnershipIndex::new();
        for s in &sequences {
            index.store(&workers[s.worker], None, &s.chained, Tier::Device);
        }
        let bytes = live_bytes() - before;
        let pairs = index.stats().pairs;
        println!(
            "{depth:>7} {n:>8} {pairs:>10} {:>12.1} {:>14.1}",
            bytes as f64 / (1 << 20) as f64,
            bytes as f64 / pairs as f64
        );
        drop(index);
    }
}
