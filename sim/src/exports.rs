//! How a decode engine keeps the blocks the third path reads, and what
//! that costs it.
//!
//! vLLM's bidirectional NIXL transfer lets a prefill engine read a decode
//! engine's blocks only through a handle the decode engine returns with a
//! finished request, and with the transfer on it exports every request
//! that came with transfer params: it pins the request's blocks until the
//! first read or `decoder_kv_blocks_ttl` (480 s by default). Three models
//! ([`KvExport`]):
//!
//! - **ideal**: the fetched prefix is pinned from the router's decision
//!   until the prefill worker has read it, and nothing else is pinned
//!   (`engine_sim::Engine::pin_prefix`). The simulated engine does this;
//!   no real engine does.
//! - **vLLM, on demand** (what the worker agent does): the decode worker's
//!   agent asks its engine to export what it holds of the prefix a fetch
//!   needs. The export is a request to the decode engine (one token of the
//!   prefix: it queues there, recomputes the prefix's last block, and any
//!   block evicted while it waited, and decodes one token); the blocks are
//!   pinned from its end until read, and the prefill worker is sent its
//!   leg only then; an export
//!   not done within the agent's deadline, or beyond the exports one
//!   source runs at once, is abandoned and the leg prefills whole
//!   ([`KvExport::exports_by_request`]). The TTL runs from the export's
//!   end. And every remote decode leg, which carries the prefill engine's
//!   transfer params, is exported as it finishes and stays pinned until
//!   the TTL: nobody reads it.
//! - **vLLM, every request** (the agent before it asked on demand: a
//!   handle asked of every bypass): every request decoded is exported as it
//!   finishes, pinned until a later turn's fetch reads it or the TTL ends,
//!   conversations that never come back included. [`Exports`] keeps them,
//!   found as the agent found them: by the chained block hash of each whole
//!   block from the end of the request's prompt to the last block the
//!   engine computed; a fetch that finds none prefills whole.
//!
//! In both vLLM models the prefill engine declines a read that would start
//! less than [`VLLM_READ_MARGIN_US`] before the export's TTL ends (the
//! prefill worker computes the prefix, as vLLM does with
//! `kv_load_failure_policy: recompute`; its default fails the request),
//! and the decode engine keeps the blocks until the TTL all the same.

use std::collections::{BTreeSet, HashMap};

use protocol::{BlockHash, Path};

/// vLLM's prefill engine declines to read an export that expires within
/// this long (`_KV_BLOCKS_EXPIRY_SAFETY_MARGIN` in
/// `nixl/pull_worker.py`, vLLM 0.34.0), so an export is readable for its
/// TTL less this.
pub const VLLM_READ_MARGIN_US: u64 = 5_000_000;

/// How the third path's source keeps the blocks it supplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvExport {
    /// Pinned from the decision until read; nothing else pinned.
    #[default]
    Ideal,
    /// vLLM, the agent asking for an export when a fetch needs it: pinned
    /// from the decision until read; every remote decode leg pinned until
    /// `ttl_us` after it finishes.
    VllmOnDemand { ttl_us: u64 },
    /// vLLM, a handle asked of every request: every request decoded pinned
    /// until a fetch reads it or `ttl_us` after it finishes.
    VllmEveryRequest { ttl_us: u64 },
}

impl KvExport {
    /// Whether a fetch pins its prefix at the decision (the ideal engine;
    /// else it is exported by a request, or taken from an export kept since
    /// an earlier request finished).
    pub fn pins_at_decision(self) -> bool {
        matches!(self, Self::Ideal)
    }

    /// Whether the source's engine exports a fetched prefix with a request
    /// of its own before the prefill worker is sent the leg, within the
    /// agent's deadline and bound ([`worker_agent::core::EXPORT_DEADLINE`],
    /// [`worker_agent::core::MAX_EXPORTS`]); else the source's blocks
    /// are readable from the decision on.
    pub fn exports_by_request(self) -> bool {
        matches!(self, Self::VllmOnDemand { .. })
    }

