//! Switchyard's ownership index against dynamo-kv-router's `RadixTree`, side
//! by side in one process, on the same generated events (the peer's own
//! microbenchmark workload: `kv_indexer::workload::PrefixGroups`).
//!
//! `cd bench-peers && cargo run --release` (builds the peer: minutes).
//!
//! Each figure is the median of alternating rounds (ours, peer, ours, ...),
//! so that machine noise hits both sides alike. Find-matches latency is per
//! query, from batches of queries over different stored sequences.

use std::hint::black_box;
use std::time::Instant;

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash,
};
use dynamo_kv_router::{RadixTree, RouterEvent};
use kv_indexer::alloc_counter::{live_bytes, CountingAllocator};
use kv_indexer::workload::{miss, PrefixGroups, Sequence};
use kv_indexer::OwnershipIndex;
use protocol::{Tier, WorkerId};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const TOTAL_BLOCKS: usize = 1_000_000;
const ROUNDS: usize = 5;
const QUERY_BATCH: usize = 64;
const QUERY_BATCHES: usize = 101;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn peer_events(sequences: &[Sequence]) -> Vec<RouterEvent> {
    sequences
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let blocks = s
                .content
                .iter()
                .zip(&s.chained)
                .map(|(c, h)| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(h.0),
                    tokens_hash: LocalBlockHash(*c),
                    mm_extra_info: None,
                })
                .collect();
            RouterEvent::new(
                s.worker as u64,
                KvCacheEvent {
                    event_id: i as u64,
                    data: KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash: None,
                        start_position: None,
                        blocks,
                    }),
                    dp_rank: 0,
                },
            )
        })
        .collect()
}

struct Built<T> {
    index: T,
    seconds: f64,
    heap_bytes: usize,
}

fn build_ours(sequences: &[Sequence], workers: &[WorkerId]) -> Built<OwnershipIndex> {
    let before = live_bytes();
    let start = Instant::now();
    let mut index = OwnershipIndex::new();
    for s in sequences {
        index.store(&workers[s.worker], None, &s.chained, Tier::Device);
    }
    let seconds = start.elapsed().as_secs_f64();
    Built {
        heap_bytes: live_bytes() - before,
        index,
        seconds,
    }
}

fn build_peer(sequences: &[Sequence]) -> Built<RadixTree> {
    // The events are made after `before` and consumed by the build, so the
    // difference below is the tree's heap alone.
    let before = live_bytes();
    let events = peer_events(sequences);
    let start = Instant::now();
    let mut tree = RadixTree::new();
    for e in events {
        tree.apply_event(e).expect("peer accepts the event");
    }
    let seconds = start.elapsed().as_secs_f64();
    Built {
        heap_bytes: live_bytes() - before,
        index: tree,
        seconds,
    }
}

/// Median seconds per call of `f` over batches of calls.
fn per_call(mut f: impl FnMut(usize)) -> f64 {
    let samples = (0..QUERY_BATCHES)
        .map(|b| {
            let start = Instant::now();
            for q in 0..QUERY_BATCH {
                f(b * QUERY_BATCH + q);
            }
            start.elapsed().as_secs_f64() / QUERY_BATCH as f64
        })
        .collect();
    median(samples)
}

struct Row {
    depth: usize,
    workers: usize,
    ours_apply: f64,
    peer_apply: f64,
    ours_hit: f64,
    peer_hit: f64,
    ours_miss: f64,
    peer_miss: f64,
    ours_bytes: f64,
    peer_bytes: f64,
}

