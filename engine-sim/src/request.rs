//! Requests as the caller submits them, and their state inside the engine.

use std::fmt;
use std::sync::Arc;

use protocol::{BlockHash, BlockHasher, Role};

use crate::kv_cache::BlockId;

/// How a request is served by this worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Aggregated / bypass: prefill the part of the prompt that is not
    /// cached here, then decode. Accepted by `Decode` and `Both` workers.
    LocalPrefill,
    /// Disaggregated prefill: compute the prompt's KV, report
    /// [`crate::StepOutput::PrefillDone`] and leave; the blocks stay cached.
    /// Accepted by `Prefill` and `Both` workers.
    PrefillOnly,
    /// Disaggregated decode: the prompt's KV was transferred here, so the
    /// request is admitted with it present (no prefill compute), stores its
    /// prompt blocks in the prefix cache and decodes. Accepted by `Decode`
    /// and `Both` workers.
    KvReceived,
}

impl Mode {
    /// Every mode.
    pub const ALL: [Mode; 3] = [Mode::LocalPrefill, Mode::PrefillOnly, Mode::KvReceived];

    /// Whether a worker of `role` serves this mode.
    pub fn accepted_by(self, role: Role) -> bool {
        match self {
            Mode::PrefillOnly => role.prefills_for_others(),
            Mode::LocalPrefill | Mode::KvReceived => role.decodes(),
        }
    }

    /// Whether the request produces tokens on this worker.
    pub fn decodes(self) -> bool {
        !matches!(self, Mode::PrefillOnly)
    }

