//! The kv-indexer core fed arbitrary batches of three workers: blocks from
//! a small hash space (so chains collide, fork and repeat, as a confused or
//! hostile engine would send them), epochs and seqs in and out of order,
//! removals of what nobody holds, clears, a memory cap, workers leaving.
//! Nothing may panic; a replica applying the deltas in order reaches the
//! indexer's digest, and so does a restore from its snapshot.

use kv_indexer::index::OwnershipIndex;
use kv_indexer::indexer::KvIndexer;
use kv_indexer::replica::IndexReplica;
use protocol::{BlockHash, KvEvent, KvEventBatch, Tier, WorkerId};

use crate::input::Input;

const WORKERS: usize = 3;

fn block(input: &mut Input<'_>) -> BlockHash {
    BlockHash(u64::from(input.byte() % 48) + 1)
}

fn tier(input: &mut Input<'_>) -> Tier {
    Tier::ALL[usize::from(input.byte()) % Tier::ALL.len()]
}

fn blocks(input: &mut Input<'_>) -> Vec<BlockHash> {
    let n = usize::from(input.byte() % 9);
    (0..n).map(|_| block(input)).collect()
}

fn event(input: &mut Input<'_>) -> KvEvent {
    match input.byte() % 8 {
        0..=3 => KvEvent::Stored {
            parent: (input.byte() % 3 != 0).then(|| block(input)),
            blocks: blocks(input),
            tier: tier(input),
        },
        4..=6 => KvEvent::Removed {
            blocks: blocks(input),
            tier: tier(input),
        },
        _ => KvEvent::Cleared,
    }
}

pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let cap = input.byte();
    let index = match cap {
        0..=127 => OwnershipIndex::new(),
        c => OwnershipIndex::with_max_blocks(u64::from(c % 64) + 1),
    };
    let mut indexer = KvIndexer::new(index);
    let mut replica = IndexReplica::new();
    let workers: Vec<WorkerId> = (0..WORKERS)
        .map(|i| WorkerId::new(&format!("w{i}"), 0).expect("a valid worker id"))
        .collect();
    let mut epoch = [1u64; WORKERS];
    let mut seq = [0u64; WORKERS];
    while !input.is_empty() {
        let op = input.byte();
        let w = usize::from(op % WORKERS as u8);
        let delta = match op / WORKERS as u8 % 8 {
            // The worker left (its lease expired).
            0 => indexer.remove_worker(&workers[w]),
            // A new epoch (agent restart or resync), from seq 0.
            1 => {
                epoch[w] += 1;
                seq[w] = 0;
                None
            }
            // Stream position from the input: stale epochs, gaps, duplicates.
            2 => {
                epoch[w] = u64::from(input.byte() % 4) + 1;
                seq[w] = u64::from(input.byte() % 4);
                None
            }
            _ => {
                let n = usize::from(input.byte() % 4) + 1;
                let batch = KvEventBatch {
                    worker: workers[w].clone(),
                    epoch: epoch[w],
                    seq: seq[w],
                    events: (0..n).map(|_| event(&mut input)).collect(),
                };
                seq[w] += 1;
                indexer.apply(batch).delta
            }
        };
        if let Some(delta) = delta {
            replica
                .apply(&delta)
                .unwrap_or_else(|e| panic!("delta {} does not apply: {e}", delta.seq));
        }
    }
    let digest = indexer.index().digest();
    assert_eq!(
        replica.index().digest(),
        digest,
        "the replica's digest differs from the indexer's"
    );
    let mut restored = IndexReplica::new();
    restored
        .restore(indexer.snapshot())
        .unwrap_or_else(|e| panic!("the indexer's own snapshot does not restore: {e}"));
    assert_eq!(restored.index().digest(), digest, "restored digest differs");
}

pub fn seeds() -> Vec<Vec<u8>> {
    // cap byte, then ops: worker 0 stores a chain and extends it, worker 1
    // stores the same prefix, worker 0 removes its tail, worker 2 clears.
    vec![
        vec![0, 9, 1, 0, 0, 4, 1, 2, 3, 4, 0],
        vec![
            0, 9, 2, 0, 0, 4, 1, 2, 3, 4, 0, 1, 2, 1, 4, 2, 5, 6, 0, 10, 1, 0, 0, 2, 1, 2, 0, 9, 1,
            4, 2, 3, 4, 0, 11, 1, 7,
        ],
        vec![
            200, 9, 3, 0, 0, 8, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 1, 8, 9, 10, 11, 12, 13, 14, 15, 16,
            0,
        ],
    ]
}
