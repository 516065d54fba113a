//! Index throughput and latency on the peer's microbenchmark workload
//! (see `kv_indexer::workload::PrefixGroups`).
//!
//! `cargo bench -p kv-indexer --bench index`

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use kv_indexer::workload::{miss, PrefixGroups, Sequence};
use kv_indexer::OwnershipIndex;
use protocol::{Tier, WorkerId};

const TOTAL_BLOCKS: usize = 1_000_000;

fn build(sequences: &[Sequence], workers: &[WorkerId]) -> OwnershipIndex {
    let mut index = OwnershipIndex::new();
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
    let workload = PrefixGroups {
        depth: 32,
        workers: 4,
        total_blocks: TOTAL_BLOCKS,
    };
    let sequences = workload.sequences();
    let workers = worker_ids(4);
    group.throughput(Throughput::Elements(TOTAL_BLOCKS as u64));
    group.bench_function("store_1m_blocks_depth32_4workers", |b| {
        b.iter_batched(
            || (),
            |()| build(&sequences, &workers),
            BatchSize::PerIteration,
        )
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
            let index = build(&sequences, &worker_ids(n));
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

criterion_group!(benches, apply, find_matches);
criterion_main!(benches);