    /// How long the decode engine keeps an export nobody read (`None`: as
    /// long as the read takes to come).
    pub fn ttl_us(self) -> Option<u64> {
        match self {
            Self::Ideal => None,
            Self::VllmOnDemand { ttl_us } | Self::VllmEveryRequest { ttl_us } => Some(ttl_us),
        }
    }

    /// Until when an export that expires at `expires_us` may be read.
    pub fn readable_until_us(self, expires_us: u64) -> u64 {
        match self {
            Self::Ideal => expires_us,
            Self::VllmOnDemand { .. } | Self::VllmEveryRequest { .. } => {
                expires_us.saturating_sub(VLLM_READ_MARGIN_US)
            }
        }
    }

    /// What the decode engine does with a request that finishes after
    /// coming on `path`: keeps its blocks pinned for that long, and
    /// whether a later fetch can find them (`None`: not exported).
    pub fn export_of(self, path: Path) -> Option<(u64, bool)> {
        match self {
            Self::Ideal => None,
            Self::VllmOnDemand { ttl_us } => path.is_remote().then_some((ttl_us, false)),
            Self::VllmEveryRequest { ttl_us } => Some((ttl_us, true)),
        }
    }
}

/// One decode engine's exported requests, each holding a pin `P` on its
/// blocks until it is taken (read) or expires.
#[derive(Debug)]
pub struct Exports<P> {
    by_id: HashMap<u64, Export<P>>,
    /// The newest export that covers each key.
    by_key: HashMap<BlockHash, u64>,
    /// `(expires_us, id)`, soonest first.
    expiry: BTreeSet<(u64, u64)>,
}

/// An export a fetch took ([`Exports::take_longest`]).
#[derive(Debug, PartialEq, Eq)]
pub struct Taken<P> {
    /// Leading blocks of the prompt it covers.
    pub blocks: usize,
    pub pin: P,
    pub expires_us: u64,
}

#[derive(Debug)]
struct Export<P> {
    pin: P,
    keys: Vec<BlockHash>,
    expires_us: u64,
}

impl<P> Default for Exports<P> {
    fn default() -> Self {
        Self {
            by_id: HashMap::new(),
            by_key: HashMap::new(),
            expiry: BTreeSet::new(),
        }
    }
}

impl<P> Exports<P> {
    /// Keeps export `id` until `expires_us`, found by `keys` (none: kept
    /// only until then, for no fetch); the newest export wins a key two
    /// share. An id kept already is replaced.
    pub fn insert(&mut self, id: u64, pin: P, keys: Vec<BlockHash>, expires_us: u64) -> Option<P> {
        let replaced = self.remove(id).map(|e| e.pin);
        for &key in &keys {
            self.by_key.insert(key, id);
        }
        self.by_id.insert(
            id,
            Export {
                pin,
                keys,
                expires_us,
            },
        );
        self.expiry.insert((expires_us, id));
        replaced
    }

