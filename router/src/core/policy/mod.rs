//! Conditional-disaggregation policies: given the chosen decode worker and
//! the best prefill worker, bypass (prefill locally on the decode worker) or
//! prefill remotely — and, when the router offers it
//! ([`PolicyInput::fetch`]), remotely with the prefix pulled from the
//! decode worker that holds it ([`Path::RemoteFetch`]).
//!
//! A policy is asked only when a prefill worker exists; without one the
//! router bypasses with rule [`rules::NO_PREFILL_WORKER`]. Its verdict may
//! still be vetoed by the decode gate ([`super::gate`]).
//!
//! Each policy is a plain struct with its parameters and their defaults
//! (its `Default` impl); [`registry`] is the one place that names them, lists
//! their parameters and builds them from flags, files and decision records.

mod fixed;
mod isl;
mod isl_or_load;
mod load;
pub mod registry;
mod sla;

use protocol::{Path, WorkerId, WorkerRecord};

use super::calibrate::Factors;
use super::fetch::FetchOption;
use super::select::TierWeights;
use super::workers::EffectiveLoad;

pub use fixed::{AlwaysDisagg, NeverDisagg};
pub use isl::IslBased;
pub use isl_or_load::IslOrLoad;
pub use load::LoadBased;
pub use registry::{parse_param, ParamError, ParamSpec, Policy, PolicyName, PolicySpec, POLICIES};
pub use sla::{CostModel, FetchPrediction, SlaDynamic, SlaPrediction};

/// The `rule` labels of verdicts and decisions (low cardinality: metrics
/// labels).
pub mod rules {
    /// No prefill worker is registered: aggregated on the decode worker.
    pub const NO_PREFILL_WORKER: &str = "no_prefill_worker";
    /// [`super::AlwaysDisagg`]: remote.
    pub const ALWAYS_REMOTE: &str = "always.remote";
    /// [`super::NeverDisagg`]: bypass.
    pub const NEVER_BYPASS: &str = "never.bypass";
    /// ISL rule: the append is short and small against the prompt: bypass.
    pub const ISL_SHORT_APPEND: &str = "isl.short_append";
    /// ISL rule: the uncached part is at least the token threshold: remote.
    pub const ISL_LONG_PREFILL: &str = "isl.long_prefill";
    /// ISL rule: short, but too large a share of the prompt: remote.
    pub const ISL_LOW_REUSE: &str = "isl.low_reuse";
    /// ISL rule: the whole prompt is below `min_remote_isl`: bypass.
    pub const ISL_SHORT_PROMPT: &str = "isl.short_prompt";
    /// Load rule: prefill side busy, decode side not: bypass.
    pub const LOAD_PREFILL_BUSY: &str = "load.prefill_busy";
    /// Load rule: the prefill side is not busy: remote.
    pub const LOAD_PREFILL_FREE: &str = "load.prefill_free";
    /// Load rule: both sides busy: remote (spare the decodes).
    pub const LOAD_DECODE_BUSY: &str = "load.decode_busy";
    /// SLA rule: both paths meet the targets, the local prefill spends less
    /// compute (or as much, [`SLA_REMOTE_HAS_ROOM`] does not apply, and its
    /// first token is no later): bypass.
    pub const SLA_LOCAL_SAVES_WORK: &str = "sla.local_saves_work";
    /// SLA rule: both paths meet the targets, remote spends less compute
    /// (or as much, [`SLA_REMOTE_HAS_ROOM`] does not apply, and its first
    /// token is sooner): remote.
    pub const SLA_REMOTE_NO_MORE_WORK: &str = "sla.remote_no_more_work";
    /// SLA rule: both paths meet the targets with the same compute, and
    /// the plain remote prefill (no pull: the prefill worker holds as much
    /// of the prompt as the decode worker) fits in the prefill worker's
    /// next step (its queue and these tokens within one step's token
    /// budget): remote.
    pub const SLA_REMOTE_HAS_ROOM: &str = "sla.remote_has_room";
    /// SLA rule: only the local prefill meets the TTFT and ITL targets: bypass.
    pub const SLA_LOCAL_MEETS_TARGETS: &str = "sla.local_meets_targets";
    /// SLA rule: only remote meets the targets: remote.
    pub const SLA_REMOTE_MEETS_TARGETS: &str = "sla.remote_meets_targets";
    /// SLA rule: neither meets them; a bypass would push the decode
    /// worker's running requests over the ITL target, and the remote first
    /// token is predicted within `spare_decodes_up_to` times the TTFT
    /// target (0: no limit, the default): remote.
    pub const SLA_REMOTE_SPARES_DECODES: &str = "sla.remote_spares_decodes";
    /// SLA rule: neither meets them; a bypass would push the decode
    /// worker's running requests over the ITL target, but the remote first
    /// token is predicted past `spare_decodes_up_to` times the TTFT target
    /// (the prefill side is overloaded) and the local one is sooner: bypass.
    pub const SLA_LOCAL_REMOTE_OVERLOADED: &str = "sla.local_remote_overloaded";
    /// SLA rule: neither meets them; the local first token is sooner: bypass.
    pub const SLA_LOCAL_SOONER: &str = "sla.local_sooner";
    /// SLA rule: neither meets them; remote's is no later: remote.
    pub const SLA_REMOTE_SOONER: &str = "sla.remote_sooner";
    /// SLA rule: both the local prefill and a remote one with the prefix
    /// fetched from the decode worker meet the targets, the fetch computes
    /// less (or as much, and its first token is sooner): remote with the
    /// prefix fetched.
    pub const SLA_FETCH_LESS_WORK: &str = "sla.fetch_less_work";
    /// SLA rule: only the fetching remote prefill meets the targets.
    pub const SLA_FETCH_MEETS_TARGETS: &str = "sla.fetch_meets_targets";
    /// SLA rule: neither meets them; a bypass would push the decode
    /// worker's running requests over the ITL target, and the fetching
    /// remote's first token is predicted within `spare_decodes_up_to`
    /// times the TTFT target: remote, fetching.
    pub const SLA_FETCH_SPARES_DECODES: &str = "sla.fetch_spares_decodes";
    /// SLA rule: neither meets them; the fetching remote's first token is
    /// no later: remote, fetching.
    pub const SLA_FETCH_SOONER: &str = "sla.fetch_sooner";
    /// The decode gate vetoed a bypass over the decode worker's KV budget.
    pub const GATE_KV_BUDGET: &str = "gate.kv_budget";
    /// The chosen decode worker cannot serve the policy's path (its
    /// registered capabilities) and no other can: the other path is taken.
    pub const CAPABILITY_OTHER_PATH: &str = "capability.other_path";
    /// The decode gate vetoed a bypass: the decode worker's KV capacity is
    /// unknown (no signal), as Dynamo's gate does.
    pub const GATE_NO_SIGNAL: &str = "gate.no_signal";
}

