//! The SLA-driven policy: predicts time to first token on both paths and
//! the inter-token latency a local prefill inflicts on the decode worker.

use protocol::Path;
use serde::{Deserialize, Serialize};

use super::{positive, rules, ConditionalDisaggPolicy, ParamError, PolicyInput, Verdict};

/// Engine timing constants, in milliseconds. The defaults fit Llama-3.3-70B
/// FP8, TP2 on 2 × H100 (see `engine-timing.md` in the project reference):
/// TTFT 48 ms for 500 tokens and 407 ms for 5 000; ITL 18.6 / 38.8 /
/// 59.7 ms at 1 / 25 / 50 running requests of about 5k tokens of context;
/// KV moved at 87 GB/s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CostModel {
    /// Fixed cost of a prefill step (launch, weights pass). Default 15.
    pub prefill_c0_ms: f64,
    /// Linear cost per new prompt token (MLP, projections). Default 0.065.
    pub prefill_c1_ms: f64,
    /// Attention cost per new token per attended token: the prefill of
    /// `n_new` tokens after `n_cached` cached ones costs
    /// `c0 + c1 * n_new + c2 * n_new * (n_new + 2 * n_cached)`.
    /// Default 2.75e-6.
    pub prefill_c2_ms: f64,
    /// Fixed cost of a decode step (reading the weights). Default 17.8.
    pub decode_t0_ms: f64,
    /// Cost per sequence in the decode batch. Default 0.6.
    pub decode_per_seq_ms: f64,
    /// Cost per context token of the batch (reading its KV): a step costs
    /// `t0 + per_seq * batch + per_ctx_token * sum_context`. Default 4.4e-5
    /// (80 KB per token per GPU at 56% of 3.35 TB/s).
    pub decode_per_ctx_token_ms: f64,
    /// Fixed cost of one P -> D KV transfer. Default 2.
    pub transfer_setup_ms: f64,
    /// Transfer bandwidth in bytes per millisecond. Default 87e6 (87 GB/s).
    pub transfer_bytes_per_ms: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            prefill_c0_ms: 15.0,
            prefill_c1_ms: 0.065,
            prefill_c2_ms: 2.75e-6,
            decode_t0_ms: 17.8,
            decode_per_seq_ms: 0.6,
            decode_per_ctx_token_ms: 4.4e-5,
            transfer_setup_ms: 2.0,
            transfer_bytes_per_ms: 87e6,
        }
    }
}

impl CostModel {
    /// One prefill of `n_new` tokens after `n_cached` cached ones (0 when
    /// there is nothing to prefill).
    pub fn prefill_ms(&self, n_new: u64, n_cached: u64) -> f64 {
        if n_new == 0 {
            return 0.0;
        }
        let (n, c) = (n_new as f64, n_cached as f64);
        self.prefill_c0_ms + self.prefill_c1_ms * n + self.prefill_c2_ms * n * (n + 2.0 * c)
    }

    /// The extra time a chunk of `chunk` prefill tokens after `n_cached`
    /// cached ones adds to a decode step it is mixed into (the step's fixed
    /// cost is already paid by the decodes).
    pub fn mixed_chunk_ms(&self, chunk: u64, n_cached: u64) -> f64 {
        let (n, c) = (chunk as f64, n_cached as f64);
        self.prefill_c1_ms * n + self.prefill_c2_ms * n * (n + 2.0 * c)
    }

    /// One decode step of `batch` sequences holding `sum_context` tokens.
    pub fn decode_step_ms(&self, batch: u32, sum_context: u64) -> f64 {
        self.decode_t0_ms
            + self.decode_per_seq_ms * f64::from(batch)
            + self.decode_per_ctx_token_ms * sum_context as f64
    }

    /// Moving `bytes` of KV from a prefill to a decode worker.
    pub fn transfer_ms(&self, bytes: u64) -> f64 {
        self.transfer_setup_ms + bytes as f64 / self.transfer_bytes_per_ms.max(f64::MIN_POSITIVE)
    }

    /// Time to work off `queued` prefill tokens in steps of at most
    /// `max_batched` tokens, ignoring their attention term (their context is
    /// unknown): a lower bound of the wait.
    pub fn queue_ms(&self, queued: u64, max_batched: u32) -> f64 {
        if queued == 0 {
            return 0.0;
        }
        let steps = queued.div_ceil(u64::from(max_batched.max(1)));
        steps as f64 * self.prefill_c0_ms + self.prefill_c1_ms * queued as f64
    }
}

