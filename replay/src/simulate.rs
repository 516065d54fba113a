//! Handing a window to the simulator: the window's requests become a
//! scripted workload (arrivals at the decisions' times; prompts rebuilt
//! from their block hashes so that requests share exactly the prefixes
//! they shared), run on a deployment shaped like the recorded one, once
//! with the recorded policy and once with the what-if's.

use engine_sim::{KvTransfer, Preset};
use protocol::{DecisionRecord, Role};
use router::Policy;
use sim::workload::{pseudo_tokens, Arrival, RequestSpec, Scripted};
use sim::{simulate, Deployment, OutboxLimits, RunSummary, SimConfig, Slo};

/// A prompt with the record's prefix structure: each full block's tokens
/// derive from its chained hash (equal hashes, equal prefixes), the tail
/// from the decision.
fn prompt(record: &DecisionRecord) -> Vec<u32> {
    let inputs = &record.inputs;
    let bs = inputs.block_size as usize;
    let mut tokens = Vec::with_capacity(record.decision.isl_tokens as usize);
    for hash in &inputs.block_hashes {
        pseudo_tokens(hash.0, bs, &mut tokens);
    }
    let tail = (record.decision.isl_tokens as usize).saturating_sub(tokens.len());
    pseudo_tokens(record.decision.id.0, tail, &mut tokens);
    tokens
}

/// The window as a workload.
pub fn workload(decisions: &[DecisionRecord]) -> Scripted {
    let start = decisions
        .iter()
        .map(|r| r.decision.at_ms)
        .min()
        .unwrap_or(0);
    let arrivals = decisions
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut output = Vec::new();
            pseudo_tokens(
                !r.decision.id.0,
                r.inputs.expected_output_tokens.max(1) as usize,
                &mut output,
            );
            Arrival {
                at_us: (r.decision.at_ms - start) * 1000,
                request: RequestSpec {
                    id: i as u64,
                    session: i as u64,
                    turn: 0,
                    prompt: prompt(r).into(),
                    output: output.into(),
                },
            }
        })
        .collect();
    Scripted::new(arrivals)
}

/// The recorded deployment's shape: prefill workers and decode workers.
pub fn shape(decisions: &[DecisionRecord]) -> (u32, u32) {
    let mut prefill = std::collections::BTreeSet::new();
    let mut decode = std::collections::BTreeSet::new();
    for r in decisions {
        for c in &r.inputs.candidates {
            match c.role {
                Role::Prefill => prefill.insert(c.worker.clone()),
                Role::Decode | Role::Both => decode.insert(c.worker.clone()),
            };
        }
    }
    (prefill.len() as u32, decode.len().max(1) as u32)
}

/// Simulates the window with one policy.
pub fn run(
    decisions: &[DecisionRecord],
    preset: Preset,
    policy: Policy,
    slo: Slo,
) -> Result<RunSummary, sim::SimError> {
    let (prefill, decode) = shape(decisions);
    let block_size = decisions.first().map_or(16, |r| r.inputs.block_size);
    let config = SimConfig {
        preset,
        block_size,
        deployment: Deployment::Conditional {
            prefill,
            decode,
            policy,
        },
        link: KvTransfer::default(),
        index_delay_us: 5_000,
        kv_outbox: OutboxLimits::default(),
        load_interval_us: 100_000,
        expected_output_tokens: 256,
        slo,
        seed: 1,
        warmup_fraction: 0.0,
        fetch: router::FetchConfig::default(),
        kv_export: Default::default(),
        host_offload_gib: 0.0,
        reuse_ceiling: false,
        router_params: Vec::new(),
    };
    Ok(simulate(&config, &mut workload(decisions))?.summary)
}
