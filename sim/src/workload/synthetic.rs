//! Single-turn requests with a configurable shared-prefix ratio.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};

use super::{content_seed, pseudo_tokens, Arrival, RequestSpec, Workload};

/// The shape of the synthetic workload.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticConfig {
    /// Requests per second (Poisson).
    pub requests_per_s: f64,
    pub duration_s: f64,
    /// Prompt length, uniform in this range.
    pub prompt_tokens: (u32, u32),
    /// Share of each prompt that is one of `prefixes` shared prefixes.
    pub shared_prefix_ratio: f64,
    pub prefixes: u32,
    pub output_tokens: (u32, u32),
    pub seed: u64,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        Self {
            requests_per_s: 4.0,
            duration_s: 60.0,
            prompt_tokens: (1_000, 8_000),
            shared_prefix_ratio: 0.5,
            prefixes: 8,
            output_tokens: (64, 512),
            seed: 1,
        }
    }
}

/// The synthetic workload.
#[derive(Debug)]
pub struct Synthetic {
    config: SyntheticConfig,
    rng: ChaCha8Rng,
    at_s: f64,
    next_id: u64,
}

impl Synthetic {
    pub fn new(config: SyntheticConfig) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(content_seed(&[config.seed, 0x5E]));
        Self {
            config,
            rng,
            at_s: 0.0,
            next_id: 0,
        }
    }
}

impl Workload for Synthetic {
    fn next_arrival(&mut self) -> Option<Arrival> {
        let c = &self.config;
        let rng = &mut self.rng;
        let gap = Exp::new(c.requests_per_s.max(1e-9)).expect("positive rate");
        self.at_s += gap.sample(rng);
        if self.at_s >= c.duration_s {
            self.at_s = f64::INFINITY;
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        let len =
            rng.random_range(c.prompt_tokens.0..=c.prompt_tokens.1.max(c.prompt_tokens.0)) as usize;
        let shared = (len as f64 * c.shared_prefix_ratio.clamp(0.0, 1.0)) as usize;
        let group = rng.random_range(0..c.prefixes.max(1));
        let mut prompt = Vec::with_capacity(len);
        // A shared prefix is the head of one long per-group stream, so
        // prompts of one group share min(their shared lengths) tokens.
        pseudo_tokens(
            content_seed(&[c.seed, 8, u64::from(group)]),
            shared,
            &mut prompt,
        );
        pseudo_tokens(content_seed(&[c.seed, 9, id]), len - shared, &mut prompt);
        let n =
            rng.random_range(c.output_tokens.0..=c.output_tokens.1.max(c.output_tokens.0)) as usize;
        let mut output = Vec::with_capacity(n);
        pseudo_tokens(content_seed(&[c.seed, 10, id]), n, &mut output);
        Some(Arrival {
            at_us: (self.at_s * 1e6) as u64,
            request: RequestSpec {
                id,
                session: id,
                turn: 0,
                prompt: prompt.into(),
                output: output.into(),
            },
        })
    }

    fn on_finished(&mut self, _request: &RequestSpec, _now_us: u64) -> Option<Arrival> {
        None
    }

    fn arrival_window_us(&self) -> u64 {
        (self.config.duration_s * 1e6) as u64
    }
}
