//! The engines' KV-event wire format, decoded. Pure: bytes in, values out;
//! malformed input is a typed error, never a panic.
//!
//! - ZMQ frames: live messages `[topic, seq, payload]`; replay replies with
//!   or without the topic frame (and the DEALER's empty delimiter), ending
//!   with the marker whose seq is -1 ([`parse_live`], [`parse_replay`]).
//! - The payload: a msgpack `KVEventBatch`, as a positional array
//!   `[ts, events, data_parallel_rank?]` (vLLM releases, SGLang's
//!   `[ts, events, attn_dp_rank]`) or a map `{ts, events,
//!   data_parallel_rank}` ([`decode_batch`]).
//! - Each event: a tagged array `[tag, field, ...]` (trailing defaults
//!   omitted) or a tagged map `{"type": tag, field: value, ...}` (defaults
//!   omitted, unknown keys ignored). Tags: `BlockStored`, `BlockRemoved`,
//!   `AllBlocksCleared`; an unknown tag is skipped.
//! - Block hashes: msgpack uint64 (vLLM), int64 (SGLang) or bytes.

use std::fmt;

use rmpv::Value;

/// Most nesting accepted in a payload (a batch is 4 deep; extra keys add a
/// few levels).
const MAX_DEPTH: usize = 32;

/// An engine's own name for a block. Engine-private: it cannot be
/// recomputed outside the engine, only mapped (see [`super::translate`]).
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum EngineHash {
    /// An integer hash: vLLM's unsigned 64 bits, or SGLang's signed i64
    /// kept as its 64-bit pattern (an engine uses one form only).
    Int(u64),
    /// A hash published as bytes (e.g. a full digest).
    Bytes(Box<[u8]>),
}

impl fmt::Debug for EngineHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineHash::Int(v) => write!(f, "{v:#018x}"),
            EngineHash::Bytes(b) => {
                f.write_str("0x")?;
                for byte in b.iter() {
                    write!(f, "{byte:02x}")?;
                }
                Ok(())
            }
        }
    }
}

impl fmt::Display for EngineHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// One decoded `BlockStored`.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// The engine's chained hashes, oldest first.
    pub block_hashes: Vec<EngineHash>,
    /// The engine hash of the block before the first; `None` at the root.
    pub parent: Option<EngineHash>,
    /// The tokens of every block of the event, in order.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// One entry per block (multimodal ids, cache salt...), re-encoded as
    /// msgpack so that they can seed a block's own hash; `None` when the
    /// field is absent or every entry is nil.
    pub extra_keys: Option<Vec<Option<Vec<u8>>>>,
    /// SGLang's per-event cache salt (map form), if any.
    pub cache_salt: Option<String>,
    pub group_idx: Option<i64>,
    /// The KV-cache group's kind, e.g. `full_attention`.
    pub kv_cache_spec_kind: Option<String>,
}

/// One decoded event.
#[derive(Debug, Clone, PartialEq)]
pub enum WireEvent {
    Stored(BlockStored),
    Removed {
        block_hashes: Vec<EngineHash>,
        medium: Option<String>,
        group_idx: Option<i64>,
    },
    AllCleared,
}

/// A decoded batch: the events that decoded, and what was skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct WireBatch {
    /// Engine timestamp, epoch seconds.
    pub ts: Option<f64>,
    pub events: Vec<WireEvent>,
    /// The publisher's data-parallel rank, when it says.
    pub dp_rank: Option<i64>,
    /// Events that did not decode (each skipped), with why.
    pub skipped: Vec<WireError>,
}

/// Why bytes are not what they should be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("{0} trailing bytes after the batch")]
    Trailing(usize),
    #[error("the batch is neither an array [ts, events, rank?] nor a map with `events`")]
    BatchShape,
    #[error("an event is neither a tagged array nor a map with `type`")]
    EventShape,
    #[error("unknown event type {0:?}")]
    UnknownTag(String),
    #[error("{event}: field `{field}` is missing or has the wrong type")]
    Field {
        event: &'static str,
        field: &'static str,
    },
    #[error("BlockStored: token id {0} is not a u32")]
    TokenId(i128),
    #[error("BlockStored: block size {0} is not a positive u32")]
    BlockSize(i128),
    #[error("expected {expected} frames, got {got}")]
    Frames { expected: &'static str, got: usize },
    #[error("sequence frame of {0} bytes (expected 8)")]
    SeqFrame(usize),
    #[error("a replay batch with an empty payload")]
    EmptyReplayPayload,
}

