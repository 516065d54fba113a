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

use protocol::{DecisionRecord, ResolveError, RouteDecision};
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
    #[error("the export cannot be read back: {0}")]
    Resolve(#[from] ResolveError),
}

/// Why a logged decision was not re-decided.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The export lacks what its entry refers to.
    #[error(transparent)]
    Unresolved(#[from] ResolveError),
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

/// One decision replayed.
#[derive(Debug)]
pub struct Outcome {
    /// The decision as logged.
    pub decision: RouteDecision,
    pub replayed: Result<Replayed, Failure>,
}

impl Outcome {
    /// How the replayed decision differs from the recorded one (also a
    /// replay error, or an index that answered otherwise).
    pub fn mismatch(&self) -> Option<String> {
        match &self.replayed {
            Err(e) => Some(format!("could not re-decide: {e}")),
            Ok(r) => {
                let mut out = difference(&self.decision, &r.decision);
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
pub struct Report {
    pub outcomes: Vec<Outcome>,
    pub digest: Option<DigestCheck>,
    /// Time spent re-deciding (not rebuilding the index).
    pub decide_time: Duration,
}

/// Replays every decision of the export, each on the index rebuilt up to
/// its position, with `overrides` (none: the recorded settings). Decisions
/// are taken in index order.
pub fn replay(export: &Export, overrides: &Overrides) -> Result<Report, WindowError> {
    replay_records(export, export.records(), overrides)
}

/// [`replay`] of records already read back from the export's log (an
/// error for each entry that could not be).
fn replay_records(
    export: &Export,
    records: Vec<Result<DecisionRecord, ResolveError>>,
    overrides: &Overrides,
) -> Result<Report, WindowError> {
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
    let mut order: Vec<_> = export.decisions.iter().zip(records).collect();
    order.sort_by_key(|(logged, _)| logged.delta_seq);
    let mut outcomes = Vec::with_capacity(order.len());
    let mut decide_time = Duration::ZERO;
    for (logged, record) in order {
        let replayed = match record {
            Err(e) => Err(Failure::from(e)),
            Ok(record) => {
                advance(&mut replayer, record.inputs.delta_seq)?;
                let started = Instant::now();
                let replayed = replayer.replay(&record, overrides);
                decide_time += started.elapsed();
                replayed.map_err(Failure::from)
            }
        };
        outcomes.push(Outcome {
            decision: logged.decision.clone(),
            replayed,
        });
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
) -> Result<(DecisionRecord, Result<Replayed, Failure>), WindowError> {
    let at = export
        .decisions
        .iter()
        .position(|d| d.decision.id.to_string() == decision || d.decision.request_id == decision)
        .ok_or_else(|| WindowError::UnknownDecision(decision.to_owned()))?;
    let record = export.records().swap_remove(at)?;
    let single = Export {
        snapshot: export.snapshot.clone(),
        deltas: export.deltas.clone(),
        decisions: vec![export.decisions[at].clone()],
        ..Export::default()
    };
    let mut report = replay_records(&single, vec![Ok(record.clone())], overrides)?;
    let outcome = report.outcomes.pop().expect("one decision");
    Ok((record, outcome.replayed))
}

/// How decisions changed under other settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Flips {
    pub decisions: usize,
    pub bypass_to_remote: usize,
    pub remote_to_bypass: usize,
    /// Remote both times, with a fetched prefix once only (the third
    /// path, [`protocol::Path::RemoteFetch`], gained or lost).
    pub fetch_changed: usize,
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
pub fn flips(report: &Report) -> Flips {
    let mut f = Flips {
        decisions: report.outcomes.len(),
        ..Flips::default()
    };
    for o in &report.outcomes {
        let Ok(r) = &o.replayed else {
            f.failed += 1;
            continue;
        };
        let (before, after) = (&o.decision, &r.decision);
        let flipped = match (before.path.is_remote(), after.path.is_remote()) {
            (false, true) => {
                f.bypass_to_remote += 1;
                true
            }
            (true, false) => {
                f.remote_to_bypass += 1;
                true
            }
            _ if before.path != after.path => {
                f.fetch_changed += 1;
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
