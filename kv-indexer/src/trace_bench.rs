//! `kv-indexer bench --trace FILE`: replays a Mooncake-format trace as the
//! KV events of simulated workers with bounded caches, through the indexer
//! core, and measures it.
//!
//! Each request is routed to the worker holding the longest prefix of its
//! prompt among those not busier than twice the average over the last few
//! requests (ties: the least recently chosen), so that a prefix shared by
//! every prompt does not send everything to one worker. The lookup is what
//! is timed. The worker stores the blocks it lacks and evicts its least
//! recently used blocks beyond its capacity, publishing the corresponding
//! `Stored` / `Removed` batches, which the indexer applies (timed).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use protocol::trace::MooncakeRecord;
use protocol::{BlockHash, BlockHasher, HashSalt, KvEvent, KvEventBatch, Tier, WorkerId};

use crate::index::OwnershipIndex;
use crate::indexer::KvIndexer;

/// What to replay and how.
#[derive(Debug, Clone)]
pub struct TraceBench {
    pub workers: usize,
    /// Tokens per KV block of the simulated engines.
    pub block_size: u32,
    /// Capacity of each worker's cache, in blocks.
    pub capacity_blocks: usize,
}

/// The figures `kv-indexer bench` prints (as one JSON line).
#[derive(Debug, Clone)]
pub struct TraceBenchReport {
    pub requests: usize,
    pub block_events: u64,
    pub events_per_s: f64,
    pub lookups_per_s: f64,
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
    /// Distinct blocks and (block, owner) pairs in the index at the end.
    pub blocks: u64,
    pub pairs: u64,
    pub runs: u64,
    /// Filled in by the caller, which owns the allocator.
    pub bytes_per_pair: Option<f64>,
}

impl TraceBenchReport {
    pub fn to_json(&self, workers: usize, block_size: u32) -> String {
        format!(
            "{{\"requests\":{},\"workers\":{workers},\"block_size\":{block_size},\"block_events\":{},\
             \"events_per_s\":{:.0},\"lookups_per_s\":{:.0},\"lookup_p50_us\":{:.3},\"lookup_p99_us\":{:.3},\
             \"blocks\":{},\"pairs\":{},\"runs\":{},\"bytes_per_pair\":{}}}",
            self.requests,
            self.block_events,
            self.events_per_s,
            self.lookups_per_s,
            self.lookup_p50_us,
            self.lookup_p99_us,
            self.blocks,
            self.pairs,
            self.runs,
            self.bytes_per_pair.map_or("null".to_owned(), |b| format!("{b:.1}")),
        )
    }
}

/// One simulated worker's cache: least recently used blocks go first.
#[derive(Debug)]
struct WorkerCache {
    id: WorkerId,
    last_used: HashMap<BlockHash, u64>,
    /// (use stamp, block); entries whose stamp is stale are skipped.
    order: VecDeque<(u64, BlockHash)>,
    seq: u64,
    chosen_at: u64,
}

impl WorkerCache {
    fn new(id: WorkerId) -> Self {
        Self {
            id,
            last_used: HashMap::new(),
            order: VecDeque::new(),
            seq: 0,
            chosen_at: 0,
        }
    }

    /// Uses the prompt's blocks; returns the events to publish.
    fn serve(&mut self, blocks: &[BlockHash], stamp: u64, capacity: usize) -> Vec<KvEvent> {
        let mut events = Vec::new();
        let mut new_run: Option<(Option<BlockHash>, Vec<BlockHash>)> = None;
        for (i, block) in blocks.iter().enumerate() {
            let known = self.last_used.insert(*block, stamp).is_some();
            self.order.push_back((stamp, *block));
            if known {
                if let Some((parent, run)) = new_run.take() {
                    events.push(KvEvent::Stored {
                        parent,
                        blocks: run,
                        tier: Tier::Device,
                    });
                }
            } else {
                let parent = i.checked_sub(1).map(|p| blocks[p]);
                new_run
                    .get_or_insert_with(|| (parent, Vec::new()))
                    .1
                    .push(*block);
            }
        }
        if let Some((parent, run)) = new_run {
            events.push(KvEvent::Stored {
                parent,
                blocks: run,
                tier: Tier::Device,
            });
        }
        let mut evicted = Vec::new();
        while self.last_used.len() > capacity {
            let Some((stamp, block)) = self.order.pop_front() else {
                break;
            };
            if self.last_used.get(&block) == Some(&stamp) {
                self.last_used.remove(&block);
                evicted.push(block);
            }
        }
        if !evicted.is_empty() {
            events.push(KvEvent::Removed {
                blocks: evicted,
                tier: Tier::Device,
            });
        }
        events
    }

