//! Routing decisions and the annotation that travels with a request.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{DecisionId, WorkerId};

/// The two ways to serve a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "u8", try_from = "u8")]
pub enum Path {
    /// Straight to the decode worker, which prefills locally what it lacks.
    Bypass = 0,
    /// Prefill on a prefill worker, KV moved to the decode worker.
    Remote = 1,
}

impl Path {
    pub fn as_str(self) -> &'static str {
        match self {
            Path::Bypass => "bypass",
            Path::Remote => "remote",
        }
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<Path> for u8 {
    fn from(p: Path) -> u8 {
        p as u8
    }
}

/// A byte that is not a [`Path`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown path {0}")]
pub struct UnknownPath(pub u8);

impl TryFrom<u8> for Path {
    type Error = UnknownPath;

    fn try_from(v: u8) -> Result<Self, Self::Error> {
        match v {
            0 => Ok(Path::Bypass),
            1 => Ok(Path::Remote),
            other => Err(UnknownPath(other)),
        }
    }
}

/// What a router decided for one request, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteDecision {
    pub id: DecisionId,
    pub request_id: String,
    pub path: Path,
    pub decode: WorkerId,
    /// The prefill worker; `Some` exactly when `path` is `Remote`.
    pub prefill: Option<WorkerId>,
    /// Prompt length in tokens.
    pub isl_tokens: u32,
    /// Leading prompt tokens the decode worker already holds.
    pub decode_overlap_tokens: u32,
    /// Leading prompt tokens the chosen (or best) prefill worker holds.
    pub prefill_overlap_tokens: u32,
    /// KV blocks reserved on the decode worker until the request finishes.
    pub reserved_decode_blocks: u64,
    /// Prefill tokens charged to the worker that prefills.
    pub reserved_prefill_tokens: u64,
    pub policy: String,
    /// Short, low-cardinality name of the rule that decided (a metrics label).
    pub rule: String,
    /// The rule with the numbers that decided it, for people.
    pub reason: String,
    /// Router clock when decided, in milliseconds.
    pub at_ms: u64,
}

impl RouteDecision {
    /// The part of the decision that travels with the request to workers.
    pub fn annotation(&self) -> Annotation {
        Annotation {
            decision: self.id,
            path: self.path,
            decode: self.decode.clone(),
            prefill: self.prefill.clone(),
            decode_overlap_tokens: self.decode_overlap_tokens,
            prefill_overlap_tokens: self.prefill_overlap_tokens,
        }
    }

    /// The worker that runs this request's prefill.
    pub fn prefilling_worker(&self) -> &WorkerId {
        self.prefill.as_ref().unwrap_or(&self.decode)
    }
}

/// Travels with a routed request, so that workers know what to do and logs
/// on every side name the decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Annotation {
    pub decision: DecisionId,
    pub path: Path,
    pub decode: WorkerId,
    pub prefill: Option<WorkerId>,
    /// Tokens the router expected the decode worker to hold already (to set
    /// beside the engine's actual cached tokens).
    pub decode_overlap_tokens: u32,
    pub prefill_overlap_tokens: u32,
}