/// Leading prompt tokens a worker holds, per tier; cumulative like
/// [`kv_indexer::PrefixDepth`] (`device <= host <= disk`), capped at the
/// prompt length.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldTokens {
    /// Held on the device.
    pub device: u32,
    /// Held on the device or in host memory.
    pub host: u32,
    /// Held anywhere (device, host or disk).
    pub disk: u32,
}

impl HeldTokens {
    /// Tokens held in any tier: what the worker does not have to compute
    /// (offloaded blocks are loaded, not recomputed).
    pub fn any(&self) -> u32 {
        self.disk
    }
}

/// One worker as a policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    /// The worker.
    pub id: &'a WorkerId,
    /// Its registration (capacity, step size, KV bytes per token).
    pub record: &'a WorkerRecord,
    /// Its effective load (report and ledger).
    pub load: EffectiveLoad,
    /// How much of the prompt it holds.
    pub held: HeldTokens,
}

/// What a policy decides on.
#[derive(Debug, Clone, Copy)]
pub struct PolicyInput<'a> {
    /// Prompt length in tokens (at least 1).
    pub isl_tokens: u32,
    /// Output tokens the request is expected to produce.
    pub expected_output_tokens: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The chosen decode worker (where a bypass would prefill).
    pub decode: Candidate<'a>,
    /// The chosen prefill worker (where a remote prefill would run): chosen
    /// KV-aware, its `held` is its overlap with the prompt.
    pub prefill: Candidate<'a>,
    /// The worker, decode or prefill, that holds the longest (weighted)
    /// prefix of the prompt, `None` when no worker holds any of it; the
    /// chosen decode worker, then the chosen prefill worker, when they tie
    /// with others. Where a prefix could be fetched from.
    pub holder: Option<Candidate<'a>>,
    /// A decode worker other than the chosen one that holds more of the
    /// prompt than it does (the one holding the most), could take a bypass
    /// (not busy while another is free, serving local prefills, within the
    /// decode gate's budget with this request), never for a request with
    /// a session (its decode stays on its bound worker): where a bypass
    /// could go instead ([`Verdict::on_decode_holder`]). Offered only to
    /// the policy that weighs it ([`SlaDynamic`]); `None` otherwise.
    pub decode_holder: Option<Candidate<'a>>,
    /// The decode selection's weights of the offloaded tiers: how much a
    /// host or disk block counts in [`PolicyInput::eff_isl_tokens`].
    pub tier_weights: TierWeights,
    /// The router core's calibration factors (used by the SLA policy).
    pub calibration: Factors,
    /// The prefix the prefill worker could pull from a decode worker
    /// before it prefills (the third path), when the router offers one
    /// ([`super::fetch::offer`]).
    pub fetch: Option<FetchOption<'a>>,
}

