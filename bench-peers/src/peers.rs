//! The peer's indexes, each driven the way its authors drive it in their own
//! benchmarks (`lib/bench/kv_router/` in ai-dynamo/dynamo, the crate's
//! `benches/indexer_delegate.rs`):
//!
//! - `RadixTree`: single-threaded; `apply_event` and `find_matches` called
//!   directly (its authors: "worker-side `LocalKvIndexer`, unit tests").
//! - `ConcurrentRadixTreeCompressed` and `PositionalIndexer` have no public
//!   synchronous write for a shared tree: writes go through
//!   `ThreadPoolIndexer` (`enqueue_event`, sticky by worker, one OS thread
//!   per lane running the backend's own `SyncIndexer::worker` loop), and
//!   reads run inline on the caller's thread (`backend().find_matches(..,
//!   false)`), exactly as their `indexer_memory` and `mooncake_bench`
//!   harnesses do. Writes are known applied after `flush_and_wait` (a FIFO
//!   barrier through every lane), which is how those harnesses wait before
//!   reading or sampling memory.
//! - `PositionalIndexer` needs the router to be able to recompute sequence
//!   hashes (its README, "Engine-Provided Hashes"), so every peer is given
//!   the peer's own rolling hashes (`compute_seq_hash_for_block`); its
//!   jump size is the one of the authors' harness for the workload (32 in
//!   the microbenchmarks, 8 in `mooncake_bench`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::positional::SearchMode;
use dynamo_kv_router::protocols::{LocalBlockHash, OverlapScores, RouterEvent};
use dynamo_kv_router::{
    ConcurrentRadixTreeCompressed, PositionalIndexer, RadixTree, SyncIndexer, ThreadPoolIndexer,
};

/// Tokens per block, given to `ThreadPoolIndexer::new` (it only uses it to
/// hash token requests, which this benchmark does not make).
const KV_BLOCK_SIZE: u32 = 16;

/// Which peer index, and how it is driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerKind {
    Radix,
    /// `ConcurrentRadixTreeCompressed` behind a `ThreadPoolIndexer` with
    /// this many writer threads.
    Crtc {
        threads: usize,
    },
    /// `PositionalIndexer` behind a `ThreadPoolIndexer`.
    Positional {
        threads: usize,
        jump: usize,
        mode: SearchMode,
    },
}

impl PeerKind {
    /// Every peer index the benchmark runs, for a workload whose authors'
    /// harness uses this positional jump size. Two writer threads because
    /// this machine has two vCPUs; the binary search mode of the positional
    /// index is its authors' other option (`DYN_ROUTER_POSITIONAL_SEARCH_MODE`),
    /// measured on the two-thread build (the search mode does not change
    /// writes, and the thread count does not change reads).
    pub fn all(jump: usize) -> Vec<PeerKind> {
        vec![
            PeerKind::Radix,
            PeerKind::Crtc { threads: 1 },
            PeerKind::Crtc { threads: 2 },
            PeerKind::Positional {
                threads: 1,
                jump,
                mode: SearchMode::Strided,
            },
            PeerKind::Positional {
                threads: 2,
                jump,
                mode: SearchMode::Binary,
            },
        ]
    }

    pub fn name(&self) -> String {
        match *self {
            PeerKind::Radix => "RadixTree".to_owned(),
            PeerKind::Crtc { threads } => format!("CRTC/tp{threads}"),
            PeerKind::Positional {
                threads,
                jump,
                mode,
            } => {
                let mode = match mode {
                    SearchMode::Strided => "strided",
                    SearchMode::Binary => "binary",
                };
                format!("Positional/tp{threads}/j{jump}/{mode}")
            }
        }
    }

