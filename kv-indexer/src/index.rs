//! The global block-ownership index: which worker holds which KV block, in
//! which tier. Pure data structure: no IO, no clock, no threads.
//!
//! # Layout
//!
//! Block hashes are chained (one hash names its whole prefix), so finding a
//! block needs no tree walk: one flat hash table maps every block to its
//! place. Blocks live in *runs*: consecutive blocks of one chain (each the
//! child of the one before) that have exactly the same owners. A lookup of
//! a prompt finds its first block in the table, then compares the prompt's
//! following hashes against the run's contiguous array, and only consults
//! the table again (and intersects owner sets) where a run ends. Ownership
//! changes that cover part of a run split it; the smaller side moves.
//!
//! Per distinct block the index costs the hash in its run (8 bytes) and one
//! table slot (8 bytes, the table at most 5/8 full and, while it grows,
//! at least 5/16: 13 to 26 bytes per block; it never shrinks; see
//! `block_table`); per run a small header and its owner list.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use protocol::{BlockHash, OwnedRun, RunOwner, Tier, TierSet, WorkerId};

mod block_table;

use block_table::{BlockTable, Key, Loc, Slot, MAX_OFFSET};

/// A worker's dense number inside one index. Stable while the worker is
/// known to the index; reused after [`OwnershipIndex::remove_worker`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerSlot(u32);

/// How many leading blocks of a query one worker holds, per tier. Tiers are
/// cumulative: `host` counts blocks held on the device or in host memory,
/// `disk` blocks held anywhere; so `device <= host <= disk`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PrefixDepth {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
}

/// Per worker, the leading blocks of one query it holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Matches {
    /// Sorted by slot; only workers holding at least the first block.
    hits: Vec<Hit>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hit {
    slot: u32,
    /// While matching: tier levels still matching (bit 0 device, 1 host,
    /// 2 disk). Zero once done.
    alive: u8,
    depth: PrefixDepth,
}

impl Matches {
    /// The worker's depth, zero when it holds nothing of the query.
    pub fn get(&self, slot: WorkerSlot) -> PrefixDepth {
        self.hits
            .binary_search_by_key(&slot.0, |h| h.slot)
            .map(|i| self.hits[i].depth)
            .unwrap_or_default()
    }

    pub fn iter(&self) -> impl Iterator<Item = (WorkerSlot, PrefixDepth)> + '_ {
        self.hits.iter().map(|h| (WorkerSlot(h.slot), h.depth))
    }

    pub fn len(&self) -> usize {
        self.hits.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hits.is_empty()
    }
}

/// Counters of the index's size and work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct blocks held by at least one worker.
    pub blocks: u64,
    /// (block, worker) ownership pairs.
    pub pairs: u64,
    /// Runs (see the module docs).
    pub runs: u64,
    /// Blocks dropped by the memory cap since the index was created.
    pub evicted_blocks: u64,
}

