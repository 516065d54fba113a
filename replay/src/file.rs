//! The export file: one incident window, taken off the cluster to be
//! examined anywhere.
//!
//! Layout: the magic line `SWITCHYARD-EXPORT v3\n`, then frames of
//! `[kind: u8][length: u32 LE][checksum: u64 LE][payload]`, each payload
//! one protocol message in its wire encoding, and last an end frame holding
//! the number of frames before it (so that a file cut at a frame boundary
//! is still caught). The checksum (xxh3-64 of the payload) catches changed
//! bytes that would still decode, such as a block hash. A reader reports a
//! truncated or corrupt file with the byte offset of the frame at fault.

use protocol::{
    BlockHash, DecisionContext, DecisionRecord, DecodeError, IndexDelta, IndexSnapshot,
    IndexStatus, KvEventBatch, LogReader, LoggedDecision, Message, PackedHashes, PromptRecord,
    ResolveError,
};
use xxhash_rust::xxh3::xxh3_64;

pub const MAGIC: &[u8] = b"SWITCHYARD-EXPORT v3\n";

/// Kind, length and checksum.
const HEADER: usize = 1 + 4 + 8;

/// Everything an export holds, in file order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Export {
    /// The index before the window (absent when the deltas start at 1).
    pub snapshot: Option<IndexSnapshot>,
    /// Deltas after the snapshot, in sequence.
    pub deltas: Vec<IndexDelta>,
    /// The workers' KV batches during the window, in stream order.
    pub kv_batches: Vec<KvEventBatch>,
    /// The decision contexts the window's decisions name.
    pub contexts: Vec<DecisionContext>,
    /// Prompts logged before the window that its decisions begin with.
    pub prompts: Vec<Vec<BlockHash>>,
    /// The decision log in the window, in log order, as logged (each
    /// repeated part by reference: [`Export::records`] resolves them).
    pub decisions: Vec<LoggedDecision>,
    /// The live indexer's position and digest when the export was taken
    /// (the deltas run up to it).
    pub checkpoint: Option<IndexStatus>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Snapshot = 1,
    Delta = 2,
    KvBatch = 3,
    Decision = 4,
    Checkpoint = 5,
    Context = 6,
    Prompt = 7,
    End = 0xff,
}

/// Why bytes are not an export.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("not a Switchyard export (the file does not start with {:?})", String::from_utf8_lossy(MAGIC).trim_end())]
    BadMagic,
    #[error("truncated at byte {offset}: {what}")]
    Truncated { offset: usize, what: &'static str },
    #[error("byte {offset}: the frame's checksum does not match its bytes (the file is corrupt)")]
    Checksum { offset: usize },
    #[error("byte {offset}: unknown frame kind {kind}")]
    UnknownKind { offset: usize, kind: u8 },
    #[error("byte {offset}: corrupt {kind} frame: {source}")]
    Corrupt {
        offset: usize,
        kind: &'static str,
        #[source]
        source: DecodeError,
    },
    #[error("byte {offset}: a second snapshot or checkpoint")]
    Duplicate { offset: usize },
    #[error("byte {offset}: the end frame counts {expected} frames, the file has {found}")]
    Count {
        offset: usize,
        expected: u32,
        found: u32,
    },
    #[error("byte {offset}: data after the end frame")]
    AfterEnd { offset: usize },
}

fn frame(out: &mut Vec<u8>, kind: Kind, payload: &[u8]) {
    raw_frame(out, kind as u8, payload);
}

