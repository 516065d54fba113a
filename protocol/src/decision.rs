//! Routing decisions and the annotation that travels with a request.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{DecisionId, WorkerId};

/// The two ways to serve a request. Its name (`"bypass"`, `"remote"`) in
/// JSON and other human-readable formats, a byte in msgpack; JSON readers
/// take the name or the byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
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

impl Serialize for Path {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(self.as_str())
        } else {
            s.serialize_u8(*self as u8)
        }
    }
}

impl<'de> Deserialize<'de> for Path {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Path;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a path (\"bypass\", \"remote\", or its byte)")
            }

            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Path, E> {
                u8::try_from(v)
                    .map_err(|_| E::custom(format!("unknown path {v}")))
                    .and_then(|b| Path::try_from(b).map_err(E::custom))
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Path, E> {
                match v {
                    "bypass" => Ok(Path::Bypass),
                    "remote" => Ok(Path::Remote),
                    other => Err(E::custom(format!("unknown path {other:?}"))),
                }
            }
        }
        if d.is_human_readable() {
            d.deserialize_any(V)
        } else {
            d.deserialize_u8(V)
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_its_name_in_json_and_a_byte_in_msgpack() {
        assert_eq!(serde_json::to_string(&Path::Remote).unwrap(), "\"remote\"");
        assert_eq!(
            serde_json::from_str::<Path>("\"bypass\"").unwrap(),
            Path::Bypass
        );
        assert_eq!(serde_json::from_str::<Path>("1").unwrap(), Path::Remote);
        assert!(serde_json::from_str::<Path>("\"sideways\"").is_err());
        assert!(serde_json::from_str::<Path>("7").is_err());
        let packed = rmp_serde::to_vec(&Path::Remote).unwrap();
        assert_eq!(packed, [1]);
        assert_eq!(
            rmp_serde::from_slice::<Path>(&packed).unwrap(),
            Path::Remote
        );
    }
}