    /// Short lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::LocalPrefill => "local-prefill",
            Mode::PrefillOnly => "prefill-only",
            Mode::KvReceived => "kv-received",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One request submitted to an [`crate::Engine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRequest {
    /// Caller's id; unique among the worker's requests in flight.
    pub id: u64,
    /// Prompt token ids.
    pub prompt: Arc<[u32]>,
    /// The tokens the "model" produces, decided by the caller (so that a
    /// multi-turn workload can append them to the next turn's prompt). The
    /// request finishes after producing all of them. Ignored by
    /// [`Mode::PrefillOnly`].
    pub output_tokens: Arc<[u32]>,
    /// How this worker serves it.
    pub mode: Mode,
    /// Leading prompt tokens whose KV another worker supplies (the third
    /// path: a prefix pulled D -> P; 0 for none; ignored by
    /// [`Mode::KvReceived`]). When the request reaches the queue's head it
    /// takes blocks for all of the part this worker lacks (or waits for
    /// room) and is set aside until the caller moved them
    /// ([`crate::Step::pulls`], [`crate::Engine::pull_done`]), as vLLM holds
    /// a request waiting for remote KV: the blocks are stored in the prefix
    /// cache when the KV arrived, and the request takes the queue's head
    /// again.
    pub pull_tokens: u32,
}

/// A request inside the engine.
///
/// Token positions `0..prompt_len` are the prompt, then the generated
/// outputs. `computed` tokens have KV in `blocks`; the next sample needs KV
/// for all `known()` tokens. A request is prefilling while
/// `computed < prefill_end`; otherwise each step computes the one missing
/// token (none for the first sample of a [`Mode::KvReceived`] request) and
/// samples.
#[derive(Debug)]
pub(crate) struct Seq {
    pub(crate) id: u64,
    pub(crate) prompt: Arc<[u32]>,
    pub(crate) output: Arc<[u32]>,
    pub(crate) mode: Mode,
    pub(crate) prompt_len: u32,
    /// Tokens to produce (0 for prefill-only).
    pub(crate) output_len: u32,
    /// Chained hashes of the full blocks hashed so far.
    pub(crate) hashes: Vec<BlockHash>,
    /// Blocks held, in order: `ceil(allocated tokens / block_size)`.
    pub(crate) blocks: Vec<BlockId>,
    /// Tokens whose KV is present.
    pub(crate) computed: u32,
    /// Leading blocks registered in the prefix cache.
    pub(crate) committed: u32,
    /// Output tokens produced.
    pub(crate) generated: u32,
    /// Prefill target: the request prefills while `computed` is below it.
    pub(crate) prefill_end: u32,
    /// Prefix-cache hit tokens at the first admission.
    pub(crate) cached_tokens: Option<u32>,
    /// Set when the request left the running batch during a step.
    pub(crate) done: bool,
    /// Prompt tokens cached when the request was submitted, or, once
    /// preempted, the blocks it had committed (they stay cached); whole
    /// blocks short of its prefill target: the hits it expects at
    /// admission, where they are settled.
    pub(crate) expected_hit_tokens: u32,
    /// Leading prompt tokens another worker supplies, as submitted.
    pub(crate) pull_tokens: u32,
    /// The pull was started, or found needless, once: whatever of the
    /// prefix is missing later (a preemption) is computed.
    pub(crate) pulled: bool,
}

impl Seq {
    /// A new request; lengths were validated by the caller.
    pub(crate) fn new(req: EngineRequest, prompt_len: u32, output_len: u32) -> Self {
        let prefill_end = match req.mode {
            Mode::KvReceived => 0,
            Mode::LocalPrefill | Mode::PrefillOnly => prompt_len,
        };
        Self {
            id: req.id,
            prompt: req.prompt,
            output: req.output_tokens,
            mode: req.mode,
            prompt_len,
            output_len,
            hashes: Vec::new(),
            blocks: Vec::new(),
            computed: 0,
            committed: 0,
            generated: 0,
            prefill_end,
            cached_tokens: None,
            done: false,
            expected_hit_tokens: 0,
            pull_tokens: req.pull_tokens,
            pulled: req.mode == Mode::KvReceived,
        }
    }

    /// The request as submitted.
    pub(crate) fn to_request(&self) -> EngineRequest {
        EngineRequest {
            id: self.id,
            prompt: self.prompt.clone(),
            output_tokens: self.output.clone(),
            mode: self.mode,
            pull_tokens: self.pull_tokens,
        }
    }

    /// Tokens known so far: the prompt and the generated outputs.
    pub(crate) fn known(&self) -> u32 {
        self.prompt_len + self.generated
    }

    /// Prompt tokens still to prefill.
    pub(crate) fn remaining_prefill(&self) -> u32 {
        self.prefill_end.saturating_sub(self.computed)
    }

    /// Leading whole blocks of the prefill target a cache hit may cover:
    /// all but the one holding its last token, which an engine always
    /// computes.
    pub(crate) fn hittable_prefill_blocks(&self, block_size: u32) -> u32 {
        self.prefill_end.saturating_sub(1) / block_size
    }

    /// What the request adds to the load report's queued prefill while it
    /// waits: its remaining prefill less the hits it expects.
    pub(crate) fn queued_prefill(&self) -> u32 {
        self.remaining_prefill()
            .saturating_sub(self.expected_hit_tokens)
    }

    /// Whether the request still pulls its supplied prefix at admission.
    pub(crate) fn awaits_pull(&self) -> bool {
        self.pull_tokens > 0 && !self.pulled
    }

    pub(crate) fn is_prefilling(&self) -> bool {
        self.computed < self.prefill_end
    }

    /// Whether the request waits for its KV to arrive rather than for a
    /// prefill (a [`Mode::KvReceived`] request never admitted yet).
    pub(crate) fn awaits_transfer(&self) -> bool {
        self.prefill_end == 0
    }

    /// Makes sure the hashes of the first `n_blocks` full blocks are known.
    /// Each block is hashed once per request.
    pub(crate) fn ensure_hashes(
        &mut self,
        n_blocks: usize,
        hasher: &BlockHasher,
        scratch: &mut Vec<u32>,
    ) {
        let bs = hasher.block_size() as usize;
        let prompt_len = self.prompt_len as usize;
        let known = self.known() as usize;
        let n_blocks = n_blocks.min(known / bs);
        self.hashes
            .reserve(n_blocks.saturating_sub(self.hashes.len()));
        while self.hashes.len() < n_blocks {
            let start = self.hashes.len() * bs;
            let end = start + bs;
            let content = if end <= prompt_len {
                hasher.content_hash(&self.prompt[start..end])
            } else if start >= prompt_len {
                hasher.content_hash(&self.output[start - prompt_len..end - prompt_len])
            } else {
                scratch.clear();
                scratch.extend_from_slice(&self.prompt[start..]);
                scratch.extend_from_slice(&self.output[..end - prompt_len]);
                hasher.content_hash(scratch)
            };
            let parent = self.hashes.last().copied();
            self.hashes.push(BlockHasher::chain(parent, content));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::HashSalt;

    #[test]
    fn roles_accept_their_modes() {
        use Mode::*;
        assert!(PrefillOnly.accepted_by(Role::Prefill));
        assert!(!LocalPrefill.accepted_by(Role::Prefill));
        assert!(!KvReceived.accepted_by(Role::Prefill));
        assert!(!PrefillOnly.accepted_by(Role::Decode));
        assert!(LocalPrefill.accepted_by(Role::Decode));
        assert!(KvReceived.accepted_by(Role::Decode));
        for m in Mode::ALL {
            assert!(m.accepted_by(Role::Both));
        }
    }

    #[test]
    fn hashes_span_prompt_and_output_like_one_token_stream() {
        let h = BlockHasher::new(4, HashSalt(3)).unwrap();
        let req = EngineRequest {
            id: 1,
            prompt: (0..6).collect::<Vec<u32>>().into(),
            output_tokens: (6..12).collect::<Vec<u32>>().into(),
            mode: Mode::LocalPrefill,
            pull_tokens: 0,
        };
        let mut seq = Seq::new(req, 6, 6);
        let mut scratch = Vec::new();
        seq.ensure_hashes(10, &h, &mut scratch);
        assert_eq!(seq.hashes.len(), 1, "only known tokens are hashed");
        seq.generated = 6;
        seq.ensure_hashes(10, &h, &mut scratch);
        let all: Vec<u32> = (0..12).collect();
        assert_eq!(seq.hashes, h.hash_prompt(&all));
    }
}
