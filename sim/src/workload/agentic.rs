//! The agentic workload: coding-agent sessions of many turns.
//!
//! Sessions arrive as a Poisson process. Each starts with one of a few
//! shared system prompts (agent instructions and tool definitions, several
//! thousand tokens) and a user task; every later turn appends the previous
//! answer and a tool output or user message (heavy-tailed, from tens to
//! thousands of tokens). A session is a closed loop: its next turn arrives a
//! think time (tool execution) after the previous turn finished. It ends
//! after its drawn number of turns or when its context would pass the cap.

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
    pub seed: u64,
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
            seed: 1,
        }
    }
}

#[derive(Debug)]
struct Session {
    rng: ChaCha8Rng,
    turns_left: u32,
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
        let context = request.prompt.len() + request.output.len() + append;
        if context > config.max_context_tokens as usize {
            return None;
        }
        let mut prompt = Vec::with_capacity(context);
        prompt.extend_from_slice(&request.prompt);
        prompt.extend_from_slice(&request.output);
        let turn = request.turn + 1;
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
