//! Live heap bytes per (block, owner) pair, measured by a counting
//! allocator around building the index: on the peer's microbenchmark
//! workload, and at the end of the Mooncake trace replay (when the trace is
//! present).
//!
//! `cargo bench -p kv-indexer --bench memory`

use std::path::Path;

use kv_indexer::alloc_counter::{live_bytes, CountingAllocator};
use kv_indexer::workload::{MooncakeReplay, PrefixGroups};
use kv_indexer::OwnershipIndex;
use protocol::{Tier, WorkerId};

/// `../shared/traces/mooncake_conversation_trace.jsonl` from the repository root.
const TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/traces/mooncake_conversation_trace.jsonl"
);

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
    let path = Path::new(TRACE);
    if !path.exists() {
        println!(
            "note: no trace at {}; the mooncake row is skipped",
            path.display()
        );
        return;
    }
    let text = std::fs::read_to_string(path).expect("the trace is readable");
    let records = protocol::trace::parse_mooncake(&text).expect("the trace parses");
    let log = MooncakeReplay::default().log(&records);
    let before = live_bytes();
    let mut index = OwnershipIndex::new();
    for e in &log.entries {
        log.apply(&mut index, e);
    }
    let bytes = live_bytes() - before;
    let pairs = index.stats().pairs;
    println!(
        "{:>16} {pairs:>10} {:>12.1} {:>14.1}   (end of the replay, {} workers)",
        "mooncake",
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / pairs as f64,
        log.workers.len()
    );
}
