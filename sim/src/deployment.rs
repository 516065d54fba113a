//! Deployments to compare: the same GPUs, organised three ways.

use protocol::Role;
use router::{AlwaysDisagg, NeverDisagg, Policy, SlaDynamic, POLICIES};

/// How the GPUs are organised.
#[derive(Debug, Clone, PartialEq)]
pub enum Deployment {
    /// Every request: prefill on P, KV to D, decode on D.
    Disaggregated { prefill: u32, decode: u32 },
    /// Every worker prefills and decodes; KV-aware routing.
    Aggregated { workers: u32 },
    /// P and D workers; a policy decides per request.
    Conditional {
        prefill: u32,
        decode: u32,
        policy: Policy,
    },
}

impl Deployment {
    /// A short name for tables and legends.
    pub fn name(&self) -> String {
        match self {
            Deployment::Disaggregated { prefill, decode } => format!("disagg {prefill}P+{decode}D"),
            Deployment::Aggregated { workers } => format!("agg {workers}"),
            Deployment::Conditional {
                prefill,
                decode,
                policy,
            } => format!("c/d {} {prefill}P+{decode}D", policy.name()),
        }
    }

    /// Prefill and decode (or aggregated) workers.
    pub fn split(&self) -> (u32, u32) {
        match *self {
            Deployment::Disaggregated { prefill, decode }
            | Deployment::Conditional {
                prefill, decode, ..
            } => (prefill, decode),
            Deployment::Aggregated { workers } => (0, workers),
        }
    }

    /// The workers' roles, prefill workers first.
    pub fn roles(&self) -> Vec<Role> {
        let (p, d, role) = match *self {
            Deployment::Disaggregated { prefill, decode }
            | Deployment::Conditional {
                prefill, decode, ..
            } => (prefill, decode, Role::Decode),
            Deployment::Aggregated { workers } => (0, workers, Role::Both),
        };
        std::iter::repeat_n(Role::Prefill, p as usize)
            .chain(std::iter::repeat_n(role, d as usize))
            .collect()
    }

    /// The router policy: remote always, never, or the C/D policy.
    pub fn policy(&self) -> Policy {
        match self {
            Deployment::Disaggregated { .. } => AlwaysDisagg.into(),
            Deployment::Aggregated { .. } => NeverDisagg.into(),
            Deployment::Conditional { policy, .. } => policy.clone(),
        }
    }

    /// Every deployment of `workers` workers: aggregated; disaggregated
    /// with `prefill` prefill workers and, as disaggregation needs more
    /// prefill capacity than C/D, also with half of the workers; C/D with
    /// `prefill` prefill workers and each of `policies`.
    pub fn all(workers: u32, prefill: u32, policies: &[Policy]) -> Vec<Deployment> {
        let decode = workers - prefill;
        let mut out = vec![
            Deployment::Aggregated { workers },
            Deployment::Disaggregated { prefill, decode },
        ];
        let half = workers / 2;
        if half != prefill && half > 0 {
            out.push(Deployment::Disaggregated {
                prefill: half,
                decode: workers - half,
            });
        }
        for policy in policies {
            out.push(Deployment::Conditional {
                prefill,
                decode,
                policy: policy.clone(),
            });
        }
        out
    }
}

/// The C/D policies a comparison runs: every policy of the registry that
/// decides per request (not the two fixed ones, which are the aggregated
/// and disaggregated deployments), with its defaults; the SLA policy with
/// the comparison's SLO as its targets and nothing else (its cost model's
/// defaults, corrected online by the router core's calibration: what an
/// operator would set).
pub fn conditional_policies(slo: (f64, f64)) -> Vec<Policy> {
    POLICIES
        .iter()
        .map(|spec| spec.default_policy())
        .filter(|p| !matches!(p, Policy::AlwaysDisagg(_) | Policy::NeverDisagg(_)))
        .map(|p| match p {
            Policy::SlaDynamic(_) => SlaDynamic::with_slo(slo.0, slo.1).into(),
            other => other,
        })
        .collect()
}
