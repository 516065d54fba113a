//! One publisher's batches put in order: sequence numbers, gaps, replays,
//! restarts and resynchronisation decisions, around the [`Translator`].
//! Pure: frames in, [`Action`]s out; the shell ([`super::engine`]) does
//! the ZMQ IO and the timing.
//!
//! - **Start**: PUB/SUB drops whatever is published before the
//!   subscription reaches the publisher, so the history is read from the
//!   replay socket first (from seq 0: the engine keeps its last 10,000
//!   batches); live batches wait meanwhile. A history that no longer
//!   starts at 0 is taken as it is (counted): blocks stored before it are
//!   unknown, their descendants' `BlockStored` events are counted as
//!   unknown parents.
//! - **Gap** (a live seq beyond the next expected): live batches wait, the
//!   missing range is asked of the replay socket; when the replay cannot
//!   cover it (evicted, timed out, no replay socket), the worker is
//!   resynchronised: [`Action::NewEpoch`] with the translator's block set
//!   (what is known), counted.
//! - **Restart**: a live seq at or below the last live seq means the
//!   engine restarted with an empty cache: the translator is reset and a
//!   new, empty epoch starts ([`EpochReason::Restart`]). A SUB connection
//!   that dropped and came back may hide a restart whose first batches
//!   were missed, so the next batch after a reconnection rebuilds from the
//!   engine's history.
//! - **Unknown parent**: a `BlockStored` whose parent is not known means
//!   the view is incomplete. The translator is rebuilt from the engine's
//!   whole history (a replay from 0); when the engine still holds it, a
//!   new epoch with the rebuilt block set replaces the old one
//!   ([`EpochReason::Rebuild`]); when it does not, the view stays as it is
//!   (counted). No rebuild storms: none again for the same batches, and
//!   none at all once a rebuild could not help (the history no longer
//!   starts at 0, or holds the orphans itself) until the engine restarts
//!   or the connection comes back.
//! - **Idle**: an engine that published its last batches before the
//!   subscription took effect (or whose PUB dropped them) and then went
//!   quiet shows no gap; when nothing comes for a while, the shell calls
//!   [`RankCore::on_idle`], which asks the replay socket for anything
//!   after the last batch seen (a cheap request: usually just the end
//!   marker).
//! - Malformed batches and events are counted and skipped.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use protocol::KvEvent;

use super::translate::{BlockSizeMismatch, Translator};
use super::wire::decode_batch;

/// What the shell must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Canonical events for the agent's current epoch.
    Events(Vec<KvEvent>),
    /// Start a new epoch from this block set (`Cleared`, then the set).
    NewEpoch {
        set: Vec<KvEvent>,
        reason: EpochReason,
    },
    /// Ask the replay socket for every batch from `from` on, and report
    /// them with [`RankCore::on_replay`], then [`RankCore::on_replay_end`]
    /// (or [`RankCore::on_replay_failed`]).
    Replay { from: u64 },
    /// The engine cannot serve this deployment; stop.
    Fatal(BlockSizeMismatch),
}

/// Why a new epoch starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpochReason {
    /// The engine restarted: its cache is empty.
    Restart,
    /// Batches were lost that no replay could cover.
    LostGap,
    /// The view was rebuilt from the engine's whole history.
    Rebuild,
}

impl EpochReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EpochReason::Restart => "engine_restart",
            EpochReason::LostGap => "lost_gap",
            EpochReason::Rebuild => "rebuild",
        }
    }
}

/// Counters since the start (the shell exports their increments).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Batches applied (decoded or not).
    pub batches: u64,
    pub malformed_batches: u64,
    /// Events skipped, by reason.
    pub skipped_events: BTreeMap<&'static str, u64>,
    pub unknown_parents: u64,
    pub unknown_removed: u64,
    pub token_mismatches: u64,
    pub unknown_media: u64,
    pub other_groups: u64,
    /// `BlockStored` events of another block size (partial tails), skipped.
    pub other_block_sizes: u64,
    /// Batches whose `data_parallel_rank` is not this publisher's.
    pub rank_mismatches: u64,
    /// Live batches already applied from a replay.
    pub duplicates: u64,
    pub gaps: u64,
    pub gaps_recovered: u64,
    pub gaps_unrecovered: u64,
    pub restarts: u64,
    pub replays: u64,
    pub replay_failures: u64,
    pub rebuilds: u64,
    pub rebuild_failures: u64,
    /// Histories that did not start at seq 0.
    pub partial_histories: u64,
    /// New epochs from the known block set after a lost gap.
    pub resyncs: u64,
    /// Idle checks of the replay socket for batches the SUB socket missed.
    pub tail_checks: u64,
    /// Batches only an idle check found (the last ones published before a
    /// subscription took effect, or dropped by the publisher).
    pub tail_recovered: u64,
}

