//! One grid point: the peer's own microbenchmark workload
//! (`kv_indexer::workload::PrefixGroups`), 1 M blocks submitted as one store
//! event per sequence, through every index.
//!
//! Rounds alternate the indexes (and rotate who goes first), so that
//! machine noise hits every index alike; each figure is the median over
//! rounds. Apply: blocks submitted / time from the first event to the last
//! one applied (for a thread pool: enqueue everything, then its flush
//! barrier). Find: median over batches of the time per lookup, after one
//! untimed warm-up batch; a full hit on stored sequences, and a miss at the
//! first block. Memory is measured once, in its own build: a thread pool's
//! channels keep the capacity that a bulk load grew them to, so that build
//! feeds the pool in slices of 256 events with a flush between them (as a
//! live event stream would), and the figure is the index's own heap.

use std::hint::black_box;
use std::time::Instant;

use dynamo_kv_router::protocols::LocalBlockHash;
use dynamo_kv_router::RouterEvent;
use kv_indexer::alloc_counter::live_bytes;
use kv_indexer::workload::{miss, PrefixGroups};
use kv_indexer::OwnershipIndex;
use protocol::{BlockHash, Tier, WorkerId};

use crate::events::{peer_worker, stored, Chain};
use crate::ours::Setup;
use crate::peers::{Peer, PeerKind};
use crate::report::{Point, Samples};

pub const TOTAL_BLOCKS: usize = 1_000_000;
const QUERY_BATCH: usize = 64;
const QUERY_BATCHES: usize = 51;
const PACED_SLICE: usize = 256;
/// The authors' microbenchmarks' positional jump size.
pub const JUMP: usize = 32;

struct Workload {
    workers: Vec<WorkerId>,
    /// (worker, chain) per stored sequence.
    sequences: Vec<(usize, Chain)>,
    /// Indices of the sequences queried for full hits.
    hits: Vec<usize>,
    miss_ours: Vec<BlockHash>,
    miss_peer: Vec<LocalBlockHash>,
}

impl Workload {
    fn new(depth: usize, workers: usize) -> Self {
        let sequences: Vec<(usize, Chain)> = PrefixGroups {
            depth,
            workers,
            total_blocks: TOTAL_BLOCKS,
        }
        .sequences()
        .into_iter()
        .map(|s| (s.worker, Chain::from_content(&s.content)))
        .collect();
        let hits = (0..sequences.len()).step_by(7).take(256).collect();
        let miss_ours = miss(depth);
        let miss_peer = miss_ours.iter().map(|h| LocalBlockHash(h.0)).collect();
        Workload {
            workers: (0..workers)
                .map(|w| WorkerId::new(&format!("w{w}"), 0).expect("valid name"))
                .collect(),
            sequences,
            hits,
            miss_ours,
            miss_peer,
        }
    }

    fn peer_events(&self) -> Vec<RouterEvent> {
        self.sequences
            .iter()
            .enumerate()
            .map(|(i, (w, chain))| stored(*w, i as u64, chain, 0, chain.len()))
            .collect()
    }

    fn build_ours(&self, mut index: OwnershipIndex) -> OwnershipIndex {
        for (w, chain) in &self.sequences {
            index.store(&self.workers[*w], None, &chain.ours, Tier::Device);
        }
        index
    }

    fn hit_query(&self, i: usize) -> &Chain {
        &self.sequences[self.hits[i % self.hits.len()]].1
    }
}

/// Median seconds per call over batches (the first batch is a warm-up).
/// Every index gets each batch's queries as fresh copies (a router looks up
/// hashes it has just computed), made before the clock starts.
fn per_call(mut batch: impl FnMut(usize) -> f64) -> f64 {
    batch(0);
    let samples: Vec<f64> = (1..=QUERY_BATCHES)
        .map(|b| batch(b) / QUERY_BATCH as f64)
        .collect();
    crate::report::median(&samples)
}

fn ours_round(setup: Setup, w: &Workload, s: &mut Samples) -> OwnershipIndex {
    let index = setup.index();
    let start = Instant::now();
    let index = w.build_ours(index);
    s.apply
        .push(TOTAL_BLOCKS as f64 / start.elapsed().as_secs_f64());
    s.find.push(per_call(|b| {
        // Copies made just before, as for the peers: a router looks up
        // hashes it has just computed.
        let batch: Vec<Vec<BlockHash>> = (0..QUERY_BATCH)
            .map(|q| w.hit_query(b * QUERY_BATCH + q).ours.clone())
            .collect();
        let start = Instant::now();
        for q in &batch {
            black_box(index.find_matches(q));
        }
        start.elapsed().as_secs_f64()
    }));
    s.miss.push(per_call(|_| {
        let start = Instant::now();
        for _ in 0..QUERY_BATCH {
            black_box(index.find_matches(&w.miss_ours));
        }
        start.elapsed().as_secs_f64()
    }));
    index
}

