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
//! use router::{IslBased, RouterConfig, RouterCore};
//!
//! let contract = HashingContract::for_model("m", 16);
//! let mut core = RouterCore::new(RouterConfig::new(contract.clone()), Box::new(IslBased::default())).unwrap();
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
//!     })
//!     .unwrap();
//! }
//! let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
//! let prompt: Vec<u32> = (0..4000).collect();
//! let decision = core.route_tokens("r1", &prompt, 100, DecisionId(1), 0, &mut rng).unwrap();
//! assert_eq!(decision.rule, "isl.long_prefill");
//! assert_eq!(decision.prefill.unwrap().to_string(), "p0");
//! ```

pub mod core;
#[cfg(feature = "service")]
pub mod explain;
#[cfg(feature = "service")]
pub mod service;

pub use crate::core::{
    decision_seed, difference, policy_from_params, rules, AlwaysDisagg, Candidate, CandidateScore,
    Charges, ConditionalDisaggPolicy, ConfigError, CostModel, DecodeSelection, DepthMismatch,
    EffectiveLoad, Explanation, GateCheck, GateConfig, HeldTokens, IslBased, IslOrLoad,
    LedgerConfig, LoadBased, NeverDisagg, Overrides, ParamError, PolicyInput, PrefillSelection,
    ReplayError, Replayed, Replayer, RouteError, RouteRequest, RouterConfig, RouterCore,
    SlaDynamic, SlaPrediction, TierWeights, Verdict, Workers,
};