/// What [`SlaDynamic`] predicts for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlaPrediction {
    /// Tokens a bypass prefills on the decode worker.
    pub local_prefill_tokens: u64,
    /// Time to first token on the bypass path: the decode worker's prefill
    /// queue, the local prefill, and the decode batch run in each of the
    /// prefill's chunked steps.
    pub local_ttft_ms: f64,
    /// The decode worker's step time without this request's prefill (0
    /// when nothing runs there).
    pub itl_base_ms: f64,
    /// Time the prefills queued on the decode worker and this local
    /// prefill's chunks add to its steps, in total: every request running
    /// there waits that much longer.
    pub prefill_stall_ms: f64,
    /// The mean ITL of the requests running on the decode worker while the
    /// local prefill runs: the base step plus the stall spread over an
    /// answer of the expected length (the ITL target is a per-request mean,
    /// TPOT). 0 when nothing runs there: no one to slow.
    pub itl_local_ms: f64,
    /// Tokens a remote prefill computes on the prefill worker.
    pub remote_prefill_tokens: u64,
    /// KV transfer time of the prompt (whole prompt: an upper bound, as
    /// engines differ on skipping what the decode worker holds).
    pub transfer_ms: f64,
    /// Time to first token on the remote path: the prefill worker's queue,
    /// its prefill of what it lacks, and the transfer.
    pub remote_ttft_ms: f64,
}

/// Bypass when the local prefill meets the TTFT target and keeps the decode
/// worker's steps within the ITL target; otherwise take the path with the
/// smaller predicted violation. Violations are relative to the targets
/// (`excess / target`) so that TTFT and ITL add up: the bypass's is its
/// TTFT excess plus the ITL excess it adds beyond what the decode worker
/// already has; the remote path's is its TTFT excess (it adds no prefill to
/// the decode worker's steps). Equal violations go remote.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SlaDynamic {
    /// Time-to-first-token target (ms). Default 2000.
    pub ttft_target_ms: f64,
    /// Inter-token latency target (ms). Default 60.
    pub itl_target_ms: f64,
    /// Engine timing.
    #[serde(flatten)]
    pub cost: CostModel,
}

impl Default for SlaDynamic {
    fn default() -> Self {
        Self::new(2_000.0, 60.0, CostModel::default())
    }
}

impl SlaDynamic {
    /// The policy for the given targets and cost model.
    pub fn new(ttft_target_ms: f64, itl_target_ms: f64, cost: CostModel) -> Self {
        Self {
            ttft_target_ms,
            itl_target_ms,
            cost,
        }
    }

    /// Checks what the registry's generic check (every parameter finite and
    /// `>= 0`) does not: the targets and the bandwidth are `> 0`.
    pub fn validate(&self) -> Result<(), ParamError> {
        positive("ttft_target_ms", self.ttft_target_ms)?;
        positive("itl_target_ms", self.itl_target_ms)?;
        positive("transfer_bytes_per_ms", self.cost.transfer_bytes_per_ms)
    }

