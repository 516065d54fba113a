//! Deterministic index workloads for benchmarks (criterion benches, the
//! side-by-side comparison with the peer index, `kv-indexer bench`).

use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};

use protocol::trace::{MooncakeRecord, MOONCAKE_BLOCK_TOKENS};
use protocol::{BlockHash, BlockHasher, Tier, WorkerId};

use crate::index::OwnershipIndex;

/// The peer's own microbenchmark workload: sequences of `depth` blocks,
/// the first quarter shared by one of 4 prefix groups, the rest unique;
/// sequences assigned to workers round-robin, until `total_blocks` blocks
/// have been submitted.
#[derive(Debug, Clone, Copy)]
pub struct PrefixGroups {
    pub depth: usize,
    pub workers: usize,
    pub total_blocks: usize,
}

/// One generated sequence, as both kinds of hashes.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub worker: usize,
    /// Per-block content hashes (what the peer's index matches on).
    pub content: Vec<u64>,
    /// Chained sequence hashes (what Switchyard's index matches on).
    pub chained: Vec<BlockHash>,
}

const GROUPS: u64 = 4;

fn mix(a: u64, b: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&[a.to_le_bytes(), b.to_le_bytes()].concat())
}

impl PrefixGroups {
    pub fn sequences(&self) -> Vec<Sequence> {
        let count = self.total_blocks.div_ceil(self.depth);
        let shared = self.depth / 4;
        (0..count as u64)
            .map(|s| {
                let group = s % GROUPS;
                let content: Vec<u64> = (0..self.depth as u64)
                    .map(|i| {
                        if (i as usize) < shared {
                            mix(group, i)
                        } else {
                            mix(GROUPS + s, i)
                        }
                    })
                    .collect();
                let mut chained = Vec::with_capacity(content.len());
                for c in &content {
                    chained.push(BlockHasher::chain(chained.last().copied(), *c));
                }
                Sequence {
                    worker: s as usize % self.workers,
                    content,
                    chained,
                }
            })
            .collect()
    }
}

/// A query no index holds, of `len` blocks.
pub fn miss(len: usize) -> Vec<BlockHash> {
    (0..len as u64)
        .map(|i| BlockHash(mix(u64::MAX, i)))
        .collect()
}

/// A Mooncake-format trace as one fixed log of lookups and KV events, the
/// same for every index that replays it (criterion benches, the comparison
/// with the peer's indexes).
///
/// Each request's prompt is cut into blocks of `block_tokens` tokens: sub-block
/// `j` of a 512-token trace block `h` has content hash `xxh3(h, j)`, so equal
/// ids at equal positions give equal blocks; the partial last block is not
/// cached. Requests go to `workers` simulated workers, each with an LRU cache
/// of `capacity_blocks`, routed to the worker holding the longest prefix among
/// those at most one request busier than the least busy over the last few
/// requests (ties: the least recently chosen). `kv-indexer bench` allows
/// twice the average, which on this trace keeps 7 of 16 workers idle for
/// good: every conversation shares its first trace block, so a worker that
/// served once always has the longer prefix. A worker stores the blocks it lacks (one store whose
/// parent is the last block it held) and evicts its least recently used
/// blocks, a request's tail before its head as engines do, so that every
/// worker always holds whole prefixes.
#[derive(Debug, Clone, Copy)]
pub struct MooncakeReplay {
    pub workers: usize,
    pub block_tokens: usize,
    pub capacity_blocks: usize,
}

impl Default for MooncakeReplay {
    /// 16 workers with 16-token blocks and 1 M tokens of cache each, as
    /// `kv-indexer bench`.
    fn default() -> Self {
        Self {
            workers: 16,
            block_tokens: 16,
            capacity_blocks: 65_536,
        }
    }
}

/// One prompt of the log, in both kinds of hashes.
#[derive(Debug, Clone)]
pub struct Prompt {
    /// Milliseconds since the start of the trace.
    pub at_ms: u64,
    pub content: Vec<u64>,
    pub chained: Vec<BlockHash>,
}

/// A block of the log: block `pos` of prompt `prompt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    pub prompt: u32,
    pub pos: u32,
}

/// One step of the log, in trace order.
#[derive(Debug, Clone)]
pub enum ReplayEntry {
    /// The router looks the prompt up (before the worker serves it).
    Lookup { prompt: usize },
    /// The worker stores blocks `from..to` of the prompt; the parent is block
    /// `from - 1`, none when `from` is 0.
    Store {
        worker: usize,
        prompt: usize,
        from: usize,
        to: usize,
    },
    /// The worker evicts these blocks (leaves first).
    Remove {
        worker: usize,
        blocks: Vec<BlockHash>,
        refs: Vec<BlockRef>,
    },
}

/// The log: see [`MooncakeReplay`].
#[derive(Debug, Clone)]
pub struct ReplayLog {
    pub workers: Vec<WorkerId>,
    pub prompts: Vec<Prompt>,
    pub entries: Vec<ReplayEntry>,
    /// Stored plus removed blocks.
    pub block_events: u64,
}

/// One simulated worker's LRU cache.
#[derive(Debug, Default)]
struct LruCache {
    /// Block -> (last use, where it first appeared).
    held: HashMap<BlockHash, (u64, BlockRef)>,
    /// (use, block) in eviction order; entries with a stale use are skipped.
    order: VecDeque<(u64, BlockHash)>,
    chosen_at: u64,
}

