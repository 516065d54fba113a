//! Step-time model: how long one forward pass of the batch takes.
//!
//! A step carries prefill chunks (`n` new tokens each, on top of `m` tokens
//! whose KV is already there) and decodes (one sampled token each, attending
//! to its context). Its time in milliseconds:
//!
//! ```text
//! prefill only:  c0 + c1·P + c2·A
//! decode only:   d0 + k·C
//! mixed:         d0 + k·C + c1·max(0, P − h) + c2·A
//!
//! P = Σ n                 prefill tokens of the step
//! A = Σ n·(n + 2·m)       prefill attention work (the cached prefix is
//!                         attended to, not recomputed)
//! C = Σ context           tokens read by the decodes' attention
//! d0 = t0 + weight_bytes/TP / (η·HBM_bw),   k = kv_bytes_per_token/TP / (η·HBM_bw)
//! ```
//!
//! A mixed step is the decode step plus the prefill's variable cost, so a
//! local prefill slows the decodes running beside it. Two refinements keep
//! the mixed step physical (one forward pass, not two):
//! - the prefill's fixed cost `c0` (kernel launches, weight streaming) is
//!   already paid by the decode part, which also streams the weights;
//! - a memory-bound decode step leaves its tensor cores idle while the
//!   weights stream, so the first `h` prefill tokens' linear work rides along
//!   for free (roofline). `h` is fitted to the published interference
//!   figures (see [`crate::preset`]).
//!
//! With `d0 ≥ c0 + c1·h` (checked for every preset by a test) adding work to
//! a step never makes it shorter: a mixed step costs at least as much as
//! either of its parts alone.

use crate::error::ConfigError;

/// Constants of the step-time model, in milliseconds. Built from a
/// [`crate::Preset`] by [`crate::Preset::cost_model`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// `c0`: fixed cost of a step that carries only prefill.
    pub prefill_fixed_ms: f64,
    /// `c1`: linear (MLP, projections) cost per new prompt token.
    pub prefill_token_ms: f64,
    /// `c2`: attention cost per unit of `n·(n + 2·m)`.
    pub prefill_attention_ms: f64,
    /// `d0`: fixed cost of a step that carries decodes (overhead plus one
    /// read of the weights).
    pub decode_fixed_ms: f64,
    /// `k`: cost per context token read by a decode's attention.
    pub decode_context_token_ms: f64,
    /// `h`: prefill tokens whose linear cost hides under a decode step.
    pub hidden_prefill_tokens: u32,
}

/// What one step computes, as the cost model sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepWork {
    /// New prompt tokens computed (all chunks).
    pub prefill_tokens: u64,
    /// `Σ n·(n + 2·m)` over the chunks (`n` new tokens on `m` present).
    pub prefill_attention: u64,
    /// Sequences that sample a token as decodes.
    pub decode_seqs: u64,
    /// Context tokens those decodes attend to.
    pub decode_context_tokens: u64,
}

impl StepWork {
    /// Adds one prefill chunk of `new_tokens` on top of `present_tokens`.
    pub fn add_prefill_chunk(&mut self, new_tokens: u32, present_tokens: u32) {
        let n = u64::from(new_tokens);
        let m = u64::from(present_tokens);
        self.prefill_tokens += n;
        self.prefill_attention += n * (n + 2 * m);
    }

    /// Adds one decode attending to `context_tokens`.
    pub fn add_decode(&mut self, context_tokens: u32) {
        self.decode_seqs += 1;
        self.decode_context_tokens += u64::from(context_tokens);
    }

    /// True when the step computes nothing.
    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }
}

impl CostModel {
    /// Duration of a step in milliseconds (0 for an empty step).
    pub fn step_ms(&self, work: &StepWork) -> f64 {
        let attention = self.prefill_attention_ms * work.prefill_attention as f64;
        match (work.prefill_tokens > 0, work.decode_seqs > 0) {
            (false, false) => 0.0,
            (true, false) => {
                self.prefill_fixed_ms
                    + self.prefill_token_ms * work.prefill_tokens as f64
                    + attention
            }
            (has_prefill, true) => {
                let decode = self.decode_fixed_ms
                    + self.decode_context_token_ms * work.decode_context_tokens as f64;
                if !has_prefill {
                    return decode;
                }
                let charged = work
                    .prefill_tokens
                    .saturating_sub(u64::from(self.hidden_prefill_tokens));
                decode + self.prefill_token_ms * charged as f64 + attention
            }
        }
    }

