//! The Mooncake conversation trace, replayed through every index.
//!
//! The trace becomes one fixed log of lookups and KV events
//! (`kv_indexer::workload::MooncakeReplay`, with its defaults: 16 workers,
//! 16-token blocks, 65,536 blocks of LRU cache each), and the same log goes
//! through each index.
//!
//! Each index replays the log twice per round. Apply: every event in order,
//! timed from the first to the last one applied (a thread pool: enqueue all,
//! then its flush barrier); the rate is block events (stored plus removed
//! blocks) per second. Lookups: the log again, events untimed and, for a
//! thread pool, flushed before each lookup, so that every index answers each
//! lookup in the same state; the figure is the mean time per lookup. In that
//! pass the concurrent tree also gets its stale-child sweep at every five
//! minutes of trace time, as its thread pool would schedule it in real time.
//! Memory: the index's live heap after a third, untimed pass fed like the
//! lookup pass (so a thread pool's channels never hold more than the events
//! between two lookups), in which every lookup is also checked against ours.

use std::hint::black_box;
use std::time::{Duration, Instant};

use dynamo_kv_router::RouterEvent;
use kv_indexer::alloc_counter::live_bytes;
use kv_indexer::workload::{ReplayEntry, ReplayLog};

use crate::events::{peer_worker, removed, stored, Chain};
use crate::ours::Setup;
use crate::peers::{Peer, PeerKind};
use crate::report::{Point, Samples};

/// The positional jump size of the authors' Mooncake harness.
pub const JUMP: usize = 8;
/// The concurrent tree's sweep interval (`CLEANUP_INTERVAL_MS`).
const SWEEP_MS: u64 = 5 * 60 * 1000;

/// What [`Replay::feed`] just gave the peer.
enum Step<'a> {
    Event(&'a ReplayEntry),
    Lookup(usize),
}

/// The log and each prompt in the peer's hashes.
#[derive(Debug)]
pub struct Replay {
    log: ReplayLog,
    chains: Vec<Chain>,
}

impl Replay {
    pub fn new(log: ReplayLog) -> Self {
        let chains = log
            .prompts
            .iter()
            .map(|p| Chain::from_content(&p.content))
            .collect();
        Replay { log, chains }
    }

    fn describe(&self) -> String {
        let blocks: usize = self.chains.iter().map(Chain::len).sum();
        format!(
            "{} lookups ({blocks} blocks), {} block events, {} workers",
            self.log.lookups(),
            self.log.block_events,
            self.log.workers.len()
        )
    }

    fn peer_event(&self, id: u64, entry: &ReplayEntry) -> Option<RouterEvent> {
        match entry {
            ReplayEntry::Lookup { .. } => None,
            ReplayEntry::Store {
                worker,
                prompt,
                from,
                to,
            } => Some(stored(*worker, id, &self.chains[*prompt], *from, *to)),
            ReplayEntry::Remove { worker, refs, .. } => {
                let seq: Vec<_> = refs
                    .iter()
                    .map(|r| self.chains[r.prompt as usize].seq[r.pos as usize])
                    .collect();
                Some(removed(*worker, id, &seq))
            }
        }
    }

    fn ours_apply_pass(&self, setup: Setup) -> f64 {
        let mut index = setup.index();
        let start = Instant::now();
        for e in &self.log.entries {
            self.log.apply(&mut index, e);
        }
        start.elapsed().as_secs_f64()
    }

    /// Mean seconds per lookup.
    fn ours_lookup_pass(&self, setup: Setup) -> f64 {
        let mut index = setup.index();
        let mut spent = Duration::ZERO;
        for e in &self.log.entries {
            match e {
                ReplayEntry::Lookup { prompt } => {
                    // A fresh copy, as the peers get: a router looks up
                    // hashes it has just computed.
                    let q = self.log.prompts[*prompt].chained.clone();
                    let start = Instant::now();
                    black_box(index.find_matches(&q));
                    spent += start.elapsed();
                }
                _ => self.log.apply(&mut index, e),
            }
        }
        spent.as_secs_f64() / self.log.lookups() as f64
    }

    /// Our index's live heap bytes after the log, and its pairs.
    fn ours_memory(&self, setup: Setup) -> (usize, u64) {
        let before = live_bytes();
        let mut index = setup.index();
        for e in &self.log.entries {
            self.log.apply(&mut index, e);
        }
        (live_bytes() - before, index.stats().pairs)
    }

    fn peer_apply_pass(&self, kind: PeerKind, runtime: &tokio::runtime::Runtime) -> f64 {
        let events: Vec<RouterEvent> = (self.log.entries.iter().enumerate())
            .filter_map(|(i, e)| self.peer_event(i as u64, e))
            .collect();
        let mut peer = kind.build();
        let start = Instant::now();
        for e in events {
            peer.apply(e);
        }
        peer.settle(runtime);
        start.elapsed().as_secs_f64()
    }

