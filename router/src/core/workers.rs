//! The router's view of the workers: registrations, latest load reports and
//! the in-flight ledger.
//!
//! # The ledger
//!
//! Load reports arrive every 100 ms or so; a router may route hundreds of
//! requests in between. Without a record of its own (and its peers')
//! decisions, every one of them would see the same stale report and pile
//! onto the same worker. The ledger charges each routed request, keyed by
//! its [`DecisionId`]:
//!
//! * its *prefill tokens* to the worker that prefills it (the prefill worker
//!   on the remote path, the decode worker on the bypass path), released by
//!   [`Workers::on_prefill_done`];
//! * its *decode blocks* (and one running request) to the decode worker,
//!   released by [`Workers::on_finished`];
//! * on [`protocol::Path::RemoteFetch`], the *pinned blocks* of the prefix
//!   the prefill worker pulls, to the worker that supplies them (they cannot
//!   be evicted or freed while read: vLLM's bidirectional NIXL transfer
//!   holds them), released with the prefill tokens by
//!   [`Workers::on_prefill_done`] (the pull ends before the prefill does).
//!
//! Entries are added for this replica's decisions and for its peers'
//! ([`Workers::on_decision`], idempotent by id), and expire after a TTL
//! ([`Workers::expire`]) so that lost completions cannot leak load.
//! A finished id leaves a short-lived *tombstone* so
//! that a late duplicate of its decision (a peer's broadcast arriving after
//! the completion, or this replica's own decision echoed back) does not
//! charge it again.
//!
//! # Effective load
//!
//! See [`EffectiveLoad`] for how reports and the ledger are combined.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use protocol::{
    ContractMismatch, DecisionId, HashingContract, LoadReport, RouteDecision, WorkerId,
    WorkerRecord,
};
use serde::{Deserialize, Serialize};

/// Timing of the in-flight ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LedgerConfig {
    /// An entry whose completion never arrives is dropped this long after
    /// its decision (ms). Must exceed the longest request (prefill plus a
    /// long decode); a lost completion overstates load for at most this
    /// long. Default 600 000 (10 minutes).
    #[serde(rename = "ttl", with = "settings::duration_ms")]
    pub ttl_ms: u64,
    /// How long a finished id is remembered so that a late duplicate of its
    /// decision is ignored (ms). Counted from the first [`Workers::expire`]
    /// after the finish. Default 60 000.
    #[serde(rename = "tombstone_ttl", with = "settings::duration_ms")]
    pub tombstone_ttl_ms: u64,
    /// A load report received at `t` is assumed to include the requests
    /// decided before `t - report_grace_ms` (dispatch and report transit
    /// delays). Later decisions are added on top of the report. Default 50.
    #[serde(rename = "report_grace", with = "settings::duration_ms")]
    pub report_grace_ms: u64,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            ttl_ms: 600_000,
            tombstone_ttl_ms: 60_000,
            report_grace_ms: 50,
        }
    }
}

/// Load charged by in-flight decisions to one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charges {
    /// Prompt tokens still to prefill on this worker.
    pub prefill_tokens: u64,
    /// KV blocks of requests decoding on this worker, each request's
    /// whole context (what their decode steps read).
    pub decode_blocks: u64,
    /// KV blocks these requests add to the worker's cache beyond the prefix
    /// it held for them when they were decided: a lower bound of the memory
    /// they take (or will, a remote prefill's once its KV lands), since a
    /// prefix shared by several of them is not counted again.
    pub cache_blocks: u64,
    /// Requests decoding on this worker.
    pub requests: u32,
    /// KV blocks pinned here while a prefill worker pulls them
    /// ([`protocol::Path::RemoteFetch`]).
    pub pinned_blocks: u64,
}

impl Charges {
    fn add_prefill(&mut self, tokens: u64) {
        self.prefill_tokens = self.prefill_tokens.saturating_add(tokens);
    }

    fn sub_prefill(&mut self, tokens: u64) {
        self.prefill_tokens = self.prefill_tokens.saturating_sub(tokens);
    }

    /// One request decoding here.
    fn add_decode(&mut self, live: &Live) {
        self.decode_blocks = self.decode_blocks.saturating_add(live.decode_blocks);
        self.cache_blocks = self.cache_blocks.saturating_add(live.cache_blocks);
        self.requests = self.requests.saturating_add(1);
    }

