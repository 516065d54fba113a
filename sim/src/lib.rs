//! The cluster simulator: runs a whole conditional-disaggregation cluster
//! in virtual time through the real router, index and agent (KV batch)
//! cores and the engine model, and compares deployments and policies on a
//! workload.

pub mod capacity;
pub mod cluster;
pub mod compare;
pub mod deployment;
pub mod exports;
pub mod floor;
pub mod metrics;
pub mod plot;
pub mod reuse;
pub mod tune;
pub mod workload;

pub use capacity::{Capacity, Search};
pub use cluster::{simulate, RunResult, SimConfig, SimError};
pub use deployment::{conditional_policies, Deployment};
pub use exports::KvExport;
pub use metrics::{
    ExportFigures, Misses, MissesByPath, MissesByRule, Percentiles, RequestRecord, RunSummary, Slo,
};
pub use worker_agent::core::OutboxLimits;
