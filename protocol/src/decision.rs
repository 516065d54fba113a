//! Routing decisions and the annotation that travels with a request.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{DecisionId, WorkerId};

/// The three ways to serve a request. Its name (`"bypass"`, `"remote"`,
/// `"remote_fetch"`) in JSON and other human-readable formats, a byte in
/// msgpack; JSON readers take the name or the byte. The bytes of the first
/// two never change (older decision logs hold them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Path {
    /// Straight to the decode worker, which prefills locally what it lacks.
    Bypass = 0,
    /// Prefill on a prefill worker, KV moved to the decode worker.
    Remote = 1,
    /// Remote prefill with the prefix fetched from where it lives: the
    /// prefill worker first pulls the prefix a decode worker holds
    /// ([`PrefixFetch`], D -> P), prefills only the rest, and its KV moves
    /// to the decode worker as for [`Path::Remote`].
    RemoteFetch = 2,
}

impl Path {
    pub fn as_str(self) -> &'static str {
        match self {
            Path::Bypass => "bypass",
            Path::Remote => "remote",
            Path::RemoteFetch => "remote_fetch",
        }
    }

    /// Whether a prefill worker runs the prefill (remote, with or without
    /// a fetched prefix).
    pub fn is_remote(self) -> bool {
        !matches!(self, Path::Bypass)
    }

    /// Every path, in byte order.
    pub const ALL: [Path; 3] = [Path::Bypass, Path::Remote, Path::RemoteFetch];
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
                f.write_str("a path (\"bypass\", \"remote\", \"remote_fetch\", or its byte)")
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
                    "remote_fetch" => Ok(Path::RemoteFetch),
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
            2 => Ok(Path::RemoteFetch),
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
    /// The prefill worker; `Some` exactly when `path` is remote
    /// ([`Path::is_remote`]).
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
    /// The prefix the prefill worker pulls first; `Some` exactly when
    /// `path` is [`Path::RemoteFetch`] (absent in older entries).
    #[serde(default)]
    pub fetch: Option<PrefixFetch>,
}

/// The prefix a [`Path::RemoteFetch`] prefill worker pulls from the worker
/// that holds it before it prefills the rest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixFetch {
    /// The worker that supplies the prefix (a decode worker holding the
    /// conversation); its blocks stay pinned while they are read.
    pub source: WorkerId,
    /// Leading prompt tokens the source holds (whole blocks): the prefix
    /// the prefill worker holds once the pull is done.
    pub prefix_tokens: u32,
    /// Tokens pulled: `prefix_tokens` less what the prefill worker held
    /// already (`prefill_overlap_tokens`).
    pub pulled_tokens: u32,
}

impl PrefixFetch {
    /// The blocks pulled, of `block_size` tokens.
    pub fn pulled_blocks(&self, block_size: u32) -> u64 {
        u64::from(self.pulled_tokens.div_ceil(block_size.max(1)))
    }
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
            fetch: self.fetch.clone(),
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
    /// The prefix the prefill worker pulls first ([`Path::RemoteFetch`];
    /// absent from older senders).
    #[serde(default)]
    pub fetch: Option<PrefixFetch>,
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
        // The third path, and the first two's bytes unchanged.
        for (byte, path) in Path::ALL.into_iter().enumerate() {
            assert_eq!(rmp_serde::to_vec(&path).unwrap(), [byte as u8]);
            let name = serde_json::to_string(&path).unwrap();
            assert_eq!(serde_json::from_str::<Path>(&name).unwrap(), path);
        }
        assert_eq!(
            serde_json::to_string(&Path::RemoteFetch).unwrap(),
            "\"remote_fetch\""
        );
    }
}