impl PolicyInput<'_> {
    /// Dynamo's effective ISL on the decode worker: `prompt - min(weighted
    /// cached tokens, prompt)`, where a host or disk block counts with its
    /// tier weight, in tokens (not rounded to whole blocks).
    pub fn eff_isl_tokens(&self) -> f64 {
        let h = self.decode.held;
        let w = self.tier_weights;
        let weighted = f64::from(h.device)
            + w.host * f64::from(h.host.saturating_sub(h.device))
            + w.disk * f64::from(h.disk.saturating_sub(h.host));
        let isl = f64::from(self.isl_tokens);
        isl - weighted.min(isl)
    }

    /// Prompt tokens the decode worker would have to prefill on a bypass.
    pub fn decode_append_tokens(&self) -> u32 {
        self.isl_tokens
            .saturating_sub(self.decode.held.any().min(self.isl_tokens))
    }
}

/// A policy's decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Bypass, remote, or remote with the offered prefix fetched (only
    /// when [`PolicyInput::fetch`] offered one).
    pub path: Path,
    /// A short label of the rule that decided (see [`rules`]).
    pub rule: &'static str,
    /// The rule with the numbers that decided it, for people.
    pub reason: String,
    /// A bypass on [`PolicyInput::decode_holder`] instead of the chosen
    /// decode worker (only with a bypass, and only when one was offered).
    pub on_decode_holder: bool,
}

impl Verdict {
    /// A verdict about the chosen decode worker.
    pub fn new(path: Path, rule: &'static str, reason: String) -> Self {
        Self {
            path,
            rule,
            reason,
            on_decode_holder: false,
        }
    }
}

/// Decides per request between bypass and remote prefill. Every policy the
/// router runs is a variant of the closed [`Policy`] enum, which also names
/// it and lists its parameters.
pub trait ConditionalDisaggPolicy {
    /// Bypass or remote for one request.
    fn decide(&self, input: &PolicyInput<'_>) -> Verdict;
}

/// `value` is a finite number `> 0`, or the error naming parameter `name`.
pub(crate) fn positive(name: &'static str, value: f64) -> Result<(), ParamError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ParamError::OutOfRange {
            name: name.to_owned(),
            value,
            expected: "a finite number > 0",
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use protocol::{HashingContract, Role};

    pub(crate) fn record(name: &str, role: Role) -> WorkerRecord {
        WorkerRecord {
            kv_capacity_blocks: 10_000,
            kv_bytes_per_token: 163_840,
            gpus: 2,
            max_model_len: 0,
            ..::tests::fixtures::registration(name, role, HashingContract::for_model("m", 16))
        }
    }

    /// A fixture: decode worker `d0`, prefill worker `p0`.
    pub(crate) struct Fixture {
        pub(crate) d: WorkerRecord,
        pub(crate) p: WorkerRecord,
    }

    impl Fixture {
        pub(crate) fn new() -> Self {
            Self {
                d: record("d0", Role::Decode),
                p: record("p0", Role::Prefill),
            }
        }

        pub(crate) fn input(
            &self,
            isl: u32,
            decode_hit: u32,
            d_load: EffectiveLoad,
            p_load: EffectiveLoad,
        ) -> PolicyInput<'_> {
            let held = HeldTokens {
                device: decode_hit,
                host: decode_hit,
                disk: decode_hit,
            };
            PolicyInput {
                isl_tokens: isl,
                expected_output_tokens: 200,
                block_size: 16,
                decode: Candidate {
                    id: &self.d.id,
                    record: &self.d,
                    load: d_load,
                    held,
                },
                prefill: Candidate {
                    id: &self.p.id,
                    record: &self.p,
                    load: p_load,
                    held: HeldTokens::default(),
                },
                holder: None,
                decode_holder: None,
                tier_weights: TierWeights::default(),
                calibration: Factors::default(),
                fetch: None,
            }
        }
    }

    /// A load of `queued` prefill tokens and `used` of 10 000 KV blocks.
    pub(crate) fn load(queued: u64, used: u64) -> EffectiveLoad {
        EffectiveLoad {
            queued_prefill_tokens: queued,
            kv_blocks_used: used,
            kv_capacity_blocks: 10_000,
            ..EffectiveLoad::default()
        }
    }
}
