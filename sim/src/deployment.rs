//! Deployments to compare: the same GPUs, organised three ways.

use engine_sim::{KvTransfer, Preset};
use protocol::Role;
use router::{
    AlwaysDisagg, ConditionalDisaggPolicy, CostModel, IslBased, IslOrLoad, LoadBased, NeverDisagg,
    ParamError, SlaDynamic,
};

/// The per-request decision rule of a C/D deployment.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyKind {
    /// Bypass short appends on the decode worker that holds the context.
    Isl { tokens: u32, ratio: f64 },
    /// Bypass while prefill workers are busy and the decode worker is not.
    Load { prefill_busy: f64, decode_busy: f64 },
    /// Either of the two.
    IslOrLoad,
    /// Predict TTFT and ITL on both paths against SLA targets.
    Sla { ttft_ms: f64, itl_ms: f64 },
    /// Any router policy by name and parameters (see
    /// [`router::policy_from_params`]), e.g. from a decision log.
    Named {
        name: String,
        params: Vec<(String, f64)>,
    },
}

impl PolicyKind {
    pub fn label(&self) -> &str {
        match self {
            PolicyKind::Isl { .. } => "isl",
            PolicyKind::Load { .. } => "load",
            PolicyKind::IslOrLoad => "isl-or-load",
            PolicyKind::Sla { .. } => "sla",
            PolicyKind::Named { name, .. } => name,
        }
    }

    /// The router policy, with cost constants from the engines' preset and
    /// the KV link.
    pub fn policy(
        &self,
        preset: &Preset,
        link: &KvTransfer,
    ) -> Result<Box<dyn ConditionalDisaggPolicy>, ParamError> {
        Ok(match *self {
            PolicyKind::Isl { tokens, ratio } => Box::new(IslBased {
                eff_isl_tokens: tokens,
                eff_isl_ratio: ratio,
            }),
            PolicyKind::Load {
                prefill_busy,
                decode_busy,
            } => Box::new(LoadBased {
                prefill_busy,
                decode_busy,
            }),
            PolicyKind::IslOrLoad => Box::new(IslOrLoad::default()),
            PolicyKind::Sla { ttft_ms, itl_ms } => Box::new(SlaDynamic::new(
                ttft_ms,
                itl_ms,
                sla_cost_model(preset, link),
            )),
            PolicyKind::Named {
                ref name,
                ref params,
            } => router::policy_from_params(name, params)?,
        })
    }
}

/// The SLA policy's cost model, from the preset's constants and the link:
/// what an operator would calibrate from live metrics.
pub fn sla_cost_model(preset: &Preset, link: &KvTransfer) -> CostModel {
    let engine = preset.cost_model();
    CostModel {
        prefill_c0_ms: engine.prefill_fixed_ms,
        prefill_c1_ms: engine.prefill_token_ms,
        prefill_c2_ms: engine.prefill_attention_ms,
        decode_t0_ms: engine.decode_fixed_ms,
        decode_per_seq_ms: 0.0,
        decode_per_ctx_token_ms: engine.decode_context_token_ms,
        transfer_setup_ms: link.setup_us as f64 / 1e3,
        transfer_bytes_per_ms: link.bytes_per_s / 1e3,
    }
}

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
        policy: PolicyKind,
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
            } => format!("c/d {} {prefill}P+{decode}D", policy.label()),
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

    pub fn policy(
        &self,
        preset: &Preset,
        link: &KvTransfer,
    ) -> Result<Box<dyn ConditionalDisaggPolicy>, ParamError> {
        match self {
            Deployment::Disaggregated { .. } => Ok(Box::new(AlwaysDisagg)),
            Deployment::Aggregated { .. } => Ok(Box::new(NeverDisagg)),
            Deployment::Conditional { policy, .. } => policy.policy(preset, link),
        }
    }

    /// Every deployment of `workers` workers: aggregated; disaggregated
    /// with `prefill` prefill workers and, as disaggregation needs more
    /// prefill capacity than C/D, also with half of the workers; each C/D
    /// policy with `prefill` prefill workers.
    pub fn all(workers: u32, prefill: u32, slo: (f64, f64)) -> Vec<Deployment> {
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
        for policy in [
            PolicyKind::Isl {
                tokens: 2048,
                ratio: 0.7,
            },
            PolicyKind::Load {
                prefill_busy: LoadBased::default().prefill_busy,
                decode_busy: LoadBased::default().decode_busy,
            },
            PolicyKind::IslOrLoad,
            PolicyKind::Sla {
                ttft_ms: slo.0,
                itl_ms: slo.1,
            },
        ] {
            out.push(Deployment::Conditional {
                prefill,
                decode,
                policy,
            });
        }
        out
    }
}
