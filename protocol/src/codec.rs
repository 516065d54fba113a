//! The wire codec: every message is msgpack `[version, body]`.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::decision::RouteDecision;
use crate::events::{KvEventBatch, LoadReport};
use crate::fragment::RequestFragment;
use crate::generate::{
    CancelRequest, GenerateChunk, GenerateRequest, KvHandleQuery, KvHandleReply, LegProbe,
    LegProbeReply, OverlapQuery, OverlapReply, RequestProgress, ResyncReply,
};
use crate::index::{IndexDelta, IndexSnapshot};
use crate::presence::RouterHeartbeat;
use crate::registry::WorkerRecord;
use crate::replay::IndexStatus;

/// A type that travels on the bus or sits in the registry.
pub trait Message: Serialize + DeserializeOwned {
    /// Named in errors and logs.
    const NAME: &'static str;
    /// Format version written with every message; a reader refuses others.
    const VERSION: u16;

    /// The message as `[VERSION, body]` msgpack.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        // Writing to a Vec cannot fail.
        rmp::encode::write_array_len(&mut out, 2).expect("write to Vec");
        rmp::encode::write_uint(&mut out, u64::from(Self::VERSION)).expect("write to Vec");
        rmp_serde::encode::write(&mut out, self).expect("msgpack encoding of a protocol type");
        out
    }

    /// Reads a message written by [`Message::encode`]. Garbage gives an
    /// error, never a panic.
    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut rest = bytes;
        let envelope = |detail: String| DecodeError::NotAnEnvelope {
            message: Self::NAME,
            detail,
        };
        let len = rmp::decode::read_array_len(&mut rest).map_err(|e| envelope(e.to_string()))?;
        if len != 2 {
            return Err(envelope(format!("array of {len} elements, not 2")));
        }
        let version: u64 = rmp::decode::read_int(&mut rest).map_err(|e| envelope(e.to_string()))?;
        if version != u64::from(Self::VERSION) {
            return Err(DecodeError::UnsupportedVersion {
                message: Self::NAME,
                got: version,
                supported: Self::VERSION,
            });
        }
        let body =
            Self::deserialize(&mut rmp_serde::Deserializer::new(&mut rest)).map_err(|source| {
                DecodeError::Malformed {
                    message: Self::NAME,
                    source,
                }
            })?;
        if !rest.is_empty() {
            return Err(DecodeError::TrailingBytes {
                message: Self::NAME,
                extra: rest.len(),
            });
        }
        Ok(body)
    }
}

/// Why bytes are not a message.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("{message}: not a [version, body] msgpack envelope: {detail}")]
    NotAnEnvelope {
        message: &'static str,
        detail: String,
    },
    #[error(
        "{message}: format version {got} is not supported (this build reads version {supported})"
    )]
    UnsupportedVersion {
        message: &'static str,
        got: u64,
        supported: u16,
    },
    #[error("{message}: malformed body: {source}")]
    Malformed {
        message: &'static str,
        #[source]
        source: rmp_serde::decode::Error,
    },
    #[error("{message}: {extra} bytes after the end of the message")]
    TrailingBytes { message: &'static str, extra: usize },
}

macro_rules! message {
    ($($ty:ty => $name:literal, version $version:literal;)*) => {
        $(impl Message for $ty {
            const NAME: &'static str = $name;
            const VERSION: u16 = $version;
        })*
    };
}

message! {
    KvEventBatch => "KvEventBatch", version 1;
    LoadReport => "LoadReport", version 1;
    WorkerRecord => "WorkerRecord", version 1;
    RouteDecision => "RouteDecision", version 1;
    IndexDelta => "IndexDelta", version 1;
    IndexSnapshot => "IndexSnapshot", version 1;
    GenerateRequest => "GenerateRequest", version 2;
    GenerateChunk => "GenerateChunk", version 2;
    RequestFragment => "RequestFragment", version 1;
    CancelRequest => "CancelRequest", version 1;
    ResyncReply => "ResyncReply", version 1;
    OverlapQuery => "OverlapQuery", version 1;
    OverlapReply => "OverlapReply", version 1;
    RequestProgress => "RequestProgress", version 1;
    IndexStatus => "IndexStatus", version 1;
    RouterHeartbeat => "RouterHeartbeat", version 1;
    LegProbe => "LegProbe", version 1;
    LegProbeReply => "LegProbeReply", version 1;
    KvHandleQuery => "KvHandleQuery", version 2;
    KvHandleReply => "KvHandleReply", version 1;
}
