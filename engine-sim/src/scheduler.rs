//! Continuous batching: admission, chunked prefill and preemption.
//!
//! Each step is planned in three passes over a token budget of
//! `max_batched_tokens`:
//! 1. every running decode gets its one token (decodes first, so that a
//!    long prefill never stalls the requests already producing tokens);
//! 2. running requests still prefilling get chunks, oldest first;
//! 3. waiting requests are admitted first come, first served while the
//!    budget, the running cap and the free KV blocks allow. The head of the
//!    queue blocks the others (no overtaking). A request is admitted with its
//!    cached prefix (whole blocks; at least one prompt token is always
//!    computed, since sampling needs its logits) and its first chunk.
//!
//! When a running request needs a block and none is free or evictable, the
//! most recently admitted running request is preempted (vLLM's recompute
//! policy): its blocks are released, it goes back to the front of the
//! waiting queue and later prefills again its prompt and the tokens it
//! already produced (hitting whatever of its blocks is still cached). No
//! request is admitted in a step that preempted.
//!
//! With a host tier, a waiting request whose prefix continues on host past
//! its device hit is set aside (`loading`) while those blocks are read back
//! into device blocks it holds; the others may be admitted meanwhile (as
//! vLLM does with requests waiting for remote KV). When the read ends it
//! releases them (they stay cached) and goes back to the front of the
//! queue, where admission finds them on the device.
//!
//! A request whose prompt starts with a prefix another worker supplies
//! ([`crate::EngineRequest::pull_tokens`], the third path) is set aside the
//! same way when it reaches the queue's head (`pulling`): it takes device
//! blocks for all of the part of that prefix not cached here (or waits for
//! room) and asks its caller to move them ([`Pull`]); when the caller
//! reports them moved they are stored in the prefix cache and the request
//! goes back to the queue's front, where admission hits them. Pulling at
//! admission, not at submission, keeps a prefix that waits behind a long
//! queue from being evicted before it is used (vLLM allocates the blocks of
//! a request's remote KV when it schedules it, caches them when they
//! arrived, then admits it).

use std::collections::{HashSet, VecDeque};

use protocol::{BlockHash, BlockHasher};

use crate::cost::StepWork;
use crate::engine::{EngineStats, StepOutput};
use crate::kv_cache::{KvCache, Mix};
use crate::request::{Mode, Seq};

/// One request's share of the planned step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Planned {
    /// Index in `running`.
    slot: usize,
    /// Tokens whose KV the step computes for it.
    new_tokens: u32,
    /// A prefill chunk (else a decode, which samples).
    prefill: bool,
    /// Tokens with KV before the step.
    present: u32,
    /// Budget tokens it took.
    budget: u32,
}

/// What the step does, for the cost model and the caller.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PlannedWork {
    pub(crate) work: StepWork,
    pub(crate) prefill_tokens: u32,
    pub(crate) decode_seqs: u32,
}

/// Everything a scheduling pass touches besides the queues.
pub(crate) struct Env<'a> {
    pub(crate) cache: &'a mut KvCache,
    pub(crate) hasher: &'a BlockHasher,
    pub(crate) scratch: &'a mut Vec<u32>,
    pub(crate) outputs: &'a mut Vec<StepOutput>,
    pub(crate) stats: &'a mut EngineStats,
    pub(crate) in_flight: &'a mut HashSet<u64, Mix>,
    pub(crate) max_batched_tokens: u32,
    pub(crate) max_running: u32,
    /// When the step being planned starts.
    pub(crate) now_us: u64,
}

impl Env<'_> {
    fn block_size(&self) -> u32 {
        self.hasher.block_size()
    }
}

