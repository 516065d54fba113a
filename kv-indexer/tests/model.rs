//! Property tests: after any sequence of changes the index answers exactly
//! like a naive model; digests ignore interleaving and run layout; snapshots
//! restore the same index.

use std::collections::{BTreeMap, HashMap};

use kv_indexer::{apply_change, IndexReplica, KvIndexer, OwnershipIndex, PrefixDepth};
use proptest::prelude::*;
use protocol::{
    BlockHash, BlockHasher, HashSalt, IndexChange, KvEvent, KvEventBatch, Message, Tier, TierSet,
    WorkerId,
};

const WORKERS: usize = 4;

/// A handful of block chains sharing prefixes, so that runs split and merge
/// in every way: chain `c` shares its first `c` blocks with chain 0.
fn chains() -> Vec<Vec<BlockHash>> {
    let hasher = BlockHasher::new(1, HashSalt(1)).unwrap();
    (0..6u32)
        .map(|c| {
            let tokens: Vec<u32> = (0..12u32)
                .map(|i| if i < c * 2 { i } else { 1000 * (c + 1) + i })
                .collect();
            hasher.hash_prompt(&tokens)
        })
        .collect()
}

fn worker(w: usize) -> WorkerId {
    WorkerId::new(&format!("w{w}"), 0).unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        w: usize,
        chain: usize,
        from: usize,
        len: usize,
        tier: Tier,
    },
    Remove {
        w: usize,
        chain: usize,
        from: usize,
        len: usize,
        tier: Tier,
        backwards: bool,
    },
    Clear {
        w: usize,
    },
    RemoveWorker {
        w: usize,
    },
    Evict {
        chain: usize,
        from: usize,
        len: usize,
    },
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![4 => Just(Tier::Device), 1 => Just(Tier::Host), 1 => Just(Tier::Disk)]
}

fn op() -> impl Strategy<Value = Op> {
    let range = (0..6usize, 0..12usize, 1..12usize);
    prop_oneof![
        8 => (0..WORKERS, range.clone(), tier())
            .prop_map(|(w, (chain, from, len), tier)| Op::Store { w, chain, from, len, tier }),
        4 => (0..WORKERS, range.clone(), tier(), any::<bool>()).prop_map(
            |(w, (chain, from, len), tier, backwards)| Op::Remove { w, chain, from, len, tier, backwards }
        ),
        1 => (0..WORKERS).prop_map(|w| Op::Clear { w }),
        1 => (0..WORKERS).prop_map(|w| Op::RemoveWorker { w }),
        1 => range.prop_map(|(chain, from, len)| Op::Evict { chain, from, len }),
    ]
}

fn slice(
    chains: &[Vec<BlockHash>],
    chain: usize,
    from: usize,
    len: usize,
) -> (Option<BlockHash>, Vec<BlockHash>) {
    let c = &chains[chain];
    let end = (from + len).min(c.len());
    let parent = from.checked_sub(1).map(|p| c[p]);
    (parent, c[from..end].to_vec())
}

/// The op as a canonical change (what a replica would receive).
fn to_change(chains: &[Vec<BlockHash>], op: &Op) -> IndexChange {
    match *op {
        Op::Store {
            w,
            chain,
            from,
            len,
            tier,
        } => {
            let (parent, blocks) = slice(chains, chain, from, len);
            IndexChange::Stored {
                worker: worker(w),
                parent,
                blocks,
                tier,
            }
        }
        Op::Remove {
            w,
            chain,
            from,
            len,
            tier,
            backwards,
        } => {
            let (_, mut blocks) = slice(chains, chain, from, len);
            if backwards {
                blocks.reverse();
            }
            IndexChange::Removed {
                worker: worker(w),
                blocks,
                tier,
            }
        }
        Op::Clear { w } => IndexChange::WorkerCleared { worker: worker(w) },
        Op::RemoveWorker { w } => IndexChange::WorkerRemoved { worker: worker(w) },
        Op::Evict { chain, from, len } => IndexChange::Evicted {
            blocks: slice(chains, chain, from, len).1,
        },
    }
}

