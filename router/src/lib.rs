//! Switchyard's router: for each request, picks a decode worker (KV-aware),
//! a prefill worker, and whether to prefill remotely or bypass (prefill
//! locally on the decode worker).
//!
//! The decisions are made by the sans-IO core ([`core`]): time (`now_ms`)
//! and randomness (an [`rand::Rng`]) are arguments, so that the service,
//! the simulator and replays drive the very same code. The service (HTTP,
//! NATS, etcd) is `service`, behind the default `service` feature; the
//! simulator builds this crate without it.
//!
//! ```
//! use protocol::{DecisionId, HashingContract, Role, WorkerRecord, WorkerSubjects};
//! use rand::SeedableRng;
//! use router::{IslBased, RouteOptions, RouteRequest, RouterConfig, RouterCore};
//!
//! let contract = HashingContract::for_model("m", 16);
//! let mut core = RouterCore::new(RouterConfig::new(contract.clone()), IslBased::default()).unwrap();
//! for (name, role) in [("p0", Role::Prefill), ("d0", Role::Decode)] {
//!     let id = name.parse().unwrap();
//!     core.register(WorkerRecord {
//!         subjects: WorkerSubjects::for_worker(&id),
//!         id,
//!         role,
//!         contract: contract.clone(),
//!         kv_capacity_blocks: 10_000,
//!         max_batched_tokens: 8192,
//!         kv_bytes_per_token: 163_840,
//!         gpus: 1,
//!         max_model_len: 0,
//!         capabilities: Default::default(),
//!     })
//!     .unwrap();
//! }
//! let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
//! let prompt: Vec<u32> = (0..4000).collect();
//! let hashes = core.hasher().hash_prompt(&prompt);
//! let request = RouteRequest {
//!     request_id: "r1",
//!     isl_tokens: prompt.len() as u32,
//!     block_hashes: &hashes,
//!     expected_output_tokens: 100,
//!     session: None,
//! };
//! let routed = core.route(&request, RouteOptions::default(), DecisionId(1), 0, &mut rng).unwrap();
//! assert_eq!(routed.decision.rule, "isl.long_prefill");
//! assert_eq!(routed.decision.prefill.unwrap().to_string(), "p0");
//! ```

pub mod core;
#[cfg(feature = "service")]
pub mod explain;
#[cfg(feature = "service")]
pub mod service;

pub use crate::core::{
    decision_seed, difference, parse_param, rules, AlwaysDisagg, Calibration, Candidate,
    CandidateScore, Charges, ConditionalDisaggPolicy, ConfigError, CostModel, DecodeSelection,
    DepthMismatch, EffectiveLoad, Expected, Explanation, Factors, FetchConfig, FetchOption,
    FetchPrediction, GateCheck, GateConfig, HeldTokens, IslBased, IslOrLoad, LedgerConfig,
    LoadBased, NeverDisagg, Overrides, ParamError, ParamSpec, Policy, PolicyInput, PolicyName,
    PolicySpec, PrefillSelection, ReplayError, Replayed, Replayer, RouteError, RouteOptions,
    RouteRequest, Routed, RouterConfig, RouterCore, Side, SlaDynamic, SlaPrediction, TierWeights,
    Verdict, Workers, POLICIES, TUNED_PARAMS,
};