impl WireError {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            WireError::Msgpack(_) | WireError::Trailing(_) => "msgpack",
            WireError::BatchShape => "batch_shape",
            WireError::EventShape => "event_shape",
            WireError::UnknownTag(_) => "unknown_event",
            WireError::Field { .. } | WireError::TokenId(_) | WireError::BlockSize(_) => "field",
            WireError::Frames { .. } | WireError::SeqFrame(_) | WireError::EmptyReplayPayload => {
                "frames"
            }
        }
    }
}

/// Decodes one batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<WireBatch, WireError> {
    let mut rd = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| WireError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(WireError::Trailing(rd.len()));
    }
    let (ts, events, rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(entries) => (
            map_get(entries, "ts"),
            map_get(entries, "events"),
            map_get(entries, "data_parallel_rank").or_else(|| map_get(entries, "attn_dp_rank")),
        ),
        _ => return Err(WireError::BatchShape),
    };
    let events = events
        .and_then(Value::as_array)
        .ok_or(WireError::BatchShape)?;
    let mut batch = WireBatch {
        ts: ts.and_then(Value::as_f64),
        events: Vec::with_capacity(events.len()),
        dp_rank: rank.and_then(Value::as_i64),
        skipped: Vec::new(),
    };
    for event in events {
        match decode_event(event) {
            Ok(e) => batch.events.push(e),
            Err(e) => batch.skipped.push(e),
        }
    }
    Ok(batch)
}

fn map_get<'a>(entries: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    entries
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// An event's fields by name, whatever its encoding: positional (by the
/// field order of the class) or by key.
enum Fields<'a> {
    Array(&'a [Value]),
    Map(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    /// Field `name` at position `index` (0 = the first field after the
    /// tag); `None` when absent (omitted default) or nil.
    fn get(&self, index: usize, name: &str) -> Option<&'a Value> {
        let v = match self {
            Fields::Array(items) => items.get(index),
            Fields::Map(entries) => map_get(entries, name),
        };
        v.filter(|v| !v.is_nil())
    }
}

const STORED_FIELDS: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];

fn decode_event(event: &Value) -> Result<WireEvent, WireError> {
    let (tag, fields) = match event {
        Value::Array(items) => {
            let tag = items
                .first()
                .and_then(Value::as_str)
                .ok_or(WireError::EventShape)?;
            (tag, Fields::Array(&items[1..]))
        }
        Value::Map(entries) => {
            let tag = map_get(entries, "type")
                .and_then(Value::as_str)
                .ok_or(WireError::EventShape)?;
            (tag, Fields::Map(entries))
        }
        _ => return Err(WireError::EventShape),
    };
    match tag {
        "BlockStored" => decode_stored(&fields).map(WireEvent::Stored),
        "BlockRemoved" => {
            const E: &str = "BlockRemoved";
            let block_hashes = hashes(fields.get(0, "block_hashes"), E, "block_hashes")?;
            Ok(WireEvent::Removed {
                block_hashes,
                medium: opt_str(fields.get(1, "medium"), E, "medium")?,
                group_idx: opt_int(fields.get(2, "group_idx"), E, "group_idx")?,
            })
        }
        "AllBlocksCleared" => Ok(WireEvent::AllCleared),
        other => Err(WireError::UnknownTag(other.chars().take(64).collect())),
    }
}

