//! The router's pure decision core: no IO, no clock, no ambient randomness.
//!
//! * [`workers`]: registered workers, load reports and the in-flight ledger;
//! * [`select`]: decode and prefill selection;
//! * [`policy`]: bypass or remote prefill, and [`policy::registry`], the
//!   one place that names the policies and their parameters;
//! * [`gate`]: the decode gate;
//! * [`breaker`]: the circuit breaker taking a repeatedly failing worker
//!   out of rotation ([`Breakers`]);
//! * [`admission`]: the bounded queue of requests waiting while every
//!   decode worker is busy ([`Admission`]);
//! * [`fetch`]: the third path's settings and offer ([`FetchConfig`]);
//! * [`calibrate`]: the SLA policy's online calibration ([`Calibration`]);
//! * [`peers`]: the peer replicas' presence and the decisions of theirs
//!   the ledger holds ([`Peers`]);
//! * [`session`]: session affinity ([`Sessions`], [`SessionConfig`]);
//! * [`config`]: [`RouterConfig`], what the core is configured with;
//! * [`decide`]: [`RouterCore`], which puts them together, and the
//!   decision record;
//! * [`replay`]: re-deciding a recorded decision ([`Replayer`]).

pub mod admission;
pub mod breaker;
pub mod calibrate;
pub mod config;
pub mod decide;
pub mod fetch;
pub mod gate;
pub mod peers;
pub mod policy;
pub mod replay;
pub mod select;
pub mod session;
pub mod workers;

pub use admission::{Admission, AdmissionConfig, Offer};
pub use breaker::{BreakerConfig, BreakerState, Breakers, Transition};
pub use calibrate::{Calibration, Expected, Factors};
pub use config::{ConfigError, RouterConfig, TUNED_PARAMS};
pub use decide::{
    decision_seed, CandidateScore, Explanation, RouteError, RouteOptions, RouteRequest, Routed,
    RouterCore,
};
pub use fetch::{FetchConfig, FetchOption};
pub use gate::{GateCheck, GateConfig};
pub use peers::{Heard, PeerConfig, PeerGone, Peers};
pub use policy::{
    parse_param, rules, AlwaysDisagg, Candidate, ConditionalDisaggPolicy, CostModel,
    FetchPrediction, HeldTokens, IslBased, IslOrLoad, LoadBased, NeverDisagg, ParamError,
    ParamSpec, Policy, PolicyInput, PolicyName, PolicySpec, SlaDynamic, SlaPrediction, Verdict,
    POLICIES,
};
pub use replay::{difference, DepthMismatch, Overrides, ReplayError, Replayed, Replayer};
pub use select::{DecodeSelection, PrefillSelection, Side, TierWeights};
pub use session::{SessionConfig, Sessions};
pub use workers::{Charges, EffectiveLoad, LedgerConfig, Workers};