/// The running batch and the waiting queue.
#[derive(Debug, Default)]
pub(crate) struct Scheduler {
    /// In admission order.
    pub(crate) running: Vec<Seq>,
    /// First come, first served; preempted requests go to the front.
    pub(crate) waiting: VecDeque<Seq>,
    /// Σ queued prefill tokens of the waiting requests
    /// ([`Seq::queued_prefill`]: their remaining prefill less the hits they
    /// expect).
    pub(crate) waiting_prefill_tokens: u64,
    /// Requests whose prefix is being read back from host, in the order
    /// their reads end: each holds the device blocks of its prefix.
    pub(crate) loading: VecDeque<Loading>,
    /// Requests waiting for the blocks of a prefix another worker supplies,
    /// in the order their pulls started: each holds those blocks.
    pub(crate) pulling: Vec<Seq>,
    /// Pulls started by the step being planned, for its caller.
    pub(crate) pulls: Vec<Pull>,
    plan: Vec<Planned>,
}

/// A prefix the caller is to move to this worker from the one that supplies
/// it ([`crate::Step::pulls`]); report it done with
/// [`crate::Engine::pull_done`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pull {
    /// The request.
    pub id: u64,
    /// Tokens whose KV to move (whole blocks after the prefix cached here).
    pub tokens: u32,
}

/// A request waiting for its prefix's read-back from host.
#[derive(Debug)]
pub(crate) struct Loading {
    pub(crate) seq: Seq,
    /// When the read ends.
    pub(crate) ready_us: u64,
}

/// Blocks needed to hold `tokens` tokens.
fn blocks_for(tokens: u32, block_size: u32) -> usize {
    tokens.div_ceil(block_size) as usize
}