impl LruCache {
    /// Serves a prompt: returns how many of its leading blocks the cache
    /// held, and the blocks it evicted.
    fn serve(
        &mut self,
        prompt: &Prompt,
        id: u32,
        stamp: u64,
        capacity: usize,
    ) -> (usize, Vec<BlockHash>, Vec<BlockRef>) {
        let held = prompt
            .chained
            .iter()
            .take_while(|b| self.held.contains_key(b))
            .count();
        // Pushed tail first: among blocks of equal last use the tail goes
        // first, and a parent is never used less recently than its child,
        // so the cache always holds whole prefixes.
        for (pos, block) in prompt.chained.iter().enumerate().rev() {
            let at = BlockRef {
                prompt: id,
                pos: pos as u32,
            };
            self.held
                .entry(*block)
                .and_modify(|(used, _)| *used = stamp)
                .or_insert((stamp, at));
            self.order.push_back((stamp, *block));
        }
        let (mut blocks, mut refs) = (Vec::new(), Vec::new());
        while self.held.len() > capacity {
            let Some((used, block)) = self.order.pop_front() else {
                break;
            };
            if self.held.get(&block).is_some_and(|(u, _)| *u == used) {
                let (_, at) = self.held.remove(&block).expect("just checked");
                blocks.push(block);
                refs.push(at);
            }
        }
        (held, blocks, refs)
    }
}

/// Requests per worker in the routing rule's load window.
const RECENT_PER_WORKER: usize = 4;

impl MooncakeReplay {
    fn prompt(&self, record: &MooncakeRecord) -> Prompt {
        let per_id = MOONCAKE_BLOCK_TOKENS / self.block_tokens;
        let blocks =
            (record.input_length as usize / self.block_tokens).min(record.hash_ids.len() * per_id);
        let content: Vec<u64> = (0..blocks)
            .map(|k| mix(record.hash_ids[k / per_id], (k % per_id) as u64))
            .collect();
        let mut chained = Vec::with_capacity(content.len());
        for c in &content {
            chained.push(BlockHasher::chain(chained.last().copied(), *c));
        }
        Prompt {
            at_ms: record.timestamp,
            content,
            chained,
        }
    }

    /// Routes the requests and records what every worker stores and evicts.
    /// Routing reads an [`OwnershipIndex`] built alongside; the log is then
    /// fixed, whatever index replays it. Requests shorter than a block are
    /// left out.
    pub fn log(&self, records: &[MooncakeRecord]) -> ReplayLog {
        assert!(
            self.block_tokens > 0 && MOONCAKE_BLOCK_TOKENS % self.block_tokens == 0,
            "blocks must divide the trace's 512-token blocks"
        );
        let workers: Vec<WorkerId> = (0..self.workers)
            .map(|w| WorkerId::new(&format!("w{w}"), 0).expect("valid name"))
            .collect();
        let mut caches: Vec<LruCache> = (0..self.workers).map(|_| LruCache::default()).collect();
        let mut index = OwnershipIndex::new();
        let mut recent = VecDeque::new();
        let (mut prompts, mut entries) = (Vec::new(), Vec::new());
        let mut block_events = 0u64;
        for record in records {
            let prompt = self.prompt(record);
            if prompt.chained.is_empty() {
                continue;
            }
            let id = prompts.len();
            let stamp = id as u64 + 1;
            entries.push(ReplayEntry::Lookup { prompt: id });
            let matches = index.find_matches(&prompt.chained);
            let window_load = |w: usize| recent.iter().filter(|r| **r == w).count();
            let least = (0..self.workers).map(window_load).min().unwrap_or(0);
            let chosen = (0..self.workers)
                .filter(|w| window_load(*w) <= least + 1)
                .max_by_key(|w| {
                    let depth = index
                        .slot(&workers[*w])
                        .map_or(0, |s| matches.get(s).device);
                    (depth, Reverse(caches[*w].chosen_at))
                })
                .expect("the least busy worker qualifies");
            if recent.len() == RECENT_PER_WORKER * self.workers {
                recent.pop_front();
            }
            recent.push_back(chosen);
            caches[chosen].chosen_at = stamp;
            let (held, blocks, refs) =
                caches[chosen].serve(&prompt, id as u32, stamp, self.capacity_blocks);
            let len = prompt.chained.len();
            if held < len {
                let parent = held.checked_sub(1).map(|p| prompt.chained[p]);
                index.store(
                    &workers[chosen],
                    parent,
                    &prompt.chained[held..],
                    Tier::Device,
                );
                block_events += (len - held) as u64;
                entries.push(ReplayEntry::Store {
                    worker: chosen,
                    prompt: id,
                    from: held,
                    to: len,
                });
            }
            if !blocks.is_empty() {
                index.remove(&workers[chosen], &blocks, Tier::Device);
                block_events += blocks.len() as u64;
                entries.push(ReplayEntry::Remove {
                    worker: chosen,
                    blocks,
                    refs,
                });
            }
            prompts.push(prompt);
        }
        ReplayLog {
            workers,
            prompts,
            entries,
            block_events,
        }
    }
}

impl ReplayLog {
    pub fn lookups(&self) -> usize {
        self.prompts.len()
    }

    /// Applies one entry's event to our index (a lookup changes nothing).
    pub fn apply(&self, index: &mut OwnershipIndex, entry: &ReplayEntry) {
        match entry {
            ReplayEntry::Lookup { .. } => {}
            ReplayEntry::Store {
                worker,
                prompt,
                from,
                to,
            } => {
                let chained = &self.prompts[*prompt].chained;
                let parent = from.checked_sub(1).map(|p| chained[p]);
                index.store(
                    &self.workers[*worker],
                    parent,
                    &chained[*from..*to],
                    Tier::Device,
                );
            }
            ReplayEntry::Remove { worker, blocks, .. } => {
                index.remove(&self.workers[*worker], blocks, Tier::Device)
            }
        }
    }
}
