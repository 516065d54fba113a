//! The router's pure decision core: no IO, no clock, no ambient randomness.
//!
//! * [`workers`]: registered workers, load reports and the in-flight ledger;
//! * [`select`]: decode and prefill selection;
//! * [`policy`] (and its SLA model): bypass or remote prefill;
//! * [`gate`]: the decode gate;
//! * [`decide`]: [`RouterCore`], which puts them together.

pub mod decide;
pub mod gate;
pub mod policy;
pub mod replay;
pub mod select;
mod sla;
pub mod workers;

pub use decide::{
    decision_seed, CandidateScore, ConfigError, Explanation, RouteError, RouteRequest,
    RouterConfig, RouterCore,
};
pub use gate::{GateCheck, GateConfig};
pub use policy::{
    rules, AlwaysDisagg, Candidate, ConditionalDisaggPolicy, CostModel, HeldTokens, IslBased,
    IslOrLoad, LoadBased, NeverDisagg, PolicyInput, SlaDynamic, SlaPrediction, Verdict,
};
pub use replay::{
    difference, policy_from_params, DepthMismatch, Overrides, ParamError, ReplayError, Replayed,
    Replayer,
};
pub use select::{DecodeSelection, PrefillSelection, TierWeights};
pub use workers::{Charges, EffectiveLoad, LedgerConfig, Workers};