    fn sub_decode(&mut self, live: &Live) {
        self.decode_blocks = self.decode_blocks.saturating_sub(live.decode_blocks);
        self.cache_blocks = self.cache_blocks.saturating_sub(live.cache_blocks);
        self.requests = self.requests.saturating_sub(1);
    }

    /// The request's pin (if it still holds one) released here.
    fn sub_pin(&mut self, live: &Live) {
        if let Some((_, blocks)) = live.pin {
            self.pinned_blocks = self.pinned_blocks.saturating_sub(blocks);
        }
    }
}

/// A worker's load as the router should assume it now.
///
/// Each figure is `max(report + unreported, ledger)`:
///
/// * `report` is the worker's last [`LoadReport`]. It includes every
///   request the engine has admitted, including ones routed by peers and
///   ones from before this router started, but not the requests routed
///   since it was taken.
/// * `unreported` is the ledger entries decided after that report (minus
///   [`LedgerConfig::report_grace_ms`]): what the report cannot have seen.
/// * `ledger` is every in-flight entry charged to the worker.
///
/// Both sides are lower bounds of the true load, so the larger is the better
/// estimate. Adding the whole ledger to the report instead would count every
/// admitted request twice (once reported, once in the ledger) until it
/// finishes; taking the report alone would let every decision between two
/// reports land on the same worker. Taking the maximum never double counts,
/// and `report + unreported` makes each new decision raise the estimate
/// even when the report is larger than the ledger (a restarted router, or
/// load the ledger never saw), which is what keeps concurrent bypasses from
/// overcommitting a worker (see the decode gate).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EffectiveLoad {
    /// Prompt tokens admitted or routed whose prefill has not run yet.
    pub queued_prefill_tokens: u64,
    /// KV blocks of running (or routed) decodes, each request's whole
    /// context, remote prefills still on their prefill worker included:
    /// the decode load selection spreads and the steps read.
    pub active_decode_blocks: u64,
    /// KV blocks in use: the reported ones plus those routed requests add
    /// to the cache ([`Charges::cache_blocks`]), what the decode gate and
    /// the busy checks compare with the capacity. A request's prefix the
    /// worker holds is not counted again: summing whole contexts counted a
    /// system prompt once per request (and a long prefill queue of such
    /// requests as decode memory), and the gate then vetoed bypasses on
    /// decode workers whose cache was a quarter full, sending them to that
    /// queue.
    pub kv_blocks_used: u64,
    /// KV blocks in use as last reported, without the ledger (what a gate
    /// that reserves nothing would look at).
    pub reported_kv_blocks_used: u64,
    /// KV capacity in blocks: the registration's, else the report's, else 0
    /// (unknown).
    pub kv_capacity_blocks: u64,
    /// Requests running (or routed to decode here).
    pub running: u32,
    /// Requests waiting for admission, as last reported.
    pub waiting: u32,
    /// KV blocks the ledger has pinned here for prefill workers pulling a
    /// prefix (counted in `kv_blocks_used` too).
    pub pinned_blocks: u64,
    /// The inter-token latency its decodes saw lately, µs, as last
    /// reported ([`LoadReport::recent_itl_us`]; 0: unknown).
    pub recent_itl_us: u32,
}

impl EffectiveLoad {
    /// Share of the KV cache in use; 0 when the capacity is unknown.
    pub fn kv_usage(&self) -> f64 {
        if self.kv_capacity_blocks == 0 {
            0.0
        } else {
            self.kv_blocks_used as f64 / self.kv_capacity_blocks as f64
        }
    }
}

/// One worker known to the view: registered, or only referred to by
/// in-flight decisions.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) id: WorkerId,
    pub(crate) record: Option<WorkerRecord>,
    report: Option<LoadReport>,
    /// Router clock when `report` was received.
    report_rx_ms: u64,
    ledger: Charges,
    unreported: Charges,
    /// Entries that may still have unreported charges here (lazily pruned).
    unreported_ids: Vec<DecisionId>,
    /// Live ledger entries referring to this slot (once per side).
    refs: u32,
}

impl Slot {
    /// The legs the worker registered it can serve (none when it is not
    /// registered).
    pub(crate) fn capabilities(&self) -> protocol::Capabilities {
        self.record.as_ref().map_or(
            protocol::Capabilities {
                local_prefill: false,
                remote_decode: false,
                remote_prefill: false,
            },
            |r| r.capabilities,
        )
    }

