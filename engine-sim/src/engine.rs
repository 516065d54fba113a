//! The engine: one worker's batch, KV cache and event stream.

use std::collections::HashSet;

use protocol::{BlockHash, BlockHasher, KvEvent, LoadReport, Role, WorkerId};

use crate::config::EngineConfig;
use crate::error::{ConfigError, SubmitError};
use crate::kv_cache::{BlockCounts, BlockId, KvCache, Mix};
use crate::request::{EngineRequest, Seq};
pub use crate::scheduler::Pull;
use crate::scheduler::{Env, Scheduler};

/// Something a step did to one request. Outputs of a step take effect at
/// the step's end ([`Step::end_us`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutput {
    /// The request's first output token. `cached_tokens`: prompt tokens
    /// found in the prefix cache when it was first admitted.
    FirstToken {
        /// The request.
        id: u64,
        /// Prefix-cache hit tokens.
        cached_tokens: u32,
    },
    /// One more output token.
    Token {
        /// The request.
        id: u64,
    },
    /// A [`crate::Mode::PrefillOnly`] request computed its prompt's KV and left;
    /// its blocks stay cached on this worker.
    PrefillDone {
        /// The request.
        id: u64,
        /// Prompt length.
        prompt_tokens: u32,
        /// Prefix-cache hit tokens.
        cached_tokens: u32,
    },
    /// The request produced its last token (reported right after that
    /// token's output) and left.
    Finished {
        /// The request.
        id: u64,
        /// Tokens produced.
        output_tokens: u32,
        /// Prefix-cache hit tokens.
        cached_tokens: u32,
    },
    /// The KV cache ran out: the request lost its blocks and went back to
    /// the front of the waiting queue. It will prefill again (its prompt and
    /// the tokens already produced) and resume; tokens already reported are
    /// not reported again.
    Preempted {
        /// The request.
        id: u64,
    },
}

/// One step: a forward pass over the batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// When the step starts: the `now_us` it was asked at, or the end of
    /// the previous step if that is later.
    pub start_us: u64,
    /// How long it takes (cost model).
    pub duration_us: u64,
    /// What happened to requests, in order.
    pub outputs: Vec<StepOutput>,
    /// Prompt tokens computed.
    pub prefill_tokens: u32,
    /// Requests that sampled a decode token.
    pub decode_seqs: u32,
    /// Prefixes to move here from the workers that supply them, starting
    /// now ([`crate::EngineRequest::pull_tokens`]); report each one done
    /// with [`Engine::pull_done`].
    pub pulls: Vec<Pull>,
}

impl Step {
    /// When the step's outputs take effect and the next step may start.
    pub fn end_us(&self) -> u64 {
        self.start_us.saturating_add(self.duration_us)
    }
}

/// Counters since the engine was built (a restart does not reset them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Steps run.
    pub steps: u64,
    /// Σ step durations.
    pub busy_us: u64,
    /// Prompt tokens computed by prefill (recomputation after preemption
    /// included).
    pub prefill_tokens: u64,
    /// Prompt tokens found in the prefix cache at admission (every
    /// admission, re-admissions after preemption included).
    pub cached_prompt_tokens: u64,
    /// Prompt tokens whose KV arrived by transfer ([`crate::Mode::KvReceived`]).
    pub kv_received_tokens: u64,
    /// Prompt tokens whose KV the caller was asked to pull from another
    /// worker ([`Step::pulls`]).
    pub pulled_prefix_tokens: u64,
    /// Output tokens produced.
    pub output_tokens: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Requests finished (all tokens produced).
    pub finished: u64,
    /// Prefill-only requests done.
    pub prefills_done: u64,
    /// Requests aborted before their end ([`Engine::abort`]).
    pub aborted: u64,
    /// Blocks stored in the prefix cache.
    pub blocks_stored: u64,
    /// Cached blocks evicted.
    pub blocks_evicted: u64,
    /// Blocks written to the host tier (evicted from the device, not there
    /// yet).
    pub host_blocks_written: u64,
    /// Host blocks evicted.
    pub host_blocks_evicted: u64,
    /// Prompt tokens read back from the host tier (instead of recomputed).
    pub host_read_tokens: u64,
    /// Time the host link's device-to-host direction spent writing, µs
    /// (beside the steps).
    pub host_write_us: u64,
    /// Time the host-to-device direction spent reading back (latency
    /// included), µs: requests waited for it, steps did not.
    pub host_read_us: u64,
}

