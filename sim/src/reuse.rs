//! The reuse ceiling: the most prompt blocks any placement and any eviction
//! could have served from cache, were the whole cluster's KV memory one
//! pool.
//!
//! Offline, over a run's block accesses in arrival order (each request's
//! prompt blocks, then its answer's, which only enter the pool) with
//! Belady's rule: on a miss with the pool full, drop the block used again
//! furthest in the future (the new block itself when it is that one). For
//! blocks of one size no eviction serves more hits (Belady, 1966). A
//! block's parent is used in every request that uses the block, before it,
//! so the rule drops a child before its parent: the pool stays
//! prefix-closed and each hit is a prefix hit. A real cluster serves no
//! more: its memory is split among workers (which may hold copies), running
//! requests take room, and its eviction is online.

use std::collections::{BTreeSet, HashMap, HashSet};

use protocol::BlockHash;

/// What a run's accesses allow.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReuseCeiling {
    /// Prompt blocks of the run, all requests (warm-up included).
    pub prompt_blocks: u64,
    /// Of them, used before by an earlier request (memory unbounded).
    pub unbounded_hits: u64,
    /// Of them, served at most from a pool of `pool_blocks`.
    pub pooled_hits: u64,
    pub pool_blocks: u64,
}

impl ReuseCeiling {
    pub fn unbounded_share(&self) -> f64 {
        self.unbounded_hits as f64 / self.prompt_blocks.max(1) as f64
    }

    pub fn pooled_share(&self) -> f64 {
        self.pooled_hits as f64 / self.prompt_blocks.max(1) as f64
    }
}

/// One block access: a prompt's (a hit counts) or an answer's (it only
/// enters the pool).
#[derive(Debug, Clone, Copy)]
struct Access {
    block: BlockHash,
    prompt: bool,
}

/// A run's block accesses, in arrival order.
#[derive(Debug, Clone, Default)]
pub struct ReuseLog {
    accesses: Vec<Access>,
}

impl ReuseLog {
    /// Records one request: its prompt's full blocks, then its answer's
    /// (the chain continued over the prompt's partial last block and the
    /// answer).
    pub fn record(&mut self, prompt: &[BlockHash], answer: &[BlockHash]) {
        let access = |prompt| move |&block| Access { block, prompt };
        self.accesses.extend(prompt.iter().map(access(true)));
        self.accesses.extend(answer.iter().map(access(false)));
    }

    /// The ceiling with a pool of `pool_blocks` blocks.
    pub fn ceiling(&self, pool_blocks: u64) -> ReuseCeiling {
        let next = self.next_uses();
        ReuseCeiling {
            prompt_blocks: self.accesses.iter().filter(|a| a.prompt).count() as u64,
            unbounded_hits: self.repeats(),
            pooled_hits: self.hits(&next, pool_blocks),
            pool_blocks,
        }
    }

    /// For each access, the index of the next access to its block
    /// (`usize::MAX`: none).
    fn next_uses(&self) -> Vec<usize> {
        let mut next = vec![usize::MAX; self.accesses.len()];
        let mut later: HashMap<BlockHash, usize> = HashMap::new();
        for (i, a) in self.accesses.iter().enumerate().rev() {
            if let Some(j) = later.insert(a.block, i) {
                next[i] = j;
            }
        }
        next
    }

    /// Prompt accesses to a block accessed before: the hits of a pool that
    /// never evicts.
    fn repeats(&self) -> u64 {
        let mut seen = HashSet::new();
        self.accesses
            .iter()
            .filter(|a| !seen.insert(a.block) && a.prompt)
            .count() as u64
    }

    /// Prompt hits under Belady's rule with room for `pool_blocks`.
    fn hits(&self, next: &[usize], pool_blocks: u64) -> u64 {
        // Each pooled block with its next use, and the same ordered by it.
        let mut pool: HashMap<BlockHash, usize> = HashMap::new();
        let mut by_next: BTreeSet<(usize, BlockHash)> = BTreeSet::new();
        let mut hits = 0;
        for (i, a) in self.accesses.iter().enumerate() {
            if let Some(at) = pool.get_mut(&a.block) {
                hits += u64::from(a.prompt);
                by_next.remove(&(*at, a.block));
                *at = next[i];
                by_next.insert((next[i], a.block));
                continue;
            }
            if pool.len() as u64 >= pool_blocks {
                match by_next.last() {
                    Some(&(furthest, victim)) if furthest > next[i] => {
                        by_next.pop_last();
                        pool.remove(&victim);
                    }
                    // The new block is used again last (or never): skip it.
                    _ => continue,
                }
            }
            pool.insert(a.block, next[i]);
            by_next.insert((next[i], a.block));
        }
        hits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(ids: &[u64]) -> Vec<BlockHash> {
        ids.iter().map(|&i| BlockHash(i)).collect()
    }

    #[test]
    fn unbounded_memory_serves_every_repeat() {
        let mut log = ReuseLog::default();
        log.record(&blocks(&[1, 2]), &blocks(&[3]));
        log.record(&blocks(&[1, 2, 3, 4]), &[]);
        log.record(&blocks(&[1, 5]), &[]);
        let c = log.ceiling(u64::MAX);
        assert_eq!(
            (c.prompt_blocks, c.unbounded_hits, c.pooled_hits),
            (8, 4, 4)
        );
        assert_eq!(c.unbounded_share(), 0.5);
    }

    #[test]
    fn a_small_pool_keeps_what_is_used_soonest() {
        // Two conversations take turns; a pool of 2 holds one of them.
        let mut log = ReuseLog::default();
        for _ in 0..3 {
            log.record(&blocks(&[1, 2]), &[]);
            log.record(&blocks(&[7, 8]), &[]);
        }
        let c = log.ceiling(2);
        assert_eq!(c.unbounded_hits, 8);
        // Belady keeps one conversation (4 hits over its next 2 turns) and
        // never the other (LRU would hit nothing here).
        assert_eq!(c.pooled_hits, 4);
        assert_eq!(log.ceiling(4).pooled_hits, 8);
        assert_eq!(log.ceiling(0).pooled_hits, 0);
    }

    #[test]
    fn the_deepest_block_goes_first_so_the_prefix_still_hits() {
        // [1,2,3] then a cold [9], then [1,2,3] again with room for 3:
        // the cold block never returns, so it is not kept.
        let mut log = ReuseLog::default();
        log.record(&blocks(&[1, 2, 3]), &[]);
        log.record(&blocks(&[9]), &[]);
        log.record(&blocks(&[1, 2, 3]), &[]);
        assert_eq!(log.ceiling(3).pooled_hits, 3);
        // Room for 2: the child (used last) goes first, the prefix hits.
        assert_eq!(log.ceiling(2).pooled_hits, 2);
    }
}