impl Stats {
    /// The plain counters with their metric labels (`skipped_events` has
    /// its own, by reason).
    pub fn counters(&self) -> [(&'static str, u64); 22] {
        [
            ("batches", self.batches),
            ("malformed_batches", self.malformed_batches),
            ("unknown_parents", self.unknown_parents),
            ("unknown_removed", self.unknown_removed),
            ("token_mismatches", self.token_mismatches),
            ("unknown_media", self.unknown_media),
            ("other_groups", self.other_groups),
            ("other_block_sizes", self.other_block_sizes),
            ("rank_mismatches", self.rank_mismatches),
            ("duplicates", self.duplicates),
            ("gaps", self.gaps),
            ("gaps_recovered", self.gaps_recovered),
            ("gaps_unrecovered", self.gaps_unrecovered),
            ("restarts", self.restarts),
            ("replays", self.replays),
            ("replay_failures", self.replay_failures),
            ("rebuilds", self.rebuilds),
            ("rebuild_failures", self.rebuild_failures),
            ("partial_histories", self.partial_histories),
            ("resyncs", self.resyncs),
            ("tail_checks", self.tail_checks),
            ("tail_recovered", self.tail_recovered),
        ]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Start,
    Gap,
    /// An idle check: anything published after the last batch seen.
    Tail,
    Rebuild,
}

#[derive(Debug)]
struct Replaying {
    from: u64,
    purpose: Purpose,
    /// A rebuild's batches, applied once complete.
    received: Vec<(u64, Bytes)>,
    /// A gap replay skipped over missing batches.
    lost: bool,
    /// Batches applied from it.
    applied: u64,
    failed: bool,
}

#[derive(Debug)]
struct Pending {
    seq: u64,
    payload: Bytes,
    /// The engine restarted just before this batch.
    restart: bool,
}

/// One publisher's (one data-parallel rank's) event stream.
#[derive(Debug)]
pub struct RankCore {
    translator: Translator,
    dp_rank: u32,
    replay_available: bool,
    /// The next seq to apply; `None` before any history.
    next: Option<u64>,
    /// The highest live seq received.
    live_high: Option<u64>,
    replaying: Option<Replaying>,
    /// Live batches received during a replay, in arrival order.
    pending: VecDeque<Pending>,
    max_pending: usize,
    /// Unknown parents at or below this seq do not trigger a rebuild.
    rebuild_guard: Option<u64>,
    rebuild_due: bool,
    /// A rebuild cannot help (the engine's history no longer starts at 0,
    /// or has the unknown parents itself) until the engine restarts or the
    /// connection is re-established: no rebuild storms.
    rebuild_useless: bool,
    resync_due: bool,
    reconnected: bool,
    fatal: bool,
    stats: Stats,
}

impl RankCore {
    /// A core for the publisher of data-parallel rank `dp_rank`;
    /// `replay_available` when the engine has a replay socket. At most
    /// `max_pending` live batches wait during a replay (older ones are
    /// dropped, which the replay or a resync then covers).
    pub fn new(
        translator: Translator,
        dp_rank: u32,
        replay_available: bool,
        max_pending: usize,
    ) -> Self {
        Self {
            translator,
            dp_rank,
            replay_available,
            next: None,
            live_high: None,
            replaying: None,
            pending: VecDeque::new(),
            max_pending: max_pending.max(1),
            rebuild_guard: None,
            rebuild_due: false,
            rebuild_useless: false,
            resync_due: false,
            reconnected: false,
            fatal: false,
            stats: Stats::default(),
        }
    }

    /// The first actions: the history replay when there is a replay socket.
    pub fn start(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        if self.replay_available {
            self.begin_replay(0, Purpose::Start, &mut out);
        }
        out
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The seq the replay in progress started from.
    pub fn replaying_from(&self) -> Option<u64> {
        self.replaying.as_ref().map(|r| r.from)
    }

    /// The known block set (for a block-set request).
    pub fn block_set(&self) -> Vec<KvEvent> {
        self.translator.block_set()
    }

    pub fn translator(&self) -> &Translator {
        &self.translator
    }

    /// The SUB connection dropped and came back.
    pub fn on_reconnected(&mut self) {
        self.reconnected = true;
    }

    /// A live message.
    pub fn on_live(&mut self, seq: u64, payload: Bytes) -> Vec<Action> {
        let mut out = Vec::new();
        if self.fatal {
            return out;
        }
        let restart = self.live_high.is_some_and(|high| seq <= high);
        self.live_high = Some(seq);
        if self.reconnected && !restart {
            self.reconnected = false;
            if self.replay_available && self.next.is_some() {
                self.rebuild_due = true;
                self.rebuild_guard = None;
                self.rebuild_useless = false;
            }
        }
        self.reconnected = false;
        let p = Pending {
            seq,
            payload,
            restart,
        };
        if self.replaying.is_some() {
            if self.pending.len() >= self.max_pending {
                if let Some(dropped) = self.pending.pop_front() {
                    if let Some(front) = self.pending.front_mut() {
                        front.restart |= dropped.restart;
                    }
                }
            }
            self.pending.push_back(p);
        } else {
            self.ingest(p, false, &mut out);
        }
        self.finish(&mut out);
        out
    }

    /// One batch from the replay in progress.
    pub fn on_replay(&mut self, seq: u64, payload: Bytes) -> Vec<Action> {
        let mut out = Vec::new();
        if self.fatal {
            return out;
        }
        let Some(r) = self.replaying.as_mut() else {
            return out;
        };
        if r.purpose == Purpose::Rebuild {
            r.received.push((seq, payload));
            return out;
        }
        let from = r.from;
        match self.next {
            Some(n) if seq < n => {
                self.stats.duplicates += 1;
                return out;
            }
            Some(n) => {
                if seq > n {
                    r.lost = true;
                }
            }
            None => {
                if seq > from {
                    self.stats.partial_histories += 1;
                }
            }
        }
        r.applied += 1;
        self.apply(seq, &payload, &mut out);
        out
    }

    /// Nothing came on the SUB socket for a while: asks the replay socket
    /// for anything after the last batch seen. PUB/SUB drops what is
    /// published before a subscription reaches the publisher (or past its
    /// high-water mark), and an idle engine publishes nothing that would
    /// reveal the gap; this finds such trailing batches.
    pub fn on_idle(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        if self.fatal || !self.replay_available || self.replaying.is_some() {
            return out;
        }
        self.stats.tail_checks += 1;
        self.begin_replay(self.next.unwrap_or(0), Purpose::Tail, &mut out);
        out
    }

    /// The replay in progress ended (its end marker came).
    pub fn on_replay_end(&mut self) -> Vec<Action> {
        self.end_replay(false)
    }

    /// The replay in progress failed (timeout, connection, bad frames):
    /// what came of it stays applied.
    pub fn on_replay_failed(&mut self) -> Vec<Action> {
        self.stats.replay_failures += 1;
        self.end_replay(true)
    }

    fn end_replay(&mut self, failed: bool) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(mut r) = self.replaying.take() else {
            return out;
        };
        r.failed |= failed;
        if self.fatal {
            return out;
        }
        match r.purpose {
            Purpose::Rebuild => {
                let complete = !r.failed
                    && r.received.first().is_some_and(|(s, _)| *s == 0)
                    && r.received
                        .windows(2)
                        .all(|w| w[0].0.checked_add(1) == Some(w[1].0));
                let last = r.received.last().map(|(s, _)| *s);
                if complete {
                    self.translator.reset();
                    let orphans = self.stats.unknown_parents;
                    let mut scratch = Vec::new();
                    for (seq, payload) in &r.received {
                        self.apply(*seq, payload, &mut scratch);
                        if self.fatal {
                            out.extend(scratch);
                            return out;
                        }
                    }
                    // The history has the orphans itself: rebuilding again
                    // would find them again.
                    self.rebuild_useless = self.stats.unknown_parents > orphans;
                    self.stats.rebuilds += 1;
                    out.push(Action::NewEpoch {
                        set: self.translator.block_set(),
                        reason: EpochReason::Rebuild,
                    });
                } else {
                    self.stats.rebuild_failures += 1;
                    self.rebuild_useless = true;
                }
                self.rebuild_guard = self.rebuild_guard.max(last).max(self.live_high);
                // Applying the history may have asked for another rebuild.
                self.rebuild_due = false;
            }
            Purpose::Start => {}
            Purpose::Tail => {
                self.stats.tail_recovered += r.applied;
                if r.lost {
                    self.stats.gaps_unrecovered += 1;
                    self.resync_due = true;
                }
            }
            Purpose::Gap => {
                let hole = match (self.next, self.pending.front()) {
                    (Some(n), Some(first)) => !first.restart && first.seq > n,
                    _ => false,
                };
                if r.lost || hole {
                    self.stats.gaps_unrecovered += 1;
                    self.resync_due = true;
                } else {
                    self.stats.gaps_recovered += 1;
                }
            }
        }
        // The live batches that waited: anything still missing is lost.
        if let (Some(n), Some(first)) = (self.next, self.pending.front()) {
            if !first.restart && first.seq > n {
                self.resync_due = true;
                self.next = Some(first.seq);
            }
        }
        let pending = std::mem::take(&mut self.pending);
        for p in pending {
            self.ingest(p, true, &mut out);
        }
        self.finish(&mut out);
        out
    }

    /// A live batch in order of arrival. `draining`: batches that waited
    /// for a replay, which asks for no further replay.
    fn ingest(&mut self, mut p: Pending, draining: bool, out: &mut Vec<Action>) {
        if self.fatal {
            return;
        }
        if p.restart {
            // Handled here, once, even if the batch waits for a replay.
            p.restart = false;
            self.restart(out);
        }
        match self.next {
            None => {
                if p.seq == 0 || !self.replay_available || draining {
                    if p.seq > 0 {
                        self.stats.partial_histories += 1;
                    }
                    self.apply(p.seq, &p.payload, out);
                } else {
                    self.pending.push_back(p);
                    self.begin_replay(0, Purpose::Gap, out);
                }
            }
            Some(n) if p.seq < n => self.stats.duplicates += 1,
            Some(n) if p.seq == n => self.apply(p.seq, &p.payload, out),
            Some(n) => {
                self.stats.gaps += 1;
                if self.replay_available && !draining {
                    self.pending.push_back(p);
                    self.begin_replay(n, Purpose::Gap, out);
                } else {
                    self.stats.gaps_unrecovered += 1;
                    self.resync_due = true;
                    self.apply(p.seq, &p.payload, out);
                }
            }
        }
    }

    fn restart(&mut self, out: &mut Vec<Action>) {
        self.stats.restarts += 1;
        self.translator.reset();
        self.next = None;
        self.rebuild_guard = None;
        self.rebuild_due = false;
        self.rebuild_useless = false;
        self.resync_due = false;
        out.push(Action::NewEpoch {
            set: Vec::new(),
            reason: EpochReason::Restart,
        });
    }

    fn begin_replay(&mut self, from: u64, purpose: Purpose, out: &mut Vec<Action>) {
        if purpose != Purpose::Tail {
            self.stats.replays += 1;
        }
        self.replaying = Some(Replaying {
            from,
            purpose,
            received: Vec::new(),
            lost: false,
            applied: 0,
            failed: false,
        });
        out.push(Action::Replay { from });
    }

    /// Decodes and translates one batch; `seq` is then applied.
    fn apply(&mut self, seq: u64, payload: &[u8], out: &mut Vec<Action>) {
        self.stats.batches += 1;
        // No engine counts to u64::MAX: such a seq is garbage, and leaves
        // the stream expecting no particular next one, as at start (found
        // by `scripts/fuzz`: `seq + 1` overflowed).
        self.next = seq.checked_add(1);
        let batch = match decode_batch(payload) {
            Ok(batch) => batch,
            Err(_) => {
                self.stats.malformed_batches += 1;
                return;
            }
        };
        for e in &batch.skipped {
            *self.stats.skipped_events.entry(e.label()).or_insert(0) += 1;
        }
        if batch.dp_rank.is_some_and(|r| r != i64::from(self.dp_rank)) {
            self.stats.rank_mismatches += 1;
        }
        let o = self.translator.apply(&batch);
        let s = &mut self.stats;
        s.unknown_parents += o.unknown_parents;
        s.unknown_removed += o.unknown_removed;
        s.token_mismatches += o.token_mismatches;
        s.unknown_media += o.unknown_media;
        s.other_groups += o.other_groups;
        s.other_block_sizes += o.other_block_sizes;
        if !o.events.is_empty() {
            match out.last_mut() {
                Some(Action::Events(events)) => events.extend(o.events),
                _ => out.push(Action::Events(o.events)),
            }
        }
        if let Some(fatal) = o.fatal {
            self.fatal = true;
            out.push(Action::Fatal(fatal));
            return;
        }
        if o.unknown_parents > 0
            && self.replay_available
            && !self.rebuild_useless
            && self.rebuild_guard.is_none_or(|g| seq > g)
            && self
                .replaying
                .as_ref()
                .is_none_or(|r| r.purpose != Purpose::Rebuild)
        {
            self.rebuild_due = true;
        }
    }

    /// After every input: a due resync or rebuild, once no replay runs.
    fn finish(&mut self, out: &mut Vec<Action>) {
        if self.fatal || self.replaying.is_some() {
            return;
        }
        if self.resync_due {
            self.resync_due = false;
            self.stats.resyncs += 1;
            out.push(Action::NewEpoch {
                set: self.translator.block_set(),
                reason: EpochReason::LostGap,
            });
        }
        if self.rebuild_due {
            self.rebuild_due = false;
            self.rebuild_guard = self.live_high.max(self.next.map(|n| n.saturating_sub(1)));
            self.begin_replay(0, Purpose::Rebuild, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use proptest::prelude::*;
    use protocol::{BlockHash, BlockHasher, HashSalt};
    use rmpv::Value as V;

    use super::*;
    use crate::block_set::BlockMirror;

    const BS: u32 = 2;

    fn hasher() -> BlockHasher {
        BlockHasher::new(BS, HashSalt::new("m", None, None)).unwrap()
    }

    fn core(replay: bool) -> RankCore {
        RankCore::new(Translator::new("m", hasher()), 0, replay, 1000)
    }

    /// A toy engine: stores chains of 2-token blocks under private hashes
    /// and evicts leaves; each step is one batch.
    #[derive(Default)]
    struct ToyEngine {
        seq: u64,
        /// engine hash -> (tokens of the whole prefix, parent)
        held: HashMap<u64, (Vec<u32>, Option<u64>)>,
        log: Vec<(u64, Bytes)>,
    }

    fn ehash(prefix: &[u32]) -> u64 {
        // Private: not the canonical hash.
        prefix.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, t| {
            (h ^ u64::from(*t)).wrapping_mul(0x100_0000_01b3)
        })
    }

    fn payload(events: Vec<V>) -> Bytes {
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &V::Array(vec![V::F64(0.0), V::Array(events)]))
            .unwrap();
        Bytes::from(buf)
    }

    fn stored_event(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32) -> V {
        V::Array(vec![
            V::from("BlockStored"),
            V::Array(hashes.iter().map(|h| V::from(*h)).collect()),
            parent.map_or(V::Nil, V::from),
            V::Array(tokens.iter().map(|t| V::from(*t)).collect()),
            V::from(block_size),
        ])
    }

    impl ToyEngine {
        /// Stores `blocks` blocks of prompt `p` (shared first block per pair).
        fn store(&mut self, p: u32, blocks: usize) -> (u64, Bytes) {
            let tokens: Vec<u32> = [p / 2, p / 2 + 100]
                .into_iter()
                .chain((0..2 * blocks as u32).map(|i| 1000 * (p + 1) + i))
                .collect();
            let n = (tokens.len() / BS as usize).min(blocks);
            let mut events = Vec::new();
            let mut parent = None;
            let (mut new, mut new_tokens, mut new_parent) = (Vec::new(), Vec::new(), None);
            for i in 0..n {
                let prefix = &tokens[..(i + 1) * BS as usize];
                let h = ehash(prefix);
                if let std::collections::hash_map::Entry::Vacant(slot) = self.held.entry(h) {
                    if new.is_empty() {
                        new_parent = parent;
                    }
                    slot.insert((prefix.to_vec(), parent));
                    new.push(h);
                    new_tokens.extend_from_slice(&prefix[i * BS as usize..]);
                } else if !new.is_empty() {
                    break;
                }
                parent = Some(h);
            }
            if !new.is_empty() {
                events.push(stored_event(&new, new_parent, &new_tokens, BS));
            }
            self.emit(events)
        }

        fn evict(&mut self, pick: usize) -> (u64, Bytes) {
            let parents: HashSet<u64> = self.held.values().filter_map(|(_, p)| *p).collect();
            let mut leaves: Vec<u64> = self
                .held
                .keys()
                .copied()
                .filter(|h| !parents.contains(h))
                .collect();
            leaves.sort_unstable();
            let mut events = Vec::new();
            if !leaves.is_empty() {
                let leaf = leaves[pick % leaves.len()];
                self.held.remove(&leaf);
                events.push(V::Array(vec![
                    V::from("BlockRemoved"),
                    V::Array(vec![V::from(leaf)]),
                ]));
            }
            self.emit(events)
        }

        fn emit(&mut self, events: Vec<V>) -> (u64, Bytes) {
            let b = (self.seq, payload(events));
            self.seq += 1;
            self.log.push(b.clone());
            b
        }

        fn restart(&mut self) {
            *self = Self::default();
        }

        /// The canonical hashes of every held block.
        fn canonical(&self) -> HashSet<BlockHash> {
            self.held
                .values()
                .map(|(prefix, _)| *hasher().hash_prompt(prefix).last().unwrap())
                .collect()
        }
    }

    /// The agent's side: what the published events amount to.
    #[derive(Default)]
    struct View {
        mirror: BlockMirror,
        epochs: Vec<EpochReason>,
        fatal: bool,
    }

    /// Runs `actions`, answering replays from `engine`'s log (batches at
    /// or after `keep_from`, or a failure when `fail_replays`).
    fn run(
        core: &mut RankCore,
        actions: Vec<Action>,
        engine: &ToyEngine,
        keep_from: u64,
        fail_replays: bool,
        view: &mut View,
    ) {
        let mut queue: VecDeque<Action> = actions.into();
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Events(events) => view.mirror.apply(&events),
                Action::NewEpoch { set, reason } => {
                    view.mirror = BlockMirror::new();
                    view.mirror.apply(&set);
                    view.epochs.push(reason);
                }
                Action::Fatal(_) => view.fatal = true,
                Action::Replay { from } => {
                    let mut more = Vec::new();
                    if fail_replays {
                        more.extend(core.on_replay_failed());
                    } else {
                        for (seq, p) in engine.log.iter().filter(|(s, _)| *s >= from.max(keep_from))
                        {
                            more.extend(core.on_replay(*seq, p.clone()));
                        }
                        more.extend(core.on_replay_end());
                    }
                    queue.extend(more);
                }
            }
        }
    }

    fn live(core: &mut RankCore, b: (u64, Bytes), engine: &ToyEngine, view: &mut View) {
        let actions = core.on_live(b.0, b.1);
        run(core, actions, engine, 0, false, view);
    }

    fn holds_exactly(view: &View, engine: &ToyEngine) -> bool {
        let want = engine.canonical();
        view.mirror.len() == want.len() && want.iter().all(|h| view.mirror.contains(*h))
    }

    #[test]
    fn the_start_reads_the_history_and_holds_live_batches() {
        let mut e = ToyEngine::default();
        e.store(0, 2);
        e.store(1, 2);
        let mut c = core(true);
        let mut view = View::default();
        let start = c.start();
        assert_eq!(start, vec![Action::Replay { from: 0 }]);
        // A live batch arrives while the history replays.
        let b2 = e.store(2, 1);
        assert!(c.on_live(b2.0, b2.1).is_empty(), "held");
        let mut actions = Vec::new();
        for (seq, p) in e.log[..2].iter().cloned() {
            actions.extend(c.on_replay(seq, p));
        }
        actions.extend(c.on_replay_end());
        run(&mut c, actions, &e, 0, false, &mut view);
        assert!(holds_exactly(&view, &e));
        assert!(view.epochs.is_empty());
        assert_eq!(c.stats().partial_histories, 0);
    }

    #[test]
    fn a_gap_is_replayed() {
        let mut e = ToyEngine::default();
        let mut c = core(true);
        let mut view = View::default();
        let b0 = e.store(0, 2);
        live(&mut c, b0, &e, &mut view);
        let _lost = e.store(1, 2);
        let b2 = e.evict(0);
        let actions = c.on_live(b2.0, b2.1);
        assert_eq!(actions, vec![Action::Replay { from: 1 }]);
        run(&mut c, actions, &e, 0, false, &mut view);
        assert!(holds_exactly(&view, &e));
        assert_eq!((c.stats().gaps, c.stats().gaps_recovered), (1, 1));
        assert!(view.epochs.is_empty());
    }

    #[test]
    fn a_gap_the_replay_cannot_cover_resyncs() {
        let mut e = ToyEngine::default();
        let mut c = core(true);
        let mut view = View::default();
        live(&mut c, e.store(0, 2), &e, &mut view);
        e.store(1, 2);
        e.store(2, 2);
        let b3 = e.store(3, 1);
        let actions = c.on_live(b3.0, b3.1);
        // The engine's buffer starts at seq 2 now.
        run(&mut c, actions, &e, 2, false, &mut view);
        assert_eq!(view.epochs, vec![EpochReason::LostGap]);
        assert_eq!(c.stats().gaps_unrecovered, 1);
        assert_eq!(c.stats().resyncs, 1);
        // The unknown parent of prompt 3's chain (stored in a lost batch)
        // rebuilds once the replay is done: the buffer does not start at
        // 0, so the rebuild fails and the view stays.
        assert!(c.stats().unknown_parents <= 1);

        // A failed replay resynchronises as well.
        let mut c = core(true);
        let mut view = View::default();
        let mut e = ToyEngine::default();
        live(&mut c, e.store(0, 1), &e, &mut view);
        e.store(1, 1);
        let b = e.store(2, 1);
        let actions = c.on_live(b.0, b.1);
        run(&mut c, actions, &e, 0, true, &mut view);
        assert_eq!(view.epochs, vec![EpochReason::LostGap]);
        assert_eq!(c.stats().replay_failures, 1);
    }

    #[test]
    fn an_idle_check_finds_the_batches_the_subscription_missed() {
        let mut e = ToyEngine::default();
        let mut c = core(true);
        let mut view = View::default();
        live(&mut c, e.store(0, 1), &e, &mut view);
        // Published before the subscription took effect; then silence.
        e.store(1, 2);
        let actions = c.on_idle();
        assert_eq!(actions, vec![Action::Replay { from: 1 }]);
        run(&mut c, actions, &e, 0, false, &mut view);
        assert!(holds_exactly(&view, &e));
        assert_eq!((c.stats().tail_checks, c.stats().tail_recovered), (1, 1));
        assert!(view.epochs.is_empty());
        // Up to date: nothing comes, nothing changes.
        let actions = c.on_idle();
        run(&mut c, actions, &e, 0, false, &mut view);
        assert_eq!(c.stats().tail_recovered, 1);
        assert_eq!(c.stats().gaps, 0);
        // Without a replay socket there is nothing to ask.
        assert!(core(false).on_idle().is_empty());
    }

    #[test]
    fn without_a_replay_socket_a_gap_resyncs_at_once() {
        let mut e = ToyEngine::default();
        let mut c = core(false);
        assert!(c.start().is_empty());
        let mut view = View::default();
        live(&mut c, e.store(0, 1), &e, &mut view);
        e.store(1, 1);
        live(&mut c, e.store(2, 1), &e, &mut view);
        assert_eq!(view.epochs, vec![EpochReason::LostGap]);
        assert_eq!(c.stats().gaps_unrecovered, 1);
    }

    #[test]
    fn a_sequence_going_backwards_is_a_restart() {
        let mut e = ToyEngine::default();
        let mut c = core(true);
        let mut view = View::default();
        live(&mut c, e.store(0, 2), &e, &mut view);
        live(&mut c, e.store(1, 2), &e, &mut view);
        e.restart();
        live(&mut c, e.store(4, 1), &e, &mut view);
        assert_eq!(view.epochs, vec![EpochReason::Restart]);
        assert!(holds_exactly(&view, &e));
        assert_eq!(c.stats().restarts, 1);

        // A restart with seq past 0 at the first live batch (below the
        // last one): replayed from 0.
        live(&mut c, e.store(0, 2), &e, &mut view);
        live(&mut c, e.store(1, 2), &e, &mut view);
        e.restart();
        e.store(2, 1);
        let b = e.store(3, 1);
        let actions = c.on_live(b.0, b.1);
        assert!(
            matches!(
                actions[..],
                [
                    Action::NewEpoch {
                        reason: EpochReason::Restart,
                        ..
                    },
                    Action::Replay { from: 0 }
                ]
            ),
            "{actions:?}"
        );
        run(&mut c, actions, &e, 0, false, &mut view);
        assert!(holds_exactly(&view, &e));

        // A restart whose first batches were missed cannot show in the
        // sequence alone; the SUB connection dropping with the engine
        // process shows it: the next batch rebuilds from the history.
        let mut e = ToyEngine::default();
        let mut c = core(true);
        let mut view = View::default();
        live(&mut c, e.store(0, 2), &e, &mut view);
        e.restart();
        c.on_reconnected();
        e.store(2, 1);
        let b = e.store(3, 1);
        let actions = c.on_live(b.0, b.1);
        assert_eq!(actions.last(), Some(&Action::Replay { from: 0 }));
        run(&mut c, actions, &e, 0, false, &mut view);
        assert_eq!(view.epochs, vec![EpochReason::Rebuild]);
        assert!(holds_exactly(&view, &e));
    }

    #[test]
    fn an_unknown_parent_rebuilds_from_the_history() {
        let mut e = ToyEngine::default();
        let mut c = core(true);
        let mut view = View::default();
        // The core misses batch 0 entirely (as if its replay had failed).
        let actions = c.start();
        let b0 = e.store(0, 1);
        let mut out = c.on_live(b0.0, b0.1.clone());
        out.extend(c.on_replay_failed());
        run(
            &mut c,
            actions
                .into_iter()
                .filter(|a| !matches!(a, Action::Replay { .. }))
                .chain(out)
                .collect(),
            &e,
            0,
            false,
            &mut view,
        );
        // Pretend batch 0 was lost in the translator: a fresh core that
        // starts at batch 1 sees an unknown parent.
        let mut c = core(true);
        c.live_high = Some(0);
        c.next = Some(1);
        let b1 = e.store(0, 3);
        let actions = c.on_live(b1.0, b1.1);
        assert_eq!(actions, vec![Action::Replay { from: 0 }], "rebuild");
        let mut view = View::default();
        run(&mut c, actions, &e, 0, false, &mut view);
        assert_eq!(view.epochs, vec![EpochReason::Rebuild]);
        assert!(holds_exactly(&view, &e));
        assert_eq!(c.stats().rebuilds, 1);

        // The same unknown parent does not rebuild again and again.
        let mut c = core(true);
        c.live_high = Some(0);
        c.next = Some(1);
        let mut bad = ToyEngine::default();
        bad.emit(vec![]);
        let orphan = bad.emit(vec![stored_event(&[77], Some(76), &[1, 2], BS)]);
        let actions = c.on_live(orphan.0, orphan.1);
        let mut view = View::default();
        run(&mut c, actions, &bad, 0, false, &mut view);
        let next = bad.emit(vec![]);
        let actions = c.on_live(next.0, next.1);
        assert!(actions.is_empty(), "{actions:?}");
        assert_eq!(c.stats().rebuilds, 1);
        assert!(c.stats().unknown_parents >= 2);
        // Nor does a later orphan: the history holds orphans itself, a
        // rebuild cannot help (no rebuild storms).
        let later = bad.emit(vec![stored_event(&[88], Some(87), &[3, 4], BS)]);
        let actions = c.on_live(later.0, later.1);
        assert!(actions.is_empty(), "{actions:?}");
        assert_eq!(c.stats().replays, 1);
        // After a restart, rebuilds are possible again.
        let mut fresh = ToyEngine::default();
        let b = fresh.store(0, 1);
        let actions = c.on_live(b.0, b.1);
        assert!(matches!(
            actions[..],
            [
                Action::NewEpoch {
                    reason: EpochReason::Restart,
                    ..
                },
                ..
            ]
        ));
        assert!(!c.rebuild_useless);
    }

    #[test]
    fn a_reconnection_rebuilds_and_malformed_batches_are_skipped() {
        let mut e = ToyEngine::default();
        let mut c = core(true);
        let mut view = View::default();
        live(&mut c, e.store(0, 1), &e, &mut view);
        c.on_reconnected();
        let b = e.store(1, 1);
        let actions = c.on_live(b.0, b.1);
        assert_eq!(actions.last(), Some(&Action::Replay { from: 0 }));
        run(&mut c, actions, &e, 0, false, &mut view);
        assert_eq!(view.epochs, vec![EpochReason::Rebuild]);
        assert!(holds_exactly(&view, &e));

        let garbage = e.emit(vec![]);
        let actions = c.on_live(garbage.0, Bytes::from_static(b"\xc1\xc1"));
        assert!(actions.is_empty());
        assert_eq!(c.stats().malformed_batches, 1);
        live(&mut c, e.store(2, 1), &e, &mut view);
        assert_eq!(c.stats().gaps, 0, "the malformed batch counted as applied");
    }

    #[test]
    fn a_wrong_block_size_is_fatal() {
        let mut c = core(true);
        let actions = c.on_live(0, payload(vec![stored_event(&[1], None, &[1, 2, 3, 4], 4)]));
        assert!(
            matches!(actions.last(), Some(Action::Fatal(m)) if m.engine == 4 && m.deployment == BS)
        );
        assert!(c.on_live(1, payload(vec![])).is_empty());
    }

    #[derive(Debug, Clone)]
    enum Step {
        Store(u8, u8),
        Evict(u16),
        Restart,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => (0u8..6, 1u8..4).prop_map(|(p, b)| Step::Store(p, b)),
            3 => any::<u16>().prop_map(Step::Evict),
            1 => Just(Step::Restart),
        ]
    }