/// The obviously correct index: block -> worker -> tiers.
#[derive(Default)]
struct Model {
    owners: HashMap<BlockHash, BTreeMap<WorkerId, TierSet>>,
}

impl Model {
    fn apply(&mut self, change: &IndexChange) {
        match change {
            IndexChange::Stored {
                worker,
                blocks,
                tier,
                ..
            } => {
                for b in blocks {
                    let tiers = self
                        .owners
                        .entry(*b)
                        .or_default()
                        .entry(worker.clone())
                        .or_default();
                    *tiers = tiers.with(*tier);
                }
            }
            IndexChange::Removed {
                worker,
                blocks,
                tier,
            } => {
                for b in blocks {
                    if let Some(owners) = self.owners.get_mut(b) {
                        if let Some(tiers) = owners.get_mut(worker) {
                            *tiers = tiers.without(*tier);
                            if tiers.is_empty() {
                                owners.remove(worker);
                            }
                        }
                        if owners.is_empty() {
                            self.owners.remove(b);
                        }
                    }
                }
            }
            IndexChange::WorkerCleared { worker } | IndexChange::WorkerRemoved { worker } => {
                for owners in self.owners.values_mut() {
                    owners.remove(worker);
                }
                self.owners.retain(|_, o| !o.is_empty());
            }
            IndexChange::Evicted { blocks } => {
                for b in blocks {
                    self.owners.remove(b);
                }
            }
        }
    }

    fn matches(&self, query: &[BlockHash]) -> BTreeMap<WorkerId, PrefixDepth> {
        let mut out = BTreeMap::new();
        let Some(first) = query.first().and_then(|b| self.owners.get(b)) else {
            return out;
        };
        for w in first.keys() {
            let depth = |ok: &dyn Fn(TierSet) -> bool| {
                query
                    .iter()
                    .take_while(|b| {
                        self.owners
                            .get(b)
                            .and_then(|o| o.get(w))
                            .is_some_and(|t| ok(*t))
                    })
                    .count() as u32
            };
            out.insert(
                w.clone(),
                PrefixDepth {
                    device: depth(&|t| t.contains(Tier::Device)),
                    host: depth(&|t| t.contains(Tier::Device) || t.contains(Tier::Host)),
                    disk: depth(&|t| !t.is_empty()),
                },
            );
        }
        out
    }

    fn pairs(&self) -> u64 {
        self.owners.values().map(|o| o.len() as u64).sum()
    }
}

fn index_matches(index: &OwnershipIndex, query: &[BlockHash]) -> BTreeMap<WorkerId, PrefixDepth> {
    index
        .find_matches(query)
        .iter()
        .map(|(slot, depth)| (index.worker(slot).unwrap().clone(), depth))
        .collect()
}

/// Every query the chains allow: each chain from each start.
fn queries(chains: &[Vec<BlockHash>]) -> impl Iterator<Item = &[BlockHash]> {
    chains
        .iter()
        .flat_map(|c| (0..c.len()).map(move |s| &c[s..]))
}

