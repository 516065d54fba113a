//! Replay of a Mooncake-format trace (`../shared/traces/`), time scaled by
//! a rate scale (timestamps divided by it).
//!
//! Closed loop (the default, [`Arrivals::ClosedLoop`]): a conversation's
//! first turn arrives at its timestamp; a later turn arrives its
//! predecessor's last token plus the trace's gap between the two turns
//! (also scaled), as a real client sends its next message only once it has
//! the answer. Open loop ([`Arrivals::OpenLoop`]): every request at its
//! timestamp, whether its predecessor has been answered or not.
//!
//! Block ids expand to deterministic tokens (512 per id). The trace has no
//! answer tokens, so turns are linked: a request whose prompt starts with
//! all full blocks of an earlier request is that request's next turn, and
//! the earlier request's answer is taken from the later prompt (the tokens
//! right after the earlier prompt). The later prompt is the earlier prompt,
//! then its own tokens from there on. So a conversation's later turns find
//! the previous answer where it was decoded, as they would in production.

use std::collections::HashMap;
use std::sync::Arc;

use protocol::trace::{MooncakeRecord, MOONCAKE_BLOCK_TOKENS};

use super::{content_seed, pseudo_tokens, Arrival, Arrivals, RequestSpec, Workload};

/// How to replay a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct MooncakeConfig {
    /// Arrivals at `timestamp / rate_scale`: 2.0 replays twice as fast.
    pub rate_scale: f64,
    /// Replay only the first N requests.
    pub limit: Option<usize>,
    /// When a conversation's later turns arrive.
    pub arrivals: Arrivals,
    pub seed: u64,
}

/// A request's place in its conversation.
#[derive(Debug, Clone, Copy, Default)]
struct Links {
    parent: Option<usize>,
    child: Option<usize>,
    session: u64,
    turn: u32,
}

/// The replay (see the module docs).
#[derive(Debug)]
pub struct Mooncake {
    config: MooncakeConfig,
    records: Vec<MooncakeRecord>,
    links: Vec<Links>,
    /// Prompts kept until their next turn is built.
    prompts: HashMap<usize, Arc<[u32]>>,
    next: usize,
}

/// Hash of a prefix of block ids.
fn prefix_key(ids: &[u64]) -> u64 {
    content_seed(ids)
}

impl Mooncake {
    pub fn new(mut records: Vec<MooncakeRecord>, config: MooncakeConfig) -> Self {
        records.sort_by_key(|r| r.timestamp);
        if let Some(limit) = config.limit {
            records.truncate(limit);
        }
        let links = link_turns(&records);
        Self {
            config,
            records,
            links,
            prompts: HashMap::new(),
            next: 0,
        }
    }

    fn expanded(&self, i: usize) -> Vec<u32> {
        self.records[i].tokens()
    }

    fn prompt(&mut self, i: usize) -> Arc<[u32]> {
        let own = self.expanded(i);
        let prompt: Arc<[u32]> = match self.links[i]
            .parent
            .and_then(|p| self.prompts.remove(&p).map(|t| (p, t)))
        {
            Some((p, parent)) => {
                let start = self.records[p].input_length as usize;
                let mut tokens = parent.to_vec();
                tokens.extend_from_slice(&own[start.min(own.len())..]);
                tokens.into()
            }
            None => own.into(),
        };
        if self.links[i].child.is_some() {
            self.prompts.insert(i, prompt.clone());
        }
        prompt
    }

    fn output(&self, i: usize) -> Arc<[u32]> {
        let record = &self.records[i];
        let n = record.output_length.max(1) as usize;
        let mut out = Vec::with_capacity(n);
        if let Some(child) = self.links[i].child {
            let next = self.expanded(child);
            let start = record.input_length as usize;
            out.extend_from_slice(&next[start.min(next.len())..(start + n).min(next.len())]);
        }
        let have = out.len();
        pseudo_tokens(
            content_seed(&[self.config.seed, 7, i as u64]),
            n - have,
            &mut out,
        );
        out.into()
    }
}

/// Links each request to the latest earlier request whose full blocks its
/// prompt starts with (the longest such prefix).
fn link_turns(records: &[MooncakeRecord]) -> Vec<Links> {
    let mut links = vec![Links::default(); records.len()];
    // Full-block prefix key -> latest request whose full blocks it is.
    let mut by_prefix: HashMap<u64, usize> = HashMap::new();
    let mut sessions = 0u64;
    for (i, r) in records.iter().enumerate() {
        let full = (r.input_length as usize / MOONCAKE_BLOCK_TOKENS).min(r.hash_ids.len());
        let parent = (1..=full.min(r.hash_ids.len()))
            .rev()
            .filter_map(|k| by_prefix.get(&prefix_key(&r.hash_ids[..k])).copied())
            .find(|p| links[*p].child.is_none() && records[*p].input_length < r.input_length);
        match parent {
            Some(p) => {
                links[p].child = Some(i);
                links[i].parent = Some(p);
                links[i].session = links[p].session;
                links[i].turn = links[p].turn + 1;
            }
            None => {
                links[i].session = sessions;
                sessions += 1;
            }
        }
        if full > 0 {
            by_prefix.insert(prefix_key(&r.hash_ids[..full]), i);
        }
    }
    links
}

impl Mooncake {
    /// A trace time (ms) or gap in virtual microseconds at this rate.
    fn scaled_us(&self, ms: u64) -> u64 {
        (ms as f64 * 1000.0 / self.config.rate_scale) as u64
    }

    fn request(&mut self, i: usize) -> RequestSpec {
        RequestSpec {
            id: i as u64,
            session: self.links[i].session,
            turn: self.links[i].turn,
            prompt: self.prompt(i),
            output: self.output(i),
        }
    }
}

