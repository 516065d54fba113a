//! `kv-indexer-bench`: replays a Mooncake-format trace as simulated
//! workers' KV events through the index core and prints one JSON line of
//! figures (apply and match rates, bytes per (block, owner) pair).

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use kv_indexer::alloc_counter::{live_bytes, CountingAllocator};
use kv_indexer::trace_bench::TraceBench;

// Counts live heap bytes for the bytes-per-pair figure; the cost is one
// relaxed atomic add per allocation. This binary only: the service's has
// the system allocator.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Replays a Mooncake-format trace through the index core"
)]
struct Cli {
    /// Mooncake JSONL trace, e.g. ../shared/traces/mooncake_conversation_trace.jsonl
    #[arg(long)]
    trace: PathBuf,
    /// Simulated workers.
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Tokens per KV block of the simulated engines.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Each worker's cache capacity, in blocks (default: 1M tokens).
    #[arg(long, default_value_t = 65_536)]
    capacity_blocks: usize,
    /// Replay only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    anyhow::ensure!(cli.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(cli.block_size > 0, "--block-size must be at least 1");
    let text = std::fs::read_to_string(&cli.trace)
        .with_context(|| format!("reading trace {}", cli.trace.display()))?;
    let mut records = protocol::trace::parse_mooncake(&text)
        .with_context(|| format!("parsing trace {}", cli.trace.display()))?;
    if let Some(limit) = cli.limit {
        records.truncate(limit);
    }
    let bench = TraceBench {
        workers: cli.workers,
        block_size: cli.block_size,
        capacity_blocks: cli.capacity_blocks,
    };
    let (mut report, indexer) = bench.run(&records);
    let with_index = live_bytes();
    drop(indexer);
    let index_bytes = with_index.saturating_sub(live_bytes());
    report.bytes_per_pair = Some(index_bytes as f64 / report.pairs.max(1) as f64);
    println!("{}", report.to_json(cli.workers, cli.block_size));
    Ok(())
}