/// A GPU-free model of one inference worker. See the crate documentation.
#[derive(Debug)]
pub struct Engine {
    worker: WorkerId,
    role: Role,
    config: EngineConfig,
    hasher: BlockHasher,
    busy_until_us: u64,
    cache: KvCache,
    sched: Scheduler,
    in_flight: HashSet<u64, Mix>,
    stats: EngineStats,
    scratch: Vec<u32>,
    outputs: Vec<StepOutput>,
    /// Pinned prefixes still being read by another worker
    /// ([`Engine::pin_prefix`], [`Engine::end_read`]): steps are longer
    /// while any is.
    reads: u32,
    /// Pins held on each block (indexed by [`BlockId`]).
    pins: Vec<u32>,
    /// Restarts so far: a pin from before the last one holds nothing.
    generation: u64,
    /// A moving mean of the durations of the steps that decoded since
    /// decoding last started here, µs: what [`LoadReport::recent_itl_us`]
    /// reports (`None` while nothing decodes).
    recent_itl_us: Option<f64>,
}

/// The weight of the newest decode step in [`Engine::load_report`]'s
/// `recent_itl_us`: a moving mean over about the last fifty steps that
/// decoded.
const RECENT_ITL_WEIGHT: f64 = 0.02;

/// Blocks of a prefix held for another worker's read
/// ([`Engine::pin_prefix`]): they are in use (not evictable) until
/// [`Engine::unpin`]; the read itself lengthens the engine's steps until
/// [`Engine::end_read`] (or the unpin).
#[derive(Debug)]
#[must_use = "a pin holds its blocks until Engine::unpin"]
pub struct PinnedPrefix {
    blocks: Vec<BlockId>,
    tokens: u32,
    reading: bool,
    generation: u64,
}

impl PinnedPrefix {
    /// Leading tokens pinned (whole blocks).
    pub fn tokens(&self) -> u32 {
        self.tokens
    }
}

impl Engine {
    /// An idle engine with an empty cache (and no event yet: nothing was
    /// lost).
    pub fn new(worker: WorkerId, role: Role, config: EngineConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let hasher = config.hasher()?;
        Ok(Self {
            worker,
            role,
            config,
            hasher,
            busy_until_us: 0,
            cache: KvCache::with_host(config.kv_capacity_blocks, config.host, config.block_bytes()),
            sched: Scheduler::default(),
            in_flight: HashSet::default(),
            stats: EngineStats::default(),
            scratch: Vec::new(),
            outputs: Vec::new(),
            reads: 0,
            pins: vec![0; config.kv_capacity_blocks as usize],
            generation: 0,
            recent_itl_us: None,
        })
    }

    /// The hashes of `prompt`'s first `tokens / block_size` full blocks.
    fn prefix_hashes(&self, prompt: &[u32], tokens: u32) -> Vec<BlockHash> {
        let bs = self.hasher.block_size() as usize;
        let n = (tokens as usize).min(prompt.len()) / bs;
        let mut parent = None;
        prompt[..n * bs]
            .chunks_exact(bs)
            .map(|block| {
                let hash = BlockHasher::chain(parent, self.hasher.content_hash(block));
                parent = Some(hash);
                hash
            })
            .collect()
    }

    /// Holds the cached blocks of `prompt`'s first `tokens` tokens (as many
    /// leading whole blocks as are cached) for another worker's read: they
    /// stay in use, so cannot be evicted, until [`Engine::unpin`]. The
    /// engine's steps are longer by [`EngineConfig::read_step_overhead`]
    /// while any read runs ([`Engine::start_read`] to [`Engine::end_read`]).
    pub fn pin_prefix(&mut self, prompt: &[u32], tokens: u32) -> PinnedPrefix {
        let mut blocks = Vec::new();
        for hash in self.prefix_hashes(prompt, tokens) {
            let Some(b) = self.cache.lookup(hash) else {
                break;
            };
            self.cache.acquire(b);
            self.pins[b as usize] += 1;
            blocks.push(b);
        }
        let tokens = blocks.len() as u32 * self.hasher.block_size();
        PinnedPrefix {
            blocks,
            tokens,
            reading: false,
            generation: self.generation,
        }
    }

    /// Another worker starts reading a pinned prefix: the steps are longer
    /// until [`Engine::end_read`] (or the unpin).
    pub fn start_read(&mut self, pin: &mut PinnedPrefix) {
        if !pin.reading && pin.generation == self.generation {
            pin.reading = true;
            self.reads += 1;
        }
    }