    /// Replays the log into `peer`, settled before each lookup and maintained
    /// every five minutes of trace time; tells `step` of each entry once
    /// the peer has it.
    fn feed(
        &self,
        peer: &mut Peer,
        runtime: &tokio::runtime::Runtime,
        mut step: impl FnMut(&Peer, Step<'_>),
    ) {
        let mut next_sweep = SWEEP_MS;
        for (i, e) in self.log.entries.iter().enumerate() {
            let ReplayEntry::Lookup { prompt } = e else {
                peer.apply(self.peer_event(i as u64, e).expect("an event"));
                step(peer, Step::Event(e));
                continue;
            };
            if self.log.prompts[*prompt].at_ms >= next_sweep {
                peer.maintain(runtime);
                next_sweep += SWEEP_MS;
            }
            peer.settle(runtime);
            step(peer, Step::Lookup(*prompt));
        }
        peer.settle(runtime);
    }

    /// Mean seconds per lookup.
    fn peer_lookup_pass(&self, kind: PeerKind, runtime: &tokio::runtime::Runtime) -> f64 {
        let mut peer = kind.build();
        let mut spent = Duration::ZERO;
        self.feed(&mut peer, runtime, |peer, step| {
            if let Step::Lookup(prompt) = step {
                spent += peer.find_timed(vec![self.chains[prompt].local.clone()]);
            }
        });
        spent.as_secs_f64() / self.log.lookups() as f64
    }

    /// The peer's live heap bytes after the log, and how many lookups it
    /// answered differently from ours (in the same state, step by step).
    fn peer_memory_pass(
        &self,
        kind: PeerKind,
        runtime: &tokio::runtime::Runtime,
    ) -> (usize, usize) {
        let mut ours = Setup::Service.index();
        let mut disagreements = 0;
        let before = live_bytes();
        let mut peer = kind.build();
        self.feed(&mut peer, runtime, |peer, step| {
            let prompt = match step {
                Step::Event(e) => return self.log.apply(&mut ours, e),
                Step::Lookup(prompt) => prompt,
            };
            let theirs = peer.find(&self.chains[prompt].local);
            let mine = ours.find_matches(&self.log.prompts[prompt].chained);
            let differs = self.log.workers.iter().enumerate().any(|(n, id)| {
                let ours_depth = ours.slot(id).map_or(0, |s| mine.get(s).device);
                ours_depth != theirs.scores.get(&peer_worker(n)).copied().unwrap_or(0)
            });
            disagreements += differs as usize;
        });
        // Our index grew alongside: take its share out.
        let with_ours = live_bytes() - before;
        let ours_alone = {
            let with = live_bytes();
            drop(ours);
            with - live_bytes()
        };
        (with_ours.saturating_sub(ours_alone), disagreements)
    }

    pub fn measure(
        &self,
        peers: &[PeerKind],
        rounds: usize,
        runtime: &tokio::runtime::Runtime,
    ) -> Point {
        let mut ours = Samples::default();
        let mut unreserved = Samples::default();
        let mut theirs: Vec<Samples> = peers.iter().map(|_| Samples::default()).collect();
        let mut notes = Vec::new();

        let (bytes, pairs) = self.ours_memory(Setup::Service);
        ours.bytes = bytes as f64 / pairs as f64;
        unreserved.bytes = self.ours_memory(Setup::Unreserved).0 as f64 / pairs as f64;
        for (kind, s) in peers.iter().zip(&mut theirs) {
            let (bytes, disagreements) = self.peer_memory_pass(*kind, runtime);
            s.bytes = bytes as f64 / pairs as f64;
            if disagreements > 0 {
                notes.push(format!(
                    "{} answers {disagreements} of {} lookups differently from ours",
                    kind.name(),
                    self.log.lookups()
                ));
            }
        }

        let contenders = peers.len() + 2;
        for round in 0..rounds {
            for k in 0..contenders {
                let events = self.log.block_events as f64;
                match (round + k) % contenders {
                    0 => {
                        ours.apply
                            .push(events / self.ours_apply_pass(Setup::Service));
                        ours.find.push(self.ours_lookup_pass(Setup::Service));
                    }
                    1 => {
                        let rate = events / self.ours_apply_pass(Setup::Unreserved);
                        unreserved.apply.push(rate);
                        unreserved
                            .find
                            .push(self.ours_lookup_pass(Setup::Unreserved));
                    }
                    p => {
                        let (kind, s) = (peers[p - 2], &mut theirs[p - 2]);
                        s.apply.push(events / self.peer_apply_pass(kind, runtime));
                        s.find.push(self.peer_lookup_pass(kind, runtime));
                    }
                }
            }
        }
        Point {
            label: format!(
                "mooncake replay: {} ({pairs} pairs at the end)",
                self.describe()
            ),
            ours: ours.figures(),
            unreserved: unreserved.figures(),
            peers: peers
                .iter()
                .zip(&theirs)
                .map(|(k, s)| (k.name(), s.figures()))
                .collect(),
            notes,
        }
    }
}