    /// The numbers the policy decides on.
    pub fn predict(&self, input: &PolicyInput<'_>) -> SlaPrediction {
        let c = &self.cost;
        let isl = u64::from(input.isl_tokens);
        let bs = u64::from(input.block_size);

        let d = &input.decode;
        let d_hit = u64::from(d.held.any()).min(isl);
        let local = (isl - d_hit).max(1);
        let mbt_d = d.record.max_batched_tokens.max(1);
        let chunks = local.div_ceil(u64::from(mbt_d));
        let batch = d.load.running;
        let context = d.load.active_decode_blocks.saturating_mul(bs);
        let itl_base = if batch > 0 {
            c.decode_step_ms(batch, context)
        } else {
            0.0
        };
        let local_ttft = c.queue_ms(d.load.queued_prefill_tokens, mbt_d)
            + c.prefill_ms(local, isl.saturating_sub(local))
            + chunks as f64 * itl_base;
        // Chunk k attends to the cached prefix and the chunks before it;
        // the queued prefills ahead of it stall the decodes too (linear
        // term only: their contexts are unknown).
        let queued_stall = c.prefill_c1_ms * d.load.queued_prefill_tokens as f64;
        let stall: f64 = queued_stall
            + (0..chunks)
                .map(|k| {
                    let start = k * u64::from(mbt_d);
                    let chunk = (local - start).min(u64::from(mbt_d));
                    c.mixed_chunk_ms(chunk, d_hit + start)
                })
                .sum::<f64>();
        let itl_local = if batch > 0 {
            itl_base + stall / f64::from(input.expected_output_tokens.max(1))
        } else {
            0.0
        };

        let p = &input.prefill;
        let p_hit = u64::from(p.held.any()).min(isl);
        let remote = (isl - p_hit).max(1);
        let transfer = c.transfer_ms(isl.saturating_mul(p.record.kv_bytes_per_token));
        let remote_ttft = c.queue_ms(p.load.queued_prefill_tokens, p.record.max_batched_tokens)
            + c.prefill_ms(remote, isl.saturating_sub(remote))
            + transfer;

        SlaPrediction {
            local_prefill_tokens: local,
            local_ttft_ms: local_ttft,
            itl_base_ms: itl_base,
            prefill_stall_ms: stall,
            itl_local_ms: itl_local,
            remote_prefill_tokens: remote,
            transfer_ms: transfer,
            remote_ttft_ms: remote_ttft,
        }
    }
}

