//! The agentic workload: coding-agent sessions of many turns.
//!
//! Sessions arrive as a Poisson process. Each starts with one of a few
//! shared system prompts (agent instructions and tool definitions, several
//! thousand tokens) and a user task; every later turn appends the previous
//! answer and a tool output or user message (heavy-tailed, from tens to
//! thousands of tokens). A session is a closed loop: its next turn arrives a
//! think time (tool execution) after the previous turn finished. It ends
//! after its drawn number of turns or when its context would pass the cap.
//!
//! With [`Compaction`] (the long-context workload,
//! [`AgenticConfig::long_context`]), a context that would pass the
//! compaction threshold is compacted instead, as coding agents do: the next
//! prompt is the system prompt, a fresh summary and the new append, a cold
//! prefill after the shared system prompt.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, LogNormal};

use super::{content_seed, pseudo_tokens, Arrival, RequestSpec, Workload};

/// The shape of the agentic workload.
#[derive(Debug, Clone, PartialEq)]
pub struct AgenticConfig {
    /// Session arrivals per second (the load).
    pub sessions_per_s: f64,
    /// Sessions start arriving during this window, seconds.
    pub duration_s: f64,
    /// Distinct system prompts shared across sessions.
    pub agent_types: u32,
    /// System prompt length range, tokens.
    pub system_prompt_tokens: (u32, u32),
    /// Median and log-sd of the first user message.
    pub task_tokens: (f64, f64),
    /// Median and log-sd of each appended tool output or message.
    pub append_tokens: (f64, f64),
    /// Clamp of appended tokens.
    pub append_range: (u32, u32),
    /// Median and log-sd of answer lengths.
    pub output_tokens: (f64, f64),
    /// Clamp of answer lengths.
    pub output_range: (u32, u32),
    /// Turns per session, uniform in this range.
    pub turns: (u32, u32),
    /// Mean think time (tool execution) between turns, seconds.
    pub think_time_s: f64,
    /// Contexts stop growing here: the session ends.
    pub max_context_tokens: u32,
    /// Context compaction, if the agent compacts.
    pub compaction: Option<Compaction>,
    pub seed: u64,
}

/// When and to what an agent compacts its context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Compaction {
    /// A next prompt longer than this is compacted.
    pub at_tokens: u32,
    /// The summary that replaces the history after the system prompt.
    pub summary_tokens: u32,
}

impl Default for AgenticConfig {
    fn default() -> Self {
        Self {
            sessions_per_s: 1.0,
            duration_s: 120.0,
            agent_types: 4,
            system_prompt_tokens: (3_000, 8_000),
            task_tokens: (600.0, 0.8),
            append_tokens: (350.0, 1.3),
            append_range: (16, 24_000),
            output_tokens: (180.0, 0.7),
            output_range: (16, 2_048),
            turns: (4, 24),
            think_time_s: 1.5,
            max_context_tokens: 256 * 1024,
            compaction: None,
            seed: 1,
        }
    }
}

impl AgenticConfig {
    /// The long-context agentic workload: coding-agent sessions in the
    /// regime of the C/D design note (../shared/reference/
    /// conditional-disagg.md) and issue 12. Where each number comes from:
    /// - contexts up to 256k (`max_context_tokens`): the design note's
    ///   workload, "context up to 256k"; compaction at 200k: issue 12's
    ///   traces, "contexts up to ~200k tokens";
    /// - tool outputs (appends) heavy-tailed, log-normal with median 800
    ///   tokens and log-sd 1.8, clamped to 16..64k (a file read can be
    ///   tens of thousands of tokens), and 4-40 turns a session: chosen
    ///   together so that the median prompt is ~40k tokens (issue 12:
    ///   "median prompt ~40k"; these give ~47k) and the median prefix
    ///   reuse above 95% (the design note: "theoretical KV reuse > 95%";
    ///   ~98%); the test `long_context_is_in_the_regime` checks both;
    /// - system prompts 6k-12k tokens over 4 agent types, answers (median
    ///   180, log-sd 0.7, 16..2,048), think time 1.5 s: the default agentic
    ///   workload's, whose system prompts are doubled for a coding agent's
    ///   tool schemas (an assumption: no reference gives them);
    /// - the summary after compaction 8k tokens: an assumption (no
    ///   reference gives it), 4% of the compacted context.
    ///
    /// Nothing here was chosen by how a policy fares on it.
    pub fn long_context() -> Self {
        Self {
            sessions_per_s: 0.05,
            agent_types: 4,
            system_prompt_tokens: (6_000, 12_000),
            task_tokens: (1_000.0, 0.8),
            append_tokens: (800.0, 1.8),
            append_range: (16, 64 * 1024),
            turns: (4, 40),
            max_context_tokens: 256 * 1024,
            compaction: Some(Compaction {
                at_tokens: 200_000,
                summary_tokens: 8_000,
            }),
            ..Self::default()
        }
    }
}