    /// Duration in microseconds, rounded, at least 1 for a non-empty step.
    pub fn step_us(&self, work: &StepWork) -> u64 {
        if work.is_empty() {
            return 0;
        }
        // `as` saturates for out-of-range floats; the constants are
        // validated finite and non-negative.
        ((self.step_ms(work) * 1000.0).round() as u64).max(1)
    }

    /// A prefill-only step of one chunk: `c0 + c1·n + c2·n·(n + 2·m)`.
    pub fn prefill_ms(&self, new_tokens: u32, cached_tokens: u32) -> f64 {
        let mut w = StepWork::default();
        w.add_prefill_chunk(new_tokens, cached_tokens);
        self.step_ms(&w)
    }

    /// A decode-only step of `seqs` sequences with `context_tokens` in all.
    pub fn decode_ms(&self, seqs: u32, context_tokens: u64) -> f64 {
        let w = StepWork {
            decode_seqs: u64::from(seqs),
            decode_context_tokens: context_tokens,
            ..StepWork::default()
        };
        self.step_ms(&w)
    }

    /// Checks every constant is finite and non-negative.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fields = [
            ("prefill_fixed_ms", self.prefill_fixed_ms),
            ("prefill_token_ms", self.prefill_token_ms),
            ("prefill_attention_ms", self.prefill_attention_ms),
            ("decode_fixed_ms", self.decode_fixed_ms),
            ("decode_context_token_ms", self.decode_context_token_ms),
        ];
        for (name, v) in fields {
            if !v.is_finite() || v < 0.0 {
                return Err(ConfigError::InvalidCost { name, value: v });
            }
        }
        Ok(())
    }

    /// True when adding work never shortens a step (`d0 ≥ c0 + c1·h`).
    pub fn is_monotone(&self) -> bool {
        self.decode_fixed_ms
            >= self.prefill_fixed_ms + self.prefill_token_ms * f64::from(self.hidden_prefill_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> CostModel {
        CostModel {
            prefill_fixed_ms: 10.0,
            prefill_token_ms: 0.1,
            prefill_attention_ms: 1e-6,
            decode_fixed_ms: 20.0,
            decode_context_token_ms: 1e-4,
            hidden_prefill_tokens: 50,
        }
    }

    #[test]
    fn prefill_only_follows_the_published_shape() {
        let m = model();
        let got = m.prefill_ms(100, 1000);
        let want = 10.0 + 0.1 * 100.0 + 1e-6 * 100.0 * (100.0 + 2000.0);
        assert!((got - want).abs() < 1e-9);
    }

    #[test]
    fn mixed_step_is_decode_plus_prefill_beyond_hidden_tokens() {
        let m = model();
        let mut w = StepWork::default();
        w.add_decode(1000);
        w.add_decode(3000);
        let decode = m.step_ms(&w);
        assert!((decode - (20.0 + 1e-4 * 4000.0)).abs() < 1e-9);
        w.add_prefill_chunk(200, 0);
        let mixed = m.step_ms(&w);
        let want = decode + 0.1 * 150.0 + 1e-6 * 200.0 * 200.0;
        assert!((mixed - want).abs() < 1e-9);
    }

    #[test]
    fn empty_step_costs_nothing_and_tiny_steps_cost_a_microsecond() {
        let m = CostModel {
            prefill_fixed_ms: 0.0,
            prefill_token_ms: 0.0,
            prefill_attention_ms: 0.0,
            decode_fixed_ms: 0.0,
            decode_context_token_ms: 0.0,
            hidden_prefill_tokens: 0,
        };
        assert_eq!(m.step_us(&StepWork::default()), 0);
        let mut w = StepWork::default();
        w.add_decode(1);
        assert_eq!(m.step_us(&w), 1);
    }

    #[test]
    fn invalid_constants_are_refused() {
        let mut m = model();
        m.prefill_token_ms = f64::NAN;
        assert!(matches!(
            m.validate(),
            Err(ConfigError::InvalidCost {
                name: "prefill_token_ms",
                ..
            })
        ));
        m.prefill_token_ms = -1.0;
        assert!(m.validate().is_err());
        assert!(model().validate().is_ok());
    }
}
