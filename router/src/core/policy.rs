//! Conditional-disaggregation policies: given the chosen decode worker and
//! the best prefill worker, bypass (prefill locally on the decode worker) or
//! prefill remotely.
//!
//! A policy is asked only when a prefill worker exists; without one the
//! router bypasses with rule [`rules::NO_PREFILL_WORKER`]. Its verdict may
//! still be vetoed by the decode gate ([`super::gate`]).

use std::fmt;

use protocol::{Path, WorkerId, WorkerRecord};

use super::workers::EffectiveLoad;

pub use super::sla::{CostModel, SlaDynamic, SlaPrediction};

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
    /// Load rule: prefill side busy, decode side not: bypass.
    pub const LOAD_PREFILL_BUSY: &str = "load.prefill_busy";
    /// Load rule: the prefill side is not busy: remote.
    pub const LOAD_PREFILL_FREE: &str = "load.prefill_free";
    /// Load rule: both sides busy: remote (spare the decodes).
    pub const LOAD_DECODE_BUSY: &str = "load.decode_busy";
    /// SLA rule: the local prefill meets the TTFT and ITL targets: bypass.
    pub const SLA_LOCAL_MEETS_TARGETS: &str = "sla.local_meets_targets";
    /// SLA rule: local misses a target, remote meets TTFT: remote.
    pub const SLA_REMOTE_MEETS_TARGETS: &str = "sla.remote_meets_targets";
    /// SLA rule: both miss; local misses by less: bypass.
    pub const SLA_LOCAL_SMALLER_VIOLATION: &str = "sla.local_smaller_violation";
    /// SLA rule: both miss; remote misses by less (or as much): remote.
    pub const SLA_REMOTE_SMALLER_VIOLATION: &str = "sla.remote_smaller_violation";
    /// The decode gate vetoed a bypass over the decode worker's KV budget.
    pub const GATE_KV_BUDGET: &str = "gate.kv_budget";
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
    /// The chosen prefill worker (where a remote prefill would run).
    pub prefill: Candidate<'a>,
}

impl PolicyInput<'_> {
    /// Prompt tokens the decode worker would have to prefill on a bypass.
    pub fn decode_append_tokens(&self) -> u32 {
        self.isl_tokens
            .saturating_sub(self.decode.held.any().min(self.isl_tokens))
    }
}

/// A policy's decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Bypass or remote.
    pub path: Path,
    /// A short label of the rule that decided (see [`rules`]).
    pub rule: &'static str,
    /// The rule with the numbers that decided it, for people.
    pub reason: String,
}

/// Decides per request between bypass and remote prefill.
pub trait ConditionalDisaggPolicy: Send + Sync + fmt::Debug {
    /// A short name, recorded in every decision.
    fn name(&self) -> &'static str;

    /// The policy's parameters as (name, value) pairs, for logs and replay.
    fn params(&self) -> Vec<(&'static str, f64)>;

    /// Bypass or remote for one request.
    fn decide(&self, input: &PolicyInput<'_>) -> Verdict;
}

/// Remote prefill whenever a prefill worker exists (plain disaggregation).
#[derive(Debug, Clone, Copy, Default)]
pub struct AlwaysDisagg;

impl ConditionalDisaggPolicy for AlwaysDisagg {
    fn name(&self) -> &'static str {
        "always_disagg"
    }

    fn params(&self) -> Vec<(&'static str, f64)> {
        Vec::new()
    }

    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        Verdict {
            path: Path::Remote,
            rule: rules::ALWAYS_REMOTE,
            reason: format!(
                "always disaggregated: remote prefill of {} tokens on {} ({} cached there), decode on {}",
                input.isl_tokens, input.prefill.id, input.prefill.held.any(), input.decode.id
            ),
        }
    }
}

/// Always bypass: every request is prefilled on its decode worker
/// (aggregated serving).
#[derive(Debug, Clone, Copy, Default)]
pub struct NeverDisagg;

impl ConditionalDisaggPolicy for NeverDisagg {
    fn name(&self) -> &'static str {
        "never_disagg"
    }

    fn params(&self) -> Vec<(&'static str, f64)> {
        Vec::new()
    }

    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        Verdict {
            path: Path::Bypass,
            rule: rules::NEVER_BYPASS,
            reason: format!(
                "never disaggregated: bypass on {}, local prefill of {} of {} tokens",
                input.decode.id,
                input.decode_append_tokens(),
                input.isl_tokens
            ),
        }
    }
}

