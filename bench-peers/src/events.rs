//! Blocks in both hash families, and the peer's events built from them.
//!
//! Our index keys blocks by `protocol::BlockHasher::chain` hashes; the peer
//! matches on per-block content hashes (`LocalBlockHash`) and names stored
//! blocks by its own rolling hash (`compute_seq_hash_for_block`), which its
//! positional index must be able to recompute. Each side gets its own
//! hashes of the same blocks.

use dynamo_kv_router::protocols::{
    compute_seq_hash_for_block, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData,
    KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, WorkerWithDpRank,
};
use dynamo_kv_router::RouterEvent;
use protocol::{BlockHash, BlockHasher};

/// One chain of blocks, as each index names them.
#[derive(Debug, Clone)]
pub struct Chain {
    pub ours: Vec<BlockHash>,
    pub local: Vec<LocalBlockHash>,
    pub seq: Vec<ExternalSequenceBlockHash>,
}

impl Chain {
    pub fn from_content(content: &[u64]) -> Self {
        let mut ours = Vec::with_capacity(content.len());
        for c in content {
            ours.push(BlockHasher::chain(ours.last().copied(), *c));
        }
        let local: Vec<LocalBlockHash> = content.iter().map(|c| LocalBlockHash(*c)).collect();
        let seq = compute_seq_hash_for_block(&local)
            .into_iter()
            .map(ExternalSequenceBlockHash)
            .collect();
        Chain { ours, local, seq }
    }

    pub fn len(&self) -> usize {
        self.ours.len()
    }
}

/// The peer's worker for our worker number `w` (rank 0).
pub fn peer_worker(w: usize) -> WorkerWithDpRank {
    WorkerWithDpRank {
        worker_id: w as u64,
        dp_rank: 0,
    }
}

fn event(worker: usize, event_id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent::new(
        worker as u64,
        KvCacheEvent {
            event_id,
            data,
            dp_rank: 0,
        },
    )
}

/// Blocks `from..to` of `chain` stored by `worker`, the parent being block
/// `from - 1` (none for the chain's first block).
pub fn stored(worker: usize, event_id: u64, chain: &Chain, from: usize, to: usize) -> RouterEvent {
    let blocks = (from..to)
        .map(|k| KvCacheStoredBlockData {
            block_hash: chain.seq[k],
            tokens_hash: chain.local[k],
            mm_extra_info: None,
        })
        .collect();
    event(
        worker,
        event_id,
        KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: from.checked_sub(1).map(|p| chain.seq[p]),
            start_position: None,
            blocks,
        }),
    )
}

pub fn removed(worker: usize, event_id: u64, blocks: &[ExternalSequenceBlockHash]) -> RouterEvent {
    event(
        worker,
        event_id,
        KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: blocks.to_vec(),
        }),
    )
}
