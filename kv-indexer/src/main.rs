//! `kv-indexer`: the indexer service (`kv-indexer run`, the default), and
//! its benchmark (`kv-indexer bench`).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kv_indexer::alloc_counter::{live_bytes, CountingAllocator};
use kv_indexer::service::{self, Config};
use kv_indexer::trace_bench::TraceBench;

// Counts live heap bytes for `bench`'s bytes-per-pair figure; the cost is
// one relaxed atomic add per allocation.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Switchyard's global KV block-ownership indexer",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Without a subcommand: `run` with these flags.
    #[command(flatten)]
    run: Config,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the indexer service (the default).
    Run(Config),
    /// Replay a Mooncake-format trace as simulated workers' KV events
    /// through the index core; print one JSON line of figures.
    Bench {
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
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Run(cli.run)) {
        Command::Run(config) => serve(config)?,
        Command::Bench {
            trace,
            workers,
            block_size,
            capacity_blocks,
            limit,
        } => {
            anyhow::ensure!(workers > 0, "--workers must be at least 1");
            anyhow::ensure!(block_size > 0, "--block-size must be at least 1");
            let text = std::fs::read_to_string(&trace)
                .with_context(|| format!("reading trace {}", trace.display()))?;
            let mut records = protocol::trace::parse_mooncake(&text)
                .with_context(|| format!("parsing trace {}", trace.display()))?;
            if let Some(limit) = limit {
                records.truncate(limit);
            }
            let bench = TraceBench {
                workers,
                block_size,
                capacity_blocks,
            };
            let (mut report, indexer) = bench.run(&records);
            let with_index = live_bytes();
            drop(indexer);
            let index_bytes = with_index.saturating_sub(live_bytes());
            report.bytes_per_pair = Some(index_bytes as f64 / report.pairs.max(1) as f64);
            println!("{}", report.to_json(workers, block_size));
        }
    }
    Ok(())
}

fn serve(config: Config) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime
        .block_on(service::run(config, bus::shutdown_signal()))
        .context("kv-indexer failed")
}
