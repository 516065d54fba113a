//! The decision step: match, select, ask the policy, gate, reserve.

use kv_indexer::{DeltaError, IndexReplica, PrefixDepth, RestoreError};
use protocol::{
    BlockHash, BlockHasher, CandidateInput, CandidateLoad, ContractMismatch, DecisionId,
    DecisionInputs, DecisionRecord, IndexDelta, IndexSnapshot, LoadReport, Path, PrefixFetch,
    RouteDecision, SessionId, SessionInput, WorkerId,
};
use rand::Rng;

use super::calibrate::{Calibration, Factors};
use super::config::{ConfigError, RouterConfig};
use super::fetch;
use super::gate::GateCheck;
use super::policy::{
    rules, Candidate, ConditionalDisaggPolicy, HeldTokens, Policy, PolicyInput, Verdict,
};
use super::select::{
    any_free, best_holder, pick, score_decode, score_prefill, Scored, Shape, Side,
};
use super::session::{rendezvous, Sessions};
use super::workers::{cache_blocks, Charge, EffectiveLoad, Workers};

/// Why a request could not be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No worker with role decode or both is registered.
    #[error("no decode-capable worker is registered")]
    NoDecodeWorker,
    /// No decode worker can serve either path's decode leg (their
    /// registered capabilities).
    #[error("no decode worker can serve a {path} decode, nor the other path's")]
    NoCapableDecodeWorker {
        /// The policy's path.
        path: &'static str,
    },
    /// The prompt has no token.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt is longer than `u32::MAX` tokens.
    #[error("a prompt of {0} tokens is too long")]
    PromptTooLong(usize),
    /// More block hashes than the prompt has full blocks.
    #[error("{blocks} block hashes for a {isl_tokens}-token prompt (at most {max} full blocks of {block_size} tokens)")]
    TooManyBlocks {
        /// Hashes given.
        blocks: usize,
        /// The prompt's length.
        isl_tokens: u32,
        /// Tokens per block.
        block_size: u32,
        /// Full blocks in the prompt.
        max: u32,
    },
    /// The decision id is already in the ledger (in flight or just
    /// finished): its reservation would be lost.
    #[error("decision {0} is already in flight or recently finished")]
    DuplicateDecision(DecisionId),
    /// Every decode-capable worker is in the avoid list of the
    /// [`RouteOptions`].
    #[error("no other decode-capable worker: all {avoided} registered ones are avoided")]
    NoOtherDecodeWorker {
        /// Registered decode-capable workers that were avoided.
        avoided: usize,
    },
    /// Every decode-capable worker is busy and the admission queue is
    /// full, or the request waited in it its longest
    /// ([`super::admission`]). Nothing was reserved.
    #[error("every decode worker is busy and {queued} requests are queued; waited {waited_ms} ms: retry after {retry_after_s} s")]
    Saturated {
        /// Requests waiting when it was turned away.
        queued: usize,
        /// How long it waited (0: the queue was full).
        waited_ms: u64,
        /// What the client is told to wait.
        retry_after_s: u32,
    },
    /// The replica has not finished starting (its index or its list of
    /// workers is still loading), and the request waited its longest in
    /// the admission queue, or the queue was full. Nothing was reserved.
    #[error("this router replica is still starting (loading its index and its workers); waited {waited_ms} ms: retry after {retry_after_s} s")]
    Starting {
        /// How long it waited (0: the queue was full).
        waited_ms: u64,
        /// What the client is told to wait.
        retry_after_s: u32,
    },
}

impl RouteError {
    /// A metrics label.
    pub fn label(&self) -> &'static str {
        match self {
            RouteError::NoDecodeWorker => "no_decode_worker",
            RouteError::NoOtherDecodeWorker { .. } => "no_other_decode_worker",
            RouteError::NoCapableDecodeWorker { .. } => "no_capable_decode_worker",
            RouteError::EmptyPrompt => "empty_prompt",
            RouteError::PromptTooLong(_) => "prompt_too_long",
            RouteError::Saturated { waited_ms: 0, .. } => "saturated",
            RouteError::Saturated { .. } => "queue_timeout",
            RouteError::Starting { .. } => "starting",
            // The HTTP layer checks the prompt; these would be our bugs.
            RouteError::TooManyBlocks { .. } | RouteError::DuplicateDecision(_) => "internal",
        }
    }
}