/// Bypass iff `ISL - decode_hit < eff_isl_tokens` and
/// `(ISL - decode_hit) / ISL < eff_isl_ratio`, where `decode_hit` is the
/// tokens the chosen decode worker holds (any tier). Both comparisons are
/// strict: at a threshold the request goes remote.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IslBased {
    /// Longest append (uncached tokens) still prefilled locally is one less.
    /// Default 2048: appends of a few hundred tokens slow co-running decodes
    /// by about 2%, a 1k-token prefill by about 48% (see the reference).
    pub eff_isl_tokens: u32,
    /// Largest uncached share of the prompt still prefilled locally (strict).
    /// Default 0.7.
    pub eff_isl_ratio: f64,
}

impl Default for IslBased {
    fn default() -> Self {
        Self {
            eff_isl_tokens: 2048,
            eff_isl_ratio: 0.7,
        }
    }
}

/// The numbers of the ISL rule.
struct IslCheck {
    append: u32,
    ratio: f64,
    short: bool,
    small: bool,
}

impl IslBased {
    fn check(&self, input: &PolicyInput<'_>) -> IslCheck {
        let append = input.decode_append_tokens();
        let ratio = f64::from(append) / f64::from(input.isl_tokens.max(1));
        IslCheck {
            append,
            ratio,
            short: append < self.eff_isl_tokens,
            small: ratio < self.eff_isl_ratio,
        }
    }

    fn clause(&self, c: &IslCheck, input: &PolicyInput<'_>) -> (Path, &'static str, String) {
        let (isl, hit) = (
            input.isl_tokens,
            input.decode.held.any().min(input.isl_tokens),
        );
        if c.short && c.small {
            let text = format!(
                "append of {} uncached tokens < {} and {}/{} = {:.2} < {:.2}: bypass on {} which holds {} tokens",
                c.append, self.eff_isl_tokens, c.append, isl, c.ratio, self.eff_isl_ratio, input.decode.id, hit
            );
            (Path::Bypass, rules::ISL_SHORT_APPEND, text)
        } else if !c.short {
            let text = format!(
                "append of {} uncached tokens >= {} ({} holds {} of {}): remote prefill on {}",
                c.append, self.eff_isl_tokens, input.decode.id, hit, isl, input.prefill.id
            );
            (Path::Remote, rules::ISL_LONG_PREFILL, text)
        } else {
            let text = format!(
                "append of {} < {} tokens but {}/{} = {:.2} >= {:.2} ({} holds {}): remote prefill on {}",
                c.append,
                self.eff_isl_tokens,
                c.append,
                isl,
                c.ratio,
                self.eff_isl_ratio,
                input.decode.id,
                hit,
                input.prefill.id
            );
            (Path::Remote, rules::ISL_LOW_REUSE, text)
        }
    }
}

impl ConditionalDisaggPolicy for IslBased {
    fn name(&self) -> &'static str {
        "isl"
    }

    fn params(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("eff_isl_tokens", f64::from(self.eff_isl_tokens)),
            ("eff_isl_ratio", self.eff_isl_ratio),
        ]
    }

    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        let (path, rule, reason) = self.clause(&self.check(input), input);
        Verdict { path, rule, reason }
    }
}

/// Bypass iff the prefill side is busy (the chosen prefill worker's queued
/// prefill tokens `> prefill_busy ×` its max batched tokens) and the decode
/// worker is not (its KV usage `< decode_busy`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadBased {
    /// Queued prefill tokens, in max-size steps, above which the prefill
    /// worker is busy. Default 2.0: a new prompt would wait more than two
    /// full prefill steps before starting.
    pub prefill_busy: f64,
    /// KV usage from which the decode worker is too busy to prefill.
    /// Default 0.8: leaves room for the prompt and for decode growth below
    /// the busy filter (0.9) and the gate (0.95).
    pub decode_busy: f64,
}

impl Default for LoadBased {
    fn default() -> Self {
        Self {
            prefill_busy: 2.0,
            decode_busy: 0.8,
        }
    }
}

struct LoadCheck {
    queued: u64,
    limit: f64,
    usage: f64,
    prefill_busy: bool,
    decode_free: bool,
}

impl LoadBased {
    fn check(&self, input: &PolicyInput<'_>) -> LoadCheck {
        let queued = input.prefill.load.queued_prefill_tokens;
        let limit = self.prefill_busy * f64::from(input.prefill.record.max_batched_tokens);
        let usage = input.decode.load.kv_usage();
        LoadCheck {
            queued,
            limit,
            usage,
            prefill_busy: queued as f64 > limit,
            decode_free: usage < self.decode_busy,
        }
    }