/// Writes one frame with any kind byte and its checksum: the fuzzers build
/// files of arbitrary frames this way, so that they reach the payloads'
/// decoders past the checksum.
#[doc(hidden)]
pub fn raw_frame(out: &mut Vec<u8>, kind: u8, payload: &[u8]) {
    out.push(kind);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&xxh3_64(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

impl Export {
    /// The window's decisions read back into records, in log order; one
    /// whose context or prompt prefix the export does not carry is an error
    /// naming what is missing.
    pub fn records(&self) -> Vec<Result<DecisionRecord, ResolveError>> {
        let mut reader = LogReader::new();
        for context in &self.contexts {
            reader.add_context(context.id(), context.clone());
        }
        for prompt in &self.prompts {
            reader.add_prompt(prompt.clone().into());
        }
        self.decisions.iter().map(|d| reader.decision(d)).collect()
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        if let Some(s) = &self.snapshot {
            frame(&mut out, Kind::Snapshot, &s.encode());
        }
        for d in &self.deltas {
            frame(&mut out, Kind::Delta, &d.encode());
        }
        for b in &self.kv_batches {
            frame(&mut out, Kind::KvBatch, &b.encode());
        }
        for c in &self.contexts {
            frame(&mut out, Kind::Context, &c.encode());
        }
        for p in &self.prompts {
            let record = PromptRecord {
                blocks: PackedHashes(p.clone()),
            };
            frame(&mut out, Kind::Prompt, &record.encode());
        }
        for r in &self.decisions {
            frame(&mut out, Kind::Decision, &r.encode());
        }
        if let Some(c) = &self.checkpoint {
            frame(&mut out, Kind::Checkpoint, &c.encode());
        }
        let frames = self.deltas.len()
            + self.kv_batches.len()
            + self.contexts.len()
            + self.prompts.len()
            + self.decisions.len()
            + usize::from(self.snapshot.is_some())
            + usize::from(self.checkpoint.is_some());
        frame(&mut out, Kind::End, &(frames as u32).to_le_bytes());
        out
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ExportError> {
        let mut export = Export::default();
        let mut at = bytes.strip_prefix(MAGIC).ok_or(ExportError::BadMagic)?;
        let mut offset = MAGIC.len();
        let mut frames = 0u32;
        loop {
            if at.is_empty() {
                return Err(ExportError::Truncated {
                    offset,
                    what: "the end frame (the file was cut short)",
                });
            }
            let truncated = |what| ExportError::Truncated { offset, what };
            let (&kind, rest) = at.split_first().ok_or(truncated("frame kind"))?;
            let len_bytes: [u8; 4] = rest
                .get(..4)
                .ok_or(truncated("frame length"))?
                .try_into()
                .expect("4 bytes");
            let len = u32::from_le_bytes(len_bytes) as usize;
            let checksum: [u8; 8] = rest
                .get(4..12)
                .ok_or(truncated("frame checksum"))?
                .try_into()
                .expect("8 bytes");
            let payload = rest
                .get(HEADER - 1..HEADER - 1 + len)
                .ok_or(truncated("frame payload"))?;
            if xxh3_64(payload) != u64::from_le_bytes(checksum) {
                return Err(ExportError::Checksum { offset });
            }
            macro_rules! decode {
                ($ty:ty, $name:literal) => {
                    <$ty>::decode(payload).map_err(|source| ExportError::Corrupt {
                        offset,
                        kind: $name,
                        source,
                    })?
                };
            }
            match kind {
                k if k == Kind::Snapshot as u8 => {
                    if export.snapshot.is_some() {
                        return Err(ExportError::Duplicate { offset });
                    }
                    export.snapshot = Some(decode!(IndexSnapshot, "snapshot"));
                }
                k if k == Kind::Delta as u8 => export.deltas.push(decode!(IndexDelta, "delta")),
                k if k == Kind::KvBatch as u8 => {
                    export.kv_batches.push(decode!(KvEventBatch, "KV batch"))
                }
                k if k == Kind::Decision as u8 => {
                    export.decisions.push(decode!(LoggedDecision, "decision"))
                }
                k if k == Kind::Context as u8 => {
                    export.contexts.push(decode!(DecisionContext, "context"))
                }
                k if k == Kind::Prompt as u8 => export
                    .prompts
                    .push(decode!(PromptRecord, "prompt").blocks.0),
                k if k == Kind::Checkpoint as u8 => {
                    if export.checkpoint.is_some() {
                        return Err(ExportError::Duplicate { offset });
                    }
                    export.checkpoint = Some(decode!(IndexStatus, "checkpoint"));
                }
                k if k == Kind::End as u8 => {
                    let count: [u8; 4] =
                        payload.try_into().map_err(|_| ExportError::Truncated {
                            offset,
                            what: "the end frame's count",
                        })?;
                    let expected = u32::from_le_bytes(count);
                    if expected != frames {
                        return Err(ExportError::Count {
                            offset,
                            expected,
                            found: frames,
                        });
                    }
                    if rest.len() > HEADER - 1 + len {
                        return Err(ExportError::AfterEnd {
                            offset: offset + HEADER + len,
                        });
                    }
                    return Ok(export);
                }
                other => {
                    return Err(ExportError::UnknownKind {
                        offset,
                        kind: other,
                    })
                }
            }
            frames += 1;
            at = &rest[HEADER - 1 + len..];
            offset += HEADER + len;
        }
    }
}

#[cfg(test)]
mod tests {
    use protocol::{BlockHash, IndexChange, Tier, WorkerId};

    use super::*;

    fn sample() -> Export {
        let worker = WorkerId::new("d0", 0).unwrap();
        Export {
            snapshot: None,
            deltas: (1..=3)
                .map(|seq| IndexDelta {
                    seq,
                    changes: vec![IndexChange::Stored {
                        worker: worker.clone(),
                        parent: None,
                        blocks: vec![BlockHash(seq)],
                        tier: Tier::Device,
                    }],
                    source: None,
                })
                .collect(),
            kv_batches: vec![KvEventBatch {
                worker,
                epoch: 1,
                seq: 0,
                events: vec![protocol::KvEvent::Cleared],
            }],
            contexts: Vec::new(),
            prompts: vec![vec![BlockHash(1), BlockHash(2)]],
            decisions: Vec::new(),
            checkpoint: Some(IndexStatus {
                delta_seq: 3,
                digest: 9,
                blocks: 3,
                pairs: 3,
            }),
        }
    }

    #[test]
    fn round_trips() {
        assert_eq!(Export::from_bytes(&sample().to_bytes()).unwrap(), sample());
    }

    /// A decision whose context or earlier prompt the export lacks reads
    /// back as an error naming it; with them it reads back whole.
    #[test]
    fn missing_references_are_named() {
        use protocol::{
            CandidateInput, CandidateLoad, DecisionId, DecisionInputs, LogWriter, Path, Role,
            RouteDecision,
        };
        let worker = WorkerId::new("d0", 0).unwrap();
        let record = |id: u64, blocks: u64| DecisionRecord {
            decision: RouteDecision {
                id: DecisionId(id),
                request_id: format!("r{id}"),
                path: Path::Bypass,
                decode: worker.clone(),
                prefill: None,
                isl_tokens: 16 * blocks as u32,
                decode_overlap_tokens: 0,
                prefill_overlap_tokens: 0,
                reserved_decode_blocks: blocks,
                reserved_prefill_tokens: 0,
                policy: "never_disagg".into(),
                rule: "never.bypass".into(),
                reason: String::new(),
                at_ms: id,
                fetch: None,
            },
            inputs: DecisionInputs {
                block_hashes: (0..blocks).map(BlockHash).collect(),
                block_size: 16,
                expected_output_tokens: 1,
                delta_seq: 0,
                seed: 0,
                avoid: Vec::new(),
                policy_params: Vec::new(),
                router_params: Vec::new(),
                calibration: Vec::new(),
                candidates: vec![CandidateInput {
                    worker: worker.clone(),
                    role: Role::Decode,
                    kv_capacity_blocks: 100,
                    max_batched_tokens: 64,
                    kv_bytes_per_token: 1,
                    depth: [0; 3],
                    load: CandidateLoad::default(),
                    capabilities: Default::default(),
                }],
                session: None,
            },
        };
        let mut writer = LogWriter::default();
        let first = writer.write(&record(1, 4), 0);
        let second = writer.write(&record(2, 6), 0);
        let (protocol::LogEntry::Context { context, .. }, protocol::LogEntry::Decision(later)) =
            (first[0].clone(), second[0].clone())
        else {
            panic!("a context, then a decision: {first:?} {second:?}");
        };
        let mut window = Export {
            decisions: vec![later],
            ..Export::default()
        };
        let error = window.records().remove(0).unwrap_err();
        assert!(error.to_string().contains("names context"), "{error}");
        window.contexts.push(context);
        let error = window.records().remove(0).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("begins with the 4 blocks ending in"),
            "{error}"
        );
        window.prompts.push((0..4).map(BlockHash).collect());
        let window = Export::from_bytes(&window.to_bytes()).unwrap();
        assert_eq!(window.records().remove(0).unwrap(), record(2, 6));
    }

    #[test]
    fn every_truncation_names_its_offset() {
        let bytes = sample().to_bytes();
        for cut in MAGIC.len() + 1..bytes.len() {
            let error = Export::from_bytes(&bytes[..cut]).unwrap_err();
            match error {
                ExportError::Truncated { offset, .. }
                | ExportError::Corrupt { offset, .. }
                | ExportError::Checksum { offset } => {
                    assert!(offset >= MAGIC.len() && offset <= cut, "cut {cut}: {error}")
                }
                other => panic!("cut {cut}: {other}"),
            }
        }
        assert!(matches!(
            Export::from_bytes(&bytes[..5]),
            Err(ExportError::BadMagic)
        ));
    }

    #[test]
    fn corrupt_frames_name_their_offset() {
        let bytes = sample().to_bytes();
        let first = MAGIC.len();
        let len = u32::from_le_bytes(bytes[first + 1..first + 5].try_into().unwrap()) as usize;
        let second = first + HEADER + len;
        // Any changed payload byte, whether or not it would still decode.
        for at in second + HEADER..second + HEADER + 4 {
            let mut corrupt = bytes.clone();
            corrupt[at] ^= 0x01;
            let error = Export::from_bytes(&corrupt).unwrap_err();
            assert!(
                matches!(error, ExportError::Checksum { offset } if offset == second),
                "{error}"
            );
            assert!(error.to_string().starts_with(&format!("byte {second}: ")));
        }
        let mut corrupt = bytes.clone();
        corrupt[second] = 42;
        assert!(matches!(
            Export::from_bytes(&corrupt),
            Err(ExportError::UnknownKind { kind: 42, .. })
        ));
        // A payload with a valid checksum that does not decode.
        let mut forged = bytes[..second].to_vec();
        frame(&mut forged, Kind::Delta, &[0x7f, 1, 2]);
        let error = Export::from_bytes(&forged).unwrap_err();
        assert!(
            matches!(error, ExportError::Corrupt { offset, kind: "delta", .. } if offset == second),
            "{error}"
        );
    }

    proptest::proptest! {
        #[test]
        fn garbage_never_panics(tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let mut bytes = MAGIC.to_vec();
            bytes.extend(tail);
            let _ = Export::from_bytes(&bytes);
        }
    }
}