/// The index holding exactly the model's ownership, built block by block.
fn index_from_model(model: &Model) -> OwnershipIndex {
    let mut index = OwnershipIndex::new();
    let mut blocks: Vec<_> = model.owners.iter().collect();
    blocks.sort_by_key(|(b, _)| **b);
    for (block, owners) in blocks {
        for (w, tiers) in owners {
            for tier in tiers.iter() {
                index.store(w, None, &[*block], tier);
            }
        }
    }
    index
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// An announced batch is applied ahead of the stream exactly when the
    /// stream's order would apply it (`next_seq`), whatever came before:
    /// duplicates, gaps, new and stale epochs.
    #[test]
    fn next_seq_is_exactly_an_in_order_apply(
        batches in proptest::collection::vec((0..2usize, 1..4u64, 0..5u64), 1..60)
    ) {
        let mut indexer = KvIndexer::new(OwnershipIndex::new());
        for (w, epoch, seq) in batches {
            let batch = KvEventBatch {
                worker: worker(w),
                epoch,
                seq,
                events: if seq == 0 { vec![KvEvent::Cleared] } else { vec![] },
            };
            let next = indexer.next_seq(&batch.worker, batch.epoch) == Some(batch.seq);
            let status = indexer.apply(batch).status;
            prop_assert_eq!(next, status == kv_indexer::BatchStatus::Applied, "{:?}", status);
        }
    }

    #[test]
    fn answers_like_the_naive_model(ops in proptest::collection::vec(op(), 1..60)) {
        let chains = chains();
        let mut index = OwnershipIndex::new();
        let mut model = Model::default();
        for op in &ops {
            let change = to_change(&chains, op);
            apply_change(&mut index, &change);
            model.apply(&change);
            prop_assert_eq!(index.stats().blocks, model.owners.len() as u64);
            prop_assert_eq!(index.stats().pairs, model.pairs());
        }
        for q in queries(&chains) {
            prop_assert_eq!(index_matches(&index, q), model.matches(q), "query {:?}", q);
        }
        // Equal ownership, whatever the run layout: equal digests.
        prop_assert_eq!(index.digest(), index_from_model(&model).digest());
    }

    #[test]
    fn snapshot_restore_keeps_answers_and_digest(ops in proptest::collection::vec(op(), 1..40)) {
        let chains = chains();
        let mut index = OwnershipIndex::new();
        index.reserve(8); // the stores grow the table past it
        for op in &ops {
            apply_change(&mut index, &to_change(&chains, op));
        }
        let (workers, runs) = index.export();
        let mut restored = OwnershipIndex::new();
        restored.reserve(1000);
        restored.import(workers, runs, index.digest()).unwrap();
        prop_assert_eq!(restored.reserved(), 1000, "an import keeps the reservation");
        prop_assert_eq!(restored.digest(), index.digest());
        prop_assert_eq!(restored.stats().blocks, index.stats().blocks);
        for q in queries(&chains) {
            prop_assert_eq!(index_matches(&restored, q), index_matches(&index, q));
        }
    }

    /// Different workers' batches may interleave in any order on the bus;
    /// each worker's own order is kept. The digest must not care.
    #[test]
    fn interleaving_of_workers_does_not_change_the_digest(
        ops in proptest::collection::vec(op(), 1..40),
        picks in proptest::collection::vec(0..WORKERS, 0..200),
    ) {
        let chains = chains();
        // Per-worker ops only (clears, stores, removes); evictions are global
        // and so ordered by the indexer.
        let per_worker: Vec<Vec<IndexChange>> = (0..WORKERS)
            .map(|w| {
                ops.iter()
                    .filter(|op| matches!(op,
                        Op::Store { w: x, .. } | Op::Remove { w: x, .. } | Op::Clear { w: x } if *x == w))
                    .map(|op| to_change(&chains, op))
                    .collect()
            })
            .collect();
        let mut in_order = OwnershipIndex::new();
        for changes in &per_worker {
            for c in changes {
                apply_change(&mut in_order, c);
            }
        }
        let mut interleaved = OwnershipIndex::new();
        let mut next = [0usize; WORKERS];
        for w in picks.into_iter().chain((0..WORKERS).cycle().take(WORKERS * 60)) {
            if let Some(c) = per_worker[w].get(next[w]) {
                apply_change(&mut interleaved, c);
                next[w] += 1;
            }
        }
        prop_assert_eq!(interleaved.digest(), in_order.digest());
    }

    /// The indexer's deltas, applied by a replica, give the same index.
    #[test]
    fn replicas_following_deltas_agree_with_the_indexer(ops in proptest::collection::vec(op(), 1..40)) {
        let chains = chains();
        let mut indexer = KvIndexer::new(OwnershipIndex::with_max_blocks(30));
        let mut replica = IndexReplica::new();
        let mut seqs = [0u64; WORKERS];
        for op in &ops {
            let (w, event) = match to_change(&chains, op) {
                IndexChange::Stored { worker: _, parent, blocks, tier } => {
                    (op_worker(op), KvEvent::Stored { parent, blocks, tier })
                }
                IndexChange::Removed { blocks, tier, .. } => (op_worker(op), KvEvent::Removed { blocks, tier }),
                IndexChange::WorkerCleared { .. } => (op_worker(op), KvEvent::Cleared),
                _ => continue,
            };
            let batch = KvEventBatch { worker: worker(w), epoch: 1, seq: seqs[w], events: vec![event] };
            seqs[w] += 1;
            // Through the wire format, as in production.
            let batch = KvEventBatch::decode(&batch.encode()).unwrap();
            if let Some(delta) = indexer.apply(batch).delta {
                replica.apply(&delta).unwrap();
            }
            prop_assert!(indexer.index().stats().blocks <= 30);
        }
        prop_assert_eq!(replica.index().digest(), indexer.index().digest());
        prop_assert_eq!(replica.applied(), indexer.delta_seq());
        // A sized replica restored from a snapshot: the same, still sized.
        let mut restored = IndexReplica::new();
        restored.reserve(500);
        restored.restore(indexer.snapshot()).unwrap();
        prop_assert_eq!(restored.index().reserved(), 500);
        prop_assert_eq!(restored.index().digest(), indexer.index().digest());
        for q in queries(&chains) {
            prop_assert_eq!(index_matches(replica.index(), q), index_matches(indexer.index(), q));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// An indexer restarted from a snapshot taken at any point, replaying
    /// the deltas it published after it (its write-ahead log), is the
    /// indexer it was: same index, same cursors, and the batches it had
    /// applied are duplicates to it.
    #[test]
    fn snapshot_plus_delta_log_restores_the_indexer(
        ops in proptest::collection::vec(op(), 1..40),
        cut in 0usize..40,
        skips in proptest::collection::vec(any::<bool>(), 40),
    ) {
        let chains = chains();
        let mut indexer = KvIndexer::new(OwnershipIndex::with_max_blocks(40));
        let mut seqs = [0u64; WORKERS];
        let mut snapshot = indexer.snapshot();
        let mut log = Vec::new();
        let mut batches = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            if i == cut {
                snapshot = indexer.snapshot();
                log.clear();
            }
            let w = op_worker(op);
            let event = match to_change(&chains, op) {
                IndexChange::Stored { parent, blocks, tier, .. } => KvEvent::Stored { parent, blocks, tier },
                IndexChange::Removed { blocks, tier, .. } => KvEvent::Removed { blocks, tier },
                IndexChange::WorkerCleared { .. } => KvEvent::Cleared,
                _ => {
                    if let Some(delta) = indexer.remove_worker(&worker(w)) {
                        log.push(delta);
                    }
                    seqs[w] = 0;
                    continue;
                }
            };
            // Some batches are lost on the way: gaps.
            if skips[i] {
                seqs[w] += 1;
            }
            let batch = KvEventBatch { worker: worker(w), epoch: 1, seq: seqs[w], events: vec![event] };
            seqs[w] += 1;
            batches.push(batch.clone());
            if let Some(delta) = indexer.apply(batch).delta {
                log.push(delta);
            }
        }
        let mut restarted = KvIndexer::restore(OwnershipIndex::with_max_blocks(40), snapshot).unwrap();
        for delta in &log {
            restarted.replay(delta).unwrap();
        }
        prop_assert_eq!(restarted.delta_seq(), indexer.delta_seq());
        prop_assert_eq!(restarted.index().digest(), indexer.index().digest());
        prop_assert_eq!(restarted.cursors().collect::<Vec<_>>(), indexer.cursors().collect::<Vec<_>>());
        // Redelivered batches change nothing.
        for batch in batches {
            prop_assert_eq!(restarted.apply(batch.clone()).status, indexer.apply(batch).status);
        }
        prop_assert_eq!(restarted.index().digest(), indexer.index().digest());
    }
}

fn op_worker(op: &Op) -> usize {
    match *op {
        Op::Store { w, .. } | Op::Remove { w, .. } | Op::Clear { w } | Op::RemoveWorker { w } => w,
        Op::Evict { .. } => 0,
    }
}
