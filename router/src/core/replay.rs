//! Re-deciding a recorded decision (the record is [`RouterCore::record`]),
//! with its own policy and settings, or others for a what-if.
//!
//! A record carries everything a decision depended on except the index,
//! which the replayer rebuilds from the delta log up to the record's
//! `delta_seq` (and checks against the depths the record saw). The load
//! each candidate had is replayed as its only load report, with an empty
//! ledger, so that its effective load is exactly the recorded one.

use kv_indexer::{DeltaError, IndexReplica, RestoreError};
use protocol::{
    CandidateInput, DecisionRecord, HashingContract, IndexDelta, IndexSnapshot, LoadReport,
    RouteDecision, WorkerId, WorkerRecord, WorkerSubjects,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::calibrate::Factors;
use super::config::{ConfigError, RouterConfig, UNRECORDED_PARAMS};
use super::decide::{Explanation, RouteError, RouteOptions, RouteRequest, RouterCore};
use super::policy::{ParamError, Policy};

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
    #[error(transparent)]
    Config(#[from] ConfigError),
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
        for (name, value) in UNRECORDED_PARAMS {
            config.set_param(name, *value)?;
        }
        for (name, value) in inputs.router_params.iter().chain(&overrides.router_params) {
            config.set_param(name, *value)?;
        }
        let policy = match &overrides.policy {
            None => Policy::with_params(
                &decision.policy,
                named(&inputs.policy_params).chain(named(&overrides.policy_params)),
            )?,
            Some(name) => Policy::with_params(name, named(&overrides.policy_params))?,
        };
        let mut core = RouterCore::new(config, policy)?;
        core.set_calibration(Factors::from_named(named(&inputs.calibration)));
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
        // The session's binding as the decision found it.
        if let Some(bound) = inputs
            .session
            .as_ref()
            .and_then(|s| Some((&s.id, s.bound.as_ref()?)))
        {
            core.bind_session(bound.0, bound.1, decision.at_ms);
        }
        let request = RouteRequest {
            request_id: &decision.request_id,
            isl_tokens: decision.isl_tokens,
            block_hashes: &inputs.block_hashes,
            expected_output_tokens: inputs.expected_output_tokens,
            session: inputs.session.as_ref().map(|s| &s.id),
        };
        let mut rng = ChaCha8Rng::seed_from_u64(inputs.seed);
        let options = RouteOptions {
            avoid: &inputs.avoid,
            explain: true,
        };
        let routed = core.route(&request, options, decision.id, decision.at_ms, &mut rng)?;
        Ok(Replayed {
            decision: routed.decision,
            explanation: routed.explanation.unwrap_or_default(),
            depth_mismatches,
        })
    }
}

/// Recorded parameters as the registry takes them.
fn named(params: &[(String, f64)]) -> impl Iterator<Item = (&str, f64)> {
    params.iter().map(|(k, v)| (k.as_str(), *v))
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
        max_model_len: 0,
        capabilities: c.capabilities,
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
        recent_itl_us: c.load.recent_itl_us,
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
    let fetch = |d: &RouteDecision| match &d.fetch {
        Some(f) => format!("{} from {}", f.pulled_tokens, f.source),
        None => "none".to_owned(),
    };
    check("fetch", fetch(recorded), fetch(replayed));
    check("rule", recorded.rule.clone(), replayed.rule.clone());
    check("reason", recorded.reason.clone(), replayed.reason.clone());
    (!diffs.is_empty()).then(|| diffs.join("; "))
}
