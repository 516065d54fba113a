//! Replay of a Mooncake-format trace (`../shared/traces/`), open loop, by
//! the trace's timestamps divided by a rate scale.
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

use super::{content_seed, pseudo_tokens, Arrival, RequestSpec, Workload};

/// How to replay a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct MooncakeConfig {
    /// Arrivals at `timestamp / rate_scale`: 2.0 replays twice as fast.
    pub rate_scale: f64,
    /// Replay only the first N requests.
    pub limit: Option<usize>,
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

impl Workload for Mooncake {
    fn next_arrival(&mut self) -> Option<Arrival> {
        let i = self.next;
        let record = self.records.get(i)?;
        let at_us = (record.timestamp as f64 * 1000.0 / self.config.rate_scale) as u64;
        self.next += 1;
        let request = RequestSpec {
            id: i as u64,
            session: self.links[i].session,
            turn: self.links[i].turn,
            prompt: self.prompt(i),
            output: self.output(i),
        };
        Some(Arrival { at_us, request })
    }

    fn on_finished(&mut self, _request: &RequestSpec, _now_us: u64) -> Option<Arrival> {
        None
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
                seed: 1,
            },
        );
        w.next_arrival();
        assert_eq!(w.next_arrival().unwrap().at_us, 250_000);
        assert_eq!(w.arrival_window_us(), 250_000);
    }
}