    fn new(id: WorkerId) -> Self {
        Self {
            id,
            record: None,
            report: None,
            report_rx_ms: 0,
            ledger: Charges::default(),
            unreported: Charges::default(),
            unreported_ids: Vec::new(),
            refs: 0,
        }
    }

    /// See [`EffectiveLoad`].
    pub(crate) fn effective(&self) -> EffectiveLoad {
        let (queued, active, used, total, running, waiting, recent_itl) = match &self.report {
            Some(r) => (
                r.queued_prefill_tokens,
                r.active_decode_blocks,
                r.kv_blocks_used,
                r.kv_blocks_total,
                r.running,
                r.waiting,
                r.recent_itl_us,
            ),
            None => (0, 0, 0, 0, 0, 0, 0),
        };
        let u = &self.unreported;
        let l = &self.ledger;
        let capacity = match self.record.as_ref().map_or(0, |r| r.kv_capacity_blocks) {
            0 => total,
            c => c,
        };
        EffectiveLoad {
            queued_prefill_tokens: queued
                .saturating_add(u.prefill_tokens)
                .max(l.prefill_tokens),
            active_decode_blocks: active.saturating_add(u.decode_blocks).max(l.decode_blocks),
            kv_blocks_used: used
                .saturating_add(u.cache_blocks)
                .saturating_add(u.pinned_blocks)
                .max(l.cache_blocks.saturating_add(l.pinned_blocks)),
            reported_kv_blocks_used: used,
            kv_capacity_blocks: capacity,
            running: running.saturating_add(u.requests).max(l.requests),
            waiting,
            pinned_blocks: l.pinned_blocks,
            recent_itl_us: recent_itl,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Live {
    decode: u32,
    prefiller: u32,
    /// Prefill tokens still charged (0 once the prefill is done).
    prefill_tokens: u64,
    decode_blocks: u64,
    /// The worker supplying a fetched prefix and the blocks pinned there
    /// (`None` once released, or without a fetch).
    pin: Option<(u32, u64)>,
    /// The supplying worker, as long as the entry lives (its slot is
    /// referred to until then).
    pin_ref: Option<u32>,
    at_ms: u64,
    unreported_prefill: bool,
    unreported_decode: bool,
    /// The pin is not in its source's last report yet.
    unreported_pin: bool,
    /// See [`Charges::cache_blocks`].
    cache_blocks: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// `None`: a tombstone.
    live: Option<Live>,
    /// When the entry goes; `None` for a tombstone whose clock starts at the
    /// next [`Workers::expire`].
    deadline: Option<u64>,
}

/// A decision's charges, as the ledger takes them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Charge {
    pub(crate) decode: u32,
    pub(crate) prefiller: u32,
    pub(crate) prefill_tokens: u64,
    pub(crate) decode_blocks: u64,
    /// See [`Charges::cache_blocks`] ([`cache_blocks`]).
    pub(crate) cache_blocks: u64,
    /// The supplying worker of a fetched prefix and its blocks to pin.
    pub(crate) pin: Option<(u32, u64)>,
    pub(crate) at_ms: u64,
}

/// The KV blocks a decision's request adds to its decode worker's cache:
/// its reserved blocks less the whole blocks of the prefix the worker held
/// for it ([`Charges::cache_blocks`]). Read from the decision alone, so
/// that every replica charges a decision alike.
pub(crate) fn cache_blocks(decision: &RouteDecision, block_size: u32) -> u64 {
    let held = u64::from(decision.decode_overlap_tokens / block_size.max(1));
    decision.reserved_decode_blocks.saturating_sub(held)
}

/// Takes a request's pin (if it still holds one) off its source's ledger,
/// and off its unreported charges while no report has covered it.
fn release_pin(slots: &mut [Slot], live: &Live) {
    if let Some((source, _)) = live.pin {
        let s = &mut slots[source as usize];
        s.ledger.sub_pin(live);
        if live.unreported_pin {
            s.unreported.sub_pin(live);
        }
    }
}

/// Registered workers, their latest load reports and the in-flight ledger.
#[derive(Debug)]
pub struct Workers {
    contract: HashingContract,
    config: LedgerConfig,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    by_id: HashMap<WorkerId, u32>,
    /// Registered decode-capable workers (role decode or both), by id.
    decode: Vec<u32>,
    /// Registered prefill workers (role prefill), by id.
    prefill: Vec<u32>,
    entries: HashMap<DecisionId, Entry>,
    live: usize,
    deadlines: BinaryHeap<Reverse<(u64, DecisionId)>>,
    fresh_tombstones: Vec<DecisionId>,
}

impl Workers {
    /// An empty view that admits workers hashing as `contract` does.
    pub fn new(contract: HashingContract, config: LedgerConfig) -> Self {
        Self {
            contract,
            config,
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_id: HashMap::new(),
            decode: Vec::new(),
            prefill: Vec::new(),
            entries: HashMap::new(),
            live: 0,
            deadlines: BinaryHeap::new(),
            fresh_tombstones: Vec::new(),
        }
    }

    /// The hashing contract workers must meet.
    pub fn contract(&self) -> &HashingContract {
        &self.contract
    }

    /// The ledger's timing.
    pub fn ledger_config(&self) -> &LedgerConfig {
        &self.config
    }

    /// Adds (or updates) a worker after checking its hashing contract.
    ///
    /// A worker whose contract differs is refused and not added; if it was
    /// registered before (under a contract that matched), it is removed as
    /// by [`Workers::deregister`], since its blocks are now named otherwise.
    pub fn register(&mut self, record: WorkerRecord) -> Result<(), ContractMismatch> {
        if let Err(mismatch) = self.contract.check(&record.contract) {
            self.deregister(&record.id);
            return Err(mismatch);
        }
        let slot = self.intern(&record.id);
        self.slots[slot as usize].record = Some(record);
        self.rebuild_roles();
        Ok(())
    }

    /// Removes a worker (its lease expired): its record, its load report,
    /// and the in-flight entries that name it on either side (their
    /// requests died with it). Returns whether it was registered.
    pub fn deregister(&mut self, id: &WorkerId) -> bool {
        let Some(&slot) = self.by_id.get(id) else {
            return false;
        };
        let was = self.slots[slot as usize].record.take().is_some();
        self.slots[slot as usize].report = None;
        let doomed: Vec<DecisionId> = self
            .entries
            .iter()
            .filter_map(|(id, e)| {
                e.live
                    .filter(|l| l.decode == slot || l.prefiller == slot)
                    .map(|_| *id)
            })
            .collect();
        for id in doomed {
            if let Some(entry) = self.entries.remove(&id) {
                if let Some(live) = entry.live {
                    self.release(&live);
                }
            }
        }
        self.maybe_free(slot);
        self.rebuild_roles();
        was
    }

    /// Records a worker's load report, received at `now_ms` on the router's
    /// clock. Ignored (returns `false`) for an unregistered worker or a
    /// report older than the one held.
    pub fn on_load(&mut self, report: LoadReport, now_ms: u64) -> bool {
        let Some(&slot) = self.by_id.get(&report.worker) else {
            return false;
        };
        let s = &mut self.slots[slot as usize];
        if s.record.is_none() || s.report.as_ref().is_some_and(|r| r.at_ms > report.at_ms) {
            return false;
        }
        s.report = Some(report);
        s.report_rx_ms = now_ms;
        let grace = self.config.report_grace_ms;
        let mut ids = std::mem::take(&mut s.unreported_ids);
        ids.retain(|id| {
            let Some(live) = self.entries.get_mut(id).and_then(|e| e.live.as_mut()) else {
                return false;
            };
            let s = &mut self.slots[slot as usize];
            let mine_prefill = live.unreported_prefill && live.prefiller == slot;
            let mine_decode = live.unreported_decode && live.decode == slot;
            let mine_pin =
                live.unreported_pin && live.pin.is_some_and(|(source, _)| source == slot);
            if !mine_prefill && !mine_decode && !mine_pin {
                return false;
            }
            if live.at_ms.saturating_add(grace) > now_ms {
                return true; // too recent for this report to include
            }
            if mine_prefill {
                live.unreported_prefill = false;
                s.unreported.sub_prefill(live.prefill_tokens);
            }
            if mine_decode {
                live.unreported_decode = false;
                s.unreported.sub_decode(live);
            }
            if mine_pin {
                live.unreported_pin = false;
                s.unreported.sub_pin(live);
            }
            false
        });
        self.slots[slot as usize].unreported_ids = ids;
        true
    }

    /// Charges a decision (this replica's or a peer's) to its workers, once:
    /// returns `false` if the id is already in flight or recently finished.
    /// The entry expires [`LedgerConfig::ttl_ms`] after `decision.at_ms`.
    pub fn on_decision(&mut self, decision: &RouteDecision) -> bool {
        if self.entries.contains_key(&decision.id) {
            return false;
        }
        let decode = self.intern(&decision.decode);
        let prefiller = self.intern(decision.prefilling_worker());
        let pin = decision.fetch.as_ref().map(|f| {
            let blocks = f.pulled_blocks(self.contract.block_size);
            (self.intern(&f.source), blocks)
        });
        self.charge(
            decision.id,
            Charge {
                decode,
                prefiller,
                prefill_tokens: decision.reserved_prefill_tokens,
                decode_blocks: decision.reserved_decode_blocks,
                cache_blocks: cache_blocks(decision, self.contract.block_size),
                pin,
                at_ms: decision.at_ms,
            },
        )
    }

    /// The request's prefill ran: its prefill tokens leave the prefilling
    /// worker's charge, and a fetched prefix's pin its source's. Returns
    /// whether anything was released.
    pub fn on_prefill_done(&mut self, id: DecisionId) -> bool {
        let Some(live) = self.entries.get_mut(&id).and_then(|e| e.live.as_mut()) else {
            return false;
        };
        let unpinned = live.pin.is_some();
        release_pin(&mut self.slots, live);
        live.pin = None;
        live.unreported_pin = false;
        if live.prefill_tokens == 0 {
            return unpinned;
        }
        let tokens = std::mem::take(&mut live.prefill_tokens);
        let s = &mut self.slots[live.prefiller as usize];
        s.ledger.sub_prefill(tokens);
        if live.unreported_prefill {
            live.unreported_prefill = false;
            s.unreported.sub_prefill(tokens);
        }
        true
    }

    /// The request finished (or failed): all its charges are released and
    /// its id is remembered for a while so that a late copy of its decision
    /// is ignored. Returns whether an in-flight entry was released.
    pub fn on_finished(&mut self, id: DecisionId) -> bool {
        let tombstone = Entry {
            live: None,
            deadline: None,
        };
        let previous = self.entries.insert(id, tombstone);
        self.fresh_tombstones.push(id);
        match previous.and_then(|e| e.live) {
            Some(live) => {
                self.release(&live);
                true
            }
            None => false,
        }
    }

    /// A decision that will not run and that no peer saw (a dry run): its
    /// charges are released and, unlike [`Workers::on_finished`], it leaves
    /// no tombstone, since no late copy of it can come. Returns whether an
    /// in-flight entry was released.
    pub fn forget(&mut self, id: DecisionId) -> bool {
        let Some(live) = self.entries.get(&id).and_then(|e| e.live) else {
            return false; // unknown, or a tombstone (which stays)
        };
        self.entries.remove(&id);
        self.release(&live);
        true
    }

    /// Drops the entries whose TTL ran out by `now_ms` (and old tombstones).
    /// Returns how many in-flight entries expired.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        for id in std::mem::take(&mut self.fresh_tombstones) {
            if let Some(e) = self.entries.get_mut(&id) {
                if e.live.is_none() && e.deadline.is_none() {
                    let deadline = now_ms.saturating_add(self.config.tombstone_ttl_ms);
                    e.deadline = Some(deadline);
                    self.deadlines.push(Reverse((deadline, id)));
                }
            }
        }
        let mut expired = 0;
        while let Some(&Reverse((deadline, id))) = self.deadlines.peek() {
            if deadline > now_ms {
                break;
            }
            self.deadlines.pop();
            let current = self.entries.get(&id).and_then(|e| e.deadline);
            if current != Some(deadline) {
                continue; // stale: the entry finished or was replaced
            }
            if let Some(live) = self.entries.remove(&id).and_then(|e| e.live) {
                self.release(&live);
                expired += 1;
            }
        }
        // Entries that finished early leave stale deadlines behind; rebuild
        // the heap when they dominate it.
        if self.deadlines.len() > 2 * self.entries.len() + 1024 {
            self.deadlines = self
                .entries
                .iter()
                .filter_map(|(id, e)| e.deadline.map(|d| Reverse((d, *id))))
                .collect();
        }
        // Prune unreported lists of workers that do not report.
        for slot in 0..self.slots.len() {
            let mut ids = std::mem::take(&mut self.slots[slot].unreported_ids);
            let s = slot as u32;
            ids.retain(|id| {
                self.entries.get(id).and_then(|e| e.live).is_some_and(|l| {
                    (l.unreported_prefill && l.prefiller == s)
                        || (l.unreported_decode && l.decode == s)
                })
            });
            self.slots[slot].unreported_ids = ids;
        }
        expired
    }

