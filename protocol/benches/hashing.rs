//! Hashing throughput in token bytes per second.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use protocol::{BlockHasher, HashSalt};

fn hashing(c: &mut Criterion) {
    let mut group = c.benchmark_group("hash_prompt");
    for block_size in [16u32, 64, 512] {
        let hasher = BlockHasher::new(block_size, HashSalt::new("bench", None, None)).unwrap();
        let tokens: Vec<u32> = (0..8192u32)
            .map(|t| t.wrapping_mul(2_654_435_761))
            .collect();
        group.throughput(Throughput::Bytes((tokens.len() * 4) as u64));
        group.bench_with_input(
            BenchmarkId::new("8k_tokens_block", block_size),
            &tokens,
            |b, t| b.iter(|| hasher.hash_prompt(std::hint::black_box(t))),
        );
    }
    group.finish();
}

criterion_group!(benches, hashing);
criterion_main!(benches);