    pub fn build(&self) -> Peer {
        match *self {
            PeerKind::Radix => Peer::Radix(RadixTree::new()),
            PeerKind::Crtc { threads } => Peer::Crtc(ThreadPoolIndexer::new(
                ConcurrentRadixTreeCompressed::new(),
                threads,
                KV_BLOCK_SIZE,
            )),
            PeerKind::Positional {
                threads,
                jump,
                mode,
            } => Peer::Positional(ThreadPoolIndexer::new(
                PositionalIndexer::new_with_mode(jump, mode),
                threads,
                KV_BLOCK_SIZE,
            )),
        }
    }
}

/// A built peer index.
pub enum Peer {
    Radix(RadixTree),
    Crtc(ThreadPoolIndexer<ConcurrentRadixTreeCompressed>),
    Positional(ThreadPoolIndexer<PositionalIndexer>),
}

/// Waits until every event enqueued so far is applied (a barrier through
/// every writer lane, as the authors' harnesses do before reading).
fn settle_pool<T: SyncIndexer>(runtime: &tokio::runtime::Runtime, pool: &ThreadPoolIndexer<T>) {
    runtime
        .block_on(pool.flush_and_wait())
        .expect("the writer threads are running");
}

impl Peer {
    /// Applies (single-threaded tree) or enqueues (thread pools) one event.
    pub fn apply(&mut self, event: RouterEvent) {
        match self {
            Peer::Radix(tree) => tree.apply_event(event).expect("the peer accepts the event"),
            Peer::Crtc(pool) => pool
                .enqueue_event(event)
                .expect("the writer threads are running"),
            Peer::Positional(pool) => pool
                .enqueue_event(event)
                .expect("the writer threads are running"),
        }
    }

    /// Returns once every event given to [`Peer::apply`] is applied.
    pub fn settle(&self, runtime: &tokio::runtime::Runtime) {
        match self {
            Peer::Radix(_) => {}
            Peer::Crtc(pool) => settle_pool(runtime, pool),
            Peer::Positional(pool) => settle_pool(runtime, pool),
        }
    }

    /// The periodic maintenance a long-running index gets: the concurrent
    /// tree's stale-child sweep, which its thread pool schedules every five
    /// minutes of wall clock (`CLEANUP_INTERVAL_MS`), called as the authors'
    /// `indexer_memory` harness calls it (`backend().run_cleanup_task()`
    /// between flushes). The other indexes clean up as they go.
    pub fn maintain(&self, runtime: &tokio::runtime::Runtime) {
        if let Peer::Crtc(pool) = self {
            settle_pool(runtime, pool);
            pool.backend().run_cleanup_task();
            settle_pool(runtime, pool);
        }
    }

    /// One lookup (for the agreement check; not timed).
    pub fn find(&self, query: &[LocalBlockHash]) -> OverlapScores {
        match self {
            Peer::Radix(tree) => tree.find_matches(query.to_vec(), false),
            Peer::Crtc(pool) => pool.backend().find_matches(query, false),
            Peer::Positional(pool) => pool.backend().find_matches(query, false),
        }
    }

    /// Times lookups of `queries`, one after the other. The queries are owned
    /// because `RadixTree::find_matches` takes its query by value: a caller
    /// hands over a vector it already has, so the copy is not the tree's
    /// cost and is made before the clock starts.
    pub fn find_timed(&self, queries: Vec<Vec<LocalBlockHash>>) -> Duration {
        match self {
            Peer::Radix(tree) => {
                let start = Instant::now();
                for q in queries {
                    black_box(tree.find_matches(q, false));
                }
                start.elapsed()
            }
            Peer::Crtc(pool) => time_inline(pool, &queries),
            Peer::Positional(pool) => time_inline(pool, &queries),
        }
    }
}

fn time_inline<T: SyncIndexer>(
    pool: &ThreadPoolIndexer<T>,
    queries: &[Vec<LocalBlockHash>],
) -> Duration {
    let backend = pool.backend();
    let start = Instant::now();
    for q in queries {
        black_box(backend.find_matches(q, false));
    }
    start.elapsed()
}
