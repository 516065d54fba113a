//! The event log as a debugging tool.
//!
//! An [`Export`] holds a window of the cluster's logs: the index snapshot
//! before it and the deltas after, the workers' KV batches, the decision
//! log (each decision with everything it depended on) and the live
//! indexer's digest at the end. From it, [`replay`] rebuilds the index at
//! each decision's position and re-decides it with the core that made it
//! (`router::Replayer`), with the recorded settings (`verify`) or others
//! (`what-if`).

pub mod file;
pub mod live;
pub mod simulate;

use std::time::{Duration, Instant};

use protocol::{DecisionRecord, Path, RouteDecision};
use router::{difference, DepthMismatch, Overrides, ReplayError, Replayed, Replayer};

pub use file::{Export, ExportError};

/// Why a window cannot be replayed at all.
#[derive(Debug, thiserror::Error)]
pub enum WindowError {
    #[error("the snapshot cannot be restored: {0}")]
    Snapshot(#[from] kv_indexer::RestoreError),
    #[error("delta {got} follows delta {at}: the export misses deltas {} to {}", at + 1, got - 1)]
    DeltaGap { at: u64, got: u64 },
    #[error("no decision {0} in the window")]
    UnknownDecision(String),
}

/// One decision replayed.
#[derive(Debug)]
pub struct Outcome<'a> {
    pub record: &'a DecisionRecord,
    pub replayed: Result<Replayed, ReplayError>,
}

impl Outcome<'_> {
    /// How the replayed decision differs from the recorded one (also a
    /// replay error, or an index that answered otherwise).
    pub fn mismatch(&self) -> Option<String> {
        match &self.replayed {
            Err(e) => Some(format!("could not re-decide: {e}")),
            Ok(r) => {
                let mut out = difference(&self.record.decision, &r.decision);
                if !r.depth_mismatches.is_empty() {
                    let depths = depth_text(&r.depth_mismatches);
                    out = Some(match out {
                        Some(d) => format!("{d}; {depths}"),
                        None => depths,
                    });
                }
                out
            }
        }
    }
}

fn depth_text(m: &[DepthMismatch]) -> String {
    let parts: Vec<String> = m
        .iter()
        .map(|d| {
            format!(
                "{} held {:?} blocks then, {:?} in the rebuilt index",
                d.worker, d.recorded, d.rebuilt
            )
        })
        .collect();
    format!("index differs: {}", parts.join(", "))
}

/// The index digest at the end of the window against the live indexer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DigestCheck {
    pub delta_seq: u64,
    pub live: u64,
    pub rebuilt: u64,
}

/// Everything a replay of the window found.
#[derive(Debug)]
pub struct Report<'a> {
    pub outcomes: Vec<Outcome<'a>>,
    pub digest: Option<DigestCheck>,
    /// Time spent re-deciding (not rebuilding the index).
    pub decide_time: Duration,
}

/// Replays every decision of the export, each on the index rebuilt up to
/// its position, with `overrides` (none: the recorded settings). Decisions
/// are taken in index order.
pub fn replay<'a>(export: &'a Export, overrides: &Overrides) -> Result<Report<'a>, WindowError> {
    let mut replayer = Replayer::new();
    if let Some(snapshot) = &export.snapshot {
        replayer.restore(snapshot.clone())?;
    }
    let mut deltas = export.deltas.iter().peekable();
    let mut advance = |replayer: &mut Replayer, to: u64| -> Result<(), WindowError> {
        while replayer.replica().applied() < to {
            let Some(delta) = deltas.next_if(|d| d.seq <= to) else {
                break;
            };
            if delta.seq <= replayer.replica().applied() {
                continue; // covered by the snapshot
            }
            replayer
                .apply_delta(delta)
                .map_err(|_| WindowError::DeltaGap {
                    at: replayer.replica().applied(),
                    got: delta.seq,
                })?;
        }
        Ok(())
    };
    let mut order: Vec<&DecisionRecord> = export.decisions.iter().collect();
    order.sort_by_key(|r| r.inputs.delta_seq);
    let mut outcomes = Vec::with_capacity(order.len());
    let mut decide_time = Duration::ZERO;
    for record in order {
        advance(&mut replayer, record.inputs.delta_seq)?;
        let started = Instant::now();
        let replayed = replayer.replay(record, overrides);
        decide_time += started.elapsed();
        outcomes.push(Outcome { record, replayed });
    }
    let digest = match &export.checkpoint {
        Some(c) => {
            advance(&mut replayer, c.delta_seq)?;
            Some(DigestCheck {
                delta_seq: replayer.replica().applied(),
                live: c.digest,
                rebuilt: replayer.replica().index().digest(),
            })
        }
        None => None,
    };
    Ok(Report {
        outcomes,
        digest,
        decide_time,
    })
}

/// Replays the window up to one decision and returns it re-decided (with
/// `overrides`, if any).
pub fn explain(
    export: &Export,
    decision: &str,
    overrides: &Overrides,
) -> Result<(DecisionRecord, Result<Replayed, ReplayError>), WindowError> {
    let record = export
        .decisions
        .iter()
        .find(|r| r.decision.id.to_string() == decision || r.decision.request_id == decision)
        .ok_or_else(|| WindowError::UnknownDecision(decision.to_owned()))?;
    let single = Export {
        snapshot: export.snapshot.clone(),
        deltas: export.deltas.clone(),
        kv_batches: Vec::new(),
        decisions: vec![record.clone()],
        checkpoint: None,
    };
    let mut report = replay(&single, overrides)?;
    let outcome = report.outcomes.pop().expect("one decision");
    Ok((record.clone(), outcome.replayed))
}

/// How decisions changed under other settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Flips {
    pub decisions: usize,
    pub bypass_to_remote: usize,
    pub remote_to_bypass: usize,
    /// Same path, another decode worker.
    pub other_decode_worker: usize,
    pub failed: usize,
    /// Up to ten flipped decisions: (id, before, after).
    pub examples: Vec<(String, String, String)>,
}

fn summary(d: &RouteDecision) -> String {
    match &d.prefill {
        Some(p) => format!("{} ({}) via {p} -> {}", d.path, d.rule, d.decode),
        None => format!("{} ({}) on {}", d.path, d.rule, d.decode),
    }
}

/// Counts the decisions a what-if flips.
pub fn flips(report: &Report<'_>) -> Flips {
    let mut f = Flips {
        decisions: report.outcomes.len(),
        ..Flips::default()
    };
    for o in &report.outcomes {
        let Ok(r) = &o.replayed else {
            f.failed += 1;
            continue;
        };
        let (before, after) = (&o.record.decision, &r.decision);
        let flipped = match (before.path, after.path) {
            (Path::Bypass, Path::Remote) => {
                f.bypass_to_remote += 1;
                true
            }
            (Path::Remote, Path::Bypass) => {
                f.remote_to_bypass += 1;
                true
            }
            _ if before.decode != after.decode => {
                f.other_decode_worker += 1;
                true
            }
            _ => false,
        };
        if flipped && f.examples.len() < 10 {
            f.examples
                .push((before.id.to_string(), summary(before), summary(after)));
        }
    }
    f
}