/// Length of the longest prefix of `hashes` whose blocks satisfy `pred`,
/// for a predicate that, along a chain, holds for a block whenever it holds
/// for one of its descendants (so a binary search suffices).
fn leading_blocks(hashes: &[BlockHash], pred: impl Fn(BlockHash) -> bool) -> usize {
    let (mut lo, mut hi) = (0, hashes.len());
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if pred(hashes[mid - 1]) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Number of leading `hashes` cached. The cache is prefix-closed (a cached
/// block's parent is cached), so a binary search suffices.
fn cached_prefix_blocks(cache: &KvCache, hashes: &[BlockHash]) -> usize {
    leading_blocks(hashes, |h| cache.contains(h))
}

/// Hashes `seq`'s first `blocks` blocks (as far as its known tokens go)
/// and counts the leading ones `cache` holds: (blocks hashed, blocks
/// cached).
pub(crate) fn cached_prefix(
    cache: &KvCache,
    hasher: &BlockHasher,
    scratch: &mut Vec<u32>,
    seq: &mut Seq,
    blocks: usize,
) -> (usize, usize) {
    seq.ensure_hashes(blocks, hasher, scratch);
    let hashed = blocks.min(seq.hashes.len());
    (hashed, cached_prefix_blocks(cache, &seq.hashes[..hashed]))
}

/// Number of leading `hashes` (all cached) held by running requests. A
/// request holding a block holds its ancestors, so this is a prefix too.
fn held_prefix_blocks(cache: &KvCache, hashes: &[BlockHash]) -> usize {
    leading_blocks(hashes, |h| {
        cache.lookup(h).is_some_and(|b| !cache.is_evictable(b))
    })
}

/// Registers the request's newly completed blocks in the prefix cache.
fn commit_blocks(seq: &mut Seq, env: &mut Env<'_>) {
    let full = seq.computed / env.block_size();
    if full <= seq.committed {
        return;
    }
    seq.ensure_hashes(full as usize, env.hasher, env.scratch);
    register_blocks(seq, env.cache, full as usize);
}

/// Registers the request's blocks from its committed ones up to `upto`
/// (their hashes known) in the prefix cache.
fn register_blocks(seq: &mut Seq, cache: &mut KvCache, upto: usize) {
    for j in seq.committed as usize..upto {
        let parent = j.checked_sub(1).map(|p| seq.hashes[p]);
        seq.blocks[j] = cache.register(seq.blocks[j], seq.hashes[j], parent);
    }
    seq.committed = upto as u32;
}

/// Holds the request's device hit: its first `hits` blocks, cached.
fn acquire_hits(seq: &mut Seq, cache: &mut KvCache, hits: usize) {
    for &h in &seq.hashes[..hits] {
        if let Some(b) = cache.lookup(h) {
            cache.acquire(b);
            seq.blocks.push(b);
        }
    }
}

/// Appends `n` new device blocks to the request's; the caller checked
/// that `n` are available.
fn allocate_blocks(seq: &mut Seq, cache: &mut KvCache, n: usize) {
    for _ in 0..n {
        match cache.allocate() {
            Some(b) => seq.blocks.push(b),
            None => debug_assert!(false, "available blocks vanished"),
        }
    }
}

/// Blocks that can be allocated beside a device hit (the first `hits` of
/// `hashes`, cached) without evicting it.
fn room_beside_hit(cache: &KvCache, hashes: &[BlockHash], hits: usize) -> usize {
    let evictable = hits - held_prefix_blocks(cache, &hashes[..hits]);
    (cache.available() as usize).saturating_sub(evictable)
}

/// Releases every block, tail first (so the tail is evicted first).
fn release_blocks(seq: &mut Seq, cache: &mut KvCache) {
    for &b in seq.blocks.iter().rev() {
        cache.release(b);
    }
    seq.blocks.clear();
    seq.committed = 0;
}

impl Scheduler {
    /// Whether no request is running or waiting.
    pub(crate) fn is_idle(&self) -> bool {
        self.running.is_empty()
            && self.waiting.is_empty()
            && self.loading.is_empty()
            && self.pulling.is_empty()
    }

    /// When the first read-back in progress ends.
    pub(crate) fn next_ready_us(&self) -> Option<u64> {
        self.loading.front().map(|l| l.ready_us)
    }

    /// Requests whose read-back has ended by `now_us` release their blocks
    /// (cached, so admission hits them) and go back to the queue's front,
    /// in the order they were set aside.
    fn finish_loads(&mut self, env: &mut Env<'_>) {
        let mut k = self
            .loading
            .iter()
            .take_while(|l| l.ready_us <= env.now_us)
            .count();
        while k > 0 {
            k -= 1;
            let Some(mut l) = self.loading.remove(k) else {
                break;
            };
            release_blocks(&mut l.seq, env.cache);
            self.waiting_prefill_tokens += u64::from(l.seq.queued_prefill());
            self.waiting.push_front(l.seq);
        }
    }

    /// Sets the queue's head aside to read back the blocks of its prompt
    /// that continue its device hit (`hits` blocks of `hashes`) on host,
    /// when there are any and the device has blocks for them. Returns
    /// whether it did.
    fn start_load(&mut self, env: &mut Env<'_>, hashes_len: usize, hits: usize) -> bool {
        let Some(seq) = self.waiting.front() else {
            return false;
        };
        let on_host = seq.hashes[hits..hashes_len]
            .iter()
            .take_while(|&&h| env.cache.host.contains(h))
            .count();
        if on_host == 0 {
            return false;
        }
        // Read blocks are new device blocks; the device hit must stay.
        let n = on_host.min(room_beside_hit(env.cache, &seq.hashes, hits));
        if n == 0 {
            return false;
        }
        let Some(mut seq) = self.waiting.pop_front() else {
            return false;
        };
        self.waiting_prefill_tokens -= u64::from(seq.queued_prefill());
        acquire_hits(&mut seq, env.cache, hits);
        // Used before the allocations' evictions can push them out.
        let read: Vec<BlockHash> = seq.hashes[hits..hits + n].to_vec();
        for &h in read.iter().rev() {
            env.cache.host.touch(h);
        }
        let mut got = 0;
        for (j, &h) in read.iter().enumerate() {
            if !env.cache.host.contains(h) {
                break;
            }
            let Some(b) = env.cache.allocate() else {
                break;
            };
            let parent = (hits + j).checked_sub(1).map(|p| seq.hashes[p]);
            seq.blocks.push(env.cache.register(b, h, parent));
            got += 1;
        }
        let ready_us = env.cache.host.read(&read[..got], env.now_us);
        env.stats.host_read_tokens += u64::from(got as u32 * env.block_size());
        let at = self.loading.partition_point(|l| l.ready_us <= ready_us);
        self.loading.insert(at, Loading { seq, ready_us });
        true
    }

    /// Sets the queue's head aside to pull the blocks of its supplied prefix
    /// ([`Seq::pull_tokens`]) that continue its device hit (`hits` blocks of
    /// its first `hashes_len`). Returns `None` when there is nothing to pull
    /// (admit it as usual), `Some(false)` when the device lacks the blocks
    /// for the whole pull (the head waits: vLLM allocates them all or none),
    /// `Some(true)` when the pull started. The pulled blocks are allocated
    /// now and stored in the prefix cache when the KV arrived
    /// ([`Scheduler::pull_done`]): until then no other request hits them.
    fn start_pull(&mut self, env: &mut Env<'_>, hashes_len: usize, hits: usize) -> Option<bool> {
        let seq = self.waiting.front_mut()?;
        let bs = env.block_size();
        let supplied = (seq.pull_tokens / bs) as usize;
        let lacking = supplied.min(hashes_len).saturating_sub(hits);
        if lacking == 0 {
            seq.pulled = true;
            return None;
        }
        // Pulled blocks are new device blocks; the device hit must stay.
        if room_beside_hit(env.cache, &seq.hashes, hits) < lacking {
            return Some(false);
        }
        let mut seq = self.waiting.pop_front()?;
        self.waiting_prefill_tokens -= u64::from(seq.queued_prefill());
        seq.pulled = true;
        acquire_hits(&mut seq, env.cache, hits);
        seq.committed = seq.blocks.len() as u32;
        allocate_blocks(&mut seq, env.cache, lacking);
        let tokens = (seq.blocks.len() as u32 - seq.committed) * bs;
        env.stats.pulled_prefix_tokens += u64::from(tokens);
        self.pulls.push(Pull { id: seq.id, tokens });
        self.pulling.push(seq);
        Some(true)
    }

    /// The pull of request `id` is done: its blocks are stored in the prefix
    /// cache (their `Stored` events now) and released, and it goes back to
    /// the queue's front, where its admission hits them (holding them on
    /// would let two pulled requests at the front each wait for the other's
    /// blocks). Returns whether it was pulling.
    pub(crate) fn pull_done(&mut self, id: u64, cache: &mut KvCache) -> bool {
        let Some(k) = self.pulling.iter().position(|s| s.id == id) else {
            return false;
        };
        let mut seq = self.pulling.remove(k);
        let pulled = seq.blocks.len();
        register_blocks(&mut seq, cache, pulled);
        release_blocks(&mut seq, cache);
        self.waiting_prefill_tokens += u64::from(seq.queued_prefill());
        self.waiting.push_front(seq);
        true
    }

    /// The pull of request `id` was declined: the blocks allocated for it
    /// are released unstored (its device hit stays cached) and it goes
    /// back to the queue's front, pulled (it computes the rest). Returns
    /// whether it was pulling.
    pub(crate) fn pull_declined(&mut self, id: u64, cache: &mut KvCache, block_size: u32) -> bool {
        let Some(k) = self.pulling.iter().position(|s| s.id == id) else {
            return false;
        };
        let mut seq = self.pulling.remove(k);
        // Only its device hit is left to find at admission.
        seq.expected_hit_tokens = seq.expected_hit_tokens.min(seq.committed * block_size);
        release_blocks(&mut seq, cache);
        self.waiting_prefill_tokens += u64::from(seq.queued_prefill());
        self.waiting.push_front(seq);
        true
    }

    /// Queues a new request.
    pub(crate) fn enqueue(&mut self, seq: Seq) {
        self.waiting_prefill_tokens += u64::from(seq.queued_prefill());
        self.waiting.push_back(seq);
    }

    /// Plans the next step: allocates its blocks, preempts and admits.
    pub(crate) fn plan_step(&mut self, env: &mut Env<'_>) -> PlannedWork {
        self.plan.clear();
        self.finish_loads(env);
        let mut budget = env.max_batched_tokens;
        let mut preempted = false;

        // 1. Decodes.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            if seq.is_prefilling() {
                i += 1;
                continue;
            }
            let new_tokens = seq.known() - seq.computed;
            let present = seq.computed;
            if !self.reserve(i, new_tokens, env, &mut budget, &mut preempted) {
                break;
            }
            self.plan.push(Planned {
                slot: i,
                new_tokens,
                prefill: false,
                present,
                budget: 1,
            });
            budget -= 1;
            i += 1;
        }

        // 2. Chunks of running prefills.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            if !seq.is_prefilling() {
                i += 1;
                continue;
            }
            let n = seq.remaining_prefill().min(budget);
            let present = seq.computed;
            if !self.reserve(i, n, env, &mut budget, &mut preempted) {
                break;
            }
            self.plan.push(Planned {
                slot: i,
                new_tokens: n,
                prefill: true,
                present,
                budget: n,
            });
            budget -= n;
            i += 1;
        }

        // 3. Admission.
        if !preempted || self.plan.is_empty() {
            self.admit(env, &mut budget);
        }

        let mut planned = PlannedWork::default();
        for p in &self.plan {
            if p.prefill {
                planned.work.add_prefill_chunk(p.new_tokens, p.present);
                planned.prefill_tokens += p.new_tokens;
            } else {
                planned.work.add_decode(p.present + p.new_tokens);
                planned.decode_seqs += 1;
            }
        }
        planned
    }

    /// Gives `running[i]` the blocks for `new_tokens` more tokens,
    /// preempting from the back of the batch as needed. False when `i`
    /// itself had to be preempted.
    fn reserve(
        &mut self,
        i: usize,
        new_tokens: u32,
        env: &mut Env<'_>,
        budget: &mut u32,
        preempted: &mut bool,
    ) -> bool {
        let bs = env.block_size();
        loop {
            let seq = &self.running[i];
            let need = blocks_for(seq.computed + new_tokens, bs).saturating_sub(seq.blocks.len());
            if need <= env.cache.available() as usize {
                let seq = &mut self.running[i];
                allocate_blocks(seq, env.cache, need);
                return true;
            }
            let victim = self.running.len() - 1;
            self.preempt_last(env, budget);
            *preempted = true;
            if victim == i {
                return false;
            }
        }
    }

    /// Preempts the most recently admitted running request.
    fn preempt_last(&mut self, env: &mut Env<'_>, budget: &mut u32) {
        let Some(mut seq) = self.running.pop() else {
            return;
        };
        let slot = self.running.len();
        if let Some(pos) = self.plan.iter().rposition(|p| p.slot == slot) {
            *budget += self.plan.remove(pos).budget;
        }
        let bs = env.block_size();
        let kept_tokens = seq.committed * bs;
        release_blocks(&mut seq, env.cache);
        seq.computed = 0;
        seq.prefill_end = seq.known();
        seq.expected_hit_tokens = kept_tokens.min(seq.hittable_prefill_blocks(bs) * bs);
        env.outputs.push(StepOutput::Preempted { id: seq.id });
        env.stats.preemptions += 1;
        self.waiting_prefill_tokens += u64::from(seq.queued_prefill());
        self.waiting.push_front(seq);
    }

    /// Admits waiting requests in order while they fit.
    fn admit(&mut self, env: &mut Env<'_>, budget: &mut u32) {
        let bs = env.block_size();
        while *budget > 0 && (self.running.len() as u64) < u64::from(env.max_running) {
            let Some(seq) = self.waiting.front_mut() else {
                break;
            };
            let transfer = seq.awaits_transfer();
            // Blocks that may come from the prefix cache.
            let cacheable = if transfer {
                seq.prompt_len / bs
            } else {
                seq.hittable_prefill_blocks(bs)
            } as usize;
            let (hashes_len, hits) =
                cached_prefix(env.cache, env.hasher, env.scratch, seq, cacheable);
            if !transfer && seq.awaits_pull() {
                match self.start_pull(env, hashes_len, hits) {
                    Some(true) => continue,
                    Some(false) => break,
                    None => {}
                }
            }
            if !transfer && env.cache.host.enabled() && self.start_load(env, hashes_len, hits) {
                continue;
            }
            let Some(seq) = self.waiting.front() else {
                break;
            };
            let hashes = &seq.hashes[..hashes_len];
            let hit_tokens = hits as u32 * bs;
            let (new_tokens, held_tokens) = if transfer {
                (0, seq.prompt_len)
            } else {
                let n = (seq.prefill_end - hit_tokens).min(*budget);
                (n, hit_tokens + n)
            };
            let need = blocks_for(held_tokens, bs) - hits;
            let available = env.cache.available() as usize;
            if need > available {
                break;
            }
            if need + hits > available {
                // Hits sitting in the evictable pool stop being available.
                let evictable = hits - held_prefix_blocks(env.cache, &hashes[..hits]);
                if need + evictable > available {
                    break;
                }
            }

            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            self.waiting_prefill_tokens -= u64::from(seq.queued_prefill());
            debug_assert!(seq.blocks.is_empty());
            seq.blocks.reserve(blocks_for(held_tokens, bs));
            acquire_hits(&mut seq, env.cache, hits);
            allocate_blocks(&mut seq, env.cache, need);
            seq.computed = hit_tokens;
            seq.committed = hits as u32;
            seq.cached_tokens.get_or_insert(hit_tokens);
            env.stats.cached_prompt_tokens += u64::from(hit_tokens);

            let slot = self.running.len();
            if transfer {
                // The transferred KV is present: store it, then sample.
                env.stats.kv_received_tokens += u64::from(seq.prompt_len - hit_tokens);
                seq.computed = seq.prompt_len;
                commit_blocks(&mut seq, env);
                self.plan.push(Planned {
                    slot,
                    new_tokens: 0,
                    prefill: false,
                    present: seq.prompt_len,
                    budget: 1,
                });
                *budget -= 1;
            } else {
                self.plan.push(Planned {
                    slot,
                    new_tokens,
                    prefill: true,
                    present: hit_tokens,
                    budget: new_tokens,
                });
                *budget -= new_tokens;
            }
            self.running.push(seq);
        }
    }

    /// Applies the planned step's results: KV computed, blocks stored,
    /// tokens sampled, requests finished.
    pub(crate) fn apply_step(&mut self, env: &mut Env<'_>) {
        let mut any_done = false;
        for k in 0..self.plan.len() {
            let p = self.plan[k];
            let Some(seq) = self.running.get_mut(p.slot) else {
                debug_assert!(false, "planned slot out of range");
                continue;
            };
            seq.computed += p.new_tokens;
            if p.prefill {
                env.stats.prefill_tokens += u64::from(p.new_tokens);
            }
            commit_blocks(seq, env);
            if seq.is_prefilling() {
                continue;
            }
            let cached_tokens = seq.cached_tokens.unwrap_or(0);
            if seq.mode == Mode::PrefillOnly {
                env.outputs.push(StepOutput::PrefillDone {
                    id: seq.id,
                    prompt_tokens: seq.prompt_len,
                    cached_tokens,
                });
                env.stats.prefills_done += 1;
                seq.done = true;
            } else {
                env.outputs.push(if seq.generated == 0 {
                    StepOutput::FirstToken {
                        id: seq.id,
                        cached_tokens,
                    }
                } else {
                    StepOutput::Token { id: seq.id }
                });
                seq.generated += 1;
                env.stats.output_tokens += 1;
                if seq.generated >= seq.output_len {
                    env.outputs.push(StepOutput::Finished {
                        id: seq.id,
                        output_tokens: seq.output_len,
                        cached_tokens,
                    });
                    env.stats.finished += 1;
                    seq.done = true;
                }
            }
            if seq.done {
                release_blocks(seq, env.cache);
                env.in_flight.remove(&seq.id);
                any_done = true;
            }
        }
        self.plan.clear();
        if any_done {
            self.running.retain(|s| !s.done);
        }
    }

    /// Removes request `id`, running or waiting, and releases its blocks
    /// (the full ones stay cached, as after a preemption). Call between
    /// steps. Returns whether it was there.
    pub(crate) fn abort(&mut self, id: u64, cache: &mut KvCache) -> bool {
        debug_assert!(self.plan.is_empty(), "abort between steps only");
        let mut seq = if let Some(k) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(k)
        } else if let Some(k) = self.waiting.iter().position(|s| s.id == id) {
            let seq = self.waiting.remove(k).expect("position is in range");
            self.waiting_prefill_tokens = self
                .waiting_prefill_tokens
                .saturating_sub(u64::from(seq.queued_prefill()));
            seq
        } else if let Some(k) = self.loading.iter().position(|l| l.seq.id == id) {
            self.loading.remove(k).expect("position is in range").seq
        } else if let Some(k) = self.pulling.iter().position(|s| s.id == id) {
            self.pulling.remove(k)
        } else {
            return false;
        };
        release_blocks(&mut seq, cache);
        true
    }

    /// Drops every request (engine restart), in running then waiting order.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = Seq> + '_ {
        self.plan.clear();
        self.waiting_prefill_tokens = 0;
        self.pulls.clear();
        let loading: Vec<Seq> = self.loading.drain(..).map(|l| l.seq).collect();
        self.running
            .drain(..)
            .chain(self.waiting.drain(..))
            .chain(loading)
            .chain(self.pulling.drain(..))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_search_finds_the_cached_prefix() {
        let mut cache = KvCache::new(8);
        let hashes: Vec<BlockHash> = (1..=6).map(BlockHash).collect();
        assert_eq!(cached_prefix_blocks(&cache, &hashes), 0);
        for (j, &h) in hashes.iter().take(4).enumerate() {
            let b = cache.allocate().unwrap();
            cache.register(b, h, j.checked_sub(1).map(|p| hashes[p]));
        }
        assert_eq!(cached_prefix_blocks(&cache, &hashes), 4);
        assert_eq!(cached_prefix_blocks(&cache, &hashes[..2]), 2);
        assert_eq!(cached_prefix_blocks(&cache, &[]), 0);
    }

    #[test]
    fn binary_search_finds_the_held_prefix() {
        let mut cache = KvCache::new(8);
        let hashes: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
        let ids: Vec<_> = hashes
            .iter()
            .enumerate()
            .map(|(j, &h)| {
                let b = cache.allocate().unwrap();
                cache.register(b, h, j.checked_sub(1).map(|p| hashes[p]))
            })
            .collect();
        assert_eq!(held_prefix_blocks(&cache, &hashes), 4);
        // Released tail first; another holder keeps the first two.
        for &b in ids.iter().rev() {
            cache.release(b);
        }
        cache.acquire(ids[0]);
        cache.acquire(ids[1]);
        assert_eq!(held_prefix_blocks(&cache, &hashes), 2);
        assert_eq!(cached_prefix_blocks(&cache, &hashes), 4);
    }

    #[test]
    fn blocks_for_rounds_up() {
        assert_eq!(blocks_for(0, 16), 0);
        assert_eq!(blocks_for(1, 16), 1);
        assert_eq!(blocks_for(16, 16), 1);
        assert_eq!(blocks_for(17, 16), 2);
    }
}
