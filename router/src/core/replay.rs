//! Decision records and their replay: what the decision log holds about a
//! decision, and re-deciding it from that record (with its own policy and
//! settings, or others for a what-if).
//!
//! A record carries everything a decision depended on except the index,
//! which the replayer rebuilds from the delta log up to the record's
//! `delta_seq` (and checks against the depths the record saw). The load
//! each candidate had is replayed as its only load report, with an empty
//! ledger, so that its effective load is exactly the recorded one.

use kv_indexer::{DeltaError, IndexReplica, RestoreError};
use protocol::{
    CandidateInput, CandidateLoad, DecisionInputs, DecisionRecord, HashingContract, IndexDelta,
    IndexSnapshot, LoadReport, RouteDecision, WorkerId, WorkerRecord, WorkerSubjects,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::decide::{ConfigError, Explanation, RouteError, RouteRequest, RouterConfig, RouterCore};
use super::policy::{
    AlwaysDisagg, ConditionalDisaggPolicy, IslBased, IslOrLoad, LoadBased, NeverDisagg,
};
use super::sla::{CostModel, SlaDynamic};

/// A parameter that is not one of a policy's or of the router's.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamError {
    #[error("unknown policy {0:?} (known: always_disagg, never_disagg, isl, load, isl_or_load, sla_dynamic)")]
    UnknownPolicy(String),
    #[error("policy {policy} has no parameter {name:?} (it has: {known})")]
    UnknownPolicyParam {
        policy: String,
        name: String,
        known: String,
    },
    #[error("the router has no setting {0:?}")]
    UnknownRouterParam(String),
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// A policy by name, from its parameters (missing ones keep their
/// defaults; see each policy's `params`).
pub fn policy_from_params(
    name: &str,
    params: &[(String, f64)],
) -> Result<Box<dyn ConditionalDisaggPolicy>, ParamError> {
    let mut policy: Box<dyn ConditionalDisaggPolicy> = match name {
        "always_disagg" => Box::new(AlwaysDisagg),
        "never_disagg" => Box::new(NeverDisagg),
        "isl" => Box::new(IslBased::default()),
        "load" => Box::new(LoadBased::default()),
        "isl_or_load" => Box::new(IslOrLoad::default()),
        "sla_dynamic" => Box::new(SlaDynamic::new(2_000.0, 60.0, CostModel::default())),
        other => return Err(ParamError::UnknownPolicy(other.to_owned())),
    };
    for (key, value) in params {
        policy = with_param(policy, key, *value)?;
    }
    Ok(policy)
}

fn with_param(
    policy: Box<dyn ConditionalDisaggPolicy>,
    key: &str,
    value: f64,
) -> Result<Box<dyn ConditionalDisaggPolicy>, ParamError> {
    let name = policy.name();
    let unknown = || ParamError::UnknownPolicyParam {
        policy: name.to_owned(),
        name: key.to_owned(),
        known: policy
            .params()
            .iter()
            .map(|(k, _)| *k)
            .collect::<Vec<_>>()
            .join(", "),
    };
    // Rebuild from the current parameters with one changed.
    let mut params = policy.params();
    let slot = params
        .iter_mut()
        .find(|(k, _)| *k == key)
        .ok_or_else(unknown)?;
    slot.1 = value;
    let get = |k: &str| {
        params
            .iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| *v)
            .unwrap_or(0.0)
    };
    let isl = || IslBased {
        eff_isl_tokens: get("eff_isl_tokens") as u32,
        eff_isl_ratio: get("eff_isl_ratio"),
    };
    let load = || LoadBased {
        prefill_busy: get("prefill_busy"),
        decode_busy: get("decode_busy"),
    };
    Ok(match name {
        "isl" => Box::new(isl()),
        "load" => Box::new(load()),
        "isl_or_load" => Box::new(IslOrLoad {
            isl: isl(),
            load: load(),
        }),
        "sla_dynamic" => Box::new(SlaDynamic::new(
            get("ttft_target_ms"),
            get("itl_target_ms"),
            CostModel {
                prefill_c0_ms: get("prefill_c0_ms"),
                prefill_c1_ms: get("prefill_c1_ms"),
                prefill_c2_ms: get("prefill_c2_ms"),
                decode_t0_ms: get("decode_t0_ms"),
                decode_per_seq_ms: get("decode_per_seq_ms"),
                decode_per_ctx_token_ms: get("decode_per_ctx_token_ms"),
                transfer_setup_ms: get("transfer_setup_ms"),
                transfer_bytes_per_ms: get("transfer_bytes_per_ms"),
            },
        )),
        _ => return Err(unknown()),
    })
}