    fn clause(&self, c: &LoadCheck, input: &PolicyInput<'_>) -> (Path, &'static str, String) {
        let (p, d) = (input.prefill.id, input.decode.id);
        let mbt = input.prefill.record.max_batched_tokens;
        if c.prefill_busy && c.decode_free {
            let text = format!(
                "{p} has {} queued prefill tokens > {:.2} × {mbt} and {d} KV use {:.2} < {:.2}: bypass on {d}",
                c.queued, self.prefill_busy, c.usage, self.decode_busy
            );
            (Path::Bypass, rules::LOAD_PREFILL_BUSY, text)
        } else if !c.prefill_busy {
            let text = format!(
                "{p} has {} queued prefill tokens <= {:.2} × {mbt} = {:.0}: remote prefill on {p}",
                c.queued, self.prefill_busy, c.limit
            );
            (Path::Remote, rules::LOAD_PREFILL_FREE, text)
        } else {
            let text = format!(
                "{p} is busy ({} queued prefill tokens > {:.2} × {mbt}) but {d} KV use {:.2} >= {:.2}: remote prefill on {p}",
                c.queued, self.prefill_busy, c.usage, self.decode_busy
            );
            (Path::Remote, rules::LOAD_DECODE_BUSY, text)
        }
    }
}

impl ConditionalDisaggPolicy for LoadBased {
    fn name(&self) -> &'static str {
        "load"
    }

    fn params(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("prefill_busy", self.prefill_busy),
            ("decode_busy", self.decode_busy),
        ]
    }

    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        let (path, rule, reason) = self.clause(&self.check(input), input);
        Verdict { path, rule, reason }
    }
}

/// Bypass iff the ISL rule or the load rule says bypass. A bypass carries
/// the rule that allowed it; a remote verdict carries the ISL rule's label
/// and both rules' numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IslOrLoad {
    /// The ISL rule.
    pub isl: IslBased,
    /// The load rule.
    pub load: LoadBased,
}