fn decode_stored(fields: &Fields<'_>) -> Result<BlockStored, WireError> {
    const E: &str = "BlockStored";
    let f = |i: usize| fields.get(i, STORED_FIELDS[i]);
    let block_hashes = hashes(f(0), E, "block_hashes")?;
    let parent = match f(1) {
        None => None,
        Some(v) => Some(hash(v).ok_or(WireError::Field {
            event: E,
            field: "parent_block_hash",
        })?),
    };
    let token_ids = f(2)
        .and_then(Value::as_array)
        .ok_or(WireError::Field {
            event: E,
            field: "token_ids",
        })?
        .iter()
        .map(|t| match t {
            Value::Integer(i) => {
                let wide = i.as_i64().map(i128::from).or(i.as_u64().map(i128::from));
                match wide {
                    Some(w) => u32::try_from(w).map_err(|_| WireError::TokenId(w)),
                    None => Err(WireError::Field {
                        event: E,
                        field: "token_ids",
                    }),
                }
            }
            _ => Err(WireError::Field {
                event: E,
                field: "token_ids",
            }),
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let block_size = match f(3) {
        Some(Value::Integer(i)) => {
            let wide = i
                .as_i64()
                .map(i128::from)
                .or(i.as_u64().map(i128::from))
                .unwrap_or(0);
            match u32::try_from(wide) {
                Ok(b) if b > 0 => b,
                _ => return Err(WireError::BlockSize(wide)),
            }
        }
        _ => {
            return Err(WireError::Field {
                event: E,
                field: "block_size",
            })
        }
    };
    let extra_keys = match f(7) {
        None => None,
        Some(Value::Array(per_block)) => {
            let keys: Vec<Option<Vec<u8>>> = per_block
                .iter()
                .map(|k| {
                    (!k.is_nil()).then(|| {
                        let mut buf = Vec::new();
                        // Writing to a Vec cannot fail.
                        let _ = rmpv::encode::write_value(&mut buf, k);
                        buf
                    })
                })
                .collect();
            keys.iter().any(Option::is_some).then_some(keys)
        }
        Some(_) => {
            return Err(WireError::Field {
                event: E,
                field: "extra_keys",
            })
        }
    };
    let cache_salt = match fields {
        Fields::Map(entries) => opt_str(
            map_get(entries, "cache_salt").filter(|v| !v.is_nil()),
            E,
            "cache_salt",
        )?,
        Fields::Array(_) => None,
    };
    Ok(BlockStored {
        block_hashes,
        parent,
        token_ids,
        block_size,
        medium: opt_str(f(5), E, "medium")?,
        lora_name: opt_str(f(6), E, "lora_name")?,
        extra_keys,
        cache_salt,
        group_idx: opt_int(f(8), E, "group_idx")?,
        kv_cache_spec_kind: opt_str(f(9), E, "kv_cache_spec_kind")?,
    })
}

fn hash(v: &Value) -> Option<EngineHash> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|s| s as u64))
            .map(EngineHash::Int),
        Value::Binary(b) => Some(EngineHash::Bytes(b.clone().into_boxed_slice())),
        _ => None,
    }
}

fn hashes(
    v: Option<&Value>,
    event: &'static str,
    field: &'static str,
) -> Result<Vec<EngineHash>, WireError> {
    v.and_then(Value::as_array)
        .ok_or(WireError::Field { event, field })?
        .iter()
        .map(|h| hash(h).ok_or(WireError::Field { event, field }))
        .collect()
}

fn opt_str(
    v: Option<&Value>,
    event: &'static str,
    field: &'static str,
) -> Result<Option<String>, WireError> {
    match v {
        None => Ok(None),
        Some(v) => v
            .as_str()
            .map(|s| Some(s.to_owned()))
            .ok_or(WireError::Field { event, field }),
    }
}

fn opt_int(
    v: Option<&Value>,
    event: &'static str,
    field: &'static str,
) -> Result<Option<i64>, WireError> {
    match v {
        None => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or(WireError::Field { event, field }),
    }
}

/// The sequence number of the replay end marker, -1 as 8 bytes.
pub const END_SEQ: [u8; 8] = [0xff; 8];