    /// The read of a pinned prefix is done: the steps are no longer slowed
    /// by it, but its blocks stay held until [`Engine::unpin`] (a decode
    /// worker keeps them for the reader until its prefill is done, as the
    /// router's ledger counts them).
    pub fn end_read(&mut self, pin: &mut PinnedPrefix) {
        if std::mem::take(&mut pin.reading) && pin.generation == self.generation {
            self.reads -= 1;
        }
    }

    /// Releases a pin (ending its read if still running); the blocks stay
    /// cached.
    pub fn unpin(&mut self, mut pin: PinnedPrefix) {
        // A pin from before a restart holds nothing any more.
        if pin.generation != self.generation {
            return;
        }
        self.end_read(&mut pin);
        for &b in pin.blocks.iter().rev() {
            self.pins[b as usize] -= 1;
            self.cache.release(b);
        }
    }

    /// Queues a request (it is admitted by a later [`Engine::step`]).
    pub fn submit(&mut self, req: EngineRequest) -> Result<(), SubmitError> {
        let id = req.id;
        if !req.mode.accepted_by(self.role) {
            return Err(SubmitError::UnsupportedMode {
                role: self.role,
                mode: req.mode,
            });
        }
        if self.in_flight.contains(&id) {
            return Err(SubmitError::DuplicateId(id));
        }
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt(id));
        }
        let output_len = if req.mode.decodes() {
            if req.output_tokens.is_empty() {
                return Err(SubmitError::NoOutputTokens(id));
            }
            req.output_tokens.len()
        } else {
            0
        };
        let prompt_len = u32::try_from(req.prompt.len()).map_err(|_| SubmitError::TooLong(id))?;
        let output_len = u32::try_from(output_len).map_err(|_| SubmitError::TooLong(id))?;
        // Tokens held at the peak: the last output's KV is never computed.
        let peak = u64::from(prompt_len) + u64::from(output_len.saturating_sub(1));
        if peak > u64::from(u32::MAX) {
            return Err(SubmitError::TooLong(id));
        }
        let needed_blocks = peak.div_ceil(u64::from(self.config.block_size));
        if needed_blocks > u64::from(self.config.kv_capacity_blocks) {
            return Err(SubmitError::ExceedsKvCapacity {
                id,
                needed_blocks,
                capacity_blocks: self.config.kv_capacity_blocks,
            });
        }
        self.in_flight.insert(id);
        let mut seq = Seq::new(req, prompt_len, output_len);
        seq.expected_hit_tokens = self.expected_hit_tokens(&mut seq);
        self.sched.enqueue(seq);
        Ok(())
    }

    /// The pull of request `id`'s supplied prefix ([`Step::pulls`]) is
    /// done: its blocks are stored in the prefix cache and it goes back to
    /// the front of the queue, where its admission hits them. Returns
    /// whether it was waiting for one (not, once aborted or after a
    /// restart). Call after the outputs of the last step were applied,
    /// then [`Engine::step`] (a step running on meanwhile admits it no
    /// earlier than the next).
    pub fn pull_done(&mut self, id: u64) -> bool {
        self.sched.pull_done(id, &mut self.cache)
    }

    /// The pull of request `id`'s supplied prefix ([`Step::pulls`]) was
    /// declined (its source no longer held the blocks): the blocks set
    /// aside for it are let go unstored, and it goes back to the front of
    /// the queue to compute what it lacks. Returns whether it was waiting
    /// for one. Call as [`Engine::pull_done`].
    pub fn pull_declined(&mut self, id: u64) -> bool {
        let bs = self.hasher.block_size();
        self.sched.pull_declined(id, &mut self.cache, bs)
    }

    /// Drops request `id` (its client went away): it leaves the queue or
    /// the batch at once, and its blocks are released; the full ones stay
    /// in the prefix cache. Call between steps (after the outputs of the
    /// last one were applied). Returns whether the request was in flight.
    pub fn abort(&mut self, id: u64) -> bool {
        if !self.sched.abort(id, &mut self.cache) {
            return false;
        }
        self.in_flight.remove(&id);
        self.stats.aborted += 1;
        true
    }

    /// Plans and runs the next step if there is work. The step starts at
    /// `now_us`, or when the previous step ends if that is later; the
    /// caller applies its outputs at [`Step::end_us`] and calls `step`
    /// again no earlier, and starts the pulls it asks for
    /// ([`Step::pulls`]). `None` when idle, when no waiting request fits
    /// beside the prefixes pinned for other workers' reads (call `step`
    /// again after [`Engine::unpin`]), or when only pulls are awaited (call
    /// it again after [`Engine::pull_done`]).
    pub fn step(&mut self, now_us: u64) -> Option<Step> {
        if self.sched.is_idle() {
            return None;
        }
        let start_us = now_us.max(self.busy_until_us);
        self.cache.now_us = start_us;
        let mut env = Env {
            cache: &mut self.cache,
            hasher: &self.hasher,
            scratch: &mut self.scratch,
            outputs: &mut self.outputs,
            stats: &mut self.stats,
            in_flight: &mut self.in_flight,
            max_batched_tokens: self.config.max_batched_tokens,
            max_running: self.config.max_running,
            now_us: start_us,
        };
        let planned = self.sched.plan_step(&mut env);
        self.sched.apply_step(&mut env);
        debug_assert!(
            !planned.work.is_empty()
                || self.sched.is_idle()
                || self.sched.next_ready_us().is_some()
                || self.pins.iter().any(|&p| p > 0)
                || !self.sched.pulling.is_empty(),
            "work pending but nothing scheduled"
        );
        self.sync_stats();
        let pulls = std::mem::take(&mut self.sched.pulls);
        if planned.work.is_empty() && self.outputs.is_empty() {
            // Only pulls started (the caller moves them, then steps again),
            // or read-backs from host in progress (wait for the first).
            let duration_us = if pulls.is_empty() {
                let ready = self.sched.next_ready_us()?;
                ready.saturating_sub(start_us).max(1)
            } else {
                1
            };
            self.busy_until_us = start_us.saturating_add(duration_us);
            return Some(Step {
                start_us,
                duration_us,
                outputs: Vec::new(),
                prefill_tokens: 0,
                decode_seqs: 0,
                pulls,
            });
        }
        let mut duration_us = self.config.cost.step_us(&planned.work);
        if self.reads > 0 {
            // `as` saturates.
            duration_us =
                (duration_us as f64 * (1.0 + self.config.read_step_overhead)).ceil() as u64;
        }
        self.busy_until_us = start_us.saturating_add(duration_us);
        self.stats.steps += 1;
        self.stats.busy_us += duration_us;
        if planned.decode_seqs > 0 {
            self.note_decode_step(duration_us);
        } else {
            // Nothing decodes (decodes go first in every step): the next
            // decode starts a new mean, not the last busy period's.
            self.recent_itl_us = None;
        }
        let mut outputs = Vec::with_capacity(self.outputs.len());
        outputs.append(&mut self.outputs);
        Some(Step {
            start_us,
            duration_us,
            outputs,
            prefill_tokens: planned.prefill_tokens,
            decode_seqs: planned.decode_seqs,
            pulls,
        })
    }

    fn note_decode_step(&mut self, duration_us: u64) {
        let d = duration_us as f64;
        self.recent_itl_us = Some(match self.recent_itl_us {
            None => d,
            Some(mean) => mean + RECENT_ITL_WEIGHT * (d - mean),
        });
    }

    fn sync_stats(&mut self) {
        let (c, h) = (&self.cache, &self.cache.host);
        self.stats.blocks_stored = c.stored_blocks;
        self.stats.blocks_evicted = c.evicted_blocks;
        self.stats.host_blocks_written = h.written_blocks;
        self.stats.host_blocks_evicted = h.evicted_blocks;
        self.stats.host_write_us = h.write_us;
        self.stats.host_read_us = h.read_us;
    }

    /// The KV events since the last call, in order (empty when nothing
    /// happened). Plain events: whoever publishes them numbers them (the
    /// worker agent's `KvCore`).
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.cache.take_events()
    }

    /// The prefix of a new request's prefill target cached now, in whole
    /// blocks short of the target (an engine computes at least one token).
    /// Hashes the blocks admission would hash anyway.
    fn expected_hit_tokens(&mut self, seq: &mut Seq) -> u32 {
        let bs = self.config.block_size;
        if seq.prefill_end == 0 || bs == 0 {
            return 0;
        }
        let cacheable = seq.hittable_prefill_blocks(bs) as usize;
        let (_, hits) = crate::scheduler::cached_prefix(
            &self.cache,
            &self.hasher,
            &mut self.scratch,
            seq,
            cacheable,
        );
        // A supplied prefix is no work here either.
        let supplied = if seq.awaits_pull() {
            seq.pull_tokens.min(cacheable as u32 * bs) / bs
        } else {
            0
        };
        (hits as u32).max(supplied) * bs
    }

    /// The worker's load now. `queued_prefill_tokens` counts the prompt
    /// tokens still to compute: a running request's rest, and a waiting
    /// one's prefill target less the prefix cached (or supplied by another
    /// worker: [`EngineRequest::pull_tokens`]) when it came (its hits
    /// are only settled at admission; counting its whole prompt made a
    /// worker holding many prefixes look busier than it is, and the
    /// router's ledger counts only what is not cached);
    /// `active_decode_blocks` sums the blocks of each decoding request (a
    /// prefix shared by several counts once per request, as each one's
    /// attention reads it); `kv_blocks_used` counts distinct blocks held by
    /// requests; `recent_itl_us` is a moving mean of the steps that
    /// decoded, 0 while nothing decodes.
    pub fn load_report(&self, now_us: u64) -> LoadReport {
        let mut running_prefill = 0u64;
        let mut decode_blocks = 0u64;
        for seq in &self.sched.running {
            if seq.is_prefilling() {
                running_prefill += u64::from(seq.remaining_prefill());
            } else {
                decode_blocks += seq.blocks.len() as u64;
            }
        }
        let counts = self.cache.counts();
        let loading: u64 = self
            .sched
            .loading
            .iter()
            .map(|l| u64::from(l.seq.remaining_prefill()))
            .chain(
                self.sched
                    .pulling
                    .iter()
                    .map(|s| u64::from(s.queued_prefill())),
            )
            .sum();
        LoadReport {
            worker: self.worker.clone(),
            running: self.sched.running.len() as u32,
            waiting: (self.sched.waiting.len()
                + self.sched.loading.len()
                + self.sched.pulling.len()) as u32,
            queued_prefill_tokens: self.sched.waiting_prefill_tokens + running_prefill + loading,
            active_decode_blocks: decode_blocks,
            kv_blocks_used: u64::from(counts.in_use),
            kv_blocks_total: u64::from(counts.total),
            at_ms: now_us / 1000,
            // `as` saturates.
            recent_itl_us: match self.recent_itl_us {
                Some(mean) if decode_blocks > 0 => mean.round() as u32,
                _ => 0,
            },
        }
    }

    /// Engine restart: every request is dropped (returned, running ones
    /// first, as submitted), the cache is emptied, and the next events
    /// start with [`KvEvent::Cleared`] (events not yet taken are lost, as
    /// they would be with a real engine). The stats keep counting.
    pub fn restart(&mut self) -> Vec<EngineRequest> {
        let dropped: Vec<EngineRequest> = self.sched.drain().map(|s| s.to_request()).collect();
        self.in_flight.clear();
        self.cache.clear();
        self.outputs.clear();
        self.pins.fill(0);
        self.generation += 1;
        self.reads = 0;
        self.recent_itl_us = None;
        dropped
    }

    /// How many leading tokens of `prompt` are cached here right now, in
    /// whole blocks (what a KV transfer to this worker need not move).
    pub fn cached_prefix_tokens(&self, prompt: &[u32]) -> u32 {
        let bs = self.hasher.block_size() as usize;
        let mut parent = None;
        let mut hits = 0u32;
        for block in prompt.chunks_exact(bs) {
            let hash = BlockHasher::chain(parent, self.hasher.content_hash(block));
            if !self.cache.contains(hash) {
                break;
            }
            hits += 1;
            parent = Some(hash);
        }
        hits.saturating_mul(self.hasher.block_size())
    }

    /// Every block hash currently cached (in use or evictable), in no
    /// particular order.
    pub fn cached_blocks(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.cache.cached_hashes()
    }

    /// Every block hash currently cached with its parent's (`None` for a
    /// chain's first block), in no particular order. The cache is
    /// prefix-closed: every parent is cached too. What a block-set listing
    /// for a resync is built from.
    pub fn cached_block_links(&self) -> impl Iterator<Item = (BlockHash, Option<BlockHash>)> + '_ {
        self.cache.cached_links()
    }

    /// Number of blocks currently cached under a hash.
    pub fn cached_block_count(&self) -> usize {
        self.cache.cached_len()
    }

    /// Free, evictable and in-use blocks (they add up to the capacity).
    pub fn block_counts(&self) -> BlockCounts {
        self.cache.counts()
    }

    /// No request running or waiting.
    pub fn is_idle(&self) -> bool {
        self.sched.is_idle()
    }

    /// Requests in the running batch.
    pub fn running(&self) -> usize {
        self.sched.running.len()
    }

    /// Requests waiting for admission (reading their prefix back from
    /// host, or waiting for a pulled one, included).
    pub fn waiting(&self) -> usize {
        self.sched.waiting.len() + self.sched.loading.len() + self.sched.pulling.len()
    }

    /// Every block hash in the host tier with its parent's, in no
    /// particular order (empty without a host tier). The union of these and
    /// [`Engine::cached_block_links`] is prefix-closed.
    pub fn host_block_links(&self) -> impl Iterator<Item = (BlockHash, Option<BlockHash>)> + '_ {
        self.cache.host.links()
    }

    /// Blocks in the host tier.
    pub fn host_block_count(&self) -> u32 {
        self.cache.host.len()
    }

    /// Counters since the engine was built.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The worker this engine models.
    pub fn worker(&self) -> &WorkerId {
        &self.worker
    }

    /// The worker's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// When the last step planned ends.
    pub fn busy_until_us(&self) -> u64 {
        self.busy_until_us
    }

    /// Checks the engine's internal consistency: block reference counts
    /// against the requests holding them (running, reading back from host,
    /// waiting for a pull), the free and LRU lists, the hash map, prefix closure of the
    /// device's blocks and of the device's and host's together, the host
    /// tier's LRU and capacity, and the per-request state.
    /// O(capacity + requests' blocks); meant for tests and debugging.
    pub fn check_invariants(&self) -> Result<(), String> {
        let bs = self.config.block_size;
        let mut holders = vec![0u32; self.config.kv_capacity_blocks as usize];
        for (holders, &pins) in holders.iter_mut().zip(&self.pins) {
            *holders += pins;
        }
        for seq in &self.sched.running {
            let want = seq.computed.div_ceil(bs) as usize;
            if seq.blocks.len() < want {
                return Err(format!(
                    "request {} holds {} blocks for {} tokens",
                    seq.id,
                    seq.blocks.len(),
                    seq.computed
                ));
            }
            if seq.committed != seq.computed / bs {
                return Err(format!("request {} has uncommitted full blocks", seq.id));
            }
            for (j, &b) in seq.blocks.iter().enumerate() {
                holders[b as usize] += 1;
                if (j as u32) < seq.committed && self.cache.lookup(seq.hashes[j]) != Some(b) {
                    return Err(format!(
                        "request {} block {j} is not its cached block",
                        seq.id
                    ));
                }
            }
        }
        // Requests set aside hold cached blocks only (reading back from
        // host), but for the blocks a pull is filling, stored when it is
        // done.
        let set_aside = (self.sched.loading.iter())
            .map(|l| ("loading", &l.seq, l.seq.blocks.len()))
            .chain((self.sched.pulling.iter()).map(|seq| ("pulling", seq, seq.committed as usize)));
        for (what, seq, stored) in set_aside {
            for (j, &b) in seq.blocks.iter().enumerate() {
                holders[b as usize] += 1;
                let cached = self.cache.lookup(seq.hashes[j]) == Some(b);
                if cached != (j < stored) {
                    return Err(format!(
                        "{what} request {} block {j} is {}its cached block",
                        seq.id,
                        if cached { "" } else { "not " }
                    ));
                }
            }
        }
        if !self
            .sched
            .loading
            .iter()
            .zip(self.sched.loading.iter().skip(1))
            .all(|(a, b)| a.ready_us <= b.ready_us)
        {
            return Err("read-backs are not in the order they end".into());
        }
        let mut waiting_prefill = 0u64;
        for seq in &self.sched.waiting {
            if !seq.blocks.is_empty() {
                return Err(format!("waiting request {} holds blocks", seq.id));
            }
            waiting_prefill += u64::from(seq.queued_prefill());
        }
        if waiting_prefill != self.sched.waiting_prefill_tokens {
            return Err("waiting prefill counter drifted".into());
        }
        if self.in_flight.len()
            != self.sched.running.len()
                + self.sched.waiting.len()
                + self.sched.loading.len()
                + self.sched.pulling.len()
        {
            return Err("in-flight set does not match the queues".into());
        }
        self.cache.check(&holders)?;
        // Prefix closure needs the parent of each cached block; the running
        // requests know it for the blocks they hold.
        for seq in &self.sched.running {
            for j in 1..seq.committed as usize {
                if !self.cache.contains(seq.hashes[j - 1]) {
                    return Err(format!("parent of a block of request {} is gone", seq.id));
                }
            }
        }
        Ok(())
    }
}