impl ConditionalDisaggPolicy for IslOrLoad {
    fn name(&self) -> &'static str {
        "isl_or_load"
    }

    fn params(&self) -> Vec<(&'static str, f64)> {
        let mut p = self.isl.params();
        p.extend(self.load.params());
        p
    }

    fn decide(&self, input: &PolicyInput<'_>) -> Verdict {
        let isl = self.isl.check(input);
        if isl.short && isl.small {
            let (path, rule, reason) = self.isl.clause(&isl, input);
            return Verdict { path, rule, reason };
        }
        let load = self.load.check(input);
        let (load_path, load_rule, load_reason) = self.load.clause(&load, input);
        if load_path == Path::Bypass {
            return Verdict {
                path: load_path,
                rule: load_rule,
                reason: load_reason,
            };
        }
        let (_, rule, isl_reason) = self.isl.clause(&isl, input);
        Verdict {
            path: Path::Remote,
            rule,
            reason: format!("{isl_reason}; and {load_reason}"),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use protocol::{HashingContract, Role, WorkerSubjects};

    pub(crate) fn record(name: &str, role: Role) -> WorkerRecord {
        let id: WorkerId = name.parse().unwrap();
        WorkerRecord {
            subjects: WorkerSubjects::for_worker(&id),
            id,
            role,
            contract: HashingContract::for_model("m", 16),
            kv_capacity_blocks: 10_000,
            max_batched_tokens: 8192,
            kv_bytes_per_token: 163_840,
            gpus: 2,
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
            }
        }
    }

    fn load(queued: u64, used: u64) -> EffectiveLoad {
        EffectiveLoad {
            queued_prefill_tokens: queued,
            kv_blocks_used: used,
            kv_capacity_blocks: 10_000,
            ..EffectiveLoad::default()
        }
    }

    #[test]
    fn isl_rule_at_and_around_its_thresholds() {
        let f = Fixture::new();
        let policy = IslBased::default(); // 2048 tokens, 0.7
        let idle = EffectiveLoad::default();
        // (isl, decode hit, expected path, rule)
        let table = [
            // token threshold: append 2047 / 2048 / 2049 of a 10 000 prompt
            (10_000, 7_953, Path::Bypass, rules::ISL_SHORT_APPEND),
            (10_000, 7_952, Path::Remote, rules::ISL_LONG_PREFILL),
            (10_000, 7_951, Path::Remote, rules::ISL_LONG_PREFILL),
            // ratio threshold: append 699 / 700 / 701 of a 1000 prompt
            (1_000, 301, Path::Bypass, rules::ISL_SHORT_APPEND),
            (1_000, 300, Path::Remote, rules::ISL_LOW_REUSE),
            (1_000, 299, Path::Remote, rules::ISL_LOW_REUSE),
            // cold short prompt: ratio 1.0
            (100, 0, Path::Remote, rules::ISL_LOW_REUSE),
            // fully cached
            (5_000, 5_000, Path::Bypass, rules::ISL_SHORT_APPEND),
            // hit beyond the prompt is capped
            (5_000, 9_000, Path::Bypass, rules::ISL_SHORT_APPEND),
        ];
        for (isl, hit, path, rule) in table {
            let v = policy.decide(&f.input(isl, hit, idle, idle));
            assert_eq!(
                (v.path, v.rule),
                (path, rule),
                "isl {isl} hit {hit}: {}",
                v.reason
            );
        }
        let v = policy.decide(&f.input(8_500, 8_188, idle, idle));
        assert_eq!(
            v.reason,
            "append of 312 uncached tokens < 2048 and 312/8500 = 0.04 < 0.70: bypass on d0 which holds 8188 tokens"
        );
    }

    #[test]
    fn load_rule_at_and_around_its_thresholds() {
        let f = Fixture::new();
        let policy = LoadBased::default(); // 2.0 × 8192 = 16384 tokens, 0.8
                                           // (p queued, d used of 10 000, path, rule)
        let table = [
            (16_385, 7_999, Path::Bypass, rules::LOAD_PREFILL_BUSY),
            (16_384, 7_999, Path::Remote, rules::LOAD_PREFILL_FREE),
            (16_383, 7_999, Path::Remote, rules::LOAD_PREFILL_FREE),
            (16_385, 8_000, Path::Remote, rules::LOAD_DECODE_BUSY),
            (16_385, 8_001, Path::Remote, rules::LOAD_DECODE_BUSY),
            (0, 0, Path::Remote, rules::LOAD_PREFILL_FREE),
        ];
        for (queued, used, path, rule) in table {
            let v = policy.decide(&f.input(4_000, 0, load(0, used), load(queued, 0)));
            assert_eq!((v.path, v.rule), (path, rule), "{}", v.reason);
        }
    }

    #[test]
    fn isl_or_load_bypasses_when_either_does() {
        let f = Fixture::new();
        let policy = IslOrLoad::default();
        let idle = load(0, 0);
        let busy_p = load(20_000, 0);
        // short append, prefill idle: ISL bypass
        let v = policy.decide(&f.input(10_000, 9_000, idle, idle));
        assert_eq!((v.path, v.rule), (Path::Bypass, rules::ISL_SHORT_APPEND));
        // long cold prompt, prefill busy, decode free: load bypass
        let v = policy.decide(&f.input(10_000, 0, idle, busy_p));
        assert_eq!((v.path, v.rule), (Path::Bypass, rules::LOAD_PREFILL_BUSY));
        // long cold prompt, prefill busy, decode busy: remote
        let v = policy.decide(&f.input(10_000, 0, load(0, 9_000), busy_p));
        assert_eq!((v.path, v.rule), (Path::Remote, rules::ISL_LONG_PREFILL));
        assert!(v.reason.contains("; and p0 is busy"), "{}", v.reason);
        // long cold prompt, prefill idle: remote
        let v = policy.decide(&f.input(10_000, 0, idle, idle));
        assert_eq!((v.path, v.rule), (Path::Remote, rules::ISL_LONG_PREFILL));
        assert_eq!(policy.params().len(), 4);
    }

    #[test]
    fn always_and_never() {
        let f = Fixture::new();
        let idle = EffectiveLoad::default();
        let input = f.input(100, 100, idle, idle);
        assert_eq!(AlwaysDisagg.decide(&input).path, Path::Remote);
        assert_eq!(NeverDisagg.decide(&input).path, Path::Bypass);
        let input = f.input(100_000, 0, idle, idle);
        assert_eq!(AlwaysDisagg.decide(&input).rule, rules::ALWAYS_REMOTE);
        assert_eq!(NeverDisagg.decide(&input).rule, rules::NEVER_BYPASS);
    }

    #[test]
    fn policies_are_object_safe() {
        let all: Vec<Box<dyn ConditionalDisaggPolicy>> = vec![
            Box::new(AlwaysDisagg),
            Box::new(NeverDisagg),
            Box::new(IslBased::default()),
            Box::new(LoadBased::default()),
            Box::new(IslOrLoad::default()),
            Box::new(SlaDynamic::new(1000.0, 50.0, CostModel::default())),
        ];
        let names: Vec<_> = all.iter().map(|p| p.name()).collect();
        assert_eq!(
            names,
            [
                "always_disagg",
                "never_disagg",
                "isl",
                "load",
                "isl_or_load",
                "sla_dynamic"
            ]
        );
    }
}
