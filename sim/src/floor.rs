//! The TTFT floor: the least time to first token any router could give a
//! request on the simulated engines, so that a latency target can be
//! checked against what is possible, not only against another deployment.
//!
//! A request's floor is one prefill-only step of what is left of its prompt
//! after the longest prefix some earlier request held (in its prompt or in
//! its answer), as if that prefix were cached on an idle worker with room
//! for everything: no queue, no transfer, no eviction, no chunking. Each of
//! those only adds time (a step that mixes the prefill with decodes costs at
//! least the prefill alone, since every preset's cost model is monotone;
//! chunks add fixed costs and the same attention work), so a request's TTFT
//! is never below its floor, and no percentile of TTFT is below the same
//! percentile of the floors.

use std::collections::HashSet;

use engine_sim::CostModel;
use protocol::BlockHash;

/// The floor of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Floor {
    /// Prompt tokens an earlier request held (whole blocks, and never the
    /// last prompt token: an engine always computes at least that one).
    pub reusable_tokens: u32,
    /// One prefill-only step of the rest, on top of them.
    pub ttft_ms: f64,
}

/// Every block any request so far held, and the engines' cost model.
#[derive(Debug, Clone)]
pub struct TtftFloor {
    /// Prefix-closed: a block's parent is in it too.
    held: HashSet<BlockHash>,
    cost: CostModel,
    block_size: u32,
}

impl TtftFloor {
    pub fn new(cost: CostModel, block_size: u32) -> Self {
        Self {
            held: HashSet::new(),
            cost,
            block_size: block_size.max(1),
        }
    }

    /// The floor of a request of `prompt_tokens` tokens whose full blocks
    /// hash to `prompt` (chained), then remembers its blocks, and those of
    /// its answer (`answer`: the chain continued over the prompt's partial
    /// last block and the answer), for the requests after it.
    ///
    /// The answer counts as held from the request's arrival on: an upper
    /// bound on what any worker can hold, which keeps the floor a lower
    /// bound even where a later turn arrives before its predecessor's
    /// answer is complete (an open-loop replay).
    pub fn admit(
        &mut self,
        prompt_tokens: u32,
        prompt: &[BlockHash],
        answer: &[BlockHash],
    ) -> Floor {
        // `held` is prefix-closed (whole chains go in, from their first
        // block), so the prompt's held blocks are a prefix of it.
        let held_blocks = prompt.partition_point(|h| self.held.contains(h));
        let computable_blocks = prompt_tokens.saturating_sub(1) / self.block_size;
        let reusable_tokens = (held_blocks as u32).min(computable_blocks) * self.block_size;
        let ttft_ms = self
            .cost
            .prefill_ms(prompt_tokens - reusable_tokens, reusable_tokens);
        self.held
            .extend(prompt[held_blocks..].iter().chain(answer).copied());
        Floor {
            reusable_tokens,
            ttft_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost() -> CostModel {
        engine_sim::Preset::llama8b_h100().cost_model()
    }

    fn hashes(ids: &[u64]) -> Vec<BlockHash> {
        ids.iter().map(|&i| BlockHash(i)).collect()
    }

    #[test]
    fn a_first_request_computes_its_whole_prompt() {
        let mut floor = TtftFloor::new(cost(), 16);
        let f = floor.admit(40, &hashes(&[1, 2]), &hashes(&[3]));
        assert_eq!(f.reusable_tokens, 0);
        assert_eq!(f.ttft_ms, cost().prefill_ms(40, 0));
    }

    #[test]
    fn a_later_turn_reuses_the_earlier_prompt_and_its_answer() {
        let mut floor = TtftFloor::new(cost(), 16);
        floor.admit(40, &hashes(&[1, 2]), &hashes(&[3]));
        // Prompt and answer held (3 blocks), the 4th and the tail are new.
        let f = floor.admit(70, &hashes(&[1, 2, 3, 4]), &[]);
        assert_eq!(f.reusable_tokens, 48);
        assert_eq!(f.ttft_ms, cost().prefill_ms(22, 48));
        // Another branch off the first block (chained hashes differ after
        // the first difference).
        let f = floor.admit(64, &hashes(&[1, 9, 10, 11]), &[]);
        assert_eq!(f.reusable_tokens, 16);
    }

    #[test]
    fn a_prompt_held_whole_still_computes_its_last_block() {
        let mut floor = TtftFloor::new(cost(), 16);
        floor.admit(32, &hashes(&[1, 2]), &[]);
        let f = floor.admit(32, &hashes(&[1, 2]), &[]);
        assert_eq!(f.reusable_tokens, 16);
        assert_eq!(f.ttft_ms, cost().prefill_ms(16, 16));
    }
}