    proptest! {
        /// Whatever live batches are lost, with a replay buffer that holds
        /// everything, the agent's view ends exactly the engine's.
        #[test]
        fn the_view_converges(steps in proptest::collection::vec((step(), any::<bool>()), 1..50)) {
            let mut e = ToyEngine::default();
            let mut c = core(true);
            let mut view = View::default();
            let actions = c.start();
            run(&mut c, actions, &e, 0, false, &mut view);
            for (s, delivered) in steps {
                let b = match s {
                    Step::Store(p, n) => e.store(u32::from(p), usize::from(n)),
                    Step::Evict(pick) => e.evict(usize::from(pick)),
                    Step::Restart => {
                        // The engine process goes: the SUB connection drops.
                        e.restart();
                        c.on_reconnected();
                        e.emit(vec![])
                    }
                };
                if delivered {
                    live(&mut c, b, &e, &mut view);
                }
            }
            // A last batch, delivered, closes any gap.
            let b = e.emit(vec![]);
            live(&mut c, b, &e, &mut view);
            prop_assert!(holds_exactly(&view, &e), "{} blocks vs {}", view.mirror.len(), e.canonical().len());
            prop_assert!(!view.fatal);
        }

        /// With a small replay buffer, the core never panics nor stalls.
        #[test]
        fn small_buffers_never_stall(steps in proptest::collection::vec((step(), any::<bool>()), 1..40), keep in 0u64..10) {
            let mut e = ToyEngine::default();
            let mut c = core(true);
            let mut view = View::default();
            for (s, delivered) in steps {
                let b = match s {
                    Step::Store(p, n) => e.store(u32::from(p), usize::from(n)),
                    Step::Evict(pick) => e.evict(usize::from(pick)),
                    Step::Restart => { e.restart(); e.emit(vec![]) }
                };
                if delivered {
                    let actions = c.on_live(b.0, b.1);
                    let keep_from = e.seq.saturating_sub(keep);
                    run(&mut c, actions, &e, keep_from, false, &mut view);
                }
                prop_assert!(c.replaying_from().is_none(), "a replay left hanging");
            }
        }
    }
}