/// Why a snapshot cannot be restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RestoreError {
    #[error("run {run} names worker #{worker}, but the snapshot lists {workers} workers")]
    UnknownWorker {
        run: usize,
        worker: u32,
        workers: usize,
    },
    #[error("run {run} is empty or has no owner")]
    EmptyRun { run: usize },
    #[error("run {run} has an owner with no tier")]
    NoTier { run: usize },
    #[error("run {run} lists worker #{worker} twice or out of order")]
    OwnersNotSorted { run: usize, worker: u32 },
    #[error("block {block} appears twice (again in run {run})")]
    DuplicateBlock { run: usize, block: BlockHash },
    #[error("worker {0} is listed twice")]
    DuplicateWorker(WorkerId),
    #[error("restored index digest {got:016x} differs from the snapshot's {expected:016x}")]
    DigestMismatch { expected: u64, got: u64 },
    #[error("snapshot covers delta {snapshot}, but the replica needs delta {needed} next")]
    Behind { snapshot: u64, needed: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Owner {
    slot: u32,
    tiers: TierSet,
}

/// The block a table entry names, read from its run.
fn block_of(runs: &[Run], slot: Slot) -> BlockHash {
    runs[slot.run() as usize].at(slot.loc())
}

/// Whether the table entry is `key`'s block: the tag first, then the block
/// itself in its run.
fn is_block(runs: &[Run], key: Key, slot: Slot) -> bool {
    slot.tag() == key.tag && block_of(runs, slot) == key.block
}

#[derive(Debug, Default)]
struct Run {
    blocks: Vec<BlockHash>,
    /// Offset of `blocks[0]`: table entries store `base + index`, so that
    /// dropping a run's head moves no entry of the part that stays.
    base: u32,
    /// Sorted by slot. Empty only while the run is free.
    owners: Vec<Owner>,
    /// The block before `blocks[0]`, if any (walked by the memory cap).
    parent: Option<BlockHash>,
    /// Logical time of the last store that touched this run.
    touched: u64,
}

impl Run {
    fn at(&self, loc: Loc) -> BlockHash {
        self.blocks[(loc.offset - self.base) as usize]
    }

    fn index_of(&self, loc: Loc) -> usize {
        (loc.offset - self.base) as usize
    }

    fn end(&self) -> u32 {
        self.base + self.blocks.len() as u32
    }

    fn owner(&self, slot: u32) -> Option<&Owner> {
        self.owners
            .binary_search_by_key(&slot, |o| o.slot)
            .ok()
            .map(|i| &self.owners[i])
    }
}

#[derive(Debug)]
struct WorkerEntry {
    id: WorkerId,
    /// Hash of the id, mixed into the digest.
    id_hash: u64,
    /// Ownership pairs of this worker.
    pairs: u64,
}

/// Least-recently-touched eviction, enabled by a block cap.
#[derive(Debug)]
struct Cap {
    max_blocks: u64,
    /// (touched, run); stale entries are skipped when popped.
    queue: BinaryHeap<Reverse<(u64, u32)>>,
}

/// How many blocks ahead a loop over new blocks asks for their table
/// slots' cache lines (see [`BlockTable::prefetch`]).
const PREFETCH_AHEAD: usize = 8;

/// How many blocks the services size their index for at start (see
/// [`OwnershipIndex::reserve`]): 16 MB of table.
pub const DEFAULT_RESERVE_BLOCKS: usize = 1 << 20;

/// The index. See the module docs for its layout.
#[derive(Debug, Default)]
pub struct OwnershipIndex {
    table: BlockTable,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    workers: Vec<Option<WorkerEntry>>,
    free_slots: Vec<u32>,
    slots: HashMap<WorkerId, u32>,
    clock: u64,
    cap: Option<Cap>,
    /// The block table is sized for at least this many blocks.
    reserved: usize,
    stats: IndexStats,
}

fn digest_term(block: BlockHash, worker_hash: u64, tiers: TierSet) -> u64 {
    // splitmix64 finaliser over the triple; summed, so order-independent.
    let mut z = block.0 ^ worker_hash.rotate_left(29) ^ (u64::from(tiers.bits()) << 59);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Length of the common prefix of two chained hash sequences that start
/// equal, in O(log n) comparisons.
///
/// Relies on chaining: a block hash names its whole prefix, so if both
/// sequences hold the same hash at position `k` they agree on every
/// position before `k` too; equality is monotone along the sequences. So
/// the last common position is checked first (a full match, the common
/// case), then the first mismatch is found by bisection. Used for lookups
/// only: stores compare every hash, so that a worker sending blocks that
/// are not a chain cannot claim blocks it did not list.
fn chained_prefix(query: &[BlockHash], run: &[BlockHash]) -> usize {
    let m = query.len().min(run.len());
    if m == 0 || query[m - 1] == run[m - 1] {
        return m;
    }
    // The first mismatch lies in [lo, hi]; position hi = m - 1 mismatches.
    let (mut lo, mut hi) = (0, m - 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if query[mid] == run[mid] {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Length of the common prefix of two slices; compares eight hashes at a
/// time (branch-free, so the compiler can vectorise) before finishing one
/// by one.
fn common_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
    const LANES: usize = 8;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + LANES <= n {
        let diff = a[i..i + LANES]
            .iter()
            .zip(&b[i..i + LANES])
            .fold(0, |acc, (x, y)| acc | (x.0 ^ y.0));
        if diff != 0 {
            break;
        }
        i += LANES;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl OwnershipIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// An index that keeps at most `max_blocks` distinct blocks: beyond it,
    /// [`OwnershipIndex::evict_to_cap`] drops the least recently touched runs.
    pub fn with_max_blocks(max_blocks: u64) -> Self {
        Self {
            cap: Some(Cap {
                max_blocks,
                queue: BinaryHeap::new(),
            }),
            ..Self::default()
        }
    }

    /// Sizes the block table for `blocks` blocks in all, also after an
    /// [`import`](OwnershipIndex::import). Growing the table rebuilds it,
    /// which stops its caller for a while (about 20 ms per million blocks on
    /// a 2-vCPU VM): a service reserves what it expects to hold.
    pub fn reserve(&mut self, blocks: usize) {
        self.reserved = blocks;
        self.reserve_table(blocks.saturating_sub(self.table.len()));
    }

    /// What [`OwnershipIndex::reserve`] was last given.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// An empty index with this one's settings (cap and reservation).
    fn emptied(&self) -> Self {
        let mut empty = match self.cap.as_ref() {
            Some(c) => Self::with_max_blocks(c.max_blocks),
            None => Self::new(),
        };
        empty.reserved = self.reserved;
        empty
    }

    pub fn stats(&self) -> IndexStats {
        IndexStats {
            runs: (self.runs.len() - self.free_runs.len()) as u64,
            ..self.stats
        }
    }

    /// The worker's slot, if the index knows it.
    pub fn slot(&self, worker: &WorkerId) -> Option<WorkerSlot> {
        self.slots.get(worker).map(|s| WorkerSlot(*s))
    }

    /// The worker behind a slot.
    pub fn worker(&self, slot: WorkerSlot) -> Option<&WorkerId> {
        self.workers
            .get(slot.0 as usize)
            .and_then(|w| w.as_ref())
            .map(|w| &w.id)
    }

    /// Workers the index knows, with the number of blocks each holds.
    pub fn workers(&self) -> impl Iterator<Item = (&WorkerId, u64)> {
        self.workers.iter().flatten().map(|w| (&w.id, w.pairs))
    }

    /// Blocks (in any tier) the worker holds.
    pub fn worker_blocks(&self, worker: &WorkerId) -> u64 {
        self.slots
            .get(worker)
            .and_then(|s| self.workers[*s as usize].as_ref())
            .map_or(0, |w| w.pairs)
    }

    fn intern(&mut self, worker: &WorkerId) -> u32 {
        if let Some(slot) = self.slots.get(worker) {
            return *slot;
        }
        let entry = WorkerEntry {
            id: worker.clone(),
            id_hash: xxhash_rust::xxh3::xxh3_64(worker.to_string().as_bytes()),
            pairs: 0,
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.workers[slot as usize] = Some(entry);
                slot
            }
            None => {
                self.workers.push(Some(entry));
                (self.workers.len() - 1) as u32
            }
        };
        self.slots.insert(worker.clone(), slot);
        slot
    }

    #[inline]
    fn locate(&self, block: BlockHash) -> Option<Loc> {
        let key = Key::of(block);
        let runs = &self.runs;
        self.table
            .find(key.hash, |slot| is_block(runs, key, slot))
            .map(|slot| slot.loc())
    }

    /// Points the block's table entry, which still says `from`, at `to`.
    /// Matches on the old place itself: while a run is being cut, the
    /// entries of its moving part no longer point at their blocks.
    fn relocate(&mut self, block: BlockHash, from: Loc, to: Loc) {
        let key = Key::of(block);
        let found = self
            .table
            .replace(key.hash, |slot| slot.loc() == from, Slot::new(to, key));
        assert!(found, "every stored block has a table entry");
    }

    /// Makes room for `additional` more table entries. A full table is
    /// rebuilt at twice its size by walking the runs in memory order (its
    /// entries hold no hash, so it cannot rehash itself).
    fn reserve_table(&mut self, additional: usize) {
        if self.table.fits(additional) {
            return;
        }
        let needed = self.table.len() + additional;
        let entries = needed.max(2 * self.table.capacity());
        let mut table = BlockTable::with_capacity(entries.max(self.reserved));
        for (id, run) in self.runs.iter().enumerate() {
            for (i, block) in run.blocks.iter().enumerate() {
                if let Some(next) = run.blocks.get(i + PREFETCH_AHEAD) {
                    table.prefetch(Key::of(*next).hash);
                }
                let loc = Loc {
                    run: id as u32,
                    offset: run.base + i as u32,
                };
                let key = Key::of(*block);
                table.insert_unique(key.hash, Slot::new(loc, key));
            }
        }
        self.table = table;
    }

    fn new_run(&mut self, run: Run) -> u32 {
        match self.free_runs.pop() {
            Some(id) => {
                self.runs[id as usize] = run;
                id
            }
            None => {
                self.runs.push(run);
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// Splits `run` so that blocks `[from, from + len)` (lineage offsets)
    /// form a run of their own, and returns it. The smaller side of each cut
    /// moves to a new run; the larger keeps its table entries.
    fn isolate(&mut self, run: u32, from: u32, len: u32) -> u32 {
        let r = &self.runs[run as usize];
        let (base, end) = (r.base, r.end());
        debug_assert!(from >= base && from + len <= end);
        let mut middle = run;
        if from + len < end {
            middle = self.cut(middle, from + len).0;
        }
        if from > base {
            middle = self.cut(middle, from).1;
        }
        middle
    }

    /// Cuts a run at lineage offset `at` into `[base, at)` and `[at, end)`;
    /// returns the ids of the runs holding them, in that order. Blocks keep
    /// their lineage offsets; the smaller side moves to a new run id.
    fn cut(&mut self, run: u32, at: u32) -> (u32, u32) {
        let r = &mut self.runs[run as usize];
        let base = r.base;
        let split = (at - base) as usize;
        let owners = r.owners.clone();
        let touched = r.touched;
        let (moved, moved_base, parent) = if r.blocks.len() - split <= split {
            let tail = r.blocks.split_off(split);
            (tail, at, Some(r.blocks[split - 1]))
        } else {
            let head: Vec<BlockHash> = r.blocks.drain(..split).collect();
            let parent = r.parent.replace(head[split - 1]);
            r.base = at;
            if r.blocks.capacity() > 2 * r.blocks.len() + 8 {
                r.blocks.shrink_to_fit();
            }
            (head, base, parent)
        };
        let moved_tail = moved_base == at;
        let id = self.new_run(Run {
            blocks: moved,
            base: moved_base,
            owners,
            parent,
            touched,
        });
        for i in 0..self.runs[id as usize].blocks.len() {
            self.prefetch_block(id, i + PREFETCH_AHEAD);
            let block = self.runs[id as usize].blocks[i];
            let offset = moved_base + i as u32;
            self.relocate(block, Loc { run, offset }, Loc { run: id, offset });
        }
        self.queue_for_cap(id);
        if moved_tail {
            (run, id)
        } else {
            (id, run)
        }
    }

    /// Drops a run and the table entries of its blocks.
    fn delete_run(&mut self, run: u32) -> Vec<BlockHash> {
        let base = self.runs[run as usize].base;
        for i in 0..self.runs[run as usize].blocks.len() {
            self.prefetch_block(run, i + PREFETCH_AHEAD);
            let loc = Loc {
                run,
                offset: base + i as u32,
            };
            self.drop_entry(self.runs[run as usize].blocks[i], loc);
        }
        let r = std::mem::take(&mut self.runs[run as usize]);
        let n = r.blocks.len() as u64;
        self.stats.blocks -= n;
        for owner in &r.owners {
            self.stats.pairs -= n;
            if let Some(w) = self.workers[owner.slot as usize].as_mut() {
                w.pairs -= n;
            }
        }
        self.free_runs.push(run);
        r.blocks
    }

    /// Records that `worker` holds `blocks` in `tier`; `blocks[0]` is the
    /// child of `parent` and each block the child of the one before.
    pub fn store(
        &mut self,
        worker: &WorkerId,
        parent: Option<BlockHash>,
        blocks: &[BlockHash],
        tier: Tier,
    ) {
        let slot = self.intern(worker);
        self.clock += 1;
        // The first blocks' slots (the loops below ask for the later ones
        // as they go), and the parent's: in flight together.
        for block in &blocks[..blocks.len().min(PREFETCH_AHEAD)] {
            self.table.prefetch(Key::of(*block).hash);
        }
        let mut prev = parent.map(|p| (p, self.locate(p)));
        let mut i = 0;
        while i < blocks.len() {
            let (last, advanced) = match self.locate(blocks[i]) {
                Some(loc) => self.store_known(slot, tier, loc, &blocks[i..]),
                None => self.store_new(slot, tier, prev, &blocks[i..]),
            };
            i += advanced;
            prev = Some((blocks[i - 1], Some(last)));
            self.touch(last.run);
        }
    }

    /// Adds the owner to the known blocks at `loc` onward that continue in
    /// the same run; returns where the last of them is and how many there
    /// were.
    fn store_known(
        &mut self,
        slot: u32,
        tier: Tier,
        loc: Loc,
        blocks: &[BlockHash],
    ) -> (Loc, usize) {
        let r = &self.runs[loc.run as usize];
        let at = r.index_of(loc);
        let k = common_prefix(blocks, &r.blocks[at..]);
        let last = |run| Loc {
            run,
            offset: loc.offset + k as u32 - 1,
        };
        let current = r.owner(slot).copied();
        if current.is_some_and(|o| o.tiers.contains(tier)) {
            return (last(loc.run), k);
        }
        let run = self.isolate(loc.run, loc.offset, k as u32);
        let r = &mut self.runs[run as usize];
        match r.owners.binary_search_by_key(&slot, |o| o.slot) {
            Ok(i) => r.owners[i].tiers = r.owners[i].tiers.with(tier),
            Err(i) => {
                r.owners.insert(
                    i,
                    Owner {
                        slot,
                        tiers: TierSet::only(tier),
                    },
                );
                self.stats.pairs += k as u64;
                if let Some(w) = self.workers[slot as usize].as_mut() {
                    w.pairs += k as u64;
                }
            }
        }
        (last(run), k)
    }

    /// Places blocks the index does not hold yet, up to the first it holds;
    /// extends the parent's run when the parent ends it and has exactly
    /// this owner. `parent` is the parent's hash and place, if known.
    /// Returns where the last placed block is and how many were placed.
    fn store_new(
        &mut self,
        slot: u32,
        tier: Tier,
        parent: Option<(BlockHash, Option<Loc>)>,
        blocks: &[BlockHash],
    ) -> (Loc, usize) {
        let owner = Owner {
            slot,
            tiers: TierSet::only(tier),
        };
        let extendable = parent.and_then(|(_, loc)| loc).filter(|loc| {
            let r = &self.runs[loc.run as usize];
            loc.offset + 1 == r.end() && r.end() < MAX_OFFSET && r.owners == [owner]
        });
        let parent = parent.map(|(hash, _)| hash);
        let run = match extendable {
            Some(loc) => loc.run,
            None => self.new_run(Run {
                blocks: Vec::with_capacity(blocks.len()),
                base: 0,
                owners: vec![owner],
                parent,
                touched: 0,
            }),
        };
        self.reserve_table(blocks.len());
        let first = self.runs[run as usize].end();
        let room = (MAX_OFFSET - first) as usize;
        let mut placed = 0;
        let blocks = &blocks[..blocks.len().min(room)];
        for (i, block) in blocks.iter().enumerate() {
            if let Some(next) = blocks.get(i + PREFETCH_AHEAD) {
                self.table.prefetch(Key::of(*next).hash);
            }
            let offset = first + placed as u32;
            let key = Key::of(*block);
            let runs = &self.runs;
            let slot = Slot::new(Loc { run, offset }, key);
            if self
                .table
                .insert_new(key.hash, slot, |s| is_block(runs, key, s))
                .is_err()
            {
                break;
            }
            self.runs[run as usize].blocks.push(*block);
            placed += 1;
        }
        debug_assert!(placed > 0, "the first block was not in the table");
        self.stats.blocks += placed as u64;
        self.stats.pairs += placed as u64;
        if let Some(w) = self.workers[slot as usize].as_mut() {
            w.pairs += placed as u64;
        }
        let last = Loc {
            run,
            offset: first + placed as u32 - 1,
        };
        (last, placed)
    }

    /// Records that `worker` no longer holds `blocks` in `tier`. Blocks it
    /// does not hold there are ignored.
    pub fn remove(&mut self, worker: &WorkerId, blocks: &[BlockHash], tier: Tier) {
        let Some(&slot) = self.slots.get(worker) else {
            return;
        };
        let mut i = 0;
        while i < blocks.len() {
            let Some(loc) = self.locate(blocks[i]) else {
                i += 1;
                continue;
            };
            let r = &self.runs[loc.run as usize];
            if !r.owner(slot).is_some_and(|o| o.tiers.contains(tier)) {
                i += 1;
                continue;
            }
            // Engines evict leaf-first, so removals often list a run's
            // blocks backwards; take the longest stretch either way.
            let at = r.index_of(loc);
            let rest = &blocks[i..];
            let forward = common_prefix(rest, &r.blocks[at..]);
            let backward = rest
                .iter()
                .zip(r.blocks[..=at].iter().rev())
                .take_while(|(x, y)| x == y)
                .count();
            let (from, len) = if backward > forward {
                (loc.offset + 1 - backward as u32, backward)
            } else {
                (loc.offset, forward)
            };
            self.remove_owner(loc.run, from, len as u32, slot, tier);
            i += len;
        }
    }

    fn remove_owner(&mut self, run: u32, from: u32, len: u32, slot: u32, tier: Tier) {
        if self.trim_sole_owner(run, from, len, slot, tier) {
            return;
        }
        let run = self.isolate(run, from, len);
        let r = &mut self.runs[run as usize];
        let i = r
            .owners
            .binary_search_by_key(&slot, |o| o.slot)
            .expect("caller checked ownership");
        let tiers = r.owners[i].tiers.without(tier);
        if !tiers.is_empty() {
            r.owners[i].tiers = tiers;
            return;
        }
        if r.owners.len() == 1 {
            self.delete_run(run);
            return;
        }
        r.owners.remove(i);
        self.stats.pairs -= u64::from(len);
        if let Some(w) = self.workers[slot as usize].as_mut() {
            w.pairs -= u64::from(len);
        }
    }

    /// The common eviction, leaves first: the run's only owner loses its
    /// only tier on a stretch at the run's tail (or head). The stretch's
    /// blocks leave the index in place, without cutting them off into a
    /// run of their own first (which moves each block's table entry once
    /// more and allocates a run only to free it). Returns whether it
    /// applied; the run keeps at least one block.
    fn trim_sole_owner(&mut self, run: u32, from: u32, len: u32, slot: u32, tier: Tier) -> bool {
        let r = &self.runs[run as usize];
        let sole = r.owners.len() == 1
            && r.owners[0].slot == slot
            && r.owners[0].tiers.without(tier).is_empty();
        let (base, end) = (r.base, r.end());
        let tail = from + len == end && from > base;
        let head = from == base && from + len < end;
        if !sole || !(tail || head) {
            return false;
        }
        let first = (from - base) as usize;
        for i in first..first + len as usize {
            self.prefetch_block(run, i + PREFETCH_AHEAD);
            let loc = Loc {
                run,
                offset: base + i as u32,
            };
            self.drop_entry(self.runs[run as usize].blocks[i], loc);
        }
        let r = &mut self.runs[run as usize];
        if tail {
            r.blocks.truncate(first);
        } else {
            r.parent = Some(r.blocks[len as usize - 1]);
            r.blocks.drain(..len as usize);
            r.base = from + len;
        }
        if r.blocks.capacity() > 2 * r.blocks.len() + 8 {
            r.blocks.shrink_to_fit();
        }
        let n = u64::from(len);
        self.stats.blocks -= n;
        self.stats.pairs -= n;
        if let Some(w) = self.workers[slot as usize].as_mut() {
            w.pairs -= n;
        }
        true
    }

    /// Asks for the table slot of the run's `i`th block, if it has one: a
    /// loop over a run's blocks calls it `PREFETCH_AHEAD` blocks ahead.
    fn prefetch_block(&self, run: u32, i: usize) {
        if let Some(block) = self.runs[run as usize].blocks.get(i) {
            self.table.prefetch(Key::of(*block).hash);
        }
    }

    /// Removes the table entry of `block`, which lives at `loc`.
    fn drop_entry(&mut self, block: BlockHash, loc: Loc) {
        let key = Key::of(block);
        let runs = &self.runs;
        let removed = self.table.remove(
            key.hash,
            |slot| slot.loc() == loc,
            |slot| Key::of(block_of(runs, slot)).hash,
        );
        debug_assert!(removed, "every stored block has a table entry");
    }

    /// Drops every block of the worker; the worker stays known.
    pub fn clear_worker(&mut self, worker: &WorkerId) {
        let Some(&slot) = self.slots.get(worker) else {
            return;
        };
        if self.workers[slot as usize]
            .as_ref()
            .is_some_and(|w| w.pairs == 0)
        {
            return;
        }
        for run in 0..self.runs.len() as u32 {
            let r = &mut self.runs[run as usize];
            let Ok(i) = r.owners.binary_search_by_key(&slot, |o| o.slot) else {
                continue;
            };
            if r.owners.len() == 1 {
                self.delete_run(run);
            } else {
                r.owners.remove(i);
                let n = r.blocks.len() as u64;
                self.stats.pairs -= n;
                if let Some(w) = self.workers[slot as usize].as_mut() {
                    w.pairs -= n;
                }
            }
        }
    }

    /// Drops every block of the worker and forgets it.
    pub fn remove_worker(&mut self, worker: &WorkerId) {
        self.clear_worker(worker);
        if let Some(slot) = self.slots.remove(worker) {
            self.workers[slot as usize] = None;
            self.free_slots.push(slot);
        }
    }

    /// Drops blocks from every owner.
    pub fn evict_blocks(&mut self, blocks: &[BlockHash]) {
        for block in blocks {
            if let Some(loc) = self.locate(*block) {
                let run = self.isolate(loc.run, loc.offset, 1);
                self.delete_run(run);
            }
        }
    }

    fn touch(&mut self, mut run: u32) {
        let clock = self.clock;
        let Some(cap) = self.cap.as_mut() else {
            return;
        };
        // A store touches the whole prefix path, so that a shared prefix
        // is never evicted before the runs that continue it.
        loop {
            let r = &mut self.runs[run as usize];
            if r.touched == clock {
                break; // this store already touched it and its ancestors
            }
            r.touched = clock;
            cap.queue.push(Reverse((clock, run)));
            let Some(parent) = r.parent else { break };
            let key = Key::of(parent);
            let runs = &self.runs;
            match self.table.find(key.hash, |slot| is_block(runs, key, slot)) {
                Some(slot) => run = slot.run(),
                None => break,
            }
        }
    }

    fn queue_for_cap(&mut self, run: u32) {
        if let Some(cap) = self.cap.as_mut() {
            cap.queue
                .push(Reverse((self.runs[run as usize].touched, run)));
        }
    }

    /// Under a block cap, drops least recently touched runs until the index
    /// fits; returns the dropped blocks (to publish as an eviction).
    pub fn evict_to_cap(&mut self) -> Vec<BlockHash> {
        let mut evicted = Vec::new();
        let Some(max) = self.cap.as_ref().map(|c| c.max_blocks) else {
            return evicted;
        };
        while self.stats.blocks > max {
            let Some(Reverse((touched, run))) = self.cap.as_mut().and_then(|c| c.queue.pop())
            else {
                break;
            };
            let r = &self.runs[run as usize];
            if r.owners.is_empty() || r.touched != touched {
                continue; // stale entry
            }
            evicted.extend(self.delete_run(run));
        }
        self.stats.evicted_blocks += evicted.len() as u64;
        let live = self.runs.len() - self.free_runs.len();
        if let Some(cap) = self.cap.as_mut() {
            if cap.queue.len() > 4 * live + 1024 {
                cap.queue = self
                    .runs
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| !r.owners.is_empty())
                    .map(|(i, r)| Reverse((r.touched, i as u32)))
                    .collect();
            }
        }
        evicted
    }

    /// For each worker, how many leading blocks of `query` it holds (per
    /// tier). Stops as soon as no worker holds the next block. `query` must
    /// be a chain (as [`protocol::BlockHasher`] makes them): inside a run
    /// the match length is found by bisection (see [`chained_prefix`]).
    pub fn find_matches(&self, query: &[BlockHash]) -> Matches {
        fn levels(tiers: TierSet) -> u8 {
            let device = tiers.contains(Tier::Device) as u8;
            let host = (device != 0 || tiers.contains(Tier::Host)) as u8;
            let disk = (!tiers.is_empty()) as u8;
            device | host << 1 | disk << 2
        }
        fn end_levels(h: &mut Hit, dying: u8, at: u32) {
            if dying & 1 != 0 {
                h.depth.device = at;
            }
            if dying & 2 != 0 {
                h.depth.host = at;
            }
            if dying & 4 != 0 {
                h.depth.disk = at;
            }
            h.alive &= !dying;
        }

        let Some(first) = query.first().and_then(|b| self.locate(*b)) else {
            return Matches::default();
        };
        let mut run = &self.runs[first.run as usize];
        // One entry per owner of the first block, kept in slot order; an
        // entry whose levels all ended stays, with its depths.
        let mut hits: Vec<Hit> = run
            .owners
            .iter()
            .map(|o| Hit {
                slot: o.slot,
                alive: levels(o.tiers),
                depth: PrefixDepth::default(),
            })
            .collect();
        let mut alive = hits.len();
        let mut matched = chained_prefix(query, &run.blocks[run.index_of(first)..]);
        while matched < query.len() {
            let Some(loc) = self.locate(query[matched]) else {
                break;
            };
            run = &self.runs[loc.run as usize];
            // Intersect the live entries with this run's owners (both sorted).
            let mut owners = run.owners.iter().peekable();
            let at = matched as u32;
            for h in hits.iter_mut().filter(|h| h.alive != 0) {
                while owners.next_if(|o| o.slot < h.slot).is_some() {}
                let now = owners
                    .peek()
                    .filter(|o| o.slot == h.slot)
                    .map_or(0, |o| levels(o.tiers));
                let dying = h.alive & !now;
                end_levels(h, dying, at);
                alive -= (h.alive == 0) as usize;
            }
            if alive == 0 {
                break;
            }
            matched += chained_prefix(&query[matched..], &run.blocks[run.index_of(loc)..]);
        }
        let at = matched as u32;
        for h in hits.iter_mut() {
            let dying = h.alive;
            end_levels(h, dying, at);
        }
        Matches { hits }
    }

    /// A digest of who holds which block in which tier: equal for equal
    /// ownership, whatever the order of changes or the run layout.
    pub fn digest(&self) -> u64 {
        let mut sum = 0u64;
        for r in &self.runs {
            for o in &r.owners {
                let worker_hash = self.workers[o.slot as usize]
                    .as_ref()
                    .map_or(0, |w| w.id_hash);
                for block in &r.blocks {
                    sum = sum.wrapping_add(digest_term(*block, worker_hash, o.tiers));
                }
            }
        }
        sum
    }

    /// The index as workers and runs (see [`protocol::IndexSnapshot`]).
    pub fn export(&self) -> (Vec<WorkerId>, Vec<OwnedRun>) {
        let mut compact = vec![u32::MAX; self.workers.len()];
        let mut workers = Vec::new();
        for (slot, w) in self.workers.iter().enumerate() {
            if let Some(w) = w {
                compact[slot] = workers.len() as u32;
                workers.push(w.id.clone());
            }
        }
        let runs = self
            .runs
            .iter()
            .filter(|r| !r.owners.is_empty())
            .map(|r| OwnedRun {
                blocks: r.blocks.clone(),
                owners: r
                    .owners
                    .iter()
                    .map(|o| RunOwner {
                        worker: compact[o.slot as usize],
                        tiers: o.tiers,
                    })
                    .collect(),
            })
            .collect();
        (workers, runs)
    }

    /// Rebuilds the index from [`OwnershipIndex::export`]'s output and checks
    /// it against the exporter's [`OwnershipIndex::digest`]. Keeps this
    /// index's memory cap setting. On an error the index is left empty (a
    /// half-placed run's table entries would name blocks it does not hold).
    pub fn import(
        &mut self,
        workers: Vec<WorkerId>,
        runs: Vec<OwnedRun>,
        digest: u64,
    ) -> Result<(), RestoreError> {
        if let Err(e) = self.import_unchecked(workers, runs) {
            *self = self.emptied();
            return Err(e);
        }
        let got = self.digest();
        if got != digest {
            *self = self.emptied();
            return Err(RestoreError::DigestMismatch {
                expected: digest,
                got,
            });
        }
        Ok(())
    }

    fn import_unchecked(
        &mut self,
        workers: Vec<WorkerId>,
        runs: Vec<OwnedRun>,
    ) -> Result<(), RestoreError> {
        // The table's allocation stays: a reserved index imports into it.
        let mut table = std::mem::take(&mut self.table);
        table.clear();
        *self = self.emptied();
        self.table = table;
        for worker in &workers {
            if self.slots.contains_key(worker) {
                return Err(RestoreError::DuplicateWorker(worker.clone()));
            }
            self.intern(worker);
        }
        let total: usize = runs.iter().map(|r| r.blocks.len()).sum();
        if !self.table.fits(total.max(self.reserved)) {
            self.table = BlockTable::with_capacity(total.max(self.reserved));
        }
        for (i, run) in runs.into_iter().enumerate() {
            if run.blocks.is_empty() || run.owners.is_empty() {
                return Err(RestoreError::EmptyRun { run: i });
            }
            let mut owners = Vec::with_capacity(run.owners.len());
            for o in &run.owners {
                if o.worker as usize >= workers.len() {
                    return Err(RestoreError::UnknownWorker {
                        run: i,
                        worker: o.worker,
                        workers: workers.len(),
                    });
                }
                if o.tiers.is_empty() {
                    return Err(RestoreError::NoTier { run: i });
                }
                if owners.last().is_some_and(|l: &Owner| l.slot >= o.worker) {
                    return Err(RestoreError::OwnersNotSorted {
                        run: i,
                        worker: o.worker,
                    });
                }
                // Workers were interned in order, so slot == position.
                owners.push(Owner {
                    slot: o.worker,
                    tiers: o.tiers,
                });
            }
            // Runs longer than a lineage may be (see `MAX_OFFSET`) come in
            // as several runs: the layout is ours, ownership is the same.
            if run.blocks.len() <= MAX_OFFSET as usize {
                self.import_run(i, owners, run.blocks)?;
            } else {
                for chunk in run.blocks.chunks(MAX_OFFSET as usize) {
                    self.import_run(i, owners.clone(), chunk.to_vec())?;
                }
            }
        }
        Ok(())
    }

    /// Places one imported run (snapshot run `i`, or a piece of it).
    fn import_run(
        &mut self,
        i: usize,
        owners: Vec<Owner>,
        blocks: Vec<BlockHash>,
    ) -> Result<(), RestoreError> {
        let n = blocks.len() as u64;
        let id = self.new_run(Run {
            blocks: Vec::new(),
            base: 0,
            owners,
            parent: None,
            touched: 0,
        });
        for (offset, block) in blocks.iter().enumerate() {
            let key = Key::of(*block);
            let runs = &self.runs;
            // The run's blocks join it once all are placed: until then its
            // entries are read from `blocks`.
            let at = |slot: Slot| {
                if slot.run() == id {
                    blocks[slot.loc().offset as usize]
                } else {
                    block_of(runs, slot)
                }
            };
            let loc = Loc {
                run: id,
                offset: offset as u32,
            };
            let placed = self
                .table
                .insert_new(key.hash, Slot::new(loc, key), |slot| {
                    slot.tag() == key.tag && at(slot) == *block
                });
            if placed.is_err() {
                return Err(RestoreError::DuplicateBlock {
                    run: i,
                    block: *block,
                });
            }
        }
        let r = &mut self.runs[id as usize];
        r.blocks = blocks;
        self.stats.blocks += n;
        for o in &r.owners {
            self.stats.pairs += n;
            if let Some(w) = self.workers[o.slot as usize].as_mut() {
                w.pairs += n;
            }
        }
        self.queue_for_cap(id);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: u64, seed: u64) -> Vec<BlockHash> {
        let mut out: Vec<BlockHash> = Vec::new();
        for i in 0..n {
            out.push(protocol::BlockHasher::chain(
                out.last().copied(),
                seed * 1000 + i,
            ));
        }
        out
    }

    fn worker(name: &str) -> WorkerId {
        WorkerId::new(name, 0).unwrap()
    }

    fn depth(index: &OwnershipIndex, query: &[BlockHash], w: &WorkerId) -> u32 {
        let m = index.find_matches(query);
        index.slot(w).map_or(0, |s| m.get(s).device)
    }

    /// Chains longer than a lineage (`MAX_OFFSET`, 8 in unit tests) span
    /// several runs; what the index answers does not depend on it.
    #[test]
    fn chains_longer_than_a_lineage() {
        let (a, b) = (worker("a"), worker("b"));
        let c = chain(30, 1);
        let mut index = OwnershipIndex::new();
        index.store(&a, None, &c[..20], Tier::Device);
        index.store(&a, Some(c[19]), &c[20..], Tier::Device);
        index.store(&b, None, &c[..5], Tier::Device);
        assert!(index.runs.iter().all(|r| r.end() <= MAX_OFFSET));
        assert_eq!(depth(&index, &c, &a), 30);
        assert_eq!(depth(&index, &c, &b), 5);
        let stats = index.stats();
        assert_eq!((stats.blocks, stats.pairs), (30, 35));

        index.remove(&a, &c[12..16], Tier::Device);
        assert_eq!(depth(&index, &c, &a), 12);
        assert_eq!(depth(&index, &c[16..], &a), 14);
        assert_eq!(index.stats().pairs, 31);

        let (workers, runs) = index.export();
        let mut copy = OwnershipIndex::new();
        copy.import(workers, runs, index.digest()).unwrap();
        assert_eq!(depth(&copy, &c, &a), 12);
        assert_eq!(copy.stats(), index.stats());
    }

    /// An imported run longer than a lineage comes in as several runs.
    #[test]
    fn imports_runs_longer_than_a_lineage() {
        let a = worker("a");
        let c = chain(21, 2);
        let mut source = OwnershipIndex::new();
        source.store(&a, None, &c, Tier::Device);
        let run = OwnedRun {
            blocks: c.clone(),
            owners: vec![RunOwner {
                worker: 0,
                tiers: TierSet::only(Tier::Device),
            }],
        };
        let mut index = OwnershipIndex::new();
        index
            .import(vec![a.clone()], vec![run], source.digest())
            .unwrap();
        assert_eq!(depth(&index, &c, &a), 21);
        assert_eq!(index.stats().runs, 3);
        assert_eq!(index.stats().pairs, 21);
    }

    /// A snapshot that lists a block twice is refused, and the index is left
    /// empty and usable: its half-placed run leaves nothing behind.
    #[test]
    fn an_import_refused_midway_leaves_an_empty_index() {
        let a = worker("a");
        let c = chain(6, 3);
        let owners = vec![RunOwner {
            worker: 0,
            tiers: TierSet::only(Tier::Device),
        }];
        let mut doubled = c.clone();
        doubled.push(c[2]);
        let runs = vec![OwnedRun {
            blocks: doubled,
            owners,
        }];
        let mut index = OwnershipIndex::new();
        index.store(&a, None, &chain(4, 9), Tier::Device);
        let refused = index.import(vec![a.clone()], runs, 0);
        assert!(matches!(
            refused,
            Err(RestoreError::DuplicateBlock { run: 0, .. })
        ));
        assert_eq!(index.stats(), IndexStats::default());
        assert_eq!(depth(&index, &c, &a), 0);
        index.store(&a, None, &c, Tier::Device);
        index.remove(&a, &c[3..], Tier::Device);
        assert_eq!(depth(&index, &c, &a), 3);
    }
}