    /// Whether the id is in flight or recently finished.
    pub fn knows_decision(&self, id: DecisionId) -> bool {
        self.entries.contains_key(&id)
    }

    /// Number of in-flight ledger entries.
    pub fn in_flight(&self) -> usize {
        self.live
    }

    /// Number of registered workers.
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|s| s.record.is_some()).count()
    }

    /// Whether no worker is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A registered worker's record.
    pub fn record(&self, id: &WorkerId) -> Option<&WorkerRecord> {
        self.slot_of(id).and_then(|s| s.record.as_ref())
    }

    /// Registered workers, in no particular order.
    pub fn records(&self) -> impl Iterator<Item = &WorkerRecord> {
        self.slots.iter().filter_map(|s| s.record.as_ref())
    }

    /// A worker's last load report.
    pub fn report(&self, id: &WorkerId) -> Option<&LoadReport> {
        self.slot_of(id).and_then(|s| s.report.as_ref())
    }

    /// A registered worker's effective load (see [`EffectiveLoad`]).
    pub fn effective_load(&self, id: &WorkerId) -> Option<EffectiveLoad> {
        self.slot_of(id)
            .filter(|s| s.record.is_some())
            .map(Slot::effective)
    }

    /// What the in-flight ledger charges a worker (registered or not).
    pub fn ledger_charges(&self, id: &WorkerId) -> Charges {
        self.slot_of(id).map_or_else(Charges::default, |s| s.ledger)
    }

    fn slot_of(&self, id: &WorkerId) -> Option<&Slot> {
        self.by_id.get(id).map(|&s| &self.slots[s as usize])
    }

    pub(crate) fn slot_index(&self, id: &WorkerId) -> Option<u32> {
        self.by_id.get(id).copied()
    }

    pub(crate) fn slot(&self, slot: u32) -> &Slot {
        &self.slots[slot as usize]
    }

    pub(crate) fn slot_count(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn decode_slots(&self) -> &[u32] {
        &self.decode
    }

    pub(crate) fn prefill_slots(&self) -> &[u32] {
        &self.prefill
    }

    /// Adds a ledger entry unless the id is known; see [`Workers::on_decision`].
    pub(crate) fn charge(&mut self, id: DecisionId, c: Charge) -> bool {
        if self.entries.contains_key(&id) {
            return false;
        }
        let deadline = c.at_ms.saturating_add(self.config.ttl_ms);
        // One request never holds more than the whole cache: a charge past
        // it would only repel every other request from the worker.
        let decode_blocks = match &self.slots[c.decode as usize].record {
            Some(r) => c.decode_blocks.min(r.kv_capacity_blocks),
            None => c.decode_blocks,
        };
        let c = Charge { decode_blocks, ..c };
        let mut live = Live {
            decode: c.decode,
            prefiller: c.prefiller,
            prefill_tokens: c.prefill_tokens,
            decode_blocks: c.decode_blocks,
            pin: c.pin,
            pin_ref: c.pin.map(|(source, _)| source),
            at_ms: c.at_ms,
            unreported_prefill: false,
            unreported_decode: false,
            unreported_pin: false,
            cache_blocks: c.cache_blocks.min(c.decode_blocks),
        };
        let grace = self.config.report_grace_ms;
        // Unseen by the side's last report (if any) when decided after it.
        let unseen =
            |s: &Slot| s.report.is_none() || c.at_ms.saturating_add(grace) > s.report_rx_ms;
        {
            let p = &mut self.slots[c.prefiller as usize];
            p.refs += 1;
            p.ledger.add_prefill(c.prefill_tokens);
            if c.prefill_tokens > 0 && unseen(p) {
                live.unreported_prefill = true;
                p.unreported.add_prefill(c.prefill_tokens);
                p.unreported_ids.push(id);
            }
        }
        {
            let d = &mut self.slots[c.decode as usize];
            d.refs += 1;
            d.ledger.add_decode(&live);
            if unseen(d) {
                live.unreported_decode = true;
                d.unreported.add_decode(&live);
                if c.decode != c.prefiller || !live.unreported_prefill {
                    d.unreported_ids.push(id);
                }
            }
        }
        if let Some((source, blocks)) = c.pin {
            let listed = (source == c.decode && live.unreported_decode)
                || (source == c.prefiller && live.unreported_prefill);
            let s = &mut self.slots[source as usize];
            s.refs += 1;
            s.ledger.pinned_blocks = s.ledger.pinned_blocks.saturating_add(blocks);
            // The source holds the pinned blocks from the decision on, so
            // its next report counts them: unreported until then, like the
            // other charges (adding the ledger's pins to every report
            // counted them twice for as long as the prefill waited).
            if blocks > 0 && unseen(s) {
                live.unreported_pin = true;
                s.unreported.pinned_blocks = s.unreported.pinned_blocks.saturating_add(blocks);
                if !listed {
                    s.unreported_ids.push(id);
                }
            }
        }
        self.entries.insert(
            id,
            Entry {
                live: Some(live),
                deadline: Some(deadline),
            },
        );
        self.deadlines.push(Reverse((deadline, id)));
        self.live += 1;
        true
    }

    fn release(&mut self, live: &Live) {
        self.live = self.live.saturating_sub(1);
        {
            let p = &mut self.slots[live.prefiller as usize];
            p.ledger.sub_prefill(live.prefill_tokens);
            if live.unreported_prefill {
                p.unreported.sub_prefill(live.prefill_tokens);
            }
            p.refs = p.refs.saturating_sub(1);
        }
        {
            let d = &mut self.slots[live.decode as usize];
            d.ledger.sub_decode(live);
            if live.unreported_decode {
                d.unreported.sub_decode(live);
            }
            d.refs = d.refs.saturating_sub(1);
        }
        release_pin(&mut self.slots, live);
        if let Some(source) = live.pin_ref {
            let s = &mut self.slots[source as usize];
            s.refs = s.refs.saturating_sub(1);
        }
        self.maybe_free(live.prefiller);
        self.maybe_free(live.decode);
        if let Some(source) = live.pin_ref {
            self.maybe_free(source);
        }
    }

    fn intern(&mut self, id: &WorkerId) -> u32 {
        if let Some(&slot) = self.by_id.get(id) {
            return slot;
        }
        let slot = match self.free_slots.pop() {
            Some(free) => {
                self.slots[free as usize] = Slot::new(id.clone());
                free
            }
            None => {
                self.slots.push(Slot::new(id.clone()));
                (self.slots.len() - 1) as u32
            }
        };
        self.by_id.insert(id.clone(), slot);
        slot
    }

    /// Forgets a slot nothing refers to any more.
    fn maybe_free(&mut self, slot: u32) {
        let s = &self.slots[slot as usize];
        if s.record.is_none() && s.refs == 0 && self.by_id.get(&s.id) == Some(&slot) {
            self.by_id.remove(&s.id);
            let s = &mut self.slots[slot as usize];
            s.report = None;
            s.ledger = Charges::default();
            s.unreported = Charges::default();
            s.unreported_ids = Vec::new();
            self.free_slots.push(slot);
        }
    }

    fn rebuild_roles(&mut self) {
        self.decode.clear();
        self.prefill.clear();
        for (i, s) in self.slots.iter().enumerate() {
            let Some(record) = &s.record else { continue };
            if !self.by_id.contains_key(&s.id) {
                continue;
            }
            if record.role.decodes() {
                self.decode.push(i as u32);
            }
            if record.role == protocol::Role::Prefill {
                self.prefill.push(i as u32);
            }
        }
        // By id, so that every replica (and a replay) sees candidates in
        // the same order whatever the registration order.
        let slots = &self.slots;
        self.decode
            .sort_by(|a, b| slots[*a as usize].id.cmp(&slots[*b as usize].id));
        self.prefill
            .sort_by(|a, b| slots[*a as usize].id.cmp(&slots[*b as usize].id));
    }
}