impl RouterConfig {
    /// The selection and gate settings, by name (recorded with every
    /// decision; the contract and ledger timing are not decision inputs).
    pub fn params(&self) -> Vec<(&'static str, f64)> {
        let bool_f = |b: bool| if b { 1.0 } else { 0.0 };
        vec![
            ("decode.overlap_credit", self.decode.overlap_credit),
            ("decode.host_weight", self.decode.tier_weights.host),
            ("decode.disk_weight", self.decode.tier_weights.disk),
            ("decode.queue_weight", self.decode.queue_weight),
            ("decode.busy_kv_usage", self.decode.busy_kv_usage),
            ("decode.busy_waiting", f64::from(self.decode.busy_waiting)),
            ("decode.temperature", self.decode.temperature),
            ("prefill.host_weight", self.prefill.tier_weights.host),
            ("prefill.disk_weight", self.prefill.tier_weights.disk),
            ("prefill.temperature", self.prefill.temperature),
            ("gate.enabled", bool_f(self.gate.enabled)),
            ("gate.budget_fraction", self.gate.budget_fraction),
            (
                "gate.count_reservations",
                bool_f(self.gate.count_reservations),
            ),
        ]
    }

    /// Sets one of [`RouterConfig::params`].
    pub fn set_param(&mut self, name: &str, value: f64) -> Result<(), ParamError> {
        match name {
            "decode.overlap_credit" => self.decode.overlap_credit = value,
            "decode.host_weight" => self.decode.tier_weights.host = value,
            "decode.disk_weight" => self.decode.tier_weights.disk = value,
            "decode.queue_weight" => self.decode.queue_weight = value,
            "decode.busy_kv_usage" => self.decode.busy_kv_usage = value,
            "decode.busy_waiting" => self.decode.busy_waiting = value as u32,
            "decode.temperature" => self.decode.temperature = value,
            "prefill.host_weight" => self.prefill.tier_weights.host = value,
            "prefill.disk_weight" => self.prefill.tier_weights.disk = value,
            "prefill.temperature" => self.prefill.temperature = value,
            "gate.enabled" => self.gate.enabled = value != 0.0,
            "gate.budget_fraction" => self.gate.budget_fraction = value,
            "gate.count_reservations" => self.gate.count_reservations = value != 0.0,
            other => return Err(ParamError::UnknownRouterParam(other.to_owned())),
        }
        Ok(())
    }
}

impl RouterCore {
    /// The decision-log entry of a decision made by
    /// [`RouterCore::route_explained`] (or its avoiding variant) for
    /// `request`, with the draws seeded by `seed`.
    pub fn record(
        &self,
        decision: &RouteDecision,
        explanation: &Explanation,
        request: &RouteRequest<'_>,
        seed: u64,
        avoid: &[WorkerId],
    ) -> DecisionRecord {
        let candidates = explanation
            .decode
            .iter()
            .chain(&explanation.prefill)
            .filter_map(|c| {
                let record = self.workers().record(&c.worker)?;
                Some(CandidateInput {
                    worker: c.worker.clone(),
                    role: record.role,
                    kv_capacity_blocks: record.kv_capacity_blocks,
                    max_batched_tokens: record.max_batched_tokens,
                    kv_bytes_per_token: record.kv_bytes_per_token,
                    depth: [c.depth.device, c.depth.host, c.depth.disk],
                    load: CandidateLoad {
                        running: c.load.running,
                        waiting: c.load.waiting,
                        queued_prefill_tokens: c.load.queued_prefill_tokens,
                        active_decode_blocks: c.load.active_decode_blocks,
                        kv_blocks_used: c.load.kv_blocks_used,
                        reported_kv_blocks_used: c.load.reported_kv_blocks_used,
                    },
                })
            })
            .collect();
        let named =
            |p: Vec<(&'static str, f64)>| p.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        DecisionRecord {
            decision: decision.clone(),
            inputs: DecisionInputs {
                block_hashes: request.block_hashes.to_vec(),
                block_size: self.hasher().block_size(),
                expected_output_tokens: request.expected_output_tokens,
                delta_seq: self.replica().applied(),
                seed,
                avoid: avoid.to_vec(),
                policy_params: named(self.policy().params()),
                router_params: named(self.config().params()),
                candidates,
            },
        }
    }
}