/// The seed of the random draws (tie-breaks, softmax sampling) of one
/// decision: a function of the request and the deployment's seed only, so
/// that replicas at the same state decide the same for the same request,
/// and a recorded decision can be replayed exactly.
pub fn decision_seed(deployment_seed: u64, request: &RouteRequest<'_>) -> u64 {
    let last = request.block_hashes.last().map_or(0, |h| h.0);
    let mut bytes = [0u8; 28];
    bytes[..8].copy_from_slice(&deployment_seed.to_le_bytes());
    bytes[8..16].copy_from_slice(&last.to_le_bytes());
    bytes[16..20].copy_from_slice(&request.isl_tokens.to_le_bytes());
    bytes[20..28].copy_from_slice(&(request.block_hashes.len() as u64).to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

/// One request to route.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The caller's request id (copied into the decision).
    pub request_id: &'a str,
    /// Prompt length in tokens.
    pub isl_tokens: u32,
    /// Chained hashes of the prompt's leading full blocks (all of them, or
    /// a prefix: overlaps beyond it are not seen).
    pub block_hashes: &'a [BlockHash],
    /// Output tokens expected (for the KV the request will hold).
    pub expected_output_tokens: u32,
    /// The conversation's session, if the client named one: its turns
    /// stay on one decode worker ([`crate::core::session`]).
    pub session: Option<&'a SessionId>,
}

/// How to route one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteOptions<'a> {
    /// Workers not to choose for either leg (a retry after one failed).
    pub avoid: &'a [WorkerId],
    /// Also return what the decision looked at ([`Routed::explanation`]).
    pub explain: bool,
}

/// A decision, and what it looked at when asked to explain.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// The decision (charged to the ledger).
    pub decision: RouteDecision,
    /// What it looked at, with [`RouteOptions::explain`].
    pub explanation: Option<Explanation>,
}

/// One candidate's numbers, as a selection looked at them.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateScore {
    /// The worker.
    pub worker: WorkerId,
    /// Leading prompt blocks it holds per tier (cumulative).
    pub depth: PrefixDepth,
    /// Its weighted overlap, in blocks.
    pub overlap_blocks: f64,
    /// Its effective load.
    pub load: EffectiveLoad,
    /// Whether the busy filter marked it (decode only).
    pub busy: bool,
    /// Its selection cost (lower is better).
    pub cost: f64,
}

/// Everything a decision looked at, for explain and replay. Filled only
/// with [`RouteOptions::explain`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Explanation {
    /// Blocks the request occupies on its decode worker.
    pub request_blocks: u64,
    /// Every decode candidate, in id order.
    pub decode: Vec<CandidateScore>,
    /// The decode candidate selection picked (index into `decode`); the
    /// final decode worker differs when the policy bypassed on
    /// `decode_holder` or the gate moved the request.
    pub decode_pick: Option<usize>,
    /// Every prefill candidate, in id order.
    pub prefill: Vec<CandidateScore>,
    /// The prefill candidate selection picked (index into `prefill`).
    pub prefill_pick: Option<usize>,
    /// The candidate holding the longest weighted prefix of the prompt
    /// ([`crate::PolicyInput::holder`]): its side and index there.
    pub holder: Option<(Side, usize)>,
    /// The decode candidate offered to the policy as where a bypass could
    /// go instead of the pick ([`crate::PolicyInput::decode_holder`]):
    /// its index in `decode`.
    pub decode_holder: Option<usize>,
    /// The policy's parameters.
    pub policy_params: Vec<(&'static str, f64)>,
    /// The calibration factors the policy was given.
    pub calibration: Factors,
    /// The policy's verdict, before the gate (`None`: the policy was not
    /// asked, as no prefill worker exists).
    pub verdict: Option<Verdict>,
    /// The gate's check of the bypass (`None`: no bypass was checked).
    pub gate: Option<GateCheck>,
    /// The request's session and the live binding the decision found.
    pub session: Option<SessionInput>,
}