#[derive(Debug)]
struct Session {
    rng: ChaCha8Rng,
    turns_left: u32,
    /// Its system prompt.
    kind: usize,
    /// Compactions so far.
    compactions: u32,
}

/// The agentic workload (see the module docs).
#[derive(Debug)]
pub struct Agentic {
    config: AgenticConfig,
    system_prompts: Vec<Arc<[u32]>>,
    sessions: Vec<Session>,
    next_id: u64,
    arrivals: ChaCha8Rng,
    /// Start of the last session, seconds.
    last_start_s: f64,
}

fn lognormal(rng: &mut ChaCha8Rng, (median, sigma): (f64, f64), (lo, hi): (u32, u32)) -> usize {
    let dist = LogNormal::new(median.ln(), sigma).expect("valid log-normal parameters");
    (dist.sample(rng).round() as u32).clamp(lo, hi) as usize
}

impl Agentic {
    pub fn new(config: AgenticConfig) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(content_seed(&[config.seed, 0x5157]));
        let system_prompts = (0..config.agent_types.max(1))
            .map(|k| {
                let (lo, hi) = config.system_prompt_tokens;
                let n = rng.random_range(lo..=hi.max(lo)) as usize;
                let mut tokens = Vec::with_capacity(n);
                pseudo_tokens(
                    content_seed(&[config.seed, 1, u64::from(k)]),
                    n,
                    &mut tokens,
                );
                Arc::from(tokens)
            })
            .collect();
        let arrivals = ChaCha8Rng::seed_from_u64(content_seed(&[config.seed, 0xA221]));
        Self {
            config,
            system_prompts,
            sessions: Vec::new(),
            next_id: 0,
            arrivals,
            last_start_s: 0.0,
        }
    }

    fn request(&mut self, session: u64, turn: u32, prompt: Vec<u32>) -> RequestSpec {
        let s = &mut self.sessions[session as usize];
        let n = lognormal(
            &mut s.rng,
            self.config.output_tokens,
            self.config.output_range,
        );
        let mut output = Vec::with_capacity(n);
        pseudo_tokens(
            content_seed(&[self.config.seed, 2, session, u64::from(turn)]),
            n,
            &mut output,
        );
        let id = self.next_id;
        self.next_id += 1;
        RequestSpec {
            id,
            session,
            turn,
            prompt: prompt.into(),
            output: output.into(),
        }
    }
}

impl Workload for Agentic {
    fn next_arrival(&mut self) -> Option<Arrival> {
        let gap = Exp::new(self.config.sessions_per_s.max(1e-9)).expect("positive rate");
        self.last_start_s += gap.sample(&mut self.arrivals);
        if self.last_start_s >= self.config.duration_s {
            self.last_start_s = f64::INFINITY;
            return None;
        }
        let session = self.sessions.len() as u64;
        let mut rng = ChaCha8Rng::seed_from_u64(content_seed(&[self.config.seed, 3, session]));
        let (lo, hi) = self.config.turns;
        let turns = rng.random_range(lo.max(1)..=hi.max(lo.max(1)));
        let kind = rng.random_range(0..self.system_prompts.len());
        let task = lognormal(&mut rng, self.config.task_tokens, (16, 16_000));
        self.sessions.push(Session {
            rng,
            turns_left: turns - 1,
            kind,
            compactions: 0,
        });
        let mut prompt = self.system_prompts[kind].to_vec();
        pseudo_tokens(
            content_seed(&[self.config.seed, 4, session]),
            task,
            &mut prompt,
        );
        let request = self.request(session, 0, prompt);
        Some(Arrival {
            at_us: (self.last_start_s * 1e6) as u64,
            request,
        })
    }

    fn on_finished(&mut self, request: &RequestSpec, now_us: u64) -> Option<Arrival> {
        let config = self.config.clone();
        let s = &mut self.sessions[request.session as usize];
        if s.turns_left == 0 {
            return None;
        }
        s.turns_left -= 1;
        let append = lognormal(&mut s.rng, config.append_tokens, config.append_range);
        let think = Exp::new(1.0 / config.think_time_s.max(1e-6))
            .expect("positive rate")
            .sample(&mut s.rng);
        let turn = request.turn + 1;
        let context = request.prompt.len() + request.output.len() + append;
        let mut prompt;
        match config.compaction {
            Some(c) if context > c.at_tokens as usize => {
                s.compactions += 1;
                let system = &self.system_prompts[s.kind];
                prompt = Vec::with_capacity(system.len() + c.summary_tokens as usize + append);
                prompt.extend_from_slice(system);
                pseudo_tokens(
                    content_seed(&[config.seed, 6, request.session, u64::from(s.compactions)]),
                    c.summary_tokens as usize,
                    &mut prompt,
                );
            }
            _ if context > config.max_context_tokens as usize => return None,
            _ => {
                prompt = Vec::with_capacity(context);
                prompt.extend_from_slice(&request.prompt);
                prompt.extend_from_slice(&request.output);
            }
        }
        pseudo_tokens(
            content_seed(&[config.seed, 5, request.session, u64::from(turn)]),
            append,
            &mut prompt,
        );
        let request = self.request(request.session, turn, prompt);
        Some(Arrival {
            at_us: now_us + (think * 1e6) as u64,
            request,
        })
    }