fn peer_round(kind: PeerKind, w: &Workload, runtime: &tokio::runtime::Runtime, s: &mut Samples) {
    let events = w.peer_events();
    let mut peer = kind.build();
    let start = Instant::now();
    for e in events {
        peer.apply(e);
    }
    peer.settle(runtime);
    s.apply
        .push(TOTAL_BLOCKS as f64 / start.elapsed().as_secs_f64());
    s.find.push(per_call(|b| {
        let batch = (0..QUERY_BATCH)
            .map(|q| w.hit_query(b * QUERY_BATCH + q).local.clone())
            .collect();
        peer.find_timed(batch).as_secs_f64()
    }));
    s.miss.push(per_call(|_| {
        let batch = (0..QUERY_BATCH).map(|_| w.miss_peer.clone()).collect();
        peer.find_timed(batch).as_secs_f64()
    }));
}

/// The peer built for memory (paced feed), its heap bytes, and how many hit
/// queries it answers differently from ours.
fn peer_memory(
    kind: PeerKind,
    w: &Workload,
    ours: &OwnershipIndex,
    runtime: &tokio::runtime::Runtime,
) -> (usize, usize) {
    let before = live_bytes();
    let events = w.peer_events();
    let mut peer: Peer = kind.build();
    for (i, e) in events.into_iter().enumerate() {
        peer.apply(e);
        if (i + 1) % PACED_SLICE == 0 {
            peer.settle(runtime);
        }
    }
    peer.settle(runtime);
    let bytes = live_bytes() - before;
    let disagreements = (0..w.hits.len())
        .filter(|i| {
            let q = w.hit_query(*i);
            let theirs = peer.find(&q.local);
            let mine = ours.find_matches(&q.ours);
            w.workers.iter().enumerate().any(|(n, id)| {
                let ours_depth = ours.slot(id).map_or(0, |s| mine.get(s).device);
                let peer_depth = theirs.scores.get(&peer_worker(n)).copied().unwrap_or(0);
                ours_depth != peer_depth
            })
        })
        .count();
    (bytes, disagreements)
}

pub fn measure(
    depth: usize,
    workers: usize,
    peers: &[PeerKind],
    rounds: usize,
    runtime: &tokio::runtime::Runtime,
) -> Point {
    let w = Workload::new(depth, workers);
    let mut ours = Samples::default();
    let mut unreserved = Samples::default();
    let mut theirs: Vec<Samples> = peers.iter().map(|_| Samples::default()).collect();
    let mut notes = Vec::new();

    // Memory, and the agreement check, from one build each.
    let before = live_bytes();
    let reference = w.build_ours(Setup::Service.index());
    let pairs = reference.stats().pairs;
    ours.bytes = (live_bytes() - before) as f64 / pairs as f64;
    unreserved.bytes = {
        let with = live_bytes();
        let grown = w.build_ours(Setup::Unreserved.index());
        let bytes = live_bytes() - with;
        drop(grown);
        bytes as f64 / pairs as f64
    };
    for (kind, s) in peers.iter().zip(&mut theirs) {
        let (bytes, disagreements) = peer_memory(*kind, &w, &reference, runtime);
        s.bytes = bytes as f64 / pairs as f64;
        if disagreements > 0 {
            notes.push(format!(
                "{} answers {disagreements} of {} hit queries differently from ours",
                kind.name(),
                w.hits.len()
            ));
        }
    }
    drop(reference);

    let contenders = peers.len() + 2;
    for round in 0..rounds {
        for k in 0..contenders {
            match (round + k) % contenders {
                0 => drop(ours_round(Setup::Service, &w, &mut ours)),
                1 => drop(ours_round(Setup::Unreserved, &w, &mut unreserved)),
                p => peer_round(peers[p - 2], &w, runtime, &mut theirs[p - 2]),
            }
        }
    }
    Point {
        label: format!(
            "depth {depth} x {workers} workers: {pairs} pairs, {} store events of {depth} blocks",
            w.sequences.len()
        ),
        ours: ours.figures(),
        unreserved: unreserved.figures(),
        peers: peers
            .iter()
            .zip(&theirs)
            .map(|(k, s)| (k.name(), s.figures()))
            .collect(),
        notes,
    }
}