/// Why a record could not be replayed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(
        "decision {decision} was made at delta {recorded}, but the replayed index is at delta {at}"
    )]
    IndexPosition {
        decision: String,
        recorded: u64,
        at: u64,
    },
    #[error(transparent)]
    Params(#[from] ParamError),
    #[error("re-deciding failed: {0}")]
    Route(#[from] RouteError),
    #[error("candidate {worker}: {error}")]
    Candidate { worker: WorkerId, error: String },
}

/// A candidate whose depth in the rebuilt index differs from the record's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DepthMismatch {
    pub worker: WorkerId,
    pub recorded: [u32; 3],
    pub rebuilt: [u32; 3],
}

/// A decision made again.
#[derive(Debug, Clone)]
pub struct Replayed {
    pub decision: RouteDecision,
    pub explanation: Explanation,
    /// Candidates whose prefix depth differs between the record and the
    /// rebuilt index (empty when the index was rebuilt exactly).
    pub depth_mismatches: Vec<DepthMismatch>,
}

/// Other settings to re-decide with (a what-if).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// Another policy (by name); `None` keeps the recorded one.
    pub policy: Option<String>,
    /// Parameters set over the (recorded or named) policy's.
    pub policy_params: Vec<(String, f64)>,
    /// Router settings set over the recorded ones.
    pub router_params: Vec<(String, f64)>,
}

impl Overrides {
    pub fn is_empty(&self) -> bool {
        self.policy.is_none() && self.policy_params.is_empty() && self.router_params.is_empty()
    }
}

/// Re-decides recorded decisions against an index rebuilt from the delta
/// log. Feed it the snapshot and deltas in order, and each record once the
/// index has reached the record's `delta_seq`. Pure, like the router core.
#[derive(Debug, Default)]
pub struct Replayer {
    replica: IndexReplica,
}

impl Replayer {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn restore(&mut self, snapshot: IndexSnapshot) -> Result<(), RestoreError> {
        self.replica.restore(snapshot)
    }

    pub fn apply_delta(&mut self, delta: &IndexDelta) -> Result<(), DeltaError> {
        self.replica.apply(delta)
    }

    pub fn replica(&self) -> &IndexReplica {
        &self.replica
    }

    /// Re-decides `record` (with `overrides`, if any) on the index as of
    /// now, which must be the record's `delta_seq`.
    pub fn replay(
        &mut self,
        record: &DecisionRecord,
        overrides: &Overrides,
    ) -> Result<Replayed, ReplayError> {
        let inputs = &record.inputs;
        let decision = &record.decision;
        if self.replica.applied() != inputs.delta_seq {
            return Err(ReplayError::IndexPosition {
                decision: decision.id.to_string(),
                recorded: inputs.delta_seq,
                at: self.replica.applied(),
            });
        }
        // A contract of the record's block size; candidates are registered
        // under the same one.
        let contract = HashingContract::for_model("replay", inputs.block_size);
        let mut config = RouterConfig::new(contract.clone());
        for (name, value) in inputs.router_params.iter().chain(&overrides.router_params) {
            config.set_param(name, *value)?;
        }
        let policy = match &overrides.policy {
            None => {
                let mut params = inputs.policy_params.clone();
                params.extend(overrides.policy_params.iter().cloned());
                policy_from_params(&decision.policy, &params)?
            }
            Some(name) => policy_from_params(name, &overrides.policy_params)?,
        };
        let mut core = RouterCore::new(config, policy).map_err(ParamError::from)?;
        *core.replica_mut() = std::mem::take(&mut self.replica);
        let result = Self::decide(&mut core, record, &contract);
        self.replica = std::mem::take(core.replica_mut());
        result
    }