    /// Takes (single use) the export keyed by the longest leading part of
    /// `prefix` (a prompt's chained block hashes): how many of its blocks
    /// it covers, its pin (all of the exported request's blocks), and when
    /// the engine would have let it go (a read after that is declined).
    pub fn take_longest(&mut self, prefix: &[BlockHash]) -> Option<Taken<P>> {
        let (i, id) = prefix
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, hash)| self.by_key.get(hash).map(|&id| (i, id)))?;
        let export = self.remove(id)?;
        Some(Taken {
            blocks: i + 1,
            pin: export.pin,
            expires_us: export.expires_us,
        })
    }

    /// Removes the exports whose TTL has ended by `now_us` and returns
    /// their pins.
    pub fn expire(&mut self, now_us: u64) -> Vec<P> {
        let mut pins = Vec::new();
        while let Some(&(at, id)) = self.expiry.first() {
            if at > now_us {
                break;
            }
            if let Some(export) = self.remove(id) {
                pins.push(export.pin);
            }
        }
        pins
    }

    /// Exports kept (not yet read or expired).
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    fn remove(&mut self, id: u64) -> Option<Export<P>> {
        let export = self.by_id.remove(&id)?;
        self.expiry.remove(&(export.expires_us, id));
        for key in &export.keys {
            if self.by_key.get(key) == Some(&id) {
                self.by_key.remove(key);
            }
        }
        Some(export)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u64) -> BlockHash {
        BlockHash(n)
    }

    fn taken<P>(blocks: usize, pin: P, expires_us: u64) -> Taken<P> {
        Taken {
            blocks,
            pin,
            expires_us,
        }
    }

    #[test]
    fn a_vllm_export_is_readable_until_its_margin_before_the_ttl() {
        let at = 60_000_000;
        assert_eq!(KvExport::Ideal.readable_until_us(at), at);
        let vllm = [
            KvExport::VllmOnDemand { ttl_us: 1 },
            KvExport::VllmEveryRequest { ttl_us: 1 },
        ];
        for kv_export in vllm {
            assert_eq!(kv_export.readable_until_us(at), at - VLLM_READ_MARGIN_US);
            assert_eq!(kv_export.readable_until_us(1_000), 0);
        }
    }

    #[test]
    fn the_longest_keyed_prefix_is_taken_once() {
        let mut ex = Exports::default();
        // Request 1's prompt ended at block 3, its answer at block 5.
        ex.insert(1, "pin1", vec![h(3), h(4), h(5)], 100);
        // A later prompt shares blocks 0..=4 with it, then parts.
        let prompt = [h(0), h(1), h(2), h(3), h(4), h(40), h(41)];
        assert_eq!(ex.take_longest(&prompt), Some(taken(5, "pin1", 100)));
        assert_eq!(ex.take_longest(&prompt), None, "single use");
        assert!(ex.is_empty());
        assert!(
            ex.expire(1_000).is_empty(),
            "a taken export does not expire"
        );
    }

    #[test]
    fn a_prompt_that_ends_before_the_keys_finds_nothing() {
        let mut ex = Exports::default();
        ex.insert(1, (), vec![h(3), h(4)], 100);
        assert_eq!(ex.take_longest(&[h(0), h(1), h(2)]), None);
        assert_eq!(ex.len(), 1);
    }

    #[test]
    fn the_newest_wins_a_shared_key_and_the_older_keeps_its_own() {
        let mut ex = Exports::default();
        ex.insert(1, "old", vec![h(3), h(4)], 100);
        ex.insert(2, "new", vec![h(4), h(5)], 200);
        assert_eq!(ex.take_longest(&[h(3), h(4)]), Some(taken(2, "new", 200)));
        // Taking the newer leaves the older's own key.
        assert_eq!(ex.take_longest(&[h(3), h(4)]), Some(taken(1, "old", 100)));
    }

    #[test]
    fn exports_expire_soonest_first_and_give_back_their_pins() {
        let mut ex = Exports::default();
        ex.insert(3, "c", vec![h(3)], 200);
        ex.insert(1, "a", vec![h(1)], 100);
        ex.insert(2, "b", vec![h(2)], 150);
        // Kept only until it expires: no fetch finds it.
        ex.insert(4, "d", vec![], 120);
        assert_eq!(ex.take_longest(&[h(2)]), Some(taken(1, "b", 150)));
        assert!(ex.expire(99).is_empty());
        assert_eq!(ex.expire(150), vec!["a", "d"], "b was taken");
        assert_eq!(ex.take_longest(&[h(1)]), None, "expired");
        assert_eq!(ex.expire(200), vec!["c"]);
        assert!(ex.is_empty());
        // The same id again replaces the export kept under it.
        assert_eq!(ex.insert(5, "e", vec![h(5)], 300), None);
        assert_eq!(ex.insert(5, "f", vec![h(6)], 100), Some("e"));
        assert_eq!(ex.take_longest(&[h(5)]), None);
        assert_eq!(ex.expire(100), vec!["f"]);
    }
}
