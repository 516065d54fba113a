//! Index throughput and latency on the peer's microbenchmark workload
//! (see `kv_indexer::workload::PrefixGroups`) and on a replay of the
//! Mooncake conversation trace (`kv_indexer::workload::MooncakeReplay`;
//! skipped with a note when the trace is absent).
//!
//! `cargo bench -p kv-indexer --bench index`

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{
    criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use kv_indexer::workload::{miss, MooncakeReplay, PrefixGroups, ReplayEntry, ReplayLog, Sequence};
use kv_indexer::{OwnershipIndex, DEFAULT_RESERVE_BLOCKS};
use protocol::{Tier, WorkerId};

/// `../shared/traces/mooncake_conversation_trace.jsonl` from the repository root.
const TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/traces/mooncake_conversation_trace.jsonl"
);

const TOTAL_BLOCKS: usize = 1_000_000;

fn build(
    mut index: OwnershipIndex,
    sequences: &[Sequence],
    workers: &[WorkerId],
) -> OwnershipIndex {
    for s in sequences {
        index.store(&workers[s.worker], None, &s.chained, Tier::Device);
    }
    index
}

fn worker_ids(n: usize) -> Vec<WorkerId> {
    (0..n)
        .map(|w| WorkerId::new(&format!("w{w}"), 0).unwrap())
        .collect()
}

fn apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("apply");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(8));
    group.throughput(Throughput::Elements(TOTAL_BLOCKS as u64));
    for (depth, n) in [(32usize, 4usize), (32, 512), (1024, 512), (16_384, 64)] {
        let workload = PrefixGroups {
            depth,
            workers: n,
            total_blocks: TOTAL_BLOCKS,
        };
        let sequences = workload.sequences();
        let workers = worker_ids(n);
        // From an empty index, growing its table as it goes.
        group.bench_function(format!("store_1m_blocks_depth{depth}_{n}workers"), |b| {
            b.iter_batched(
                OwnershipIndex::new,
                |index| build(index, &sequences, &workers),
                BatchSize::PerIteration,
            )
        });
        // Into a table sized at start, as the services size theirs.
        group.bench_function(
            format!("store_1m_blocks_depth{depth}_{n}workers_reserved"),
            |b| {
                b.iter_batched(
                    || {
                        let mut index = OwnershipIndex::new();
                        index.reserve(DEFAULT_RESERVE_BLOCKS);
                        index
                    },
                    |index| build(index, &sequences, &workers),
                    BatchSize::PerIteration,
                )
            },
        );
    }
    group.finish();
}

/// The trace's replay log, or `None` (with a note) when the trace is absent.
fn mooncake_log() -> Option<ReplayLog> {
    let path = Path::new(TRACE);
    if !path.exists() {
        println!(
            "note: no trace at {}; the mooncake benches are skipped",
            path.display()
        );
        return None;
    }
    let text = std::fs::read_to_string(path).expect("the trace is readable");
    let records = protocol::trace::parse_mooncake(&text).expect("the trace parses");
    Some(MooncakeReplay::default().log(&records))
}

/// The trace replayed: every event in order (apply), and the lookups in
/// trace order with the events between them untimed (find_matches, per
/// lookup).
fn mooncake(c: &mut Criterion) {
    let Some(log) = mooncake_log() else {
        return;
    };
    let mut group = c.benchmark_group("mooncake");
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Elements(log.block_events));
    group.bench_function("apply_replay", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let mut index = OwnershipIndex::new();
                let start = Instant::now();
                for e in &log.entries {
                    log.apply(&mut index, e);
                }
                spent += start.elapsed();
            }
            spent
        })
    });
    group.throughput(Throughput::Elements(log.lookups() as u64));
    group.bench_function("find_matches_lookups", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let mut index = OwnershipIndex::new();
                for e in &log.entries {
                    match e {
                        ReplayEntry::Lookup { prompt } => {
                            // A fresh copy: a router looks up hashes it
                            // has just computed.
                            let q = log.prompts[*prompt].chained.clone();
                            let start = Instant::now();
                            black_box(index.find_matches(&q));
                            spent += start.elapsed();
                        }
                        _ => log.apply(&mut index, e),
                    }
                }
            }
            spent
        })
    });
    group.finish();
}

fn find_matches(c: &mut Criterion) {
    let mut group = c.benchmark_group("find_matches");
    group
        .sample_size(30)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for depth in [32usize, 256, 1024, 16_384] {
        for n in [4usize, 64, 512] {
            let workload = PrefixGroups {
                depth,
                workers: n,
                total_blocks: TOTAL_BLOCKS,
            };
            let sequences = workload.sequences();
            let index = build(OwnershipIndex::new(), &sequences, &worker_ids(n));
            let queries: Vec<_> = sequences
                .iter()
                .step_by(7)
                .take(256)
                .map(|s| s.chained.clone())
                .collect();
            let mut next = 0;
            group.bench_function(
                BenchmarkId::new("full_hit", format!("depth{depth}_workers{n}")),
                |b| {
                    b.iter(|| {
                        next = (next + 1) % queries.len();
                        index.find_matches(&queries[next])
                    })
                },
            );
            if depth == 32 && n == 4 {
                let q = miss(depth);
                group.bench_function("miss", |b| b.iter(|| index.find_matches(&q)));
            }
        }
    }
    group.finish();
}

criterion_group!(benches, apply, find_matches, mooncake);
criterion_main!(benches);