    fn decide(
        core: &mut RouterCore,
        record: &DecisionRecord,
        contract: &HashingContract,
    ) -> Result<Replayed, ReplayError> {
        let (inputs, decision) = (&record.inputs, &record.decision);
        for c in &inputs.candidates {
            register(core, c, contract)?;
        }
        // Depths in the rebuilt index against the record's.
        let index = core.replica().index();
        let matches = index.find_matches(&inputs.block_hashes);
        let depth_mismatches = inputs
            .candidates
            .iter()
            .filter_map(|c| {
                let d = index
                    .slot(&c.worker)
                    .map(|s| matches.get(s))
                    .unwrap_or_default();
                let rebuilt = [d.device, d.host, d.disk];
                (rebuilt != c.depth).then(|| DepthMismatch {
                    worker: c.worker.clone(),
                    recorded: c.depth,
                    rebuilt,
                })
            })
            .collect();
        let request = RouteRequest {
            request_id: &decision.request_id,
            isl_tokens: decision.isl_tokens,
            block_hashes: &inputs.block_hashes,
            expected_output_tokens: inputs.expected_output_tokens,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(inputs.seed);
        let (replayed, explanation) = if inputs.avoid.is_empty() {
            core.route_explained(&request, decision.id, decision.at_ms, &mut rng)?
        } else {
            core.route_avoiding_explained(
                &request,
                &inputs.avoid,
                decision.id,
                decision.at_ms,
                &mut rng,
            )?
        };
        Ok(Replayed {
            decision: replayed,
            explanation,
            depth_mismatches,
        })
    }
}

fn register(
    core: &mut RouterCore,
    c: &CandidateInput,
    contract: &HashingContract,
) -> Result<(), ReplayError> {
    let record = WorkerRecord {
        subjects: WorkerSubjects::for_worker(&c.worker),
        id: c.worker.clone(),
        role: c.role,
        contract: contract.clone(),
        kv_capacity_blocks: c.kv_capacity_blocks,
        max_batched_tokens: c.max_batched_tokens,
        kv_bytes_per_token: c.kv_bytes_per_token,
        gpus: 1,
    };
    core.register(record).map_err(|e| ReplayError::Candidate {
        worker: c.worker.clone(),
        error: e.to_string(),
    })?;
    // The recorded effective load, as the only report (the ledger is empty).
    let load = LoadReport {
        worker: c.worker.clone(),
        running: c.load.running,
        waiting: c.load.waiting,
        queued_prefill_tokens: c.load.queued_prefill_tokens,
        active_decode_blocks: c.load.active_decode_blocks,
        kv_blocks_used: c.load.kv_blocks_used,
        kv_blocks_total: c.kv_capacity_blocks,
        at_ms: 0,
    };
    core.on_load(load, 0);
    Ok(())
}

/// How a replayed decision differs from the recorded one (`None`: the same
/// path, workers, overlaps, rule and reason).
pub fn difference(recorded: &RouteDecision, replayed: &RouteDecision) -> Option<String> {
    let mut diffs = Vec::new();
    let mut check = |what: &str, a: String, b: String| {
        if a != b {
            diffs.push(format!("{what}: {a} -> {b}"));
        }
    };
    check("path", recorded.path.to_string(), replayed.path.to_string());
    check(
        "decode",
        recorded.decode.to_string(),
        replayed.decode.to_string(),
    );
    check(
        "prefill",
        format!("{:?}", recorded.prefill),
        format!("{:?}", replayed.prefill),
    );
    check(
        "decode overlap",
        recorded.decode_overlap_tokens.to_string(),
        replayed.decode_overlap_tokens.to_string(),
    );
    check(
        "prefill overlap",
        recorded.prefill_overlap_tokens.to_string(),
        replayed.prefill_overlap_tokens.to_string(),
    );
    check("rule", recorded.rule.clone(), replayed.rule.clone());
    check("reason", recorded.reason.clone(), replayed.reason.clone());
    (!diffs.is_empty()).then(|| diffs.join("; "))
}