fn seq_of(frame: &[u8]) -> Result<u64, WireError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| WireError::SeqFrame(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// A live message `[topic, seq, payload]`: its topic, seq and payload.
pub fn parse_live<F: AsRef<[u8]>>(frames: &[F]) -> Result<(&[u8], u64, &[u8]), WireError> {
    match frames {
        [topic, seq, payload] => Ok((topic.as_ref(), seq_of(seq.as_ref())?, payload.as_ref())),
        _ => Err(WireError::Frames {
            expected: "3 ([topic, seq, payload])",
            got: frames.len(),
        }),
    }
}

/// One reply on the replay socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayFrame<'a> {
    Batch { seq: u64, payload: &'a [u8] },
    End,
}

/// A replay reply as a DEALER receives it: an optional empty delimiter,
/// then `[topic, seq, payload]` (newer engines) or `[seq, payload]`; the
/// end marker has seq -1 and an empty payload.
pub fn parse_replay<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayFrame<'_>, WireError> {
    let mut rest = frames;
    if rest.len() >= 3 && rest[0].as_ref().is_empty() {
        rest = &rest[1..];
    }
    let (seq, payload) = match rest {
        [_, seq, payload] | [seq, payload] => (seq.as_ref(), payload.as_ref()),
        _ => {
            return Err(WireError::Frames {
                expected: "2 or 3 ([topic?, seq, payload])",
                got: frames.len(),
            })
        }
    };
    if seq == END_SEQ {
        return Ok(ReplayFrame::End);
    }
    let seq = seq_of(seq)?;
    if payload.is_empty() {
        return Err(WireError::EmptyReplayPayload);
    }
    Ok(ReplayFrame::Batch { seq, payload })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rmpv::Value as V;

    use super::*;

    fn enc(v: &V) -> Vec<u8> {
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, v).unwrap();
        buf
    }

    fn s(x: &str) -> V {
        V::from(x)
    }

    fn ints(xs: &[u64]) -> V {
        V::Array(xs.iter().map(|&x| V::from(x)).collect())
    }

    fn stored_array(hashes: V, parent: V, tokens: &[u64], block_size: u64) -> V {
        V::Array(vec![
            s("BlockStored"),
            hashes,
            parent,
            ints(tokens),
            V::from(block_size),
            V::Nil,
            s("GPU"),
        ])
    }

    #[test]
    fn array_batches_with_array_events() {
        let big = u64::MAX - 5; // does not fit an i64
        let batch = V::Array(vec![
            V::F64(1.5),
            V::Array(vec![
                stored_array(ints(&[big, 7]), V::Nil, &[1, 2, 3, 4], 2),
                V::Array(vec![s("BlockRemoved"), ints(&[7])]),
                V::Array(vec![s("AllBlocksCleared")]),
            ]),
        ]);
        let b = decode_batch(&enc(&batch)).unwrap();
        assert_eq!(b.ts, Some(1.5));
        assert_eq!(b.dp_rank, None);
        assert!(b.skipped.is_empty());
        let WireEvent::Stored(stored) = &b.events[0] else {
            panic!("{:?}", b.events[0]);
        };
        assert_eq!(
            stored.block_hashes,
            vec![EngineHash::Int(big), EngineHash::Int(7)]
        );
        assert_eq!(stored.parent, None);
        assert_eq!(stored.token_ids, vec![1, 2, 3, 4]);
        assert_eq!(stored.block_size, 2);
        assert_eq!(stored.medium.as_deref(), Some("GPU"));
        assert_eq!(stored.lora_name, None, "omitted trailing field");
        assert_eq!(
            b.events[1],
            WireEvent::Removed {
                block_hashes: vec![EngineHash::Int(7)],
                medium: None,
                group_idx: None
            }
        );
        assert_eq!(b.events[2], WireEvent::AllCleared);
    }

    #[test]
    fn map_batches_with_map_events_and_unknown_keys() {
        let event = V::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), V::Array(vec![V::from(-5i64)])),
            (s("parent_block_hash"), V::Binary(vec![1, 2, 3])),
            (s("token_ids"), ints(&[9, 9])),
            (s("block_size"), V::from(2)),
            (s("lora_id"), V::Nil),
            (s("medium"), s("CPU_PINNED")),
            (s("lora_name"), V::Nil),
            (s("cache_salt"), s("tenant-a")),
            (s("session_id"), s("whatever")),
            (s("something_new"), V::Map(vec![])),
        ]);
        let batch = V::Map(vec![
            (s("ts"), V::F64(2.0)),
            (s("events"), V::Array(vec![event])),
            (s("data_parallel_rank"), V::from(3)),
            (s("future_field"), V::Boolean(true)),
        ]);
        let b = decode_batch(&enc(&batch)).unwrap();
        assert_eq!(b.dp_rank, Some(3));
        let WireEvent::Stored(stored) = &b.events[0] else {
            panic!();
        };
        assert_eq!(stored.block_hashes, vec![EngineHash::Int((-5i64) as u64)]);
        assert_eq!(
            stored.parent,
            Some(EngineHash::Bytes(vec![1, 2, 3].into_boxed_slice()))
        );
        assert_eq!(stored.cache_salt.as_deref(), Some("tenant-a"));
        assert_eq!(stored.medium.as_deref(), Some("CPU_PINNED"));
    }

    #[test]
    fn sglang_envelope_and_extra_keys() {
        let batch = V::Array(vec![
            V::F64(0.0),
            V::Array(vec![V::Array(vec![
                s("BlockStored"),
                ints(&[1, 2]),
                V::Nil,
                ints(&[1, 2]),
                V::from(1),
                V::Nil,
                V::Nil,
                V::Nil,
                V::Array(vec![V::Nil, V::Array(vec![s("mm-hash")])]),
            ])]),
            V::from(1),
        ]);
        let b = decode_batch(&enc(&batch)).unwrap();
        assert_eq!(b.dp_rank, Some(1));
        let WireEvent::Stored(stored) = &b.events[0] else {
            panic!();
        };
        let keys = stored.extra_keys.as_ref().unwrap();
        assert_eq!(keys.len(), 2);
        assert!(keys[0].is_none() && keys[1].is_some());
    }

    #[test]
    fn bad_events_are_skipped_and_bad_batches_refused() {
        let batch = V::Array(vec![
            V::F64(0.0),
            V::Array(vec![
                V::Array(vec![s("BlockSwapped"), ints(&[1])]),
                V::Array(vec![s("BlockStored"), ints(&[1]), V::Nil, ints(&[1])]),
                V::Array(vec![
                    s("BlockStored"),
                    ints(&[1]),
                    V::Nil,
                    V::Array(vec![V::from(-1)]),
                    V::from(1),
                ]),
                V::from(3),
                V::Array(vec![s("AllBlocksCleared")]),
            ]),
        ]);
        let b = decode_batch(&enc(&batch)).unwrap();
        assert_eq!(b.events, vec![WireEvent::AllCleared]);
        assert_eq!(
            b.skipped,
            vec![
                WireError::UnknownTag("BlockSwapped".into()),
                WireError::Field {
                    event: "BlockStored",
                    field: "block_size"
                },
                WireError::TokenId(-1),
                WireError::EventShape,
            ]
        );
        assert_eq!(decode_batch(&enc(&V::from(3))), Err(WireError::BatchShape));
        assert_eq!(
            decode_batch(&enc(&V::Array(vec![V::F64(0.0)]))),
            Err(WireError::BatchShape)
        );
        let mut bytes = enc(&V::Array(vec![V::F64(0.0), V::Array(vec![])]));
        bytes.push(0);
        assert_eq!(decode_batch(&bytes), Err(WireError::Trailing(1)));
        assert!(matches!(
            decode_batch(b"\xdd\xff\xff\xff\xff"),
            Err(WireError::Msgpack(_))
        ));
        assert!(matches!(decode_batch(b""), Err(WireError::Msgpack(_))));
    }

    #[test]
    fn frames() {
        let seq = 7u64.to_be_bytes();
        assert_eq!(
            parse_live(&[&b"t"[..], &seq, b"p"]).unwrap(),
            (&b"t"[..], 7, &b"p"[..])
        );
        assert!(parse_live(&[&seq[..], b"p"]).is_err());
        assert_eq!(
            parse_live(&[&b"t"[..], b"\x01", b"p"]),
            Err(WireError::SeqFrame(1))
        );
        // Replies: with delimiter and topic, with delimiter only, bare.
        for frames in [
            vec![&b""[..], b"topic", &seq, b"p"],
            vec![&b""[..], b"", &seq, b"p"],
            vec![&b""[..], &seq, b"p"],
            vec![&seq[..], b"p"],
        ] {
            assert_eq!(
                parse_replay(&frames).unwrap(),
                ReplayFrame::Batch {
                    seq: 7,
                    payload: b"p"
                },
                "{frames:?}"
            );
        }
        assert_eq!(
            parse_replay(&[&b""[..], &END_SEQ, b""]).unwrap(),
            ReplayFrame::End
        );
        assert_eq!(
            parse_replay(&[&b""[..], b"topic", &END_SEQ, b""]).unwrap(),
            ReplayFrame::End
        );
        assert!(parse_replay(&[&b"x"[..]]).is_err());
        assert_eq!(
            parse_replay(&[&seq[..], b""]),
            Err(WireError::EmptyReplayPayload)
        );
    }

    proptest! {
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_batch(&bytes);
            let frames: Vec<&[u8]> = bytes.chunks(7).collect();
            let _ = parse_live(&frames);
            let _ = parse_replay(&frames);
        }

        #[test]
        fn mutated_batches_never_panic(
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
            cut in any::<usize>(),
        ) {
            let batch = V::Array(vec![
                V::F64(1.0),
                V::Array(vec![
                    stored_array(ints(&[u64::MAX, 3]), V::from(1u64), &[1, 2, 3, 4], 2),
                    V::Map(vec![(s("type"), s("BlockRemoved")), (s("block_hashes"), ints(&[3]))]),
                ]),
                V::from(0),
            ]);
            let mut bytes = enc(&batch);
            for (at, byte) in flips {
                let n = bytes.len();
                bytes[at % n] = byte;
            }
            let n = bytes.len();
            bytes.truncate(cut % (n + 1));
            let _ = decode_batch(&bytes);
        }
    }
}
