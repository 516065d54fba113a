//! Overlap queries, request/reply on `subjects::INDEX_OVERLAP`.
//!
//! The request body is an [`OverlapQuery`]; the reply an [`OverlapReply`]
//! (workers sorted by id, only those holding at least the query's first
//! block). A request that is not an `OverlapQuery` gets a reply with an
//! empty body and the header [`ERROR_HEADER`] (`Switchyard-Error`) holding
//! the reason: an empty `OverlapReply` would be indistinguishable from "no
//! worker holds it".

use protocol::{DecodeError, Message, OverlapQuery, OverlapReply, WorkerOverlap};

use crate::indexer::KvIndexer;

/// The header of an error reply (its body is empty).
pub const ERROR_HEADER: &str = "Switchyard-Error";

/// Answers one query from the index.
pub fn answer(indexer: &KvIndexer, payload: &[u8]) -> Result<OverlapReply, DecodeError> {
    let query = OverlapQuery::decode(payload)?;
    let index = indexer.index();
    let mut workers: Vec<WorkerOverlap> = index
        .find_matches(&query.block_hashes)
        .iter()
        .filter_map(|(slot, depth)| {
            Some(WorkerOverlap {
                worker: index.worker(slot)?.clone(),
                device: depth.device,
                host: depth.host,
                disk: depth.disk,
            })
        })
        .collect();
    workers.sort_by(|a, b| a.worker.cmp(&b.worker));
    Ok(OverlapReply {
        delta_seq: indexer.delta_seq(),
        workers,
    })
}

/// An error text fit for a header value (one line).
pub fn header_text(error: &impl std::fmt::Display) -> String {
    error
        .to_string()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use protocol::{BlockHash, BlockHasher, KvEvent, KvEventBatch, Tier, WorkerId};

    use super::*;
    use crate::index::OwnershipIndex;

    #[test]
    fn per_worker_depths_and_errors() {
        let chain: Vec<BlockHash> = (0..4u64).fold(Vec::new(), |mut c, i| {
            c.push(BlockHasher::chain(c.last().copied(), i));
            c
        });
        let mut indexer = KvIndexer::new(OwnershipIndex::new());
        for (name, len) in [("b", 4), ("a", 2)] {
            indexer.apply(KvEventBatch {
                worker: WorkerId::new(name, 0).unwrap(),
                epoch: 1,
                seq: 0,
                events: vec![KvEvent::Stored {
                    parent: None,
                    blocks: chain[..len].to_vec(),
                    tier: Tier::Device,
                }],
            });
        }
        let query = OverlapQuery {
            block_hashes: chain.clone(),
        };
        let reply = answer(&indexer, &query.encode()).unwrap();
        assert_eq!(reply.delta_seq, 2);
        let depths: Vec<(String, u32)> = reply
            .workers
            .iter()
            .map(|w| (w.worker.to_string(), w.device))
            .collect();
        assert_eq!(depths, vec![("a".into(), 2), ("b".into(), 4)]);
        let error = answer(&indexer, b"\x92\x01garbage").unwrap_err();
        assert!(!header_text(&error).contains('\n'));
    }
}