#[derive(Debug, Default)]
struct Scratch {
    depths: Vec<PrefixDepth>,
    decode: Vec<Scored>,
    prefill: Vec<Scored>,
}

/// The router's sans-IO core: worker view, index replica, policy and the
/// decision step. Time and randomness come in as arguments.
#[derive(Debug)]
pub struct RouterCore {
    config: RouterConfig,
    hasher: BlockHasher,
    policy: Policy,
    workers: Workers,
    replica: IndexReplica,
    calibration: Calibration,
    sessions: Sessions,
    scratch: Scratch,
}

impl RouterCore {
    /// A core with no worker and an empty index.
    pub fn new(config: RouterConfig, policy: impl Into<Policy>) -> Result<Self, ConfigError> {
        config.validate()?;
        let policy = policy.into();
        policy.validate()?;
        let hasher = config.contract.hasher()?;
        Ok(Self {
            workers: Workers::new(config.contract.clone(), config.ledger),
            config,
            hasher,
            policy,
            replica: IndexReplica::new(),
            calibration: Calibration::default(),
            sessions: Sessions::new(),
            scratch: Scratch::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The block hasher of the configured contract.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// The worker view and ledger.
    pub fn workers(&self) -> &Workers {
        &self.workers
    }

    /// The index replica.
    pub fn replica(&self) -> &IndexReplica {
        &self.replica
    }

    /// The index replica, to apply deltas or restore a snapshot.
    pub fn replica_mut(&mut self) -> &mut IndexReplica {
        &mut self.replica
    }

    /// Applies the indexer's next delta to the replica.
    pub fn apply_delta(&mut self, delta: &IndexDelta) -> Result<(), DeltaError> {
        self.replica.apply(delta)
    }

    /// Replaces the replica's state with a snapshot.
    pub fn restore(&mut self, snapshot: IndexSnapshot) -> Result<(), RestoreError> {
        self.replica.restore(snapshot)
    }

    /// See [`Workers::register`].
    pub fn register(&mut self, record: protocol::WorkerRecord) -> Result<(), ContractMismatch> {
        self.workers.register(record)
    }

    /// See [`Workers::deregister`]; the worker's sessions are released.
    pub fn deregister(&mut self, id: &WorkerId) -> bool {
        self.sessions.release_worker(id);
        self.workers.deregister(id)
    }

    /// Puts `session`'s binding back as it was (`None`: unbound), after a
    /// dry run.
    pub fn restore_session(&mut self, session: &SessionId, bound: Option<&WorkerId>, now_ms: u64) {
        match bound {
            Some(worker) => self.bind_session(session, worker, now_ms),
            None => {
                self.sessions.release(session);
            }
        }
    }

    /// The session bindings.
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// Binds `session` to decode worker `worker` at `now_ms`: a peer's
    /// decision (from the decision log), or a replay restoring a recorded
    /// binding. Ignored when sessions are disabled.
    pub fn bind_session(&mut self, session: &SessionId, worker: &WorkerId, now_ms: u64) {
        if self.config.session.enabled {
            self.sessions
                .bind(&self.config.session, session, worker, now_ms);
        }
    }

    /// See [`Workers::on_load`].
    pub fn on_load(&mut self, report: LoadReport, now_ms: u64) -> bool {
        self.workers.on_load(report, now_ms)
    }

    /// See [`Workers::on_decision`].
    pub fn on_decision(&mut self, decision: &RouteDecision) -> bool {
        self.workers.on_decision(decision)
    }

    /// See [`Workers::on_prefill_done`].
    pub fn on_prefill_done(&mut self, id: DecisionId) -> bool {
        self.workers.on_prefill_done(id)
    }

    /// See [`Workers::on_finished`].
    pub fn on_finished(&mut self, id: DecisionId) -> bool {
        self.workers.on_finished(id)
    }

    /// See [`Workers::forget`].
    pub fn forget(&mut self, id: DecisionId) -> bool {
        self.workers.forget(id)
    }

    /// The SLA policy's online calibration (its factors and the
    /// observations it awaits).
    pub fn calibration(&self) -> &Calibration {
        &self.calibration
    }

    /// Sets the calibration factors (replay of a recorded decision).
    pub fn set_calibration(&mut self, factors: Factors) {
        self.calibration.set_factors(factors);
    }

    /// Observation: decision `id`'s prefill ended at `now_ms` (a bypass's
    /// first token, the end of a remote prefill on the prefill worker), on
    /// the clock decisions are made with. Feeds the calibration; false when
    /// the decision awaits no observation (not ours, or not the SLA
    /// policy's). Independent of the ledger's [`RouterCore::on_prefill_done`].
    pub fn observe_prefill_done(&mut self, id: DecisionId, now_ms: u64) -> bool {
        self.calibration.prefill_done(id, now_ms)
    }

    /// Observation: decision `id` produced `output_tokens` tokens in
    /// `decode_ms` from its first token to its last. Feeds the calibration's
    /// ITL factor and ends the decision's observations.
    pub fn observe_decoded(&mut self, id: DecisionId, decode_ms: f64, output_tokens: u32) -> bool {
        self.calibration.decoded(id, decode_ms, output_tokens)
    }

    /// See [`Workers::expire`].
    pub fn expire(&mut self, now_ms: u64) -> usize {
        self.sessions.expire(now_ms);
        self.workers.expire(now_ms)
    }

    /// Routes one request: finds every worker's cached prefix, picks the
    /// decode worker and (if any) the prefill worker, asks the policy,
    /// applies the decode gate, and charges the decision to the ledger.
    ///
    /// Workers in `options.avoid` are left out of both selections (to retry
    /// a request elsewhere after a worker failed it): an avoided prefill
    /// worker leaves the remote path to the others, or to none, and then
    /// the request bypasses; [`RouteError::NoOtherDecodeWorker`] when every
    /// decode-capable worker is avoided. With `options.explain` the result
    /// also says what the decision looked at (for `explain` and the
    /// decision record, [`RouterCore::record`]).
    pub fn route<R: Rng + ?Sized>(
        &mut self,
        request: &RouteRequest<'_>,
        options: RouteOptions<'_>,
        id: DecisionId,
        now_ms: u64,
        rng: &mut R,
    ) -> Result<Routed, RouteError> {
        let avoid: Vec<u32> = options
            .avoid
            .iter()
            .filter_map(|w| self.workers.slot_index(w))
            .collect();
        let mut explanation = options.explain.then(Explanation::default);
        let decision = self.decide(request, id, now_ms, rng, explanation.as_mut(), &avoid)?;
        Ok(Routed {
            decision,
            explanation,
        })
    }

    /// The decision-log entry of a decision made by [`RouterCore::route`]
    /// with `explain` for `request`, its draws seeded by `seed`: the
    /// decision and everything it depended on but the index, which replay
    /// rebuilds from the delta log up to `delta_seq`.
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
                        recent_itl_us: c.load.recent_itl_us,
                    },
                    capabilities: record.capabilities,
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
                calibration: match self.policy() {
                    Policy::SlaDynamic(_) => named(explanation.calibration.named().to_vec()),
                    _ => Vec::new(),
                },
                session: explanation.session.clone(),
            },
        }
    }

    fn decide<R: Rng + ?Sized>(
        &mut self,
        req: &RouteRequest<'_>,
        id: DecisionId,
        now_ms: u64,
        rng: &mut R,
        explain: Option<&mut Explanation>,
        avoid: &[u32],
    ) -> Result<RouteDecision, RouteError> {
        let bs = self.hasher.block_size();
        let isl = req.isl_tokens;
        if isl == 0 {
            return Err(RouteError::EmptyPrompt);
        }
        if req.block_hashes.len() > (isl / bs) as usize {
            return Err(RouteError::TooManyBlocks {
                blocks: req.block_hashes.len(),
                isl_tokens: isl,
                block_size: bs,
                max: isl / bs,
            });
        }
        if self.workers.knows_decision(id) {
            return Err(RouteError::DuplicateDecision(id));
        }
        if self.workers.decode_slots().is_empty() {
            return Err(RouteError::NoDecodeWorker);
        }

        // Every worker's cached prefix, by our slot.
        let Scratch {
            depths,
            decode,
            prefill,
            ..
        } = &mut self.scratch;
        let index = self.replica.index();
        let matches = index.find_matches(req.block_hashes);
        depths.clear();
        depths.resize(self.workers.slot_count(), PrefixDepth::default());
        for (islot, depth) in matches.iter() {
            let slot = index.worker(islot).and_then(|w| self.workers.slot_index(w));
            if let Some(slot) = slot {
                depths[slot as usize] = depth;
            }
        }

        // Selection.
        let shape = Shape::new(isl, req.expected_output_tokens, bs);
        let dcfg = &self.config.decode;
        score_decode(dcfg, &self.workers, depths, &shape, decode);
        if !avoid.is_empty() {
            let avoided = decode.len();
            decode.retain(|s| !avoid.contains(&s.slot));
            if decode.is_empty() {
                return Err(RouteError::NoOtherDecodeWorker { avoided });
            }
        }
        let free = any_free(decode);
        let eligible = |s: &Scored| !free || !s.busy;
        // A session: its live binding, else a deterministic first choice.
        let session = req.session.filter(|_| self.config.session.enabled);
        let bound = session
            .and_then(|s| self.sessions.bound(s, now_ms))
            .cloned();
        let mut session_note = None;
        let session_pick = match session {
            None => None,
            Some(sid) => {
                let at = bound.as_ref().and_then(|b| {
                    decode
                        .iter()
                        .position(|s| &self.workers.slot(s.slot).id == b)
                });
                match at {
                    Some(i) if !decode[i].busy => {
                        session_note = Some(format!(
                            "; session {sid} bound to {}",
                            self.workers.slot(decode[i].slot).id
                        ));
                        Some(i)
                    }
                    _ => {
                        // First turn, or the bound worker left, is avoided or
                        // saturated (released): rendezvous among the
                        // eligible candidates holding the longest prefix.
                        let best = decode
                            .iter()
                            .filter(|s| eligible(s))
                            .map(|s| s.overlap_blocks)
                            .fold(f64::NEG_INFINITY, f64::max);
                        let i = decode
                            .iter()
                            .enumerate()
                            .filter(|(_, s)| eligible(s) && s.overlap_blocks >= best)
                            .max_by_key(|(_, s)| rendezvous(sid, &self.workers.slot(s.slot).id))
                            .map(|(i, _)| i);
                        if let Some(i) = i {
                            let to = &self.workers.slot(decode[i].slot).id;
                            session_note = Some(match &bound {
                                Some(b) => format!("; session {sid} released from {b} (left, avoided or saturated), bound to {to}"),
                                None => format!("; session {sid} bound to {to} (its first turn: rendezvous among the longest prefixes)"),
                            });
                        }
                        i
                    }
                }
            }
        };
        let d_pick = match session_pick {
            Some(i) => i,
            None => {
                pick(decode, eligible, dcfg.temperature, rng).ok_or(RouteError::NoDecodeWorker)?
            }
        };
        score_prefill(&self.config.prefill, &self.workers, depths, &shape, prefill);
        prefill.retain(|s| !avoid.contains(&s.slot));
        let p_pick = pick(prefill, |_| true, self.config.prefill.temperature, rng);

        let held = |depth: PrefixDepth| HeldTokens {
            device: depth.device.saturating_mul(bs).min(isl),
            host: depth.host.saturating_mul(bs).min(isl),
            disk: depth.disk.saturating_mul(bs).min(isl),
        };
        let candidate = |s: &Scored| {
            let slot = self.workers.slot(s.slot);
            slot.record.as_ref().map(|record| Candidate {
                id: &slot.id,
                record,
                load: s.load,
                held: held(s.depth),
            })
        };
        let d = candidate(&decode[d_pick]).ok_or(RouteError::NoDecodeWorker)?;
        let p = p_pick.and_then(|i| candidate(&prefill[i]));
        let holder_pick = best_holder(decode, d_pick, prefill, p_pick);
        let holder = holder_pick.and_then(|(side, i)| match side {
            Side::Decode => candidate(&decode[i]),
            Side::Prefill => candidate(&prefill[i]),
        });
        // Where a bypass could go instead of the chosen decode worker, for
        // the policy that weighs it (the SLA policy: the static ones keep
        // Dynamo's semantics): the eligible one holding the most of the
        // prompt, when that is more than the chosen one holds and the
        // decode gate would let a bypass run there (a session's turns stay
        // where they are).
        let weighs_alternatives = self.policy.weighs_alternatives();
        let serves_bypass = |s: &Scored| {
            self.workers
                .slot(s.slot)
                .capabilities()
                .serves(Path::Bypass)
        };
        let decode_holder_pick = match session_pick {
            Some(_) => None,
            None if !weighs_alternatives || !dcfg.offer_holder || p.is_none() => None,
            None => decode
                .iter()
                .enumerate()
                .filter(|&(i, s)| {
                    i != d_pick
                        && eligible(s)
                        && serves_bypass(s)
                        && s.overlap_blocks > decode[d_pick].overlap_blocks
                        && self.config.gate.check(&s.load, shape.request_blocks).fits
                })
                .fold(None, |best: Option<(usize, &Scored)>, (i, s)| match best {
                    Some((_, b)) if b.overlap_blocks >= s.overlap_blocks => best,
                    _ => Some((i, s)),
                })
                .map(|(i, _)| i),
        };
        let decode_holder = decode_holder_pick.and_then(|i| candidate(&decode[i]));
        let offer = p.as_ref().and_then(|p| {
            let (side, i) = holder_pick?;
            // The source serves a read of its blocks only if its engine
            // serves remote decodes (NIXL); an SGLang decode server does not.
            if matches!(side, Side::Decode)
                && !self
                    .workers
                    .slot(decode[i].slot)
                    .capabilities()
                    .remote_decode
            {
                return None;
            }
            fetch::offer(&self.config.fetch, isl, bs, holder.map(|h| (side, h)), p)
        });

        // Policy.
        let factors = self.calibration.factors();
        let input = p.as_ref().map(|p| PolicyInput {
            isl_tokens: isl,
            expected_output_tokens: req.expected_output_tokens,
            block_size: bs,
            decode: d,
            prefill: *p,
            holder,
            decode_holder,
            tier_weights: self.config.decode.tier_weights,
            calibration: factors,
            fetch: offer,
        });
        let verdict = match &input {
            Some(input) => self.policy.decide(input),
            None => Verdict::new(
                Path::Bypass,
                rules::NO_PREFILL_WORKER,
                format!(
                    "no prefill worker registered: aggregated on {}, local prefill of {} of {isl} tokens",
                    d.id,
                    isl - d.held.any()
                ),
            ),
        };

        // The decode gate.
        let mut path = verdict.path;
        let mut rule = verdict.rule;
        // The decode worker the verdict is about.
        let verdict_d = match decode_holder_pick {
            Some(i) if verdict.on_decode_holder && path == Path::Bypass => i,
            _ => d_pick,
        };
        let mut final_d = verdict_d;
        let mut gate_check = None;
        let mut veto = None;
        if let (Path::Bypass, Some(p)) = (path, &p) {
            let gate = &self.config.gate;
            let check = gate.check(&decode[verdict_d].load, shape.request_blocks);
            gate_check = Some(check);
            if !check.fits {
                path = Path::Remote;
                rule = if check.known {
                    rules::GATE_KV_BUDGET
                } else {
                    rules::GATE_NO_SIGNAL
                };
                let room =
                    |s: &Scored| eligible(s) && gate.check(&s.load, shape.request_blocks).fits;
                // A session's decode stays where its turns are.
                let moved = if session_pick.is_some() {
                    None
                } else {
                    pick(decode, room, dcfg.temperature, rng)
                };
                if let Some(m) = moved {
                    final_d = m;
                }
                let capacity = decode[verdict_d].load.kv_capacity_blocks;
                let checked = &self.workers.slot(decode[verdict_d].slot).id;
                let target = match moved {
                    Some(m) => format!(
                        "decode moved to {}, which has room",
                        self.workers.slot(decode[m].slot).id
                    ),
                    None => format!("no decode worker has room, decode stays on {checked}"),
                };
                veto = Some(if check.known {
                    format!(
                        "; vetoed by the decode gate: {} would use {} + {} = {} > {:.2} × {capacity} = {:.0} KV blocks: remote prefill on {}, {target}",
                        checked,
                        check.used_blocks,
                        check.request_blocks,
                        check.used_blocks.saturating_add(check.request_blocks),
                        gate.budget_fraction,
                        check.budget_blocks,
                        p.id,
                    )
                } else {
                    format!(
                        "; vetoed by the decode gate: {}'s KV capacity is unknown (no signal): remote prefill on {}, {target}",
                        checked, p.id,
                    )
                });
            }
        }

        // Capabilities: the decode worker must serve the path's decode leg
        // (an SGLang decode server without the bootstrap handshake takes
        // no remote decode; one without `do_local_prefill` no bypass).
        let serves = |s: &Scored, path: Path| self.workers.slot(s.slot).capabilities().serves(path);
        if !serves(&decode[final_d], path) {
            let can = |s: &Scored| eligible(s) && serves(s, path);
            let any = |s: &Scored| serves(s, path);
            let moved = if session_pick.is_some()
                && serves(&decode[final_d], Path::Bypass) != serves(&decode[final_d], Path::Remote)
            {
                // A session's worker serves the other path: it stays.
                None
            } else {
                pick(decode, can, dcfg.temperature, rng)
                    .or_else(|| pick(decode, any, dcfg.temperature, rng))
            };
            let before = self.workers.slot(decode[final_d].slot);
            let (before, before_caps) = (before.id.clone(), before.capabilities().names());
            match moved {
                Some(m) => {
                    final_d = m;
                    veto.get_or_insert_with(String::new).push_str(&format!(
                        "; {before} cannot serve a {} decode (capabilities {before_caps}): decode moved to {}",
                        path.as_str(),
                        self.workers.slot(decode[m].slot).id
                    ));
                }
                None => {
                    let other = match path {
                        Path::Bypass => Path::Remote,
                        Path::Remote | Path::RemoteFetch => Path::Bypass,
                    };
                    if other == Path::Remote && p.is_none() {
                        return Err(RouteError::NoCapableDecodeWorker {
                            path: path.as_str(),
                        });
                    }
                    let can = |s: &Scored| eligible(s) && serves(s, other);
                    let any = |s: &Scored| serves(s, other);
                    let m = if serves(&decode[final_d], other) {
                        final_d
                    } else {
                        pick(decode, can, dcfg.temperature, rng)
                            .or_else(|| pick(decode, any, dcfg.temperature, rng))
                            .ok_or(RouteError::NoCapableDecodeWorker {
                                path: path.as_str(),
                            })?
                    };
                    veto.get_or_insert_with(String::new).push_str(&format!(
                        "; no decode worker can serve a {} decode: {} on {}",
                        path.as_str(),
                        other.as_str(),
                        self.workers.slot(decode[m].slot).id
                    ));
                    final_d = m;
                    path = other;
                    rule = rules::CAPABILITY_OTHER_PATH;
                }
            }
        }

        // The third path: the SLA policy weighed it; for any other policy a
        // remote verdict fetches what the router offers (as does a bypass
        // the gate vetoed, whatever the policy).
        let vetoed = veto.is_some();
        let fetch = match (path, offer) {
            (Path::RemoteFetch, Some(o)) => Some(o),
            (Path::Remote, Some(o)) if !weighs_alternatives || vetoed => {
                path = Path::RemoteFetch;
                Some(o)
            }
            (Path::RemoteFetch, None) => {
                // A policy may fetch only what was offered.
                path = Path::Remote;
                None
            }
            _ => None,
        };
        let fetch_note = match (&fetch, weighs_alternatives && !vetoed) {
            (Some(o), false) => Some(format!(
                "; prefix fetched: {} of {} prefix tokens pulled from {} ({} blocks pinned there while read), {} tokens prefilled",
                o.pulled_tokens,
                o.prefix_tokens,
                o.source.id,
                o.pulled_tokens.div_ceil(bs),
                isl - o.prefix_tokens,
            )),
            _ => None,
        };

        // The decision, and its charge to the ledger.
        let final_slot = decode[final_d].slot;
        let d_final = if final_d == d_pick {
            d
        } else {
            candidate(&decode[final_d]).ok_or(RouteError::NoDecodeWorker)?
        };
        let prefill_overlap_tokens = p.as_ref().map_or(0, |p| p.held.any());
        let (prefiller, prefill_tokens) = match (path, p_pick, &fetch) {
            (Path::RemoteFetch, Some(i), Some(o)) => (prefill[i].slot, isl - o.prefix_tokens),
            (Path::Remote, Some(i), _) => (prefill[i].slot, isl - prefill_overlap_tokens),
            _ => (final_slot, isl - d_final.held.any()),
        };
        let pin = fetch.as_ref().and_then(|o| {
            let slot = self.workers.slot_index(o.source.id)?;
            Some((slot, u64::from(o.pulled_tokens.div_ceil(bs))))
        });
        if let Some(e) = explain {
            let score = |s: &Scored| CandidateScore {
                worker: self.workers.slot(s.slot).id.clone(),
                depth: s.depth,
                overlap_blocks: s.overlap_blocks,
                load: s.load,
                busy: s.busy,
                cost: s.cost,
            };
            *e = Explanation {
                request_blocks: shape.request_blocks,
                decode: decode.iter().map(score).collect(),
                decode_pick: Some(d_pick),
                prefill: prefill.iter().map(score).collect(),
                prefill_pick: p_pick,
                holder: holder_pick,
                decode_holder: decode_holder_pick,
                policy_params: self.policy.params(),
                calibration: factors,
                verdict: p.is_some().then(|| verdict.clone()),
                gate: gate_check,
                session: session.map(|id| SessionInput {
                    id: id.clone(),
                    bound: bound.clone(),
                }),
            };
        }

        let mut reason = verdict.reason;
        if let Some(veto) = veto {
            reason.push_str(&veto);
        }
        if let Some(note) = fetch_note {
            reason.push_str(&note);
        }
        if let Some(note) = session_note {
            reason.push_str(&note);
        }
        if let Some(sid) = session {
            let worker = d_final.id.clone();
            self.sessions
                .bind(&self.config.session, sid, &worker, now_ms);
        }
        let decision = RouteDecision {
            id,
            request_id: req.request_id.to_owned(),
            path,
            decode: d_final.id.clone(),
            prefill: match path {
                Path::Remote | Path::RemoteFetch => p.as_ref().map(|p| p.id.clone()),
                Path::Bypass => None,
            },
            isl_tokens: isl,
            decode_overlap_tokens: d_final.held.any(),
            prefill_overlap_tokens,
            reserved_decode_blocks: shape.request_blocks,
            reserved_prefill_tokens: u64::from(prefill_tokens),
            policy: self.policy.name().to_owned(),
            rule: rule.to_owned(),
            reason,
            at_ms: now_ms,
            fetch: fetch.as_ref().map(|o| PrefixFetch {
                source: o.source.id.clone(),
                prefix_tokens: o.prefix_tokens,
                pulled_tokens: o.pulled_tokens,
            }),
        };

        // What the calibration will compare with the observations: the
        // prediction for the path taken (the gate's veto included), on the
        // decode worker the verdict was about.
        if let (Policy::SlaDynamic(sla), Some(input)) = (&self.policy, &input) {
            let input = match decode_holder {
                Some(h) if verdict_d != d_pick => PolicyInput {
                    decode: h,
                    ..*input
                },
                _ => *input,
            };
            self.calibration
                .expect(id, now_ms, sla.expected(&input, path));
        }

        self.workers.charge(
            id,
            Charge {
                decode: final_slot,
                prefiller,
                prefill_tokens: u64::from(prefill_tokens),
                decode_blocks: shape.request_blocks,
                cache_blocks: cache_blocks(&decision, bs),
                pin,
                at_ms: now_ms,
            },
        );
        Ok(decision)
    }
}