fn measure(depth: usize, n: usize) -> Row {
    let sequences = PrefixGroups {
        depth,
        workers: n,
        total_blocks: TOTAL_BLOCKS,
    }
    .sequences();
    let workers: Vec<WorkerId> = (0..n).map(|w| WorkerId::new(&format!("w{w}"), 0).unwrap()).collect();
    let queries: Vec<&Sequence> = sequences.iter().step_by(7).take(256).collect();
    let peer_queries: Vec<Vec<LocalBlockHash>> = queries
        .iter()
        .map(|s| s.content.iter().map(|c| LocalBlockHash(*c)).collect())
        .collect();
    let ours_miss_query = miss(depth);
    let peer_miss_query: Vec<LocalBlockHash> = ours_miss_query.iter().map(|h| LocalBlockHash(h.0)).collect();

    let mut row = Row {
        depth,
        workers: n,
        ours_apply: 0.0,
        peer_apply: 0.0,
        ours_hit: 0.0,
        peer_hit: 0.0,
        ours_miss: 0.0,
        peer_miss: 0.0,
        ours_bytes: 0.0,
        peer_bytes: 0.0,
    };
    let (mut oa, mut pa, mut oh, mut ph, mut om, mut pm, mut ob, mut pb) =
        (vec![], vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..ROUNDS {
        let ours = build_ours(&sequences, &workers);
        let pairs = ours.index.stats().pairs as f64;
        oa.push(TOTAL_BLOCKS as f64 / ours.seconds);
        ob.push(ours.heap_bytes as f64 / pairs);
        oh.push(per_call(|i| {
            black_box(ours.index.find_matches(&queries[i % queries.len()].chained));
        }));
        om.push(per_call(|_| {
            black_box(ours.index.find_matches(&ours_miss_query));
        }));
        drop(ours);

        let peer = build_peer(&sequences);
        pa.push(TOTAL_BLOCKS as f64 / peer.seconds);
        pb.push(peer.heap_bytes as f64 / peer.index.current_size() as f64);
        ph.push(per_call(|i| {
            black_box(peer.index.find_matches(peer_queries[i % peer_queries.len()].clone(), false));
        }));
        pm.push(per_call(|_| {
            black_box(peer.index.find_matches(peer_miss_query.clone(), false));
        }));
        drop(peer);
    }
    row.ours_apply = median(oa);
    row.peer_apply = median(pa);
    row.ours_hit = median(oh);
    row.peer_hit = median(ph);
    row.ours_miss = median(om);
    row.peer_miss = median(pm);
    row.ours_bytes = median(ob);
    row.peer_bytes = median(pb);
    row
}

fn main() {
    let grid: Vec<(usize, usize)> = [32usize, 256, 1024, 16_384]
        .iter()
        .flat_map(|d| [4usize, 64, 512].map(|w| (*d, w)))
        .collect();
    println!(
        "Switchyard OwnershipIndex vs dynamo-kv-router 1.6.1 RadixTree; {TOTAL_BLOCKS} blocks per build, \
         median of {ROUNDS} alternating rounds"
    );
    println!(
        "{:>6} {:>7} | {:>10} {:>10} {:>6} | {:>9} {:>9} {:>6} | {:>8} {:>8} | {:>7} {:>7} {:>6}",
        "depth", "workers", "apply M/s", "peer M/s", "x", "hit us", "peer us", "1/x", "miss ns", "peer ns",
        "B/pair", "peer", "1/x"
    );
    for (depth, n) in grid {
        let r = measure(depth, n);
        println!(
            "{:>6} {:>7} | {:>10.2} {:>10.2} {:>6.2} | {:>9.3} {:>9.3} {:>6.2} | {:>8.1} {:>8.1} | {:>7.1} {:>7.1} {:>6.2}",
            r.depth,
            r.workers,
            r.ours_apply / 1e6,
            r.peer_apply / 1e6,
            r.ours_apply / r.peer_apply,
            r.ours_hit * 1e6,
            r.peer_hit * 1e6,
            r.peer_hit / r.ours_hit,
            r.ours_miss * 1e9,
            r.peer_miss * 1e9,
            r.ours_bytes,
            r.peer_bytes,
            r.peer_bytes / r.ours_bytes,
        );
    }
    println!("x: ours / peer throughput; 1/x: peer / ours latency or bytes (higher is better for us)");
}