impl Workload for Mooncake {
    fn next_arrival(&mut self) -> Option<Arrival> {
        let closed = self.config.arrivals == Arrivals::ClosedLoop;
        // Closed loop: only first turns arrive on their own.
        while closed && self.links.get(self.next)?.parent.is_some() {
            self.next += 1;
        }
        let i = self.next;
        let at_us = self.scaled_us(self.records.get(i)?.timestamp);
        self.next += 1;
        let request = self.request(i);
        Some(Arrival { at_us, request })
    }

    fn on_finished(&mut self, request: &RequestSpec, now_us: u64) -> Option<Arrival> {
        if self.config.arrivals != Arrivals::ClosedLoop {
            return None;
        }
        let i = request.id as usize;
        let child = self.links.get(i)?.child?;
        let gap_ms = self.records[child]
            .timestamp
            .saturating_sub(self.records[i].timestamp);
        let at_us = now_us + self.scaled_us(gap_ms);
        let request = self.request(child);
        Some(Arrival { at_us, request })
    }

    fn arrival_window_us(&self) -> u64 {
        self.records.last().map_or(0, |r| {
            (r.timestamp as f64 * 1000.0 / self.config.rate_scale) as u64
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        timestamp: u64,
        input_length: u32,
        output_length: u32,
        hash_ids: &[u64],
    ) -> MooncakeRecord {
        MooncakeRecord {
            timestamp,
            input_length,
            output_length,
            hash_ids: hash_ids.to_vec(),
        }
    }

    #[test]
    fn a_later_turn_contains_the_earlier_prompt_and_its_answer() {
        let records = vec![
            record(0, 1000, 100, &[1, 2]),
            record(5, 700, 10, &[9, 8]),
            record(10, 1600, 50, &[1, 3, 4, 5]),
        ];
        let mut w = Mooncake::new(
            records,
            MooncakeConfig {
                rate_scale: 1.0,
                limit: None,
                arrivals: Arrivals::OpenLoop,
                seed: 1,
            },
        );
        let arrivals: Vec<_> = std::iter::from_fn(|| w.next_arrival()).collect();
        let (a, b, c) = (
            &arrivals[0].request,
            &arrivals[1].request,
            &arrivals[2].request,
        );
        assert_eq!((a.session, c.session, c.turn), (0, 0, 1));
        assert_ne!(b.session, a.session);
        assert_eq!(c.prompt.len(), 1600);
        assert_eq!(&c.prompt[..1000], &a.prompt[..]);
        assert_eq!(&c.prompt[1000..1100], &a.output[..]);
        assert_eq!(arrivals[2].at_us, 10_000);
    }

    #[test]
    fn rate_scale_compresses_time() {
        let records = vec![record(0, 10, 1, &[1]), record(1000, 10, 1, &[2])];
        let mut w = Mooncake::new(
            records,
            MooncakeConfig {
                rate_scale: 4.0,
                limit: None,
                arrivals: Arrivals::OpenLoop,
                seed: 1,
            },
        );
        w.next_arrival();
        assert_eq!(w.next_arrival().unwrap().at_us, 250_000);
        assert_eq!(w.arrival_window_us(), 250_000);
    }
}

#[cfg(test)]
mod closed_loop_tests {
    use super::*;

    fn records() -> Vec<MooncakeRecord> {
        let r = |timestamp, input_length, hash_ids: &[u64]| MooncakeRecord {
            timestamp,
            input_length,
            output_length: 10,
            hash_ids: hash_ids.to_vec(),
        };
        vec![
            r(0, 1000, &[1, 2]),
            r(5, 700, &[9, 8]),
            r(10, 1600, &[1, 3, 4, 5]),
            r(40, 2100, &[1, 3, 4, 6, 7]),
        ]
    }

    fn replay(arrivals: Arrivals) -> Mooncake {
        Mooncake::new(
            records(),
            MooncakeConfig {
                rate_scale: 2.0,
                limit: None,
                arrivals,
                seed: 1,
            },
        )
    }

    /// Closed loop: a later turn comes only from its predecessor's end,
    /// the trace's gap (scaled) after it; open loop: at its timestamp.
    #[test]
    fn a_later_turn_follows_its_predecessors_last_token_plus_the_gap() {
        let mut w = replay(Arrivals::ClosedLoop);
        let starts: Vec<_> = std::iter::from_fn(|| w.next_arrival()).collect();
        let first: Vec<_> = starts.iter().map(|a| (a.request.id, a.at_us)).collect();
        assert_eq!(first, [(0, 0), (1, 2_500)], "first turns only");
        // Turn 0 of session 0 finished late (at 1 s): turn 1 comes 5 ms
        // (10 ms of trace at 2x) after that, not at 5 ms.
        let t1 = w.on_finished(&starts[0].request, 1_000_000).unwrap();
        assert_eq!(
            (t1.request.id, t1.request.turn, t1.at_us),
            (2, 1, 1_005_000)
        );
        assert_eq!(&t1.request.prompt[..1000], &starts[0].request.prompt[..]);
        let t2 = w.on_finished(&t1.request, 2_000_000).unwrap();
        assert_eq!((t2.request.id, t2.at_us), (3, 2_015_000));
        assert!(w.on_finished(&t2.request, 3_000_000).is_none());
        assert!(w.on_finished(&starts[1].request, 3_000_000).is_none());

        let mut open = replay(Arrivals::OpenLoop);
        let all: Vec<_> = std::iter::from_fn(|| open.next_arrival())
            .map(|a| (a.request.id, a.at_us))
            .collect();
        assert_eq!(all, [(0, 0), (1, 2_500), (2, 5_000), (3, 20_000)]);
        assert!(open.on_finished(&starts[0].request, 1_000_000).is_none());
    }
}
