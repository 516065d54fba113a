//! Validated identifiers: workers, blocks and decisions.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Longest worker name accepted (bytes).
pub const MAX_WORKER_NAME_LEN: usize = 128;

/// One engine worker, or one data-parallel rank of an engine.
///
/// The name is restricted to `[A-Za-z0-9_-]` so that it is a valid NATS
/// subject token and an etcd key segment. Written as `name` for rank 0 and
/// `name.rank` otherwise; on the wire it travels as that string.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct WorkerId {
    name: Arc<str>,
    dp_rank: u32,
}

/// Why a string is not a [`WorkerId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidWorkerId {
    #[error("worker name is empty")]
    Empty,
    #[error("worker name is longer than {MAX_WORKER_NAME_LEN} bytes")]
    TooLong,
    #[error("worker name {0:?} has a character outside [A-Za-z0-9_-]")]
    BadCharacter(String),
    #[error("data-parallel rank {0:?} is not an unsigned integer")]
    BadRank(String),
}

impl WorkerId {
    /// A worker id from a name and a data-parallel rank.
    pub fn new(name: &str, dp_rank: u32) -> Result<Self, InvalidWorkerId> {
        if name.is_empty() {
            return Err(InvalidWorkerId::Empty);
        }
        if name.len() > MAX_WORKER_NAME_LEN {
            return Err(InvalidWorkerId::TooLong);
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(InvalidWorkerId::BadCharacter(name.to_owned()));
        }
        Ok(Self {
            name: name.into(),
            dp_rank,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn dp_rank(&self) -> u32 {
        self.dp_rank
    }

    /// Two NATS subject tokens, `name.rank`, always with the rank.
    pub fn subject_tokens(&self) -> String {
        format!("{}.{}", self.name, self.dp_rank)
    }
}

impl FromStr for WorkerId {
    type Err = InvalidWorkerId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('.') {
            None => Self::new(s, 0),
            Some((name, rank)) => {
                let rank = rank
                    .parse()
                    .map_err(|_| InvalidWorkerId::BadRank(rank.to_owned()))?;
                Self::new(name, rank)
            }
        }
    }
}

impl TryFrom<String> for WorkerId {
    type Error = InvalidWorkerId;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<WorkerId> for String {
    fn from(id: WorkerId) -> Self {
        id.to_string()
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.dp_rank == 0 {
            f.write_str(&self.name)
        } else {
            write!(f, "{}.{}", self.name, self.dp_rank)
        }
    }
}

impl fmt::Debug for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WorkerId({self})")
    }
}

/// The chained sequence hash of one KV block: it names the block and its
/// whole prefix (see [`crate::hash`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:016x})", self.0)
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Identifies one routing decision across the cluster (logs, decision log,
/// in-flight ledgers of every router replica). Shown as 16 hex digits,
/// and so written in JSON (and other human-readable formats: a u64 there
/// is rounded by JavaScript and `jq`); a u64 in msgpack. JSON readers
/// take the string or a number.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DecisionId(pub u64);

impl Serialize for DecisionId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            s.serialize_u64(self.0)
        }
    }
}

impl<'de> Deserialize<'de> for DecisionId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = DecisionId;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a decision id (16 hex digits, or a u64)")
            }

            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<DecisionId, E> {
                Ok(DecisionId(v))
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DecisionId, E> {
                v.parse().map_err(E::custom)
            }
        }
        if d.is_human_readable() {
            d.deserialize_any(V)
        } else {
            d.deserialize_u64(V)
        }
    }
}

impl fmt::Debug for DecisionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DecisionId({self})")
    }
}

impl fmt::Display for DecisionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Why a string is not a [`DecisionId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("decision id {0:?} is not 1 to 16 hex digits")]
pub struct InvalidDecisionId(pub String);

impl FromStr for DecisionId {
    type Err = InvalidDecisionId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() || s.len() > 16 {
            return Err(InvalidDecisionId(s.to_owned()));
        }
        u64::from_str_radix(s, 16)
            .map(DecisionId)
            .map_err(|_| InvalidDecisionId(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_id_round_trips_through_its_string_form() {
        for (text, name, rank) in [("decode-0", "decode-0", 0), ("p_1.3", "p_1", 3)] {
            let id: WorkerId = text.parse().unwrap();
            assert_eq!((id.name(), id.dp_rank()), (name, rank));
            assert_eq!(id.to_string(), text);
        }
        assert_eq!(WorkerId::new("w", 0).unwrap().subject_tokens(), "w.0");
    }

    #[test]
    fn worker_id_rejects_what_cannot_be_a_subject_token() {
        assert_eq!("".parse::<WorkerId>(), Err(InvalidWorkerId::Empty));
        assert!(matches!(
            "a b".parse::<WorkerId>(),
            Err(InvalidWorkerId::BadCharacter(_))
        ));
        assert!(matches!(
            "a.*".parse::<WorkerId>(),
            Err(InvalidWorkerId::BadRank(_))
        ));
        assert!(matches!(
            "a.1.2".parse::<WorkerId>(),
            Err(InvalidWorkerId::BadRank(_))
        ));
        assert_eq!(
            "x".repeat(129).parse::<WorkerId>(),
            Err(InvalidWorkerId::TooLong)
        );
    }

    #[test]
    fn decision_id_is_hex() {
        let id = DecisionId(0xabc);
        assert_eq!(id.to_string(), "0000000000000abc");
        assert_eq!("0000000000000abc".parse::<DecisionId>().unwrap(), id);
        assert!("xyz".parse::<DecisionId>().is_err());
    }

    /// A string in JSON (no rounding in JavaScript), a number still read.
    #[test]
    fn decision_ids_are_strings_in_json() {
        let id = DecisionId(7_638_884_515_054_312_043);
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"6a02c4fe700b5a6b\"");
        assert_eq!(serde_json::from_str::<DecisionId>(&json).unwrap(), id);
        assert_eq!(
            serde_json::from_str::<DecisionId>("7638884515054312043").unwrap(),
            id
        );
    }
}

/// A conversation's session id, as a client names it (`x-session-id`,
/// Dynamo's `agent_context.session_id`, vllm-project/router's
/// `X-Session-ID`): 1 to [`SessionId::MAX_LEN`] bytes of visible ASCII.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SessionId(String);

/// A string that is not a [`SessionId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("session id {0:?}: expected 1 to 256 visible ASCII characters")]
pub struct InvalidSessionId(pub String);

impl SessionId {
    /// The longest session id accepted, in bytes.
    pub const MAX_LEN: usize = 256;

    pub fn new(s: &str) -> Result<Self, InvalidSessionId> {
        if s.is_empty() || s.len() > Self::MAX_LEN || !s.bytes().all(|b| b.is_ascii_graphic()) {
            let shown: String = s.chars().take(64).collect();
            return Err(InvalidSessionId(shown));
        }
        Ok(Self(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for SessionId {
    type Err = InvalidSessionId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<String> for SessionId {
    type Error = InvalidSessionId;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::new(&s)
    }
}

impl From<SessionId> for String {
    fn from(s: SessionId) -> String {
        s.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({:?})", self.0)
    }
}
