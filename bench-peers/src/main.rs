//! Switchyard's ownership index against every index of dynamo-kv-router
//! 1.6.1 that answers the same question (which workers hold how much of
//! this prompt): `RadixTree`, `ConcurrentRadixTreeCompressed` and
//! `PositionalIndexer`, the last two behind `ThreadPoolIndexer` with one and
//! with two writer threads. Same events for all, side by side in one
//! process: the peer's microbenchmark grid (`grid.rs`), then a replay of
//! the Mooncake conversation trace (`trace.rs`). How each peer is driven:
//! `peers.rs`.
//!
//! `cd bench-peers && cargo run --release [-- OPTIONS]` (builds the peer: minutes)
//!
//! Options: `--rounds N` (default 5), `--points 32x4,1024x64` (a subset of
//! the grid), `--no-grid`, `--no-trace`, `--trace FILE`, `--trace-limit N`
//! (first N requests).
//!
//! The last line is one JSON object for scripts: the peers, and the worst
//! point (grid and replay) of ours / best peer for the apply rate, the
//! lookup latency and the bytes per pair.

mod events;
mod grid;
mod ours;
mod peers;
mod report;
mod trace;

use std::path::PathBuf;

use kv_indexer::alloc_counter::CountingAllocator;
use kv_indexer::workload::MooncakeReplay;
use peers::PeerKind;
use report::Point;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// `../shared/traces/mooncake_conversation_trace.jsonl` from the repository root.
const DEFAULT_TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/traces/mooncake_conversation_trace.jsonl"
);

const GRID: [(usize, usize); 12] = [
    (32, 4),
    (32, 64),
    (32, 512),
    (256, 4),
    (256, 64),
    (256, 512),
    (1024, 4),
    (1024, 64),
    (1024, 512),
    (16_384, 4),
    (16_384, 64),
    (16_384, 512),
];

#[derive(Debug)]
struct Options {
    rounds: usize,
    points: Vec<(usize, usize)>,
    trace: Option<PathBuf>,
    trace_limit: Option<usize>,
}

fn parse_point(s: &str) -> (usize, usize) {
    let (d, w) = s.split_once('x').expect("a point is DEPTHxWORKERS");
    (
        d.parse().expect("depth is a number"),
        w.parse().expect("workers is a number"),
    )
}

fn options() -> Options {
    let mut o = Options {
        rounds: 5,
        points: GRID.to_vec(),
        trace: Some(PathBuf::from(DEFAULT_TRACE)),
        trace_limit: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--rounds" => o.rounds = value().parse().expect("--rounds N"),
            "--points" => o.points = value().split(',').map(parse_point).collect(),
            "--no-grid" => o.points.clear(),
            "--no-trace" => o.trace = None,
            "--trace" => o.trace = Some(PathBuf::from(value())),
            "--trace-limit" => o.trace_limit = Some(value().parse().expect("--trace-limit N")),
            other => {
                panic!("unknown option {other} (see the doc comment of bench-peers/src/main.rs)")
            }
        }
    }
    assert!(o.rounds > 0, "--rounds must be at least 1");
    o
}

fn main() {
    let o = options();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime for the flush barriers");
    let grid_peers = PeerKind::all(grid::JUMP);
    let trace_peers = PeerKind::all(trace::JUMP);
    println!(
        "Switchyard OwnershipIndex vs dynamo-kv-router 1.6.1; median of {} alternating rounds; {} vCPUs, shared with other work while this ran",
        o.rounds,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "peers: RadixTree (direct calls); CRTC = ConcurrentRadixTreeCompressed and Positional = PositionalIndexer behind \
         ThreadPoolIndexer with 1 or 2 writer threads (tp1, tp2: 2 because this machine has 2 cores; ours is one thread), \
         reads inline; j = positional jump size, strided/binary its search mode. See bench-peers/src/peers.rs."
    );
    println!(
        "apply: blocks applied per second, until the last is applied (thread pools: their flush barrier); \
         find: time per lookup; bytes: live heap of the index (counting allocator) per (block, worker) pair."
    );
    println!(
        "ours: its block table reserved for {} blocks before the clock starts, as the kv-indexer and the routers start; \
         the unreserved row (an empty index growing its table) is printed beside it and not compared.",
        kv_indexer::DEFAULT_RESERVE_BLOCKS
    );
    println!();

    let mut points: Vec<Point> = Vec::new();
    for (depth, workers) in &o.points {
        let p = grid::measure(*depth, *workers, &grid_peers, o.rounds, &runtime);
        p.print_detail();
        points.push(p);
    }
    match &o.trace {
        Some(path) if path.exists() => {
            let text = std::fs::read_to_string(path).expect("the trace is readable");
            let mut records = protocol::trace::parse_mooncake(&text).expect("the trace parses");
            if let Some(limit) = o.trace_limit {
                records.truncate(limit);
            }
            let replay = trace::Replay::new(MooncakeReplay::default().log(&records));
            let p = replay.measure(&trace_peers, o.rounds, &runtime);
            p.print_detail();
            points.push(p);
        }
        Some(path) => println!(
            "note: no trace at {}; the Mooncake replay is skipped",
            path.display()
        ),
        None => println!("note: --no-trace; the Mooncake replay is skipped"),
    }
    if points.is_empty() {
        println!("nothing measured");
        return;
    }
    report::print_summary(&points);
    let mut names: Vec<String> = grid_peers.iter().map(PeerKind::name).collect();
    for n in trace_peers.iter().map(PeerKind::name) {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    println!("{}", report::json_line(&names, &points));
}