    fn arrival_window_us(&self) -> u64 {
        (self.config.duration_s * 1e6) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> AgenticConfig {
        AgenticConfig {
            sessions_per_s: 2.0,
            duration_s: 10.0,
            ..AgenticConfig::default()
        }
    }

    fn starts(w: &mut Agentic) -> Vec<Arrival> {
        std::iter::from_fn(|| w.next_arrival()).collect()
    }

    #[test]
    fn turns_extend_the_previous_prompt_and_answer() {
        let mut w = Agentic::new(small());
        let first = starts(&mut w);
        assert!(!first.is_empty());
        let r0 = &first[0].request;
        let next = w
            .on_finished(r0, 1_000_000)
            .expect("sessions have several turns");
        let r1 = &next.request;
        assert!(next.at_us > 1_000_000);
        assert_eq!(r1.session, r0.session);
        assert_eq!(&r1.prompt[..r0.prompt.len()], &r0.prompt[..]);
        assert_eq!(
            &r1.prompt[r0.prompt.len()..r0.prompt.len() + r0.output.len()],
            &r0.output[..]
        );
        assert!(r1.prompt.len() > r0.prompt.len() + r0.output.len());
    }

    #[test]
    fn sessions_share_system_prompts() {
        let mut w = Agentic::new(small());
        let first = starts(&mut w);
        let shared = first
            .iter()
            .filter(|a| a.request.prompt[..1000] == first[0].request.prompt[..1000])
            .count();
        assert!(shared > 1, "4 agent types over ~20 sessions");
    }

    /// Every turn of every session, finished at once.
    fn all_turns(config: AgenticConfig) -> Vec<RequestSpec> {
        let mut w = Agentic::new(config);
        let mut pending = starts(&mut w);
        let mut out = Vec::new();
        while let Some(a) = pending.pop() {
            pending.extend(w.on_finished(&a.request, a.at_us));
            out.push(a.request);
        }
        out
    }

    /// The long-context workload is in the regime its docs name: contexts
    /// up to 256k, median prompt ~40k, median prefix reuse > 95%
    /// (the previous turn's prompt and answer over the prompt), compaction.
    #[test]
    fn long_context_is_in_the_regime() {
        let turns = all_turns(AgenticConfig {
            sessions_per_s: 0.5,
            duration_s: 60.0,
            ..AgenticConfig::long_context()
        });
        let mut by_id: std::collections::HashMap<(u64, u32), &RequestSpec> = Default::default();
        for r in &turns {
            by_id.insert((r.session, r.turn), r);
        }
        let mut prompts: Vec<usize> = turns.iter().map(|r| r.prompt.len()).collect();
        prompts.sort_unstable();
        let median = prompts[prompts.len() / 2];
        assert!((30_000..60_000).contains(&median), "median prompt {median}");
        assert!(*prompts.last().unwrap() <= 256 * 1024);
        let mut reuse: Vec<f64> = Vec::new();
        let mut compacted = 0;
        for r in turns.iter().filter(|r| r.turn > 0) {
            let prev = by_id[&(r.session, r.turn - 1)];
            let held = prev.prompt.len() + prev.output.len();
            if r.prompt.len() >= held && r.prompt[..prev.prompt.len()] == prev.prompt[..] {
                reuse.push(held as f64 / r.prompt.len() as f64);
            } else {
                compacted += 1;
                assert!(
                    r.prompt.len() < prev.prompt.len() && r.prompt[..1000] == prev.prompt[..1000],
                    "a compacted prompt is shorter and keeps the system prompt"
                );
                reuse.push(0.0);
            }
        }
        reuse.sort_by(f64::total_cmp);
        let p50 = reuse[reuse.len() / 2];
        assert!(p50 > 0.95, "median reuse {p50}");
        assert!(compacted > 0, "some sessions compact");
    }

    #[test]
    fn same_seed_same_workload() {
        let a = starts(&mut Agentic::new(small()));
        let b = starts(&mut Agentic::new(small()));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(
                (x.at_us, &x.request.prompt, &x.request.output),
                (y.at_us, &y.request.prompt, &y.request.output)
            );
        }
    }
}