    fn batch(&mut self, events: Vec<KvEvent>) -> KvEventBatch {
        let batch = KvEventBatch {
            worker: self.id.clone(),
            epoch: 1,
            seq: self.seq,
            events,
        };
        self.seq += 1;
        batch
    }
}

/// Requests per worker in the load window of the routing choice.
const RECENT_PER_WORKER: usize = 4;

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

impl TraceBench {
    /// Replays the records and returns the figures, with the indexer (so
    /// that the caller can measure its memory before dropping it).
    pub fn run(&self, records: &[MooncakeRecord]) -> (TraceBenchReport, KvIndexer) {
        let hasher = BlockHasher::new(self.block_size, HashSalt::new("mooncake", None, None))
            .expect("block size checked by the caller");
        let mut workers: Vec<WorkerCache> = (0..self.workers)
            .map(|w| WorkerCache::new(WorkerId::new(&format!("w{w}"), 0).expect("valid name")))
            .collect();
        let mut indexer = KvIndexer::new(OwnershipIndex::new());
        let mut lookups = Vec::with_capacity(records.len());
        let mut apply_time = Duration::ZERO;
        let mut block_events = 0u64;
        let mut recent = VecDeque::new();
        for (n, record) in records.iter().enumerate() {
            let blocks = hasher.hash_prompt(&record.tokens());
            let start = Instant::now();
            let matches = indexer.index().find_matches(&blocks);
            lookups.push(start.elapsed());
            let index = indexer.index();
            let window_load = |w: usize| recent.iter().filter(|r| **r == w).count();
            let busy = 2 * recent.len().div_ceil(workers.len()).max(1);
            let chosen = (0..workers.len())
                .filter(|w| window_load(*w) < busy)
                .max_by_key(|w| {
                    let depth = index
                        .slot(&workers[*w].id)
                        .map_or(0, |s| matches.get(s).device);
                    (depth, std::cmp::Reverse(workers[*w].chosen_at))
                })
                .expect("some worker is below twice the average");
            if recent.len() == RECENT_PER_WORKER * workers.len() {
                recent.pop_front();
            }
            recent.push_back(chosen);
            let stamp = n as u64 + 1;
            let worker = &mut workers[chosen];
            worker.chosen_at = stamp;
            let events = worker.serve(&blocks, stamp, self.capacity_blocks);
            if events.is_empty() {
                continue;
            }
            let batch = worker.batch(events);
            block_events += batch.block_events() as u64;
            let start = Instant::now();
            indexer.apply(batch);
            apply_time += start.elapsed();
        }
        let lookup_total: Duration = lookups.iter().sum();
        lookups.sort_unstable();
        let stats = indexer.index().stats();
        let report = TraceBenchReport {
            requests: records.len(),
            block_events,
            events_per_s: block_events as f64 / apply_time.as_secs_f64().max(1e-9),
            lookups_per_s: records.len() as f64 / lookup_total.as_secs_f64().max(1e-9),
            lookup_p50_us: percentile(&lookups, 0.5),
            lookup_p99_us: percentile(&lookups, 0.99),
            blocks: stats.blocks,
            pairs: stats.pairs,
            runs: stats.runs,
            bytes_per_pair: None,
        };
        (report, indexer)
    }
}