impl ConditionalDisaggPolicy for SlaDynamic {
    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        let s = self.predict(input);
        let (tt, it) = (self.ttft_target_ms, self.itl_target_ms);
        let (d, p) = (input.decode.id, input.prefill.id);
        if s.local_ttft_ms <= tt && s.itl_local_ms <= it {
            return Verdict {
                path: Path::Bypass,
                rule: rules::SLA_LOCAL_MEETS_TARGETS,
                reason: format!(
                    "local prefill of {} tokens: TTFT {:.0} ms <= {tt:.0} and ITL {:.1} ms <= {it:.1} on {d} (remote TTFT {:.0} ms): bypass on {d}",
                    s.local_prefill_tokens, s.local_ttft_ms, s.itl_local_ms, s.remote_ttft_ms
                ),
            };
        }
        let excess = |v: f64, target: f64| (v - target).max(0.0) / target.max(f64::MIN_POSITIVE);
        let local_violation =
            excess(s.local_ttft_ms, tt) + excess(s.itl_local_ms, it.max(s.itl_base_ms));
        let remote_violation = excess(s.remote_ttft_ms, tt);
        let local = format!(
            "local TTFT {:.0} ms / ITL {:.1} ms on {d} vs targets {tt:.0} / {it:.1}",
            s.local_ttft_ms, s.itl_local_ms
        );
        if remote_violation == 0.0 {
            Verdict {
                path: Path::Remote,
                rule: rules::SLA_REMOTE_MEETS_TARGETS,
                reason: format!(
                    "{local} miss; remote TTFT {:.0} ms <= {tt:.0} on {p}: remote prefill on {p}",
                    s.remote_ttft_ms
                ),
            }
        } else if local_violation < remote_violation {
            Verdict {
                path: Path::Bypass,
                rule: rules::SLA_LOCAL_SMALLER_VIOLATION,
                reason: format!(
                    "{local} miss by {local_violation:.2} < remote's {remote_violation:.2} (TTFT {:.0} ms on {p}): bypass on {d}",
                    s.remote_ttft_ms
                ),
            }
        } else {
            Verdict {
                path: Path::Remote,
                rule: rules::SLA_REMOTE_SMALLER_VIOLATION,
                reason: format!(
                    "{local} miss by {local_violation:.2} >= remote's {remote_violation:.2} (TTFT {:.0} ms on {p}): remote prefill on {p}",
                    s.remote_ttft_ms
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::tests::Fixture;
    use crate::core::workers::EffectiveLoad;

    fn running(batch: u32, blocks: u64) -> EffectiveLoad {
        EffectiveLoad {
            running: batch,
            active_decode_blocks: blocks,
            kv_capacity_blocks: 10_000,
            ..EffectiveLoad::default()
        }
    }

    #[test]
    fn cost_model_reproduces_its_calibration() {
        let c = CostModel::default();
        assert!((c.prefill_ms(500, 0) - 48.0).abs() < 1.0);
        assert!((c.prefill_ms(5_000, 0) - 407.0).abs() < 3.0);
        let ctx = 5_250;
        assert!((c.decode_step_ms(1, ctx) - 18.6).abs() < 0.5);
        assert!((c.decode_step_ms(25, 25 * ctx) - 38.8).abs() < 1.0);
        assert!((c.decode_step_ms(50, 50 * ctx) - 59.7).abs() < 2.0);
        // an 8k-token 70B prefix (2.7 GB) at 87 GB/s: about 31 ms
        assert!((c.transfer_ms(8_192 * 327_680) - 33.0).abs() < 2.0);
    }

    /// The ITL target is the threshold of interest: with 20 running requests
    /// of 1k tokens on d0 the base step is 17.8 + 12 + 0.88 = 30.7 ms;
    /// a local append of `n` tokens on a 7.8k-token cached prompt stalls
    /// them about 0.065 n + 2.75e-6 n (n + 2 * 7800) ms in total, spread
    /// over the expected answer.
    #[test]
    fn sla_rule_at_and_around_the_itl_target() {
        let f = Fixture::new();
        let d_load = running(20, 20 * 64);
        let p_load = EffectiveLoad::default();
        let isl = 8_000;
        let hit = 7_800; // append of 200 tokens
        let policy = SlaDynamic::new(1_000.0, 1_000.0, CostModel::default());
        let itl = policy
            .predict(&f.input(isl, hit, d_load, p_load))
            .itl_local_ms;
        let ttft = policy
            .predict(&f.input(isl, hit, d_load, p_load))
            .local_ttft_ms;
        assert!(itl > 30.0 && itl < 60.0, "{itl}");
        for (target, path, rule) in [
            (itl + 0.01, Path::Bypass, rules::SLA_LOCAL_MEETS_TARGETS),
            (itl, Path::Bypass, rules::SLA_LOCAL_MEETS_TARGETS),
            (itl - 0.01, Path::Remote, rules::SLA_REMOTE_MEETS_TARGETS),
        ] {
            let policy = SlaDynamic::new(1_000.0, target, CostModel::default());
            let v = policy.decide(&f.input(isl, hit, d_load, p_load));
            assert_eq!((v.path, v.rule), (path, rule), "{}", v.reason);
        }
        // and the TTFT target: just below it local misses, but by far less
        // than the remote path (a cold 8k prefill) does.
        for (target, rule) in [
            (ttft + 0.01, rules::SLA_LOCAL_MEETS_TARGETS),
            (ttft, rules::SLA_LOCAL_MEETS_TARGETS),
            (ttft - 0.01, rules::SLA_LOCAL_SMALLER_VIOLATION),
        ] {
            let policy = SlaDynamic::new(target, 1_000.0, CostModel::default());
            let v = policy.decide(&f.input(isl, hit, d_load, p_load));
            assert_eq!((v.path, v.rule), (Path::Bypass, rule), "{}", v.reason);
        }
    }

    #[test]
    fn sla_takes_the_smaller_violation() {
        let f = Fixture::new();
        // Tight TTFT: both paths miss. A short append misses by less locally.
        let policy = SlaDynamic::new(10.0, 1_000.0, CostModel::default());
        let v = policy.decide(&f.input(8_000, 7_900, running(4, 256), EffectiveLoad::default()));
        assert_eq!(
            (v.path, v.rule),
            (Path::Bypass, rules::SLA_LOCAL_SMALLER_VIOLATION),
            "{}",
            v.reason
        );
        // A cold long prompt on a busy decode worker misses by less remotely.
        let v = policy.decide(&f.input(8_000, 0, running(60, 6_000), EffectiveLoad::default()));
        assert_eq!(
            (v.path, v.rule),
            (Path::Remote, rules::SLA_REMOTE_SMALLER_VIOLATION),
            "{}",
            v.reason
        );
        // Idle decode worker: no ITL penalty; a fully cached prompt bypasses.
        let policy = SlaDynamic::new(500.0, 20.0, CostModel::default());
        let v = policy.decide(&f.input(
            8_000,
            8_000,
            EffectiveLoad::default(),
            EffectiveLoad::default(),
        ));
        assert_eq!(v.rule, rules::SLA_LOCAL_MEETS_TARGETS, "{}", v.reason);
        assert_eq!(crate::core::Policy::from(policy).params().len(), 10);
    }
}
